//! SIGINT and SIGTERM (what a preemptible cluster sends before it kills a job) as a request to
//! stop at the next step boundary, where the trainer lets an in-flight save finish (or saves,
//! with `save_on_preempt`) and returns [`TrainError::Interrupted`](crate::training::TrainError). A second
//! signal exits at once: the checkpoint client publishes atomically, so that loses at most the
//! save in flight, never a published checkpoint.
//!
//! The handlers are process-wide and installed by the CLI ([`install`]) for training runs only;
//! a library user who installs none never sees a request.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);
static SIGNAL: AtomicUsize = AtomicUsize::new(0);

/// The signal that asked the run to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Interrupt,
    Terminate,
}

impl Signal {
    fn number(self) -> i32 {
        match self {
            Self::Interrupt => signal_hook::consts::SIGINT,
            Self::Terminate => signal_hook::consts::SIGTERM,
        }
    }

    /// The shell's convention for a process ended by this signal: 128 + its number.
    pub fn exit_code(self) -> u8 {
        128 + self.number() as u8
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Interrupt => "SIGINT",
            Self::Terminate => "SIGTERM",
        }
    }
}

impl std::fmt::Display for Signal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Installs the handlers: the first SIGINT or SIGTERM records a stop request; a second one
/// exits at once with 128 + its number.
pub fn install() -> std::io::Result<()> {
    for signal in [Signal::Interrupt, Signal::Terminate] {
        let number = signal.number();
        // The exit must be registered first: it runs before the flag is set, so it fires only
        // when an earlier signal set it.
        signal_hook::flag::register_conditional_shutdown(
            number,
            i32::from(signal.exit_code()),
            &REQUESTED,
        )?;
        signal_hook::flag::register_usize(number, &SIGNAL, number as usize)?;
        signal_hook::flag::register(number, &REQUESTED)?;
    }
    Ok(())
}

/// The signal that asked to stop, if one did.
pub fn requested() -> Option<Signal> {
    if !REQUESTED.load(Ordering::SeqCst) {
        return None;
    }
    Some(
        if SIGNAL.load(Ordering::SeqCst) == signal_hook::consts::SIGINT as usize {
            Signal::Interrupt
        } else {
            Signal::Terminate
        },
    )
}
