//! Training: losses, optimizers, schedules, metrics and the trainer core every recipe shares.

pub mod activation_checkpointing;
pub mod checkpointing;
pub mod chunked_loss;
pub mod dpo;
pub mod grads;
pub mod kd;
pub mod loss;
pub mod memory;
pub mod metrics;
pub mod optimizer;
pub mod optimizer_shards;
pub mod progress;
pub mod schedule;
pub mod sft;
pub mod sharded_optimizer;
pub mod step;
pub mod tensorboard;
pub mod trainer;
pub mod validation;

pub use trainer::{
    LossStep, SaveHook, SaveKind, StepInfo, StepOutput, TrainError, TrainState, Trainer,
    TrainerSettings,
};
