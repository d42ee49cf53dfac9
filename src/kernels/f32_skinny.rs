//! f32 products with a few rows, the weight read in place: a batch of decoding rows (GRPO's
//! completions, one token each), a short prompt, or the tokens one expert of a
//! mixture-of-experts layer gets, times each weight.
//!
//! Why: for a few rows the gemm crate first packs the weight (it multiplies the transposed
//! problem, whose left operand is the weight), writing a copy of every weight per product. A
//! GRPO step on SmolLM2-135M's shape sampling 8 completions spent 36% of its time in
//! `pack_lhs` (perf, BENCHMARKS.md "GRPO against TRL"). Here each weight line (a weight row, K
//! contiguous, as `x @ w.T` sees it) is dotted with the rows while it is in cache: the weight
//! is read once and never written. One row stays on gemm's own path (its gemv does not pack).
//!
//! Why tiles of two rows by four lines ([`simd::dot_2x4`]): a dot product per (row, line) pair
//! loads both operands for every multiply-add, so the load ports bound it; a tile loads six
//! vectors for eight multiply-adds. Its eight accumulators are named variables: as one array
//! LLVM kept them in memory and the kernel ran 3x slower than the plain dots. With the tiles,
//! GRPO's rollouts of 16 rows went from 127 to 201 tokens/s, and the path pays past 16 rows:
//! up to 64 it beats gemm's packed microkernel (forward passes, `tune bench --mode forward`:
//! SmolLM2-135M 1 x 32 tokens 0.168 -> 0.109 s, 1 x 48 0.205 -> 0.165 s, 1 x 64 0.220 ->
//! 0.222 s; Llama-3.2-1B 1 x 48 2.72 -> 1.24 s, 1 x 64 3.01 -> 1.59 s; the 128-expert
//! Qwen3-MoE layers 2.28 -> 1.46 s). At 96 and 128 rows gemm wins on SmolLM2-135M (0.259 s
//! against 0.333 at 96), so the path stops at 64.
//!
//! Values: f32 products summed in f32 (each dot in SIMD lanes, then the lanes), another order
//! than gemm's; the tests hold it to gemm's within 1e-5 relative, and the tiles to the plain
//! dot bit for bit.

use super::simd::{self, multiversion};

/// The fewest and the most activation rows this path takes.
pub const ROWS: std::ops::RangeInclusive<usize> = 2..=64;

/// `rows @ w.T` as a row-major `[m, n]`: `rows` holds `m` rows of `k` values (row-major), and
/// weight line `c` (of `n`) is `weights[first + c * stride..][..k]`. Panics when a line runs
/// past `weights`.
pub fn product(
    rows: &[f32],
    m: usize,
    k: usize,
    weights: &[f32],
    first: usize,
    stride: usize,
    n: usize,
) -> Vec<f32> {
    assert_eq!(
        rows.len(),
        m * k,
        "skinny product: the rows hold m * k values"
    );
    if n > 0 {
        let end = first + (n - 1) * stride + k;
        assert!(
            end <= weights.len(),
            "skinny product: the weight is out of bounds"
        );
    }
    super::bf16_gemv::by_columns(m, n, |first_column, out| {
        let start = first + first_column * stride;
        columns(rows, m, k, &weights[start..], stride, out);
    })
}

multiversion! {
    /// `out[c * m + r] = row r . line c` for the `out.len() / m` lines from `weights[0..]`:
    /// four lines against two rows at a time ([`simd::dot_2x4`]), the last odd row and
    /// the last lines (fewer than four) by [`simd::dot`]; the same sums either way.
    fn columns(rows: &[f32], m: usize, k: usize, weights: &[f32], stride: usize, out: &mut [f32]) {
        let lines = out.len() / m;
        let row = |r: usize| &rows[r * k..][..k];
        let line = |c: usize| &weights[c * stride..][..k];
        for c in (0..lines / 4 * 4).step_by(4) {
            let quad = [line(c), line(c + 1), line(c + 2), line(c + 3)];
            for r in (0..m / 2 * 2).step_by(2) {
                let sums = simd::dot_2x4(row(r), row(r + 1), quad);
                for (j, [s0, s1]) in (0..4).map(|j| [sums[0][j], sums[1][j]]).enumerate() {
                    out[(c + j) * m + r] = s0;
                    out[(c + j) * m + r + 1] = s1;
                }
            }
            if m % 2 == 1 {
                for (j, l) in quad.iter().enumerate() {
                    out[(c + j) * m + m - 1] = simd::dot(l, row(m - 1));
                }
            }
        }
        for c in lines / 4 * 4..lines {
            for r in 0..m {
                out[c * m + r] = simd::dot(line(c), row(r));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2001) as f32
                    / 1000.0
                    - 1.0
            })
            .collect()
    }

    #[test]
    fn a_few_rows_times_a_weight_read_in_place_is_the_product() {
        for (m, k, n, stride) in [
            (2, 5, 3, 5),
            (8, 576, 77, 576),
            (16, 33, 40, 40),
            (3, 64, 1, 70),
        ] {
            let rows = values(m * k, 1);
            let weights = values(stride * n + 9, 2);
            let first = 9;
            let got = product(&rows, m, k, &weights, first, stride, n);
            for r in 0..m {
                for c in 0..n {
                    let want: f64 = (0..k)
                        .map(|i| {
                            f64::from(rows[r * k + i]) * f64::from(weights[first + c * stride + i])
                        })
                        .sum();
                    let g = f64::from(got[r * n + c]);
                    assert!(
                        (g - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "m {m} k {k} ({r}, {c}): {g} vs {want}"
                    );
                }
            }
        }
    }

    /// The tiles (two rows by four lines), the odd last row and the last lines give every sum
    /// as one [`simd::dot`] of its row and line, bit for bit: tiling changes no value.
    #[test]
    fn tiled_sums_are_each_pairs_own_dot_product() {
        for (m, k, n) in [
            (2, 13, 4),
            (3, 576, 9),
            (5, 8, 7),
            (16, 64, 12),
            (7, 100, 1),
        ] {
            let rows = values(m * k, 3);
            let weights = values(k * n, 4);
            let got = product(&rows, m, k, &weights, 0, k, n);
            for r in 0..m {
                for c in 0..n {
                    let want = simd::dot(&weights[c * k..][..k], &rows[r * k..][..k]);
                    assert_eq!(
                        got[r * n + c].to_bits(),
                        want.to_bits(),
                        "m {m} k {k} ({r}, {c})"
                    );
                }
            }
        }
    }
}
