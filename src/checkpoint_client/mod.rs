//! Asynchronous checkpoint client shared by all recipes.
//!
//! Saves never stall training longer than the caller's own host snapshot and
//! never lose work:
//!
//! * the caller snapshots state into a [`SaveRequest`] closure; [`CheckpointClient::save`]
//!   runs it on a background thread that writes into `<output_dir>/.tmp-<name>-<pid>`,
//!   fsyncs every file, records size + sha256 of each in `tune_checkpoint.json`
//!   (written last), and only then renames the directory to `<output_dir>/<name>`;
//! * at most one save is in flight; the next `save`/`wait` joins it and surfaces its
//!   failure as an error naming the last complete checkpoint;
//! * old checkpoints are pruned (`keep_last_n`) only after the new one is published;
//! * [`list_checkpoints`], [`verify`], [`latest_complete`] and [`clean_partial`] let
//!   the resume logic and `tune checkpoints` tell complete checkpoints from partial,
//!   corrupt or future-format ones. A directory without valid metadata is never
//!   resumed from.
//!
//! # Why a dedicated std thread rather than a tokio runtime
//!
//! The training loop is synchronous and the work (the caller's serializer, fsync,
//! hashing) is blocking file I/O, so a tokio runtime would only add a
//! `spawn_blocking` thread around the same code. Owning a runtime would also panic
//! when the client is created or dropped inside an async context (tokio refuses to
//! drop or `block_on` a runtime there). One `std::thread` per save, joined before
//! the next one starts, gives "at most one in flight", panic detection through
//! `JoinHandle::join`, and works identically from sync and async callers.

mod client;
mod discovery;
mod error;
mod fsutil;
mod meta;
mod notice;
mod prune;
mod report;
mod verify;
mod writer;

#[cfg(test)]
mod tests;

pub use client::{CheckpointClient, ClientOptions, SaveReport, SaveRequest};
pub use discovery::{
    CheckpointEntry, CleanAction, CleanedDir, clean_partial, latest_complete, latest_verified,
    list_checkpoints, list_checkpoints_verified,
};
pub(crate) use error::io_hint;
pub use error::{ClientError, SaveFailure, VerifyError, WriteError};
pub use meta::{
    CheckpointManifest, CheckpointMeta, CheckpointName, FORMAT_VERSION, FileRecord, METADATA_FILE,
    NameKind, PublishedCheckpoint,
};
pub use notice::{Notice, Notify, set_notify};
pub use report::{format_report, human_size};
pub use verify::{CheckpointStatus, inspect, verify};
pub use writer::WriterFn;
