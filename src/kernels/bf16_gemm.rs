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
use rayon::prelude::*;

/// Rows per A panel (and per micro-tile).
const MR: usize = 6;
/// Columns per B panel: four vectors of 16 f32 lanes.
const NR: usize = 64;
const LANES: usize = 16;
/// K-pairs per cache block of the inner loop.
const KC_PAIRS: usize = 192;
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
    #[inline(always)]
    fn bits(&self, r: usize, c: usize) -> u32 {
        self.data[self.offset + r * self.row_stride + c * self.col_stride].to_bits() as u32
    }

    /// The word `(x[r][k], x[r][k + 1])` for a K-pair along this operand's columns (`along_cols`)
    /// or rows, zero past the end.
    #[inline(always)]
    fn pair(&self, r: usize, k: usize, along_cols: bool, k_len: usize) -> u32 {
        let at = |k: usize| {
            if k >= k_len {
                0
            } else if along_cols {
                self.bits(r, k)
            } else {
                self.bits(k, r)
            }
        };
        at(k) | (at(k + 1) << 16)
    }
}

/// `a @ b` as a row-major f32 `[a.rows, b.cols]`. Panics unless [`available`] and
/// `a.cols == b.rows` (the caller checks both).
pub fn gemm(a: Operand<'_>, b: Operand<'_>) -> Vec<f32> {
    assert!(available(), "bf16 GEMM called on a CPU without AVX512-BF16");
    assert_eq!(a.cols, b.rows, "bf16 GEMM: inner dimensions differ");
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let k_pairs = k.div_ceil(2);
    let row_panels = m.div_ceil(MR);
    let col_panels = n.div_ceil(NR);

    // A: panel p, pair kp, row r -> word ((p * k_pairs) + kp) * MR + r.
    let mut packed_a = vec![0u32; row_panels * k_pairs * MR];
    packed_a
        .par_chunks_mut(k_pairs * MR)
        .enumerate()
        .for_each(|(p, panel)| {
            for (kp, words) in panel.chunks_exact_mut(MR).enumerate() {
                for (r, w) in words.iter_mut().enumerate() {
                    let row = p * MR + r;
                    if row < m {
                        *w = a.pair(row, 2 * kp, true, k);
                    }
                }
            }
        });
    // B: panel q, pair kp, column c -> word ((q * k_pairs) + kp) * NR + c.
    let mut packed_b = vec![0u32; col_panels * k_pairs * NR];
    packed_b
        .par_chunks_mut(k_pairs * NR)
        .enumerate()
        .for_each(|(q, panel)| {
            for (kp, words) in panel.chunks_exact_mut(NR).enumerate() {
                for (c, w) in words.iter_mut().enumerate() {
                    let col = q * NR + c;
                    if col < n {
                        // B's pair runs along its rows (K) for column `col`.
                        *w = b.pair(col, 2 * kp, false, k);
                    }
                }
            }
        });

    let mut out = vec![0.0f32; m * n];
    if m == 0 || n == 0 {
        return out;
    }
    // Tasks own whole row blocks of C (disjoint rows), each sweeping its column blocks.
    let task_rows = TASK_ROW_PANELS * MR;
    out.par_chunks_mut(task_rows * n)
        .enumerate()
        .for_each(|(t, c_rows)| {
            let rows_here = c_rows.len() / n;
            let first_panel = t * TASK_ROW_PANELS;
            let panels_here = rows_here.div_ceil(MR);
            for q0 in (0..col_panels).step_by(TASK_COL_PANELS) {
                let q1 = (q0 + TASK_COL_PANELS).min(col_panels);
                for kp0 in (0..k_pairs).step_by(KC_PAIRS) {
                    let kc = KC_PAIRS.min(k_pairs - kp0);
                    for q in q0..q1 {
                        let b_block = &packed_b[(q * k_pairs + kp0) * NR..][..kc * NR];
                        for pi in 0..panels_here {
                            let p = first_panel + pi;
                            let a_block = &packed_a[(p * k_pairs + kp0) * MR..][..kc * MR];
                            let tile = Tile {
                                row0: pi * MR,
                                rows: MR.min(rows_here - pi * MR),
                                col0: q * NR,
                                cols: NR.min(n - q * NR),
                                accumulate: kp0 > 0,
                            };
                            // SAFETY: `available()` checked the CPU features above.
                            unsafe { micro_kernel(a_block, b_block, kc, c_rows, n, tile) };
                        }
                    }
                }
            }
        });
    out
}

/// Where a micro-tile lands in the task's rows of C.
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
unsafe fn micro_kernel(a: &[u32], b: &[u32], kc: usize, c: &mut [f32], ldc: usize, tile: Tile) {
    use std::arch::x86_64::*;
    const V: usize = NR / LANES;
    let mut acc = [[_mm512_setzero_ps(); V]; MR];
    let mask = |v: usize| -> __mmask16 {
        let valid = tile.cols.saturating_sub(v * LANES).min(LANES);
        if valid == LANES {
            0xffff
        } else {
            ((1u32 << valid) - 1) as __mmask16
        }
    };
    if tile.accumulate {
        for (r, row) in acc.iter_mut().enumerate().take(tile.rows) {
            let base = (tile.row0 + r) * ldc + tile.col0;
            for (v, x) in row.iter_mut().enumerate() {
                if v * LANES < tile.cols {
                    // SAFETY: the mask keeps the load inside row `r`'s `tile.cols` columns.
                    *x = unsafe {
                        _mm512_maskz_loadu_ps(mask(v), c.as_ptr().add(base + v * LANES))
                    };
                }
            }
        }
    }
    let (a, b) = (a.as_ptr(), b.as_ptr());
    for kp in 0..kc {
        // SAFETY: the blocks hold `kc * NR` and `kc * MR` words.
        let bv: [__m512bh; V] = std::array::from_fn(|v| unsafe {
            std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                b.add(kp * NR + v * LANES) as *const __m512i,
            ))
        });
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: as above.
            let av: __m512bh = unsafe {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                    *a.add(kp * MR + r) as i32,
                ))
            };
            for (x, &bv) in row.iter_mut().zip(&bv) {
                *x = _mm512_dpbf16_ps(*x, av, bv);
            }
        }
    }
    for (r, row) in acc.iter().enumerate().take(tile.rows) {
        let base = (tile.row0 + r) * ldc + tile.col0;
        for (v, &x) in row.iter().enumerate() {
            if v * LANES < tile.cols {
                // SAFETY: the mask keeps the store inside row `r`'s `tile.cols` columns.
                unsafe { _mm512_mask_storeu_ps(c.as_mut_ptr().add(base + v * LANES), mask(v), x) };
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn micro_kernel(_: &[u32], _: &[u32], _: usize, _: &mut [f32], _: usize, _: Tile) {
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

    /// Every edge: rows and columns past a panel, an odd K, K blocks, strided operands.
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
        for (m, n, k) in [(1, 1, 1), (7, 65, 3), (13, 130, 401), (50, 200, 64)] {
            let a_data: Vec<bf16> = (0..m * k).map(|_| next()).collect();
            let b_data: Vec<bf16> = (0..k * n).map(|_| next()).collect();
            let a = Operand { data: &a_data, offset: 0, rows: m, cols: k, row_stride: k, col_stride: 1 };
            // B stored transposed (`[n, k]` row-major), as a linear layer's weight is.
            let b = Operand { data: &b_data, offset: 0, rows: k, cols: n, row_stride: 1, col_stride: k };
            let got = gemm(a, b);
            let want = reference(&a, &b);
            for (g, w) in got.iter().zip(&want) {
                assert!(((*g as f64) - w).abs() <= 1e-6 * k as f64, "{m}x{n}x{k}: {g} vs {w}");
            }
        }
    }
}
