//! Fused CPU kernels for the operations a training step spends its non-matmul time in:
//! softmax (attention, distillation), SiLU and SwiGLU (the MLP gate), the target
//! log-probability under a softmax (cross-entropy over the vocabulary), attention-head permutes
//! and the Adam update; and the matrix products themselves ([`matmul`]).
//!
//! The model and loss code stays generic over the backend and calls the functions here. When
//! the backend is Flex (the CPU backend), with or without autodiff, they run the fused row
//! kernels in [`rows`] with a vectorised `exp` and a hand-written backward. On any other
//! backend they are burn's own composed operations, except attention: on burn's cubecl
//! backends (CUDA, wgpu) it is tune's cubecl kernels ([`cube_attention`](mod@cube_attention)).
//! Why: burn's autodiff attention keeps every layer's `heads x seq x seq` probabilities, and
//! long sequences are what a GPU user runs out of device memory on first.
//!
//! bf16 on Flex: burn-flex 0.21 runs bf16 ops one element at a time on one core, so bf16
//! tensors take these kernels too: products on a bf16 GEMM ([`matmul`]), the row kernels and
//! attention in f32 between parallel casts ([`cast`]), one rounding per op.
//!
//! Why: burn 0.21 composes softmax from five ops (max, sub, exp, sum, div) whose autodiff
//! keeps every intermediate and recomputes `exp` in the backward, and Flex's `exp` is scalar
//! libm. Together that was about a third of a tiny-model LoRA step.

pub mod attention;
pub mod bf16;
pub mod bf16_gemm;
mod bf16_gemv;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod cube_attention;
pub(crate) mod dispatch;
pub mod f32_skinny;
mod flex;
mod matmul;
pub mod optim;
mod routed_rows;
pub mod rows;
pub mod simd;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorCreationOptions, TensorData};
use burn_flex::FlexTensor;

pub use dispatch::is_flex;
use dispatch::{AutodiffFlexTensor, FlexOp, FlexOpN, on_flex, on_flex_n};
use flex::OutputLayout;
pub(crate) use matmul::operand as bf16_operand;
pub use matmul::{matmul, matmul_accumulate};
pub use routed_rows::{add_rows, gather_rows};

/// Runs `f` on a thread of rayon's pool (this thread waits) when the pool has more than one
/// thread, else on this thread. For a whole CPU job on one worker.
///
/// Why: the kernels here run on rayon's pool, one thread per core. Called from a thread outside
/// it, every parallel op wakes the pool and puts the caller to sleep until the op is done, and
/// with one thread more than cores they fight for the cores: a decoding step (a few hundred
/// small parallel products) spent its time switching threads (276 000 context switches for 200
/// tokens of SmolLM2-135M on two cores, 14 000 from inside the pool). From inside, the caller
/// does its share of each op. Not with a pool of one: `f` may wait for another thread (the
/// checkpoint saver) that needs the pool, which its only thread would then never serve.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_num_threads() > 1 {
        rayon::scope(|_| f())
    } else {
        f()
    }
}

/// An additive attention mask `[mask_batch, q_len, k_len]` (0 where a query may see a key,
/// a large negative value elsewhere), shared by every head: `mask_batch` is 1 when all rows
/// share the causal pattern, or the batch size when packed documents differ per row.
///
/// It is kept on the host as well as on the device: the fused CPU softmax
/// ([`masked_softmax`]) reads it per score row instead of adding a mask
/// tensor at the scores' full shape in every layer.
#[derive(Debug, Clone)]
pub struct AttentionMask<B: Backend> {
    pub host: Arc<Vec<f32>>,
    /// Which keys each mask row shows, for the fused attention's block skipping.
    pub spans: Arc<Vec<attention::RowSpan>>,
    /// `[mask_batch, q_len, k_len]`.
    pub dims: [usize; 3],
    pub tensor: Tensor<B, 3>,
}

impl<B: Backend> AttentionMask<B> {
    /// The mask `host` `[mask_batch, q_len, k_len]` on the host and on `device` (in fp32
    /// whatever the run's dtype: it is added to scores the softmax upcasts).
    pub fn new(host: Vec<f32>, dims: [usize; 3], device: &B::Device) -> Self {
        let spans = attention::row_spans(&host, dims[2]);
        let tensor = Tensor::from_data(
            TensorData::new(host.clone(), dims),
            TensorCreationOptions::new(device.clone()).with_dtype(DType::F32),
        );
        Self {
            host: Arc::new(host),
            spans: Arc::new(spans),
            dims,
            tensor,
        }
    }
}

/// Whether [`attention`] may take the fused kernel (on by default; `tune bench --attention
/// composed` turns it off to measure the composed path).
static FUSED_ATTENTION: AtomicBool = AtomicBool::new(true);

pub fn set_fused_attention(enabled: bool) {
    FUSED_ATTENTION.store(enabled, Ordering::Relaxed);
}

/// The largest block (query rows per cube, keys per tile) the cubecl attention kernels may take;
/// 0: the largest the device's shared memory holds. `tune bench --attention-block` sets it, so
/// one GPU run can time each block.
static ATTENTION_BLOCK_CAP: AtomicUsize = AtomicUsize::new(0);

/// The block the cubecl attention kernels took last (0: they have not run).
static ATTENTION_BLOCK_USED: AtomicUsize = AtomicUsize::new(0);

pub fn set_attention_block_cap(cap: Option<usize>) {
    ATTENTION_BLOCK_CAP.store(cap.unwrap_or(0), Ordering::Relaxed);
}

/// The block the cubecl attention kernels took last, if they ran (`tune bench` reports it).
pub fn attention_block_used() -> Option<usize> {
    Some(ATTENTION_BLOCK_USED.load(Ordering::Relaxed)).filter(|&b| b > 0)
}

/// Whether attention on `B` is the fused kernel, whose cost follows the keys each query sees
/// (tiles the mask hides are skipped), not the rows' length squared: then a long row of
/// block-causal documents costs what the documents would alone (see `data::unpad`).
pub fn attention_skips_hidden_tiles<B: Backend>() -> bool {
    is_flex::<B>() && FUSED_ATTENTION.load(Ordering::Relaxed)
}

/// `softmax(q @ k^T (soft-capped) + mask) @ v` for queries `[batch, kv_heads, n_rep * q_len,
/// dim]` (already scaled) and keys and values `[batch, kv_heads, k_len, dim]`: grouped-query
/// attention as one batched product per kv head.
///
/// On Flex it is the fused kernel ([`attention`](mod@attention)): blocks, online softmax, and
/// a backward that recomputes the probabilities, so a layer keeps no `q_len * k_len` scores
/// for the backward; bf16 queries, keys and values are widened to fp32 for it and the output
/// rounded back (PyTorch's CPU attention accumulates bf16 in fp32 too). On CUDA and wgpu it is
/// the cubecl kernels of [`cube_attention`](mod@cube_attention) (the same algorithm, one source
/// for both). For a decoding step (one query position without autodiff) it is the composed
/// [`composed_attention`].
///
/// `sinks` (gpt-oss): one logit per query head (`[kv_heads * n_rep]`), an extra softmax term
/// with no value. The fused CPU kernel takes them (its backward gives their gradient), and so
/// does the cubecl path, as a per-row scaling of the plain kernels' output and gradients.
pub fn attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: &AttentionMask<B>,
    softcap: Option<f64>,
    sinks: Option<Tensor<B, 1>>,
) -> Tensor<B, 4> {
    attention_in(q, k, v, mask, softcap, sinks, OutputLayout::Grouped)
}

/// [`attention`] with its output `[batch, q_len, kv_heads * n_rep, dim]`: each position's
/// heads side by side, the output projection's input. On Flex the fused op writes this layout
/// itself and keeps it for its backward, so the projection's adapter and the attention share
/// one kept tensor (the grouped output and a permuted copy were two).
pub fn attention_by_position<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: &AttentionMask<B>,
    softcap: Option<f64>,
    sinks: Option<Tensor<B, 1>>,
) -> Tensor<B, 4> {
    attention_in(q, k, v, mask, softcap, sinks, OutputLayout::ByPosition)
}

#[allow(clippy::too_many_arguments)]
fn attention_in<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: &AttentionMask<B>,
    softcap: Option<f64>,
    sinks: Option<Tensor<B, 1>>,
    layout: OutputLayout,
) -> Tensor<B, 4> {
    /// The fused kernel over `N` inputs: `[q, k, v]`, or with the sinks (`[1, 1, 1, heads]`).
    struct Fused(flex::AttentionMasking, OutputLayout);
    impl<const N: usize> FlexOpN<N> for Fused {
        fn forward(&self, x: [&FlexTensor; N]) -> FlexTensor {
            flex::attention_inference(&x, &self.0, self.1)
        }
        fn autodiff<C: CheckpointStrategy>(
            &self,
            x: [AutodiffFlexTensor<C>; N],
        ) -> AutodiffFlexTensor<C> {
            flex::attention_autodiff::<C, N>(x, &self.0, self.1)
        }
    }
    let [mask_batch, q_len, _] = mask.dims;
    let laid_out = |grouped| match layout {
        OutputLayout::Grouped => grouped,
        OutputLayout::ByPosition => grouped_to_by_position(grouped, q_len),
    };
    let composed = |q, k, v, sinks| laid_out(composed_attention(q, k, v, mask, softcap, sinks));
    // A decoding step (one query position, no autodiff) on a cubecl device keeps burn's
    // batched products: a step's few query rows per head group would fill a fraction of the
    // cubecl kernels' blocks, and neither has been measured against the other there. On Flex
    // the fused kernel takes a whole group per task for one position
    // (`attention::one_position`).
    let decoding = q_len == 1 && !B::ad_enabled(&q.device()) && !is_flex::<B>();
    if !FUSED_ATTENTION.load(Ordering::Relaxed) || decoding {
        return composed(q, k, v, sinks);
    }
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    let ([q, k, v], sinks) = match cube_attention::attention(q, k, v, mask, softcap, sinks) {
        Ok(grouped) => return laid_out(grouped),
        Err(x) => x,
    };
    let dtype = q.dtype();
    if dtype == DType::BF16 && is_flex::<B>() {
        let [q, k, v] = [q, k, v].map(|t| cast(t, DType::F32));
        let sinks = sinks.map(|s| cast(s, DType::F32));
        return cast(attention_in(q, k, v, mask, softcap, sinks, layout), dtype);
    }
    let op = Fused(
        flex::AttentionMasking {
            mask: mask.host.clone(),
            spans: mask.spans.clone(),
            mask_batch,
            q_len,
            softcap: softcap.map(|c| c as f32),
        },
        layout,
    );
    match sinks {
        None => match on_flex_n([q, k, v], op) {
            Ok(out) => out,
            Err([q, k, v]) => composed(q, k, v, None),
        },
        Some(sinks) => {
            let heads = sinks.dims()[0];
            match on_flex_n([q, k, v, sinks.reshape([1, 1, 1, heads])], op) {
                Ok(out) => out,
                Err([q, k, v, sinks]) => composed(q, k, v, Some(sinks.reshape([heads]))),
            }
        }
    }
}

/// `[batch, kv_heads, n_rep * q_len, dim]` rows as `[batch, q_len, kv_heads * n_rep, dim]`.
fn grouped_to_by_position<B: Backend>(x: Tensor<B, 4>, q_len: usize) -> Tensor<B, 4> {
    let [batch, kv_heads, rows, dim] = x.dims();
    let n_rep = rows / q_len.max(1);
    permute(
        x.reshape([batch, kv_heads, n_rep, q_len, dim]),
        [0, 3, 1, 2, 4],
    )
    .reshape([batch, q_len, kv_heads * n_rep, dim])
}

/// `x` in `dtype` (no operation when it already is). On Flex, bf16 <-> f32 is a parallel,
/// vectorised pass forward and backward ([`bf16`](mod@bf16)); burn-flex 0.21 casts one element
/// at a time on one core.
pub fn cast<B: Backend, const D: usize>(x: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    struct Cast(DType);
    impl FlexOp for Cast {
        fn accepts(&self, dtype: DType) -> bool {
            matches!(
                (dtype, self.0),
                (DType::F32, DType::BF16) | (DType::BF16, DType::F32)
            )
        }
        fn forward(&self, x: &FlexTensor) -> FlexTensor {
            flex::cast_forward(x, self.0)
        }
        fn autodiff<C: CheckpointStrategy>(
            &self,
            x: AutodiffFlexTensor<C>,
        ) -> AutodiffFlexTensor<C> {
            flex::cast_autodiff::<C>(x, self.0)
        }
    }
    if x.dtype() == dtype {
        return x;
    }
    match on_flex(x, Cast(dtype)) {
        Ok(y) => y,
        Err(x) => x.cast(dtype),
    }
}

/// `f` (an fp32 kernel) on a bf16 `x` on Flex: widened, run and rounded back once, as
/// PyTorch's CPU kernels compute bf16 softmax and SiLU in fp32. Elsewhere `f(x)` as it is.
fn in_f32_on_flex<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    f: impl FnOnce(Tensor<B, D>) -> Tensor<B, D>,
) -> Tensor<B, D> {
    let dtype = x.dtype();
    if dtype == DType::BF16 && is_flex::<B>() {
        cast(f(cast(x, DType::F32)), dtype)
    } else {
        f(x)
    }
}

/// Gemma 2's soft-capping of attention scores and final logits: `tanh(x / cap) * cap`.
pub fn softcap<B: Backend, const D: usize>(x: Tensor<B, D>, cap: f64) -> Tensor<B, D> {
    (x / cap).tanh() * cap
}

/// [`attention`] from burn's ops: the scores and probabilities are tensors, and autodiff
/// keeps the probabilities for the backward.
pub fn composed_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: &AttentionMask<B>,
    softcap: Option<f64>,
    sinks: Option<Tensor<B, 1>>,
) -> Tensor<B, 4> {
    let mut scores = matmul(q, k.swap_dims(2, 3));
    if let Some(cap) = softcap {
        scores = self::softcap(scores, cap);
    }
    let probs = match sinks {
        None => masked_softmax(scores, mask),
        Some(sinks) => softmax_with_sinks(scores, mask, sinks),
    };
    matmul(probs, v)
}

/// Attention probabilities with one sink logit per query head, as transformers' gpt-oss
/// computes them: the sink joins each row's scores as one more column, the softmax runs over
/// all of them in fp32, and the sink's column is dropped.
fn softmax_with_sinks<B: Backend>(
    scores: Tensor<B, 4>,
    mask: &AttentionMask<B>,
    sinks: Tensor<B, 1>,
) -> Tensor<B, 4> {
    let dtype = scores.dtype();
    let [batch, kv_heads, rows, k_len] = scores.dims();
    let [mask_batch, q_len, _] = mask.dims;
    let heads = kv_heads * rows / q_len.max(1);
    let scores = cast(scores, DType::F32).reshape([batch, heads, q_len, k_len])
        + mask.tensor.clone().reshape([mask_batch, 1, q_len, k_len]);
    let sinks = cast(sinks, DType::F32)
        .reshape([1, heads, 1, 1])
        .expand([batch, heads, q_len, 1]);
    let probs = softmax(Tensor::cat(vec![scores, sinks], 3)).narrow(3, 0, k_len);
    cast(probs.reshape([batch, kv_heads, rows, k_len]), dtype)
}

/// Softmax over the last dimension.
pub fn softmax<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    struct Softmax;
    impl FlexOp for Softmax {
        fn forward(&self, x: &FlexTensor) -> FlexTensor {
            flex::softmax_forward(x)
        }
        fn autodiff<C: CheckpointStrategy>(
            &self,
            x: AutodiffFlexTensor<C>,
        ) -> AutodiffFlexTensor<C> {
            flex::softmax_autodiff::<C>(x, flex::softmax_forward)
        }
    }
    in_f32_on_flex(x, |x| match on_flex(x, Softmax) {
        Ok(y) => y,
        Err(x) => burn::tensor::activation::softmax(x, D - 1),
    })
}

/// Attention probabilities `softmax(scores + mask)` over the last dimension, for scores
/// `[batch, kv_heads, n_rep * q_len, k_len]` and the layer-shared mask `[mask_batch, q_len,
/// k_len]`. On Flex the mask is read per row inside the softmax; elsewhere it is broadcast
/// and added.
pub fn masked_softmax<B: Backend>(scores: Tensor<B, 4>, mask: &AttentionMask<B>) -> Tensor<B, 4> {
    struct MaskedSoftmax<'a> {
        mask: &'a [f32],
        layout: rows::MaskLayout,
    }
    impl FlexOp for MaskedSoftmax<'_> {
        fn forward(&self, x: &FlexTensor) -> FlexTensor {
            flex::masked_softmax_forward(x, self.mask, self.layout)
        }
        fn autodiff<C: CheckpointStrategy>(
            &self,
            x: AutodiffFlexTensor<C>,
        ) -> AutodiffFlexTensor<C> {
            flex::softmax_autodiff::<C>(x, |x| {
                flex::masked_softmax_forward(x, self.mask, self.layout)
            })
        }
    }
    // In fp32 whatever the scores' dtype, as PyTorch's attention accumulates half-precision
    // scores; the probabilities go back to that dtype for the values matmul.
    let dtype = scores.dtype();
    let scores = cast(scores, DType::F32);
    let [batch, kv_heads, rows, k_len] = scores.dims();
    let [mask_batch, q_len, _] = mask.dims;
    let op = MaskedSoftmax {
        mask: &mask.host,
        layout: rows::MaskLayout {
            q_len,
            rows_per_batch: kv_heads * rows,
            mask_batch,
        },
    };
    let probs = match on_flex(scores, op) {
        Ok(probs) => probs,
        Err(scores) => {
            let heads = kv_heads * rows / q_len;
            let scores = scores.reshape([batch, heads, q_len, k_len])
                + mask.tensor.clone().reshape([mask_batch, 1, q_len, k_len]);
            burn::tensor::activation::softmax(scores, 3).reshape([batch, kv_heads, rows, k_len])
        }
    };
    cast(probs, dtype)
}

/// `x.permute(axes)` materialised contiguously, with a backward that does the same for the
/// gradient: on Flex both copy whole innermost runs (the last axis must stay last) instead of
/// leaving a strided view that a later reshape copies element by element.
pub fn permute<B: Backend, const D: usize>(x: Tensor<B, D>, axes: [usize; D]) -> Tensor<B, D> {
    struct Permute<const D: usize>([usize; D]);
    impl<const D: usize> FlexOp for Permute<D> {
        fn accepts(&self, dtype: DType) -> bool {
            matches!(dtype, DType::F32 | DType::BF16)
        }
        fn forward(&self, x: &FlexTensor) -> FlexTensor {
            flex::permute_forward(x, &self.0)
        }
        fn autodiff<C: CheckpointStrategy>(
            &self,
            x: AutodiffFlexTensor<C>,
        ) -> AutodiffFlexTensor<C> {
            flex::permute_autodiff::<C>(x, &self.0)
        }
    }
    match on_flex(x, Permute(axes)) {
        Ok(y) => y,
        Err(x) => x.permute(axes),
    }
}

/// `buffer` (`[batch, heads, capacity, dim]`, a key/value cache) with `new` (`[batch, heads,
/// count, dim]`) written at positions `at..at + count`: in place on Flex when `buffer` is not
/// shared ([`flex::write_positions`] says why burn's `slice_assign` is not), elsewhere burn's
/// `slice_assign` (in place on cubecl devices).
pub fn write_positions<B: Backend>(
    buffer: Tensor<B, 4>,
    at: usize,
    new: Tensor<B, 4>,
) -> Tensor<B, 4> {
    let [batch, heads, count, dim] = new.dims();
    let range = [0..batch, 0..heads, at..at + count, 0..dim];
    let (buffer, new) = match (
        dispatch::as_flex_of(buffer, |_| true),
        dispatch::as_flex_of(new, |_| true),
    ) {
        (Ok(buffer), Ok(new)) => match flex::write_positions(buffer, at, &new) {
            Ok(written) => return dispatch::from_flex(written),
            Err(buffer) => (dispatch::from_flex(buffer), dispatch::from_flex(new)),
        },
        (buffer, new) => (
            buffer.map_or_else(|t| t, dispatch::from_flex),
            new.map_or_else(|t| t, dispatch::from_flex),
        ),
    };
    buffer.slice_assign(range, new)
}

/// `x * sigmoid(x)`.
pub fn silu<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    struct Silu;
    impl FlexOp for Silu {
        fn forward(&self, x: &FlexTensor) -> FlexTensor {
            flex::silu_forward(x)
        }
        fn autodiff<C: CheckpointStrategy>(
            &self,
            x: AutodiffFlexTensor<C>,
        ) -> AutodiffFlexTensor<C> {
            flex::silu_autodiff::<C>(x)
        }
    }
    in_f32_on_flex(x, |x| match on_flex(x, Silu) {
        Ok(y) => y,
        Err(x) => burn::tensor::activation::silu(x),
    })
}

/// `silu(gate) * up`, the SwiGLU MLP's hidden activation. On Flex in f32 one fused op with
/// the same values and gradients as the two composed ops, which keeps only `gate` and `up` for
/// its backward (the composed pair also kept `silu(gate)`: a third `[rows, intermediate]`
/// tensor per layer). bf16 keeps the composed ops, whose two roundings PyTorch's has too.
pub fn swiglu<B: Backend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    struct Swiglu;
    impl FlexOpN<2> for Swiglu {
        fn forward(&self, [gate, up]: [&FlexTensor; 2]) -> FlexTensor {
            flex::swiglu_forward(gate, up)
        }
        fn autodiff<C: CheckpointStrategy>(
            &self,
            x: [AutodiffFlexTensor<C>; 2],
        ) -> AutodiffFlexTensor<C> {
            flex::swiglu_autodiff::<C>(x)
        }
    }
    match on_flex_n([gate, up], Swiglu) {
        Ok(y) => y,
        Err([gate, up]) => silu(gate) * up,
    }
}

/// `log_softmax(logits)[row, targets[row]]` for `logits` `[rows, vocab]`: `[rows]`.
///
/// Every target must be in `0..vocab`; the trainer checks label ids against the model's
/// vocabulary before a step.
pub fn target_log_probs<B: Backend>(logits: Tensor<B, 2>, targets: &[i32]) -> Tensor<B, 1> {
    struct TargetLogProbs(Vec<usize>);
    impl FlexOp for TargetLogProbs {
        fn forward(&self, logits: &FlexTensor) -> FlexTensor {
            flex::target_log_probs_inference(logits, &self.0)
        }
        fn autodiff<C: CheckpointStrategy>(
            &self,
            logits: AutodiffFlexTensor<C>,
        ) -> AutodiffFlexTensor<C> {
            flex::target_log_probs_autodiff::<C>(logits, self.0.clone())
        }
    }
    let rows = targets.len();
    let as_index = targets.iter().map(|&t| t.max(0) as usize).collect();
    match on_flex(logits, TargetLogProbs(as_index)) {
        Ok(log_probs) => log_probs,
        Err(logits) => {
            let device = logits.device();
            let idx = Tensor::<B, 2, Int>::from_data(
                TensorData::new(targets.to_vec(), [rows, 1]),
                &device,
            );
            burn::tensor::activation::log_softmax(logits, 1)
                .gather(1, idx)
                .reshape([rows])
        }
    }
}
