//! Errors at the CLI edge and their exit codes: 2 for bad input (config, arguments), 1 for a
//! run that failed.

#[derive(Debug)]
pub enum CliError {
    /// The user's input is wrong: exit code 2.
    BadInput(anyhow::Error),
    /// The run failed: exit code 1.
    Failed(anyhow::Error),
    /// A signal stopped the run in order: 128 + the signal's number, as the shell reports it.
    Stopped(anyhow::Error, u8),
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::BadInput(_) => 2,
            Self::Failed(_) => 1,
            Self::Stopped(_, code) => *code,
        }
    }

    pub fn bad(e: impl Into<anyhow::Error>) -> Self {
        Self::BadInput(e.into())
    }

    pub fn failed(e: impl Into<anyhow::Error>) -> Self {
        Self::Failed(e.into())
    }

    /// One line per cause, without a backtrace.
    pub fn render(&self) -> String {
        let e = match self {
            Self::BadInput(e) | Self::Failed(e) => e,
            Self::Stopped(e, _) => return format!("{e}"),
        };
        let mut out = format!("error: {e}");
        for cause in e.chain().skip(1) {
            let text = cause.to_string();
            if !out.contains(&text) {
                out.push_str(&format!("\n  caused by: {text}"));
            }
        }
        out
    }
}
