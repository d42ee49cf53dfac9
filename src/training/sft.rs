//! The supervised fine-tuning loss step shared by the full, LoRA and QAT recipes: shifted
//! cross-entropy over the labelled tokens.

use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

use super::activation_checkpointing::{self, Checkpointing};
use super::error::TrainError;
use super::loss_step::{EvalOutput, LossStep, StepInfo, StepOutput};
use super::{chunked_loss, load_balancing, loss};
use crate::data::{Batch, IGNORE_INDEX, Keep, LONG_PACK, unpad_keeping};
use crate::kernels;
use crate::models::decoder::OutputHead;
use crate::models::{CausalLm, TokenBatch};
use crate::modules::ForwardMode;

#[derive(Debug, Clone)]
pub struct SftLoss {
    /// QAT: fake quantization switches on at this step (`fake_quant_after_n_steps`).
    pub fake_quant_after: Option<usize>,
    /// `enable_activation_checkpointing`: recompute each layer in the backward pass.
    pub activation_checkpointing: Checkpointing,
    /// `loss.num_output_chunks`: the output projection and loss run in this many row chunks
    /// when the projection is frozen (see [`chunked_loss`]); 1 turns chunking off.
    pub output_chunks: usize,
    /// Compute a padded batch's rows padding-free (the same loss and gradients); off only to
    /// measure the padded step (`tune bench --keep-padding`).
    pub padding_free: bool,
}

impl Default for SftLoss {
    fn default() -> Self {
        Self {
            fake_quant_after: None,
            activation_checkpointing: Checkpointing::Off,
            output_chunks: chunked_loss::DEFAULT_CHUNKS,
            padding_free: true,
        }
    }
}

/// The cross-entropy of a batch and, unless the trainer is to back-propagate the loss itself,
/// its gradients (`loss * weight`): with per-layer recomputation when `checkpointing`, and
/// with the output projection in chunks when the batch has rows for more than one chunk and
/// the projection is frozen.
pub fn loss_and_grads<B: AutodiffBackend>(
    model: &CausalLm<B>,
    input: TokenBatch<'_>,
    labels: &[i64],
    mode: ForwardMode,
    (checkpointing, output_chunks): (Checkpointing, usize),
    step_seed: u64,
    weight: f64,
) -> (Tensor<B, 1>, Option<Vec<B::Gradients>>) {
    let rows = input.tokens.len();
    let chunks = chunked_loss::chunk_ranges(rows, output_chunks);
    if chunks.len() <= 1 || chunked_loss::output_projection_trains(model) {
        let loss_of_logits = |logits| loss::cross_entropy(logits, labels);
        let pass = activation_checkpointing::loss_and_grads(
            model,
            input,
            mode,
            (checkpointing, step_seed),
            weight,
            None,
            loss_of_logits,
        );
        return (pass.loss, pass.grads);
    }
    let head = |output: &OutputHead<B>, hidden| {
        chunked_loss::cross_entropy_backward(output, hidden, labels, mode, weight, &chunks)
    };
    let (loss, grads) = if checkpointing.recomputes() || model.shards.is_some() {
        let offload = checkpointing == Checkpointing::LayersOffloaded;
        activation_checkpointing::forward_backward(
            model,
            input,
            mode,
            offload,
            step_seed,
            |output, top| head(output, output.norm(top)),
        )
    } else {
        let hidden = model.hidden(input, mode, None);
        // Every layer's activations are alive until the chunks' backward: the device's peak.
        crate::device::sample_device_memory(&model.device());
        head(&model.head(), hidden)
    };
    (loss, Some(grads))
}

/// The loss transformers' `*ForCausalLM` returns with `output_router_logits`: the
/// cross-entropy plus `coef` times the load-balancing loss of every sparse layer's routing
/// ([`RouterLoad::aux_loss`](crate::models::moe::RouterLoad::aux_loss)). Returns that loss, the
/// load-balancing loss alone (for the log) and, when the output projection runs in chunks,
/// the gradients of `loss * weight` (otherwise the trainer back-propagates it). Gradient
/// contract: as [`loss_and_grads`]'s, for the sum; the router's gradient comes through the
/// probabilities only (the expert counts are constants, as transformers' histogram is).
/// With per-layer passes (activation checkpointing, FSDP) each layer's backward takes its own
/// share of the term ([`activation_checkpointing::forward_backward_with_aux`]).
pub fn loss_with_aux<B: AutodiffBackend>(
    model: &CausalLm<B>,
    input: TokenBatch<'_>,
    labels: &[i64],
    mode: ForwardMode,
    (checkpointing, output_chunks): (Checkpointing, usize),
    (step_seed, weight): (u64, f64),
    coef: f64,
) -> AuxStep<B> {
    let chunks = chunked_loss::chunk_ranges(input.tokens.len(), output_chunks);
    let passes = (checkpointing, step_seed);
    loss_with_aux_in_chunks(model, input, labels, mode, &chunks, passes, weight, coef)
}

/// What [`loss_with_aux`] returns: the loss (the term included), the load-balancing loss
/// alone, and the gradients when it computed them.
pub type AuxStep<B> = (
    Tensor<B, 1>,
    Tensor<<B as AutodiffBackend>::InnerBackend, 1>,
    Option<Vec<<B as AutodiffBackend>::Gradients>>,
);

/// [`loss_with_aux`] with the output projection in `chunks` of rows (one chunk, or a trained
/// projection: no chunking).
#[allow(clippy::too_many_arguments)]
pub fn loss_with_aux_in_chunks<B: AutodiffBackend>(
    model: &CausalLm<B>,
    input: TokenBatch<'_>,
    labels: &[i64],
    mode: ForwardMode,
    chunks: &[std::ops::Range<usize>],
    (checkpointing, step_seed): (Checkpointing, u64),
    weight: f64,
    coef: f64,
) -> AuxStep<B> {
    let in_chunks = chunks.len() > 1 && !chunked_loss::output_projection_trains(model);
    if !in_chunks {
        let pass = activation_checkpointing::loss_and_grads(
            model,
            input,
            mode,
            (checkpointing, step_seed),
            weight,
            Some(coef),
            |logits| loss::cross_entropy(logits, labels),
        );
        let aux = pass
            .aux_loss
            .unwrap_or_else(|| Tensor::zeros([1], &model.device()));
        return (pass.loss, aux, pass.grads);
    }
    if checkpointing.recomputes() || model.shards.is_some() {
        let head = |output: &OutputHead<B>, top: Tensor<B, 3>| {
            chunked_loss::cross_entropy_backward(
                output,
                output.norm(top),
                labels,
                mode,
                weight,
                chunks,
            )
        };
        let offload = checkpointing == Checkpointing::LayersOffloaded;
        let (ce, grads, aux) = activation_checkpointing::forward_backward_with_aux(
            model,
            input,
            mode,
            offload,
            step_seed,
            head,
            coef * weight,
        );
        let loss = Tensor::from_inner(ce.inner() + aux.clone() * coef);
        return (loss, aux, Some(grads));
    }
    let device = model.device();
    let (hidden, load) = model.hidden_with_router_load(input, mode);
    let aux = load
        .aux_loss()
        .unwrap_or_else(|| Tensor::<B, 1>::zeros([1], &device));
    let logged = aux.clone().inner();
    let (ce, grads) = chunked_loss::cross_entropy_backward_with(
        &model.head(),
        hidden,
        labels,
        mode,
        weight,
        chunks,
        Some(aux * (coef * weight)),
    );
    let loss = Tensor::from_inner(ce.inner() + logged.clone() * coef);
    (loss, logged, Some(grads))
}

/// The tokens a step reports for throughput: labels that are not ignored, before the shift
/// (torchtune's `num_tokens` behind `tokens_per_second_per_gpu`), so the figure does not
/// depend on how much padding a batch had or whether it was computed.
pub fn labelled_tokens(batch: &Batch) -> usize {
    batch.labels.iter().filter(|&&l| l != IGNORE_INDEX).count()
}

/// The batch `model`'s step computes: `batch`'s rows padding-free ([`unpad_keeping`]), in
/// packs up to [`LONG_PACK`] positions where attention skips the tiles a mask hides (the fused
/// CPU kernel), else no longer than the batch's rows; `None` when there is nothing to drop.
/// Each row keeps what the loss reads: through its last counted label, or every real token
/// when the model adds the load-balancing loss (whose router statistics count them all).
pub fn padding_free<B: Backend>(model: &CausalLm<B>, batch: &Batch) -> Option<Batch> {
    let max_pack_len = if kernels::attention_skips_hidden_tiles::<B>() {
        LONG_PACK
    } else {
        0
    };
    let keep = match load_balancing::aux_loss_coef(model) {
        Some(_) => Keep::RealTokens,
        None => Keep::CountedLabels,
    };
    unpad_keeping(batch, max_pack_len, keep)
}

pub fn token_batch(batch: &Batch) -> TokenBatch<'_> {
    TokenBatch {
        tokens: &batch.tokens,
        positions: &batch.position_ids,
        document_ids: batch.document_ids.as_deref(),
        continued_documents: None,
        left_padding: None,
        padding: batch.padding.as_deref(),
        images: batch.images.as_ref(),
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
        let tokens = labelled_tokens(batch);
        // Padding-free: the rows' real tokens in block-causal packs (same loss and gradients).
        let unpadded = self
            .padding_free
            .then(|| padding_free(model, batch))
            .flatten();
        let batch = unpadded.as_ref().unwrap_or(batch);
        if let Some(coef) = load_balancing::aux_loss_coef(model) {
            let (loss, aux, grads) = loss_with_aux(
                model,
                token_batch(batch),
                &batch.labels,
                mode,
                (self.activation_checkpointing, self.output_chunks),
                (info.seed, weight as f64),
                coef,
            );
            return Ok(StepOutput {
                loss,
                weight,
                tokens,
                metrics: vec![("aux_loss", aux)],
                grads,
            });
        }
        let (loss, grads) = loss_and_grads(
            model,
            token_batch(batch),
            &batch.labels,
            mode,
            (self.activation_checkpointing, self.output_chunks),
            info.seed,
            weight as f64,
        );
        Ok(StepOutput {
            loss,
            weight,
            tokens,
            metrics: vec![],
            grads,
        })
    }

    fn evaluate(
        &mut self,
        model: &CausalLm<B::InnerBackend>,
        batch: &Batch,
        info: StepInfo,
    ) -> Result<EvalOutput, TrainError> {
        let mode = ForwardMode {
            adapters: true,
            fake_quant: self.fake_quant_after.is_none_or(|n| info.global_step >= n),
            train: false,
        };
        let unpadded = self
            .padding_free
            .then(|| padding_free(model, batch))
            .flatten();
        let batch = unpadded.as_ref().unwrap_or(batch);
        let (hidden, aux) = load_balancing::hidden_with_aux(model, token_batch(batch), mode);
        let ce = loss::chunked_cross_entropy(model, hidden, &batch.labels, mode);
        let (loss, metrics) = load_balancing::with_aux(ce, vec![], aux);
        Ok(EvalOutput {
            loss,
            weight: batch.num_trained_tokens,
            metrics,
        })
    }
}
