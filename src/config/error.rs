//! Error and warning types. Load errors ([`ConfigError`]) stop at the first failure
//! because nothing can be checked without a parsed tree; validation collects every
//! [`Problem`] into [`ValidationErrors`] so a user fixes a config in one pass.

use std::fmt;
use std::path::PathBuf;

/// Failure to produce a resolved YAML tree (reading, parsing, overriding, interpolating).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Shipped(#[from] crate::config::shipped::ShippedError),
    #[error("config `{name}` is neither a built-in config nor an existing file{hint}")]
    NotFound { name: String, hint: String },
    #[error("cannot read config file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("YAML syntax error in {source_name} at line {line}, column {column}: {message}")]
    Syntax {
        source_name: String,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("{source_name}: the top level of a config must be a mapping of keys to values")]
    NotAMapping { source_name: String },
    #[error("bad override `{arg}`: {reason}")]
    BadOverride { arg: String, reason: String },
    #[error("`{key}`: interpolation `${{{reference}}}` refers to a key that does not exist")]
    MissingReference { key: String, reference: String },
    #[error("`{key}`: interpolation cycle: {}", chain.join(" -> "))]
    InterpolationCycle { key: String, chain: Vec<String> },
    #[error("`{key}`: bad interpolation `{text}`: {reason}")]
    BadInterpolation {
        key: String,
        text: String,
        reason: String,
    },
}

/// What kind of mistake a [`Problem`] is; lets callers and tests match without parsing text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProblemKind {
    UnknownKey,
    WrongType,
    MissingKey,
    UnknownComponent,
    WrongComponentKind,
    UnsupportedComponent,
    MissingPath,
    InvalidValue,
    UnknownRecipe,
}

/// One thing wrong with a config, located by its dotted key path.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub kind: ProblemKind,
    /// Dotted key path, e.g. `model.lora_rank` or `dataset.1.source` (list index).
    pub key: String,
    pub message: String,
    /// How to fix it, when there is something concrete to say.
    pub fix: Option<String>,
}

impl Problem {
    pub fn new(kind: ProblemKind, key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            kind,
            key: key.into(),
            message: message.into(),
            fix: None,
        }
    }

    pub fn with_fix(mut self, fix: impl Into<String>) -> Self {
        let fix = fix.into();
        self.fix = (!fix.is_empty()).then_some(fix);
        self
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.message)?;
        if let Some(fix) = &self.fix {
            write!(f, " ({fix})")?;
        }
        Ok(())
    }
}

/// Every problem found in one config. `Display` prints one problem per line.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub struct ValidationErrors {
    /// File path or built-in config name the config came from.
    pub source_name: String,
    pub problems: Vec<Problem>,
}

impl ValidationErrors {
    /// True if any problem has this key and its message contains `needle` (handy in tests).
    pub fn has(&self, key: &str, needle: &str) -> bool {
        self.problems
            .iter()
            .any(|p| p.key == key && p.to_string().contains(needle))
    }
}

impl fmt::Display for ValidationErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.problems.len();
        write!(
            f,
            "{}: {n} problem{}",
            self.source_name,
            if n == 1 { "" } else { "s" }
        )?;
        for p in &self.problems {
            write!(f, "\n  {}: {p}", self.source_name)?;
        }
        Ok(())
    }
}

/// An option that is accepted but not (fully) honoured; shown to the user, never dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    pub key: String,
    pub message: String,
}

impl Warning {
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}
