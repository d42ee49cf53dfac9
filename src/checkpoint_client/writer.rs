//! One save, start to finish: temp dir, caller's writer, fsync + checksums,
//! metadata last, atomic rename, prune. Runs on the background thread (or inline
//! for `save_blocking`).

use super::notice::Notice;
use std::fs::{self, File};
use std::io::{self, Write};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::error::{SaveFailure, WriteError};
use super::fsutil::{WalkEntry, sync_and_hash_file, sync_dir, walk};
use super::meta::{
    CheckpointManifest, CheckpointMeta, FORMAT_VERSION, FileRecord, METADATA_FILE,
    PublishedCheckpoint, aside_dir_name, temp_dir_name,
};
use super::prune::prune;
use super::report::human_size;

/// The caller's serializer: writes the (already snapshotted) state into the
/// directory it is given. Nested directories are allowed; the name
/// `tune_checkpoint.json` at the top is reserved.
pub type WriterFn = Box<dyn FnOnce(&Path) -> Result<(), WriteError> + Send>;

/// Result of one save job.
#[derive(Debug)]
pub(crate) struct JobOutcome {
    /// Whether the checkpoint was published.
    pub result: Result<PublishedCheckpoint, SaveFailure>,
    /// A failure after publishing (removing the replaced copy, pruning): the new
    /// checkpoint is complete, but the error must still reach the caller.
    pub cleanup_error: Option<SaveFailure>,
}

pub(crate) struct Job {
    pub output_dir: PathBuf,
    pub name: String,
    pub meta: CheckpointMeta,
    pub writer: WriterFn,
    pub keep_last_n: Option<usize>,
}

/// The parts of a [`Job`] that stay borrowed while the writer is consumed.
struct JobInfo<'a> {
    output_dir: &'a Path,
    name: &'a str,
    meta: &'a CheckpointMeta,
}

pub(crate) fn run_job(job: Job) -> JobOutcome {
    let started = Instant::now();
    let pid = std::process::id();
    let Job {
        output_dir,
        name,
        meta,
        writer,
        keep_last_n,
    } = job;
    let temp = output_dir.join(temp_dir_name(&name, pid));
    let info = JobInfo {
        output_dir: &output_dir,
        name: &name,
        meta: &meta,
    };
    let published = match write_and_publish(&info, writer, &temp, pid) {
        Ok(p) => p,
        Err(failure) => {
            remove_temp(&temp);
            return JobOutcome {
                result: Err(failure),
                cleanup_error: None,
            };
        }
    };
    super::notice::notify(
        Notice::Info,
        &format!(
            "checkpoint: saved {} to {} ({} in {:.1?})",
            name,
            published.published.dir.display(),
            human_size(published.published.manifest.total_size()),
            started.elapsed()
        ),
    );
    let mut cleanup_error = None;
    if let Some(aside) = &published.replaced
        && let Err(e) = fs::remove_dir_all(aside).and_then(|()| sync_dir(&output_dir))
    {
        cleanup_error = Some(SaveFailure::io("remove the replaced copy", aside, e));
    }
    if cleanup_error.is_none()
        && let Some(keep) = keep_last_n
    {
        match prune(&output_dir, keep, &name) {
            Ok(removed) => {
                for dir in removed {
                    super::notice::notify(
                        Notice::Info,
                        &format!(
                            "checkpoint: removed {} (keep_last_n = {keep})",
                            dir.display()
                        ),
                    );
                }
            }
            Err(e) => cleanup_error = Some(e),
        }
    }
    JobOutcome {
        result: Ok(published.published),
        cleanup_error,
    }
}

struct Published {
    published: PublishedCheckpoint,
    /// The previous copy of the same name, moved aside, still to be deleted.
    replaced: Option<PathBuf>,
}

fn write_and_publish(
    job: &JobInfo<'_>,
    writer: WriterFn,
    temp: &Path,
    pid: u32,
) -> Result<Published, SaveFailure> {
    let out = job.output_dir;
    fs::create_dir_all(out).map_err(|e| SaveFailure::io("create the output directory", out, e))?;
    // A leftover from a crashed process that had the same pid: never ours to keep.
    match fs::symlink_metadata(temp) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(temp),
        Ok(_) => fs::remove_file(temp),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
    .map_err(|e| SaveFailure::io("remove the stale temporary directory", temp, e))?;
    fs::create_dir(temp).map_err(|e| SaveFailure::io("create the temporary directory", temp, e))?;

    run_writer(writer, temp)?;

    let files = sync_and_record(temp)?;
    let manifest = CheckpointManifest {
        format_version: FORMAT_VERSION,
        meta: job.meta.clone(),
        created_unix: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        files,
    };
    let meta_path = temp.join(METADATA_FILE);
    let json = serde_json::to_vec_pretty(&manifest).map_err(|source| SaveFailure::Metadata {
        path: meta_path.clone(),
        source,
    })?;
    write_synced(&meta_path, &json)
        .map_err(|e| SaveFailure::io("write the checkpoint metadata", &meta_path, e))?;
    sync_dir(temp).map_err(|e| SaveFailure::io("sync the directory", temp, e))?;

    let final_dir = out.join(job.name);
    let replaced = publish(temp, &final_dir, &out.join(aside_dir_name(job.name, pid)))?;
    sync_dir(out).map_err(|e| SaveFailure::io("sync the output directory", out, e))?;
    Ok(Published {
        published: PublishedCheckpoint {
            name: job.name.to_string(),
            dir: final_dir,
            manifest,
        },
        replaced,
    })
}

/// Runs the caller's writer in `temp`, turning a panic into an error.
fn run_writer(writer: WriterFn, temp: &Path) -> Result<(), SaveFailure> {
    match catch_unwind(AssertUnwindSafe(|| writer(temp))) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(SaveFailure::Writer(e)),
        Err(payload) => Err(SaveFailure::WriterPanicked {
            message: panic_message(&*payload),
        }),
    }
}

pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
}

/// fsyncs every file and directory the writer created and records size + sha256
/// of every file.
fn sync_and_record(temp: &Path) -> Result<Vec<FileRecord>, SaveFailure> {
    let entries = walk(temp).map_err(|e| SaveFailure::io("list the files written to", temp, e))?;
    let mut files = Vec::new();
    for entry in entries {
        match entry {
            WalkEntry::Dir { path } => {
                sync_dir(&path).map_err(|e| SaveFailure::io("sync the directory", &path, e))?;
            }
            WalkEntry::File { path, relative } => {
                let relative =
                    relative.ok_or_else(|| SaveFailure::NonUtf8Path { path: path.clone() })?;
                if relative == METADATA_FILE {
                    return Err(SaveFailure::ReservedName { path });
                }
                let (size, sha256) = sync_and_hash_file(&path)
                    .map_err(|e| SaveFailure::io("sync and checksum", &path, e))?;
                files.push(FileRecord {
                    path: relative,
                    size,
                    sha256,
                });
            }
            WalkEntry::Other { path } => return Err(SaveFailure::NotARegularFile { path }),
        }
    }
    Ok(files)
}

fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = File::create(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// Renames `temp` to `final_dir`. An existing `final_dir` (a resumed run saving
/// the same step again) is first moved to `aside` and returned for deletion by
/// the caller once the new copy is in place; if the second rename fails the old
/// copy is moved back.
fn publish(temp: &Path, final_dir: &Path, aside: &Path) -> Result<Option<PathBuf>, SaveFailure> {
    let replaced = match fs::symlink_metadata(final_dir) {
        Ok(m) if m.is_dir() => {
            if fs::symlink_metadata(aside).is_ok() {
                fs::remove_dir_all(aside)
                    .map_err(|e| SaveFailure::io("remove the stale directory", aside, e))?;
            }
            fs::rename(final_dir, aside)
                .map_err(|e| SaveFailure::io("move aside the previous copy", final_dir, e))?;
            Some(aside.to_path_buf())
        }
        Ok(_) => {
            return Err(SaveFailure::NotADirectory {
                path: final_dir.to_path_buf(),
            });
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(SaveFailure::io("inspect", final_dir, e)),
    };
    if let Err(e) = fs::rename(temp, final_dir) {
        if let Some(aside) = &replaced
            && let Err(back) = fs::rename(aside, final_dir)
        {
            super::notice::notify(
                Notice::Warning,
                &format!(
                    "checkpoint: could not move {} back to {}: {back}; rename it by hand",
                    aside.display(),
                    final_dir.display()
                ),
            );
        }
        return Err(SaveFailure::io("publish the checkpoint as", final_dir, e));
    }
    Ok(replaced)
}

/// Removes a failed save's temporary directory; a failure here is only logged
/// (the directory shows up as incomplete in `tune checkpoints` and
/// `clean_partial` removes it later).
fn remove_temp(temp: &Path) {
    match fs::remove_dir_all(temp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => super::notice::notify(
            Notice::Warning,
            &format!(
                "checkpoint: could not remove the temporary directory {}: {e}; remove it by hand",
                temp.display()
            ),
        ),
    }
}
