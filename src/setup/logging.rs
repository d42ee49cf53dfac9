//! Metric loggers from `metric_logger`.

use std::path::Path;

use super::SetupError;
use crate::config::components::LoggerKind;
use crate::config::schema::MetricLoggerConfig;
use crate::training::metrics::{
    JsonlSink, MetricLoggers, MetricSink, MetricsFile, StdoutSink, TensorBoardSink,
};

/// `None` logs to disk under `<output_dir>/logs`, as torchtune's configs do by default.
/// `file`: a new run's metrics, or a resumed run's continuing the old file.
pub fn loggers(
    cfg: Option<&MetricLoggerConfig>,
    output_dir: &Path,
    file: MetricsFile,
) -> Result<(MetricLoggers, String), SetupError> {
    let kind = cfg.map_or(LoggerKind::Disk, |c| c.component);
    let log_dir = cfg
        .and_then(|c| c.log_dir.clone())
        .unwrap_or_else(|| output_dir.join("logs"));
    let io = |source| SetupError::Io {
        what: "metric_logger.log_dir",
        path: log_dir.clone(),
        source,
    };
    let sink: Box<dyn MetricSink> = match kind {
        LoggerKind::Disk => Box::new(JsonlSink::create(&log_dir, file).map_err(io)?),
        LoggerKind::TensorBoard => Box::new(TensorBoardSink::create(&log_dir).map_err(io)?),
        LoggerKind::Stdout => Box::new(StdoutSink {
            printer: Box::new(|line| println!("{line}")),
        }),
    };
    let mut sinks = vec![sink];
    // metrics.jsonl is always written: `tune plot` and the model card read it.
    if kind != LoggerKind::Disk {
        sinks.push(Box::new(JsonlSink::create(&log_dir, file).map_err(io)?));
    }
    Ok((MetricLoggers { sinks }, log_dir.display().to_string()))
}
