//! Typed errors of the checkpoint client. Every message names the path involved
//! and says what to do about it.

use std::io;
use std::path::PathBuf;
use thiserror::Error;

use super::meta::FORMAT_VERSION;

/// What a caller's writer closure returns when it cannot write its files.
#[derive(Debug, Error)]
pub enum WriteError {
    #[error("could not write {}: {source}{}", path.display(), io_hint(source))]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// An I/O error without a path (prefer [`WriteError::io`]).
    #[error("{source}{}", io_hint(source))]
    UnnamedIo {
        #[from]
        source: io::Error,
    },
    #[error("{0}")]
    Other(#[from] Box<dyn std::error::Error + Send + Sync>),
}

impl WriteError {
    pub fn io(path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    pub fn msg(message: impl Into<String>) -> Self {
        Self::Other(message.into().into())
    }
}

/// Why one save did not complete (the cause inside [`ClientError`]).
#[derive(Debug, Error)]
pub enum SaveFailure {
    #[error("the writer failed: {0}")]
    Writer(#[source] WriteError),
    #[error("the writer panicked: {message}")]
    WriterPanicked { message: String },
    #[error("the background save thread panicked: {message} (this is a bug in tune)")]
    ThreadPanicked { message: String },
    #[error("could not {action} {}: {source}{}", path.display(), io_hint(source))]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "the writer created {}, but that name is reserved for the checkpoint metadata; write the state under another name",
        path.display()
    )]
    ReservedName { path: PathBuf },
    #[error(
        "the writer created {}, which is not a regular file or directory (symlinks are not allowed in checkpoints)",
        path.display()
    )]
    NotARegularFile { path: PathBuf },
    #[error("the writer created {}, whose name is not valid UTF-8; use UTF-8 file names", path.display())]
    NonUtf8Path { path: PathBuf },
    #[error(
        "{} exists but is not a directory, so the checkpoint cannot be published there; move it out of the way",
        path.display()
    )]
    NotADirectory { path: PathBuf },
    #[error("could not serialize the checkpoint metadata for {}: {source}", path.display())]
    Metadata {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

impl SaveFailure {
    pub(crate) fn io(action: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Io {
            action,
            path: path.into(),
            source,
        }
    }
}

/// Errors of [`CheckpointClient`](super::CheckpointClient) and the discovery functions.
#[derive(Debug, Error)]
pub enum ClientError {
    #[error(
        "invalid checkpoint name {name:?}: use `step_<N>` or `epoch_<N>` (e.g. `step_120`, `epoch_0`)"
    )]
    InvalidName { name: String },
    #[error("invalid checkpoint option: {message}")]
    InvalidOption { message: String },
    #[error(
        "the background save of {name} failed: {cause}; no checkpoint was lost: {}",
        describe_last(last_complete.as_deref(), output_dir)
    )]
    BackgroundSaveFailed {
        name: String,
        output_dir: PathBuf,
        last_complete: Option<String>,
        #[source]
        cause: SaveFailure,
    },
    #[error(
        "saving checkpoint {name} failed: {cause}; no checkpoint was lost: {}",
        describe_last(last_complete.as_deref(), output_dir)
    )]
    SaveFailed {
        name: String,
        output_dir: PathBuf,
        last_complete: Option<String>,
        #[source]
        cause: SaveFailure,
    },
    #[error(
        "checkpoint {name} was saved to {}, but cleaning up older checkpoints failed: {cause}; nothing was lost, delete the leftovers by hand or free disk space",
        dir.display()
    )]
    CleanupFailed {
        name: String,
        dir: PathBuf,
        #[source]
        cause: SaveFailure,
    },
    #[error("could not start the background save thread for {name}: {source}")]
    SpawnFailed {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("output directory {} does not exist; check the path", path.display())]
    OutputDirNotFound { path: PathBuf },
    #[error("could not {action} {}: {source}{}", path.display(), io_hint(source))]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Verify(#[from] VerifyError),
}

impl ClientError {
    pub(crate) fn io(action: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Io {
            action,
            path: path.into(),
            source,
        }
    }
}

/// Why a checkpoint directory cannot be resumed from.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum VerifyError {
    #[error(
        "checkpoint {} is incomplete: {reason}; it cannot be resumed from: resume from an earlier complete checkpoint (see `tune checkpoints`) or delete it",
        dir.display()
    )]
    Incomplete { dir: PathBuf, reason: String },
    #[error(
        "checkpoint {} is corrupt: {reason}; do not resume from it: resume from an earlier complete checkpoint (see `tune checkpoints`) or delete it",
        dir.display()
    )]
    Corrupt { dir: PathBuf, reason: String },
    #[error(
        "checkpoint {} was written by a newer tune (format version {version}, this tune reads up to {FORMAT_VERSION}); upgrade tune to resume from it",
        dir.display()
    )]
    FromTheFuture { dir: PathBuf, version: u64 },
}

fn describe_last(last: Option<&str>, output_dir: &std::path::Path) -> String {
    match last {
        Some(name) => format!(
            "the last complete one is {name} ({}); fix the cause and save again, or resume from it",
            output_dir.join(name).display()
        ),
        None => format!(
            "there is no complete checkpoint in {} yet; fix the cause and save again",
            output_dir.display()
        ),
    }
}

/// A hint on what to do for the I/O errors users can fix themselves.
pub(crate) fn io_hint(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::PermissionDenied | io::ErrorKind::ReadOnlyFilesystem => {
            " (check that the directory is writable, or choose another one)"
        }
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded => {
            " (the disk is full: free space, lower keep_last_n_checkpoints, or choose another output_dir)"
        }
        _ => "",
    }
}
