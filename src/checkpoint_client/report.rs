//! `tune checkpoints <output_dir>`: a table of what is there.

use super::discovery::CheckpointEntry;
use super::meta::FORMAT_VERSION;
use super::verify::CheckpointStatus;

/// Human-readable size: `512 B`, `1.5 KiB`, `3.2 GiB`.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

fn status_text(entry: &CheckpointEntry) -> String {
    let status = match &entry.status {
        CheckpointStatus::Complete(_) => "complete".to_string(),
        CheckpointStatus::Incomplete { reason } => format!("incomplete: {reason}"),
        CheckpointStatus::Corrupt { reason } => format!("corrupt: {reason}"),
        CheckpointStatus::FromTheFuture { version } => {
            format!("from a newer tune: format version {version} > {FORMAT_VERSION}; upgrade tune")
        }
    };
    if entry.temporary {
        format!("{status} (unpublished save)")
    } else {
        status
    }
}

/// A table with one row per entry: name, step, epoch, size, status.
pub fn format_report(entries: &[CheckpointEntry]) -> String {
    if entries.is_empty() {
        return "no checkpoints found\n".to_string();
    }
    let header = ["NAME", "STEP", "EPOCH", "SIZE", "STATUS"].map(str::to_string);
    let opt = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
    let rows: Vec<[String; 5]> = entries
        .iter()
        .map(|e| {
            [
                e.name.clone(),
                opt(e.step),
                opt(e.epoch),
                human_size(e.size_bytes),
                status_text(e),
            ]
        })
        .collect();
    let mut widths = header.clone().map(|h| h.len());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let line = format!(
            "{:<w0$}  {:>w1$}  {:>w2$}  {:>w3$}  {}",
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2],
            w3 = widths[3],
        );
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}
