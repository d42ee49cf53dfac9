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

/// The sizes of one call: `cubes` launched with work, `rows` query rows per group of
/// `kv_heads` heads, the mask's `mask_batch`, `q_len` and `k_len`, the `splits` of a key
/// block's query blocks (the `dK`/`dV` kernel) and the soft cap.
#[derive(CubeLaunch, CubeType)]
struct Sizes {
    cubes: usize,
    rows: usize,
    kv_heads: usize,
    mask_batch: usize,
    q_len: usize,
    k_len: usize,
    splits: usize,
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

/// A block of query rows in shared memory: each row's mask row and shown keys `lo..hi` (a row
/// past the group's end shows none) and, for the backward, its softmax statistics and `delta`.
#[derive(CubeType)]
struct BlockRows {
    mask_row: SharedMemory<u32>,
    lo: SharedMemory<u32>,
    hi: SharedMemory<u32>,
    max: SharedMemory<f32>,
    inv: SharedMemory<f32>,
    delta: SharedMemory<f32>,
}

#[cube]
fn block_rows(#[comptime] block: usize) -> BlockRows {
    BlockRows {
        mask_row: SharedMemory::<u32>::new(block),
        lo: SharedMemory::<u32>::new(block),
        hi: SharedMemory::<u32>::new(block),
        max: SharedMemory::<f32>::new(block),
        inv: SharedMemory::<f32>::new(block),
        delta: SharedMemory::<f32>::new(block),
    }
}

/// Fills the spans of `b` for rows `r0..r0 + block` of group `g` (one thread per row).
#[cube]
fn load_spans(x: &Operands, n: &Sizes, g: usize, r0: usize, b: &mut BlockRows) {
    let t = UNIT_POS as usize;
    if t < b.lo.len() {
        let r = r0 + t;
        let mut row = 0usize;
        let mut lo = 0usize;
        let mut hi = 0usize;
        if r < n.rows {
            row = ((g / n.kv_heads) % n.mask_batch) * n.q_len + r % n.q_len;
            lo = usize::cast_from(x.spans[2 * row]);
            hi = usize::cast_from(x.spans[2 * row + 1]);
        }
        b.mask_row[t] = u32::cast_from(row);
        b.lo[t] = u32::cast_from(lo);
        b.hi[t] = u32::cast_from(hi);
    }
}

/// The keys `lo..hi` some row of `b` shows (after a `sync_cube` that published `b`); empty
/// (`lo >= hi`) when none does.
#[cube]
fn union_span(b: &BlockRows, k_len: usize) -> (usize, usize) {
    let mut lo = k_len;
    let mut hi = 0usize;
    for i in 0..b.lo.len() {
        let (l, h) = (usize::cast_from(b.lo[i]), usize::cast_from(b.hi[i]));
        if l < h {
            if l < lo {
                lo = l;
            }
            if h > hi {
                hi = h;
            }
        }
    }
    (lo, hi)
}

/// Copies rows `0..valid` of `src` from element `first` (rows `dim` apart) into `dst` at
/// stride `dim + 1`, zeros for rows `valid..block` (every thread of the cube takes part).
#[cube]
fn load_tile(
    src: &Array<f32>,
    first: usize,
    valid: usize,
    dst: &mut SharedMemory<f32>,
    #[comptime] block: usize,
    #[comptime] dim: usize,
) {
    let mut e = UNIT_POS as usize;
    while e < comptime!(block * dim) {
        let r = e / dim;
        let mut value = f32::new(0.0);
        if r < valid {
            value = src[first + e];
        }
        dst[r * comptime!(dim + 1) + e % dim] = value;
        e += comptime!(2 * block);
    }
}

/// `out[i * cols + c] = a[ROWS * ty + i] . b[tx + LANES * c]` over rows of `dim` at stride
/// `dim + 1`: the thread's `ROWS x cols` tile of `a @ b^T`.
#[cube]
fn tile_dots(
    a: &SharedMemory<f32>,
    b: &SharedMemory<f32>,
    ty: usize,
    tx: usize,
    out: &mut Array<f32>,
    #[comptime] cols: usize,
    #[comptime] dim: usize,
) {
    let stride = comptime!(dim + 1);
    let mut av = Array::<f32>::new(ROWS);
    let mut bv = Array::<f32>::new(cols);
    #[unroll]
    for x in 0..comptime!(ROWS * cols) {
        out[x] = 0.0;
    }
    for d in 0..dim {
        #[unroll]
        for i in 0..ROWS {
            av[i] = a[(ROWS * ty + i) * stride + d];
        }
        #[unroll]
        for c in 0..cols {
            bv[c] = b[(tx + LANES * c) * stride + d];
        }
        #[unroll]
        for i in 0..ROWS {
            #[unroll]
            for c in 0..cols {
                out[i * cols + c] += av[i] * bv[c];
            }
        }
    }
}

/// `acc[i * cols + c] += sum_j p[ROWS * ty + i][j] * v[j][tx + LANES * c]`: the thread's tile
/// of `p @ v`, `p` a `block x block` tile at stride `block + 1`, `v` a `block x dim` tile at
/// stride `dim + 1` (columns past `dim` skipped).
#[cube]
fn tile_accumulate(
    p: &SharedMemory<f32>,
    v: &SharedMemory<f32>,
    ty: usize,
    tx: usize,
    acc: &mut Array<f32>,
    #[comptime] block: usize,
    #[comptime] dim: usize,
) {
    let cols = comptime!(dim.div_ceil(LANES));
    let mut pv = Array::<f32>::new(ROWS);
    for j in 0..block {
        #[unroll]
        for i in 0..ROWS {
            pv[i] = p[(ROWS * ty + i) * comptime!(block + 1) + j];
        }
        #[unroll]
        for c in 0..cols {
            let col = tx + LANES * c;
            if col < dim {
                let value = v[j * comptime!(dim + 1) + col];
                #[unroll]
                for i in 0..ROWS {
                    acc[i * cols + c] += pv[i] * value;
                }
            }
        }
    }
}

/// A query-block cube's place: the thread (`t`, its row group `ty` and lane `tx`), the block's
/// group `g` and first row `r0`, where its first query row starts and where its group's keys do.
#[derive(CubeType)]
struct QueryBlock {
    t: usize,
    ty: usize,
    tx: usize,
    g: usize,
    r0: usize,
    q_first: usize,
    kv_first: usize,
}

#[cube]
fn query_block(n: &Sizes, #[comptime] block: usize, #[comptime] dim: usize) -> QueryBlock {
    let t = UNIT_POS as usize;
    let blocks = n.rows.div_ceil(block);
    let g = CUBE_POS / blocks;
    let r0 = (CUBE_POS % blocks) * block;
    QueryBlock {
        t,
        ty: t / LANES,
        tx: t % LANES,
        g,
        r0,
        q_first: (g * n.rows + r0) * dim,
        kv_first: g * n.k_len * dim,
    }
}

/// Writes the thread's `ROWS x` every-`LANES`-th-column tile `acc` to rows `0..valid` of a
/// block starting at element `first` of `dst` (rows `dim` apart).
#[cube]
fn store_tile(
    acc: &Array<f32>,
    dst: &mut Array<f32>,
    first: usize,
    valid: usize,
    ty: usize,
    tx: usize,
    #[comptime] dim: usize,
) {
    let cols = comptime!(dim.div_ceil(LANES));
    #[unroll]
    for i in 0..ROWS {
        let r = ROWS * ty + i;
        if r < valid {
            #[unroll]
            for c in 0..cols {
                let col = tx + LANES * c;
                if col < dim {
                    dst[first + r * dim + col] = acc[i * cols + c];
                }
            }
        }
    }
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

/// One cube per block of query rows: the output rows and their softmax statistics, over the
/// key tiles some row of the block shows.
#[cube(launch)]
fn forward_kernel(
    x: &Operands,
    out: &mut Array<f32>,
    stats: &mut Array<f32>,
    n: Sizes,
    #[comptime] dim: usize,
    #[comptime] block: usize,
    #[comptime] capped: bool,
) {
    if CUBE_POS >= n.cubes {
        terminate!();
    }
    let cols = comptime!(block / LANES);
    let out_cols = comptime!(dim.div_ceil(LANES));
    let QueryBlock {
        t,
        ty,
        tx,
        g,
        r0,
        q_first,
        kv_first,
    } = query_block(&n, block, dim);

    let mut rows = block_rows(block);
    let mut qs = SharedMemory::<f32>::new(comptime!(block * (dim + 1)));
    let mut kv = SharedMemory::<f32>::new(comptime!(block * (dim + 1)));
    let mut ps = SharedMemory::<f32>::new(comptime!(block * (block + 1)));
    let mut scale = SharedMemory::<f32>::new(block);
    load_spans(x, &n, g, r0, &mut rows);
    load_tile(&x.q, q_first, n.rows - r0, &mut qs, block, dim);
    sync_cube();
    let (lo, hi) = union_span(&rows, n.k_len);

    // The row owner's (thread `t < block`) running max and sum.
    let mut m = f32::new(-3.0e38);
    let mut l = f32::new(0.0);
    let mut s = Array::<f32>::new(comptime!(ROWS * cols));
    let mut acc = Array::<f32>::new(comptime!(ROWS * out_cols));
    #[unroll]
    for x in 0..comptime!(ROWS * out_cols) {
        acc[x] = 0.0;
    }
    let mut j0 = lo;
    while j0 < hi {
        load_tile(&x.k, kv_first + j0 * dim, n.k_len - j0, &mut kv, block, dim);
        sync_cube();
        tile_dots(&qs, &kv, ty, tx, &mut s, cols, dim);
        #[unroll]
        for i in 0..ROWS {
            let rl = ROWS * ty + i;
            let m0 = usize::cast_from(rows.mask_row[rl]) * n.k_len;
            #[unroll]
            for c in 0..cols {
                let j = j0 + tx + LANES * c;
                let (sc, _t) = capped_score(s[i * cols + c], n.cap, capped);
                let mut value = f32::new(0.0);
                if j < n.k_len {
                    value = sc + x.mask[m0 + j];
                }
                ps[rl * comptime!(block + 1) + tx + LANES * c] = value;
            }
        }
        sync_cube();
        // Each row's owner: the online softmax over the tile's shown keys.
        if t < block {
            let (rlo, rhi) = (usize::cast_from(rows.lo[t]), usize::cast_from(rows.hi[t]));
            let base = t * comptime!(block + 1);
            let mut m_new = m;
            for c in 0..block {
                let j = j0 + c;
                if j >= rlo && j < rhi {
                    m_new = max(m_new, ps[base + c]);
                }
            }
            let a = (m - m_new).exp();
            let mut sum = f32::new(0.0);
            for c in 0..block {
                let j = j0 + c;
                let mut p = f32::new(0.0);
                if j >= rlo && j < rhi {
                    p = (ps[base + c] - m_new).exp();
                }
                ps[base + c] = p;
                sum += p;
            }
            l = l * a + sum;
            m = m_new;
            scale[t] = a;
        }
        sync_cube();
        load_tile(&x.v, kv_first + j0 * dim, n.k_len - j0, &mut kv, block, dim);
        sync_cube();
        #[unroll]
        for i in 0..ROWS {
            let a = scale[ROWS * ty + i];
            #[unroll]
            for c in 0..out_cols {
                acc[i * out_cols + c] *= a;
            }
        }
        tile_accumulate(&ps, &kv, ty, tx, &mut acc, block, dim);
        sync_cube();
        j0 += block;
    }
    // The max and the sum apart, not `m + ln(l)`: for a row whose mask hides every key `m` is
    // -1e30, and `m + ln(l)` rounds to `m` in fp32 (the backward would then see `p = 1`).
    if t < block {
        let inv = f32::new(1.0) / l;
        scale[t] = inv;
        let r = r0 + t;
        if r < n.rows {
            let at = g * n.rows + r;
            stats[2 * at] = m;
            stats[2 * at + 1] = inv;
        }
    }
    sync_cube();
    #[unroll]
    for i in 0..ROWS {
        let inv = scale[ROWS * ty + i];
        #[unroll]
        for c in 0..out_cols {
            acc[i * out_cols + c] *= inv;
        }
    }
    store_tile(&acc, out, q_first, n.rows - r0, ty, tx, dim);
}

/// Fills the statistics of `st` for rows `r0..r0 + block` of group `g` (one thread per row).
#[cube]
fn load_stats(b: &Backprop, n: &Sizes, g: usize, r0: usize, st: &mut BlockRows) {
    let t = UNIT_POS as usize;
    if t < st.max.len() {
        let r = r0 + t;
        let mut max = f32::new(0.0);
        let mut inv = f32::new(0.0);
        let mut delta = f32::new(0.0);
        if r < n.rows {
            let at = g * n.rows + r;
            max = b.stats[2 * at];
            inv = b.stats[2 * at + 1];
            delta = b.delta[at];
        }
        st.max[t] = max;
        st.inv[t] = inv;
        st.delta[t] = delta;
    }
}

/// The gradient of one score: `p * (dp - delta)`, times the soft cap's derivative, with `p`
/// recomputed from the row's statistics; 0 and 0 (`p`, `ds`) for a key the row does not show.
#[cube]
fn score_grad(
    raw: f32,
    dp: f32,
    mask: f32,
    shown: bool,
    max: f32,
    inv: f32,
    delta: f32,
    cap: f32,
    #[comptime] capped: bool,
) -> (f32, f32) {
    let mut p = f32::new(0.0);
    let mut ds = f32::new(0.0);
    if shown {
        let (s, t) = capped_score(raw, cap, capped);
        p = (s + mask - max).exp() * inv;
        ds = p * (dp - delta);
        if capped {
            ds *= 1.0 - t * t;
        }
    }
    (p, ds)
}

/// One cube per block of query rows: `dQ` over the key tiles some row of the block shows.
#[cube(launch)]
fn grad_query_kernel(
    x: &Operands,
    b: &Backprop,
    dq: &mut Array<f32>,
    n: Sizes,
    #[comptime] dim: usize,
    #[comptime] block: usize,
    #[comptime] capped: bool,
) {
    if CUBE_POS >= n.cubes {
        terminate!();
    }
    let cols = comptime!(block / LANES);
    let out_cols = comptime!(dim.div_ceil(LANES));
    let QueryBlock {
        ty,
        tx,
        g,
        r0,
        q_first,
        kv_first,
        ..
    } = query_block(&n, block, dim);

    let mut rows = block_rows(block);
    let mut qs = SharedMemory::<f32>::new(comptime!(block * (dim + 1)));
    let mut gs = SharedMemory::<f32>::new(comptime!(block * (dim + 1)));
    let mut ks = SharedMemory::<f32>::new(comptime!(block * (dim + 1)));
    let mut vs = SharedMemory::<f32>::new(comptime!(block * (dim + 1)));
    let mut ds_tile = SharedMemory::<f32>::new(comptime!(block * (block + 1)));
    load_spans(x, &n, g, r0, &mut rows);
    load_stats(b, &n, g, r0, &mut rows);
    load_tile(&x.q, q_first, n.rows - r0, &mut qs, block, dim);
    load_tile(&b.grad_out, q_first, n.rows - r0, &mut gs, block, dim);
    sync_cube();
    let (lo, hi) = union_span(&rows, n.k_len);

    let mut s = Array::<f32>::new(comptime!(ROWS * cols));
    let mut dp = Array::<f32>::new(comptime!(ROWS * cols));
    let mut acc = Array::<f32>::new(comptime!(ROWS * out_cols));
    #[unroll]
    for x in 0..comptime!(ROWS * out_cols) {
        acc[x] = 0.0;
    }
    let mut j0 = lo;
    while j0 < hi {
        load_tile(&x.k, kv_first + j0 * dim, n.k_len - j0, &mut ks, block, dim);
        load_tile(&x.v, kv_first + j0 * dim, n.k_len - j0, &mut vs, block, dim);
        sync_cube();
        tile_dots(&qs, &ks, ty, tx, &mut s, cols, dim);
        tile_dots(&gs, &vs, ty, tx, &mut dp, cols, dim);
        #[unroll]
        for i in 0..ROWS {
            let rl = ROWS * ty + i;
            let (rlo, rhi) = (usize::cast_from(rows.lo[rl]), usize::cast_from(rows.hi[rl]));
            let m0 = usize::cast_from(rows.mask_row[rl]) * n.k_len;
            #[unroll]
            for c in 0..cols {
                let j = j0 + tx + LANES * c;
                let shown = j >= rlo && j < rhi;
                let mut mask = f32::new(0.0);
                if shown {
                    mask = x.mask[m0 + j];
                }
                let (_p, ds) = score_grad(
                    s[i * cols + c],
                    dp[i * cols + c],
                    mask,
                    shown,
                    rows.max[rl],
                    rows.inv[rl],
                    rows.delta[rl],
                    n.cap,
                    capped,
                );
                ds_tile[rl * comptime!(block + 1) + tx + LANES * c] = ds;
            }
        }
        sync_cube();
        tile_accumulate(&ds_tile, &ks, ty, tx, &mut acc, block, dim);
        sync_cube();
        j0 += block;
    }
    store_tile(&acc, dq, q_first, n.rows - r0, ty, tx, dim);
}

/// One cube per block of keys and split: `dK` and `dV` over the split's query blocks (every
/// `splits`-th) that show a key of the block, written to the split's own slice (summed after).
#[cube(launch)]
fn grad_key_value_kernel(
    x: &Operands,
    b: &Backprop,
    dk: &mut Array<f32>,
    dv: &mut Array<f32>,
    n: Sizes,
    #[comptime] dim: usize,
    #[comptime] block: usize,
    #[comptime] capped: bool,
) {
    if CUBE_POS >= n.cubes {
        terminate!();
    }
    let cols = comptime!(block / LANES);
    let out_cols = comptime!(dim.div_ceil(LANES));
    let t = UNIT_POS as usize;
    let (ty, tx) = (t / LANES, t % LANES);
    let key_blocks = n.k_len.div_ceil(block);
    let split = CUBE_POS % n.splits;
    let g = CUBE_POS / n.splits / key_blocks;
    let j0 = (CUBE_POS / n.splits % key_blocks) * block;
    let kv_first = (g * n.k_len + j0) * dim;
    let groups = n.cubes / n.splits / key_blocks;
    let out_first = split * groups * n.k_len * dim + kv_first;

    let mut rows = block_rows(block);
    let mut ks = SharedMemory::<f32>::new(comptime!(block * (dim + 1)));
    let mut vs = SharedMemory::<f32>::new(comptime!(block * (dim + 1)));
    let mut qs = SharedMemory::<f32>::new(comptime!(block * (dim + 1)));
    let mut gs = SharedMemory::<f32>::new(comptime!(block * (dim + 1)));
    // `P^T`, then `dS^T`: keys down, query rows across.
    let mut pt = SharedMemory::<f32>::new(comptime!(block * (block + 1)));
    load_tile(&x.k, kv_first, n.k_len - j0, &mut ks, block, dim);
    load_tile(&x.v, kv_first, n.k_len - j0, &mut vs, block, dim);

    let mut s = Array::<f32>::new(comptime!(ROWS * cols));
    let mut dp = Array::<f32>::new(comptime!(ROWS * cols));
    let mut ds = Array::<f32>::new(comptime!(ROWS * cols));
    let mut dk_acc = Array::<f32>::new(comptime!(ROWS * out_cols));
    let mut dv_acc = Array::<f32>::new(comptime!(ROWS * out_cols));
    #[unroll]
    for x in 0..comptime!(ROWS * out_cols) {
        dk_acc[x] = 0.0;
        dv_acc[x] = 0.0;
    }
    let query_blocks = n.rows.div_ceil(block);
    let mut qb = split;
    while qb < query_blocks {
        let r0 = qb * block;
        let q_first = (g * n.rows + r0) * dim;
        load_spans(x, &n, g, r0, &mut rows);
        load_stats(b, &n, g, r0, &mut rows);
        load_tile(&x.q, q_first, n.rows - r0, &mut qs, block, dim);
        load_tile(&b.grad_out, q_first, n.rows - r0, &mut gs, block, dim);
        sync_cube();
        let (lo, hi) = union_span(&rows, n.k_len);
        // The same answer on every thread of the cube, so the barriers below stay uniform.
        if lo < j0 + block && hi > j0 {
            tile_dots(&ks, &qs, ty, tx, &mut s, cols, dim);
            tile_dots(&vs, &gs, ty, tx, &mut dp, cols, dim);
            #[unroll]
            for i in 0..ROWS {
                let j = j0 + ROWS * ty + i;
                #[unroll]
                for c in 0..cols {
                    let rl = tx + LANES * c;
                    let (rlo, rhi) = (usize::cast_from(rows.lo[rl]), usize::cast_from(rows.hi[rl]));
                    let shown = j >= rlo && j < rhi;
                    let mut mask = f32::new(0.0);
                    if shown {
                        mask = x.mask[usize::cast_from(rows.mask_row[rl]) * n.k_len + j];
                    }
                    let (p, grad) = score_grad(
                        s[i * cols + c],
                        dp[i * cols + c],
                        mask,
                        shown,
                        rows.max[rl],
                        rows.inv[rl],
                        rows.delta[rl],
                        n.cap,
                        capped,
                    );
                    ds[i * cols + c] = grad;
                    pt[(ROWS * ty + i) * comptime!(block + 1) + rl] = p;
                }
            }
            sync_cube();
            tile_accumulate(&pt, &gs, ty, tx, &mut dv_acc, block, dim);
            sync_cube();
            #[unroll]
            for i in 0..ROWS {
                #[unroll]
                for c in 0..cols {
                    pt[(ROWS * ty + i) * comptime!(block + 1) + tx + LANES * c] = ds[i * cols + c];
                }
            }
            sync_cube();
            tile_accumulate(&pt, &qs, ty, tx, &mut dk_acc, block, dim);
        }
        sync_cube();
        qb += n.splits;
    }
    store_tile(&dk_acc, dk, out_first, n.k_len - j0, ty, tx, dim);
    store_tile(&dv_acc, dv, out_first, n.k_len - j0, ty, tx, dim);
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
