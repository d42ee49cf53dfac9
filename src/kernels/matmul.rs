//! bf16 matrix products on the CPU, with a backward that computes both gradients the same way.
//!
//! Three paths, all with f32 sums and one rounding to bf16 per product (what PyTorch's CPU and
//! cuBLAS bf16 GEMMs compute; each product of two bf16 values is exact in f32):
//! - A few rows times a K-contiguous matrix (decoding: `x @ w.T` for one token) reads the
//!   weight in place, widening it in L1 ([`bf16_gemv`]), on any CPU.
//! - On CPUs with AVX512-BF16, a single matrix times one of at least [`NATIVE_MIN_COLS`] columns
//!   runs on the native bf16 GEMM ([`bf16_gemm`]), twice the multiply-adds per instruction of f32.
//! - Elsewhere the operands are widened to f32 in parallel (views keep their strides) and
//!   multiplied by burn-flex's f32 GEMM (strided, batched, broadcasting, multi-threaded).
//!
//! Why: burn-flex 0.21's own bf16 matmul is single-threaded around its f32 GEMM (see
//! [`super::bf16`]) and burn's autodiff matmul calls it three times per product.
//!
//! f32 products, and every other backend, stay on burn's matmul.

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

/// `lhs @ rhs` over the last two dimensions, batch dimensions broadcast as burn's `matmul`.
pub fn matmul<B: Backend, const D: usize>(lhs: Tensor<B, D>, rhs: Tensor<B, D>) -> Tensor<B, D> {
    match on_flex_n([lhs, rhs], Bf16Matmul) {
        Ok(y) => y,
        Err([lhs, rhs]) => lhs.matmul(rhs),
    }
}

/// The product of two bf16 Flex tensors in f32, not yet rounded.
fn product_f32(lhs: &FlexTensor, rhs: &FlexTensor) -> FlexTensor {
    skinny_product(lhs, rhs)
        .or_else(|| native_product(lhs, rhs))
        .unwrap_or_else(|| Flex::float_matmul(to_f32(lhs), to_f32(rhs)))
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

/// `x` (bf16) as a GEMM operand, when it is one matrix.
fn operand(x: &FlexTensor) -> Option<Operand<'_>> {
    let layout = x.layout();
    let shape = layout.shape();
    let rank = shape.num_dims();
    if rank < 2 || shape.iter().take(rank - 2).any(|&d| d != 1) {
        return None;
    }
    let strides = layout.strides();
    Some(Operand {
        data: x.storage::<bf16>(),
        offset: layout.start_offset(),
        rows: shape[rank - 2],
        cols: shape[rank - 1],
        row_stride: usize::try_from(strides[rank - 2]).ok()?,
        col_stride: usize::try_from(strides[rank - 1]).ok()?,
    })
}

/// The last two dimensions swapped (a view).
fn transposed(x: &FlexTensor) -> FlexTensor {
    let rank = x.shape().num_dims();
    x.transpose(rank - 2, rank - 1)
}

struct Bf16Matmul;

impl FlexOpN<2> for Bf16Matmul {
    fn accepts(&self, dtype: DType) -> bool {
        dtype == DType::BF16
    }

    fn forward(&self, [lhs, rhs]: [&FlexTensor; 2]) -> FlexTensor {
        to_bf16(&product_f32(lhs, rhs))
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
        // Where the widening path runs, the output gradient is widened once for both products.
        let grad_f32 = OnceCell::new();
        binary::<Flex, _, _>(
            ops.parents,
            ops.node,
            grads,
            |grad| {
                let rhs = rhs.expect("the right operand is kept when the left needs a gradient");
                // grad_lhs = grad @ rhs^T, summed over the batch dimensions lhs broadcast.
                let rhs_t = transposed(&rhs);
                let product = native_product(&grad, &rhs_t).unwrap_or_else(|| {
                    let grad = grad_f32.get_or_init(|| to_f32(&grad)).clone();
                    Flex::float_matmul(grad, to_f32(&rhs_t))
                });
                to_bf16(&broadcast_shape::<Flex>(product, &lhs_shape))
            },
            |grad| {
                let lhs = lhs.expect("the left operand is kept when the right needs a gradient");
                // grad_rhs = lhs^T @ grad, summed over the batch dimensions rhs broadcast.
                let lhs_t = transposed(&lhs);
                let product = native_product(&lhs_t, &grad).unwrap_or_else(|| {
                    let grad = grad_f32.get_or_init(|| to_f32(&grad)).clone();
                    Flex::float_matmul(to_f32(&lhs_t), grad)
                });
                to_bf16(&broadcast_shape::<Flex>(product, &rhs_shape))
            },
        );
    }
}
