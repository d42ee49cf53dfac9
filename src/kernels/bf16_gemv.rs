//! bf16 products with a few rows, the weight read in place: decoding (one token's activations
//! times each weight, or a batch of completions' tokens), on any CPU.
//!
//! Why: a decoding step multiplies one row by every weight matrix, so it is bound by reading
//! the weights. The GEMM ([`super::bf16_gemm`]) packs its B operand first, which for one row
//! reads and writes every weight once more than the product itself; the widening path converts
//! the whole weight to f32 per product. Here each weight column (a weight row, K contiguous, as
//! `x @ w.T` sees it) is widened a chunk at a time in L1 and dotted with the few activation
//! rows: the weight is read once, at half fp32's bytes.
//!
//! Values: the activations are widened exactly, each product of two bf16 values is exact in
//! f32 and the sums are f32, as the other bf16 paths (one rounding by the caller).

use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::bf16::widen_bits;
use super::bf16_gemm::Operand;
use super::simd::{self, multiversion};

/// The most rows (activation rows) this path takes; more go to the GEMM.
///
/// Why 32: rows go through the native kernel four at a time, so the weight is read once per
/// four rows; against the packed bf16 GEMM (forward, `tune bench --mode forward --dtype bf16`,
/// batch 1) that wins up to 32 rows and then loses on small weights: SmolLM2-135M at 8 tokens
/// 0.060 -> 0.037 s, 16 0.071 -> 0.050 s, 32 0.097 -> 0.093 s, but 48 0.116 -> 0.137 s;
/// Llama-3.2-1B at 32 tokens 0.886 -> 0.491 s (at 48, 1.035 -> 0.754 s). It took 4 before.
pub const MAX_ROWS: usize = 32;
/// K values of a weight column widened at a time (4 KiB of f32, in L1).
const CHUNK: usize = 1024;
/// Output columns per parallel task, at least.
const TASK_COLS: usize = 32;

/// `a @ b` as a row-major f32 `[a.rows, b.cols]`, when `a` has at most [`MAX_ROWS`] rows and
/// `b`'s columns are contiguous along K (`b.row_stride == 1`: a transposed row-major weight);
/// else `None`. Panics unless `a.cols == b.rows`.
pub fn skinny(a: Operand<'_>, b: Operand<'_>) -> Option<Vec<f32>> {
    product(a, b, super::bf16_gemm::available())
}

/// [`skinny`] on the native kernel when `native` (the caller checked the CPU), else the
/// portable one.
fn product(a: Operand<'_>, b: Operand<'_>, native: bool) -> Option<Vec<f32>> {
    if a.rows == 0 || a.rows > MAX_ROWS || (b.row_stride != 1 && b.rows > 1) {
        return None;
    }
    assert_eq!(a.cols, b.rows, "bf16 product: inner dimensions differ");
    let (m, k, n) = (a.rows, a.cols, b.cols);
    // The activation rows, gathered once: `m * k` values, row-major.
    let rows: Vec<u16> = (0..m)
        .flat_map(|r| (0..k).map(move |c| (r, c)))
        .map(|(r, c)| a.data[a.offset + r * a.row_stride + c * a.col_stride].to_bits())
        .collect();
    let kernel = Kernel::new(&rows, native);
    let weights: &[u16] = b.data.reinterpret_cast();
    Some(by_columns(m, n, |first_column, out| {
        let columns = Columns {
            data: weights,
            first: b.offset + first_column * b.col_stride,
            stride: b.col_stride,
            k,
        };
        kernel.columns(m, columns, out);
    }))
}

/// The `[m, n]` row-major product from `fill(first_column, out)`, which writes the columns
/// from `first_column` on column-major (`out[c * m + r]`): tasks own whole columns while
/// computing, and the result is transposed at the end. A few tasks per thread: small weights
/// are a few microseconds of work in all.
pub(super) fn by_columns(
    m: usize,
    n: usize,
    fill: impl Fn(usize, &mut [f32]) + Sync + Send,
) -> Vec<f32> {
    let task_cols = TASK_COLS.max(n.div_ceil(4 * rayon::current_num_threads()));
    let mut by_column = vec![0.0f32; n * m];
    by_column
        .par_chunks_mut(task_cols * m)
        .enumerate()
        .for_each(|(t, out)| fill(t * task_cols, out));
    if m == 1 {
        return by_column;
    }
    let mut out = vec![0.0f32; m * n];
    let transpose = |(r, row): (usize, &mut [f32])| {
        for (v, column) in row.iter_mut().zip(by_column.chunks_exact(m)) {
            *v = column[r];
        }
    };
    // Why both: the transpose of a vocabulary's logits (16 rows of SmolLM2's 49 152) took a
    // tenth of the product on one core; a layer's few thousand values cost more to share out.
    if m * n >= PARALLEL_TRANSPOSE {
        out.par_chunks_mut(n).enumerate().for_each(transpose);
    } else {
        out.chunks_mut(n).enumerate().for_each(transpose);
    }
    out
}

/// Values from which [`by_columns`] transposes its result on every thread.
const PARALLEL_TRANSPOSE: usize = 1 << 16;

/// Weight lines `data[first + c * stride..][..k]` for `c` from 0: B's columns, K contiguous.
#[derive(Clone, Copy)]
struct Columns<'a> {
    data: &'a [u16],
    first: usize,
    stride: usize,
    k: usize,
}

impl Columns<'_> {
    /// Column `c`.
    fn line(&self, c: usize) -> &[u16] {
        &self.data[self.first + c * self.stride..][..self.k]
    }
}

/// The dot products, with the activation rows in the form each kernel reads.
enum Kernel<'a> {
    /// `vdpbf16ps` on the bf16 values (CPUs with AVX512-BF16).
    Native(&'a [u16]),
    /// Portable: weight chunks widened to f32 against the rows widened once.
    Widening(Vec<f32>),
}

impl<'a> Kernel<'a> {
    fn new(rows: &'a [u16], native: bool) -> Self {
        if native {
            Self::Native(rows)
        } else {
            Self::Widening(rows.iter().map(|&b| widen_bits(b)).collect())
        }
    }

    /// `out[c * m + r] = row r . columns.line(c)` for the `out.len() / m` columns.
    fn columns(&self, m: usize, columns: Columns<'_>, out: &mut [f32]) {
        let count = out.len() / m;
        let end = columns.first + count.saturating_sub(1) * columns.stride + columns.k;
        assert!(
            end <= columns.data.len(),
            "bf16 product: the weight operand is out of bounds"
        );
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Native(rows) => {
                // SAFETY: `available()` checked the CPU features; the assert above bounds every
                // column and the rows hold `m * k` values.
                unsafe { native::columns(rows, m, columns, out) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Self::Native(_) => unreachable!("the native kernel is chosen on x86_64 only"),
            Self::Widening(rows) => widening_columns(rows, m, columns, out),
        }
    }
}

multiversion! {
    /// [`Kernel::columns`], portable: each column widened [`CHUNK`] values at a time.
    fn widening_columns(rows: &[f32], m: usize, columns: Columns<'_>, out: &mut [f32]) {
        let k = columns.k;
        let mut widened = [0.0f32; CHUNK];
        for (c, sums) in out.chunks_exact_mut(m).enumerate() {
            let column = columns.line(c);
            for (i, chunk) in column.chunks(CHUNK).enumerate() {
                let w = &mut widened[..chunk.len()];
                for (d, &s) in w.iter_mut().zip(chunk) {
                    *d = widen_bits(s);
                }
                for (r, sum) in sums.iter_mut().enumerate() {
                    *sum += simd::dot(w, &rows[r * k + i * CHUNK..][..chunk.len()]);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod native {
    use std::arch::x86_64::*;

    use super::Columns;

    /// Columns per group: four weight lines share each activation load.
    const GROUP: usize = 4;

    /// [`super::Kernel::columns`] by `vdpbf16ps`: 32 values of K per instruction.
    ///
    /// # Safety
    /// The CPU has AVX512F, AVX512BW and AVX512-BF16; `rows` holds `m * k` values and every
    /// column of `columns` up to `out.len() / m` is inside its data.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn columns(rows: &[u16], m: usize, columns: Columns<'_>, out: &mut [f32]) {
        let Columns {
            data,
            first,
            stride,
            k,
        } = columns;
        let count = out.len() / m;
        let base = data.as_ptr();
        // Rows in blocks of up to four (the accumulators of four rows by four columns fill
        // the registers), each block's sums scattered into `out`'s column-major layout.
        let mut sums = [0.0f32; GROUP * 4];
        let mut c = 0;
        while c < count {
            let group = GROUP.min(count - c);
            // SAFETY: the caller bounds columns `c .. c + group`.
            let column = |j: usize| unsafe { base.add(first + (c + j) * stride) };
            for first_row in (0..m).step_by(4) {
                let block = 4.min(m - first_row);
                let rows = &rows[first_row * k..(first_row + block) * k];
                let sums = &mut sums[..group * block];
                unsafe {
                    if group == GROUP {
                        let cols = [column(0), column(1), column(2), column(3)];
                        match block {
                            1 => dots::<1, GROUP>(rows, k, cols, sums),
                            2 => dots::<2, GROUP>(rows, k, cols, sums),
                            3 => dots::<3, GROUP>(rows, k, cols, sums),
                            _ => dots::<4, GROUP>(rows, k, cols, sums),
                        }
                    } else {
                        for j in 0..group {
                            let sums = &mut sums[j * block..(j + 1) * block];
                            match block {
                                1 => dots::<1, 1>(rows, k, [column(j)], sums),
                                2 => dots::<2, 1>(rows, k, [column(j)], sums),
                                3 => dots::<3, 1>(rows, k, [column(j)], sums),
                                _ => dots::<4, 1>(rows, k, [column(j)], sums),
                            }
                        }
                    }
                }
                for j in 0..group {
                    for r in 0..block {
                        out[(c + j) * m + first_row + r] = sums[j * block + r];
                    }
                }
            }
            c += group;
        }
    }

    /// `out[j * M + r] = rows[r] . cols[j]` over `k` values; the accumulators stay in registers
    /// (`M * G <= 16`). The last block of K is read under a mask.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn dots<const M: usize, const G: usize>(
        rows: &[u16],
        k: usize,
        cols: [*const u16; G],
        out: &mut [f32],
    ) {
        let mut acc = [[_mm512_setzero_ps(); G]; M];
        let mut i = 0;
        while i < k {
            let mask: __mmask32 = if k - i >= 32 {
                !0
            } else {
                (1u32 << (k - i)) - 1
            };
            let mut w = [_mm512_setzero_si512(); G];
            for (x, &col) in w.iter_mut().zip(&cols) {
                // SAFETY: the mask keeps the load inside the column's `k` values.
                *x = unsafe { _mm512_maskz_loadu_epi16(mask, col.add(i) as *const i16) };
            }
            for (r, sums) in acc.iter_mut().enumerate() {
                // SAFETY: row `r` holds `k` values from `r * k`; the mask bounds the load.
                let a = unsafe {
                    _mm512_maskz_loadu_epi16(mask, rows.as_ptr().add(r * k + i) as *const i16)
                };
                let a = unsafe { std::mem::transmute::<__m512i, __m512bh>(a) };
                for (s, &w) in sums.iter_mut().zip(&w) {
                    let w = unsafe { std::mem::transmute::<__m512i, __m512bh>(w) };
                    *s = _mm512_dpbf16_ps(*s, a, w);
                }
            }
            i += 32;
        }
        for (r, sums) in acc.iter().enumerate() {
            for (j, &s) in sums.iter().enumerate() {
                out[j * M + r] = _mm512_reduce_add_ps(s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::bf16;

    use super::*;

    fn values(count: usize, seed: u32) -> Vec<bf16> {
        (0..count)
            .map(|i| {
                bf16::from_f32(
                    (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000) as f32 / 250.0 - 2.0,
                )
            })
            .collect()
    }

    /// Rows 1 to `MAX_ROWS` (blocks of four and a partial block) against an f64 reference on
    /// both kernels (the native one where the CPU has it), K longer than a chunk and not a
    /// multiple of 32, a column count that leaves a partial group, a transposed weight with an
    /// offset, and strided activations; wider rows and a weight that is not K-contiguous are
    /// refused.
    #[test]
    fn few_rows_times_a_transposed_weight_match_an_f64_reference() {
        for native in [false, crate::kernels::bf16_gemm::available()] {
            check(native);
        }
    }

    fn check(native: bool) {
        let (k, n) = (CHUNK + 37, 70);
        let weight = values(3 + n * k, 7); // [n, k] row-major after a 3-value offset
        let b = Operand {
            data: &weight,
            offset: 3,
            rows: k,
            cols: n,
            row_stride: 1,
            col_stride: k,
        };
        for m in 1..=MAX_ROWS {
            let act = values(k * m, 11); // stored [k, m]: a transposed view of [m, k]
            let a = Operand {
                data: &act,
                offset: 0,
                rows: m,
                cols: k,
                row_stride: 1,
                col_stride: m,
            };
            let got = product(a, b, native).expect("few rows take this path");
            for r in 0..m {
                for c in 0..n {
                    let want: f64 = (0..k)
                        .map(|i| act[i * m + r].to_f64() * weight[3 + c * k + i].to_f64())
                        .sum();
                    let scale: f64 = (0..k)
                        .map(|i| (act[i * m + r].to_f64() * weight[3 + c * k + i].to_f64()).abs())
                        .sum();
                    let g = f64::from(got[r * n + c]);
                    assert!(
                        (g - want).abs() <= 1e-6 * scale,
                        "native={native} m={m} ({r}, {c}): {g} vs {want}"
                    );
                }
            }
        }
        let act = values(k * (MAX_ROWS + 1), 3);
        let a = Operand {
            data: &act,
            offset: 0,
            rows: MAX_ROWS + 1,
            cols: k,
            row_stride: k,
            col_stride: 1,
        };
        assert!(product(a, b, native).is_none());
        let row_major = Operand {
            row_stride: n,
            col_stride: 1,
            ..b
        };
        let one = Operand { rows: 1, ..a };
        assert!(product(one, row_major, native).is_none());
    }
}
