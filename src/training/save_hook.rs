//! The recipe's side of checkpointing, as the trainer calls it: when it saves ([`SaveKind`]),
//! what it hands over ([`OptimizerSnapshot`], [`TrainState`]) and the hook that writes it.

use burn::tensor::backend::AutodiffBackend;

use std::time::Instant;

use super::error::TrainError;
use super::progress::EpochProgress;
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

impl<B: AutodiffBackend> super::trainer::Trainer<B> {
    /// The periodic save, every `save_every_n_steps` steps done (the epoch-end save follows the
    /// last step of an epoch: no periodic one then); returns whether it saved.
    pub(super) fn save_if_due(
        &mut self,
        saver: &mut dyn SaveHook<B>,
        progress: &EpochProgress,
        steps_done: usize,
    ) -> Result<bool, TrainError> {
        let epoch_done = self.state.step_in_epoch == self.state.steps_per_epoch;
        let due = !epoch_done
            && self
                .settings
                .save_every_n_steps
                .is_some_and(|n| n > 0 && steps_done.is_multiple_of(n));
        if due {
            self.save(SaveKind::Periodic, saver, Some(progress))?;
        }
        Ok(due)
    }

    /// Hands the model, the optimizer and the state to the save hook, as the parallelism
    /// gathers or shares them, and says (rank 0) how long training waited: gathering what is
    /// written and the hand-over to the checkpoint client (the writing itself runs in the
    /// background; the client says when it is done).
    pub(super) fn save(
        &mut self,
        kind: SaveKind,
        saver: &mut dyn SaveHook<B>,
        progress: Option<&EpochProgress>,
    ) -> Result<(), TrainError> {
        let started = Instant::now();
        // The weights about to be saved: every task that made them has run, and none failed.
        // (A sync that fails reports the failure cubecl's stream kept; a panicked task is the
        // recorded fault.)
        if let Err(e) = B::sync(&self.model.device()) {
            return Err(TrainError::DeviceFailed {
                fault: crate::device::DeviceFault {
                    message: e.to_string(),
                    count: 1,
                },
                step: self.state.global_step,
            });
        }
        self.check_device(self.state.global_step)?;
        let at = (self.state.global_step, self.state.epoch);
        let (optimizer, mut whole) =
            self.parallel
                .for_save(&mut self.model, &self.optimizer, at)?;
        let model = whole.as_mut().unwrap_or(&mut self.model);
        let mut save = || saver.save(kind, model, &optimizer, &self.state);
        match progress {
            Some(p) => p.suspend(save)?,
            None => save()?,
        }
        if self.world().is_main() {
            let line = format!(
                "checkpoint: training waited {:.3} s for the save at step {}",
                started.elapsed().as_secs_f64(),
                self.state.global_step
            );
            match progress {
                Some(p) => p.suspend(|| crate::say!("{line}")),
                None => crate::say!("{line}"),
            }
        }
        Ok(())
    }

    /// The optimizer as a checkpoint holds it, for a recipe that saves a second trainer's
    /// model itself (PPO's value model).
    pub fn optimizer_snapshot(&self) -> Result<OptimizerSnapshot, TrainError> {
        self.parallel.snapshot(&self.model, &self.optimizer)
    }
}
