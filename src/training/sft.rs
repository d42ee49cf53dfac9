//! The supervised fine-tuning loss step shared by the full, LoRA and QAT recipes: shifted
//! cross-entropy over the labelled tokens.

use burn::tensor::backend::AutodiffBackend;

use super::trainer::{LossStep, StepInfo, StepOutput, TrainError};
use super::{activation_checkpointing, loss};
use crate::data::Batch;
use crate::models::{CausalLm, TokenBatch};
use crate::modules::ForwardMode;

#[derive(Debug, Clone, Default)]
pub struct SftLoss {
    /// QAT: fake quantization switches on at this step (`fake_quant_after_n_steps`).
    pub fake_quant_after: Option<usize>,
    /// `enable_activation_checkpointing`: recompute each layer in the backward pass.
    pub activation_checkpointing: bool,
}

pub fn token_batch(batch: &Batch) -> TokenBatch<'_> {
    TokenBatch {
        tokens: &batch.tokens,
        positions: &batch.position_ids,
        document_ids: batch.document_ids.as_deref(),
        batch: batch.batch_size,
    }
}

impl<B: AutodiffBackend> LossStep<B> for SftLoss {
    fn step(
        &mut self,
        model: &CausalLm<B>,
        batch: &Batch,
        info: StepInfo,
    ) -> Result<StepOutput<B>, TrainError> {
        let mode = ForwardMode {
            adapters: true,
            fake_quant: self.fake_quant_after.is_none_or(|n| info.global_step >= n),
            train: true,
        };
        let weight = batch.num_trained_tokens;
        let loss_of_logits = |logits| loss::cross_entropy(logits, &batch.labels);
        let (loss, grads) = activation_checkpointing::loss_and_grads(
            model,
            token_batch(batch),
            mode,
            self.activation_checkpointing,
            info.seed,
            weight as f64,
            loss_of_logits,
        );
        Ok(StepOutput {
            loss,
            weight,
            tokens: batch.tokens.len(),
            metrics: vec![],
            grads,
        })
    }
}
