//! Fused causal attention on burn's cubecl backends (`device: cuda|wgpu`), one kernel source for
//! both, with a backward of its own: what [`attention`](mod@super::attention) is on the CPU.
//!
//! Why: burn 0.21's autodiff attention is the composed ops, which keep `batch * heads * q_len *
//! k_len` probabilities per layer for the backward (its flash kernels serve inference only), so
//! a step's memory grows with the square of the sequence length. Here a layer keeps its inputs,
//! its output and two floats per query row (the score max and the softmax sum): linear in the
//! sequence length.
//!
//! The kernels are FlashAttention-2's algorithm in blocks. A cube takes a block of query rows
//! ([`block_for`] the device: 64 at SmolLM2's head size of 64 on an H200, 16 in lavapipe's
//! 32 KB of shared memory) and sweeps the key tiles some row of it
//! shows, each tile staged in shared memory: the block's scores come from register tiles (a
//! thread owns 4 rows and every 8th column), each row's owner folds them into its running max
//! and sum (online softmax), and the output tile accumulates `P @ V` in registers. The backward
//! recomputes each tile's probabilities from the saved max and sum: `dQ` one cube per query
//! block over its key tiles, `dK` and `dV` one cube per key block over the query blocks that
//! show it (split over several cubes at short sequences, [`Call::splits`]); nothing is shared
//! between cubes, so there are no atomics. Key tiles no row of a block shows (outside every
//! row's [`RowSpan`](super::attention::RowSpan)) are skipped: half the work of a causal mask.
//! The layout, masks, soft cap and grouped queries are the CPU kernel's: queries
//! `[batch, kv_heads, n_rep * q_len, dim]` (already scaled), keys and values `[batch, kv_heads,
//! k_len, dim]`, the additive mask `[mask_batch, q_len, k_len]` in fp32. The maths is fp32
//! whatever the run's dtype (bf16 inputs are widened and the output rounded back, as the CPU
//! path does); it is checked against the composed path on wgpu (`tests/suite/gpu.rs`).
//!
//! `dim` and the block are compile-time constants of each kernel (one compilation per head size
//! and block), so a thread's tiles are unrolled into registers.
//!
//! gpt-oss's attention sinks (a logit `s_h` per query head in every row's softmax denominator,
//! with no value) need no kernel of their own: with a sink, a row's output is the plain
//! attention's times `w = sigmoid(lse - s_h)`, `lse` the plain row's log-sum-exp (from its saved
//! max and sum), and the backward is the plain kernels' with the output's gradient scaled by `w`
//! and the row's `delta` by `w^2`; the sink's gradient is `-D w (1 - w)` summed over its head's
//! rows, `D = sum(dO * O_plain)` ([`SinkAttentionBackward`]).
//!
//! What it is not yet: tensor-core products (cubecl's `cmma`), which the fp32 maths here does
//! not use. The blocked kernels replaced one-thread-per-row kernels (fb59af8) that ran at 0.43x
//! the composed path's tokens/s on an H200; the blocked ones have been checked on lavapipe only,
//! for values, and wait for a lent GPU to be timed (`benches/gpu_session.sh` part 5).

use std::any::TypeId;
use std::sync::atomic::Ordering;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Int, Shape, Tensor, TensorData, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime};
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::AttentionMask;
use super::dispatch::{cast_back, same_type};

/// burn's cubecl backend as tune builds it (fp32 floats, i32 ints; the bool element differs
/// between CUDA and wgpu).
type Cube<R, BT> = CubeBackend<R, f32, i32, BT>;

/// A cube's threads form `block / ROWS` row groups of `LANES` lanes: a thread owns `ROWS`
/// consecutive rows of a block and every `LANES`-th column (of a score tile and of an output
/// tile). Why this shape: each operand read from shared memory then serves `ROWS` (or the
/// thread's column count) multiply-adds from registers, where one thread per row did one per
/// read; and lanes reading neighbouring columns hit different shared-memory banks.
const ROWS: usize = 4;
const LANES: usize = 8;

/// The block sizes tried, largest first: `block` query rows per cube and keys per tile. The
/// largest whose shared memory fits the device is taken ([`block_for`]); 64 only for heads of
/// at most 64 (larger heads would hold more accumulators than a thread has registers).
const BLOCKS: [usize; 4] = [64, 32, 16, 8];

/// Shared memory (bytes) of the largest kernel (the backward's: four `block x dim` tiles at
/// stride `dim + 1`, a `block x block` score tile at stride `block + 1`, six values per row).
fn shared_bytes(block: usize, dim: usize) -> usize {
    4 * (4 * block * (dim + 1) + block * (block + 1) + 6 * block)
}

/// The block for heads of `dim` on a device with `max_shared` bytes of shared memory per cube,
/// at most `tune bench --attention-block`'s cap when one is set.
fn block_for(dim: usize, max_shared: usize) -> usize {
    let cap = match super::ATTENTION_BLOCK_CAP.load(Ordering::Relaxed) {
        0 => usize::MAX,
        cap => cap,
    };
    let block = BLOCKS
        .into_iter()
        .filter(|&b| (b <= 32 || dim <= 64) && b <= cap)
        .find(|&b| shared_bytes(b, dim) <= max_shared)
        .unwrap_or(BLOCKS[BLOCKS.len() - 1]);
    super::ATTENTION_BLOCK_USED.store(block, Ordering::Relaxed);
    block
}

mod kernels;
use kernels::*;

// ---------------------------------------------------------------------------------------------
// Launches.

/// The sizes and masking of one attention call, and the mask and its row spans on the device.
#[derive(Debug, Clone)]
struct Call<R: CubeRuntime> {
    groups: usize,
    kv_heads: usize,
    rows: usize,
    q_len: usize,
    k_len: usize,
    dim: usize,
    mask_batch: usize,
    softcap: Option<f32>,
    mask: CubeTensor<R>,
    /// `(lo, hi)` per mask row, i32.
    spans: CubeTensor<R>,
    /// Query rows per cube and keys per tile ([`block_for`] the device).
    block: usize,
}

impl<R: CubeRuntime> Call<R> {
    /// `cubes` cubes of `2 * block` threads.
    fn cubes(&self, client: &ComputeClient<R>, cubes: usize) -> (CubeCount, CubeDim) {
        let dim = CubeDim::new_1d(2 * self.block as u32);
        (
            calculate_cube_count_elemwise(client, cubes * 2 * self.block, dim),
            dim,
        )
    }

    fn empty(&self, like: &CubeTensor<R>, shape: Shape) -> CubeTensor<R> {
        empty_device_dtype(like.client.clone(), like.device.clone(), shape, DType::F32)
    }

    fn operands(&self, [q, k, v]: &[CubeTensor<R>; 3]) -> OperandsLaunch<R> {
        OperandsLaunch::new(
            q.clone().into_array_arg(),
            k.clone().into_array_arg(),
            v.clone().into_array_arg(),
            self.mask.clone().into_array_arg(),
            self.spans.clone().into_array_arg(),
        )
    }

    fn sizes(&self, cubes: usize, splits: usize) -> SizesLaunch<R> {
        SizesLaunch::new(
            cubes,
            self.rows,
            self.kv_heads,
            self.mask_batch,
            self.q_len,
            self.k_len,
            splits,
            self.softcap.unwrap_or(1.0),
        )
    }

    /// Cubes of query blocks: one per block of `block` rows of each group.
    fn query_cubes(&self) -> usize {
        self.groups * self.rows.div_ceil(self.block)
    }

    /// How many cubes share a key block's query blocks in the `dK`/`dV` kernel. Why: one cube
    /// per key block leaves most of a large GPU idle at short sequences (512 tokens of
    /// SmolLM2-135M, one row, are 24 key blocks of 64 against an H200's 132 multiprocessors),
    /// so each key block's query blocks are dealt to `splits` cubes, each writing its own
    /// partial `dK`/`dV`, summed afterwards (no atomics, the same sums in the same order every
    /// run).
    fn splits(&self, client: &ComputeClient<R>) -> usize {
        let key_cubes = self.groups * self.k_len.div_ceil(self.block);
        let processors = client
            .properties()
            .hardware
            .num_streaming_multiprocessors
            .unwrap_or(16) as usize;
        // Four cubes per multiprocessor, at most one per query block.
        (4 * processors)
            .div_ceil(key_cubes)
            .clamp(1, self.rows.div_ceil(self.block).min(8))
    }

    /// The output (grouped, as `q`) and the softmax statistics (max, 1 / sum) of every query
    /// row.
    fn forward(&self, inputs: &[CubeTensor<R>; 3]) -> (CubeTensor<R>, CubeTensor<R>) {
        let q = &inputs[0];
        let out = self.empty(q, q.meta.shape().clone());
        let stats = self.empty(q, Shape::new([2 * self.groups * self.rows]));
        let cubes = self.query_cubes();
        let (count, dim) = self.cubes(&q.client, cubes);
        forward_kernel::launch::<R>(
            &q.client,
            count,
            dim,
            self.operands(inputs),
            out.clone().into_array_arg(),
            stats.clone().into_array_arg(),
            self.sizes(cubes, 1),
            self.dim,
            self.block,
            self.softcap.is_some(),
        );
        (out, stats)
    }

    /// `dQ`, `dK`, `dV` from the saved inputs and statistics, `delta` (each query row's
    /// `sum(dO * O)`) and the output's gradient.
    fn backward<BT: BoolElement>(
        &self,
        saved: &Saved<R>,
        delta: &CubeTensor<R>,
        grad: &CubeTensor<R>,
    ) -> [CubeTensor<R>; 3] {
        let [q, k, v] = &saved.inputs;
        let client = &q.client;
        let backprop = || {
            BackpropLaunch::new(
                saved.stats.clone().into_array_arg(),
                delta.clone().into_array_arg(),
                grad.clone().into_array_arg(),
            )
        };
        let dq = self.empty(q, q.meta.shape().clone());
        let cubes = self.query_cubes();
        let (count, dim) = self.cubes(client, cubes);
        grad_query_kernel::launch::<R>(
            client,
            count,
            dim,
            self.operands(&saved.inputs),
            backprop(),
            dq.clone().into_array_arg(),
            self.sizes(cubes, 1),
            self.dim,
            self.block,
            self.softcap.is_some(),
        );
        let splits = self.splits(client);
        let shape = k.meta.shape().dims::<4>();
        let parts = Shape::new([splits, shape[0], shape[1], shape[2], shape[3]]);
        let (dk, dv) = (self.empty(k, parts.clone()), self.empty(v, parts));
        let cubes = self.groups * self.k_len.div_ceil(self.block) * splits;
        let (count, dim) = self.cubes(client, cubes);
        grad_key_value_kernel::launch::<R>(
            client,
            count,
            dim,
            self.operands(&saved.inputs),
            backprop(),
            dk.clone().into_array_arg(),
            dv.clone().into_array_arg(),
            self.sizes(cubes, splits),
            self.dim,
            self.block,
            self.softcap.is_some(),
        );
        let summed = |t: CubeTensor<R>| {
            let t = Tensor::<Cube<R, BT>, 5>::from_primitive(TensorPrimitive::Float(t));
            let t = if splits == 1 { t } else { t.sum_dim(0) };
            into_contiguous(t.reshape(shape).into_primitive().tensor())
        };
        [dq, summed(dk), summed(dv)]
    }
}

/// What the backward reads: the contiguous fp32 inputs, the output and its softmax statistics.
#[derive(Debug, Clone)]
struct Saved<R: CubeRuntime> {
    inputs: [CubeTensor<R>; 3],
    out: CubeTensor<R>,
    /// Each query row's score max and inverse sum.
    stats: CubeTensor<R>,
}

#[derive(Debug)]
struct CubeAttentionBackward;

impl<R: CubeRuntime, BT: BoolElement> Backward<Cube<R, BT>, 3> for CubeAttentionBackward {
    type State = (Saved<R>, Call<R>);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (saved, call) = ops.state;
        let grad = into_contiguous(grads.consume::<Cube<R, BT>>(&ops.node));
        // Each query row's `sum(dO * O)`: the softmax backward's row term.
        let float =
            |t: CubeTensor<R>| Tensor::<Cube<R, BT>, 4>::from_primitive(TensorPrimitive::Float(t));
        let delta = (float(grad.clone()) * float(saved.out.clone()))
            .sum_dim(3)
            .into_primitive()
            .tensor();
        let delta = into_contiguous(delta);
        let grads_in = call.backward::<BT>(&saved, &delta, &grad);
        for (parent, g) in ops.parents.into_iter().zip(grads_in) {
            if let Some(node) = parent {
                grads.register::<Cube<R, BT>>(node.id, g);
            }
        }
    }
}

/// The plain attention's output as a 4-D tensor of the inner backend.
fn float4<R: CubeRuntime, BT: BoolElement>(t: CubeTensor<R>) -> Tensor<Cube<R, BT>, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

impl<R: CubeRuntime> Call<R> {
    /// Query heads per key-value head.
    fn n_rep(&self) -> usize {
        self.rows / self.q_len.max(1)
    }

    /// Each query row's sink weight `w = sigmoid(lse - s_h)`, `[batch, kv_heads, rows, 1]`,
    /// from the plain kernel's statistics (max, 1 / sum) and the sinks `[heads]` (fp32). A row
    /// whose mask hides every key has `lse` near -1e30: `w` is 0, the sink takes all the weight.
    fn sink_weights<BT: BoolElement>(
        &self,
        stats: &CubeTensor<R>,
        sinks: Tensor<Cube<R, BT>, 1>,
    ) -> Tensor<Cube<R, BT>, 4> {
        let (batch, kv_heads) = (self.groups / self.kv_heads, self.kv_heads);
        let (n_rep, q_len, rows) = (self.n_rep(), self.q_len, self.rows);
        let stats = Tensor::<Cube<R, BT>, 1>::from_primitive(TensorPrimitive::Float(stats.clone()))
            .reshape([self.groups * rows, 2]);
        let (max, inv) = (stats.clone().narrow(1, 0, 1), stats.narrow(1, 1, 1));
        let lse = (max - inv.log()).reshape([batch, kv_heads, rows, 1]);
        let sink = sinks
            .reshape([1, kv_heads, n_rep, 1])
            .expand([batch, kv_heads, n_rep, q_len])
            .reshape([batch, kv_heads, rows, 1]);
        burn::tensor::activation::sigmoid(lse - sink)
    }
}

/// [`CubeAttentionBackward`] with gpt-oss's sinks as a fourth input.
#[derive(Debug)]
struct SinkAttentionBackward;

impl<R: CubeRuntime, BT: BoolElement> Backward<Cube<R, BT>, 4> for SinkAttentionBackward {
    /// The plain attention's saved inputs, output and statistics, the call, and each row's
    /// sink weight `w`.
    type State = (Saved<R>, Call<R>, CubeTensor<R>);

    fn backward(self, ops: Ops<Self::State, 4>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (saved, call, w) = ops.state;
        let grad = float4::<R, BT>(into_contiguous(grads.consume::<Cube<R, BT>>(&ops.node)));
        let w = float4::<R, BT>(w);
        // Each row's `sum(dO * O_plain)`.
        let d = (grad.clone() * float4::<R, BT>(saved.out.clone())).sum_dim(3);
        let scaled = into_contiguous((grad * w.clone()).into_primitive().tensor());
        let delta = into_contiguous(
            (d.clone() * w.clone() * w.clone())
                .into_primitive()
                .tensor(),
        );
        let [dq, dk, dv] = call.backward::<BT>(&saved, &delta, &scaled);
        let (batch, kv_heads, n_rep) = (call.groups / call.kv_heads, call.kv_heads, call.n_rep());
        let dsink = (d * w.clone() * (w.neg() + 1.0))
            .neg()
            .reshape([batch, kv_heads, n_rep, call.q_len])
            .sum_dim(3)
            .sum_dim(0)
            .reshape([kv_heads * n_rep])
            .into_primitive()
            .tensor();
        let grads_in = [dq, dk, dv, dsink];
        for (parent, g) in ops.parents.into_iter().zip(grads_in) {
            if let Some(node) = parent {
                grads.register::<Cube<R, BT>>(node.id, g);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Dispatch.

/// The call's sizes, with the mask (`mask_tensor`: `masking`'s device tensor on the inner
/// backend) and its spans on the device of `q`.
fn call<B: Backend, R: CubeRuntime, BT: BoolElement>(
    q: &CubeTensor<R>,
    masking: &AttentionMask<B>,
    mask_tensor: &CubeTensor<R>,
    softcap: Option<f64>,
) -> Call<R> {
    let [batch, kv_heads, rows, dim] = q.meta.shape().dims::<4>();
    let [mask_batch, q_len, k_len] = masking.dims;
    let spans: Vec<i32> = masking
        .spans
        .iter()
        .flat_map(|s| [s.lo as i32, s.hi as i32])
        .collect();
    let n = spans.len();
    let spans = Tensor::<Cube<R, BT>, 1, Int>::from_data(TensorData::new(spans, [n]), &q.device)
        .into_primitive();
    Call {
        groups: batch * kv_heads,
        kv_heads,
        rows,
        q_len,
        k_len,
        dim,
        mask_batch,
        softcap: softcap.map(|c| c as f32),
        mask: into_contiguous(mask_tensor.clone()),
        spans,
        block: block_for(dim, q.client.properties().hardware.max_shared_memory_size),
    }
}

/// `t` contiguous in fp32, on the inner backend.
fn fp32<R: CubeRuntime, BT: BoolElement>(t: Tensor<Cube<R, BT>, 4>) -> CubeTensor<R> {
    into_contiguous(t.cast(DType::F32).into_primitive().tensor())
}

/// The mask's device tensor on the inner backend, when `B` is `Cube<R, BT>` or
/// `Autodiff<Cube<R, BT>, C>` (either checkpoint strategy); `None` on any other backend.
fn inner_mask<B: Backend, R: CubeRuntime, BT: BoolElement>(
    mask: &AttentionMask<B>,
) -> Option<CubeTensor<R>> {
    let t = match same_type::<Tensor<B, 3>, Tensor<Cube<R, BT>, 3>>(mask.tensor.clone()) {
        Ok(t) => return Some(t.into_primitive().tensor()),
        Err(t) => t,
    };
    let t = match same_type::<_, Tensor<Autodiff<Cube<R, BT>, NoCheckpointing>, 3>>(t) {
        Ok(t) => return Some(t.inner().into_primitive().tensor()),
        Err(t) => t,
    };
    same_type::<_, Tensor<Autodiff<Cube<R, BT>, BalancedCheckpointing>, 3>>(t)
        .ok()
        .map(|t| t.inner().into_primitive().tensor())
}

/// No autodiff (validation, a frozen reference, generation's prefill): the forward alone.
fn inference<B: Backend, R: CubeRuntime, BT: BoolElement>(
    [q, k, v]: [Tensor<Cube<R, BT>, 4>; 3],
    sinks: Option<Tensor<Cube<R, BT>, 1>>,
    mask: (&AttentionMask<B>, &CubeTensor<R>),
    softcap: Option<f64>,
) -> Tensor<Cube<R, BT>, 4> {
    let dtype = q.dtype();
    let [q, k, v] = [q, k, v].map(fp32);
    let c = call::<B, R, BT>(&q, mask.0, mask.1, softcap);
    let (out, stats) = c.forward(&[q, k, v]);
    let out = float4::<R, BT>(out);
    let out = match sinks {
        Some(sinks) => out * c.sink_weights(&stats, sinks.cast(DType::F32)),
        None => out,
    };
    out.cast(dtype)
}

fn autodiff<B: Backend, R: CubeRuntime, BT: BoolElement, C: CheckpointStrategy>(
    [q, k, v]: [Tensor<Autodiff<Cube<R, BT>, C>, 4>; 3],
    mask: (&AttentionMask<B>, &CubeTensor<R>),
    softcap: Option<f64>,
) -> Tensor<Autodiff<Cube<R, BT>, C>, 4> {
    let dtype = q.dtype();
    // fp32 through autodiff (the casts' backward rounds the gradients back).
    let [q, k, v]: [FloatTensor<Autodiff<Cube<R, BT>, C>>; 3] =
        [q, k, v].map(|t| t.cast(DType::F32).into_primitive().tensor());
    let inputs = [&q, &k, &v].map(|t| into_contiguous(t.primitive.clone()));
    let c = call::<B, R, BT>(&inputs[0], mask.0, mask.1, softcap);
    let (out, stats) = c.forward(&inputs);
    let y = match CubeAttentionBackward
        .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            (
                Saved {
                    inputs,
                    out: out.clone(),
                    stats,
                },
                c,
            ),
            out,
        ),
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    Tensor::<Autodiff<Cube<R, BT>, C>, 4>::from_primitive(TensorPrimitive::Float(y)).cast(dtype)
}

/// [`autodiff`] with gpt-oss's sinks: the plain kernels' output times each row's sink weight,
/// and [`SinkAttentionBackward`] for all four inputs.
fn autodiff_with_sinks<B: Backend, R: CubeRuntime, BT: BoolElement, C: CheckpointStrategy>(
    [q, k, v]: [Tensor<Autodiff<Cube<R, BT>, C>, 4>; 3],
    sinks: Tensor<Autodiff<Cube<R, BT>, C>, 1>,
    mask: (&AttentionMask<B>, &CubeTensor<R>),
    softcap: Option<f64>,
) -> Tensor<Autodiff<Cube<R, BT>, C>, 4> {
    let dtype = q.dtype();
    let [q, k, v]: [FloatTensor<Autodiff<Cube<R, BT>, C>>; 3] =
        [q, k, v].map(|t| t.cast(DType::F32).into_primitive().tensor());
    let s: FloatTensor<Autodiff<Cube<R, BT>, C>> = sinks.cast(DType::F32).into_primitive().tensor();
    let inputs = [&q, &k, &v].map(|t| into_contiguous(t.primitive.clone()));
    let c = call::<B, R, BT>(&inputs[0], mask.0, mask.1, softcap);
    let (plain, stats) = c.forward(&inputs);
    let sink_values =
        Tensor::<Cube<R, BT>, 1>::from_primitive(TensorPrimitive::Float(s.primitive.clone()));
    let w = c.sink_weights(&stats, sink_values);
    let out = into_contiguous(
        (float4::<R, BT>(plain.clone()) * w.clone())
            .into_primitive()
            .tensor(),
    );
    let y = match SinkAttentionBackward
        .prepare::<C>([
            q.node.clone(),
            k.node.clone(),
            v.node.clone(),
            s.node.clone(),
        ])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            (
                Saved {
                    inputs,
                    out: plain,
                    stats,
                },
                c,
                into_contiguous(w.into_primitive().tensor()),
            ),
            out,
        ),
        OpsKind::UnTracked(prep) => prep.finish(out),
    };
    Tensor::<Autodiff<Cube<R, BT>, C>, 4>::from_primitive(TensorPrimitive::Float(y)).cast(dtype)
}

/// What the fused attention takes: queries, keys, values and gpt-oss's sinks, if any.
type Inputs<B> = ([Tensor<B, 4>; 3], Option<Tensor<B, 1>>);

/// The fused attention when `B` is `Cube<R, BT>` with or without autodiff, else the inputs back.
fn on_cube<B: Backend, R: CubeRuntime, BT: BoolElement>(
    x: Inputs<B>,
    mask: &AttentionMask<B>,
    softcap: Option<f64>,
) -> Result<Tensor<B, 4>, Inputs<B>> {
    let Some(inner) = inner_mask::<B, R, BT>(mask) else {
        return Err(x);
    };
    let mask = (mask, &inner);
    let x = match typed::<B, Cube<R, BT>>(x) {
        Ok((x, sinks)) => return Ok(cast_back(inference(x, sinks, mask, softcap))),
        Err(x) => x,
    };
    let x = match typed::<B, Autodiff<Cube<R, BT>, NoCheckpointing>>(x) {
        Ok((x, None)) => return Ok(cast_back(autodiff(x, mask, softcap))),
        Ok((x, Some(s))) => return Ok(cast_back(autodiff_with_sinks(x, s, mask, softcap))),
        Err(x) => x,
    };
    match typed::<B, Autodiff<Cube<R, BT>, BalancedCheckpointing>>(x) {
        Ok((x, None)) => Ok(cast_back(autodiff(x, mask, softcap))),
        Ok((x, Some(s))) => Ok(cast_back(autodiff_with_sinks(x, s, mask, softcap))),
        Err(x) => Err(x),
    }
}

/// The inputs as backend `T`'s when `B` is `T`.
fn typed<B: Backend, T: Backend>((x, sinks): Inputs<B>) -> Result<Inputs<T>, Inputs<B>> {
    if TypeId::of::<B>() != TypeId::of::<T>() {
        return Err((x, sinks));
    }
    Ok((
        x.map(cast_back::<Tensor<B, 4>, Tensor<T, 4>>),
        sinks.map(cast_back::<Tensor<B, 1>, Tensor<T, 1>>),
    ))
}

/// `softmax(q @ k^T (soft-capped) + mask) @ v`, grouped as [`super::attention`] (with `sinks`
/// `[heads]` in each row's denominator), through the fused kernels when `B` is burn's CUDA or
/// wgpu backend (with or without autodiff); otherwise the inputs back for the caller's path.
pub fn attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: &AttentionMask<B>,
    softcap: Option<f64>,
    sinks: Option<Tensor<B, 1>>,
) -> Result<Tensor<B, 4>, Inputs<B>> {
    let x = ([q, k, v], sinks);
    #[cfg(feature = "cuda")]
    let x = match on_cube::<B, cubecl::cuda::CudaRuntime, u8>(x, mask, softcap) {
        Ok(y) => return Ok(y),
        Err(x) => x,
    };
    #[cfg(feature = "wgpu")]
    let x = match on_cube::<B, cubecl::wgpu::WgpuRuntime, u32>(x, mask, softcap) {
        Ok(y) => return Ok(y),
        Err(x) => x,
    };
    #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
    let _ = (mask, softcap);
    Err(x)
}
