//! Checking one checkpoint directory against its `tune_checkpoint.json`.

use std::fs;
use std::io;
use std::path::Path;

use super::error::VerifyError;
use super::fsutil::{hash_file, resolve_relative};
use super::meta::{CheckpointManifest, FORMAT_VERSION, METADATA_FILE};

/// The state of one checkpoint directory.
#[derive(Debug, Clone, PartialEq)]
pub enum CheckpointStatus {
    /// Metadata readable and every recorded file present with its size (and
    /// checksum, when checked).
    Complete(Box<CheckpointManifest>),
    /// No metadata, unreadable metadata, a missing file or a size mismatch.
    Incomplete { reason: String },
    /// A checksum mismatch (only detected when checksums are checked).
    Corrupt { reason: String },
    /// `format_version` is newer than this tune reads.
    FromTheFuture { version: u64 },
}

impl CheckpointStatus {
    pub fn is_complete(&self) -> bool {
        matches!(self, Self::Complete(_))
    }
}

/// Verifies `dir`: the metadata must be readable and of a supported version,
/// and every recorded file must exist with the recorded size; with
/// `check_checksums` its sha256 must match too. Returns the metadata.
pub fn verify(dir: &Path, check_checksums: bool) -> Result<CheckpointManifest, VerifyError> {
    let dir_buf = dir.to_path_buf();
    match inspect(dir, check_checksums) {
        CheckpointStatus::Complete(manifest) => Ok(*manifest),
        CheckpointStatus::Incomplete { reason } => Err(VerifyError::Incomplete {
            dir: dir_buf,
            reason,
        }),
        CheckpointStatus::Corrupt { reason } => Err(VerifyError::Corrupt {
            dir: dir_buf,
            reason,
        }),
        CheckpointStatus::FromTheFuture { version } => Err(VerifyError::FromTheFuture {
            dir: dir_buf,
            version,
        }),
    }
}

/// Like [`verify`], as a status instead of an error.
pub fn inspect(dir: &Path, check_checksums: bool) -> CheckpointStatus {
    let incomplete = |reason: String| CheckpointStatus::Incomplete { reason };
    let meta_path = dir.join(METADATA_FILE);
    let bytes = match fs::read(&meta_path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return incomplete(if dir.is_dir() {
                format!("no {METADATA_FILE} (the save did not finish)")
            } else {
                "the directory does not exist".to_string()
            });
        }
        Err(e) => return incomplete(format!("cannot read {METADATA_FILE}: {e}")),
    };
    let value: serde_json::Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => return incomplete(format!("unreadable {METADATA_FILE}: {e}")),
    };
    let version = match value
        .get("format_version")
        .and_then(serde_json::Value::as_u64)
    {
        Some(v) => v,
        None => {
            return incomplete(format!(
                "unreadable {METADATA_FILE}: no valid format_version"
            ));
        }
    };
    if version > FORMAT_VERSION {
        return CheckpointStatus::FromTheFuture { version };
    }
    if version == 0 {
        return incomplete(format!(
            "unreadable {METADATA_FILE}: format_version 0 is not valid"
        ));
    }
    let manifest: CheckpointManifest = match serde_json::from_value(value) {
        Ok(m) => m,
        Err(e) => return incomplete(format!("unreadable {METADATA_FILE}: {e}")),
    };
    for file in &manifest.files {
        let Some(path) = resolve_relative(dir, &file.path) else {
            return incomplete(format!(
                "{METADATA_FILE} lists an invalid path {:?}",
                file.path
            ));
        };
        let actual = match fs::metadata(&path) {
            Ok(m) if m.is_file() => m.len(),
            Ok(_) => return incomplete(format!("{} is not a regular file", file.path)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return incomplete(format!("missing file {}", file.path));
            }
            Err(e) => return incomplete(format!("cannot read {}: {e}", file.path)),
        };
        if actual != file.size {
            return incomplete(format!(
                "{} is {actual} bytes, expected {}",
                file.path, file.size
            ));
        }
        if check_checksums {
            match hash_file(&path) {
                Ok((_, sha)) if sha == file.sha256 => {}
                Ok((_, sha)) => {
                    return CheckpointStatus::Corrupt {
                        reason: format!(
                            "checksum mismatch in {}: expected sha256 {}, found {sha}",
                            file.path, file.sha256
                        ),
                    };
                }
                Err(e) => return incomplete(format!("cannot read {}: {e}", file.path)),
            }
        }
    }
    CheckpointStatus::Complete(Box::new(manifest))
}
