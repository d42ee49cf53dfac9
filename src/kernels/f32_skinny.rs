//! f32 products with a few rows, the weight read in place: a batch of decoding rows (GRPO's
//! completions, one token each), a short prompt, or the tokens one expert of a
//! mixture-of-experts layer gets, times each weight.
//!
//! Why: for a few rows the gemm crate first packs the weight (it multiplies the transposed
//! problem, whose left operand is the weight), writing a copy of every weight per product. A
//! GRPO step on SmolLM2-135M's shape sampling 8 completions spent 36% of its time in
//! `pack_lhs` (perf, BENCHMARKS.md "GRPO against TRL"). Here each weight line (a weight row, K
//! contiguous, as `x @ w.T` sees it) is dotted with the rows while it is in cache: the weight
//! is read once and never written. One row stays on gemm's own path (its gemv does not pack)
//! below 128 KB of weight; from there it takes this one, whose columns are split over rayon's
//! threads where the gemv runs on one (`matmul::ONE_ROW_MIN_WEIGHT`).
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
//! Why AVX-512 tiles of four rows by four lines ([`avx512`]) where the CPU has AVX-512: 32
//! vector registers hold sixteen accumulators, so every loaded vector serves four products (a
//! weight line's served two in the AVX2 tiles), and each instruction does twice the lanes. On the two cores of the
//! machine BENCHMARKS.md measures on (AMD EPYC, AVX-512): 16 rows against SmolLM2-135M's
//! weights (30 layers' worth, read from memory) 61-71 -> 83-106 GFLOP/s per product shape,
//! 3-6 rows (an expert's tokens) 17-35 -> 21-53; GRPO's rollouts (16 rows) 255 -> 290
//! tokens/s; forward passes of SmolLM2-135M 1 x 16 tokens 262 -> 310 tokens/s, 1 x 64 369 ->
//! 433; the 128-expert Qwen3-MoE layers 1.43-1.54 -> 1.35-1.43 s. Past 64 rows it is within
//! this machine's noise of gemm (1 x 96: +3-9%, 1 x 128: -3 to +4%), so the path still stops
//! at 64.
//!
//! Why one transposing tree for a tile's sixteen lane sums ([`avx512`]'s `lane_sums`), the
//! next four weight lines prefetched while the first rows pass over the current ones, and the
//! result's transpose on every thread for a vocabulary's width (`bf16_gemv::by_columns`):
//! sixteen separate reductions were a fifth of a tile's instructions over K = 576, and the
//! transpose of 16 rows of SmolLM2's 49 152 logits ran on one core. Every product of one
//! decoding step of 16 rows on SmolLM2-135M (its 538 MB of weights read from memory, best of
//! five): 49.5 -> 42 ms, the vocabulary's projection 11.3 -> 8.3 ms; with one layer's weights
//! in cache the same products take 32.5 ms, so what is left is reading the weights.
//!
//! Values: f32 products summed in f32 (each dot in SIMD lanes, then the lanes), another order
//! than gemm's; the tests hold it to gemm's within 1e-5 relative. Within a path every
//! (row, line) sum is computed the same way whatever tile it falls in, so a row's values do not
//! depend on the other rows of the product: the tests hold the tiles to the one-pair sum bit
//! for bit.

use super::simd::{self, multiversion};

/// The fewest and the most activation rows this path takes (and one row against a weight of
/// 128 KB or more, `matmul::ONE_ROW_MIN_WEIGHT`).
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
        on_best_path(rows, m, k, &weights[start..], stride, out);
    })
}

/// Weight lines decoded at a time by [`product_decoded`]: 16 lines of a 2048-wide weight are
/// 128 KB, which stays in L2 while the rows pass over them.
const DECODED_LINES: usize = 16;

/// [`product`] over a weight stored in another form (NF4): `decode(c, line)` writes line `c`'s
/// `k` values, and each task decodes its lines a few at a time into a buffer that stays in
/// cache, so the float weight is never written whole nor read back from memory. The sums are
/// [`product`]'s over the decoded lines, bit for bit.
pub fn product_decoded(
    rows: &[f32],
    m: usize,
    k: usize,
    n: usize,
    decode: impl Fn(usize, &mut [f32]) + Sync,
) -> Vec<f32> {
    assert_eq!(
        rows.len(),
        m * k,
        "skinny product: the rows hold m * k values"
    );
    super::bf16_gemv::by_columns(m, n, |first_column, out| {
        let mut lines = vec![0.0f32; DECODED_LINES.min(out.len() / m.max(1)) * k];
        for (i, out) in out.chunks_mut(DECODED_LINES * m).enumerate() {
            let first = first_column + i * DECODED_LINES;
            let count = out.len() / m;
            for (j, line) in lines.chunks_exact_mut(k).take(count).enumerate() {
                decode(first + j, line);
            }
            on_best_path(rows, m, k, &lines, k, out);
        }
    })
}

/// [`avx512::columns`] when the CPU has AVX-512, else [`columns`] (AVX2 or the baseline).
fn on_best_path(rows: &[f32], m: usize, k: usize, weights: &[f32], stride: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the running CPU has AVX-512F, which `avx512::columns` is compiled for.
        unsafe { avx512::columns(rows, m, k, weights, stride, out) };
        return;
    }
    columns(rows, m, k, weights, stride, out);
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

/// [`columns`] in tiles of four rows by four lines of AVX-512 vectors.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        __m512, _MM_HINT_T0, _mm_prefetch, _mm512_add_ps, _mm512_castpd_ps, _mm512_castps_pd,
        _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_permute_ps, _mm512_setzero_ps,
        _mm512_shuffle_f32x4, _mm512_storeu_ps, _mm512_unpackhi_pd, _mm512_unpackhi_ps,
        _mm512_unpacklo_pd, _mm512_unpacklo_ps,
    };

    /// Lanes of one vector.
    const LANES: usize = 16;

    /// `out[r][j] = rows[r] . lines[j]`, each the same way: a fused multiply-add per vector of
    /// 16 lanes in order, the lanes added by `_mm512_reduce_add_ps`, then the last `k % 16`
    /// products one at a time. Every slice holds `k` values.
    #[inline(always)]
    fn tile<const R: usize, const L: usize>(
        rows: [&[f32]; R],
        lines: [&[f32]; L],
        next: Option<[&[f32]; L]>,
    ) -> [[f32; L]; R] {
        let k = lines[0].len();
        assert!(
            rows.iter().chain(&lines).all(|x| x.len() == k),
            "skinny tile: every row and line holds k values"
        );
        let whole = k / LANES * LANES;
        // SAFETY: every load reads `LANES` values from `i < whole <= k`, inside each slice
        // (all of length `k`, asserted above); the intrinsics need AVX-512F, which every
        // caller is compiled for.
        unsafe {
            let mut acc: [[__m512; L]; R] = [[_mm512_setzero_ps(); L]; R];
            for i in (0..whole).step_by(LANES) {
                let mut y: [__m512; L] = [_mm512_setzero_ps(); L];
                for j in 0..L {
                    y[j] = _mm512_loadu_ps(lines[j].as_ptr().add(i));
                }
                if let Some(next) = next {
                    for line in next {
                        _mm_prefetch::<_MM_HINT_T0>(
                            line.as_ptr().add(i.min(line.len() - 1)).cast(),
                        );
                    }
                }
                for r in 0..R {
                    let x = _mm512_loadu_ps(rows[r].as_ptr().add(i));
                    for j in 0..L {
                        acc[r][j] = _mm512_fmadd_ps(x, y[j], acc[r][j]);
                    }
                }
            }
            let mut sums = [0.0f32; LANES];
            if R * L == LANES {
                let mut all = [_mm512_setzero_ps(); LANES];
                for r in 0..R {
                    all[r * L..(r + 1) * L].copy_from_slice(&acc[r]);
                }
                _mm512_storeu_ps(sums.as_mut_ptr(), lane_sums(all));
            } else {
                for r in 0..R {
                    for j in 0..L {
                        sums[r * L + j] = lane_sum(acc[r][j]);
                    }
                }
            }
            let mut out = [[0.0f32; L]; R];
            for r in 0..R {
                for j in 0..L {
                    let mut sum = sums[r * L + j];
                    for t in whole..k {
                        sum = rows[r][t].mul_add(lines[j][t], sum);
                    }
                    out[r][j] = sum;
                }
            }
            out
        }
    }

    /// The sum of `v`'s lanes, in [`lane_sums`]' order: within each 128-bit quarter
    /// `(l0 + l2) + (l1 + l3)`, then `(q0 + q1) + (q2 + q3)`.
    #[inline(always)]
    unsafe fn lane_sum(v: __m512) -> f32 {
        // SAFETY: register-only AVX-512F intrinsics (the caller is compiled for AVX-512F).
        unsafe {
            let v = _mm512_add_ps(v, _mm512_permute_ps::<0b01_00_11_10>(v));
            let v = _mm512_add_ps(v, _mm512_permute_ps::<0b10_11_00_01>(v));
            let v = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0b10_11_00_01>(v, v));
            let v = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0b01_00_11_10>(v, v));
            let mut lanes = [0.0f32; LANES];
            _mm512_storeu_ps(lanes.as_mut_ptr(), v);
            lanes[0]
        }
    }

    /// Lane `i` of the result is the sum of `v[i]`'s lanes, each added as [`lane_sum`] adds
    /// them (bit for bit), by a transposing tree: 45 instructions where sixteen separate
    /// reductions take about 130. Why: in a tile of four rows by four lines over SmolLM2's
    /// K = 576, the reductions were a fifth of the instructions.
    #[inline(always)]
    unsafe fn lane_sums(v: [__m512; LANES]) -> __m512 {
        // SAFETY: register-only AVX-512F intrinsics (the caller is compiled for AVX-512F).
        unsafe {
            // Pairs: each quarter holds (l0 + l2, l1 + l3) of both.
            let pairs: [__m512; 8] = std::array::from_fn(|i| {
                let (a, b) = (v[2 * i], v[2 * i + 1]);
                _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
            });
            // Fours: each quarter holds one partial sum of each of the four.
            let fours: [__m512; 4] = std::array::from_fn(|i| {
                let (a, b) = (
                    _mm512_castps_pd(pairs[2 * i]),
                    _mm512_castps_pd(pairs[2 * i + 1]),
                );
                _mm512_add_ps(
                    _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                    _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
                )
            });
            // Eights: quarters (q0 + q1) and (q2 + q3) of each of two fours.
            let eights: [__m512; 2] = std::array::from_fn(|i| {
                let (a, b) = (fours[2 * i], fours[2 * i + 1]);
                _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                    _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
                )
            });
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(eights[0], eights[1]),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(eights[0], eights[1]),
            )
        }
    }

    /// [`super::columns`]'s contract: `out[c * m + r] = row r . line c`; four lines against
    /// four rows at a time, then the last rows one at a time, then the last lines (fewer than
    /// four) four rows and then one row at a time.
    #[target_feature(enable = "avx512f")]
    pub(super) fn columns(
        rows: &[f32],
        m: usize,
        k: usize,
        weights: &[f32],
        stride: usize,
        out: &mut [f32],
    ) {
        let lines = out.len() / m;
        let row = |r: usize| &rows[r * k..][..k];
        let line = |c: usize| &weights[c * stride..][..k];
        let mut put = |c: usize, r: usize, sums: &[f32]| {
            for (j, &sum) in sums.iter().enumerate() {
                out[(c + j) * m + r] = sum;
            }
        };
        let quads = lines / 4 * 4;
        for c in (0..quads).step_by(4) {
            let quad = [line(c), line(c + 1), line(c + 2), line(c + 3)];
            let next =
                (c + 8 <= quads).then(|| [line(c + 4), line(c + 5), line(c + 6), line(c + 7)]);
            for r in (0..m / 4 * 4).step_by(4) {
                let sums = tile(
                    [row(r), row(r + 1), row(r + 2), row(r + 3)],
                    quad,
                    next.filter(|_| r == 0),
                );
                for (i, sums) in sums.iter().enumerate() {
                    put(c, r + i, sums);
                }
            }
            for r in m / 4 * 4..m {
                put(c, r, &tile([row(r)], quad, None)[0]);
            }
        }
        for c in quads..lines {
            for r in (0..m / 4 * 4).step_by(4) {
                let sums = tile(
                    [row(r), row(r + 1), row(r + 2), row(r + 3)],
                    [line(c)],
                    None,
                );
                for (i, sums) in sums.iter().enumerate() {
                    put(c, r + i, sums);
                }
            }
            for r in m / 4 * 4..m {
                put(c, r, &tile([row(r)], [line(c)], None)[0]);
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
    fn lines_decoded_a_few_at_a_time_give_the_product_over_the_decoded_weight_bit_for_bit() {
        // 150 lines: several tasks, each several chunks of decoded lines and a partial one.
        for (m, k, n) in [(5, 64, 150), (2, 128, 17), (64, 96, 40)] {
            let rows = values(m * k, 3);
            let weights = values(n * k, 4);
            let want = product(&rows, m, k, &weights, 0, k, n);
            let got = product_decoded(&rows, m, k, n, |c, line| {
                line.copy_from_slice(&weights[c * k..][..k])
            });
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "m {m} k {k} n {n}");
        }
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

    /// `columns`' contract (`out[c * m + r] = row r . line c`) as one function per path.
    type Path = fn(&[f32], usize, usize, &[f32], usize, &mut [f32]);

    /// Each path this CPU runs: AVX2 (or the baseline), and AVX-512 where it has it.
    fn paths() -> Vec<(&'static str, Path)> {
        let mut paths: Vec<(&'static str, Path)> = vec![("avx2", columns)];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above).
            paths.push(("avx512", |rows, m, k, w, stride, out| unsafe {
                avx512::columns(rows, m, k, w, stride, out)
            }));
        }
        paths
    }

    /// On every path, the tiles, the last rows and the last lines give every sum as the
    /// product of its row and line alone (one row, one line) gives it, bit for bit: tiling
    /// changes no value. The AVX2 path's sums are [`simd::dot`]'s.
    #[test]
    fn tiled_sums_are_each_pairs_own_sum() {
        for (name, path) in paths() {
            for (m, k, n) in [
                (2, 13, 4),
                (3, 576, 9),
                (5, 8, 7),
                (16, 64, 12),
                (7, 100, 1),
                (9, 40, 7),
                (4, 16, 4),
            ] {
                let rows = values(m * k, 3);
                let weights = values(k * n, 4);
                let mut got = vec![0.0f32; m * n];
                path(&rows, m, k, &weights, k, &mut got);
                for r in 0..m {
                    for c in 0..n {
                        let (row, line) = (&rows[r * k..][..k], &weights[c * k..][..k]);
                        let mut alone = [0.0f32];
                        path(row, 1, k, line, k, &mut alone);
                        let at = format!("{name}: m {m} k {k} ({r}, {c})");
                        assert_eq!(got[c * m + r].to_bits(), alone[0].to_bits(), "{at}");
                        if name == "avx2" {
                            assert_eq!(alone[0].to_bits(), simd::dot(line, row).to_bits(), "{at}");
                        }
                    }
                }
            }
        }
    }

    /// Every path computes the product (within f32 summation error of f64's).
    #[test]
    fn every_path_computes_the_product() {
        let (m, k, n) = (6, 333, 10);
        let rows = values(m * k, 5);
        let weights = values(k * n, 6);
        for (name, path) in paths() {
            let mut got = vec![0.0f32; m * n];
            path(&rows, m, k, &weights, k, &mut got);
            for r in 0..m {
                for c in 0..n {
                    let want: f64 = (0..k)
                        .map(|i| f64::from(rows[r * k + i]) * f64::from(weights[c * k + i]))
                        .sum();
                    let g = f64::from(got[c * m + r]);
                    assert!(
                        (g - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{name} ({r}, {c})"
                    );
                }
            }
        }
    }
}
