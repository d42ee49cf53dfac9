//! Vectorised building blocks for the row kernels: `exp`, max and sum over `f32` slices.
//!
//! Written as plain loops over 8-wide lanes that LLVM vectorises, compiled twice by
//! [`multiversion!`]: once for AVX2+FMA (picked at run time when the CPU has it) and once for
//! the baseline target. burn-flex's unary `exp` calls scalar libm `expf` per element, which was
//! 15-20% of a training step; this one is a Cephes-style polynomial evaluated 8 lanes at a time.

/// Lanes per accumulator: one AVX2 register of `f32`.
pub const LANES: usize = 8;

const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two so `x - n ln2` is exact for the `n` that occur (Cephes).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Below this, `exp` is under `f32::MIN_POSITIVE`; the result is flushed to 0.
const UNDERFLOW: f32 = -87.336_55;
/// 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;

/// `e^x` for `x <= 88` with at most a few ulp of relative error; results below
/// `f32::MIN_POSITIVE` are flushed to 0 and NaN stays NaN. Every caller passes `x <= 0`
/// (`x - max` in a softmax, `-|x|` in a sigmoid).
///
/// Both selects are bit masks, not `if`s: with branches, LLVM compiled the loops over it to a
/// compare and jump per value (4 ns per value in a log-sum-exp on two cores). A comparison
/// rather than `max`, so a NaN input keeps its bits and falls through to a NaN result.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // All ones unless x is below the underflow bound (so all ones for NaN).
    let keep = ((x < UNDERFLOW) as u32).wrapping_sub(1);
    let clamped = f32::from_bits((x.to_bits() & keep) | (UNDERFLOW.to_bits() & !keep));
    let shifted = clamped * LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let p = p * r * r + r + 1.0;
    // 2^n built from its exponent bits; n is in [-126, 127] after the clamp.
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let scale = f32::from_bits(((n_bits + 127) << 23) as u32);
    f32::from_bits((p * scale).to_bits() & keep)
}

/// Values per block of the `exp` loops: a loop of this many iterations is vectorised by LLVM's
/// loop vectoriser, where a fully unrolled 8-lane block was left partly scalar.
const EXP_BLOCK: usize = 64;

/// `1 / (1 + e^-x)` without overflow for either sign.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    let e = exp(-x.abs());
    let s = 1.0 / (1.0 + e);
    if x >= 0.0 { s } else { e * s }
}

/// The largest element (NaN elements are skipped; a NaN row shows up in the `exp` pass).
#[inline(always)]
pub fn max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (a, &v) in acc.iter_mut().zip(chunk) {
            *a = if v > *a { v } else { *a };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &v in acc.iter().chain(tail) {
        m = if v > m { v } else { m };
    }
    m
}

/// Adds `xs`' whole groups of `LANES` to the lane accumulators; returns the values after them.
#[inline(always)]
fn add_lanes<'a>(acc: &mut [f32; LANES], xs: &'a [f32]) -> &'a [f32] {
    let groups = xs.chunks_exact(LANES);
    let tail = groups.remainder();
    for group in groups {
        for (a, &v) in acc.iter_mut().zip(group) {
            *a += v;
        }
    }
    tail
}

/// The sum of the lane accumulators, then of the `tail` values in order.
#[inline(always)]
fn finish_sum(acc: [f32; LANES], tail: &[f32]) -> f32 {
    let mut sum: f32 = acc.iter().sum();
    for &v in tail {
        sum += v;
    }
    sum
}

/// `sum(e^(x - shift))`, writing each term to `out` when given. The terms are summed in
/// `LANES` accumulators, then the last `len % LANES` in order.
#[inline(always)]
pub fn exp_shifted(xs: &[f32], shift: f32, out: Option<&mut [f32]>) -> f32 {
    let mut acc = [0.0f32; LANES];
    match out {
        Some(out) => {
            let out = &mut out[..xs.len()];
            for (o, &x) in out.iter_mut().zip(xs) {
                *o = exp(x - shift);
            }
            let tail = add_lanes(&mut acc, out);
            finish_sum(acc, tail)
        }
        None => {
            // Blocks of a multiple of LANES: only the last one leaves a tail.
            let mut block = [0.0f32; EXP_BLOCK];
            let (mut tail, mut tail_len) = ([0.0f32; LANES], 0);
            for chunk in xs.chunks(EXP_BLOCK) {
                let block = &mut block[..chunk.len()];
                for (o, &x) in block.iter_mut().zip(chunk) {
                    *o = exp(x - shift);
                }
                let rest = add_lanes(&mut acc, block);
                tail[..rest.len()].copy_from_slice(rest);
                tail_len = rest.len();
            }
            finish_sum(acc, &tail[..tail_len])
        }
    }
}

/// `xs[i] = e^(xs[i] - shift)`, returning their sum (summed as [`exp_shifted`] does).
#[inline(always)]
pub fn exp_shifted_in_place(xs: &mut [f32], shift: f32) -> f32 {
    for x in xs.iter_mut() {
        *x = exp(*x - shift);
    }
    let mut acc = [0.0f32; LANES];
    let tail = add_lanes(&mut acc, xs);
    finish_sum(acc, tail)
}

/// `sum(a * b)`.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let whole = a.len() / LANES * LANES;
    for start in (0..whole).step_by(LANES) {
        for ((s, x), y) in acc
            .iter_mut()
            .zip(&a[start..start + LANES])
            .zip(&b[start..start + LANES])
        {
            *s += x * y;
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in whole..a.len() {
        sum += a[i] * b[i];
    }
    sum
}

/// `x[start..start + LANES]` as an array, so the lane loops index it without bounds checks
/// (callers keep `start + LANES` inside `x`; the fallback is never taken).
#[inline(always)]
fn lanes(x: &[f32], start: usize) -> &[f32; LANES] {
    x[start..start + LANES].try_into().unwrap_or(&[0.0; LANES])
}

/// `[[a0 . b_j], [a1 . b_j]]` for four weight lines `b_j` at once: each loaded line vector
/// serves both rows and each row vector four lines, where [`dot`] per pair reloads both for
/// every multiply-add (two loads per multiply-add bound it by the load ports). Each sum is
/// [`dot`]'s, in its order, so the results are bit for bit [`dot`]'s.
#[inline(always)]
pub fn dot_2x4(a0: &[f32], a1: &[f32], b: [&[f32]; 4]) -> [[f32; 4]; 2] {
    let k = a0.len();
    let [b0, b1, b2, b3] = b;
    // Eight named accumulators (row, line), so LLVM keeps each in a register.
    let (mut s00, mut s01, mut s02, mut s03) =
        ([0.0f32; LANES], [0.0; LANES], [0.0; LANES], [0.0; LANES]);
    let (mut s10, mut s11, mut s12, mut s13) =
        ([0.0f32; LANES], [0.0; LANES], [0.0; LANES], [0.0; LANES]);
    let whole = k / LANES * LANES;
    for start in (0..whole).step_by(LANES) {
        let x0 = lanes(a0, start);
        let x1 = lanes(a1, start);
        let y0 = lanes(b0, start);
        let y1 = lanes(b1, start);
        let y2 = lanes(b2, start);
        let y3 = lanes(b3, start);
        for l in 0..LANES {
            s00[l] += x0[l] * y0[l];
            s01[l] += x0[l] * y1[l];
            s02[l] += x0[l] * y2[l];
            s03[l] += x0[l] * y3[l];
            s10[l] += x1[l] * y0[l];
            s11[l] += x1[l] * y1[l];
            s12[l] += x1[l] * y2[l];
            s13[l] += x1[l] * y3[l];
        }
    }
    let acc = [[s00, s01, s02, s03], [s10, s11, s12, s13]];
    let mut out = [[0.0f32; 4]; 2];
    for (r, a) in [a0, a1].iter().enumerate() {
        for (j, line) in b.iter().enumerate() {
            let mut sum: f32 = acc[r][j].iter().sum();
            for i in whole..k {
                sum += a[i] * line[i];
            }
            out[r][j] = sum;
        }
    }
    out
}

/// Defines `fn name(args) -> ret` that runs `body` compiled for AVX2+FMA when the CPU has
/// them, and the baseline build of the same body otherwise. `body` should call the
/// `#[inline(always)]` helpers above so they are vectorised in both builds.
macro_rules! multiversion {
    ($(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$attr])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn portable($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) $(-> $ret)? {
                    portable($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the running CPU has the features `avx2` is compiled for.
                    return unsafe { avx2($($arg),*) };
                }
            }
            portable($($arg),*)
        }
    };
}
pub(crate) use multiversion;

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_a_few_ulp_of_libm_over_its_domain() {
        let mut worst = 0;
        let mut x = -87.3f32;
        while x <= 88.0 {
            let (got, want) = (exp(x), x.exp());
            worst = worst.max(ulps(got, want));
            x += 0.000_731;
        }
        assert!(worst <= 3, "worst error {worst} ulp");
    }

    #[test]
    fn exp_edges_flush_and_propagate() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-1.0e30), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-90.0), 0.0);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn sigmoid_matches_the_definition_for_both_signs() {
        for x in [-100.0f32, -20.0, -3.5, -0.1, 0.0, 0.1, 3.5, 20.0, 100.0] {
            let want = 1.0 / (1.0 + (-(x as f64)).exp());
            assert!(
                (sigmoid(x) as f64 - want).abs() <= 1e-7 * want.max(1e-30) + 1e-38,
                "{x}"
            );
        }
    }

    /// The three `exp` sums agree bit for bit (the softmax, the log-sum-exp and attention use
    /// different ones) across block boundaries and tails, and match f64.
    #[test]
    fn exp_sums_agree_across_blocks_and_tails() {
        for len in [0, 1, 7, 8, 63, 64, 65, 129, 1000] {
            let xs: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin() * 30.0).collect();
            let shift = max(&xs);
            let mut out = vec![0.0; len];
            let with_out = exp_shifted(&xs, shift, Some(&mut out));
            let without = exp_shifted(&xs, shift, None);
            let mut in_place = xs.clone();
            let sum_in_place = exp_shifted_in_place(&mut in_place, shift);
            assert_eq!(with_out.to_bits(), without.to_bits(), "len {len}");
            assert_eq!(with_out.to_bits(), sum_in_place.to_bits(), "len {len}");
            assert_eq!(out, in_place, "len {len}");
            let want: f64 = xs.iter().map(|&x| (x as f64 - shift as f64).exp()).sum();
            assert!(
                (with_out as f64 - want).abs() <= 1e-5 * want.max(1.0),
                "len {len}"
            );
        }
    }

    #[test]
    fn reductions_cover_the_tail() {
        let xs: Vec<f32> = (0..21).map(|i| (i as f32 * 0.37).sin()).collect();
        let want_max = xs.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(max(&xs), want_max);
        let mut out = vec![0.0; xs.len()];
        let sum = exp_shifted(&xs, want_max, Some(&mut out));
        let want: f64 = xs.iter().map(|x| ((x - want_max) as f64).exp()).sum();
        assert!((sum as f64 - want).abs() < 1e-5);
        for (o, x) in out.iter().zip(&xs) {
            assert!((o - (x - want_max).exp()).abs() < 1e-6);
        }
        let d = dot(&xs, &out);
        let want: f32 = xs.iter().zip(&out).map(|(a, b)| a * b).sum();
        assert!((d - want).abs() < 1e-5);
    }
}
