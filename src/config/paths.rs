//! Filesystem checks for paths named in a config. Relative paths are resolved
//! against the current directory, as torchtune does.

use std::path::{Path, PathBuf};

use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::Checker;

/// Reports `path` (named by config `key`) as missing unless `exists`: "{what} `{path}` does
/// not exist", and that `key` must name `expected`.
pub fn require(exists: bool, cx: &mut Checker, key: &str, what: &str, path: &str, expected: &str) {
    if !exists {
        cx.problem(
            Problem::new(
                ProblemKind::MissingPath,
                key,
                format!("{what} `{path}` does not exist"),
            )
            .with_fix(format!("`{key}` must name {expected}")),
        );
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("no tokenizer.json found for {}: looked at {}", path.display(), tried.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "))]
    TokenizerNotFound { path: PathBuf, tried: Vec<PathBuf> },
}

/// Finds the `tokenizer.json` a tokenizer path means. torchtune configs point at
/// `original/tokenizer.model` (tiktoken/sentencepiece) or `vocab.json`; we only read
/// Hugging Face `tokenizer.json`, so look beside the given file and in its parent
/// (`<model>/original/tokenizer.model` -> `<model>/tokenizer.json`). A directory
/// is searched directly.
pub fn resolve_tokenizer_json(path: &Path) -> Result<PathBuf, PathError> {
    let mut tried = Vec::new();
    if path.is_file() && path.file_name().is_some_and(|n| n == "tokenizer.json") {
        return Ok(path.to_path_buf());
    }
    let mut dirs: Vec<&Path> = Vec::new();
    if path.is_dir() {
        dirs.push(path);
    }
    if let Some(parent) = path.parent() {
        dirs.push(parent);
        if let Some(grand) = parent.parent() {
            dirs.push(grand);
        }
    }
    for dir in dirs {
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        let candidate = dir.join("tokenizer.json");
        if candidate.is_file() {
            return Ok(candidate);
        }
        tried.push(candidate);
    }
    Err(PathError::TokenizerNotFound {
        path: path.to_path_buf(),
        tried,
    })
}

/// True when a `data_files`/`source` string names a local file rather than a
/// Hub dataset or URL, so its existence can be checked.
pub fn looks_local(s: &str) -> bool {
    !s.contains("://")
        && !s.contains(['*', '?', '['])
        && (s.starts_with('/') || s.starts_with('.') || s.starts_with('~') || has_data_ext(s))
}

fn has_data_ext(s: &str) -> bool {
    [".json", ".jsonl", ".csv", ".parquet", ".txt", ".arrow"]
        .iter()
        .any(|ext| s.ends_with(ext))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_tokenizer_json_near_tokenizer_model() {
        let tmp = tempfile::Builder::new()
            .prefix("tune-paths-")
            .tempdir()
            .unwrap();
        let dir = tmp.path();
        std::fs::create_dir_all(dir.join("original")).unwrap();
        std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
        let model = dir.join("original/tokenizer.model");
        assert_eq!(
            resolve_tokenizer_json(&model).unwrap(),
            dir.join("tokenizer.json")
        );
        assert_eq!(
            resolve_tokenizer_json(dir).unwrap(),
            dir.join("tokenizer.json")
        );
        let err = resolve_tokenizer_json(Path::new("/nonexistent/x/tokenizer.model")).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/x/tokenizer.json"),
            "{err}"
        );
    }

    #[test]
    fn local_vs_hub() {
        assert!(looks_local("assets/data/alpaca_tiny.json"));
        assert!(looks_local("/data/x"));
        assert!(!looks_local("yahma/alpaca-cleaned"));
        assert!(!looks_local("https://x/y.json"));
    }
}
