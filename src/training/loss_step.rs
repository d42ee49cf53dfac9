//! The seam between the trainer core and a recipe: [`LossStep`], the one method a recipe
//! supplies (its loss on a micro-batch, and optionally the gradients it computed itself), and
//! what the trainer gives it and checks before it ([`StepInfo`], [`check_vocabulary`]).

use crate::training::metrics::MetricName;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor};

use super::error::TrainError;
use super::loss;
use crate::data::Batch;
use crate::models::CausalLm;

/// What a recipe's loss step returns for one micro-batch.
pub struct StepOutput<B: AutodiffBackend> {
    /// The mean loss over this micro-batch's `weight` units (tokens for SFT, pairs for DPO).
    pub loss: Tensor<B, 1>,
    pub weight: usize,
    /// Tokens for throughput: SFT and KD count labels that are not ignored (torchtune's
    /// `num_tokens`), DPO every position of its padded rows (as torchtune's DPO recipe).
    pub tokens: usize,
    /// Extra per-micro-batch metrics (`[1]` tensors), averaged over the step by weight. They
    /// stay on the device: the trainer reads them with the loss, once per step, so a GPU is
    /// not made to wait for the host between micro-batches.
    pub metrics: Vec<(&'static str, Tensor<B::InnerBackend, 1>)>,
    /// Gradients the step already computed (activation checkpointing runs its own backward
    /// passes, for `loss * weight`); `None` lets the trainer back-propagate `loss * weight`.
    pub grads: Option<Vec<B::Gradients>>,
}

impl<B: AutodiffBackend> StepOutput<B> {
    /// The gradients of `loss * weight`: the ones the step computed itself, or one backward
    /// pass here.
    pub fn take_gradients(&mut self) -> Vec<B::Gradients> {
        match self.grads.take() {
            Some(parts) => parts,
            None => vec![(self.loss.clone() * self.weight as f64).backward()],
        }
    }

    /// The value of metric `name` (a read from the device; for tests and inspection).
    pub fn metric(&self, name: &str) -> Option<f64> {
        let (_, value) = self.metrics.iter().find(|(k, _)| *k == name)?;
        Some(value.clone().into_scalar().elem())
    }
}

#[derive(Debug, Clone, Copy)]
pub struct StepInfo {
    pub epoch: usize,
    pub global_step: usize,
    /// The seed the backend's RNG was reset to for this step.
    pub seed: u64,
}

/// What a loss step returns for one validation batch.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalOutput {
    /// The mean loss over the batch's `weight` units, as [`StepOutput::loss`].
    pub loss: f64,
    pub weight: usize,
    /// The recipe's own metrics, averaged over the validation set by weight.
    pub metrics: Vec<(MetricName, f64)>,
}

pub trait LossStep<B: AutodiffBackend> {
    fn step(
        &mut self,
        model: &CausalLm<B>,
        batch: &Batch,
        info: StepInfo,
    ) -> Result<StepOutput<B>, TrainError>;

    /// The same loss on a validation batch, on the model without autodiff and with dropout off
    /// (torchtune's `model.eval()` under `torch.no_grad()`).
    fn evaluate(
        &mut self,
        model: &CausalLm<B::InnerBackend>,
        batch: &Batch,
        info: StepInfo,
    ) -> Result<EvalOutput, TrainError>;
}

/// Every token and label must index the model's vocabulary: an id past it would index outside
/// the embedding and the logits.
pub fn check_vocabulary(batch: &Batch, vocab_size: usize, step: usize) -> Result<(), TrainError> {
    let tokens = batch.tokens.iter().map(|&t| t as i64);
    let labels = batch
        .labels
        .iter()
        .copied()
        .filter(|&l| l != loss::IGNORE_INDEX);
    match tokens
        .chain(labels)
        .find(|&id| id < 0 || id >= vocab_size as i64)
    {
        Some(id) => Err(TrainError::TokenOutOfVocabulary {
            id,
            vocab_size,
            step: step + 1,
        }),
        None => Ok(()),
    }
}

/// Adds a micro-batch's metrics, weighted, into the running sums (by name, in first-seen order).
pub(crate) fn add_weighted(
    sums: &mut Vec<(MetricName, f64)>,
    metrics: Vec<(MetricName, f64)>,
    weight: f64,
) {
    for (k, v) in metrics {
        match sums.iter_mut().find(|(name, _)| *name == k) {
            Some(entry) => entry.1 += v * weight,
            None => sums.push((k, v * weight)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(tokens: Vec<u32>, labels: Vec<i64>) -> Batch {
        let n = tokens.len();
        Batch {
            tokens,
            labels,
            position_ids: (0..n as u32).collect(),
            document_ids: None,
            batch_size: 1,
            seq_len: n,
            num_trained_tokens: n - 1,
            padding: None,
            images: None,
        }
    }

    #[test]
    fn ids_past_the_vocabulary_are_an_error_naming_id_and_size() {
        assert!(check_vocabulary(&batch(vec![1, 2, 3], vec![-100, 2, 3]), 4, 0).is_ok());
        let err = check_vocabulary(&batch(vec![1, 7, 3], vec![-100, 2, 3]), 4, 2).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("token id 7") && msg.contains("4 entries") && msg.contains("step 3"));
        let err = check_vocabulary(&batch(vec![1, 2, 3], vec![-100, 9, 3]), 4, 0).unwrap_err();
        assert!(err.to_string().contains("token id 9"));
        assert!(check_vocabulary(&batch(vec![1, 2, 3], vec![-1, 2, 3]), 4, 0).is_err());
    }
}
