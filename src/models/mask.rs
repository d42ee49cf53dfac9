//! Additive attention masks built on the host: causal, with an offset for cached keys, and
//! block-diagonal for packed sequences so packed samples never attend to each other.

use burn::tensor::backend::Backend;

pub use crate::kernels::AttentionMask;

/// Large and finite, so a fully masked row cannot turn into NaN through `-inf - -inf`.
const MASKED: f32 = -1.0e30;

/// Query `i` (absolute position `offset + i`) may see key `j` when `j <= offset + i` and, with
/// document ids, both belong to the same document.
pub fn causal<B: Backend>(
    batch: usize,
    q_len: usize,
    offset: usize,
    document_ids: Option<&[u32]>,
    device: &B::Device,
) -> AttentionMask<B> {
    causal_window(batch, q_len, offset, document_ids, None, device)
}

/// As [`causal`], and with a `window` query `i` sees only the last `window` positions up to
/// its own (`offset + i - window < j`), as transformers' sliding-window layers do.
pub fn causal_window<B: Backend>(
    batch: usize,
    q_len: usize,
    offset: usize,
    document_ids: Option<&[u32]>,
    window: Option<usize>,
    device: &B::Device,
) -> AttentionMask<B> {
    let k_len = offset + q_len;
    let rows = if document_ids.is_some() { batch } else { 1 };
    let mut mask = vec![0.0f32; rows * q_len * k_len];
    for b in 0..rows {
        for i in 0..q_len {
            for j in 0..k_len {
                let future = j > offset + i;
                let too_old = window.is_some_and(|w| j + w <= offset + i);
                let other_doc =
                    document_ids.is_some_and(|d| d[b * k_len + j] != d[b * k_len + offset + i]);
                if future || too_old || other_doc {
                    mask[(b * q_len + i) * k_len + j] = MASKED;
                }
            }
        }
    }
    AttentionMask::new(mask, [rows, q_len, k_len], device)
}
