//! Fused causal attention on burn's cubecl backends (`device: cuda|wgpu`), one kernel source for
//! both, with a backward of its own: what [`attention`](mod@super::attention) is on the CPU.
//!
//! Why: burn 0.21's autodiff attention is the composed ops, which keep `batch * heads * q_len *
//! k_len` probabilities per layer for the backward (its flash kernels serve inference only), so
//! a step's memory grows with the square of the sequence length. Here a layer keeps its inputs,
//! its output and two floats per query row (the score max and the softmax sum): linear in the
//! sequence length.
//!
//! The kernels are the simple form of FlashAttention-2's algorithm: one unit (GPU thread) per
//! query row sweeps the keys its mask row shows with an online softmax (forward), recomputes
//! each probability from the saved max and sum for `dQ` (one unit per query row) and for `dK`
//! and `dV` (one unit per key, over the query rows that see it); nothing is shared between
//! units, so there are no atomics and no block-level synchronisation. Keys a mask row hides
//! outside its [`RowSpan`](super::attention::RowSpan) are skipped (half the work of a causal
//! mask). The layout, masks, soft cap and grouped queries are the CPU kernel's: queries
//! `[batch, kv_heads, n_rep * q_len, dim]` (already scaled), keys and values `[batch, kv_heads,
//! k_len, dim]`, the additive mask `[mask_batch, q_len, k_len]` in fp32. The maths is fp32
//! whatever the run's dtype (bf16 inputs are widened and the output rounded back, as the CPU
//! path does); it is checked against the composed path on wgpu (`tests/suite/gpu.rs`).
//!
//! `dim` is a compile-time constant of each kernel (one compilation per head size) and the
//! loops over it are unrolled, so a unit's rows live in registers rather than local memory.
//!
//! gpt-oss's attention sinks (a logit `s_h` per query head in every row's softmax denominator,
//! with no value) need no kernel of their own: with a sink, a row's output is the plain
//! attention's times `w = sigmoid(lse - s_h)`, `lse` the plain row's log-sum-exp (from its saved
//! max and sum), and the backward is the plain kernels' with the output's gradient scaled by `w`
//! and the row's `delta` by `w^2`; the sink's gradient is `-D w (1 - w)` summed over its head's
//! rows, `D = sum(dO * O_plain)` ([`SinkAttentionBackward`]).
//!
//! What it is not yet: a tiled kernel staging blocks of keys in shared memory with tensor-core
//! products. Each unit reads its keys from global memory (the L1/L2 caches serve the units of
//! a cube, which read the same keys), so its speed is below a tiled kernel's; its memory is
//! what the issue asked for.

use std::any::TypeId;

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

/// Units (threads) per cube. Why 64: a unit holds two to four rows of `dim` floats in
/// registers (128 for `dim` 64 in the forward, 256 in the backward), and a cube of many units
/// would need more registers than a multiprocessor has.
const CUBE_UNITS: u32 = 64;

// ---------------------------------------------------------------------------------------------
// Kernels.

/// What every kernel reads: queries, keys, values, the mask and its row spans (`(lo, hi)` per
/// mask row).
#[derive(CubeLaunch, CubeType)]
struct Operands {
    q: Array<f32>,
    k: Array<f32>,
    v: Array<f32>,
    mask: Array<f32>,
    spans: Array<i32>,
}

/// The sizes of one call: `units` threads, `rows` query rows per group of `kv_heads` heads,
/// the mask's `mask_batch`, `q_len` and `k_len`, and the soft cap.
#[derive(CubeLaunch, CubeType)]
struct Sizes {
    units: usize,
    rows: usize,
    kv_heads: usize,
    mask_batch: usize,
    q_len: usize,
    k_len: usize,
    cap: f32,
}

/// What the backward kernels read besides the operands: each query row's score max and
/// 1 / sum (`stats`), its `sum(dO * O)` (`delta`) and the output's gradient.
#[derive(CubeLaunch, CubeType)]
struct Backprop {
    stats: Array<f32>,
    delta: Array<f32>,
    grad_out: Array<f32>,
}

/// The mask row and shown keys `lo..hi` of query row `r` of group `g`.
#[cube]
fn mask_row(x: &Operands, n: &Sizes, g: usize, r: usize) -> (usize, usize, usize) {
    let row = ((g / n.kv_heads) % n.mask_batch) * n.q_len + r % n.q_len;
    let lo = usize::cast_from(x.spans[2 * row]);
    let hi = usize::cast_from(x.spans[2 * row + 1]);
    (row, lo, hi)
}

/// `s` soft-capped (`tanh(s / cap) * cap`) when `capped`, and the tanh, for the backward.
#[cube]
fn capped_score(s: f32, cap: f32, #[comptime] capped: bool) -> (f32, f32) {
    let mut out = s;
    let mut t = f32::new(0.0);
    if capped {
        t = (s / cap).tanh();
        out = t * cap;
    }
    (out, t)
}

/// One unit per query row: the output row and its softmax statistics.
#[cube(launch)]
fn forward_kernel(
    x: &Operands,
    out: &mut Array<f32>,
    stats: &mut Array<f32>,
    n: Sizes,
    #[comptime] dim: usize,
    #[comptime] capped: bool,
) {
    let pos = ABSOLUTE_POS;
    if pos >= n.units {
        terminate!();
    }
    let g = pos / n.rows;
    let (row, lo, hi) = mask_row(x, &n, g, pos % n.rows);
    let q0 = pos * dim;
    let kv0 = g * n.k_len * dim;
    let m0 = row * n.k_len;
    let mut qr = Array::<f32>::new(dim);
    let mut acc = Array::<f32>::new(dim);
    #[unroll]
    for d in 0..dim {
        qr[d] = x.q[q0 + d];
        acc[d] = 0.0;
    }
    // Below any score with its mask added (the masks tune builds use -1e30).
    let mut m = f32::new(-3.0e38);
    let mut l = f32::new(0.0);
    for j in lo..hi {
        let k0 = kv0 + j * dim;
        let mut s = f32::new(0.0);
        #[unroll]
        for d in 0..dim {
            s += qr[d] * x.k[k0 + d];
        }
        let (s, _t) = capped_score(s, n.cap, capped);
        let s = s + x.mask[m0 + j];
        let m_new = max(m, s);
        let scale = (m - m_new).exp();
        let p = (s - m_new).exp();
        l = l * scale + p;
        #[unroll]
        for d in 0..dim {
            acc[d] = acc[d] * scale + p * x.v[k0 + d];
        }
        m = m_new;
    }
    let inv = f32::new(1.0) / l;
    #[unroll]
    for d in 0..dim {
        out[q0 + d] = acc[d] * inv;
    }
    // The max and the sum apart, not `m + ln(l)`: for a row whose mask hides every key `m` is
    // -1e30, and `m + ln(l)` rounds to `m` in fp32 (the backward would then see `p = 1`).
    stats[2 * pos] = m;
    stats[2 * pos + 1] = inv;
}

/// One unit per query row: `dQ` from the recomputed probabilities.
#[cube(launch)]
fn grad_query_kernel(
    x: &Operands,
    b: &Backprop,
    dq: &mut Array<f32>,
    n: Sizes,
    #[comptime] dim: usize,
    #[comptime] capped: bool,
) {
    let pos = ABSOLUTE_POS;
    if pos >= n.units {
        terminate!();
    }
    let g = pos / n.rows;
    let (row, lo, hi) = mask_row(x, &n, g, pos % n.rows);
    let q0 = pos * dim;
    let kv0 = g * n.k_len * dim;
    let m0 = row * n.k_len;
    let mut qr = Array::<f32>::new(dim);
    let mut gr = Array::<f32>::new(dim);
    let mut acc = Array::<f32>::new(dim);
    #[unroll]
    for d in 0..dim {
        qr[d] = x.q[q0 + d];
        gr[d] = b.grad_out[q0 + d];
        acc[d] = 0.0;
    }
    let (m_r, inv_r, delta_r) = (b.stats[2 * pos], b.stats[2 * pos + 1], b.delta[pos]);
    for j in lo..hi {
        let k0 = kv0 + j * dim;
        let mut s = f32::new(0.0);
        let mut dp = f32::new(0.0);
        #[unroll]
        for d in 0..dim {
            s += qr[d] * x.k[k0 + d];
            dp += gr[d] * x.v[k0 + d];
        }
        let (s, t) = capped_score(s, n.cap, capped);
        let p = (s + x.mask[m0 + j] - m_r).exp() * inv_r;
        let mut ds = p * (dp - delta_r);
        if capped {
            ds *= 1.0 - t * t;
        }
        #[unroll]
        for d in 0..dim {
            acc[d] += ds * x.k[k0 + d];
        }
    }
    #[unroll]
    for d in 0..dim {
        dq[q0 + d] = acc[d];
    }
}

/// One unit per key: `dK` and `dV` over the query rows of its group whose mask row shows it.
#[cube(launch)]
fn grad_key_value_kernel(
    x: &Operands,
    b: &Backprop,
    dk: &mut Array<f32>,
    dv: &mut Array<f32>,
    n: Sizes,
    #[comptime] dim: usize,
    #[comptime] capped: bool,
) {
    let pos = ABSOLUTE_POS;
    if pos >= n.units {
        terminate!();
    }
    let g = pos / n.k_len;
    let j = pos % n.k_len;
    let k0 = pos * dim;
    let mut kr = Array::<f32>::new(dim);
    let mut vr = Array::<f32>::new(dim);
    let mut dk_acc = Array::<f32>::new(dim);
    let mut dv_acc = Array::<f32>::new(dim);
    #[unroll]
    for d in 0..dim {
        kr[d] = x.k[k0 + d];
        vr[d] = x.v[k0 + d];
        dk_acc[d] = 0.0;
        dv_acc[d] = 0.0;
    }
    for r in 0..n.rows {
        let (row, lo, hi) = mask_row(x, &n, g, r);
        if j >= lo && j < hi {
            let qi = g * n.rows + r;
            let q0 = qi * dim;
            let mut s = f32::new(0.0);
            let mut dp = f32::new(0.0);
            #[unroll]
            for d in 0..dim {
                s += x.q[q0 + d] * kr[d];
                dp += b.grad_out[q0 + d] * vr[d];
            }
            let (s, t) = capped_score(s, n.cap, capped);
            let p = (s + x.mask[row * n.k_len + j] - b.stats[2 * qi]).exp() * b.stats[2 * qi + 1];
            let mut ds = p * (dp - b.delta[qi]);
            if capped {
                ds *= 1.0 - t * t;
            }
            #[unroll]
            for d in 0..dim {
                dv_acc[d] += p * b.grad_out[q0 + d];
                dk_acc[d] += ds * x.q[q0 + d];
            }
        }
    }
    #[unroll]
    for d in 0..dim {
        dk[k0 + d] = dk_acc[d];
        dv[k0 + d] = dv_acc[d];
    }
}

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
}

impl<R: CubeRuntime> Call<R> {
    /// The cubes for `units` threads.
    fn cube(&self, client: &ComputeClient<R>, units: usize) -> (CubeCount, CubeDim) {
        let dim = CubeDim::new_1d(CUBE_UNITS);
        (calculate_cube_count_elemwise(client, units, dim), dim)
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

    fn sizes(&self, units: usize) -> SizesLaunch<R> {
        SizesLaunch::new(
            units,
            self.rows,
            self.kv_heads,
            self.mask_batch,
            self.q_len,
            self.k_len,
            self.softcap.unwrap_or(1.0),
        )
    }

    /// The output (grouped, as `q`) and the softmax statistics (max, 1 / sum) of every query
    /// row.
    fn forward(&self, inputs: &[CubeTensor<R>; 3]) -> (CubeTensor<R>, CubeTensor<R>) {
        let q = &inputs[0];
        let units = self.groups * self.rows;
        let out = self.empty(q, q.meta.shape().clone());
        let stats = self.empty(q, Shape::new([2 * units]));
        let (count, dim) = self.cube(&q.client, units);
        forward_kernel::launch::<R>(
            &q.client,
            count,
            dim,
            self.operands(inputs),
            out.clone().into_array_arg(),
            stats.clone().into_array_arg(),
            self.sizes(units),
            self.dim,
            self.softcap.is_some(),
        );
        (out, stats)
    }

    /// `dQ`, `dK`, `dV` from the saved inputs and statistics, `delta` (each query row's
    /// `sum(dO * O)`) and the output's gradient.
    fn backward(
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
        let units = self.groups * self.rows;
        let (count, dim) = self.cube(client, units);
        grad_query_kernel::launch::<R>(
            client,
            count,
            dim,
            self.operands(&saved.inputs),
            backprop(),
            dq.clone().into_array_arg(),
            self.sizes(units),
            self.dim,
            self.softcap.is_some(),
        );
        let dk = self.empty(k, k.meta.shape().clone());
        let dv = self.empty(v, v.meta.shape().clone());
        let units = self.groups * self.k_len;
        let (count, dim) = self.cube(client, units);
        grad_key_value_kernel::launch::<R>(
            client,
            count,
            dim,
            self.operands(&saved.inputs),
            backprop(),
            dk.clone().into_array_arg(),
            dv.clone().into_array_arg(),
            self.sizes(units),
            self.dim,
            self.softcap.is_some(),
        );
        [dq, dk, dv]
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
        let grads_in = call.backward(&saved, &delta, &grad);
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
        let [dq, dk, dv] = call.backward(&saved, &delta, &scaled);
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
