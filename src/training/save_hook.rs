//! The recipe's side of checkpointing, as the trainer calls it: when it saves ([`SaveKind`]),
//! what it hands over ([`OptimizerSnapshot`], [`TrainState`]) and the hook that writes it.

use burn::tensor::backend::AutodiffBackend;

use super::error::TrainError;
use crate::models::CausalLm;

/// Where training stands; saved in every checkpoint so a resumed run continues exactly.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainState {
    pub epoch: usize,
    /// Optimizer steps completed in `epoch`.
    pub step_in_epoch: usize,
    pub global_step: usize,
    pub steps_per_epoch: usize,
    pub total_steps: usize,
    pub tokens_seen: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveKind {
    /// Every `save_every_n_steps`: in the background.
    Periodic,
    /// End of an epoch that is not the last: in the background.
    EpochEnd,
    /// End of training: synchronous.
    Final,
    /// A stop signal with `save_on_preempt`: a `step_N` checkpoint, synchronous.
    Preempt,
}

impl SaveKind {
    /// Whether training waits for the checkpoint to be published (the process exits after).
    pub fn blocks(self) -> bool {
        matches!(self, Self::Final | Self::Preempt)
    }
}

/// The optimizer as a checkpoint holds it: its step count and every parameter's moments
/// (gathered from all ranks when the state is sharded).
pub struct OptimizerSnapshot {
    pub step: u64,
    pub state: Vec<(String, crate::checkpoint::HostTensor)>,
}

/// The recipe's side of checkpointing: what to save (adapter or full model, optimizer, state).
pub trait SaveHook<B: AutodiffBackend> {
    fn save(
        &mut self,
        kind: SaveKind,
        model: &mut CausalLm<B>,
        optimizer: &OptimizerSnapshot,
        state: &TrainState,
    ) -> Result<(), TrainError>;
}
