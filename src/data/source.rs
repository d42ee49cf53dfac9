//! Loads the rows of local dataset files: JSON (an array of objects), JSON Lines, CSV,
//! Parquet (the format of most Hugging Face Hub datasets), text.
use super::error::{DataError, Result};
use super::spec::DatasetSpec;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One row of a dataset file, with where it came from (for error messages).
#[derive(Debug, Clone)]
pub struct Row {
    pub file: Arc<PathBuf>,
    /// 0-based position in its file.
    pub index: usize,
    pub value: Value,
}

impl Row {
    /// Rows of an in-memory list of values, numbered in order as if read from `file` (rows a
    /// test or a caller builds rather than reads).
    pub fn inline(file: &str, values: Vec<Value>) -> Vec<Row> {
        let file = Arc::new(PathBuf::from(file));
        values
            .into_iter()
            .enumerate()
            .map(|(index, value)| Row {
                file: Arc::clone(&file),
                index,
                value,
            })
            .collect()
    }
}

/// Local file formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileFormat {
    /// A JSON array of objects; a file ending in `.jsonl` (or not parsing as one JSON value)
    /// is read as JSON Lines.
    Json,
    Csv,
    /// Apache Parquet, read row by row with the `parquet` crate's record API (no Arrow).
    Parquet,
    /// One row per non-blank line, in the column `text`.
    Text,
}

impl FileFormat {
    fn from_builder(name: &str) -> Option<FileFormat> {
        match name {
            "json" => Some(FileFormat::Json),
            "csv" => Some(FileFormat::Csv),
            "parquet" => Some(FileFormat::Parquet),
            "text" => Some(FileFormat::Text),
            _ => None,
        }
    }

    fn from_extension(path: &Path) -> Option<FileFormat> {
        let ext = path.extension()?.to_str()?.to_ascii_lowercase();
        match ext.as_str() {
            "json" | "jsonl" | "ndjson" => Some(FileFormat::Json),
            "csv" => Some(FileFormat::Csv),
            "parquet" => Some(FileFormat::Parquet),
            "txt" | "text" => Some(FileFormat::Text),
            _ => None,
        }
    }
}

/// Which local files `spec` names, with their format. Relative paths are taken from `base_dir`.
pub fn resolve_files(spec: &DatasetSpec, base_dir: &Path) -> Result<Vec<(PathBuf, FileFormat)>> {
    let source = spec.source.as_deref().ok_or_else(|| DataError::Spec {
        message: "the dataset has no `source`; set `source: json` with `data_files: path/to/file.json`, or `source: path/to/file.json`".into(),
    })?;
    if source == "arrow" {
        return Err(DataError::Spec {
            message: "`source: arrow` is not supported; use the dataset's Parquet, JSON Lines or CSV files".into(),
        });
    }
    if let Some(format) = FileFormat::from_builder(source) {
        let files = spec.data_files.clone();
        if files.is_empty() {
            return Err(DataError::Spec {
                message: format!(
                    "`source: {source}` needs `data_files: path/to/file` (a path or a list)"
                ),
            });
        }
        return Ok(files.iter().map(|f| (base_dir.join(f), format)).collect());
    }
    let path = base_dir.join(source);
    if path.is_file() {
        let format = FileFormat::from_extension(&path).ok_or_else(|| DataError::Spec {
            message: format!(
                "cannot tell the format of {}: name it .json/.jsonl/.csv/.parquet/.txt, or write `source: json` and `data_files: {source}`",
                path.display()
            ),
        })?;
        return Ok(vec![(path, format)]);
    }
    if path.is_dir() {
        return Err(DataError::Spec {
            message: format!(
                "`source: {source}` is a folder; name the file(s) with `source: json` and `data_files: [...]`"
            ),
        });
    }
    let looks_local = source.starts_with('.')
        || source.starts_with('/')
        || source.starts_with('~')
        || FileFormat::from_extension(Path::new(source)).is_some();
    if looks_local {
        return Err(DataError::Io {
            path,
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
        });
    }
    Err(DataError::HubDatasetNotAvailable {
        repo: source.to_string(),
    })
}

/// Reads every row of the files `spec` names, then applies `split`.
pub fn load_rows(spec: &DatasetSpec, base_dir: &Path) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (path, format) in resolve_files(spec, base_dir)? {
        let file_rows = read_file(&path, format)?;
        if file_rows.is_empty() {
            return Err(DataError::Empty { path });
        }
        let file = Arc::new(path);
        rows.extend(file_rows.into_iter().enumerate().map(|(index, value)| Row {
            file: Arc::clone(&file),
            index,
            value,
        }));
    }
    apply_split(rows, &spec.split)
}

/// Reads one file into JSON values (one per row).
pub fn read_file(path: &Path, format: FileFormat) -> Result<Vec<Value>> {
    if format == FileFormat::Parquet {
        return parse_parquet(path);
    }
    let text = std::fs::read_to_string(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    match format {
        FileFormat::Json => parse_json(path, &text),
        FileFormat::Csv => parse_csv(path, &text),
        FileFormat::Parquet => unreachable!("parquet files are read above"),
        FileFormat::Text => Ok(text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                let mut m = Map::new();
                m.insert("text".into(), Value::String(l.to_string()));
                Value::Object(m)
            })
            .collect()),
    }
}

fn parse_json(path: &Path, text: &str) -> Result<Vec<Value>> {
    let is_jsonl = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("jsonl") || e.eq_ignore_ascii_case("ndjson"));
    if !is_jsonl {
        match serde_json::from_str::<Value>(text) {
            Ok(Value::Array(rows)) => return Ok(rows),
            Ok(obj @ Value::Object(_)) => return Ok(vec![obj]),
            Ok(other) => {
                return Err(DataError::Parse {
                    path: path.to_path_buf(),
                    location: String::new(),
                    format: "dataset JSON",
                    message: format!(
                        "the file holds a {}, expected an array of row objects or one object per line",
                        kind_name(&other)
                    ),
                });
            }
            // "trailing characters" after the first value: JSON Lines.
            Err(e) if e.is_syntax() && e.line() > 1 && text.trim_start().starts_with('{') => {}
            Err(e) => {
                return Err(DataError::Parse {
                    path: path.to_path_buf(),
                    location: String::new(),
                    format: "JSON",
                    message: e.to_string(),
                });
            }
        }
    }
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value = serde_json::from_str(line).map_err(|e| DataError::Parse {
            path: path.to_path_buf(),
            location: format!("line {} ", i + 1),
            format: "JSON Lines (one JSON object per line)",
            message: e.to_string(),
        })?;
        rows.push(value);
    }
    Ok(rows)
}

fn parse_csv(path: &Path, text: &str) -> Result<Vec<Value>> {
    let mut reader = csv::ReaderBuilder::new().from_reader(text.as_bytes());
    let parse_err = |e: csv::Error| DataError::Parse {
        path: path.to_path_buf(),
        location: e
            .position()
            .map(|p| format!("line {} ", p.line()))
            .unwrap_or_default(),
        format: "CSV",
        message: e.to_string(),
    };
    let headers = reader.headers().map_err(parse_err)?.clone();
    let mut rows = Vec::new();
    for record in reader.records() {
        let record = record.map_err(parse_err)?;
        let map: Map<String, Value> = headers
            .iter()
            .zip(record.iter())
            .map(|(h, v)| (h.to_string(), Value::String(v.to_string())))
            .collect();
        rows.push(Value::Object(map));
    }
    Ok(rows)
}

/// The most rows a Parquet footer may reserve room for up front; more still load, growing.
const MAX_ROWS_HINT: usize = 1 << 16;

/// Every row of a Parquet file as a JSON object (nested lists and structs included, e.g.
/// a chat dataset's `messages` column), in file order.
fn parse_parquet(path: &Path) -> Result<Vec<Value>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let file = std::fs::File::open(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let parse_err = |location: String, e: parquet::errors::ParquetError| DataError::Parse {
        path: path.to_path_buf(),
        location,
        format: "Parquet",
        message: e.to_string(),
    };
    let reader = SerializedFileReader::new(file).map_err(|e| parse_err(String::new(), e))?;
    // The footer's row count only sizes the first allocation: a corrupt one (negative, or
    // 2^62) must neither overflow the capacity nor reserve terabytes.
    let hint = usize::try_from(reader.metadata().file_metadata().num_rows()).unwrap_or(0);
    let mut rows = Vec::with_capacity(hint.min(MAX_ROWS_HINT));
    for (i, row) in reader
        .get_row_iter(None)
        .map_err(|e| parse_err(String::new(), e))?
        .enumerate()
    {
        let row = row.map_err(|e| parse_err(format!("row {} ", i + 1), e))?;
        rows.push(row.to_json_value());
    }
    Ok(rows)
}

pub(crate) fn kind_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// `train`, `train[a:b]` (row numbers, either side optional) or `train[a%:b%]`.
fn apply_split(rows: Vec<Row>, split: &str) -> Result<Vec<Row>> {
    let split = split.trim();
    let bad = || DataError::Spec {
        message: format!(
            "`split: {split}` is not available for local files: they only have `train` (optionally sliced: `train[:100]`, `train[10:20]`, `train[:10%]`)"
        ),
    };
    if split == "train" {
        return Ok(rows);
    }
    let inner = split
        .strip_prefix("train[")
        .and_then(|s| s.strip_suffix(']'))
        .ok_or_else(bad)?;
    let (a, b) = inner.split_once(':').ok_or_else(bad)?;
    let n = rows.len();
    let bound = |s: &str, default: usize| -> Result<usize> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(default);
        }
        let (num, pct) = match s.strip_suffix('%') {
            Some(p) => (p.trim(), true),
            None => (s, false),
        };
        let v: i64 = num.parse().map_err(|_| bad())?;
        let v = if pct {
            (v as f64 / 100.0 * n as f64).round() as i64
        } else {
            v
        };
        let v = if v < 0 { n as i64 + v } else { v };
        Ok(v.clamp(0, n as i64) as usize)
    };
    let (start, end) = (bound(a, 0)?, bound(b, n)?);
    Ok(rows
        .into_iter()
        .skip(start)
        .take(end.saturating_sub(start))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize) -> Vec<Row> {
        Row::inline("x", vec![Value::Null; n])
    }

    #[test]
    fn splits() {
        let idx = |s| {
            apply_split(rows(10), s)
                .expect("split")
                .iter()
                .map(|r| r.index)
                .collect::<Vec<_>>()
        };
        assert_eq!(idx("train"), (0..10).collect::<Vec<_>>());
        assert_eq!(idx("train[:3]"), vec![0, 1, 2]);
        assert_eq!(idx("train[8:]"), vec![8, 9]);
        assert_eq!(idx("train[:20%]"), vec![0, 1]);
        assert_eq!(idx("train[-1:]"), vec![9]);
        assert!(apply_split(rows(3), "validation").is_err());
    }
}
