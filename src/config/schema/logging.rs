//! `metric_logger` and `profiler`.

use std::path::PathBuf;

use crate::config::components::{LoggerKind, Profiler};
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{Checker, choice, keys, on, optional};
use crate::config::values::choices;
use crate::verbosity::LogLevel;

// Python's level names, as torchtune's `log_level` takes them.
choices!(LogLevel {
    "DEBUG" => LogLevel::Debug,
    "INFO" => LogLevel::Info,
    "WARN" => LogLevel::Warn,
    "WARNING" => LogLevel::Warn,
    "ERROR" => LogLevel::Error,
    "debug" => LogLevel::Debug,
    "info" => LogLevel::Info,
    "warn" => LogLevel::Warn,
    "warning" => LogLevel::Warn,
    "error" => LogLevel::Error,
});

keys! {
    /// `DiskLogger`'s settings (and those of the tracking services' loggers, WandB, Comet and
    /// MLflow, which write to disk here: their component says so).
    pub struct DiskLoggerKeys {}
    /// The log directory (null: `<output_dir>/logs`).
    log_dir: Option<PathBuf> = optional(),
    /// The metrics file's name in it (null: `metrics.jsonl`).
    filename: Option<String> = optional().rule(a_file_name),
    /// A tracking service's project.
    project: Option<String> = optional().validation_only(
        "there is no tracking service to send to: the metrics go to disk, as the logger's component warns",
    ),
}

keys! {
    /// `StdoutLogger`'s settings: each step's metrics printed, and written to disk too.
    pub struct StdoutLoggerKeys {}
    /// Where `metrics.jsonl` goes besides (null: `<output_dir>/logs`).
    log_dir: Option<PathBuf> = optional(),
}

keys! {
    /// `TensorBoardLogger`'s settings.
    pub struct TensorBoardLoggerKeys {}
    /// The log directory (null: `<output_dir>/logs`); `metrics.jsonl` is written there too.
    log_dir: Option<PathBuf> = optional(),
    /// The event files go in a subdirectory of their own for this run (`run_0_<unix time>`),
    /// so TensorBoard shows each run apart, as torchtune's logger does.
    organize_logs: bool = on(),
}

choice! {
    /// Where metrics go: metrics.jsonl (DiskLogger), the console or TensorBoard event files.
    pub struct MetricLoggerConfig {
        section: "metric_logger",
        component: LoggerKind,
        settings: MetricLoggerSettings,
    }
    "tune.metric_logging.DiskLogger": LoggerKind::Disk => Disk(DiskLoggerKeys),
    "tune.metric_logging.StdoutLogger": LoggerKind::Stdout => Stdout(StdoutLoggerKeys),
    "tune.metric_logging.TensorBoardLogger":
        LoggerKind::TensorBoard => TensorBoard(TensorBoardLoggerKeys),
}

impl MetricLoggerConfig {
    /// The log directory it names.
    pub fn log_dir(&self) -> Option<&PathBuf> {
        match &self.settings {
            MetricLoggerSettings::Disk(k) => k.log_dir.as_ref(),
            MetricLoggerSettings::Stdout(k) => k.log_dir.as_ref(),
            MetricLoggerSettings::TensorBoard(k) => k.log_dir.as_ref(),
        }
    }
}

/// A file name, not a path: it goes in the log directory.
fn a_file_name(name: &Option<String>, path: &str, cx: &mut Checker) {
    if let Some(name) = name
        && (name.is_empty() || name.contains('/') || name == "." || name == "..")
    {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                path,
                format!("`{name}` is not a file name: the metrics file goes in `log_dir`"),
            )
            .with_fix("e.g. `filename: metrics.jsonl`; set the directory with `log_dir`"),
        );
    }
}

keys! {
    /// torchtune's profiler: accepted so its configs load; no traces are recorded (its other
    /// options are accepted and never read).
    pub struct ProfilerConfig {
        section: "profiler",
        component: Profiler,
        open: true,
    }
    /// Whether to profile: warned about when true, since nothing is recorded.
    enabled: bool = on().warn("the PyTorch profiler is not available; no traces are recorded"),
}
