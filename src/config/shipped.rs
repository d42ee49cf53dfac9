//! The tiny model, its teacher and the tiny datasets, embedded in the binary so the `tiny/*`
//! built-in configs run from any directory after `cargo install`, with no source tree.
//!
//! A config value that is a relative path under `assets/` naming a shipped file or directory,
//! and that does not exist relative to the current directory (where a source checkout has
//! it), is pointed at a copy written once into the user cache
//! (`$XDG_CACHE_HOME/tune/assets-<version>-<hash>`, else `~/.cache/...`, else the temp dir).
//! The copy is the same bytes, so the run is the same as from the source tree.

use std::io;
use std::path::{Path, PathBuf};

use serde_yaml::Value;
use sha2::{Digest, Sha256};

macro_rules! shipped {
    ($($path:literal),* $(,)?) => {
        &[$(($path, include_bytes!(concat!("../../", $path)) as &[u8])),*]
    };
}

/// Every shipped file: its path relative to the repository root, and its bytes.
pub const FILES: &[(&str, &[u8])] = shipped![
    "assets/tiny-llama/config.json",
    "assets/tiny-llama/generation_config.json",
    "assets/tiny-llama/model.safetensors",
    "assets/tiny-llama/special_tokens_map.json",
    "assets/tiny-llama/tokenizer.json",
    "assets/tiny-llama/tokenizer_config.json",
    "assets/tiny-llama-reward/config.json",
    "assets/tiny-llama-reward/generation_config.json",
    "assets/tiny-llama-reward/model.safetensors",
    "assets/tiny-llama-reward/special_tokens_map.json",
    "assets/tiny-llama-reward/tokenizer.json",
    "assets/tiny-llama-reward/tokenizer_config.json",
    "assets/tiny-llama-teacher/config.json",
    "assets/tiny-llama-teacher/generation_config.json",
    "assets/tiny-llama-teacher/model.safetensors",
    "assets/tiny-llama-teacher/special_tokens_map.json",
    "assets/tiny-llama-teacher/tokenizer.json",
    "assets/tiny-llama-teacher/tokenizer_config.json",
    "assets/tiny-qwen2-vl/chat_template.json",
    "assets/tiny-qwen2-vl/config.json",
    "assets/tiny-qwen2-vl/generation_config.json",
    "assets/tiny-qwen2-vl/model.safetensors",
    "assets/tiny-qwen2-vl/preprocessor_config.json",
    "assets/tiny-qwen2-vl/tokenizer.json",
    "assets/tiny-qwen2-vl/tokenizer_config.json",
    "assets/images/blue_circle.png",
    "assets/images/blue_square.png",
    "assets/images/green_circle.png",
    "assets/images/green_square.png",
    "assets/images/red_circle.png",
    "assets/images/red_square.png",
    "assets/images/yellow_circle.png",
    "assets/images/yellow_square.png",
    "assets/data/vision_tiny.json",
    "assets/data/alpaca_pairs_tiny.json",
    "assets/data/alpaca_tiny.json",
    "assets/data/chat_tiny.json",
    "assets/data/hh_rlhf_tiny.json",
    "assets/data/instruct_tiny.json",
    "assets/data/stack_exchange_paired_tiny.json",
];

/// Writing the cached copy failed.
#[derive(Debug, thiserror::Error)]
#[error(
    "config key {key}: `{value}` is not in the current directory, and writing tune's shipped copy to {} failed: {source} (run from a tune source checkout, set XDG_CACHE_HOME to a writable directory, or point {key} at your own files)",
    path.display()
)]
pub struct ShippedError {
    pub key: String,
    pub value: String,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

/// Whether `rel` (a `/`-separated relative path) is a shipped file or a directory holding some.
fn is_shipped(rel: &str) -> bool {
    let rel = rel.trim_end_matches('/');
    FILES.iter().any(|(path, _)| {
        *path == rel
            || path
                .strip_prefix(rel)
                .is_some_and(|rest| rest.starts_with('/'))
    })
}

/// Points every missing shipped `assets/...` path in `root` at the cached copy.
pub fn resolve_paths(root: &mut Value) -> Result<(), ShippedError> {
    let mut cache: Option<PathBuf> = None;
    walk(root, "", &mut |key, value| {
        let Some(text) = value.as_str() else {
            return Ok(());
        };
        let rel = text.strip_prefix("./").unwrap_or(text);
        if !rel.starts_with("assets/") || !is_shipped(rel) || Path::new(text).exists() {
            return Ok(());
        }
        let dir = match &cache {
            Some(dir) => dir.clone(),
            None => {
                let dir = cache_root();
                materialise(&dir).map_err(|(path, source)| ShippedError {
                    key: key.to_string(),
                    value: text.to_string(),
                    path,
                    source,
                })?;
                cache = Some(dir.clone());
                dir
            }
        };
        *value = Value::String(dir.join(rel).display().to_string());
        Ok(())
    })
}

fn walk(
    node: &mut Value,
    key: &str,
    f: &mut impl FnMut(&str, &mut Value) -> Result<(), ShippedError>,
) -> Result<(), ShippedError> {
    match node {
        Value::Mapping(m) => {
            for (k, v) in m.iter_mut() {
                let name = k.as_str().map_or_else(|| format!("{k:?}"), str::to_string);
                let child = if key.is_empty() {
                    name
                } else {
                    format!("{key}.{name}")
                };
                walk(v, &child, f)?;
            }
            Ok(())
        }
        Value::Sequence(items) => {
            for (i, v) in items.iter_mut().enumerate() {
                walk(v, &format!("{key}.{i}"), f)?;
            }
            Ok(())
        }
        _ => f(key, node),
    }
}

/// `<user cache>/tune/assets-<version>-<hash of the shipped bytes>`: a new build with other
/// assets gets its own directory, so a copy is never mixed across versions.
fn cache_root() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })
        .unwrap_or_else(std::env::temp_dir);
    let mut hash = Sha256::new();
    for (path, bytes) in FILES {
        hash.update(path.as_bytes());
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(bytes);
    }
    let digest = hash.finalize();
    let short: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
    base.join("tune")
        .join(format!("assets-{}-{short}", env!("CARGO_PKG_VERSION")))
}

/// Writes the shipped files under `root` unless a complete copy is there: into a temporary
/// sibling first, renamed into place, so a concurrent or interrupted run never sees half a
/// copy. Returns the path that failed with its error.
fn materialise(root: &Path) -> Result<(), (PathBuf, io::Error)> {
    let complete = |dir: &Path| {
        FILES.iter().all(|(rel, bytes)| {
            std::fs::metadata(dir.join(rel)).is_ok_and(|m| m.len() == bytes.len() as u64)
        })
    };
    if complete(root) {
        return Ok(());
    }
    let parent = root.parent().unwrap_or(root);
    std::fs::create_dir_all(parent).map_err(|e| (parent.to_path_buf(), e))?;
    let tmp = parent.join(format!(
        ".tmp-{}-{}",
        root.file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    for (rel, bytes) in FILES {
        let path = tmp.join(rel);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| (dir.to_path_buf(), e))?;
        }
        std::fs::write(&path, bytes).map_err(|e| (path.clone(), e))?;
    }
    // A damaged copy (a file of the wrong size) is replaced whole.
    if root.exists() && !complete(root) {
        let _ = std::fs::remove_dir_all(root);
    }
    match std::fs::rename(&tmp, root) {
        Ok(()) => Ok(()),
        // Another process put a copy there first.
        Err(_) if complete(root) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(())
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err((root.to_path_buf(), e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_paths_are_files_and_their_directories() {
        assert!(is_shipped("assets/tiny-llama"));
        assert!(is_shipped("assets/tiny-llama/"));
        assert!(is_shipped("assets/tiny-llama/tokenizer.json"));
        assert!(is_shipped("assets/data/alpaca_tiny.json"));
        assert!(!is_shipped("assets/tiny"));
        assert!(!is_shipped("assets/data/mine.json"));
    }

    #[test]
    fn every_asset_a_tiny_config_names_is_shipped() {
        for b in crate::config::builtin::list() {
            for line in b.yaml.lines() {
                let Some(start) = line.find("assets/") else {
                    continue;
                };
                if line.trim_start().starts_with('#') {
                    continue;
                }
                let path: String = line[start..]
                    .chars()
                    .take_while(|c| !c.is_whitespace() && *c != ',' && *c != ']')
                    .collect();
                assert!(is_shipped(&path), "{}: {path} is not shipped", b.name);
            }
        }
    }
}
