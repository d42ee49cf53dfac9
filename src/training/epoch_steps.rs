//! What the steps of [`Trainer::run`](super::Trainer::run) are ([`EpochSteps`]): a dataset's
//! batches ([`Batches`], every SFT, DPO, KD and QAT recipe), or GRPO's and PPO's rollouts.

use burn::tensor::backend::AutodiffBackend;

use super::error::TrainError;
use super::loss_step::LossStep;
use super::step_done::StepDone;
use super::trainer::Trainer;
use super::validation::Validation;
use crate::data::{DataLoader, Dataset};

/// What the steps of [`Trainer::run`] are and how many an epoch holds: [`Batches`] of a
/// dataset (every SFT, DPO, KD and QAT recipe), or GRPO's rollouts (`training::grpo`).
pub trait EpochSteps<B: AutodiffBackend> {
    /// Steps per epoch on this rank; an error when the data makes none.
    fn steps_per_epoch(&self, trainer: &Trainer<B>) -> Result<usize, TrainError>;

    /// Runs step `index` of `epoch`: one or more optimizer updates
    /// ([`Trainer::train_step`]), the global step moving on with each; the loop moves the
    /// step in the epoch on.
    fn step(
        &mut self,
        trainer: Trainer<B>,
        epoch: usize,
        index: usize,
    ) -> Result<(Trainer<B>, StepDone), TrainError>;

    /// Optimizer updates per step (the schedule runs over all of them): 1, or GRPO's
    /// `ppo_epochs`.
    fn updates_per_step(&self) -> usize {
        1
    }

    /// Stop after this many steps over all epochs (GRPO's `num_steps`), with the final save.
    fn max_steps(&self) -> Option<usize> {
        None
    }

    /// The optimizer updates the learning-rate schedule spans, when not every epoch's
    /// (PPO's: its `num_steps` steps' updates, as torchtune's `lr_steps`).
    fn schedule_steps(&self, _steps_per_epoch: usize) -> Option<usize> {
        None
    }

    /// Save at the end of every this many epochs (GRPO's `save_every_n_epochs`); the last
    /// epoch always saves.
    fn save_every_n_epochs(&self) -> usize {
        1
    }

    /// The validation set and the loss step that scores it, when there is one.
    fn validation(&mut self) -> Option<(&Validation, &mut dyn LossStep<B>)> {
        None
    }
}

/// A dataset's batches: each step collates `gradient_accumulation_steps` micro-batches of
/// this rank's share and makes one update over them.
pub struct Batches<'a, B: AutodiffBackend> {
    pub data: &'a Dataset,
    pub loader: &'a DataLoader,
    pub loss_step: &'a mut dyn LossStep<B>,
    pub validation: Option<&'a Validation>,
    /// This rank's batches of the epoch being run (drawn once per epoch).
    epoch: crate::data::EpochBatches,
}

impl<'a, B: AutodiffBackend> Batches<'a, B> {
    pub fn new(
        data: &'a Dataset,
        loader: &'a DataLoader,
        loss_step: &'a mut dyn LossStep<B>,
        validation: Option<&'a Validation>,
    ) -> Self {
        Self {
            data,
            loader,
            loss_step,
            validation,
            epoch: Default::default(),
        }
    }
}

impl<B: AutodiffBackend> EpochSteps<B> for Batches<'_, B> {
    fn steps_per_epoch(&self, trainer: &Trainer<B>) -> Result<usize, TrainError> {
        trainer.steps_per_epoch(self.loader)
    }

    fn step(
        &mut self,
        trainer: Trainer<B>,
        epoch: usize,
        index: usize,
    ) -> Result<(Trainer<B>, StepDone), TrainError> {
        let accum = trainer.settings.gradient_accumulation_steps.max(1);
        let world = trainer.world();
        let batches = self
            .epoch
            .batches(self.loader, epoch, world.rank, world.size);
        let first = index * accum;
        let micro_batches = batches[first..first + accum]
            .iter()
            .map(|indices| self.data.collate(indices))
            .collect::<Result<Vec<_>, _>>()?;
        trainer.train_step(&micro_batches, &mut *self.loss_step)
    }

    fn validation(&mut self) -> Option<(&Validation, &mut dyn LossStep<B>)> {
        let v = self.validation?;
        Some((v, &mut *self.loss_step))
    }
}

/// Optimizer steps per epoch: this rank's batches of `loader` over the accumulation steps, at
/// most `max_steps_per_epoch`; at least one, or the data is too little.
pub fn steps_per_epoch(
    settings: &super::TrainerSettings,
    loader: &DataLoader,
    world_size: usize,
) -> Result<usize, TrainError> {
    let accum = settings.gradient_accumulation_steps.max(1);
    let batches = loader.num_batches_per_rank(world_size);
    let mut steps = batches / accum;
    if let Some(max) = settings.max_steps_per_epoch {
        steps = steps.min(max);
    }
    if steps == 0 {
        return Err(TrainError::TooLittleData {
            batches,
            batch_size: loader.config().batch_size,
            accum,
        });
    }
    Ok(steps)
}
