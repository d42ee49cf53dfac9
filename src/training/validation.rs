//! Validation loss (torchtune's `dataset_val` / `run_val_every_n_steps`): the recipe's loss over
//! the whole validation set, without gradients and with dropout off, every N optimizer steps
//! and at the end of each epoch. The batches are the same every time (unshuffled, the partial
//! last batch dropped, as torchtune's validation loader), and the loss is the mean over all
//! their weight units (label tokens for SFT and KD, pairs for DPO), so it does not depend on
//! how the set is cut into batches.

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;

use super::metrics::Metrics;
use super::trainer::{LossStep, StepInfo, TrainError, add_weighted, check_vocabulary};
use crate::data::{DataLoader, Dataset};
use crate::distributed::{World, sync};
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
        let mut weight = 0.0;
        let mut loss_sum = 0.0;
        let mut extra: Vec<(&'static str, f64)> = Vec::new();
        for indices in self.loader.rank_batches(0, world.rank, world.size) {
            let batch = self.dataset.collate(&indices)?;
            check_vocabulary(&batch, model.args.vocab_size, info.global_step)?;
            let out = loss_step.evaluate(&eval_model, &batch, info)?;
            let w = out.weight as f64;
            weight += w;
            loss_sum += out.loss * w;
            add_weighted(&mut extra, out.metrics, w);
        }
        if world.is_distributed() {
            let mut local = vec![weight, loss_sum];
            local.extend(extra.iter().map(|(_, v)| *v));
            let global = sync::all_reduce_scalars::<B::InnerBackend>(
                world,
                &local,
                &model.device(),
                "the validation loss",
            )?;
            (weight, loss_sum) = (global[0], global[1]);
            for (entry, v) in extra.iter_mut().zip(&global[2..]) {
                entry.1 = *v;
            }
        }
        // torchtune reports inf for a set with nothing to score.
        let mean = |sum: f64| {
            if weight > 0.0 {
                sum / weight
            } else {
                f64::INFINITY
            }
        };
        let mut metrics: Metrics = vec![("val_loss".into(), mean(loss_sum))];
        metrics.extend(extra.iter().map(|(k, v)| (format!("val_{k}"), mean(*v))));
        Ok(metrics)
    }
}
