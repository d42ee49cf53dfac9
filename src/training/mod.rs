//! Training: losses, optimizers, schedules, metrics and the trainer core every recipe shares.

pub mod activation_checkpointing;
pub mod checkpointing;
pub mod chunked_loss;
pub mod dpo;
pub mod error;
pub mod fsdp;
pub mod grpo;
pub mod grpo_loss;
pub mod kd;
pub mod load_balancing;
pub mod loss;
pub mod loss_step;
pub mod memory;
pub mod metrics;
pub mod offload;
pub mod optimizer;
pub mod optimizer_shards;
pub mod ppo;
pub mod ppo_maths;
pub mod progress;
pub mod rollout_pack;
pub mod rollouts;
pub mod save_hook;
pub mod schedule;
pub mod sft;
pub mod sharded_checkpoint;
pub mod sharded_optimizer;
pub mod step;
pub mod step_totals;
pub mod tensorboard;
pub mod trainer;
pub mod validation;

pub use error::{CheckpointingError, Divergence, TrainError};
pub use loss_step::{EvalOutput, LossStep, StepInfo, StepOutput};
pub use save_hook::{OptimizerSnapshot, SaveHook, SaveKind, TrainState};
pub use trainer::{Batches, EpochSteps, StepDone, StepTimes, Trainer, TrainerSettings};
