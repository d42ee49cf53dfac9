//! How much tune says on stderr: the config's `log_level` (torchtune's key, Python's level
//! names). `Info` is the default: a run's start-up lines, resume and save notices; `Debug` adds
//! what each stage loaded and wrote; `Warn` keeps warnings and errors; `Error` errors only.
//! Errors always print: the CLI renders them (`cli::exit`), not through here.
//!
//! Why a process-wide level: the lines come from every layer (setup, the trainer, the
//! checkpoint client's background writer), and threading a logger through each would add a
//! parameter to every constructor for one number.

use std::sync::atomic::{AtomicU8, Ordering};

/// A level, from the quietest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
}

static LEVEL: AtomicU8 = AtomicU8::new(LogLevel::Info as u8);

/// Sets the level for the rest of the process.
pub fn set(level: LogLevel) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

/// The current level.
pub fn level() -> LogLevel {
    match LEVEL.load(Ordering::Relaxed) {
        0 => LogLevel::Error,
        1 => LogLevel::Warn,
        2 => LogLevel::Info,
        _ => LogLevel::Debug,
    }
}

/// Whether lines of `level` print.
pub fn enabled(level: LogLevel) -> bool {
    level <= self::level()
}

/// An informational line on stderr (a run's start, a resume, a save), unless `log_level` is
/// `WARN` or `ERROR`.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {
        if $crate::verbosity::enabled($crate::verbosity::LogLevel::Info) {
            eprintln!($($arg)*);
        }
    };
}

/// A detail line on stderr, with `log_level: DEBUG` only.
#[macro_export]
macro_rules! say_debug {
    ($($arg:tt)*) => {
        if $crate::verbosity::enabled($crate::verbosity::LogLevel::Debug) {
            eprintln!("debug: {}", format_args!($($arg)*));
        }
    };
}

/// A warning on stderr (`warning: ...`), unless `log_level` is `ERROR`.
#[macro_export]
macro_rules! say_warn {
    ($($arg:tt)*) => {
        if $crate::verbosity::enabled($crate::verbosity::LogLevel::Warn) {
            eprintln!("warning: {}", format_args!($($arg)*));
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_level_lets_through_itself_and_what_is_quieter() {
        let before = level();
        set(LogLevel::Warn);
        assert!(enabled(LogLevel::Error) && enabled(LogLevel::Warn));
        assert!(!enabled(LogLevel::Info) && !enabled(LogLevel::Debug));
        set(LogLevel::Debug);
        assert!(enabled(LogLevel::Info) && enabled(LogLevel::Debug));
        set(before);
    }
}
