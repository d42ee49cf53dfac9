//! Matrix products on the CPU (f32 and bf16), with a backward that computes both gradients
//! the same way.
//!
//! f32: single matrices (the linear layers, LoRA, the output projection) call the `gemm` crate
//! directly, as burn-flex does, but write into a fresh buffer that is not zeroed first.
//! burn-flex 0.21 allocates each product's output as a zeroed `Vec<u8>`, which
//! `Bytes::from_bytes_vec` then copies into a 16-byte-aligned allocation: a memset and a
//! memcpy of every output, 3-4% of a SmolLM2-135M LoRA step in `perf`. Batched products stay
//! on burn-flex's matmul.
//!
//! bf16: three paths, all with f32 sums and one rounding to bf16 per product (what PyTorch's
//! CPU and cuBLAS bf16 GEMMs compute; each product of two bf16 values is exact in f32):
//! - A few rows times a K-contiguous matrix (decoding: `x @ w.T` for one token) reads the
//!   weight in place, widening it in L1 ([`bf16_gemv`]), on any CPU.
//! - On CPUs with AVX512-BF16, a single matrix times one of at least [`NATIVE_MIN_COLS`] columns
//!   runs on the native bf16 GEMM ([`bf16_gemm`]), twice the multiply-adds per instruction of f32.
//! - Elsewhere the operands are widened to f32 in parallel (views keep their strides) and
//!   multiplied by the f32 product above.
//!
//! Why bf16 is here: burn-flex 0.21's own bf16 matmul is single-threaded around its f32 GEMM
//! (see [`super::bf16`]) and burn's autodiff matmul calls it three times per product.
//!
//! Every other backend stays on burn's matmul.

use std::cell::OnceCell;

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary, broadcast_shape};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, Tensor, TensorData, TensorMetadata, bf16};
use burn_flex::{Flex, FlexTensor};

use super::bf16::{to_bf16, to_f32};
use super::bf16_gemm::{self, Operand};
use super::bf16_gemv;
use super::dispatch::{AutodiffFlexTensor, FlexOpN, on_flex_n};
use super::f32_skinny;

/// `lhs @ rhs` over the last two dimensions, batch dimensions broadcast as burn's `matmul`.
pub fn matmul<B: Backend, const D: usize>(lhs: Tensor<B, D>, rhs: Tensor<B, D>) -> Tensor<B, D> {
    match on_flex_n([lhs, rhs], Matmul) {
        Ok(y) => y,
        Err([lhs, rhs]) => lhs.matmul(rhs),
    }
}

/// The product of two f32 Flex tensors: [`f32_matrix_product`] for single matrices, else
/// burn-flex's (batched, broadcasting) matmul.
fn f32_product(lhs: &FlexTensor, rhs: &FlexTensor) -> FlexTensor {
    f32_matrix_product(lhs, rhs).unwrap_or_else(|| Flex::float_matmul(lhs.clone(), rhs.clone()))
}

/// Products of at least this many multiply-adds run on all of rayon's threads (burn-flex's
/// threshold, so the split, and with it every sum, is the same as there).
const PARALLEL_MIN_MACS: usize = 192 * 192 * 192;

/// All of rayon's threads for an `[m, k] @ [k, n]` product of [`PARALLEL_MIN_MACS`] or more.
fn parallelism(m: usize, n: usize, k: usize) -> gemm::Parallelism {
    if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_MIN_MACS {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    }
}

/// `y += x[:, first..first + count] @ w` by the `gemm` crate: `y` is `[m, n]` and `x` is
/// `[m, k]`, both row-major, `w` holds `count` rows of `n` values. For a product whose right
/// operand is made a block of K rows at a time (a frozen NF4 weight decoded block by block).
#[allow(clippy::too_many_arguments)]
pub fn matmul_accumulate(
    y: &mut [f32],
    x: &[f32],
    m: usize,
    k: usize,
    first: usize,
    count: usize,
    w: &[f32],
    n: usize,
) {
    assert!(
        y.len() == m * n && x.len() == m * k && first + count <= k && w.len() >= count * n,
        "matmul_accumulate: operands of other sizes than [m, n], [m, k] and [count, n]"
    );
    let parallelism = parallelism(m, n, count);
    // SAFETY: the sizes were checked above: `x`'s columns `first..first + count` of every row
    // (row stride `k`), `w`'s first `count` rows (row stride `n`) and `y`'s `m * n` values lie
    // in their slices. With `read_dst` the gemm crate computes `y = 1 * y + 1 * x @ w`.
    unsafe {
        gemm::gemm(
            m,
            n,
            count,
            y.as_mut_ptr(),
            1,
            n as isize,
            true,
            x.as_ptr().add(first),
            1,
            k as isize,
            w.as_ptr(),
            1,
            n as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// `lhs @ rhs` for two f32 single matrices (leading dimensions of 1, any strides) by the `gemm`
/// crate, into a buffer it writes without reading; `None` for batched operands.
fn f32_matrix_product(lhs: &FlexTensor, rhs: &FlexTensor) -> Option<FlexTensor> {
    let (a, b) = (matrix_view(lhs)?, matrix_view(rhs)?);
    let (m, k, n) = (a.rows, a.cols, b.cols);
    debug_assert_eq!(k, b.rows, "matmul: inner dimensions must match");
    if let Some(values) = skinny(lhs, &a, rhs, &b) {
        return Some(output(lhs, rhs, values));
    }
    let parallelism = parallelism(m, n, k);
    let a_data: &[f32] = lhs.storage();
    let b_data: &[f32] = rhs.storage();
    let len = m
        .checked_mul(n)
        .expect("matmul: output size overflows usize");
    let mut out: Vec<f32> = Vec::with_capacity(len);
    // SAFETY: the operand pointers are the views' first elements and every element the
    // strides reach lies in their storage (burn's layouts guarantee it). `out` has room for
    // `m * n` values in row-major order. With `read_dst` false the gemm crate sets alpha to
    // zero, and each of its paths (blocked kernels, gemv, gevv, k == 0) then stores into the
    // destination without reading it, so every one of the `len` values is written before
    // `set_len`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            a_data.as_ptr().add(a.offset),
            a.col_stride,
            a.row_stride,
            b_data.as_ptr().add(b.offset),
            b.col_stride,
            b.row_stride,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
        out.set_len(len);
    }
    Some(output(lhs, rhs, out))
}

/// From this many weight values (128 KB in f32) a one-row product (a decoding step's, batch 1)
/// takes [`f32_skinny`], whose columns are split over rayon's threads, instead of the gemm
/// crate's gemv, which runs on the calling thread whatever the `Parallelism` asked.
///
/// Why: a decoding step reads every weight once, so it runs at the memory bandwidth the threads
/// reading it get; one thread got half of what two get on the Intel Xeon that BENCHMARKS.md
/// measured on 2026-12-06 (SmolLM2-135M fp32 greedy decoding 25.8 -> 49.7-53.4 tokens/s, the
/// Qwen3-MoE layers 29.5-31.4 -> 61.6-67.2, the same tokens). From 128 KB rather than 1 MB:
/// SmolLM2-135M 49.5-50.5 -> 51.9-52.9 tokens/s (its k/v weights are 432 KB). Below it (the
/// tiny test model's 16 and 32 KB weights) handing the work to the pool costs more than
/// reading the weight.
const ONE_ROW_MIN_WEIGHT: usize = 32 * 1024;

/// `lhs @ rhs` by [`f32_skinny`] (a few rows times a weight read in place) when `lhs` has
/// [`f32_skinny::ROWS`] rows, or one row against a weight of [`ONE_ROW_MIN_WEIGHT`] values or
/// more, and `rhs` is a transposed row-major weight (K contiguous, lines at a non-negative
/// stride); else `None`.
fn skinny(lhs: &FlexTensor, a: &MatrixView, rhs: &FlexTensor, b: &MatrixView) -> Option<Vec<f32>> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let rows_taken = f32_skinny::ROWS.contains(&m) || (m == 1 && k * n >= ONE_ROW_MIN_WEIGHT);
    if !rows_taken || b.row_stride != 1 || b.col_stride < 0 || k == 0 {
        return None;
    }
    let rows = gathered_rows(lhs, a);
    let b_data: &[f32] = rhs.storage();
    Some(f32_skinny::product(
        &rows,
        m,
        k,
        b_data,
        b.offset,
        b.col_stride as usize,
        n,
    ))
}

/// The rows of the matrix `a` views in `x`, row-major and contiguous: one copy per row where
/// the view's rows are contiguous, else element by element.
fn gathered_rows(x: &FlexTensor, a: &MatrixView) -> Vec<f32> {
    let data: &[f32] = x.storage();
    let (m, k) = (a.rows, a.cols);
    if a.col_stride == 1 && a.row_stride >= 0 {
        let mut rows = Vec::with_capacity(m * k);
        for r in 0..m {
            let start = a.offset + r * a.row_stride as usize;
            rows.extend_from_slice(&data[start..start + k]);
        }
        return rows;
    }
    (0..m)
        .flat_map(|r| (0..k).map(move |c| (r, c)))
        .map(|(r, c)| {
            let at = a.offset as isize + r as isize * a.row_stride + c as isize * a.col_stride;
            data[at as usize]
        })
        .collect()
}

/// A single matrix's place in its storage: the last two dimensions of a tensor whose leading
/// dimensions are all 1.
struct MatrixView {
    offset: usize,
    rows: usize,
    cols: usize,
    row_stride: isize,
    col_stride: isize,
}

fn matrix_view(x: &FlexTensor) -> Option<MatrixView> {
    let layout = x.layout();
    let shape = layout.shape();
    let rank = shape.num_dims();
    if rank < 2 || shape.iter().take(rank - 2).any(|&d| d != 1) {
        return None;
    }
    let strides = layout.strides();
    Some(MatrixView {
        offset: layout.start_offset(),
        rows: shape[rank - 2],
        cols: shape[rank - 1],
        row_stride: strides[rank - 2],
        col_stride: strides[rank - 1],
    })
}

/// The product of two bf16 Flex tensors in f32, not yet rounded.
fn product_f32(lhs: &FlexTensor, rhs: &FlexTensor) -> FlexTensor {
    skinny_product(lhs, rhs)
        .or_else(|| native_product(lhs, rhs))
        .unwrap_or_else(|| f32_product(&to_f32(lhs), &to_f32(rhs)))
}

/// The product by [`bf16_gemv::skinny`] (a few rows times a weight read in place: decoding)
/// when both operands are single matrices and `rhs` is K-contiguous; else `None`.
fn skinny_product(lhs: &FlexTensor, rhs: &FlexTensor) -> Option<FlexTensor> {
    let values = bf16_gemv::skinny(operand(lhs)?, operand(rhs)?)?;
    Some(output(lhs, rhs, values))
}

/// `values` (row-major) in the shape of `lhs @ rhs` for single matrices.
fn output(lhs: &FlexTensor, rhs: &FlexTensor, values: Vec<f32>) -> FlexTensor {
    let mut shape = lhs.shape();
    let rank = shape.num_dims();
    shape[rank - 1] = rhs.shape()[rank - 1];
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// Below this many output columns the native GEMM's 64-column panels would mostly multiply
/// padding (a LoRA A product has `rank` columns): those take the widening path.
const NATIVE_MIN_COLS: usize = 32;

/// The product by the native bf16 GEMM ([`bf16_gemm`]) when the CPU has it and both operands
/// are single matrices (leading dimensions of 1) with non-negative strides; else `None`.
fn native_product(lhs: &FlexTensor, rhs: &FlexTensor) -> Option<FlexTensor> {
    if !bf16_gemm::available() {
        return None;
    }
    let (a, b) = (operand(lhs)?, operand(rhs)?);
    if b.cols < NATIVE_MIN_COLS {
        return None;
    }
    Some(output(lhs, rhs, bf16_gemm::gemm(a, b)))
}

/// `x` (bf16) as a GEMM operand, when it is one matrix with non-negative strides (a view is
/// read in place).
pub(crate) fn operand(x: &FlexTensor) -> Option<Operand<'_>> {
    let view = matrix_view(x)?;
    Some(Operand {
        data: x.storage::<bf16>(),
        offset: view.offset,
        rows: view.rows,
        cols: view.cols,
        row_stride: usize::try_from(view.row_stride).ok()?,
        col_stride: usize::try_from(view.col_stride).ok()?,
    })
}

/// The last two dimensions swapped (a view).
fn transposed(x: &FlexTensor) -> FlexTensor {
    let rank = x.shape().num_dims();
    x.transpose(rank - 2, rank - 1)
}

struct Matmul;

impl FlexOpN<2> for Matmul {
    fn accepts(&self, dtype: DType) -> bool {
        matches!(dtype, DType::F32 | DType::BF16)
    }

    fn forward(&self, [lhs, rhs]: [&FlexTensor; 2]) -> FlexTensor {
        match lhs.dtype() {
            DType::BF16 => to_bf16(&product_f32(lhs, rhs)),
            _ => f32_product(lhs, rhs),
        }
    }

    fn autodiff<C: CheckpointStrategy>(
        &self,
        [lhs, rhs]: [AutodiffFlexTensor<C>; 2],
    ) -> AutodiffFlexTensor<C> {
        let lhs_tracked = lhs.is_tracked();
        let rhs_tracked = rhs.is_tracked();
        let shapes = (lhs.primitive.shape(), rhs.primitive.shape());
        let y = self.forward([&lhs.primitive, &rhs.primitive]);
        match MatmulBackward
            .prepare::<C>([lhs.node.clone(), rhs.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                // As burn's matmul: each operand is kept (or recomputed under activation
                // checkpointing) only when the other one needs a gradient.
                let lhs_state = rhs_tracked.then(|| prep.checkpoint(&lhs));
                let rhs_state = lhs_tracked.then(|| prep.checkpoint(&rhs));
                prep.finish((lhs_state, rhs_state, shapes.0, shapes.1), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

#[derive(Debug)]
struct MatmulBackward;

impl Backward<Flex, 2> for MatmulBackward {
    /// The operands each gradient needs, and both input shapes (to sum broadcast batch
    /// dimensions back).
    type State = (Option<NodeId>, Option<NodeId>, Shape, Shape);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, cp: &mut Checkpointer) {
        let (lhs, rhs, lhs_shape, rhs_shape) = ops.state;
        let lhs: Option<FlexTensor> = lhs.map(|id| cp.retrieve_node_output(id));
        let rhs: Option<FlexTensor> = rhs.map(|id| cp.retrieve_node_output(id));
        // bf16: where the widening path runs, the output gradient is widened once for both
        // products.
        let grad_f32 = OnceCell::new();
        // `a @ b`, where the output gradient is `a` (`grad_is_lhs`) or `b`.
        let product = |a: &FlexTensor, b: &FlexTensor, grad_is_lhs: bool| {
            if a.dtype() != DType::BF16 {
                return f32_product(a, b);
            }
            native_product(a, b).unwrap_or_else(|| {
                if grad_is_lhs {
                    f32_product(grad_f32.get_or_init(|| to_f32(a)), &to_f32(b))
                } else {
                    f32_product(&to_f32(a), grad_f32.get_or_init(|| to_f32(b)))
                }
            })
        };
        let finish = |product: FlexTensor, shape: &Shape, dtype: DType| {
            let summed = broadcast_shape::<Flex>(product, shape);
            if dtype == DType::BF16 {
                to_bf16(&summed)
            } else {
                summed
            }
        };
        binary::<Flex, _, _>(
            ops.parents,
            ops.node,
            grads,
            |grad| {
                let rhs = rhs.expect("the right operand is kept when the left needs a gradient");
                // grad_lhs = grad @ rhs^T, summed over the batch dimensions lhs broadcast.
                let rhs_t = transposed(&rhs);
                finish(product(&grad, &rhs_t, true), &lhs_shape, grad.dtype())
            },
            |grad| {
                let lhs = lhs.expect("the left operand is kept when the right needs a gradient");
                // grad_rhs = lhs^T @ grad, summed over the batch dimensions rhs broadcast.
                let lhs_t = transposed(&lhs);
                finish(product(&lhs_t, &grad, false), &rhs_shape, grad.dtype())
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 + seed) % 1013) as f32 / 1013.0 - 0.5)
            .collect()
    }

    /// One row times a transposed weight of [`ONE_ROW_MIN_WEIGHT`] values is the skinny
    /// product's (threaded) bit for bit; one value fewer stays on the gemm crate's gemv.
    #[test]
    fn one_row_against_a_large_weight_takes_the_threaded_skinny_product() {
        let k = 256;
        for (n, skinny_expected) in [
            (ONE_ROW_MIN_WEIGHT / k, true),
            (ONE_ROW_MIN_WEIGHT / k - 1, false),
        ] {
            let row = values(k, 1);
            let weight = values(n * k, 2);
            let lhs = FlexTensor::from_data(TensorData::new(row.clone(), [1, k]));
            // `[k, n]`, the weight `[n, k]` transposed as a view (K contiguous).
            let rhs =
                FlexTensor::from_data(TensorData::new(weight.clone(), [n, k])).transpose(0, 1);
            let got = f32_matrix_product(&lhs, &rhs).expect("single matrices");
            let skinny = f32_skinny::product(&row, 1, k, &weight, 0, k, n);
            let got: &[f32] = got.storage();
            assert_eq!(got.len(), n);
            let same_bits = got
                .iter()
                .zip(&skinny)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            let near = got.iter().zip(&skinny).all(|(a, b)| (a - b).abs() <= 1e-4);
            assert!(near, "n = {n}: not the product");
            assert_eq!(same_bits, skinny_expected, "n = {n}: which path");
        }
    }
}
