//! [`CheckpointClient`]: at most one background save in flight, failures
//! surfaced at the next call, nothing lost on drop.

use super::notice::Notice;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::discovery::latest_complete;
use super::error::{ClientError, SaveFailure, WriteError};
use super::meta::{CheckpointMeta, CheckpointName, PublishedCheckpoint};
use super::writer::{Job, JobOutcome, WriterFn, panic_message, run_job};

/// One checkpoint to save.
pub struct SaveRequest {
    /// `step_<N>` or `epoch_<N>`.
    pub name: String,
    pub meta: CheckpointMeta,
    pub writer: WriterFn,
}

impl SaveRequest {
    pub fn new(
        name: impl Into<String>,
        meta: CheckpointMeta,
        writer: impl FnOnce(&Path) -> Result<(), WriteError> + Send + 'static,
    ) -> Self {
        Self {
            name: name.into(),
            meta,
            writer: Box::new(writer),
        }
    }
}

impl fmt::Debug for SaveRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SaveRequest")
            .field("name", &self.name)
            .field("meta", &self.meta)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientOptions {
    /// Keep only this many newest complete checkpoints (`None`: keep all).
    pub keep_last_n: Option<usize>,
}

/// What a `save` call did.
#[derive(Debug, Clone, PartialEq)]
pub struct SaveReport {
    /// How long the call blocked on the previous in-flight save.
    pub waited: Duration,
    /// The previous in-flight save, now published (if there was one).
    pub previous: Option<PublishedCheckpoint>,
    /// This save, once published: always `Some` from `save_blocking`, `None`
    /// from `save` (it is still running; see `wait`).
    pub published: Option<PublishedCheckpoint>,
}

struct InFlight {
    name: String,
    handle: JoinHandle<JobOutcome>,
}

/// Saves checkpoints into one output directory, one at a time, in the background.
pub struct CheckpointClient {
    output_dir: PathBuf,
    options: ClientOptions,
    in_flight: Option<InFlight>,
    /// Name of the newest checkpoint known complete (for error messages).
    last_complete: Option<String>,
}

impl CheckpointClient {
    /// Creates `output_dir` if needed and remembers its latest complete
    /// checkpoint. `keep_last_n = Some(0)` is rejected.
    pub fn new(output_dir: PathBuf, options: ClientOptions) -> Result<Self, ClientError> {
        if options.keep_last_n == Some(0) {
            return Err(ClientError::InvalidOption {
                message: "keep_last_n must be at least 1 (or unset to keep every checkpoint)"
                    .to_string(),
            });
        }
        fs::create_dir_all(&output_dir)
            .map_err(|e| ClientError::io("create the output directory", &output_dir, e))?;
        let last_complete = latest_complete(&output_dir)?.map(|p| p.name);
        Ok(Self {
            output_dir,
            options,
            in_flight: None,
            last_complete,
        })
    }

    pub fn output_dir(&self) -> &Path {
        &self.output_dir
    }

    /// The newest checkpoint this client knows to be complete.
    pub fn last_complete(&self) -> Option<&str> {
        self.last_complete.as_deref()
    }

    /// Whether a save is in flight (not yet joined).
    pub fn is_saving(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Waits for the previous save (surfacing its failure, in which case this
    /// request is not started and is dropped), then starts this one in the
    /// background and returns at once.
    pub fn save(&mut self, request: SaveRequest) -> Result<SaveReport, ClientError> {
        validate_name(&request.name)?;
        let (waited, previous) = self.finish_in_flight()?;
        let name = request.name.clone();
        let job = self.job(request);
        let handle = thread::Builder::new()
            .name(format!("ckpt-{name}"))
            .spawn(move || run_job(job))
            .map_err(|source| ClientError::SpawnFailed {
                name: name.clone(),
                source,
            })?;
        self.in_flight = Some(InFlight { name, handle });
        Ok(SaveReport {
            waited,
            previous,
            published: None,
        })
    }

    /// Like [`save`](Self::save) but runs on the calling thread and returns once
    /// the checkpoint is published (for the final save).
    pub fn save_blocking(&mut self, request: SaveRequest) -> Result<SaveReport, ClientError> {
        validate_name(&request.name)?;
        let (waited, previous) = self.finish_in_flight()?;
        let name = request.name.clone();
        let outcome = run_job(self.job(request));
        let published = self.absorb(&name, outcome, false)?;
        Ok(SaveReport {
            waited,
            previous,
            published: Some(published),
        })
    }

    /// Waits for the in-flight save, if any; call at the end of training.
    pub fn wait(&mut self) -> Result<Option<PublishedCheckpoint>, ClientError> {
        Ok(self.finish_in_flight()?.1)
    }

    fn job(&self, request: SaveRequest) -> Job {
        Job {
            output_dir: self.output_dir.clone(),
            name: request.name,
            meta: request.meta,
            writer: request.writer,
            keep_last_n: self.options.keep_last_n,
        }
    }

    fn finish_in_flight(&mut self) -> Result<(Duration, Option<PublishedCheckpoint>), ClientError> {
        let Some(InFlight { name, handle }) = self.in_flight.take() else {
            return Ok((Duration::ZERO, None));
        };
        let start = Instant::now();
        let was_running = !handle.is_finished();
        let outcome = handle.join().unwrap_or_else(|payload| JobOutcome {
            result: Err(SaveFailure::ThreadPanicked {
                message: panic_message(&*payload),
            }),
            cleanup_error: None,
        });
        let waited = start.elapsed();
        if was_running {
            super::notice::notify(
                Notice::Info,
                &format!(
                    "checkpoint: waited {waited:.1?} for the background save of {name} to finish"
                ),
            );
        }
        let published = self.absorb(&name, outcome, true)?;
        Ok((waited, Some(published)))
    }

    fn absorb(
        &mut self,
        name: &str,
        outcome: JobOutcome,
        background: bool,
    ) -> Result<PublishedCheckpoint, ClientError> {
        match outcome.result {
            Ok(published) => {
                self.last_complete = Some(published.name.clone());
                match outcome.cleanup_error {
                    Some(cause) => Err(ClientError::CleanupFailed {
                        name: name.to_string(),
                        dir: published.dir,
                        cause,
                    }),
                    None => Ok(published),
                }
            }
            Err(cause) => {
                let (name, output_dir, last_complete) = (
                    name.to_string(),
                    self.output_dir.clone(),
                    self.last_complete.clone(),
                );
                Err(if background {
                    ClientError::BackgroundSaveFailed {
                        name,
                        output_dir,
                        last_complete,
                        cause,
                    }
                } else {
                    ClientError::SaveFailed {
                        name,
                        output_dir,
                        last_complete,
                        cause,
                    }
                })
            }
        }
    }
}

impl Drop for CheckpointClient {
    /// Never loses an in-flight save silently: blocks until it is published and
    /// logs a failure (call [`wait`](CheckpointClient::wait) to handle it instead).
    fn drop(&mut self) {
        if let Some(in_flight) = &self.in_flight
            && !in_flight.handle.is_finished()
        {
            super::notice::notify(
                Notice::Info,
                &format!(
                    "checkpoint: waiting for the background save of {} before exiting",
                    in_flight.name
                ),
            );
        }
        if let Err(e) = self.finish_in_flight() {
            super::notice::notify(Notice::Error, &format!("checkpoint: error: {e}"));
        }
    }
}

fn validate_name(name: &str) -> Result<(), ClientError> {
    match CheckpointName::parse(name) {
        Some(parsed) if parsed.to_string() == name => Ok(()),
        _ => Err(ClientError::InvalidName {
            name: name.to_string(),
        }),
    }
}
