//! How a worker's run ended, as the launcher needs to know it: a stop signal (every worker
//! stops at the same step, so the launcher waits for all of them), a failed collective call (a
//! peer may have died: on several nodes the launcher asks which), or any other failure. Each
//! error type a recipe returns says which of its own variants is which ([`Ends`]), so the
//! launcher asks the error instead of searching its causes.

use crate::interrupt::Signal;

/// How a worker's run ended, when it did not succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// A stop signal, acted on at a step boundary.
    Stopped(Signal),
    /// A collective call failed (a peer may have died).
    CollectiveFailed,
    /// Anything else.
    Failed,
}

/// An error that knows how it ends a worker's run.
pub trait Ends {
    fn ending(&self) -> Ending;
}

/// A recipe's error, as the worker that ran it hands it to the launcher: the error itself
/// (its message and causes are the error's own) and how it ended the run.
#[derive(Debug)]
pub struct WorkerError {
    pub ending: Ending,
    error: Box<dyn std::error::Error + Send + Sync>,
}

impl WorkerError {
    /// An error that is none of the recipes' typed ones (a thread that could not start).
    pub fn failed(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self {
            ending: Ending::Failed,
            error: error.into(),
        }
    }

    /// The stop signal that ended the run, when an orderly stop did.
    pub fn stop_signal(&self) -> Option<Signal> {
        match self.ending {
            Ending::Stopped(signal) => Some(signal),
            _ => None,
        }
    }
}

impl<E: Ends + std::error::Error + Send + Sync + 'static> From<E> for WorkerError {
    fn from(error: E) -> Self {
        Self {
            ending: error.ending(),
            error: Box::new(error),
        }
    }
}

impl std::fmt::Display for WorkerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

/// Transparent: the error's causes are the wrapped error's.
impl std::error::Error for WorkerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error.source()
    }
}

impl Ends for super::DistributedError {
    fn ending(&self) -> Ending {
        if self.is_transport() {
            Ending::CollectiveFailed
        } else {
            Ending::Failed
        }
    }
}

/// Errors that never come from a collective or a signal.
macro_rules! always_failed {
    ($($t:ty),* $(,)?) => {$(
        impl Ends for $t {
            fn ending(&self) -> Ending {
                Ending::Failed
            }
        }
    )*};
}
always_failed!(std::io::Error, crate::precision::PrecisionError);
