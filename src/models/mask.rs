//! Additive attention masks built on the host: causal, with an offset for cached keys, and
//! block-diagonal for packed sequences so packed samples never attend to each other.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

/// Large and finite, so a fully masked row cannot turn into NaN through `-inf - -inf`.
const MASKED: f32 = -1.0e30;

/// The additive mask for scores `[batch, kv_heads, n_rep * q_len, k_len]`: query `i`
/// (absolute position `offset + i`) may see key `j` when `j <= offset + i` and, with document
/// ids, both belong to the same document.
///
/// The mask is written out at the scores' full shape, once per forward pass: Flex adds a
/// broadcast operand with its SIMD kernel only when it is a single row (or one scalar per
/// row); a `[q_len, k_len]` mask broadcast over batch and heads takes its strided scalar path,
/// which was the largest non-matmul cost of a training step in every layer.
pub fn causal<B: Backend>(
    batch: usize,
    heads: (usize, usize),
    q_len: usize,
    offset: usize,
    document_ids: Option<&[u32]>,
    device: &B::Device,
) -> Tensor<B, 4> {
    let k_len = offset + q_len;
    let rows = if document_ids.is_some() { batch } else { 1 };
    let mut mask = vec![0.0f32; rows * q_len * k_len];
    for b in 0..rows {
        for i in 0..q_len {
            for j in 0..k_len {
                let future = j > offset + i;
                let other_doc =
                    document_ids.is_some_and(|d| d[b * k_len + j] != d[b * k_len + offset + i]);
                if future || other_doc {
                    mask[(b * q_len + i) * k_len + j] = MASKED;
                }
            }
        }
    }
    let (kv_heads, n_rep) = heads;
    let per_row = q_len * k_len;
    let mut full = Vec::with_capacity(batch * kv_heads * n_rep * per_row);
    for b in 0..batch {
        // Without document ids every row shares row 0's causal mask.
        let row = &mask[(b % rows) * per_row..][..per_row];
        for _ in 0..kv_heads * n_rep {
            full.extend_from_slice(row);
        }
    }
    Tensor::from_data(
        TensorData::new(full, [batch, kv_heads, n_rep * q_len, k_len]),
        device,
    )
}
