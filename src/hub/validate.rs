//! Checks that a folder is something worth pushing: a PEFT adapter or a full
//! Hugging Face checkpoint, naming exactly what is missing otherwise.

use std::path::Path;

use crate::hub::error::HubError;

/// What a pushable folder holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointKind {
    /// `adapter_config.json` + `adapter_model.safetensors`.
    PeftAdapter,
    /// `config.json` + `model.safetensors`, or an index and all its shards.
    Full { shards: Vec<String> },
}

const ADAPTER_CONFIG: &str = "adapter_config.json";
const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
const CONFIG: &str = "config.json";
const WEIGHTS: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

fn invalid(dir: &Path, reason: String) -> HubError {
    HubError::InvalidPushDir {
        dir: dir.to_path_buf(),
        reason,
    }
}

/// Classifies `dir`, or says what it lacks.
pub fn validate_push_dir(dir: &Path) -> Result<CheckpointKind, HubError> {
    if !dir.is_dir() {
        return Err(invalid(dir, "it is not a directory".into()));
    }
    let has = |name: &str| dir.join(name).is_file();
    if has(ADAPTER_CONFIG) {
        if has(ADAPTER_WEIGHTS) {
            return Ok(CheckpointKind::PeftAdapter);
        }
        if !has(CONFIG) {
            return Err(invalid(
                dir,
                format!("it has {ADAPTER_CONFIG} but {ADAPTER_WEIGHTS} is missing"),
            ));
        }
    }
    if has(CONFIG) {
        if has(WEIGHTS) {
            return Ok(CheckpointKind::Full {
                shards: vec![WEIGHTS.to_string()],
            });
        }
        if has(INDEX) {
            return sharded(dir);
        }
        return Err(invalid(
            dir,
            format!("it has {CONFIG} but neither {WEIGHTS} nor {INDEX} (with its shards)"),
        ));
    }
    let missing_adapter: Vec<&str> = [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
        .into_iter()
        .filter(|f| !has(f))
        .collect();
    Err(invalid(
        dir,
        format!(
            "it is neither a PEFT adapter (missing {}) nor a Hugging Face checkpoint (missing {CONFIG} and {WEIGHTS} or {INDEX})",
            missing_adapter.join(", ")
        ),
    ))
}

fn sharded(dir: &Path) -> Result<CheckpointKind, HubError> {
    let index_path = dir.join(INDEX);
    let text = std::fs::read_to_string(&index_path).map_err(HubError::io("read", &index_path))?;
    let index: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| invalid(dir, format!("{INDEX} is not valid JSON: {e}")))?;
    let weight_map = index
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| invalid(dir, format!("{INDEX} has no \"weight_map\" object")))?;
    let mut shards: Vec<String> = weight_map
        .values()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect();
    shards.sort();
    shards.dedup();
    if shards.is_empty() {
        return Err(invalid(dir, format!("{INDEX} lists no shard files")));
    }
    let missing: Vec<&str> = shards
        .iter()
        .map(String::as_str)
        .filter(|s| !dir.join(s).is_file())
        .collect();
    if !missing.is_empty() {
        return Err(invalid(
            dir,
            format!(
                "shards listed in {INDEX} are missing: {}",
                missing.join(", ")
            ),
        ));
    }
    Ok(CheckpointKind::Full { shards })
}
