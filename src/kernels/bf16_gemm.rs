//! A bf16 GEMM for CPUs with AVX512-BF16 (`vdpbf16ps`: 32 bf16 products summed pairwise into 16
//! f32 lanes per instruction, twice the multiply-adds of an f32 FMA), f32 accumulation and
//! output, detected at run time. Where the CPU lacks it, [`available`] is false and callers take
//! the widen-then-f32-GEMM path.
//!
//! Why: PyTorch (oneDNN) multiplies bf16 on such CPUs natively, which made its bf16 training
//! faster than its fp32 on the benchmark machine, while widening to f32 made tune's bf16 slower
//! than its fp32 (BENCHMARKS.md).
//!
//! Layout: both operands are packed once (any strides: a transposed weight is read in place) into
//! K-pairs, the unit `vdpbf16ps` consumes: A into panels of [`MR`] rows whose pair `(a[m][k],
//! a[m][k+1])` is one 32-bit word to broadcast, B into panels of [`NR`] columns whose pairs
//! `(b[k][n], b[k+1][n])` are interleaved along the vector. An odd K is padded with a zero pair
//! half. Tiles of C are spread over the rayon pool; each runs the K loop in blocks of [`KC_PAIRS`]
//! so a B panel block stays in cache across the row panels that use it.
//!
//! Values: each product of two bf16 values is exact in f32 and the sums are f32 (the instruction
//! rounds to nearest even, and treats subnormal inputs and results as zero), so results differ
//! from an f32 GEMM of the widened values only in summation order and subnormals.

use burn::tensor::bf16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Rows per A panel (and per micro-tile).
const MR: usize = 6;
/// Columns per B panel: four vectors of 16 f32 lanes.
pub const NR: usize = 64;
const LANES: usize = 16;
/// K-pairs per cache block of the inner loop.
const KC_PAIRS: usize = 192;
/// K-pairs per block of the K-contiguous packing loop: 64 bytes of each line.
const PACK_PAIRS: usize = 16;
/// Row and column panels per parallel task.
const TASK_ROW_PANELS: usize = 8;
const TASK_COL_PANELS: usize = 4;

/// Whether this CPU runs the bf16 GEMM.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A bf16 matrix operand: element `(r, c)` at `data[offset + r * row_stride + c * col_stride]`.
#[derive(Debug, Clone, Copy)]
pub struct Operand<'a> {
    pub data: &'a [bf16],
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl Operand<'_> {
    #[cfg(test)]
    fn bits(&self, r: usize, c: usize) -> u32 {
        self.data[self.offset + r * self.row_stride + c * self.col_stride].to_bits() as u32
    }

    /// This operand as `count` lines (A's rows, B's columns) of K values.
    fn lines(&self, line_stride: usize, k_stride: usize, count: usize) -> Lines<'_> {
        Lines {
            data: self.data.reinterpret_cast(),
            offset: self.offset,
            count,
            line_stride,
            k_stride,
        }
    }
}

/// An operand seen as lines along K: value `(line, k)` at `offset + line * line_stride + k *
/// k_stride`.
struct Lines<'a> {
    data: &'a [u16],
    offset: usize,
    count: usize,
    line_stride: usize,
    k_stride: usize,
}

/// Packs `x` into panels of `width` lines: panel `p`, pair `kp`, line `l` is the word
/// `(x[l][2kp], x[l][2kp + 1])` at `((p * k_pairs) + kp) * width + l`, zero past the ends.
/// The two layouts weights and activations come in have loops that read memory in order: K
/// contiguous (a pair is one unaligned 32-bit read) or lines contiguous (two K rows
/// interleaved).
///
/// Why not zeroed first: each full panel has every word written below, and a zeroed
/// allocation of the packed buffer (as large as the operand) was 5% of a bf16 LoRA step on the
/// 128-expert Qwen3-MoE layer, every expert's weight being packed per product (`memset`
/// under the allocator, `perf record`). Only the last panel, when short, is zeroed.
fn pack(x: &Lines<'_>, k: usize, width: usize) -> Vec<u32> {
    let k_pairs = k.div_ceil(2);
    let len = x.count.div_ceil(width) * k_pairs * width;
    let mut packed = Vec::with_capacity(len);
    packed.spare_capacity_mut()[..len]
        .par_chunks_mut(k_pairs * width)
        .enumerate()
        .for_each(|(p, panel)| {
            let first = p * width;
            let lines = width.min(x.count - first);
            if lines < width {
                // The words past the last line are zero.
                panel.fill(MaybeUninit::new(0));
            }
            if x.k_stride == 1 {
                pack_k_contiguous(
                    x,
                    PanelAt {
                        k,
                        width,
                        first,
                        lines,
                    },
                    panel,
                );
            } else if x.line_stride == 1 {
                for (kp, words) in panel.chunks_exact_mut(width).enumerate() {
                    let row = |k_index: usize| {
                        let start = x.offset + k_index * x.k_stride + first;
                        &x.data[start..start + lines]
                    };
                    let lo = row(2 * kp);
                    if 2 * kp + 1 < k {
                        let hi = row(2 * kp + 1);
                        for ((w, &lo), &hi) in words.iter_mut().zip(lo).zip(hi) {
                            w.write(lo as u32 | ((hi as u32) << 16));
                        }
                    } else {
                        for (w, &lo) in words.iter_mut().zip(lo) {
                            w.write(lo as u32);
                        }
                    }
                }
            } else {
                for l in 0..lines {
                    let start = x.offset + (first + l) * x.line_stride;
                    for kp in 0..k_pairs {
                        let at = |k_index: usize| {
                            if k_index < k {
                                x.data[start + k_index * x.k_stride] as u32
                            } else {
                                0
                            }
                        };
                        panel[kp * width + l].write(at(2 * kp) | (at(2 * kp + 1) << 16));
                    }
                }
            }
        });
    // SAFETY: every panel's `k_pairs * width` words were written: a short one zeroed whole,
    // and each branch above writes pair `kp`'s word of every line `l < lines` for every `kp`
    // (the K-contiguous packs: a full or odd last pair per block, all lines in groups).
    unsafe { packed.set_len(len) };
    packed
}

/// Which lines one panel packs and how: K values per line, the panel's width in lines, its
/// first line, and how many of its lines exist (the last panel may be short).
#[derive(Clone, Copy)]
struct PanelAt {
    k: usize,
    width: usize,
    first: usize,
    lines: usize,
}

/// One panel of K-contiguous lines (activations `x`, or a weight read as `w.T`): a transpose of
/// 32-bit pairs, in blocks of [`PACK_PAIRS`] pairs so the panel's written words stay in L1 and
/// each line's read is one cache line per block. 16 x 16 blocks in AVX-512 registers where the
/// CPU has AVX512BW (every CPU with AVX512-BF16 does), else one word at a time.
fn pack_k_contiguous(x: &Lines<'_>, at: PanelAt, panel: &mut [MaybeUninit<u32>]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
    {
        // SAFETY: the CPU has the features the function is compiled for.
        unsafe { pack_k_contiguous_avx512(x, at, panel) };
        return;
    }
    pack_k_contiguous_scalar(x, at, panel);
}

fn pack_k_contiguous_scalar(x: &Lines<'_>, at: PanelAt, panel: &mut [MaybeUninit<u32>]) {
    let PanelAt {
        k,
        width,
        first,
        lines,
    } = at;
    let k_pairs = k.div_ceil(2);
    for kp0 in (0..k_pairs).step_by(PACK_PAIRS) {
        let kp1 = (kp0 + PACK_PAIRS).min(k_pairs);
        for l in 0..lines {
            let start = x.offset + (first + l) * x.line_stride;
            let line = &x.data[start + 2 * kp0..start + (2 * kp1).min(k)];
            let out = &mut panel[kp0 * width + l..];
            let pairs = line.chunks_exact(2);
            let odd = pairs.remainder().first().map(|&lo| lo as u32);
            let full = pairs.len();
            for (w, pair) in out.iter_mut().step_by(width).zip(pairs) {
                w.write(pair[0] as u32 | ((pair[1] as u32) << 16));
            }
            if let Some(lo) = odd {
                out[full * width].write(lo);
            }
        }
    }
}

/// [`pack_k_contiguous_scalar`] 16 lines x 16 pairs at a time: each line's block is one masked
/// load (its 32 bf16 values are the 16 pair words in order; an odd K's missing half loads as
/// zero), the 16 x 16 words are transposed in registers, and each pair's words for the group's
/// lines are one masked store into the panel.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_k_contiguous_avx512(x: &Lines<'_>, at: PanelAt, panel: &mut [MaybeUninit<u32>]) {
    let PanelAt {
        k,
        width,
        first,
        lines,
    } = at;
    use std::arch::x86_64::*;
    const _: () = assert!(PACK_PAIRS == 16, "the register transpose is 16 x 16 words");
    let k_pairs = k.div_ceil(2);
    for kp0 in (0..k_pairs).step_by(PACK_PAIRS) {
        let pairs = PACK_PAIRS.min(k_pairs - kp0);
        let halves = (k - 2 * kp0).min(2 * PACK_PAIRS);
        let load_mask: __mmask32 = if halves == 32 {
            u32::MAX
        } else {
            (1u32 << halves) - 1
        };
        for l0 in (0..lines).step_by(16) {
            let group = 16.min(lines - l0);
            let mut rows = [_mm512_setzero_si512(); 16];
            for (i, row) in rows.iter_mut().enumerate().take(group) {
                let start = x.offset + (first + l0 + i) * x.line_stride + 2 * kp0;
                let values = &x.data[start..start + halves];
                // SAFETY: the mask covers exactly the `halves` values of `values`.
                *row = unsafe { _mm512_maskz_loadu_epi16(load_mask, values.as_ptr().cast()) };
            }
            let columns = transpose_16x16(rows);
            let store_mask: __mmask16 = if group == 16 {
                u16::MAX
            } else {
                (1u16 << group) - 1
            };
            for (j, column) in columns.iter().enumerate().take(pairs) {
                let words = &mut panel[(kp0 + j) * width + l0..][..group];
                // SAFETY: the mask covers exactly the `group` words of `words`.
                unsafe { _mm512_mask_storeu_epi32(words.as_mut_ptr().cast(), store_mask, *column) };
            }
        }
    }
}

/// `out[j]` lane `i` = `rows[i]` lane `j` for 16 vectors of 16 32-bit words: pairs of rows
/// interleaved by 32 then 64 bits (4 x 4 blocks inside each 128-bit lane), then the 128-bit
/// lanes gathered across vectors in two rounds of `shuffle_i32x4`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) fn transpose_16x16(
    r: [std::arch::x86_64::__m512i; 16],
) -> [std::arch::x86_64::__m512i; 16] {
    use std::arch::x86_64::*;
    // t[2i] lane L: (r[2i][4L], r[2i+1][4L], r[2i][4L+1], r[2i+1][4L+1]); t[2i+1] the next two.
    let t: [__m512i; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    // u[4g + c] lane L: rows 4g..4g+4 of column 4L + c.
    let u: [__m512i; 16] = std::array::from_fn(|i| {
        let (g, c) = (i / 4, i % 4);
        let (a, b) = (t[4 * g + c / 2], t[4 * g + 2 + c / 2]);
        if c % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    // For column c: lanes 0 and 2 (even) or 1 and 3 (odd) of rows 0-3 and 4-7, and of 8-11
    // and 12-15.
    let mut out = [_mm512_setzero_si512(); 16];
    for c in 0..4 {
        let low_even = _mm512_shuffle_i32x4::<0x88>(u[c], u[4 + c]);
        let low_odd = _mm512_shuffle_i32x4::<0xdd>(u[c], u[4 + c]);
        let high_even = _mm512_shuffle_i32x4::<0x88>(u[8 + c], u[12 + c]);
        let high_odd = _mm512_shuffle_i32x4::<0xdd>(u[8 + c], u[12 + c]);
        out[c] = _mm512_shuffle_i32x4::<0x88>(low_even, high_even);
        out[8 + c] = _mm512_shuffle_i32x4::<0xdd>(low_even, high_even);
        out[4 + c] = _mm512_shuffle_i32x4::<0x88>(low_odd, high_odd);
        out[12 + c] = _mm512_shuffle_i32x4::<0xdd>(low_odd, high_odd);
    }
    out
}

/// `a @ b` as a row-major f32 `[a.rows, b.cols]`. Panics unless [`available`] and
/// `a.cols == b.rows` (the caller checks both).
pub fn gemm(a: Operand<'_>, b: Operand<'_>) -> Vec<f32> {
    assert_eq!(a.cols, b.rows, "bf16 GEMM: inner dimensions differ");
    let (n, k) = (b.cols, a.cols);
    // B: panel q, pair kp, column c -> word ((q * k_pairs) + kp) * NR + c.
    let packed = Packed {
        words: pack(&b.lines(b.col_stride, b.row_stride, n), k, NR),
        k_pairs: k.div_ceil(2),
    };
    gemm_panels(a, n, &packed)
}

/// Where the micro-kernels' B panels come from: `[k, n]` in panels of [`NR`] columns, each a
/// run of K-pair words (pair `kp`, column `c` at `kp * NR + c`; zero past the last column).
pub trait PanelSource: Sync {
    /// Whether each block is made anew when asked for (decoded), so that it is asked for once
    /// per product ([`gemm_panels`] then gives one task all of A's rows) rather than read from
    /// memory made once.
    const MADE_PER_BLOCK: bool;

    /// Pairs `kp0..kp0 + kc` of panel `q`: `kc * NR` words, a slice of the source's own or of
    /// `scratch` (room for a whole K block, 192 pairs of `NR` words, where
    /// [`Self::MADE_PER_BLOCK`]; else empty).
    fn block<'s>(&'s self, q: usize, kp0: usize, kc: usize, scratch: &'s mut [u32]) -> &'s [u32];
}

/// B packed ahead, whole ([`pack`]'s layout).
struct Packed {
    words: Vec<u32>,
    k_pairs: usize,
}

impl PanelSource for Packed {
    const MADE_PER_BLOCK: bool = false;

    fn block<'s>(&'s self, q: usize, kp0: usize, kc: usize, _: &'s mut [u32]) -> &'s [u32] {
        &self.words[(q * self.k_pairs + kp0) * NR..][..kc * NR]
    }
}

/// A pointer to C that tasks writing disjoint tiles share.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: each task writes only its own tiles of C (disjoint rows or columns, see
// `gemm_panels`), and C outlives the parallel loop.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The pointer, through the whole value: a closure naming `.0` would capture the bare
    /// pointer, which is not `Sync`.
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// `a @ b` as a row-major f32 `[a.rows, n]`, B's blocks from `b`. Panics unless [`available`].
///
/// Tasks own a block of C's rows and a group of its column panels. Why columns too: at the few
/// rows of a mixture-of-experts expert (32 per expert on Qwen3-30B-A3B's layer at 512 tokens)
/// one block of rows was the whole product, so it ran on one thread. A source that decodes
/// ([`PanelSource::MADE_PER_BLOCK`]) gets one block of rows (every row panel reuses each B block
/// while it is in L1), and one column panel per task.
pub fn gemm_panels<S: PanelSource>(a: Operand<'_>, n: usize, b: &S) -> Vec<f32> {
    assert!(available(), "bf16 GEMM called on a CPU without AVX512-BF16");
    let (m, k) = (a.rows, a.cols);
    let k_pairs = k.div_ceil(2);
    let col_panels = n.div_ceil(NR);
    let mut out = vec![0.0f32; m * n];
    if m == 0 || n == 0 {
        return out;
    }
    // A: panel p, pair kp, row r -> word ((p * k_pairs) + kp) * MR + r.
    let packed_a = pack(&a.lines(a.row_stride, a.col_stride, m), k, MR);
    let row_panels = m.div_ceil(MR);
    let task_panels = if S::MADE_PER_BLOCK {
        row_panels
    } else {
        TASK_ROW_PANELS
    };
    let row_tasks = row_panels.div_ceil(task_panels);
    let group = if S::MADE_PER_BLOCK || row_tasks < 2 * rayon::current_num_threads() {
        1
    } else {
        TASK_COL_PANELS
    };
    let groups = col_panels.div_ceil(group);
    let c = SharedOut(out.as_mut_ptr());
    (0..row_tasks * groups).into_par_iter().for_each_init(
        // A packed-ahead source needs no scratch: none is zeroed for it.
        || vec![0u32; if S::MADE_PER_BLOCK { KC_PAIRS * NR } else { 0 }],
        |scratch, task| {
            let (t, g) = (task / groups, task % groups);
            let first_panel = t * task_panels;
            let panels_here = task_panels.min(row_panels - first_panel);
            let row0 = first_panel * MR;
            let rows_here = (panels_here * MR).min(m - row0);
            let (q0, q1) = (g * group, ((g + 1) * group).min(col_panels));
            for kp0 in (0..k_pairs).step_by(KC_PAIRS) {
                let kc = KC_PAIRS.min(k_pairs - kp0);
                for q in q0..q1 {
                    let b_block = b.block(q, kp0, kc, scratch);
                    for pi in 0..panels_here {
                        let p = first_panel + pi;
                        let a_block = &packed_a[(p * k_pairs + kp0) * MR..][..kc * MR];
                        let tile = Tile {
                            row0: row0 + pi * MR,
                            rows: MR.min(rows_here - pi * MR),
                            col0: q * NR,
                            cols: NR.min(n - q * NR),
                            accumulate: kp0 > 0,
                        };
                        // SAFETY: `available()` checked the CPU features above; the tile lies
                        // in C (`m` rows of `n`), and no other task writes it: tasks own
                        // disjoint (row block, column group) pairs.
                        unsafe { micro_kernel(a_block, b_block, kc, c.ptr(), n, tile) };
                    }
                }
            }
        },
    );
    out
}

/// Where a micro-tile lands in C.
#[derive(Clone, Copy)]
struct Tile {
    row0: usize,
    rows: usize,
    col0: usize,
    cols: usize,
    /// Add to C's values (a later K block) rather than overwrite them.
    accumulate: bool,
}

/// `C[tile] (+)= A_panel[.., kc pairs] @ B_panel[kc pairs, ..]` for one `MR x NR` tile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn micro_kernel(a: &[u32], b: &[u32], kc: usize, c: *mut f32, ldc: usize, tile: Tile) {
    use std::arch::x86_64::*;
    const V: usize = NR / LANES;
    // No closures in here: a closure does not inherit the function's target features, so its
    // intrinsics became out-of-line calls (15% of a bf16 step when the B loads were one).
    let mut acc = [[_mm512_setzero_ps(); V]; MR];
    if tile.accumulate {
        for (r, row) in acc.iter_mut().enumerate().take(tile.rows) {
            let base = (tile.row0 + r) * ldc + tile.col0;
            for (v, x) in row.iter_mut().enumerate() {
                if v * LANES < tile.cols {
                    // SAFETY: the mask keeps the load inside row `r`'s `tile.cols` columns.
                    *x = unsafe {
                        _mm512_maskz_loadu_ps(lane_mask(tile.cols, v), c.add(base + v * LANES))
                    };
                }
            }
        }
    }
    let (a, b) = (a.as_ptr(), b.as_ptr());
    for kp in 0..kc {
        // SAFETY: the blocks hold `kc * NR` and `kc * MR` words.
        let mut bv = [_mm512_setzero_si512(); V];
        for (v, x) in bv.iter_mut().enumerate() {
            *x = unsafe { _mm512_loadu_si512(b.add(kp * NR + v * LANES) as *const __m512i) };
        }
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: as above.
            let av: __m512bh = unsafe {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                    *a.add(kp * MR + r) as i32
                ))
            };
            for (x, &bv) in row.iter_mut().zip(&bv) {
                let bv = unsafe { std::mem::transmute::<__m512i, __m512bh>(bv) };
                *x = _mm512_dpbf16_ps(*x, av, bv);
            }
        }
    }
    for (r, row) in acc.iter().enumerate().take(tile.rows) {
        let base = (tile.row0 + r) * ldc + tile.col0;
        for (v, &x) in row.iter().enumerate() {
            if v * LANES < tile.cols {
                // SAFETY: the mask keeps the store inside row `r`'s `tile.cols` columns.
                unsafe {
                    _mm512_mask_storeu_ps(c.add(base + v * LANES), lane_mask(tile.cols, v), x)
                };
            }
        }
    }
}

/// The lanes of vector `v` that fall within a tile's `cols` columns.
#[inline(always)]
fn lane_mask(cols: usize, v: usize) -> u16 {
    let valid = cols.saturating_sub(v * LANES).min(LANES);
    if valid == LANES {
        0xffff
    } else {
        ((1u32 << valid) - 1) as u16
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn micro_kernel(_: &[u32], _: &[u32], _: usize, _: *mut f32, _: usize, _: Tile) {
    unreachable!("available() is false off x86_64")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(a: &Operand<'_>, b: &Operand<'_>) -> Vec<f64> {
        let mut out = vec![0.0; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                out[i * b.cols + j] = (0..a.cols)
                    .map(|k| {
                        f64::from(bf16::from_bits(a.bits(i, k) as u16).to_f32())
                            * f64::from(bf16::from_bits(b.bits(k, j) as u16).to_f32())
                    })
                    .sum();
            }
        }
        out
    }

    /// The register transpose packs the same words as the scalar loop: odd and even K, K
    /// blocks, groups of lines past 16, both panel widths.
    #[test]
    fn k_contiguous_packing_matches_the_scalar_loop() {
        let data: Vec<u16> = (0..40_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 16) as u16)
            .collect();
        for (k, lines, width) in [
            (1, 1, MR),
            (3, 6, MR),
            (33, 5, MR),
            (64, 64, NR),
            (95, 37, NR),
            (401, 19, NR),
        ] {
            let x = Lines {
                data: &data,
                offset: 3,
                count: lines,
                line_stride: k + 5,
                k_stride: 1,
            };
            let size = k.div_ceil(2) * width;
            let seven = MaybeUninit::new(7u32);
            let (mut scalar, mut fast) = (vec![seven; size], vec![seven; size]);
            let at = PanelAt {
                k,
                width,
                first: 0,
                lines: lines.min(width),
            };
            pack_k_contiguous_scalar(&x, at, &mut scalar);
            pack_k_contiguous(&x, at, &mut fast);
            // SAFETY: every word was initialised (to 7) before the packs wrote over it.
            let words = |v: Vec<MaybeUninit<u32>>| -> Vec<u32> {
                v.into_iter().map(|w| unsafe { w.assume_init() }).collect()
            };
            assert_eq!(
                words(scalar),
                words(fast),
                "k {k}, lines {lines}, width {width}"
            );
        }
    }

    /// The packed buffer is not zeroed before packing, so every word must be written: each
    /// layout (K contiguous, lines contiguous, neither), odd K, a short last panel, packed into
    /// memory the allocator has just had back full of ones, gives the words the layout defines.
    #[test]
    fn packing_writes_every_word_of_every_panel() {
        let data: Vec<u16> = (0..60_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 16) as u16)
            .collect();
        for (k, count, width) in [(33usize, 5usize, MR), (95, 37, NR), (64, 150, NR)] {
            let k_pairs = k.div_ceil(2);
            let len = count.div_ceil(width) * k_pairs * width;
            let strides = [(k + 5, 1), (1, count + 7), (2 * k + 1, 2)];
            for (line_stride, k_stride) in strides {
                let x = Lines {
                    data: &data,
                    offset: 3,
                    count,
                    line_stride,
                    k_stride,
                };
                let at = |l: usize, i: usize| -> u32 {
                    if i < k {
                        data[3 + l * line_stride + i * k_stride] as u32
                    } else {
                        0
                    }
                };
                let mut want = vec![0u32; len];
                for l in 0..count {
                    for kp in 0..k_pairs {
                        want[((l / width) * k_pairs + kp) * width + l % width] =
                            at(l, 2 * kp) | (at(l, 2 * kp + 1) << 16);
                    }
                }
                drop(std::hint::black_box(vec![u32::MAX; len]));
                let got = pack(&x, k, width);
                assert_eq!(
                    got, want,
                    "k {k}, lines {count}, strides {line_stride}/{k_stride}"
                );
            }
        }
    }

    /// Every edge: rows and columns past a panel, an odd K, K blocks; each operand stored with
    /// K contiguous, lines contiguous, or neither (every packing loop).
    #[test]
    fn products_match_an_f64_reference() {
        if !available() {
            return;
        }
        let mut s = 0x2545_f491u32;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            bf16::from_f32((s as f32 / u32::MAX as f32) * 2.0 - 1.0)
        };
        // An `[rows, cols]` operand stored as `layout` says, in a buffer of twice its size.
        #[derive(Clone, Copy, Debug)]
        enum Layout {
            RowMajor,
            ColMajor,
            /// Every other element of a row-major `[rows, 2 * cols]` buffer.
            Strided,
        }
        fn make(data: &[bf16], rows: usize, cols: usize, layout: Layout) -> Operand<'_> {
            let (row_stride, col_stride) = match layout {
                Layout::RowMajor => (cols, 1),
                Layout::ColMajor => (1, rows),
                Layout::Strided => (2 * cols, 2),
            };
            Operand {
                data,
                offset: 1,
                rows,
                cols,
                row_stride,
                col_stride,
            }
        }
        let layouts = [Layout::RowMajor, Layout::ColMajor, Layout::Strided];
        for (m, n, k) in [(1, 1, 1), (7, 65, 3), (13, 130, 401), (50, 200, 64)] {
            let a_data: Vec<bf16> = (0..2 * m * k + 1).map(|_| next()).collect();
            let b_data: Vec<bf16> = (0..2 * k * n + 1).map(|_| next()).collect();
            for la in layouts {
                for lb in layouts {
                    let a = make(&a_data, m, k, la);
                    let b = make(&b_data, k, n, lb);
                    let got = gemm(a, b);
                    let want = reference(&a, &b);
                    for (g, w) in got.iter().zip(&want) {
                        let what = format!("{m}x{n}x{k} {la:?} {lb:?}");
                        assert!(
                            ((*g as f64) - w).abs() <= 1e-6 * k as f64,
                            "{what}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }
}
