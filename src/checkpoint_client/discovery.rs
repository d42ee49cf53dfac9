//! Finding checkpoints in an output directory: listing, the latest complete one
//! to resume from, and cleaning up what crashed saves left behind.

use super::notice::Notice;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::error::ClientError;
use super::fsutil::{dir_size_best_effort, sync_dir};
use super::meta::{CheckpointName, NameKind, PublishedCheckpoint, parse_temp_name};
use super::verify::{CheckpointStatus, inspect};

/// One checkpoint-looking directory of an output directory.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointEntry {
    /// Directory name (`step_120`, `epoch_0`, `.tmp-step_140-4242`).
    pub name: String,
    pub dir: PathBuf,
    /// A `.tmp-*` directory of an unfinished (or interrupted) save.
    pub temporary: bool,
    /// Global step: from the metadata if readable, else from a `step_N` name.
    pub step: Option<u64>,
    /// Epoch: from the metadata if readable, else from an `epoch_N` name.
    pub epoch: Option<u64>,
    /// Recorded size for complete checkpoints, bytes on disk otherwise.
    pub size_bytes: u64,
    pub status: CheckpointStatus,
}

/// Every `step_N`, `epoch_N` and `.tmp-*` directory of `output_dir` with its
/// status from cheap checks (metadata readable, every file present with the
/// recorded size), sorted by step (unknown steps last), then epoch, then name.
pub fn list_checkpoints(output_dir: &Path) -> Result<Vec<CheckpointEntry>, ClientError> {
    list_checkpoints_verified(output_dir, false)
}

/// Like [`list_checkpoints`]; with `check_checksums` every file is also hashed
/// and checksum mismatches are reported as [`CheckpointStatus::Corrupt`].
pub fn list_checkpoints_verified(
    output_dir: &Path,
    check_checksums: bool,
) -> Result<Vec<CheckpointEntry>, ClientError> {
    scan(output_dir, check_checksums).map_err(|e| {
        if e.source.kind() == io::ErrorKind::NotFound && e.path == output_dir {
            ClientError::OutputDirNotFound { path: e.path }
        } else {
            ClientError::io(e.action, e.path, e.source)
        }
    })
}

/// The newest complete published checkpoint (by step, then creation time), or
/// `None` when there is none or `output_dir` does not exist yet. Uses the cheap
/// checks; call [`verify`](super::verify) with checksums before trusting it fully.
/// Temporary directories are never returned.
pub fn latest_complete(output_dir: &Path) -> Result<Option<PublishedCheckpoint>, ClientError> {
    let entries = match scan(output_dir, false) {
        Ok(entries) => entries,
        Err(e) if e.source.kind() == io::ErrorKind::NotFound && e.path == output_dir => {
            return Ok(None);
        }
        Err(e) => return Err(ClientError::io(e.action, e.path, e.source)),
    };
    Ok(entries
        .into_iter()
        .filter(|e| !e.temporary)
        .filter_map(|e| match e.status {
            CheckpointStatus::Complete(manifest) => Some(PublishedCheckpoint {
                name: e.name,
                dir: e.dir,
                manifest: *manifest,
            }),
            _ => None,
        })
        .max_by(|a, b| {
            (a.manifest.meta.step, a.manifest.created_unix, &a.name).cmp(&(
                b.manifest.meta.step,
                b.manifest.created_unix,
                &b.name,
            ))
        }))
}

/// The newest published checkpoint that passes [`verify`](super::verify) with
/// checksums: like [`latest_complete`], but a corrupt newest checkpoint makes it
/// fall back to the previous one instead of returning it. Hashes every file of
/// the checkpoints it tries.
pub fn latest_verified(output_dir: &Path) -> Result<Option<PublishedCheckpoint>, ClientError> {
    let mut entries = match scan(output_dir, false) {
        Ok(entries) => entries,
        Err(e) if e.source.kind() == io::ErrorKind::NotFound && e.path == output_dir => {
            return Ok(None);
        }
        Err(e) => return Err(ClientError::io(e.action, e.path, e.source)),
    };
    entries.retain(|e| !e.temporary && e.status.is_complete());
    let key = |e: &CheckpointEntry| match &e.status {
        CheckpointStatus::Complete(m) => (m.meta.step, m.created_unix, e.name.clone()),
        _ => (0, 0, e.name.clone()),
    };
    entries.sort_by_key(|e| std::cmp::Reverse(key(e)));
    for entry in entries {
        match inspect(&entry.dir, true) {
            CheckpointStatus::Complete(manifest) => {
                return Ok(Some(PublishedCheckpoint {
                    name: entry.name,
                    dir: entry.dir,
                    manifest: *manifest,
                }));
            }
            other => super::notice::notify(
                Notice::Warning,
                &format!(
                    "checkpoint: skipping {}: {}",
                    entry.dir.display(),
                    match other {
                        CheckpointStatus::Corrupt { reason }
                        | CheckpointStatus::Incomplete { reason } => reason,
                        _ => "not usable".to_string(),
                    }
                ),
            ),
        }
    }
    Ok(None)
}

/// What [`clean_partial`] did with one temporary directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CleanAction {
    Removed,
    /// A save that crashed after its metadata was written but before the final
    /// rename, whose name was free: it was completed instead of deleted.
    Restored {
        to: PathBuf,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CleanedDir {
    pub path: PathBuf,
    pub action: CleanAction,
}

/// Removes the `.tmp-*` directories that crashed saves left in `output_dir`
/// (published `step_N`/`epoch_N` directories are never touched). One exception
/// keeps work from being lost: a temporary directory that holds a complete
/// checkpoint (metadata + sizes check out) whose published name does not exist
/// is renamed into place instead. Missing `output_dir` → nothing to do.
/// Must not run while a save into the same `output_dir` is in flight.
pub fn clean_partial(output_dir: &Path) -> Result<Vec<CleanedDir>, ClientError> {
    let mut temps: Vec<_> = match scan(output_dir, false) {
        Ok(entries) => entries.into_iter().filter(|e| e.temporary).collect(),
        Err(e) if e.source.kind() == io::ErrorKind::NotFound && e.path == output_dir => {
            return Ok(Vec::new());
        }
        Err(e) => return Err(ClientError::io(e.action, e.path, e.source)),
    };
    // New copies before replaced (`.old`) ones, so the newest data wins a restore.
    temps.sort_by_key(|e| {
        (
            parse_temp_name(&e.name).is_some_and(|t| t.old),
            e.name.clone(),
        )
    });
    let mut cleaned = Vec::new();
    for entry in temps {
        if let Some(to) = restore_target(output_dir, &entry) {
            fs::rename(&entry.dir, &to)
                .map_err(|e| ClientError::io("restore the complete checkpoint", &entry.dir, e))?;
            super::notice::notify(
                Notice::Info,
                &format!(
                    "checkpoint: restored {} to {} (its save was interrupted just before publishing)",
                    entry.dir.display(),
                    to.display()
                ),
            );
            cleaned.push(CleanedDir {
                path: entry.dir,
                action: CleanAction::Restored { to },
            });
        } else {
            fs::remove_dir_all(&entry.dir)
                .map_err(|e| ClientError::io("remove the partial checkpoint", &entry.dir, e))?;
            cleaned.push(CleanedDir {
                path: entry.dir,
                action: CleanAction::Removed,
            });
        }
    }
    if !cleaned.is_empty() {
        sync_dir(output_dir)
            .map_err(|e| ClientError::io("sync the output directory", output_dir, e))?;
    }
    Ok(cleaned)
}

fn restore_target(output_dir: &Path, entry: &CheckpointEntry) -> Option<PathBuf> {
    if !matches!(entry.status, CheckpointStatus::Complete(_)) {
        return None;
    }
    let target = parse_temp_name(&entry.name)?.target;
    CheckpointName::parse(&target)?;
    let to = output_dir.join(&target);
    match fs::symlink_metadata(&to) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Some(to),
        _ => None,
    }
}

/// An I/O failure while scanning, with what was being done and where.
#[derive(Debug)]
pub(crate) struct ScanError {
    pub action: &'static str,
    pub path: PathBuf,
    pub source: io::Error,
}

pub(crate) fn scan(
    output_dir: &Path,
    check_checksums: bool,
) -> Result<Vec<CheckpointEntry>, ScanError> {
    let err = |action, path: &Path| {
        let path = path.to_path_buf();
        move |source| ScanError {
            action,
            path,
            source,
        }
    };
    let read = fs::read_dir(output_dir).map_err(err("list the output directory", output_dir))?;
    let mut entries = Vec::new();
    for item in read {
        let item = item.map_err(err("list the output directory", output_dir))?;
        let dir = item.path();
        let is_dir = item.file_type().map_err(err("inspect", &dir))?.is_dir();
        let Some(name) = item.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if !is_dir {
            continue;
        }
        let (temporary, parsed) = if let Some(parsed) = CheckpointName::parse(&name) {
            (false, Some(parsed))
        } else if let Some(temp) = parse_temp_name(&name) {
            (true, CheckpointName::parse(&temp.target))
        } else {
            continue;
        };
        let status = inspect(&dir, check_checksums);
        let (step, epoch, size_bytes) = match &status {
            CheckpointStatus::Complete(m) => {
                (Some(m.meta.step), Some(m.meta.epoch), m.total_size())
            }
            _ => {
                let from_name = |kind| parsed.filter(|p| p.kind == kind).map(|p| p.number);
                (
                    from_name(NameKind::Step),
                    from_name(NameKind::Epoch),
                    dir_size_best_effort(&dir),
                )
            }
        };
        entries.push(CheckpointEntry {
            name,
            dir,
            temporary,
            step,
            epoch,
            size_bytes,
            status,
        });
    }
    entries.sort_by(|a, b| {
        (a.step.is_none(), a.step, a.epoch, &a.name).cmp(&(
            b.step.is_none(),
            b.step,
            b.epoch,
            &b.name,
        ))
    });
    Ok(entries)
}
