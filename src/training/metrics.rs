//! Metric loggers: stdout, JSON Lines on disk, TensorBoard event files. torchtune's
//! `StdoutLogger`, `DiskLogger` and `TensorBoardLogger` map to these.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::tensorboard::EventWriter;

/// One logged step: ordered name/value pairs (`step` and `epoch` included).
pub type Metrics = Vec<(String, f64)>;

pub trait MetricSink: Send {
    /// Where this sink writes, for error messages.
    fn destination(&self) -> PathBuf;
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
    fn destination(&self) -> PathBuf {
        PathBuf::from("<stdout>")
    }

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

/// `<log_dir>/metrics.jsonl`: one JSON object per logged step. A resumed run continues the
/// file; a new run starts its own.
pub struct JsonlSink {
    pub path: PathBuf,
    out: BufWriter<File>,
}

/// Whose `metrics.jsonl` a run writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricsFile {
    /// A new run: an old run's file is moved aside to `metrics.<unix time>.jsonl`, never
    /// appended to.
    New,
    /// A run resumed after `step`: the file continues, without the lines of steps after it that
    /// the interrupted run logged but did not checkpoint (they are trained again).
    ResumeAfter(usize),
}

/// A metric's name: a fixed one (`loss`), or one a run makes (`rewards/<function>`).
pub type MetricName = std::borrow::Cow<'static, str>;

/// The metrics file's name unless `metric_logger.filename` gives another.
pub const METRICS_FILE: &str = "metrics.jsonl";

impl JsonlSink {
    /// `<log_dir>/<name>`, a new run's or a resumed one's.
    pub fn create(log_dir: &Path, name: &str, file: MetricsFile) -> std::io::Result<Self> {
        std::fs::create_dir_all(log_dir)?;
        let path = log_dir.join(name);
        match file {
            MetricsFile::New => set_aside(&path)?,
            MetricsFile::ResumeAfter(step) => truncate_after(&path, step)?,
        }
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        Ok(Self {
            path,
            out: BufWriter::new(file),
        })
    }
}

/// Moves a non-empty `metrics.jsonl` to `metrics.<unix seconds>.jsonl` (a free name; another
/// file name's stem and extension likewise).
fn set_aside(path: &Path) -> std::io::Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if m.len() > 0 => {}
        Ok(_) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let stem = path
        .file_stem()
        .map_or("metrics".into(), |s| s.to_string_lossy().into_owned());
    let ext = path
        .extension()
        .map_or(String::new(), |e| format!(".{}", e.to_string_lossy()));
    let mut n = 0;
    loop {
        let name = match n {
            0 => format!("{stem}.{secs}{ext}"),
            n => format!("{stem}.{secs}-{n}{ext}"),
        };
        let aside = path.with_file_name(name);
        if !aside.exists() {
            return std::fs::rename(path, aside);
        }
        n += 1;
    }
}

/// Keeps the lines of `path` up to `step` (lines without a step stay), through a temporary
/// file renamed over it.
fn truncate_after(path: &Path, step: usize) -> std::io::Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let keep = |line: &&str| {
        serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v.get("step").and_then(serde_json::Value::as_u64))
            .is_none_or(|s| s <= step as u64)
    };
    let kept: Vec<&str> = text.lines().filter(keep).collect();
    if kept.len() == text.lines().count() {
        return Ok(());
    }
    let tmp = path.with_extension("jsonl.tmp");
    let mut body = kept.join("\n");
    if !body.is_empty() {
        body.push('\n');
    }
    std::fs::write(&tmp, body)?;
    std::fs::rename(tmp, path)
}

impl MetricSink for JsonlSink {
    fn destination(&self) -> PathBuf {
        self.path.clone()
    }

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
    log_dir: PathBuf,
}

impl TensorBoardSink {
    pub fn create(log_dir: &Path) -> std::io::Result<Self> {
        Ok(Self {
            writer: EventWriter::create(log_dir)?,
            log_dir: log_dir.to_path_buf(),
        })
    }
}

impl MetricSink for TensorBoardSink {
    fn destination(&self) -> PathBuf {
        self.log_dir.clone()
    }

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

/// A metric sink that could not write (a full disk, a log directory removed mid-run).
#[derive(Debug, thiserror::Error)]
#[error("writing metrics to {}: {source}", path.display())]
pub struct MetricsError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

impl MetricLoggers {
    pub fn log(&mut self, step: usize, metrics: &Metrics) -> Result<(), MetricsError> {
        for sink in &mut self.sinks {
            sink.log(step, metrics).map_err(|source| MetricsError {
                path: sink.destination(),
                source,
            })?;
        }
        Ok(())
    }

    pub fn flush(&mut self) -> Result<(), MetricsError> {
        for sink in &mut self.sinks {
            sink.flush().map_err(|source| MetricsError {
                path: sink.destination(),
                source,
            })?;
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
