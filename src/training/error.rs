//! How training fails: the divergence guard's findings, and every error a training step,
//! validation or a checkpoint can end a run with.

use std::path::PathBuf;

use crate::checkpoint_client::WriteError;
use crate::distributed::DistributedError;

/// What the divergence guard caught.
#[derive(Debug, Clone, PartialEq)]
pub enum Divergence {
    NonFiniteLoss(f64),
    /// The step's loss is more than [`EXPLODING_LOSS_FACTOR`] times the run's first (or 1).
    ExplodingLoss {
        loss: f64,
        first: f64,
    },
    /// The norm of the step's mean gradient: non-finite, or over [`MAX_GRAD_NORM`].
    Gradients(f64),
    /// A trained weight about to be saved: non-finite, or over [`MAX_WEIGHT`] in magnitude.
    Weight {
        name: String,
        value: f32,
    },
    /// As `Weight`, in rows of a sharded weight that another rank holds.
    WeightOnAnotherRank {
        name: String,
    },
}

/// A step whose loss exceeds this many times the run's first loss (or 1, if larger) has
/// diverged: a cross-entropy starts near ln(vocabulary) and falls.
pub const EXPLODING_LOSS_FACTOR: f64 = 100.0;
/// The largest norm of a step's mean gradient that is still training (norms of a healthy
/// fine-tune are well under 100; clipping bounds the update, not the gradient).
pub const MAX_GRAD_NORM: f64 = 1e6;
/// The largest magnitude of a saved trained weight (trained weights stay well under 100).
pub const MAX_WEIGHT: f32 = 1e6;

impl std::fmt::Display for Divergence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NonFiniteLoss(v) => write!(f, "the loss became {v}"),
            Self::ExplodingLoss { loss, first } => write!(
                f,
                "the loss became {loss:.4e}, over {EXPLODING_LOSS_FACTOR} times the first step's ({first:.4})"
            ),
            Self::Gradients(norm) if norm.is_finite() => write!(
                f,
                "the gradient norm became {norm:.3e} (over {MAX_GRAD_NORM:e})"
            ),
            Self::Gradients(norm) => write!(f, "the gradient norm became {norm}"),
            Self::Weight { name, value } => write!(f, "the weight {name} holds {value:e}"),
            Self::WeightOnAnotherRank { name } => write!(
                f,
                "another rank's rows of the weight {name} hold a value that is not finite or over {MAX_WEIGHT:e}"
            ),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(
        "training diverged at step {step} (epoch {epoch}): {cause}; training stopped before saving anything from it. Lower optimizer.lr, set clip_grad_norm, or check the data"
    )]
    Diverged {
        cause: Divergence,
        step: usize,
        epoch: usize,
    },
    /// A task on the device's own thread failed during the step (see `device::DeviceFault`):
    /// its losses and weights are not what the step computes.
    #[error(
        "step {step} did not run as computed: {fault}. Training stopped before saving anything from it"
    )]
    DeviceFailed {
        fault: crate::device::DeviceFault,
        step: usize,
    },
    #[error("stopped by {signal} at the end of step {step}")]
    Interrupted {
        signal: crate::interrupt::Signal,
        step: usize,
    },
    #[error(
        "the dataset yields {batches} batches of {batch_size}, fewer than gradient_accumulation_steps ({accum}): lower batch_size or gradient_accumulation_steps, or add data"
    )]
    TooLittleData {
        batches: usize,
        batch_size: usize,
        accum: usize,
    },
    /// Boxed, as `Checkpoint`: data errors carry a path and the row's details.
    #[error("data: {0}")]
    Data(Box<crate::data::DataError>),
    #[error(
        "the batch at step {step} holds token id {id}, but the model's vocabulary has {vocab_size} entries: the tokenizer does not match the model (check tokenizer.path against checkpointer.checkpoint_dir)"
    )]
    TokenOutOfVocabulary {
        id: i64,
        vocab_size: usize,
        step: usize,
    },
    #[error(transparent)]
    Metrics(#[from] super::metrics::MetricsError),
    /// Boxed: the checkpoint client's errors carry paths and sources.
    #[error(transparent)]
    Checkpoint(Box<CheckpointingError>),
    #[error(transparent)]
    Distributed(#[from] DistributedError),
    /// DPO scores chosen rows then rejected rows; an odd number of rows is no set of pairs.
    #[error(
        "DPO needs a preference dataset (chosen rows then rejected rows in each batch), but a batch has {rows} rows; use a preference dataset such as torchtune.datasets.stack_exchange_paired_dataset or preference_dataset"
    )]
    NotPreferencePairs { rows: usize },
    /// A GRPO step's sampling, rewards or advantages (boxed: it carries the reward's error).
    #[error("GRPO: {0}")]
    Rollout(Box<RolloutError>),
}

impl crate::distributed::Ends for TrainError {
    fn ending(&self) -> crate::distributed::Ending {
        match self {
            Self::Interrupted { signal, .. } => crate::distributed::Ending::Stopped(*signal),
            Self::Distributed(e) => e.ending(),
            _ => crate::distributed::Ending::Failed,
        }
    }
}

impl From<crate::data::DataError> for TrainError {
    fn from(e: crate::data::DataError) -> Self {
        Self::Data(Box::new(e))
    }
}

impl From<CheckpointingError> for TrainError {
    fn from(e: CheckpointingError) -> Self {
        Self::Checkpoint(Box::new(e))
    }
}

/// Saving or resuming a training checkpoint failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointingError {
    /// The checkpoint client: writing, publishing, finding or cleaning up checkpoints.
    #[error(transparent)]
    Client(#[from] crate::checkpoint_client::ClientError),
    /// Reading or converting tensors (the optimizer state, the quantized export).
    #[error(transparent)]
    Tensors(#[from] crate::checkpoint::CheckpointError),
    #[error("the quantized export needs a weight-quantizing scheme")]
    NoQuantizedWeights,
    #[error("{}: not a tune training checkpoint ({source})", dir.display())]
    NotTune {
        dir: PathBuf,
        source: serde_json::Error,
    },
    #[error(
        "cannot resume from {}: the config changed since it was written ({}); restore those keys, or set a new output_dir to start over",
        dir.display(),
        changed.join(", ")
    )]
    ConfigChanged { dir: PathBuf, changed: Vec<String> },
    /// A second model's checkpoint (PPO's value model) that must go with the run's.
    #[error(
        "cannot resume: {} has no complete checkpoint of the value model to go with the policy's {} ({source}); restore it, or remove the policy's {} to resume from the checkpoint before",
        dir.display(),
        name,
        name
    )]
    MissingCompanion {
        dir: PathBuf,
        name: String,
        #[source]
        source: crate::checkpoint_client::VerifyError,
    },
    #[error("rank {rank}: writing its files of the checkpoint: {source}")]
    Shard {
        rank: usize,
        #[source]
        source: WriteError,
    },
}

/// What a GRPO step could not do besides training.
#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    #[error("sampling completions of dataset row {row}: {source}")]
    Generate {
        row: usize,
        #[source]
        source: crate::generation::GenerateError,
    },
    #[error("decoding a completion of dataset row {row}: {message}")]
    Decode { row: usize, message: String },
    #[error("scoring the completions of step {step}: {source}")]
    Reward {
        step: usize,
        #[source]
        source: crate::rewards::RewardError,
    },
    #[error(transparent)]
    Loss(#[from] super::grpo_loss::GrpoLossError),
    /// A state the recipe's own steps rule out (a bug in tune, not in the config or data).
    #[error("{0} (a bug in tune: please report it)")]
    Invariant(&'static str),
}
