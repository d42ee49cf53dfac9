//! The attention kernels themselves (cubecl, one source for CUDA and wgpu): the forward, and the
//! backward's query and key/value passes, over blocks of query rows and staged key tiles (see
//! the parent module for the algorithm and the layout).

#![allow(clippy::too_many_arguments)]

use cubecl::prelude::*;

use super::{LANES, ROWS};

/// What every kernel reads: queries, keys, values, the mask and its row spans (`(lo, hi)` per
/// mask row).
#[derive(CubeLaunch, CubeType)]
pub(super) struct Operands {
    pub(super) q: Array<f32>,
    pub(super) k: Array<f32>,
    pub(super) v: Array<f32>,
    pub(super) mask: Array<f32>,
    pub(super) spans: Array<i32>,
}

/// The sizes of one call: `cubes` launched with work, `rows` query rows per group of
/// `kv_heads` heads, the mask's `mask_batch`, `q_len` and `k_len`, the `splits` of a key
/// block's query blocks (the `dK`/`dV` kernel) and the soft cap.
#[derive(CubeLaunch, CubeType)]
pub(super) struct Sizes {
    pub(super) cubes: usize,
    pub(super) rows: usize,
    pub(super) kv_heads: usize,
    pub(super) mask_batch: usize,
    pub(super) q_len: usize,
    pub(super) k_len: usize,
    pub(super) splits: usize,
    pub(super) cap: f32,
}

/// What the backward kernels read besides the operands: each query row's score max and
/// 1 / sum (`stats`), its `sum(dO * O)` (`delta`) and the output's gradient.
#[derive(CubeLaunch, CubeType)]
pub(super) struct Backprop {
    pub(super) stats: Array<f32>,
    pub(super) delta: Array<f32>,
    pub(super) grad_out: Array<f32>,
}

/// A block of query rows in shared memory: each row's mask row and shown keys `lo..hi` (a row
/// past the group's end shows none) and, for the backward, its softmax statistics and `delta`.
#[derive(CubeType)]
pub(super) struct BlockRows {
    pub(super) mask_row: SharedMemory<u32>,
    pub(super) lo: SharedMemory<u32>,
    pub(super) hi: SharedMemory<u32>,
    pub(super) max: SharedMemory<f32>,
    pub(super) inv: SharedMemory<f32>,
    pub(super) delta: SharedMemory<f32>,
}

#[cube]
pub(super) fn block_rows(#[comptime] block: usize) -> BlockRows {
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
pub(super) fn load_spans(x: &Operands, n: &Sizes, g: usize, r0: usize, b: &mut BlockRows) {
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
pub(super) fn union_span(b: &BlockRows, k_len: usize) -> (usize, usize) {
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
pub(super) fn load_tile(
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
pub(super) fn tile_dots(
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
pub(super) fn tile_accumulate(
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
pub(super) struct QueryBlock {
    pub(super) t: usize,
    pub(super) ty: usize,
    pub(super) tx: usize,
    pub(super) g: usize,
    pub(super) r0: usize,
    pub(super) q_first: usize,
    pub(super) kv_first: usize,
}

#[cube]
pub(super) fn query_block(
    n: &Sizes,
    #[comptime] block: usize,
    #[comptime] dim: usize,
) -> QueryBlock {
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
pub(super) fn store_tile(
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
pub(super) fn capped_score(s: f32, cap: f32, #[comptime] capped: bool) -> (f32, f32) {
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
pub(super) fn forward_kernel(
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
pub(super) fn load_stats(b: &Backprop, n: &Sizes, g: usize, r0: usize, st: &mut BlockRows) {
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
pub(super) fn score_grad(
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
pub(super) fn grad_query_kernel(
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
pub(super) fn grad_key_value_kernel(
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
