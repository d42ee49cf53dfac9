//! Losses over vocabulary logits, computed in fp32 (half-precision logits are upcast) over the positions whose label is not -100,
//! with the causal shift: the logits at position t predict the label at t + 1.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::precision;

pub const IGNORE_INDEX: i64 = -100;

/// Next-token targets for a `[batch, seq]` label grid: `(targets, mask)` of `[batch * seq]`,
/// where position `t` predicts the label at `t + 1`. The last position of each row and
/// ignored labels get target 0 and mask 0.
///
/// Every position keeps its slot (rather than dropping the last one per row) so the logits
/// `[batch, seq, vocab]` are used as `[batch * seq, vocab]` without a copy: narrowing away
/// the last position made Flex copy the whole logits tensor element by element.
pub fn next_token_targets(labels: &[i64], batch: usize) -> (Vec<i32>, Vec<f32>) {
    let seq = labels.len() / batch.max(1);
    let mut targets = Vec::with_capacity(labels.len());
    let mut mask = Vec::with_capacity(labels.len());
    for row in labels.chunks(seq) {
        for t in 0..seq {
            let next = row.get(t + 1).copied().unwrap_or(IGNORE_INDEX);
            let keep = next != IGNORE_INDEX;
            targets.push(if keep { next as i32 } else { 0 });
            mask.push(if keep { 1.0 } else { 0.0 });
        }
    }
    (targets, mask)
}

/// Log-probability of each target under `logits` `[rows, vocab]`: `[rows]`.
pub fn target_log_probs<B: Backend>(logits: Tensor<B, 2>, targets: &[i32]) -> Tensor<B, 1> {
    crate::kernels::target_log_probs(logits, targets)
}

/// `[batch, seq, vocab]` -> `[batch * seq, vocab]` (a view).
pub fn flat_logits<B: Backend>(logits: Tensor<B, 3>) -> Tensor<B, 2> {
    let [batch, seq, vocab] = logits.dims();
    logits.reshape([batch * seq, vocab])
}

/// Per-position masked log-probabilities `[batch * seq]` (zero where ignored, and at each
/// row's last position) and the number of positions that count.
pub fn masked_log_probs<B: Backend>(logits: Tensor<B, 3>, labels: &[i64]) -> (Tensor<B, 1>, usize) {
    let batch = logits.dims()[0];
    let device = logits.device();
    let logits = precision::to_f32(logits);
    let (targets, mask) = next_token_targets(labels, batch);
    let count = mask.iter().filter(|m| **m > 0.0).count();
    let n = mask.len();
    let mask = precision::f32_tensor::<B, 1>(mask, [n], &device);
    (
        target_log_probs(flat_logits(logits), &targets) * mask,
        count,
    )
}

/// Mean cross-entropy over the positions whose shifted label is not -100, as
/// `F.cross_entropy(..., ignore_index=-100)`.
pub fn cross_entropy<B: Backend>(logits: Tensor<B, 3>, labels: &[i64]) -> Tensor<B, 1> {
    let (log_probs, count) = masked_log_probs(logits, labels);
    log_probs.sum().neg() / count.max(1) as f64
}

/// Sum of the label tokens' log-probabilities per row `[batch]` (DPO's sequence log-probs).
pub fn sequence_log_probs<B: Backend>(logits: Tensor<B, 3>, labels: &[i64]) -> Tensor<B, 1> {
    let [batch, seq, _] = logits.dims();
    let (log_probs, _) = masked_log_probs(logits, labels);
    log_probs.reshape([batch, seq]).sum_dim(1).reshape([batch])
}

/// Rows of `[batch * seq, vocab]` logits held at once by [`chunked_cross_entropy`].
const EVAL_CHUNK_ROWS: usize = 1024;

/// [`cross_entropy`] of the hidden states `[batch, seq, hidden]` without gradients, projecting
/// to the vocabulary [`EVAL_CHUNK_ROWS`] positions at a time so a long validation batch never
/// holds all its logits.
pub fn chunked_cross_entropy<B: Backend>(
    model: &crate::models::CausalLm<B>,
    hidden: Tensor<B, 3>,
    labels: &[i64],
    mode: crate::modules::ForwardMode,
) -> f64 {
    use burn::tensor::ElementConversion;
    let [batch, seq, width] = hidden.dims();
    let (targets, mask) = next_token_targets(labels, batch);
    let count = mask.iter().filter(|m| **m > 0.0).count();
    let flat = hidden.reshape([batch * seq, width]);
    let device = flat.device();
    // Gathered once, whatever the data (FSDP: every rank makes the same collective calls).
    let head = model.head();
    let mut total = 0.0;
    let rows = batch * seq;
    let mut start = 0;
    while start < rows {
        let end = (start + EVAL_CHUNK_ROWS).min(rows);
        if mask[start..end].iter().any(|m| *m > 0.0) {
            let logits = precision::to_f32(head.project(flat.clone().slice(start..end), mode));
            let m =
                precision::f32_tensor::<B, 1>(mask[start..end].to_vec(), [end - start], &device);
            let lp = target_log_probs(logits, &targets[start..end]) * m;
            let sum: f64 = lp.sum().into_scalar().elem();
            total += sum;
        }
        start = end;
    }
    -total / count.max(1) as f64
}
