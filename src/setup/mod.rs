//! Turns validated config sections into library objects: models, tokenizers, datasets,
//! optimizers, schedules and metric loggers. Recipes call these; nothing here knows recipes.

pub mod adapters;
pub mod architecture;
pub mod data;
pub mod finish;
pub mod grpo;
pub mod logging;
pub mod loss;
pub mod model;
pub mod model_error;
pub mod optim;
pub mod ppo;
pub mod quant;
pub mod run;
pub mod session;
pub mod teacher;
pub mod trainer;

use std::path::PathBuf;

/// A setup failure, naming the config key involved and what to change.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("{key}: {source}")]
    Model {
        key: &'static str,
        source: crate::models::ModelError,
    },
    #[error("{key}: {source}")]
    Checkpoint {
        key: &'static str,
        source: crate::checkpoint::CheckpointError,
    },
    #[error("tokenizer.path: {0}")]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// `key`: which of `tokenizer.path`, `tokenizer_json_path` or `vocab_path` named it.
    #[error("{key}: {source}")]
    TokenizerFile {
        key: &'static str,
        source: crate::config::paths::PathError,
    },
    #[error("tokenizer.special_tokens_path {}: {problem}", path.display())]
    SpecialTokens {
        path: PathBuf,
        problem: data::SpecialTokensError,
    },
    /// `tokenizer.merges_path` (or `merges_file`) is not the merges of the tokenizer.json read.
    #[error("{key} {}: {problem}", path.display())]
    Merges {
        key: &'static str,
        path: PathBuf,
        problem: String,
    },
    #[error("dataset: {0}")]
    Data(#[from] crate::data::DataError),
    /// A vision-language checkpoint's processor settings (preprocessor_config.json).
    #[error("checkpointer.checkpoint_dir: {0}")]
    Preprocessor(#[from] crate::vision::preprocessor::PreprocessorError),
    #[error("checkpointer.checkpoint_dir {}: {message}", dir.display())]
    Processor { dir: PathBuf, message: String },
    #[error("dataset.source: {0}")]
    DatasetFetch(crate::hub::HubError),
    #[error(
        "dataset_val: the validation set has {samples} samples, too few for one batch of batch_size_val={batch_size} on each of {world_size} worker(s); lower batch_size_val or add data"
    )]
    TooLittleValidationData {
        samples: usize,
        batch_size: usize,
        world_size: usize,
    },
    #[error(transparent)]
    ModelConfig(#[from] model_error::ModelConfigError),
    #[error(transparent)]
    Teacher(#[from] teacher::TeacherError),
    #[error(transparent)]
    Quant(#[from] quant::QuantError),
    /// Boxed: a training error is much larger than every other setup failure.
    #[error(transparent)]
    Train(Box<crate::training::TrainError>),
    #[error(transparent)]
    Distributed(#[from] crate::distributed::DistributedError),
    /// Boxed: a reward's error carries its command and its output.
    #[error(transparent)]
    Reward(Box<grpo::RewardSetupError>),
    /// A recipe that does not train was handed to the training prologue (a bug in tune).
    #[error("recipe `{recipe}` does not train (a bug in tune: please report it)")]
    NotTraining { recipe: &'static str },
    #[error(
        "data_parallel_shard_dim: {dim} with {world} ranks: tune shards the weights over every rank (-1, or {world}) or over none (1); groups of ranks (HSDP) are not supported"
    )]
    ShardDim { dim: i64, world: usize },
    /// `key`: the config key that chose the directory (`output_dir`, `checkpointer.output_dir`).
    #[error(
        "{key} {}: another run is using it ({holder}); wait for it to finish, or set a different {key}",
        dir.display()
    )]
    Locked {
        key: &'static str,
        dir: PathBuf,
        holder: String,
    },
    /// Two models' checkpoints (PPO's policy and value model) would go to one directory.
    #[error(
        "{second} {} is also {first}: the policy's and the value model's checkpoints would overwrite each other; set a different {second} (torchtune's configs use `${{output_dir}}/value`)",
        dir.display()
    )]
    SameCheckpointDir {
        dir: PathBuf,
        first: &'static str,
        second: &'static str,
    },
    #[error(
        "output_dir {} holds checkpoints of another run ({} differs in: {}). Continue that run with resume_from_checkpoint=True (with those keys as they were), choose a new output_dir, or set overwrite_output_dir=True to delete its checkpoints and start over",
        dir.display(),
        checkpoint.display(),
        changed.join(", ")
    )]
    OtherRun {
        dir: PathBuf,
        checkpoint: PathBuf,
        changed: Vec<String>,
    },
    /// `what`: the config key or file the path came from, so the user knows what to change.
    #[error("{what} {}: {source}{}", path.display(), crate::checkpoint_client::io_hint(source))]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

impl crate::distributed::Ends for SetupError {
    fn ending(&self) -> crate::distributed::Ending {
        match self {
            Self::Distributed(e) => e.ending(),
            Self::Train(e) => e.ending(),
            _ => crate::distributed::Ending::Failed,
        }
    }
}

impl crate::distributed::Ends for quant::QuantError {
    fn ending(&self) -> crate::distributed::Ending {
        crate::distributed::Ending::Failed
    }
}

impl From<crate::training::TrainError> for SetupError {
    fn from(e: crate::training::TrainError) -> Self {
        Self::Train(Box::new(e))
    }
}

#[cfg(test)]
mod tests {
    use super::SetupError;
    use super::finish::FinishError;
    use crate::distributed::{DistributedError, Ending, WorkerError};
    use crate::interrupt::Signal;
    use crate::training::TrainError;

    /// The launcher learns how a worker's run ended from the error itself, however deep the
    /// stop or the failed collective call sits.
    #[test]
    fn a_stop_or_a_failed_collective_ends_the_worker_as_such_through_every_wrapper() {
        let stop = || TrainError::Interrupted {
            signal: Signal::Interrupt,
            step: 3,
        };
        let collective = || DistributedError::AllReduce {
            rank: 1,
            what: "gradients",
            detail: "peer gone".into(),
        };
        let ending = |e: WorkerError| e.ending;
        assert_eq!(ending(stop().into()), Ending::Stopped(Signal::Interrupt));
        assert_eq!(
            ending(FinishError::StoppedUnsaved { source: stop() }.into()),
            Ending::Stopped(Signal::Interrupt)
        );
        assert_eq!(
            ending(SetupError::from(TrainError::Distributed(collective())).into()),
            Ending::CollectiveFailed
        );
        assert_eq!(
            ending(FinishError::Train(TrainError::Distributed(collective())).into()),
            Ending::CollectiveFailed
        );
        // Workers that refuse each other's config did not lose a peer.
        let mismatch = DistributedError::Mismatch {
            rank: 1,
            what: "config",
        };
        assert_eq!(ending(SetupError::from(mismatch).into()), Ending::Failed);
        assert_eq!(
            ending(
                TrainError::TooLittleData {
                    batches: 1,
                    batch_size: 4,
                    accum: 2
                }
                .into()
            ),
            Ending::Failed
        );
        // The message is the error's own.
        let e = WorkerError::from(stop());
        assert_eq!(e.to_string(), "stopped by SIGINT at the end of step 3");
    }
}
