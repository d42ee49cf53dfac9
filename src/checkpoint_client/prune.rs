//! `keep_last_n`: deleting old checkpoints, only after a new one is published.

use std::fs;
use std::path::PathBuf;

use super::discovery::{ScanError, scan};
use super::error::SaveFailure;
use super::fsutil::sync_dir;
use super::verify::CheckpointStatus;

/// Keeps the newest `keep` complete checkpoints in `output_dir` (by step, then
/// creation time, then name) and deletes the other complete ones. Guarantees:
/// `just_published` is always kept, and nothing newer than it is ever deleted
/// (a run resumed from an early checkpoint does not wipe later ones). Incomplete,
/// corrupt, future-format and temporary directories are never touched here.
/// Returns the deleted directories.
pub(crate) fn prune(
    output_dir: &std::path::Path,
    keep: usize,
    just_published: &str,
) -> Result<Vec<PathBuf>, SaveFailure> {
    let entries = scan(output_dir, false).map_err(
        |ScanError {
             action,
             path,
             source,
         }| SaveFailure::io(action, path, source),
    )?;
    let mut complete: Vec<_> = entries
        .into_iter()
        .filter(|e| !e.temporary)
        .filter_map(|e| match &e.status {
            CheckpointStatus::Complete(m) => {
                Some(((m.meta.step, m.created_unix, e.name.clone()), e))
            }
            _ => None,
        })
        .collect();
    let Some(new_key) = complete
        .iter()
        .find(|(_, e)| e.name == just_published)
        .map(|(k, _)| k.clone())
    else {
        // The new checkpoint does not look complete: delete nothing.
        return Ok(Vec::new());
    };
    complete.sort_by(|a, b| b.0.cmp(&a.0));
    let mut removed = Vec::new();
    for (rank, (key, entry)) in complete.into_iter().enumerate() {
        if rank < keep || entry.name == just_published || key > new_key {
            continue;
        }
        fs::remove_dir_all(&entry.dir)
            .map_err(|e| SaveFailure::io("remove the old checkpoint", &entry.dir, e))?;
        removed.push(entry.dir);
    }
    if !removed.is_empty() {
        sync_dir(output_dir)
            .map_err(|e| SaveFailure::io("sync the output directory", output_dir, e))?;
    }
    Ok(removed)
}
