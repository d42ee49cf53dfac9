//! Fused causal attention on the CPU, flash-attention style: queries and keys in blocks, an
//! online softmax, and a backward that recomputes each block's probabilities from the saved
//! softmax statistics instead of keeping them. What it keeps for the backward is the output
//! and one max and sum per query row, so memory is linear in the sequence length; the composed
//! path keeps `batch * heads * q_len * k_len` probabilities per layer.
//!
//! The layout is the decoder's grouped-query one: per (batch, kv head) group, queries
//! `[n_rep * q_len, dim]` (query position fastest, already scaled), keys and values
//! `[k_len, dim]`. Blocks whose keys the mask hides from every query row of the block are
//! skipped (the upper triangle of a causal mask: half the work), blocks it shows in full skip
//! the mask add, and only the blocks on its edge read it.
//!
//! The structure is the one GPU flash-attention kernels use (FlashAttention-2): the unit of
//! work is a query block sweeping the key blocks it sees, in the forward and in the backward.
//! The backward's tile recomputes the probabilities and takes five block products (scores,
//! `dP`, `dV`, `dK`, `dQ`); a task owns its query blocks' `dQ` and sums `dK`/`dV` for its group
//! in a buffer of its own, added up at the end (on a GPU: atomic adds, or a split reduction).
//! Each unit maps to one thread block of a cubecl kernel; here to one rayon task, with the
//! block products on the `gemm` crate (burn-flex's matmul).

use rayon::prelude::*;

use super::simd::{self, multiversion};

/// Query rows per block.
pub const BLOCK_Q: usize = 64;
/// Keys per block.
pub const BLOCK_K: usize = 64;

/// A mask value at or below this hides the key: the masks tune builds use -1e30, whose `exp`
/// relative to any visible score is exactly 0.
const HIDDEN: f32 = -1.0e29;

/// Which keys one mask row shows: all of `lo..hi` when `dense`, none outside it. A row that
/// hides every key is `0..k_len`, not dense, so it is computed in full like the composed path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowSpan {
    pub lo: u32,
    pub hi: u32,
    pub dense: bool,
}

/// The span of every row of a `[rows, k_len]` additive mask.
pub fn row_spans(mask: &[f32], k_len: usize) -> Vec<RowSpan> {
    mask.chunks_exact(k_len.max(1))
        .map(|row| {
            let shown = |v: &f32| *v > HIDDEN;
            match (row.iter().position(shown), row.iter().rposition(shown)) {
                (Some(lo), Some(last)) => RowSpan {
                    lo: lo as u32,
                    hi: last as u32 + 1,
                    dense: row[lo..=last].iter().all(|&v| v == 0.0),
                },
                _ => RowSpan {
                    lo: 0,
                    hi: k_len as u32,
                    dense: false,
                },
            }
        })
        .collect()
}

/// Query rows `r0..r0 + nq` of group `g` against keys `k0..k0 + nk`, where the mask shows
/// some key to some row (tiles it hides entirely are skipped).
#[derive(Debug, Clone, Copy)]
struct Tile {
    g: usize,
    r0: usize,
    nq: usize,
    k0: usize,
    nk: usize,
    /// On the mask's edge: the mask rows are added. Otherwise it shows every key to every row.
    edge: bool,
}

/// The sizes of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub batch: usize,
    pub kv_heads: usize,
    /// Query rows per group: `n_rep * q_len`.
    pub rows: usize,
    pub q_len: usize,
    pub k_len: usize,
    pub dim: usize,
}

impl Dims {
    fn groups(&self) -> usize {
        self.batch * self.kv_heads
    }

    /// The query head of row `r` of group `g` (`kv_head * n_rep + r / q_len`).
    fn query_head(&self, g: usize, r: usize) -> usize {
        let q_len = self.q_len.max(1);
        (g % self.kv_heads) * (self.rows / q_len) + r / q_len
    }

    /// A group's query blocks `(first row, rows)`: `BLOCK_Q` rows at a time within each query
    /// head's `q_len` rows. A block never holds the end of one head and the start of the next:
    /// those rows see opposite ends of the keys, and a block visits every key tile any of its
    /// rows sees (a third more tiles when `q_len` is not a multiple of `BLOCK_Q`, as a padding-
    /// free pack's length rarely is).
    fn query_blocks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let q_len = self.q_len.max(1);
        (0..self.rows / q_len).flat_map(move |head| {
            (0..q_len)
                .step_by(BLOCK_Q)
                .map(move |s| (head * q_len + s, BLOCK_Q.min(q_len - s)))
        })
    }
}

/// Keys or values `[batch, kv_heads, k_len, dim]` with rows `dim` apart: contiguous, or a
/// view of the generation cache's larger buffer (no copy).
#[derive(Debug, Clone, Copy)]
pub struct HeadRows<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub batch_stride: usize,
    pub head_stride: usize,
}

impl<'a> HeadRows<'a> {
    /// Rows `start..start + n` of group `g`.
    fn rows(&self, d: &Dims, g: usize, start: usize, n: usize) -> &'a [f32] {
        let (b, h) = (g / d.kv_heads, g % d.kv_heads);
        let base = self.offset + b * self.batch_stride + h * self.head_stride + start * d.dim;
        &self.data[base..base + n * d.dim]
    }
}

/// The mask `[mask_batch, q_len, k_len]` with its row spans, and the scores' soft cap.
#[derive(Debug, Clone, Copy)]
pub struct Masking<'a> {
    pub mask: &'a [f32],
    pub spans: &'a [RowSpan],
    pub mask_batch: usize,
    /// Gemma 2: scores become `tanh(s / cap) * cap` before the mask.
    pub softcap: Option<f32>,
}

impl Masking<'_> {
    fn mask_row(&self, d: &Dims, g: usize, row: usize) -> usize {
        (g / d.kv_heads % self.mask_batch) * d.q_len + row % d.q_len
    }

    /// Query rows `r0..r0 + nq` of group `g` against keys `k0..k0 + nk`, or `None` when the
    /// mask hides those keys from all those rows.
    fn tile(
        &self,
        d: &Dims,
        g: usize,
        (r0, nq): (usize, usize),
        (k0, nk): (usize, usize),
    ) -> Option<Tile> {
        let (lo, hi) = (k0 as u32, (k0 + nk) as u32);
        let mut all_shown = true;
        let mut any_shown = false;
        for row in r0..r0 + nq {
            let span = self.spans[self.mask_row(d, g, row)];
            any_shown |= span.lo < hi && lo < span.hi;
            all_shown &= span.dense && span.lo <= lo && hi <= span.hi;
        }
        if !any_shown || (!all_shown && self.hides_tile(d, g, (r0, nq), (k0, nk))) {
            return None;
        }
        Some(Tile {
            g,
            r0,
            nq,
            k0,
            nk,
            edge: !all_shown,
        })
    }

    /// Whether the mask hides keys `k0..k0 + nk` from every row of `r0..r0 + nq` although
    /// their spans overlap them: the keys of the other completions between a packed
    /// completion and its prompt (`training::rollout_pack`). A row that hides every key is
    /// never skipped (its span is all keys, computed in full like the composed path).
    /// Why: those packs' rows span the whole pack; skipping saves their attention the tiles
    /// of every other completion. The scan reads one tile of the mask, which the tile's own
    /// products would read anyway.
    fn hides_tile(
        &self,
        d: &Dims,
        g: usize,
        (r0, nq): (usize, usize),
        (k0, nk): (usize, usize),
    ) -> bool {
        (r0..r0 + nq).all(|row| {
            let mask_row = self.mask_row(d, g, row);
            let (at, span) = (mask_row * d.k_len, self.spans[mask_row]);
            let shows_some = self.mask[at + span.lo as usize] > HIDDEN;
            shows_some
                && self.mask[at + k0..at + k0 + nk]
                    .iter()
                    .all(|&v| v <= HIDDEN)
        })
    }

    /// Soft cap and mask on the tile's raw scores `s`; with a cap, `tanh` of each capped
    /// score goes to `tanh_out` for the backward.
    fn apply(&self, d: &Dims, t: &Tile, s: &mut [f32], tanh_out: Option<&mut [f32]>) {
        if let Some(cap) = self.softcap {
            match tanh_out {
                Some(t) => {
                    for (v, t) in s.iter_mut().zip(t.iter_mut()) {
                        *t = (*v / cap).tanh();
                        *v = *t * cap;
                    }
                }
                None => {
                    for v in s.iter_mut() {
                        *v = (*v / cap).tanh() * cap;
                    }
                }
            }
        }
        if t.edge {
            for (row, s_row) in (t.r0..t.r0 + t.nq).zip(s.chunks_exact_mut(t.nk)) {
                let m = &self.mask[self.mask_row(d, t.g, row) * d.k_len + t.k0..][..t.nk];
                for (v, &m) in s_row.iter_mut().zip(m) {
                    *v += m;
                }
            }
        }
    }
}

/// A row-major matrix operand: element `(i, j)` at `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
struct Operand<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl<'a> Operand<'a> {
    fn rows(data: &'a [f32], row_len: usize) -> Self {
        Self {
            data,
            rs: row_len,
            cs: 1,
        }
    }
    /// The transpose of a row-major `[_, row_len]` matrix.
    fn transposed(data: &'a [f32], row_len: usize) -> Self {
        Self {
            data,
            rs: 1,
            cs: row_len,
        }
    }
    fn covers(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// `dst[m, n] (row-major) = lhs[m, k] @ rhs[k, n]`, or `+=` with `accumulate`.
fn matmul(
    dst: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    lhs: Operand,
    rhs: Operand,
    accumulate: bool,
) {
    assert!(
        dst.len() >= m * n && lhs.covers(m, k) && rhs.covers(k, n),
        "attention block matmul operands out of bounds"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(0.0);
        }
        return;
    }
    // SAFETY: the assert above keeps every element gemm reads or writes inside the slices:
    // dst is m x n with row stride n, lhs and rhs are covered by their strides.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

multiversion! {
    /// One online-softmax step for a block: `s` holds the block's scores and becomes their
    /// `exp(s - m_new)`; the running max `m`, sum `l` and output rows `o` are rescaled.
    fn online_softmax(s: &mut [f32], m: &mut [f32], l: &mut [f32], o: &mut [f32], nk: usize, dim: usize) {
        for (((s_row, m), l), o_row) in s
            .chunks_exact_mut(nk)
            .zip(m.iter_mut())
            .zip(l.iter_mut())
            .zip(o.chunks_exact_mut(dim))
        {
            let block_max = simd::max(s_row);
            let m_new = if block_max > *m { block_max } else { *m };
            // exp(-inf) is 0: the first block rescales nothing.
            let correction = simd::exp(*m - m_new);
            let sum = simd::exp_shifted_in_place(s_row, m_new);
            *l = *l * correction + sum;
            *m = m_new;
            if correction != 1.0 {
                for v in o_row.iter_mut() {
                    *v *= correction;
                }
            }
        }
    }
}

/// Each query row's softmax statistics: the scores' max and the inverse of the sum of
/// `exp(s - max)`. Kept apart rather than as one log-sum-exp, which loses the sum in fp32
/// when the max is a -1e30 mask value (a row that hides every key).
#[derive(Debug, Clone, Copy, Default)]
pub struct RowStats {
    pub max: f32,
    pub inv_sum: f32,
}

multiversion! {
    /// `s = exp(s - max) / sum` per row: the probabilities from the forward's statistics.
    fn probabilities(s: &mut [f32], stats: &[RowStats], nk: usize) {
        for (s_row, st) in s.chunks_exact_mut(nk).zip(stats) {
            simd::exp_shifted_in_place(s_row, st.max);
            for v in s_row.iter_mut() {
                *v *= st.inv_sum;
            }
        }
    }
}

multiversion! {
    /// `dp = p * (dp - delta)` per row, times `1 - tanh^2` under a soft cap: the scores'
    /// gradient from the probabilities' (`dp`), `delta = rowsum(dO * O)`.
    fn score_grad(p: &[f32], dp: &mut [f32], delta: &[f32], tanh: Option<&[f32]>, nk: usize) {
        for ((p_row, dp_row), &delta) in p.chunks_exact(nk).zip(dp.chunks_exact_mut(nk)).zip(delta) {
            for (g, &p) in dp_row.iter_mut().zip(p_row) {
                *g = p * (*g - delta);
            }
        }
        if let Some(t) = tanh {
            for (g, &t) in dp.iter_mut().zip(t) {
                *g *= 1.0 - t * t;
            }
        }
    }
}

/// Scratch for one block pair.
struct Scratch {
    s: Vec<f32>,
    dp: Vec<f32>,
    tanh: Option<Vec<f32>>,
}

impl Scratch {
    fn new(softcap: bool) -> Self {
        Self {
            s: vec![0.0; BLOCK_Q * BLOCK_K],
            dp: vec![0.0; BLOCK_Q * BLOCK_K],
            tanh: softcap.then(|| vec![0.0; BLOCK_Q * BLOCK_K]),
        }
    }
}

/// The attention inputs of one call.
#[derive(Clone, Copy)]
pub struct Inputs<'a> {
    pub dims: Dims,
    /// `[batch, kv_heads, rows, dim]`, contiguous, already scaled.
    pub q: &'a [f32],
    pub k: HeadRows<'a>,
    pub v: HeadRows<'a>,
    pub masking: Masking<'a>,
    /// gpt-oss: one sink logit per query head (`kv_heads * n_rep`), one more term in each
    /// row's softmax denominator with no value: the row's running max starts at the sink and
    /// its sum at 1, so the output is the sinkless one times `1 - p_sink`.
    pub sinks: Option<&'a [f32]>,
}

impl Inputs<'_> {
    fn q_rows(&self, g: usize, r0: usize, n: usize) -> &[f32] {
        let d = &self.dims;
        &self.q[(g * d.rows + r0) * d.dim..][..n * d.dim]
    }

    /// The tile's probabilities (or, in the forward, its masked scores) into `scratch.s`;
    /// `stats` turn scores into probabilities.
    fn tile_scores(&self, t: &Tile, scratch: &mut Scratch, stats: Option<&[RowStats]>) {
        let d = &self.dims;
        let Tile {
            g, r0, nq, k0, nk, ..
        } = *t;
        let s = &mut scratch.s[..nq * nk];
        matmul(
            s,
            nq,
            nk,
            d.dim,
            Operand::rows(self.q_rows(g, r0, nq), d.dim),
            Operand::transposed(self.k.rows(d, g, k0, nk), d.dim),
            false,
        );
        let tanh = scratch.tanh.as_mut().map(|t| &mut t[..nq * nk]);
        self.masking.apply(d, t, s, tanh);
        if let Some(stats) = stats {
            probabilities(s, stats, nk);
        }
    }
}

/// The forward: the output `[batch, kv_heads, rows, dim]` and each query row's softmax
/// statistics `[batch, kv_heads, rows]` (what the backward needs).
pub fn forward(x: &Inputs) -> (Vec<f32>, Vec<RowStats>) {
    let d = x.dims;
    let mut out = vec![0.0f32; d.groups() * d.rows * d.dim];
    let mut stats = vec![RowStats::default(); d.groups() * d.rows];
    if d.rows == 0 || d.dim == 0 {
        return (out, stats);
    }
    if d.q_len == 1 {
        out.par_chunks_mut(d.rows * d.dim)
            .zip(stats.par_chunks_mut(d.rows))
            .enumerate()
            .for_each(|(g, (o, st))| one_position(x, g, o, st));
        return (out, stats);
    }
    // Each group's query heads, each in blocks of its own rows (see `Dims::query_blocks`).
    let q_len = d.q_len.max(1);
    out.par_chunks_mut(q_len * d.dim)
        .zip(stats.par_chunks_mut(q_len))
        .enumerate()
        .for_each(|(head_row, (out_h, stats_h))| {
            let (g, first) = (
                head_row / (d.rows / q_len),
                head_row % (d.rows / q_len) * q_len,
            );
            out_h
                .par_chunks_mut(BLOCK_Q * d.dim)
                .zip(stats_h.par_chunks_mut(BLOCK_Q))
                .enumerate()
                .for_each(|(qb, (o, st))| forward_block(x, g, first + qb * BLOCK_Q, o, st));
        });
    (out, stats)
}

multiversion! {
    /// Group `g` of a pass with one query position (a decoding step): its query heads' rows
    /// see the same keys, so one task takes them all and computes every score at once (soft
    /// cap, then the mask row, as [`Masking::apply`]), with the sinks' terms as
    /// [`forward_block`] adds them. Why: the blocked path made each head's single row a block
    /// of its own, with a small gemm call per key tile; the composed path's batched products
    /// (what decoding used instead) were 7% of GRPO's rollouts on SmolLM2-135M.
    fn one_position(x: &Inputs, g: usize, o: &mut [f32], stats: &mut [RowStats]) {
        let d = &x.dims;
        let keys = x.k.rows(d, g, 0, d.k_len);
        let values = x.v.rows(d, g, 0, d.k_len);
        let mut s = vec![0.0f32; d.k_len];
        for (r, (o_row, st)) in o.chunks_exact_mut(d.dim).zip(stats.iter_mut()).enumerate() {
            let q = x.q_rows(g, r, 1);
            for (v, key) in s.iter_mut().zip(keys.chunks_exact(d.dim)) {
                *v = simd::dot(q, key);
            }
            if let Some(cap) = x.masking.softcap {
                for v in s.iter_mut() {
                    *v = (*v / cap).tanh() * cap;
                }
            }
            let mask = &x.masking.mask[x.masking.mask_row(d, g, r) * d.k_len..][..d.k_len];
            for (v, &m) in s.iter_mut().zip(mask) {
                *v += m;
            }
            let sink = x.sinks.map(|sinks| sinks[d.query_head(g, r)]);
            let scores_max = simd::max(&s);
            let max = match sink {
                Some(sink) if sink > scores_max => sink,
                _ => scores_max,
            };
            let sum = simd::exp_shifted_in_place(&mut s, max)
                + sink.map_or(0.0, |sink| simd::exp(sink - max));
            o_row.fill(0.0);
            for (&p, value) in s.iter().zip(values.chunks_exact(d.dim)) {
                for (o, &v) in o_row.iter_mut().zip(value) {
                    *o += p * v;
                }
            }
            let inv_sum = 1.0 / sum;
            for v in o_row.iter_mut() {
                *v *= inv_sum;
            }
            *st = RowStats { max, inv_sum };
        }
    }
}

fn forward_block(x: &Inputs, g: usize, r0: usize, o: &mut [f32], stats: &mut [RowStats]) {
    let d = &x.dims;
    let nq = stats.len();
    let mut scratch = Scratch::new(false);
    let (mut m, mut l) = match x.sinks {
        // exp(sink - sink) = 1: the sink's term of the sum.
        Some(sinks) => (
            (r0..r0 + nq).map(|r| sinks[d.query_head(g, r)]).collect(),
            vec![1.0f32; nq],
        ),
        None => (vec![f32::NEG_INFINITY; nq], vec![0.0f32; nq]),
    };
    for k0 in (0..d.k_len).step_by(BLOCK_K) {
        let nk = BLOCK_K.min(d.k_len - k0);
        let Some(tile) = x.masking.tile(d, g, (r0, nq), (k0, nk)) else {
            continue;
        };
        x.tile_scores(&tile, &mut scratch, None);
        let p = &mut scratch.s[..nq * nk];
        online_softmax(p, &mut m, &mut l, o, nk, d.dim);
        matmul(
            o,
            nq,
            d.dim,
            nk,
            Operand::rows(p, nk),
            Operand::rows(x.v.rows(d, g, k0, nk), d.dim),
            true,
        );
    }
    for ((o_row, st), (&m, &l)) in o
        .chunks_exact_mut(d.dim)
        .zip(stats.iter_mut())
        .zip(m.iter().zip(&l))
    {
        let inv = 1.0 / l;
        for v in o_row.iter_mut() {
            *v *= inv;
        }
        *st = RowStats {
            max: m,
            inv_sum: inv,
        };
    }
}

/// What the backward reads besides the inputs: the forward's output and row statistics, and
/// the output's gradient, all `[batch, kv_heads, rows, ..]` contiguous.
#[derive(Clone, Copy)]
pub struct Saved<'a> {
    pub out: &'a [f32],
    pub stats: &'a [RowStats],
    pub grad_out: &'a [f32],
}

/// The gradients of the queries, keys and values: `dq` like `q`, `dk` and `dv`
/// `[batch, kv_heads, k_len, dim]` contiguous; and of the sinks when there are some.
pub struct Grads {
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
    pub dsinks: Option<Vec<f32>>,
}

/// The sinks' gradient: a sink's probability `p = exp(sink - max) / sum` enters the output
/// only through the denominator, so `d sink = -sum over its rows of p * delta`, with
/// `delta = rowsum(dO * O)` as in the scores' gradient.
fn sink_grads(d: &Dims, sinks: &[f32], stats: &[RowStats], delta: &[f32]) -> Vec<f32> {
    let mut grads = vec![0.0f32; sinks.len()];
    for (i, (st, &delta)) in stats.iter().zip(delta).enumerate() {
        let head = d.query_head(i / d.rows.max(1), i % d.rows.max(1));
        let p = (sinks[head] - st.max).exp() * st.inv_sum;
        grads[head] -= p * delta;
    }
    grads
}

pub fn backward(x: &Inputs, saved: &Saved) -> Grads {
    let d = x.dims;
    let mut dq = vec![0.0f32; d.groups() * d.rows * d.dim];
    let mut dk = vec![0.0f32; d.groups() * d.k_len * d.dim];
    let mut dv = vec![0.0f32; d.groups() * d.k_len * d.dim];
    let no_sinks = x.sinks.map(|s| vec![0.0f32; s.len()]);
    if d.rows == 0 || d.dim == 0 || d.k_len == 0 {
        return Grads {
            dq,
            dk,
            dv,
            dsinks: no_sinks,
        };
    }
    // delta = rowsum(dO * O): the softmax backward's per-row term.
    let delta: Vec<f32> = saved
        .out
        .par_chunks(d.dim)
        .zip(saved.grad_out.par_chunks(d.dim))
        .map(|(o, g)| simd::dot(o, g))
        .collect();
    let dsinks = x
        .sinks
        .map(|sinks| sink_grads(&d, sinks, saved.stats, &delta));
    let sweep = BackwardSweep {
        x,
        saved,
        delta: &delta,
    };
    // Every group's query blocks dealt round-robin to `parts` tasks (so each gets early and
    // late causal blocks alike), enough tasks for every thread.
    let q_blocks = d.query_blocks().count();
    let parts = (2 * rayon::current_num_threads())
        .div_ceil(d.groups())
        .clamp(1, q_blocks);
    let results: Vec<PartGrads> = (0..d.groups() * parts)
        .into_par_iter()
        .map(|task| sweep.part(task / parts, task % parts, parts))
        .collect();
    let group_len = d.k_len * d.dim;
    for part in results {
        for (r0, block) in part.dq {
            let start = (part.g * d.rows + r0) * d.dim;
            dq[start..start + block.len()].copy_from_slice(&block);
        }
        let range = part.g * group_len..(part.g + 1) * group_len;
        for (sum, add) in [(&mut dk[range.clone()], part.dk), (&mut dv[range], part.dv)] {
            for (s, a) in sum.iter_mut().zip(add) {
                *s += a;
            }
        }
    }
    Grads { dq, dk, dv, dsinks }
}

/// One backward task's share: whole `dQ` blocks, and partial `dK`/`dV` sums for its group.
struct PartGrads {
    g: usize,
    dq: Vec<(usize, Vec<f32>)>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

struct BackwardSweep<'a> {
    x: &'a Inputs<'a>,
    saved: &'a Saved<'a>,
    delta: &'a [f32],
}

impl BackwardSweep<'_> {
    /// The tile's probabilities into `scratch.s` and its scores' gradient into `scratch.dp`.
    fn tile(&self, t: &Tile, scratch: &mut Scratch) {
        let x = self.x;
        let d = &x.dims;
        let Tile {
            g, r0, nq, k0, nk, ..
        } = *t;
        let row0 = g * d.rows + r0;
        x.tile_scores(t, scratch, Some(&self.saved.stats[row0..row0 + nq]));
        // dP = dO @ V^T
        let dp = &mut scratch.dp[..nq * nk];
        matmul(
            dp,
            nq,
            nk,
            d.dim,
            Operand::rows(self.grad_out(row0, nq), d.dim),
            Operand::transposed(x.v.rows(d, g, k0, nk), d.dim),
            false,
        );
        score_grad(
            &scratch.s[..nq * nk],
            dp,
            &self.delta[row0..row0 + nq],
            scratch.tanh.as_deref().map(|t| &t[..nq * nk]),
            nk,
        );
    }

    fn grad_out(&self, row0: usize, nq: usize) -> &[f32] {
        let dim = self.x.dims.dim;
        &self.saved.grad_out[row0 * dim..][..nq * dim]
    }

    /// Query blocks `part, part + parts, ...` of group `g`, each sweeping the key blocks its
    /// rows see: 5 block products per tile (scores, dP, dV, dK, dQ).
    fn part(&self, g: usize, part: usize, parts: usize) -> PartGrads {
        let x = self.x;
        let d = &x.dims;
        let mut out = PartGrads {
            g,
            dq: Vec::new(),
            dk: vec![0.0; d.k_len * d.dim],
            dv: vec![0.0; d.k_len * d.dim],
        };
        let mut scratch = Scratch::new(x.masking.softcap.is_some());
        for (r0, nq) in d.query_blocks().skip(part).step_by(parts) {
            let row0 = g * d.rows + r0;
            let mut dq = vec![0.0f32; nq * d.dim];
            for k0 in (0..d.k_len).step_by(BLOCK_K) {
                let nk = BLOCK_K.min(d.k_len - k0);
                let Some(tile) = x.masking.tile(d, g, (r0, nq), (k0, nk)) else {
                    continue;
                };
                self.tile(&tile, &mut scratch);
                let keys = k0 * d.dim..(k0 + nk) * d.dim;
                // dV += P^T @ dO
                matmul(
                    &mut out.dv[keys.clone()],
                    nk,
                    d.dim,
                    nq,
                    Operand::transposed(&scratch.s[..nq * nk], nk),
                    Operand::rows(self.grad_out(row0, nq), d.dim),
                    true,
                );
                // dK += dS^T @ Q
                matmul(
                    &mut out.dk[keys],
                    nk,
                    d.dim,
                    nq,
                    Operand::transposed(&scratch.dp[..nq * nk], nk),
                    Operand::rows(x.q_rows(g, r0, nq), d.dim),
                    true,
                );
                // dQ += dS @ K
                matmul(
                    &mut dq,
                    nq,
                    d.dim,
                    nk,
                    Operand::rows(&scratch.dp[..nq * nk], nk),
                    Operand::rows(x.k.rows(d, g, k0, nk), d.dim),
                    true,
                );
            }
            out.dq.push((r0, dq));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: f32 = -1.0e30;

    fn causal(q_len: usize) -> Vec<f32> {
        (0..q_len * q_len)
            .map(|i| if i % q_len > i / q_len { H } else { 0.0 })
            .collect()
    }

    #[test]
    fn query_blocks_stay_within_one_head() {
        let d = Dims {
            batch: 1,
            kv_heads: 1,
            rows: 3 * 130,
            q_len: 130,
            k_len: 130,
            dim: 8,
        };
        let blocks: Vec<_> = d.query_blocks().collect();
        let head = [(0, 64), (64, 64), (128, 2)];
        let want: Vec<_> = (0..3)
            .flat_map(|h| head.map(|(r0, n)| (h * 130 + r0, n)))
            .collect();
        assert_eq!(blocks, want);
    }

    #[test]
    fn spans_cover_the_shown_keys() {
        let mask = [
            [0.0, H, H, H],   // causal row 0
            [H, 0.0, 0.0, H], // a window
            [H, H, H, H],     // hides every key: computed in full
            [0.0, H, 0.0, H], // a hole: shown keys with a hidden one between
        ]
        .concat();
        let span = |lo, hi, dense| RowSpan { lo, hi, dense };
        assert_eq!(
            row_spans(&mask, 4),
            vec![
                span(0, 1, true),
                span(1, 3, true),
                span(0, 4, false),
                span(0, 3, false)
            ]
        );
    }

    #[test]
    fn causal_tiles_above_the_diagonal_are_skipped_and_below_it_unmasked() {
        let q_len = 2 * BLOCK_Q;
        let mask = causal(q_len);
        let spans = row_spans(&mask, q_len);
        let masking = Masking {
            mask: &mask,
            spans: &spans,
            mask_batch: 1,
            softcap: None,
        };
        // Two query groups (n_rep 2): the second starts at position 0 again.
        let d = Dims {
            batch: 1,
            kv_heads: 1,
            rows: 2 * q_len,
            q_len,
            k_len: q_len,
            dim: 4,
        };
        let tile = |r0, k0| masking.tile(&d, 0, (r0, BLOCK_Q), (k0, BLOCK_K));
        for rep in [0, q_len] {
            assert!(tile(rep, BLOCK_K).is_none(), "above the diagonal");
            assert!(!tile(rep + BLOCK_Q, 0).unwrap().edge, "below the diagonal");
            assert!(tile(rep, 0).unwrap().edge, "on the diagonal");
            assert!(tile(rep + BLOCK_Q, BLOCK_K).unwrap().edge);
        }
    }
}
