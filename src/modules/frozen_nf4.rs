//! A linear layer's frozen base weight stored in NF4 (QLoRA), as torchtune stores it: torchao's
//! `to_nf4` of the weight in the dtype the checkpoint stores it in, in torchtune's own row
//! order, dequantized in the model's dtype.
//!
//! torchtune permutes the rows of q_proj and k_proj when it converts a Hugging Face checkpoint
//! (its RoPE rotates interleaved pairs, Hugging Face's rotates halves), and quantizes the
//! permuted weight. NF4's double-quantized scales group 256 blocks of 64 values, so which rows
//! share a scaler block depends on the row order: quantizing Hugging Face's order would give a
//! different weight once a head spans several scaler blocks (any real model). So the rows are
//! permuted as torchtune permutes them before quantizing, and back on every dequantization.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rayon::prelude::*;

use super::nf4::{BLOCK_SIZE, Nf4Dtype, Nf4Error, Nf4Weight, block_table};
use crate::kernels::simd::{self, multiversion};

/// The row order a weight is quantized in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowOrder {
    /// Hugging Face's order, as stored.
    Stored,
    /// torchtune's `hf_to_tune` permutation of q_proj/k_proj rows for heads of `head_dim`:
    /// within each head, the two halves interleaved (row `2i + j` of the head is Hugging
    /// Face's row `j * head_dim / 2 + i`).
    RopeInterleaved { head_dim: usize },
}

impl RowOrder {
    /// The Hugging Face row that lands at quantized row `row`.
    fn source_row(self, row: usize) -> usize {
        match self {
            Self::Stored => row,
            Self::RopeInterleaved { head_dim } => {
                let (head, within) = (row / head_dim, row % head_dim);
                head * head_dim + (within % 2) * (head_dim / 2) + within / 2
            }
        }
    }

    /// The quantized row that holds Hugging Face's row `row` (the inverse of `source_row`).
    fn quantized_row(self, row: usize) -> usize {
        match self {
            Self::Stored => row,
            Self::RopeInterleaved { head_dim } => {
                let (head, within) = (row / head_dim, row % head_dim);
                let half = head_dim / 2;
                head * head_dim + 2 * (within % half) + within / half
            }
        }
    }
}

/// A frozen `[out, in]` weight in NF4.
#[derive(Debug, Clone)]
pub struct FrozenNf4 {
    pub nf4: Nf4Weight,
    pub order: RowOrder,
    /// The dtype it is dequantized in for the forward and backward passes: the model's.
    pub compute: Nf4Dtype,
}

impl FrozenNf4 {
    /// Quantizes `weight` (`[out, in]` row-major, Hugging Face order) in `dtype` (torchtune:
    /// the dtype the checkpoint stores it in), to be dequantized in `compute`.
    pub fn quantize(
        weight: &[f32],
        shape: [usize; 2],
        dtype: Nf4Dtype,
        compute: Nf4Dtype,
        order: RowOrder,
    ) -> Result<Self, Nf4Error> {
        let [out, inp] = shape;
        let reordered;
        let values = match order {
            RowOrder::Stored => weight,
            RowOrder::RopeInterleaved { .. } => {
                reordered = (0..out)
                    .flat_map(|row| {
                        let src = order.source_row(row);
                        weight[src * inp..(src + 1) * inp].iter().copied()
                    })
                    .collect::<Vec<f32>>();
                &reordered
            }
        };
        Ok(Self {
            nf4: Nf4Weight::quantize(values, &shape, dtype)?,
            order,
            compute,
        })
    }

    pub fn shape(&self) -> [usize; 2] {
        [self.nf4.shape[0], self.nf4.shape[1]]
    }

    /// The weight as torchtune saves it: its QLoRA state-dict hook casts the NF4 tensor to
    /// bf16 whatever the model dtype, i.e. the compute-dtype dequantization rounded to bf16.
    pub fn dequantize_for_export(&self) -> Vec<f32> {
        let mut values = self.dequantize();
        if self.compute != Nf4Dtype::Bf16 {
            values
                .par_iter_mut()
                .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
        }
        values
    }

    /// The dequantized weight in the compute dtype, Hugging Face's row order, `[out, in]`
    /// row-major. Rows are decoded in parallel: this runs for every NF4 layer in every forward
    /// and backward pass.
    pub fn dequantize(&self) -> Vec<f32> {
        let [out, inp] = self.shape();
        let compute = self.compute;
        let scales = self.nf4.block_scales_in(compute);
        let mut values = vec![0.0; out * inp];
        values
            .par_chunks_mut(inp.max(1))
            .enumerate()
            .for_each(|(row, dst)| {
                let start = self.order.quantized_row(row) * inp;
                self.nf4.dequantize_into(&scales, compute, start, dst);
            });
        values
    }

    /// The dequantized weight as a tensor of the device's float dtype.
    pub fn to_tensor<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2> {
        Tensor::from_data(TensorData::new(self.dequantize(), self.shape()), device)
    }

    /// `x @ W^T` for a few rows of `x` (`[rows, in]` row-major; decoding's one token), without
    /// materialising `W`: each 64-value block is decoded into a small buffer through a table of
    /// its 16 possible values (the dequantized weight's exact values) and dotted with the rows.
    /// Reads half a byte per weight where a float matmul reads four, so a decode step is
    /// cheaper than dequantizing. Only the summation order differs from the dequantized
    /// matmul. Needs `in` a multiple of the block size (blocks within rows).
    pub fn matmul_rows(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let [out, inp] = self.shape();
        debug_assert!(inp.is_multiple_of(BLOCK_SIZE) && x.len() == rows * inp);
        let scales = self.nf4.block_scales_in(self.compute);
        let levels = self.nf4.levels();
        // y^T [out, rows], one output row per task.
        let mut yt = vec![0.0f32; out * rows];
        yt.par_chunks_mut(rows).enumerate().for_each(|(o, acc)| {
            let start = self.order.quantized_row(o) * inp;
            let codes = &self.nf4.codes[start / 2..(start + inp) / 2];
            let scales = &scales[start / BLOCK_SIZE..(start + inp) / BLOCK_SIZE];
            decode_dot(codes, scales, &levels, self.compute, x, inp, acc);
        });
        let mut y = vec![0.0f32; rows * out];
        for (o, acc) in yt.chunks_exact(rows).enumerate() {
            for (r, v) in acc.iter().enumerate() {
                y[r * out + o] = *v;
            }
        }
        y
    }

    /// Bytes held by the quantized weight.
    pub fn bytes(&self) -> usize {
        self.nf4.bytes()
    }
}

multiversion! {
    /// One output row: `acc[r] = x[r] . w` for `w` the row's blocks (`codes`, `scales`).
    fn decode_dot(
        codes: &[u8],
        scales: &[f32],
        levels: &[f32; 16],
        compute: Nf4Dtype,
        x: &[f32],
        inp: usize,
        acc: &mut [f32],
    ) {
        let mut w = [0.0f32; BLOCK_SIZE];
        for (b, (block, &scale)) in codes.chunks_exact(BLOCK_SIZE / 2).zip(scales).enumerate() {
            let table = block_table(levels, scale, compute);
            for (pair, byte) in w.chunks_exact_mut(2).zip(block) {
                pair[0] = table[usize::from(byte >> 4)];
                pair[1] = table[usize::from(byte & 0x0f)];
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let xs = &x[r * inp + b * BLOCK_SIZE..r * inp + (b + 1) * BLOCK_SIZE];
                *a += simd::dot(&w, xs);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fused_row_product_equals_the_dequantized_matmul() {
        let (out, inp) = (256, 128);
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 0.1)
            .collect();
        for order in [RowOrder::Stored, RowOrder::RopeInterleaved { head_dim: 64 }] {
            for compute in [Nf4Dtype::F32, Nf4Dtype::Bf16] {
                let q =
                    FrozenNf4::quantize(&w, [out, inp], Nf4Dtype::Bf16, compute, order).unwrap();
                let dq = q.dequantize();
                for rows in 1..=3 {
                    let x: Vec<f32> = (0..rows * inp).map(|i| (i % 13) as f32 - 6.0).collect();
                    let y = q.matmul_rows(&x, rows);
                    for r in 0..rows {
                        for o in 0..out {
                            let want: f32 =
                                (0..inp).map(|k| x[r * inp + k] * dq[o * inp + k]).sum();
                            let got = y[r * out + o];
                            assert!(
                                (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                                "{order:?} {compute:?} rows {rows}: [{r}, {o}] {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn interleaved_rows_follow_torchtunes_permute() {
        // head_dim 4: torchtune's rows are HF rows [0, 2, 1, 3] per head.
        let order = RowOrder::RopeInterleaved { head_dim: 4 };
        let rows: Vec<usize> = (0..8).map(|r| order.source_row(r)).collect();
        assert_eq!(rows, [0, 2, 1, 3, 4, 6, 5, 7]);
        for row in 0..8 {
            assert_eq!(order.quantized_row(order.source_row(row)), row);
        }
    }

    #[test]
    fn the_interleaved_order_quantizes_torchtunes_rows_and_dequantizes_to_hugging_faces() {
        let (heads, head_dim, inp) = (2, 128, 64);
        let out = heads * head_dim;
        let weight: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5 + (i / inp) as f32 * 0.01)
            .collect();
        // torchtune's `t.view(heads, 2, head_dim / 2, in).transpose(1, 2).reshape(out, in)`
        let mut permuted = Vec::with_capacity(weight.len());
        for h in 0..heads {
            for i in 0..head_dim / 2 {
                for j in 0..2 {
                    let src = h * head_dim + j * head_dim / 2 + i;
                    permuted.extend_from_slice(&weight[src * inp..(src + 1) * inp]);
                }
            }
        }
        let f32 = Nf4Dtype::F32;
        let tt = FrozenNf4::quantize(&permuted, [out, inp], f32, f32, RowOrder::Stored);
        let ours = FrozenNf4::quantize(
            &weight,
            [out, inp],
            f32,
            f32,
            RowOrder::RopeInterleaved { head_dim },
        );
        let (tt, ours) = (tt.unwrap(), ours.unwrap());
        assert_eq!(tt.nf4, ours.nf4, "the same quantized weight as torchtune's");
        let (tt_rows, ours_rows) = (tt.dequantize(), ours.dequantize());
        for row in 0..out {
            let src = RowOrder::RopeInterleaved { head_dim }.source_row(row);
            assert_eq!(
                tt_rows[row * inp..(row + 1) * inp],
                ours_rows[src * inp..(src + 1) * inp],
                "row {row}"
            );
        }
    }
}
