//! `x @ W^T` for a frozen NF4 weight `W` (torchao's `linear_nf4`, torchtune's QLoRA base
//! layers), with a backward of its own.
//!
//! Why: burn's autodiff matmul keeps both operands for the backward pass, so a plain
//! `x.matmul(dequantized.transpose())` would hold every layer's dequantized weight from the
//! forward pass until the backward pass: the whole model in float at once, which is what
//! QLoRA exists to avoid. Here the forward pass dequantizes, multiplies and drops the weight;
//! the backward pass dequantizes it again for `grad_x = grad_y @ W` (the weight is frozen, so
//! it has no gradient), as torchao's `LinearNF4.backward` does. In bf16 on a CPU with
//! AVX512-BF16 neither pass holds the dequantized weight at all: the GEMM decodes it block by
//! block as its micro-kernels ask ([`super::nf4_panels`]); in f32 neither does a product of a
//! few rows (an expert's tokens: decoded lines or row blocks, [`decoded_in_f32_product`]).
//!
//! The op is written once against burn's backend API, so it serves Flex, CUDA and wgpu alike.

use std::sync::Arc;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorData, TensorMetadata, TensorPrimitive};
use burn_flex::{Flex, FlexTensor};

use super::frozen_nf4::FrozenNf4;
use super::nf4::BLOCK_SIZE;
use super::nf4_panels::Side;
use crate::kernels::bf16::{to_bf16, to_f32};
use crate::kernels::bf16_gemm;
use crate::kernels::dispatch::{as_autodiff, as_flex_of, from_autodiff, from_flex};

/// Up to this many rows (decoding's one token per sequence), an un-differentiated product on
/// the CPU decodes the weight block by block into the product instead of dequantizing it:
/// measured on Llama-3.2-1B decoding (BENCHMARKS.md). Prefill and training use the
/// dequantize-then-matmul path, where the matmul dominates.
const FUSED_MAX_ROWS: usize = 4;

/// `x` `[rows, in]` times the dequantized weight `[out, in]` transposed: `[rows, out]`.
pub fn nf4_linear<B: Backend>(x: Tensor<B, 2>, weight: &Arc<FrozenNf4>) -> Tensor<B, 2> {
    // Autodiff over each inner backend this build has (Rust has no specialisation: the
    // backend is matched by type, see `dispatch`).
    let x = match on_autodiff::<B, Flex>(x, weight) {
        Ok(y) => return y,
        Err(x) => x,
    };
    #[cfg(feature = "cuda")]
    let x = match on_autodiff::<B, burn::backend::Cuda>(x, weight) {
        Ok(y) => return y,
        Err(x) => x,
    };
    #[cfg(feature = "wgpu")]
    let x = match on_autodiff::<B, burn::backend::Wgpu>(x, weight) {
        Ok(y) => return y,
        Err(x) => x,
    };
    // No autodiff (generation, a frozen teacher or reference). A decode step's few rows on the
    // CPU: the fused product, which never materialises the weight.
    let [rows, inp] = x.dims();
    let x = if rows <= FUSED_MAX_ROWS && inp.is_multiple_of(BLOCK_SIZE) {
        match as_flex_of(x, |d| d == DType::F32 || d == DType::BF16) {
            Ok(flex) => {
                // bf16 rows are widened exactly and the f32 sums rounded once, as the bf16
                // product does (the weight's values are exact in its compute dtype).
                let half = flex.dtype() == DType::BF16;
                let flex = if half { to_f32(&flex) } else { flex }.to_contiguous();
                let y = weight.matmul_rows(flex.storage::<f32>(), rows);
                let out = weight.shape()[0];
                let y = FlexTensor::from_data(TensorData::new(y, [rows, out]));
                return from_flex(if half { to_bf16(&y) } else { y });
            }
            Err(x) => x,
        }
    } else {
        x
    };
    weight_product(x, weight, Side::Transposed)
}

/// `y` when `B` is `Autodiff<I>` with either checkpoint strategy, else `x` back.
fn on_autodiff<B: Backend, I: Backend>(
    x: Tensor<B, 2>,
    weight: &Arc<FrozenNf4>,
) -> Result<Tensor<B, 2>, Tensor<B, 2>> {
    let x = match with_strategy::<B, I, NoCheckpointing>(x, weight) {
        Ok(y) => return Ok(y),
        Err(x) => x,
    };
    with_strategy::<B, I, BalancedCheckpointing>(x, weight)
}

fn with_strategy<B: Backend, I: Backend, C: CheckpointStrategy>(
    x: Tensor<B, 2>,
    weight: &Arc<FrozenNf4>,
) -> Result<Tensor<B, 2>, Tensor<B, 2>> {
    let x = as_autodiff::<B, I, C, 2>(x)?;
    Ok(from_autodiff::<B, I, C, 2>(autodiff::<I, C>(x, weight)))
}

/// `x @ W^T` ([`Side::Transposed`]) or `x @ W` ([`Side::Plain`]) in `x`'s dtype. bf16 on a CPU
/// with the native bf16 GEMM decodes the weight into the product block by block
/// ([`super::nf4_panels`]); elsewhere the weight is dequantized whole (on the host for the
/// CPU, on the device elsewhere: [`FrozenNf4::to_tensor`]), multiplied, and dropped.
fn weight_product<B: Backend>(x: Tensor<B, 2>, weight: &FrozenNf4, side: Side) -> Tensor<B, 2> {
    let x = match as_flex_of(x, |d| d == DType::BF16 || d == DType::F32) {
        Ok(flex) => match decoded_in_product(&flex, weight, side) {
            Some(y) => return from_flex(y),
            None => from_flex(flex),
        },
        Err(x) => x,
    };
    let w = crate::kernels::cast(weight.to_tensor::<B>(&x.device()), x.dtype());
    let w = match side {
        Side::Transposed => w.transpose(),
        Side::Plain => w,
    };
    crate::kernels::matmul(x, w)
}

/// [`weight_product`] for a bf16 `x` on Flex by the native bf16 GEMM over the weight's decoded
/// panels, rounded to bf16 once as the bf16 products are; `None` where the CPU lacks
/// AVX512-BF16, the weight's rows hold part of a block, or `x` is no single matrix. An f32 `x`
/// goes to [`decoded_in_f32_product`].
fn decoded_in_product(x: &FlexTensor, weight: &FrozenNf4, side: Side) -> Option<FlexTensor> {
    if x.dtype() == DType::F32 {
        return decoded_in_f32_product(x, weight, side);
    }
    if !bf16_gemm::available() {
        return None;
    }
    let panels = weight.bf16_panels(side)?;
    let a = crate::kernels::bf16_operand(x)?;
    let n = panels.cols();
    let y = bf16_gemm::gemm_panels(a, n, &panels);
    Some(to_bf16(&FlexTensor::from_data(TensorData::new(
        y,
        [a.rows, n],
    ))))
}

/// [`weight_product`] for an f32 `x` of a few rows (an expert's tokens, a short prompt:
/// `f32_skinny::ROWS`), the weight never dequantized whole: the forward's `x @ W^T` by the
/// skinny product over the weight's lines decoded a few at a time
/// ([`FrozenNf4::matmul_rows_decoded`], bit for bit the product over the dequantized weight),
/// the backward's `g @ W` by gemm over blocks of its rows decoded into L2 and accumulated
/// ([`FrozenNf4::matmul_rows_plain_decoded`]). `None` for other row counts.
///
/// Why: with 128 experts of about 32 rows each, fp32 QLoRA dequantized every expert's weight
/// whole (6 MB in fp32 for one of Qwen3-30B-A3B's) to read it once (BENCHMARKS.md, "fp32 QLoRA
/// experts decoded in the product").
fn decoded_in_f32_product(x: &FlexTensor, weight: &FrozenNf4, side: Side) -> Option<FlexTensor> {
    let shape = x.shape();
    if shape.num_dims() != 2 {
        return None;
    }
    let rows = shape[0];
    if !crate::kernels::f32_skinny::ROWS.contains(&rows) {
        return None;
    }
    let x = x.to_contiguous();
    let [out, inp] = weight.shape();
    let (y, width) = match side {
        Side::Transposed => (weight.matmul_rows_decoded(x.storage::<f32>(), rows)?, out),
        Side::Plain => (
            weight.matmul_rows_plain_decoded(x.storage::<f32>(), rows)?,
            inp,
        ),
    };
    Some(FlexTensor::from_data(TensorData::new(y, [rows, width])))
}

/// [`weight_product`] on an autodiff backend's inner tensors.
fn inner_product<I: Backend>(x: FloatTensor<I>, weight: &FrozenNf4, side: Side) -> FloatTensor<I> {
    let x = Tensor::<I, 2>::from_primitive(TensorPrimitive::Float(x));
    weight_product(x, weight, side).into_primitive().tensor()
}

#[derive(Debug)]
struct Nf4LinearBackward {
    weight: Arc<FrozenNf4>,
}

impl<I: Backend> Backward<I, 1> for Nf4LinearBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        unary::<I, _>(ops.parents, ops.node, grads, |grad| {
            // grad_x [rows, in] = grad_y [rows, out] @ W [out, in], W decoded again.
            inner_product::<I>(grad, &self.weight, Side::Plain)
        });
    }
}

fn autodiff<I: Backend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<I, C>>,
    weight: &Arc<FrozenNf4>,
) -> FloatTensor<Autodiff<I, C>> {
    let y = inner_product::<I>(x.primitive.clone(), weight, Side::Transposed);
    let backward = Nf4LinearBackward {
        weight: Arc::clone(weight),
    };
    match backward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}
