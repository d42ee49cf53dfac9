//! f32 products with a few rows, the weight read in place: a batch of decoding rows (GRPO's
//! group of completions, one token each) times each weight.
//!
//! Why: for a few rows the gemm crate first packs the weight (it multiplies the transposed
//! problem, whose left operand is the weight), writing a copy of every weight per product. A
//! GRPO step on SmolLM2-135M's shape sampling 8 completions spent 36% of its time in
//! `pack_lhs` (perf, BENCHMARKS.md "GRPO against TRL"). Here each weight line (a weight row, K
//! contiguous, as `x @ w.T` sees it) is dotted with the few activation rows while it is in
//! cache: the weight is read once and never written. One row stays on gemm's own path (its
//! gemv does not pack).
//!
//! Values: f32 products summed in f32 (each dot in SIMD lanes, then the lanes), another order
//! than gemm's; the tests hold it to gemm's within 1e-5 relative.

use super::simd::{self, multiversion};

/// The fewest and the most activation rows this path takes.
pub const ROWS: std::ops::RangeInclusive<usize> = 2..=16;

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
    /// `out[c * m + r] = row r . line c` for the `out.len() / m` lines from `weights[0..]`.
    fn columns(rows: &[f32], m: usize, k: usize, weights: &[f32], stride: usize, out: &mut [f32]) {
        for (c, sums) in out.chunks_exact_mut(m).enumerate() {
            let line = &weights[c * stride..][..k];
            for (r, sum) in sums.iter_mut().enumerate() {
                *sum = simd::dot(line, &rows[r * k..][..k]);
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
}
