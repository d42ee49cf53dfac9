//! Additive attention masks built on the host: causal, with an offset for cached keys, and
//! block-diagonal for packed sequences so packed samples never attend to each other.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

/// Large and finite, so a fully masked row cannot turn into NaN through `-inf - -inf`.
const MASKED: f32 = -1.0e30;

/// The additive mask for scores `[batch, kv_heads, n_rep, q_len, k_len]`: query `i`
/// (absolute position `offset + i`) may see key `j` when `j <= offset + i` and, with document
/// ids, both belong to the same document.
///
/// Without document ids every row shares one `[1, 1, 1, q_len, k_len]` mask. With them and
/// more than one row, the mask is written out at the scores' full shape: Flex adds a
/// broadcast operand with its SIMD kernel only when every outer axis broadcasts, and a
/// per-row mask broadcast over the heads would take its strided scalar path in every layer.
pub fn causal<B: Backend>(
    batch: usize,
    heads: (usize, usize),
    q_len: usize,
    offset: usize,
    document_ids: Option<&[u32]>,
    device: &B::Device,
) -> Tensor<B, 5> {
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
    if rows == 1 {
        return Tensor::from_data(TensorData::new(mask, [1, 1, 1, q_len, k_len]), device);
    }
    let (kv_heads, n_rep) = heads;
    let per_row = q_len * k_len;
    let mut full = Vec::with_capacity(rows * kv_heads * n_rep * per_row);
    for row in mask.chunks(per_row) {
        for _ in 0..kv_heads * n_rep {
            full.extend_from_slice(row);
        }
    }
    Tensor::from_data(
        TensorData::new(full, [rows, kv_heads, n_rep, q_len, k_len]),
        device,
    )
}
