//! `metric_logger` and `profiler`.

use std::path::PathBuf;

use crate::config::components::{LoggerKind, Profiler};
use crate::config::keys::{keys, off, on, optional};
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
    /// Where metrics go: metrics.jsonl (DiskLogger), the console or TensorBoard event files.
    pub struct MetricLoggerConfig {
        section: "metric_logger",
        component: LoggerKind,
    }
    /// The log directory (default `<output_dir>/logs`).
    log_dir: Option<PathBuf> = optional(),
    /// The metrics file's name (default `metrics.jsonl`).
    filename: Option<String> = optional(),
    /// A tracking service's project: only metrics on disk are written.
    project: Option<String> = optional(),
    /// torchtune's per-run subdirectory of the log directory.
    organize_logs: bool = off(),
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
