//! Which Hub repository a local model directory came from, so what tune saves from it names
//! that repository (`base_model_name_or_path`, `_name_or_path`, the card's `base_model:`)
//! instead of a path that means nothing on another machine.
//!
//! Known from, in order: the record `tune download --output-dir` leaves
//! (`.cache/tune/source.json`, beside huggingface_hub's own `.cache/huggingface/` of a
//! `local_dir` download); the HF cache layout (`models--org--name/snapshots/<commit>`); a
//! `_name_or_path` in config.json that is a repo id (what an earlier tune or transformers save
//! carried along).

use std::path::{Path, PathBuf};

use crate::hub::error::HubError;
use crate::hub::repo::validate_repo_id;

/// tune's record of a downloaded directory's origin, relative to it.
pub const SOURCE_FILE: &str = ".cache/tune/source.json";

/// Where a model directory came from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Source {
    pub repo_id: String,
    pub revision: String,
    pub commit: String,
}

/// Records `source` in `dir` (a `--output-dir` download).
pub fn record(dir: &Path, source: &Source) -> Result<(), HubError> {
    let path = dir.join(SOURCE_FILE);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(HubError::io("create", parent))?;
    }
    let text = serde_json::to_string_pretty(source).unwrap_or_default();
    std::fs::write(&path, text + "\n").map_err(HubError::io("write", &path))
}

/// Whether `name` reads as a Hub repo id (`org/name` or `name`) rather than a local path.
pub fn is_hub_id(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with(['.', '/', '~'])
        && !name.contains('\\')
        && name.matches('/').count() <= 1
        && validate_repo_id(name).is_ok()
        && !Path::new(name).exists()
}

/// The Hub repo id `dir` holds a snapshot of, when it can be known.
pub fn hub_id(dir: &Path) -> Option<String> {
    if let Ok(text) = std::fs::read_to_string(dir.join(SOURCE_FILE))
        && let Ok(source) = serde_json::from_str::<Source>(&text)
    {
        return Some(source.repo_id);
    }
    if let Some(id) = from_cache_path(dir) {
        return Some(id);
    }
    let config = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let config: serde_json::Value = serde_json::from_str(&config).ok()?;
    config
        .get("_name_or_path")
        .and_then(serde_json::Value::as_str)
        .filter(|name| is_hub_id(name))
        .map(str::to_string)
}

/// `.../models--org--name/snapshots/<commit>[/...]` -> `org/name`.
fn from_cache_path(dir: &Path) -> Option<String> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let parts: Vec<String> = dir
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let at = parts.iter().rposition(|p| p == "snapshots")?;
    let repo = parts.get(at.checked_sub(1)?)?.strip_prefix("models--")?;
    let id = repo.replace("--", "/");
    validate_repo_id(&id).is_ok().then_some(id)
}

/// What to write as the base model of something saved from `dir`: its Hub id when known,
/// else its absolute path (as peft writes the path a model was loaded from).
pub fn base_model_name(dir: &Path) -> String {
    hub_id(dir).unwrap_or_else(|| {
        std::fs::canonicalize(dir)
            .unwrap_or_else(|_| PathBuf::from(dir))
            .display()
            .to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_and_paths_are_told_apart() {
        assert!(is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct"));
        assert!(is_hub_id("gpt2"));
        for path in [
            "/tmp/base",
            "./base",
            "../x/y",
            "~/m",
            "a/b/c",
            "C:\\m",
            "src",
        ] {
            assert!(!is_hub_id(path), "{path}");
        }
    }

    #[test]
    fn the_cache_layout_names_the_repo() {
        let tmp = tempfile::Builder::new()
            .prefix("tune-prov-")
            .tempdir()
            .unwrap();
        let root = tmp.path();
        let snap = root.join("hub/models--me--tiny-base/snapshots/abc123");
        std::fs::create_dir_all(&snap).unwrap();
        assert_eq!(hub_id(&snap).as_deref(), Some("me/tiny-base"));
        let local = root.join("plain");
        std::fs::create_dir_all(&local).unwrap();
        assert_eq!(hub_id(&local), None);
        std::fs::write(local.join("config.json"), r#"{"_name_or_path": "/tmp/x"}"#).unwrap();
        assert_eq!(hub_id(&local), None);
        std::fs::write(local.join("config.json"), r#"{"_name_or_path": "me/base"}"#).unwrap();
        assert_eq!(hub_id(&local).as_deref(), Some("me/base"));
        record(
            &local,
            &Source {
                repo_id: "me/recorded".into(),
                revision: "main".into(),
                commit: "c0ffee".into(),
            },
        )
        .unwrap();
        assert_eq!(hub_id(&local).as_deref(), Some("me/recorded"));
    }
}
