//! NF4 weights exactly as torchao's `to_nf4` stores them (torchtune's QLoRA base weights):
//! blocks of 64 values share a bf16 absmax scale; each value is the index of the nearest of 16
//! normal-float levels, two to a byte (first value in the high nibble); the block scales are
//! themselves quantized to int8 in blocks of 256 after subtracting their mean
//! ("double quantization"): 0.516 bytes per parameter in all.
//!
//! torchao computes everything in the weight's dtype (bf16 for torchtune's QLoRA configs, fp32
//! when a config says `dtype: fp32`): every intermediate is rounded to that dtype here as torch
//! rounds it (each bf16 op in f32, then round-to-nearest-even), so codes, scales and the
//! dequantized weight match it bit for bit (tests/suite/nf4.rs against
//! tests/fixtures/reference/nf4.safetensors and qlora.safetensors).

use std::ops::Range;

use half::bf16;
use rayon::prelude::*;

/// Values per absmax block (torchao's `block_size` default).
pub const BLOCK_SIZE: usize = 64;
/// Block scales per int8 scaler block (torchao's `scaler_block_size` default).
pub const SCALER_BLOCK_SIZE: usize = 256;

/// The 16 NF4 levels, as torchao writes them (rounded to the weight's dtype).
const NF4_LEVELS: [f32; 16] = [
    -1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609, 0.2461,
    0.3379, 0.4407, 0.5626, 0.7230, 1.0,
];

/// Why a weight cannot be stored in NF4 (torchao's assertions, in words).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Nf4Error {
    #[error(
        "a weight of {numel} values cannot be stored in NF4: torchao's to_nf4 needs a multiple of {BLOCK_SIZE} values (its block size) whose {BLOCK_SIZE}-value blocks number a multiple of {SCALER_BLOCK_SIZE} (its scaler block size), i.e. a multiple of {} values",
        BLOCK_SIZE * SCALER_BLOCK_SIZE
    )]
    Shape { numel: usize },
}

/// A dtype torchao computes NF4 in: quantization in the dtype of the weight it quantizes,
/// dequantization in the dtype of the NF4 tensor (torchtune's model dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nf4Dtype {
    Bf16,
    F16,
    F32,
}

impl Nf4Dtype {
    /// One torch op's result in this dtype: an f32 result rounded to bf16 or f16 (nearest,
    /// ties to even), or the f32 result itself.
    #[inline(always)]
    pub fn round(self, x: f32) -> f32 {
        match self {
            Self::Bf16 => crate::kernels::bf16::round_to_bf16(x),
            Self::F16 => half::f16::from_f32(x).to_f32(),
            Self::F32 => x,
        }
    }

    fn bytes(self) -> usize {
        match self {
            Self::Bf16 | Self::F16 => 2,
            Self::F32 => 4,
        }
    }
}

/// A weight in torchao's NF4 layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4Weight {
    pub shape: Vec<usize>,
    /// The dtype it was quantized in: its level table, factors and mean are values of it.
    pub dtype: Nf4Dtype,
    /// Two 4-bit level indices per byte, the first value in the high nibble.
    pub codes: Vec<u8>,
    /// Each block's absmax minus `mean`, quantized to int8 per scaler block.
    pub scalers: Vec<i8>,
    /// Per scaler block: `256 / (2 * absmax)` of its mean-subtracted block scales (values of
    /// `dtype`, held as f32).
    pub factors: Vec<f32>,
    /// The mean of the block scales (a value of `dtype`).
    pub mean: f32,
}

impl Nf4Weight {
    /// torchao's `to_nf4(weight)` for a bf16 weight (row-major, any shape).
    pub fn quantize_bf16(weight: &[bf16], shape: &[usize]) -> Result<Self, Nf4Error> {
        let values: Vec<f32> = weight.iter().map(|v| v.to_f32()).collect();
        Self::quantize(&values, shape, Nf4Dtype::Bf16)
    }

    /// torchao's `to_nf4(weight)` for a weight of `dtype` (row-major, any shape); `weight`'s
    /// values are rounded to `dtype` first, as the weight torchao sees already is.
    pub fn quantize(weight: &[f32], shape: &[usize], dtype: Nf4Dtype) -> Result<Self, Nf4Error> {
        let numel = weight.len();
        Self::check_numel(numel)?;
        // One copy of the loops per dtype, so the rounding inlines into them.
        let (scales, codes) = match dtype {
            Nf4Dtype::Bf16 => quantize_in(weight, |x| bf16::from_f32(x).to_f32()),
            Nf4Dtype::F16 => quantize_in(weight, |x| half::f16::from_f32(x).to_f32()),
            Nf4Dtype::F32 => quantize_in(weight, |x| x),
        };
        Ok(Nf4Weight {
            shape: shape.to_vec(),
            dtype,
            codes,
            scalers: scales.scalers,
            factors: scales.factors,
            mean: scales.mean,
        })
    }

    /// torchao's shape rule: a whole number of scaler blocks of whole blocks.
    pub fn check_numel(numel: usize) -> Result<(), Nf4Error> {
        if numel == 0 || !numel.is_multiple_of(BLOCK_SIZE * SCALER_BLOCK_SIZE) {
            return Err(Nf4Error::Shape { numel });
        }
        Ok(())
    }

    /// The block scales as torchao dequantizes them in the weight's own dtype.
    pub fn block_scales(&self) -> Vec<f32> {
        self.block_scales_in(self.dtype)
    }

    /// The block scales as torchao dequantizes them in `compute` (the NF4 tensor's dtype):
    /// `int8 / factor + mean`, each op rounded to `compute`.
    /// Runs per NF4 layer per forward (and per decoding step): each dtype gets its own loop so
    /// the rounding is inlined and the loop vectorises.
    pub fn block_scales_in(&self, compute: Nf4Dtype) -> Vec<f32> {
        match compute {
            Nf4Dtype::F32 => self.scales_rounded(|x| x),
            Nf4Dtype::Bf16 => self.scales_rounded(crate::kernels::bf16::round_to_bf16),
            Nf4Dtype::F16 => self.scales_rounded(|x| Nf4Dtype::F16.round(x)),
        }
    }

    fn scales_rounded(&self, r: impl Fn(f32) -> f32) -> Vec<f32> {
        let mut scales = Vec::with_capacity(self.scalers.len());
        for (block, factor) in self.scalers.chunks(SCALER_BLOCK_SIZE).zip(&self.factors) {
            scales.extend(
                block
                    .iter()
                    .map(|&q| dequantized_scale(q, *factor, self.mean, &r)),
            );
        }
        scales
    }

    /// torchao's `get_original_weight()` in the weight's own dtype, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.numel()];
        self.dequantize_into(&self.block_scales(), self.dtype, 0, &mut out);
        out
    }

    /// Decodes the values from flat index `start` on into `out`, in `compute`, given
    /// [`Self::block_scales_in`] `compute`: each level (a value of the quantization dtype)
    /// times its block's scale.
    pub fn dequantize_into(
        &self,
        scales: &[f32],
        compute: Nf4Dtype,
        start: usize,
        out: &mut [f32],
    ) {
        let levels = self.levels();
        let mut k = start;
        let mut out = out;
        while !out.is_empty() {
            let block = k / BLOCK_SIZE;
            let table = block_table(&levels, scales[block], compute);
            let n = ((block + 1) * BLOCK_SIZE - k).min(out.len());
            let (head, rest) = out.split_at_mut(n);
            let mut i = 0;
            if k % 2 == 1 {
                head[0] = table[usize::from(self.codes[k / 2] & 0x0f)];
                i = 1;
            }
            // Whole bytes: two values each.
            let pairs = head[i..].chunks_exact_mut(2);
            let bytes = &self.codes[(k + i) / 2..];
            for (pair, byte) in pairs.zip(bytes) {
                pair[0] = table[usize::from(byte >> 4)];
                pair[1] = table[usize::from(byte & 0x0f)];
            }
            if (n - i) % 2 == 1 {
                head[n - 1] = table[usize::from(self.codes[(k + n - 1) / 2] >> 4)];
            }
            k += n;
            out = rest;
        }
    }

    /// The 16 levels as values of the quantization dtype.
    pub fn levels(&self) -> [f32; 16] {
        NF4_LEVELS.map(|l| self.dtype.round(l))
    }

    /// Bytes held: codes, int8 scalers, the factors and the mean in `dtype`.
    pub fn bytes(&self) -> usize {
        self.codes.len() + self.scalers.len() + self.dtype.bytes() * (self.factors.len() + 1)
    }

    pub fn numel(&self) -> usize {
        self.codes.len() * 2
    }

    /// Unpacked level indices, one per value in row-major order (for tests and inspection).
    pub fn indices(&self) -> Vec<u8> {
        self.codes.iter().flat_map(|b| [b >> 4, b & 0x0f]).collect()
    }
}

/// The 16 values a block with `scale` holds, dequantized in `compute`: each level (a value of
/// the quantization dtype) times the scale. Decoding looks values up here: one product per
/// level instead of one per value.
#[inline(always)]
pub fn block_table(levels: &[f32; 16], scale: f32, compute: Nf4Dtype) -> [f32; 16] {
    let mut table = [0.0f32; 16];
    // fp32 spelled out, so the loop decoding calls per block carries no rounding branch.
    match compute {
        Nf4Dtype::F32 => {
            for (t, level) in table.iter_mut().zip(levels) {
                *t = level * scale;
            }
        }
        _ => {
            for (t, level) in table.iter_mut().zip(levels) {
                *t = compute.round(level * scale);
            }
        }
    }
    table
}

/// The double-quantized block scales of a weight.
struct Scales {
    scalers: Vec<i8>,
    factors: Vec<f32>,
    mean: f32,
}

/// A block's scale: its largest magnitude, each value first rounded to the weight's dtype.
fn block_absmax(block: &[f32], r: impl Fn(f32) -> f32) -> f32 {
    block.iter().map(|v| r(*v).abs()).fold(0.0, f32::max)
}

/// A scaler block's factor, `256 / (2 * absmax)` of its mean-subtracted block scales.
fn scaler_factor(centred: &[f32], r: impl Fn(f32) -> f32) -> f32 {
    let max = centred.iter().map(|v| v.abs()).fold(0.0, f32::max);
    // torch runs `256 / t` as `t.reciprocal() * 256`; times a power of two is exact.
    r(r(1.0 / r(2.0 * max)) * 256.0)
}

/// A mean-subtracted block scale quantized to int8 with its scaler block's factor.
fn scaler(centred: f32, factor: f32, r: impl Fn(f32) -> f32) -> i8 {
    let q = r(centred * factor).round_ties_even();
    q.clamp(-128.0, 127.0) as i8
}

/// A block's scale as torchao dequantizes it in the dtype `r` rounds to: `int8 / factor +
/// mean`, each op rounded.
fn dequantized_scale(q: i8, factor: f32, mean: f32, r: impl Fn(f32) -> f32) -> f32 {
    r(r(f32::from(q) / factor) + mean)
}

/// The nearest NF4 level's index of a value in a block of scale `scale`, as torch picks it.
struct Coder<R> {
    levels: [f32; 16],
    midpoints: [f32; 15],
    r: R,
}

impl<R: Fn(f32) -> f32> Coder<R> {
    fn new(r: R) -> Self {
        let levels = NF4_LEVELS.map(&r);
        let midpoints = std::array::from_fn(|i| (levels[i] + levels[i + 1]) / 2.0);
        Self {
            levels,
            midpoints,
            r,
        }
    }

    // torch: the first level at the smallest rounded distance |scaled - level|. Rounding is
    // monotone and adjacent levels are at least 0.08 apart (far above a rounding step of
    // distances below 2), so that level is the exactly nearest one or a neighbour tied with
    // it after rounding: three candidates instead of sixteen.
    fn nearest(&self, v: f32, scale: f32) -> u8 {
        let r = &self.r;
        let scaled = r(r(v) / scale);
        let c = self.midpoints.iter().filter(|m| scaled > **m).count();
        let mut best = 0u8;
        let mut best_diff = f32::INFINITY;
        let first = c.saturating_sub(1);
        for (i, level) in self.levels.iter().enumerate().take(c + 2).skip(first) {
            let diff = r((scaled - level).abs());
            if diff < best_diff {
                best = i as u8;
                best_diff = diff;
            }
        }
        best
    }

    /// A block's 64 values packed two to a byte (32 bytes), the first in the high nibble.
    fn pack_block(&self, block: &[f32], scale: f32, out: &mut [u8]) {
        for (byte, pair) in out.iter_mut().zip(block.chunks_exact(2)) {
            *byte = (self.nearest(pair[0], scale) << 4) | self.nearest(pair[1], scale);
        }
    }
}

/// torchao's `to_nf4` with `r` rounding each op's result to the weight's dtype: the block
/// scales and the packed codes.
fn quantize_in(weight: &[f32], r: impl Fn(f32) -> f32 + Sync) -> (Scales, Vec<u8>) {
    let absmax: Vec<f32> = weight
        .par_chunks(BLOCK_SIZE)
        .map(|b| block_absmax(b, &r))
        .collect();
    let mean = r(mean_f32(&absmax));
    let centred: Vec<f32> = absmax.iter().map(|v| r(v - mean)).collect();
    let mut scalers = Vec::with_capacity(centred.len());
    let mut factors = Vec::with_capacity(centred.len() / SCALER_BLOCK_SIZE);
    for block in centred.chunks(SCALER_BLOCK_SIZE) {
        let factor = scaler_factor(block, &r);
        factors.push(factor);
        scalers.extend(block.iter().map(|v| scaler(*v, factor, &r)));
    }
    let coder = Coder::new(&r);
    // Blocks in parallel (a 1B model has a billion values to place); a block's 64 values
    // fill 32 bytes.
    let mut codes = vec![0u8; weight.len() / 2];
    codes
        .par_chunks_mut(BLOCK_SIZE / 2)
        .zip(weight.par_chunks(BLOCK_SIZE))
        .zip(absmax.par_iter())
        .for_each(|((out, block), &scale)| coder.pack_block(block, scale, out));
    let scales = Scales {
        scalers,
        factors,
        mean,
    };
    (scales, codes)
}

/// torch's mean of float values: the sum accumulated in f32 (here in f64 and rounded once,
/// which equals torch's cascaded f32 sum whenever that sum is exact or correctly rounded),
/// divided in f32.
fn mean_f32(values: &[f32]) -> f32 {
    mean_of(
        values.iter().map(|v| f64::from(*v)).sum::<f64>(),
        values.len(),
    )
}

/// [`mean_f32`] from the f64 sum of `n` values, accumulated in their order.
fn mean_of(sum: f64, n: usize) -> f32 {
    sum as f32 / n as f32
}

/// Elements `keep` (whole blocks) of a weight quantized to NF4: their packed codes, and their
/// blocks' scales dequantized in the compute dtype.
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4Part {
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
}

/// torchao's `to_nf4` of a weight of `numel` values of `dtype` (a valid NF4 size:
/// [`Nf4Weight::check_numel`]) streamed in `chunks` (its values in order, each chunk whole
/// blocks), keeping elements `keep` (whole blocks): their codes, and their block scales
/// dequantized in `compute`, bit for bit what quantizing the whole weight gives them
/// ([`Nf4Weight::quantize`], [`Nf4Weight::block_scales_in`]). Only `keep`'s values and the
/// block scales of the scaler blocks around them are held: FSDP's per-rank load quantizes a
/// rank's rows of a weight no rank ever holds whole. The whole weight is read once (for the
/// mean of every block's scale, summed in block order as [`mean_f32`] sums them).
pub fn quantize_part<E>(
    chunks: impl Iterator<Item = Result<Vec<f32>, E>>,
    numel: usize,
    keep: Range<usize>,
    dtype: Nf4Dtype,
    compute: Nf4Dtype,
) -> Result<Nf4Part, E> {
    // The roundings `Nf4Weight::quantize` and `block_scales_in` use.
    let compute_r = move |x: f32| compute.round(x);
    match dtype {
        Nf4Dtype::Bf16 => quantize_part_in(
            chunks,
            numel,
            keep,
            |x| bf16::from_f32(x).to_f32(),
            compute_r,
        ),
        Nf4Dtype::F16 => quantize_part_in(
            chunks,
            numel,
            keep,
            |x| half::f16::from_f32(x).to_f32(),
            compute_r,
        ),
        Nf4Dtype::F32 => quantize_part_in(chunks, numel, keep, |x| x, compute_r),
    }
}

fn quantize_part_in<E>(
    chunks: impl Iterator<Item = Result<Vec<f32>, E>>,
    numel: usize,
    keep: Range<usize>,
    r: impl Fn(f32) -> f32 + Sync + Copy,
    compute_r: impl Fn(f32) -> f32 + Copy,
) -> Result<Nf4Part, E> {
    let blocks = numel / BLOCK_SIZE;
    let kept = keep.start / BLOCK_SIZE..keep.end / BLOCK_SIZE;
    // The scaler blocks around the kept blocks.
    let around = kept.start / SCALER_BLOCK_SIZE * SCALER_BLOCK_SIZE
        ..(kept.end.div_ceil(SCALER_BLOCK_SIZE) * SCALER_BLOCK_SIZE).min(blocks);
    let mut sum = 0f64;
    let mut absmax = Vec::with_capacity(around.len());
    let mut values = Vec::with_capacity(keep.len());
    let mut at = 0;
    for chunk in chunks {
        let chunk = chunk?;
        for (i, block) in chunk.chunks(BLOCK_SIZE).enumerate() {
            let m = block_absmax(block, r);
            sum += f64::from(m);
            if around.contains(&(at / BLOCK_SIZE + i)) {
                absmax.push(m);
            }
        }
        let (from, to) = (keep.start.max(at), keep.end.min(at + chunk.len()));
        if from < to {
            values.extend_from_slice(&chunk[from - at..to - at]);
        }
        at += chunk.len();
    }
    let mean = r(mean_of(sum, blocks));
    let centred: Vec<f32> = absmax.iter().map(|v| r(v - mean)).collect();
    let mut scales = Vec::with_capacity(kept.len());
    for (g, group) in centred.chunks(SCALER_BLOCK_SIZE).enumerate() {
        let factor = scaler_factor(group, r);
        let first = around.start + g * SCALER_BLOCK_SIZE;
        for (j, v) in group.iter().enumerate() {
            if kept.contains(&(first + j)) {
                scales.push(dequantized_scale(
                    scaler(*v, factor, r),
                    factor,
                    mean,
                    compute_r,
                ));
            }
        }
    }
    let coder = Coder::new(r);
    let mut codes = vec![0u8; values.len() / 2];
    codes
        .par_chunks_mut(BLOCK_SIZE / 2)
        .zip(values.par_chunks(BLOCK_SIZE))
        .enumerate()
        .for_each(|(i, (out, block))| {
            coder.pack_block(block, absmax[kept.start - around.start + i], out)
        });
    Ok(Nf4Part { codes, scales })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any block-aligned part of a weight, streamed in chunks of any whole number of blocks,
    /// quantizes as the whole weight does: codes and dequantized scales, in every
    /// quantization and compute dtype, parts crossing scaler blocks included.
    #[test]
    fn a_part_quantizes_as_the_whole_weight_bit_for_bit() {
        // Three scaler blocks, with an outlier so the scales spread.
        let n = 3 * SCALER_BLOCK_SIZE * BLOCK_SIZE;
        let w: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * if i == 5000 { 3.0 } else { 0.1 })
            .collect();
        let dtypes = [Nf4Dtype::Bf16, Nf4Dtype::F16, Nf4Dtype::F32];
        for dtype in dtypes {
            let whole = Nf4Weight::quantize(&w, &[n / 192, 192], dtype).unwrap();
            for compute in dtypes {
                let scales = whole.block_scales_in(compute);
                for keep in [
                    0..n,
                    0..64,
                    64 * 255..64 * 258,
                    64 * 300..n,
                    64 * 511..64 * 513,
                ] {
                    let chunks = w.chunks(64 * 37).map(|c| Ok::<_, ()>(c.to_vec()));
                    let part = quantize_part(chunks, n, keep.clone(), dtype, compute).unwrap();
                    assert_eq!(part.codes, whole.codes[keep.start / 2..keep.end / 2]);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&part.scales),
                        bits(&scales[keep.start / 64..keep.end / 64]),
                        "{dtype:?} {compute:?} {keep:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn shapes_torchao_refuses_are_errors_naming_the_rule() {
        let w = vec![bf16::ZERO; 64 * 100];
        let err = Nf4Weight::quantize_bf16(&w, &[100, 64]).unwrap_err();
        assert!(err.to_string().contains("6400 values"), "{err}");
    }

    #[test]
    fn the_levels_round_trip_through_their_codes() {
        // A block that holds each level times 0.5 (its absmax is 0.5) decodes to itself.
        let mut w: Vec<bf16> = Vec::new();
        while w.len() < BLOCK_SIZE * SCALER_BLOCK_SIZE {
            w.extend(NF4_LEVELS.iter().map(|l| bf16::from_f32(l * 0.5)));
        }
        let q = Nf4Weight::quantize_bf16(&w, &[256, 64]).unwrap();
        assert_eq!(&q.indices()[..16], (0..16).collect::<Vec<u8>>().as_slice());
        assert!(
            q.bytes() * 1000 < w.len() * 517,
            "0.516 bytes per parameter"
        );
    }
}
