//! Metric loggers from `metric_logger`.

use std::path::Path;

use super::SetupError;
use crate::config::schema::{MetricLoggerConfig, MetricLoggerSettings};
use crate::training::metrics::{
    JsonlSink, METRICS_FILE, MetricLoggers, MetricSink, MetricsFile, StdoutSink, TensorBoardSink,
};

/// `None` logs to disk under `<output_dir>/logs`, as torchtune's configs do by default.
/// `file`: a new run's metrics, or a resumed run's continuing the old file. Every logger also
/// writes the metrics file: `tune plot` reads it, and a resumed run continues it.
pub fn loggers(
    cfg: Option<&MetricLoggerConfig>,
    output_dir: &Path,
    file: MetricsFile,
) -> Result<(MetricLoggers, String), SetupError> {
    let log_dir = cfg
        .and_then(MetricLoggerConfig::log_dir)
        .cloned()
        .unwrap_or_else(|| output_dir.join("logs"));
    let io = |source| SetupError::Io {
        what: "metric_logger.log_dir",
        path: log_dir.clone(),
        source,
    };
    let jsonl = |name: &str| JsonlSink::create(&log_dir, name, file).map_err(io);
    let mut sinks: Vec<Box<dyn MetricSink>> = Vec::new();
    match cfg.map(|c| &c.settings) {
        None => sinks.push(Box::new(jsonl(METRICS_FILE)?)),
        Some(MetricLoggerSettings::Disk(k)) => {
            sinks.push(Box::new(jsonl(
                k.filename.as_deref().unwrap_or(METRICS_FILE),
            )?));
        }
        Some(MetricLoggerSettings::Stdout(_)) => {
            sinks.push(Box::new(StdoutSink {
                printer: Box::new(|line| println!("{line}")),
            }));
            sinks.push(Box::new(jsonl(METRICS_FILE)?));
        }
        Some(MetricLoggerSettings::TensorBoard(k)) => {
            // torchtune's TensorBoardLogger: `run_<rank>_<unix time>` under the directory.
            let events = if k.organize_logs {
                let secs = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                log_dir.join(format!("run_0_{secs}"))
            } else {
                log_dir.clone()
            };
            sinks.push(Box::new(TensorBoardSink::create(&events).map_err(io)?));
            sinks.push(Box::new(jsonl(METRICS_FILE)?));
        }
    }
    Ok((MetricLoggers { sinks }, log_dir.display().to_string()))
}

#[cfg(test)]
mod tests {
    use super::loggers;
    use crate::config::schema::MetricLoggerConfig;
    use crate::training::metrics::MetricsFile;

    fn logger(yaml: &str) -> MetricLoggerConfig {
        serde_yaml::from_str(yaml).expect("a metric_logger section")
    }

    fn names(dir: &std::path::Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("the log directory")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn disk_logger_filename_names_the_metrics_file() {
        let out = tempfile::tempdir().expect("temp dir");
        let cfg = logger(
            "{_component_: torchtune.training.metric_logging.DiskLogger, filename: run.jsonl}",
        );
        let (mut sinks, dir) = loggers(Some(&cfg), out.path(), MetricsFile::New).expect("loggers");
        sinks
            .log(1, &vec![("loss".into(), 1.0)])
            .expect("log a step");
        sinks.flush().expect("flush");
        assert_eq!(names(std::path::Path::new(&dir)), ["run.jsonl"]);
    }

    #[test]
    fn tensorboard_organize_logs_puts_each_runs_events_in_a_directory_of_its_own() {
        for (organize, subdirs) in [(true, 1), (false, 0)] {
            let out = tempfile::tempdir().expect("temp dir");
            let cfg = logger(&format!(
                "{{_component_: torchtune.training.metric_logging.TensorBoardLogger, organize_logs: {organize}}}"
            ));
            let (_sinks, dir) = loggers(Some(&cfg), out.path(), MetricsFile::New).expect("loggers");
            let dir = std::path::Path::new(&dir);
            let runs: Vec<String> = names(dir)
                .into_iter()
                .filter(|n| n.starts_with("run_0_") && dir.join(n).is_dir())
                .collect();
            assert_eq!(
                runs.len(),
                subdirs,
                "organize_logs {organize}: {:?}",
                names(dir)
            );
            assert!(dir.join("metrics.jsonl").is_file());
            let events_dir = runs.first().map_or(dir.to_path_buf(), |r| dir.join(r));
            assert!(
                names(&events_dir)
                    .iter()
                    .any(|n| n.starts_with("events.out.tfevents.")),
                "{:?}",
                names(&events_dir)
            );
        }
    }
}
