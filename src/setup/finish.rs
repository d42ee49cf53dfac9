//! How a run that trained ends: the error that says where to continue from
//! ([`FinishError`], [`ResumePoint`]), the closing report and the push to the Hub.

use crate::checkpoint_client::PublishedCheckpoint;
use crate::config::schema::PushToHub;
use crate::distributed::{Ending, Ends};
use crate::training::TrainError;
use crate::training::trainer::TrainSummary;

/// The end of a run that trained: the push is the only step after training that can fail
/// on its own.
#[derive(Debug, thiserror::Error)]
pub enum FinishError {
    #[error(transparent)]
    Train(#[from] TrainError),
    /// Training stopped after saving at least one checkpoint: where to continue from, and the
    /// command that does.
    #[error("{source}\n{resume}")]
    Stopped {
        source: TrainError,
        resume: Box<ResumePoint>,
    },
    /// A signal stopped a run that had saved nothing yet.
    #[error(
        "{source}; no checkpoint was saved yet (with save_on_preempt: True a signal saves one first)"
    )]
    StoppedUnsaved { source: TrainError },
    #[error("push_to_hub: {0}")]
    Push(#[from] crate::hub::HubError),
}

impl Ends for FinishError {
    fn ending(&self) -> Ending {
        match self {
            Self::Train(source)
            | Self::Stopped { source, .. }
            | Self::StoppedUnsaved { source } => source.ending(),
            Self::Push(_) => Ending::Failed,
        }
    }
}

/// Where a stopped run can continue from: its last complete checkpoint and the command.
#[derive(Debug)]
pub struct ResumePoint {
    pub last: std::path::PathBuf,
    pub command: String,
}

impl std::fmt::Display for ResumePoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "The last complete checkpoint is {}. Continue from it with:\n  {}",
            self.last.display(),
            self.command
        )
    }
}

/// This process's command line with `resume_from_checkpoint=True` in place of any value it
/// had, quoted for a POSIX shell.
pub fn resume_command(args: impl Iterator<Item = String>) -> String {
    let quote = |arg: &str| {
        let plain = !arg.is_empty()
            && arg
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-./=:,+@%~".contains(c));
        if plain {
            arg.to_string()
        } else {
            format!("'{}'", arg.replace('\'', r"'\''"))
        }
    };
    let mut words: Vec<String> = args
        .filter(|a| !a.starts_with("resume_from_checkpoint="))
        .map(|a| quote(&a))
        .collect();
    words.push("resume_from_checkpoint=True".into());
    words.join(" ")
}

/// The closing lines of a training run.
pub fn report(summary: &TrainSummary, last: Option<&PublishedCheckpoint>) {
    let first = summary.losses.first().copied().unwrap_or(f64::NAN);
    let last_loss = summary.losses.last().copied().unwrap_or(f64::NAN);
    crate::say!(
        "Trained {} steps ({} tokens): loss {first:.4} -> {last_loss:.4}",
        summary.state.global_step,
        summary.state.tokens_seen
    );
    if let Some(p) = last {
        crate::say!("Saved {}", p.dir.display());
    }
}

/// `push_to_hub: {repo_id, private}`: uploads the final checkpoint when the run finishes.
pub fn push_if_configured(
    push: Option<&PushToHub>,
    last: Option<&PublishedCheckpoint>,
) -> Result<(), crate::hub::HubError> {
    let (Some(push), Some(last)) = (push, last) else {
        return Ok(());
    };
    let report = crate::hub::push(crate::hub::PushOptions {
        dir: last.dir.clone(),
        repo_id: push.repo_id.clone(),
        private: push.private,
        commit_message: Some(format!("Upload {} trained with tune", last.name)),
        progress: true,
        ..Default::default()
    })?;
    crate::say!("Pushed {} to {}", last.dir.display(), report.repo_url);
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_resume_command_replaces_the_flag_and_quotes_what_the_shell_would_split() {
        let args = [
            "tune",
            "run",
            "lora_finetune_single_device",
            "--config",
            "my config.yaml",
            "resume_from_checkpoint=False",
            "dataset.source=it's",
        ];
        assert_eq!(
            super::resume_command(args.iter().map(|a| a.to_string())),
            r"tune run lora_finetune_single_device --config 'my config.yaml' 'dataset.source=it'\''s' resume_from_checkpoint=True"
        );
    }
}
