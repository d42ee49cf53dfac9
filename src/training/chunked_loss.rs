//! Cross-entropy with the output projection in chunks, as torchtune's `CEWithChunkedOutputLoss`
//! and `LinearCrossEntropyLoss` save memory: the final hidden states are split into row chunks,
//! and each chunk is projected to the vocabulary, scored and back-propagated on its own, so one
//! chunk's logits (and their gradient) exist at a time instead of all `[batch * seq, vocab]`.
//! The hidden states' gradient, gathered from the chunks, then goes back through the model in
//! one more backward pass. Same maths as [`super::loss::cross_entropy`].
//!
//! It applies when the output projection's weight is frozen (LoRA, also with an adapter on the
//! output): each chunk's backward pass then yields its hidden rows' gradient and at most small
//! adapter gradients. When the weight trains (full fine-tuning), every chunk would carry its own
//! `[vocab, hidden]` weight gradient until the trainer sums them, which outweighs the logits
//! saved, so the unchunked loss runs.
//!
//! Only the rows with a target are projected: a prompt's rows (`train_on_input: False`) and each
//! sequence's last row add exactly zero to the loss and its gradients. Why: with a real
//! vocabulary the projection is a large share of the step; LoRA on SmolLM2-135M-Instruct (49 152
//! tokens), alpaca rows without their prompts trained, batch 8: 96-108 -> 114-118 trained
//! tokens/s, the same losses.

use std::ops::Range;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{IndexingUpdateOp, Tensor};

use super::loss::next_token_targets;
use crate::models::CausalLm;
use crate::models::decoder::{OutputHead, row_index};
use crate::modules::ForwardMode;
use crate::{kernels, precision};

/// torchtune's `num_output_chunks` default.
pub const DEFAULT_CHUNKS: usize = 8;

/// Fewer rows per chunk than this make the projection's matmuls inefficient on CPU for little
/// memory: small batches are split into fewer chunks.
const MIN_ROWS_PER_CHUNK: usize = 256;

/// Whether the output projection's weight (or the tied embedding) is trained.
pub fn output_projection_trains<B: AutodiffBackend>(model: &CausalLm<B>) -> bool {
    match &model.lm_head {
        Some(head) => head
            .weight_param()
            .is_some_and(|w| w.val().is_require_grad()),
        None => model.model.embed_tokens.weight.val().is_require_grad(),
    }
}

/// The row ranges of `rows` split into at most `chunks` pieces of at least
/// [`MIN_ROWS_PER_CHUNK`] rows (the last may be shorter).
pub fn chunk_ranges(rows: usize, chunks: usize) -> Vec<Range<usize>> {
    let size = rows.div_ceil(chunks.max(1)).max(MIN_ROWS_PER_CHUNK);
    (0..rows)
        .step_by(size)
        .map(|start| start..(start + size).min(rows))
        .collect()
}

/// Mean cross-entropy of the shifted `labels` under `head`'s output projection of `hidden`
/// (`[batch, seq, hidden]`, final norm applied, attached to the graph that produced it), and
/// the gradients of `loss * weight`: one set per chunk of rows (`chunks` cover
/// `0..batch * seq`, as [`chunk_ranges`] makes them), then the set from back-propagating the
/// hidden states' gradient through that graph. Returns the loss without a graph.
pub fn cross_entropy_backward<B: AutodiffBackend>(
    head: &OutputHead<B>,
    hidden: Tensor<B, 3>,
    labels: &[i64],
    mode: ForwardMode,
    weight: f64,
    chunks: &[Range<usize>],
) -> (Tensor<B, 1>, Vec<B::Gradients>) {
    cross_entropy_backward_with(head, hidden, labels, mode, weight, chunks, None)
}

/// [`cross_entropy_backward`], with `extra` (a `[1]` term of the same graph as `hidden`,
/// already weighted: the load-balancing loss) back-propagated with the body's pass.
pub fn cross_entropy_backward_with<B: AutodiffBackend>(
    head: &OutputHead<B>,
    hidden: Tensor<B, 3>,
    labels: &[i64],
    mode: ForwardMode,
    weight: f64,
    chunks: &[Range<usize>],
    extra: Option<Tensor<B, 1>>,
) -> (Tensor<B, 1>, Vec<B::Gradients>) {
    let [batch, seq, width] = hidden.dims();
    let rows = batch * seq;
    let device = hidden.device();
    let (targets, mask) = next_token_targets(labels, batch);
    let count = mask.iter().filter(|m| **m > 0.0).count().max(1) as f64;
    // Only the rows with a target are projected (a prompt's, a padding's have none): their
    // loss terms and gradients are exactly zero, and the projection onto a real vocabulary is
    // a large share of the step. A batch with no target keeps every row (a zero loss, zero
    // gradients, as before).
    let labelled: Vec<usize> = (0..rows).filter(|&r| mask[r] > 0.0).collect();
    let kept = (!labelled.is_empty() && labelled.len() < rows)
        .then(|| (row_index::<B::InnerBackend>(&labelled, &device), labelled));
    let flat = hidden.clone().reshape([rows, width]).inner();
    let (flat, targets, mask, chunks) = match &kept {
        Some((index, kept)) => {
            fn pick<T: Copy>(kept: &[usize], values: &[T]) -> Vec<T> {
                kept.iter().map(|&r| values[r]).collect()
            }
            // Each chunk keeps its own rows that have a target.
            let at = |row: usize| kept.partition_point(|&r| r < row);
            let chunks = chunks
                .iter()
                .map(|c| at(c.start)..at(c.end))
                .filter(|c| !c.is_empty())
                .collect();
            (
                flat.select(0, index.clone()),
                pick(kept, &targets),
                pick(kept, &mask),
                chunks,
            )
        }
        None => (flat, targets, mask, chunks.to_vec()),
    };

    let mut grads = Vec::new();
    let mut hidden_grad = Vec::new();
    let mut loss_sum = precision::f32_tensor::<B::InnerBackend, 1>(vec![0.0], [1], &device);
    for range in chunks {
        let n = range.len();
        let rows_in = Tensor::<B, 2>::from_inner(flat.clone().slice(range.clone())).require_grad();
        let logits = precision::to_f32(head.project(rows_in.clone(), mode));
        let chunk_mask = precision::f32_tensor::<B, 1>(mask[range.clone()].to_vec(), [n], &device);
        let log_probs = kernels::target_log_probs(logits, &targets[range]) * chunk_mask;
        let chunk_loss = log_probs.sum().neg() / count;
        loss_sum = loss_sum + chunk_loss.clone().inner();
        let chunk_grads = (chunk_loss * weight).backward();
        if let Some(g) = rows_in.grad(&chunk_grads) {
            hidden_grad.push(g);
        }
        grads.push(chunk_grads);
    }
    let body = (!hidden_grad.is_empty()).then(|| {
        let upstream = Tensor::cat(hidden_grad, 0);
        // The rows without a target get a zero gradient (added onto zeros: burn 0.21 has
        // only the adding `select_assign`).
        let upstream = match &kept {
            Some((index, _)) => {
                let zeros =
                    precision::to_dtype(Tensor::zeros([rows, width], &device), upstream.dtype());
                zeros.select_assign(0, index.clone(), upstream, IndexingUpdateOp::Add)
            }
            None => upstream,
        };
        (hidden * Tensor::from_inner(upstream.reshape([batch, seq, width]))).sum()
    });
    let body = match (body, extra) {
        (Some(body), Some(extra)) => Some(body + extra),
        (body, extra) => body.or(extra),
    };
    if let Some(body) = body {
        grads.push(body.backward());
    }
    (Tensor::from_inner(loss_sum), grads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_row_once() {
        assert_eq!(chunk_ranges(100, 8), vec![0..100]);
        assert_eq!(
            chunk_ranges(1024, 8),
            vec![0..256, 256..512, 512..768, 768..1024]
        );
        let ranges = chunk_ranges(8 * 2048 + 5, 8);
        assert_eq!(ranges.len(), 8);
        assert_eq!(ranges.first().map(|r| r.start), Some(0));
        assert_eq!(ranges.last().map(|r| r.end), Some(8 * 2048 + 5));
        assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
    }
}
