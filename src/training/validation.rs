//! Validation loss (torchtune's `dataset_val` / `run_val_every_n_steps`): the recipe's loss over
//! the whole validation set, without gradients and with dropout off, every N optimizer steps
//! and at the end of each epoch. The batches are the same every time (unshuffled, the partial
//! last batch dropped, as torchtune's validation loader), and the loss is the mean over all
//! their weight units (label tokens for SFT and KD, pairs for DPO), so it does not depend on
//! how the set is cut into batches.

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;

use super::error::TrainError;
use super::loss_step::{LossStep, StepInfo, add_weighted, check_vocabulary};
use super::metrics::Metrics;
use super::progress::EpochProgress;
use super::step_totals::StepTotals;
use crate::data::{DataLoader, Dataset};
use crate::distributed::World;
use crate::models::CausalLm;

/// The validation set, its loader and when to score it.
pub struct Validation {
    pub dataset: Dataset,
    pub loader: DataLoader,
    /// `run_val_every_n_steps`; `None` scores only at the end of each epoch.
    pub every_n_steps: Option<usize>,
}

impl Validation {
    /// Whether to score after optimizer step `global_step`.
    pub fn due(&self, global_step: usize) -> bool {
        self.every_n_steps
            .is_some_and(|n| n > 0 && global_step.is_multiple_of(n))
    }

    /// The recipe's validation metrics for `model`: `val_loss` and `val_<name>` for each of
    /// the loss step's own metrics, weighted means over this rank's batches summed over the
    /// world.
    pub fn run<B: AutodiffBackend>(
        &self,
        model: &CausalLm<B>,
        loss_step: &mut dyn LossStep<B>,
        world: &World,
        info: StepInfo,
    ) -> Result<Metrics, TrainError> {
        let eval_model = model.valid();
        let mut totals = StepTotals {
            weight: 0,
            loss_sum: 0.0,
            tokens: 0,
            metrics: Vec::new(),
            non_finite: false,
            stop: None,
        };
        for indices in self.loader.rank_batches(0, world.rank, world.size) {
            let batch = self.dataset.collate(&indices)?;
            check_vocabulary(&batch, model.args.vocab_size, info.global_step)?;
            let out = loss_step.evaluate(&eval_model, &batch, info)?;
            let w = out.weight as f64;
            totals.weight += out.weight;
            totals.loss_sum += out.loss * w;
            add_weighted(&mut totals.metrics, out.metrics, w);
        }
        let totals = totals.all_reduce::<B::InnerBackend>(world, &model.device())?;
        // torchtune reports inf for a set with nothing to score.
        let mean = |sum: f64| {
            if totals.weight > 0 {
                sum / totals.weight as f64
            } else {
                f64::INFINITY
            }
        };
        let mut metrics: Metrics = vec![("val_loss".into(), mean(totals.loss_sum))];
        metrics.extend(
            totals
                .metrics
                .iter()
                .map(|(k, v)| (format!("val_{k}"), mean(*v))),
        );
        Ok(metrics)
    }
}

impl<B: AutodiffBackend> super::trainer::Trainer<B> {
    /// Scores the validation set after the current step, logs `val_loss` (and the recipe's
    /// `val_*` metrics) at this step and prints it.
    pub(super) fn validate(
        &mut self,
        validation: &Validation,
        loss_step: &mut dyn LossStep<B>,
        info: StepInfo,
        progress: &EpochProgress,
    ) -> Result<(), TrainError> {
        let metrics = validation.run(&self.model, loss_step, self.world(), info)?;
        self.check_device(self.state.global_step)?;
        super::parallel::fsdp::check(&self.model)?;
        if self.world().is_main() {
            let line = metrics
                .iter()
                .map(|(k, v)| format!("{k} {v:.4}"))
                .collect::<Vec<_>>()
                .join(", ");
            let step = self.state.global_step;
            progress.suspend(|| crate::say!("Validation at step {step}: {line}"));
        }
        let mut line: Metrics = vec![
            ("step".into(), self.state.global_step as f64),
            ("epoch".into(), info.epoch as f64),
        ];
        line.extend(metrics);
        self.loggers.log(self.state.global_step, &line)?;
        Ok(())
    }

    /// Validation after a step of `epoch`: the run's seed, unchanged per step.
    pub(super) fn validation_info(&self, epoch: usize) -> StepInfo {
        StepInfo {
            epoch,
            global_step: self.state.global_step,
            seed: self.settings.seed,
        }
    }
}
