//! The `tune_checkpoint.json` metadata format and checkpoint directory names.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::PathBuf;

/// Highest metadata format version this tune reads and the one it writes.
pub const FORMAT_VERSION: u64 = 1;

/// Name of the metadata file, written last inside every checkpoint directory.
pub const METADATA_FILE: &str = "tune_checkpoint.json";

/// Prefix of the temporary directories that saves write into.
pub(crate) const TMP_PREFIX: &str = ".tmp-";

/// Suffix of a previous checkpoint moved aside while being replaced.
pub(crate) const OLD_SUFFIX: &str = ".old";

/// What the caller supplies about a checkpoint (everything in the metadata file
/// except the file list, creation time and format version).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    pub tune_version: String,
    pub recipe: String,
    /// Hash of the resolved config, computed by the caller.
    pub config_hash: String,
    /// Global optimizer step.
    pub step: u64,
    pub epoch: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps_in_epoch: Option<u64>,
    /// Caller's free-form data (RNG state, data loader position, ...).
    #[serde(default)]
    pub extra: serde_json::Value,
}

impl CheckpointMeta {
    /// Metadata stamped with this build's version and a null `extra`.
    pub fn new(
        recipe: impl Into<String>,
        config_hash: impl Into<String>,
        step: u64,
        epoch: u64,
    ) -> Self {
        Self {
            tune_version: env!("CARGO_PKG_VERSION").to_string(),
            recipe: recipe.into(),
            config_hash: config_hash.into(),
            step,
            epoch,
            steps_in_epoch: None,
            extra: serde_json::Value::Null,
        }
    }
}

/// One file of a checkpoint as recorded in the metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// Relative to the checkpoint directory, `/`-separated.
    pub path: String,
    pub size: u64,
    /// Lower-case hex sha256 of the contents.
    pub sha256: String,
}

/// The full contents of `tune_checkpoint.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointManifest {
    pub format_version: u64,
    #[serde(flatten)]
    pub meta: CheckpointMeta,
    pub created_unix: u64,
    pub files: Vec<FileRecord>,
}

impl CheckpointManifest {
    /// Sum of the recorded file sizes.
    pub fn total_size(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// Whether a checkpoint is named after a global step or an epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NameKind {
    Step,
    Epoch,
}

/// A valid checkpoint name: `step_<N>` or `epoch_<N>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CheckpointName {
    pub kind: NameKind,
    pub number: u64,
}

impl CheckpointName {
    /// Parses `step_<digits>` / `epoch_<digits>`; anything else is `None`.
    pub fn parse(name: &str) -> Option<Self> {
        let (kind, digits) = if let Some(d) = name.strip_prefix("step_") {
            (NameKind::Step, d)
        } else if let Some(d) = name.strip_prefix("epoch_") {
            (NameKind::Epoch, d)
        } else {
            return None;
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let number = digits.parse().ok()?;
        Some(Self { kind, number })
    }
}

impl fmt::Display for CheckpointName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            NameKind::Step => write!(f, "step_{}", self.number),
            NameKind::Epoch => write!(f, "epoch_{}", self.number),
        }
    }
}

/// `.tmp-<name>-<pid>`: where a save of `name` by process `pid` is written.
pub(crate) fn temp_dir_name(name: &str, pid: u32) -> String {
    format!("{TMP_PREFIX}{name}-{pid}")
}

/// `.tmp-<name>-<pid>.old`: where a replaced checkpoint waits to be deleted.
pub(crate) fn aside_dir_name(name: &str, pid: u32) -> String {
    format!("{TMP_PREFIX}{name}-{pid}{OLD_SUFFIX}")
}

/// A parsed temporary directory name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TempName {
    /// The checkpoint name it was going to be published as (or was replaced from).
    pub target: String,
    /// `true` for a replaced checkpoint moved aside (`.old`).
    pub old: bool,
}

/// Parses `.tmp-<name>-<pid>[.old]`; `None` if it is not one of ours.
pub(crate) fn parse_temp_name(dir_name: &str) -> Option<TempName> {
    let rest = dir_name.strip_prefix(TMP_PREFIX)?;
    let (rest, old) = match rest.strip_suffix(OLD_SUFFIX) {
        Some(r) => (r, true),
        None => (rest, false),
    };
    let (target, pid) = rest.rsplit_once('-')?;
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(TempName {
        target: target.to_string(),
        old,
    })
}

/// A complete checkpoint in its final place.
#[derive(Debug, Clone, PartialEq)]
pub struct PublishedCheckpoint {
    pub name: String,
    pub dir: PathBuf,
    pub manifest: CheckpointManifest,
}

impl PublishedCheckpoint {
    pub fn meta(&self) -> &CheckpointMeta {
        &self.manifest.meta
    }
}
