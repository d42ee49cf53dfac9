//! Metric loggers: stdout, JSON Lines on disk, TensorBoard event files. torchtune's
//! `StdoutLogger`, `DiskLogger` and `TensorBoardLogger` map to these.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::tensorboard::EventWriter;

/// One logged step: ordered name/value pairs (`step` and `epoch` included).
pub type Metrics = Vec<(String, f64)>;

pub trait MetricSink: Send {
    fn log(&mut self, step: usize, metrics: &Metrics) -> std::io::Result<()>;
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Prints one line per logged step (through the progress bar so the two do not collide).
pub struct StdoutSink {
    pub printer: Box<dyn Fn(String) + Send>,
}

impl MetricSink for StdoutSink {
    fn log(&mut self, step: usize, metrics: &Metrics) -> std::io::Result<()> {
        let body: Vec<String> = metrics
            .iter()
            .filter(|(k, _)| k != "step")
            .map(|(k, v)| {
                if *v == v.trunc() && v.abs() < 1e15 {
                    format!("{k}:{v}")
                } else {
                    format!("{k}:{v:.6}")
                }
            })
            .collect();
        (self.printer)(format!("Step {step} | {}", body.join(" ")));
        Ok(())
    }
}

/// `<log_dir>/metrics.jsonl`: one JSON object per logged step, appended so resumed runs
/// continue the same file.
pub struct JsonlSink {
    pub path: PathBuf,
    out: BufWriter<File>,
}

impl JsonlSink {
    pub fn create(log_dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(log_dir)?;
        let path = log_dir.join("metrics.jsonl");
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        Ok(Self {
            path,
            out: BufWriter::new(file),
        })
    }
}

impl MetricSink for JsonlSink {
    fn log(&mut self, _step: usize, metrics: &Metrics) -> std::io::Result<()> {
        let mut obj = serde_json::Map::new();
        for (k, v) in metrics {
            // Counters stay integers in the JSON (step, epoch, bytes, token counts).
            let integral = matches!(k.as_str(), "step" | "epoch" | "peak_memory_bytes")
                || k.starts_with("num_");
            let value = if integral && v.fract() == 0.0 {
                serde_json::Value::from(*v as u64)
            } else {
                serde_json::Number::from_f64(*v)
                    .map(serde_json::Value::Number)
                    .unwrap_or(serde_json::Value::Null)
            };
            obj.insert(k.clone(), value);
        }
        writeln!(self.out, "{}", serde_json::Value::Object(obj))?;
        self.out.flush()
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

pub struct TensorBoardSink {
    writer: EventWriter,
}

impl TensorBoardSink {
    pub fn create(log_dir: &Path) -> std::io::Result<Self> {
        Ok(Self {
            writer: EventWriter::create(log_dir)?,
        })
    }
}

impl MetricSink for TensorBoardSink {
    fn log(&mut self, step: usize, metrics: &Metrics) -> std::io::Result<()> {
        for (k, v) in metrics.iter().filter(|(k, _)| k != "step") {
            self.writer.scalar(k, *v as f32, step as i64)?;
        }
        self.writer.flush()
    }
}

#[derive(Default)]
pub struct MetricLoggers {
    pub sinks: Vec<Box<dyn MetricSink>>,
}

impl MetricLoggers {
    pub fn log(&mut self, step: usize, metrics: &Metrics) -> std::io::Result<()> {
        for sink in &mut self.sinks {
            sink.log(step, metrics)?;
        }
        Ok(())
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        for sink in &mut self.sinks {
            sink.flush()?;
        }
        Ok(())
    }
}

/// Peak resident memory of this process in bytes (Linux `VmHWM`), 0 where unknown.
pub fn peak_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|kb| kb.parse::<u64>().ok())
            })
        })
        .map_or(0, |kb| kb * 1024)
}
