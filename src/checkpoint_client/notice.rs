//! Where the client's lines go (a save done, a checkpoint pruned, a directory left behind):
//! stderr unless the process routes them elsewhere ([`set_notify`]), as tune does to honour
//! its `log_level`. Kept here, not taken from the rest of the crate, so the client stays
//! self-contained.

use std::sync::RwLock;

/// How much a line matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notice {
    /// What happened (a save, a prune, a restore).
    Info,
    /// Something the user may have to act on (a directory to remove by hand).
    Warning,
    /// A failure nothing else reports (a background save that failed as the client dropped).
    Error,
}

/// Receives each line.
pub type Notify = fn(Notice, &str);

fn to_stderr(notice: Notice, line: &str) {
    match notice {
        Notice::Info => eprintln!("{line}"),
        Notice::Warning => eprintln!("warning: {line}"),
        Notice::Error => eprintln!("{line}"),
    }
}

static NOTIFY: RwLock<Notify> = RwLock::new(to_stderr);

/// Sends the client's lines to `notify` from now on.
pub fn set_notify(notify: Notify) {
    if let Ok(mut current) = NOTIFY.write() {
        *current = notify;
    }
}

pub(crate) fn notify(notice: Notice, line: &str) {
    let f = NOTIFY.read().map_or(to_stderr as Notify, |f| *f);
    f(notice, line);
}
