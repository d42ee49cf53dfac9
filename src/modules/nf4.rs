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
        if numel == 0 || !numel.is_multiple_of(BLOCK_SIZE * SCALER_BLOCK_SIZE) {
            return Err(Nf4Error::Shape { numel });
        }
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
                    .map(|&q| r(r(f32::from(q) / factor) + self.mean)),
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

/// torchao's `to_nf4` with `r` rounding each op's result to the weight's dtype: the block
/// scales and the packed codes.
fn quantize_in(weight: &[f32], r: impl Fn(f32) -> f32 + Sync) -> (Scales, Vec<u8>) {
    let absmax: Vec<f32> = weight
        .par_chunks(BLOCK_SIZE)
        .map(|b| b.iter().map(|v| r(*v).abs()).fold(0.0, f32::max))
        .collect();
    let mean = r(mean_f32(&absmax));
    let centred: Vec<f32> = absmax.iter().map(|v| r(v - mean)).collect();
    let mut scalers = Vec::with_capacity(centred.len());
    let mut factors = Vec::with_capacity(centred.len() / SCALER_BLOCK_SIZE);
    for block in centred.chunks(SCALER_BLOCK_SIZE) {
        let max = block.iter().map(|v| v.abs()).fold(0.0, f32::max);
        // torch runs `256 / t` as `t.reciprocal() * 256`; times a power of two is exact.
        let factor = r(r(1.0 / r(2.0 * max)) * 256.0);
        factors.push(factor);
        for v in block {
            let q = r(v * factor).round_ties_even();
            scalers.push(q.clamp(-128.0, 127.0) as i8);
        }
    }
    let nf4 = NF4_LEVELS.map(&r);
    let midpoints: [f32; 15] = std::array::from_fn(|i| (nf4[i] + nf4[i + 1]) / 2.0);
    // torch: the first level at the smallest rounded distance |scaled - level|. Rounding is
    // monotone and adjacent levels are at least 0.08 apart (far above a rounding step of
    // distances below 2), so that level is the exactly nearest one or a neighbour tied with
    // it after rounding: three candidates instead of sixteen.
    let nearest = |v: f32, scale: f32| -> u8 {
        let scaled = r(r(v) / scale);
        let c = midpoints.iter().filter(|m| scaled > **m).count();
        let mut best = 0u8;
        let mut best_diff = f32::INFINITY;
        let first = c.saturating_sub(1);
        for (i, level) in nf4.iter().enumerate().take(c + 2).skip(first) {
            let diff = r((scaled - level).abs());
            if diff < best_diff {
                best = i as u8;
                best_diff = diff;
            }
        }
        best
    };
    // Blocks in parallel (a 1B model has a billion values to place); a block's 64 values
    // fill 32 bytes.
    let mut codes = vec![0u8; weight.len() / 2];
    codes
        .par_chunks_mut(BLOCK_SIZE / 2)
        .zip(weight.par_chunks(BLOCK_SIZE))
        .zip(absmax.par_iter())
        .for_each(|((out, block), &scale)| {
            for (byte, pair) in out.iter_mut().zip(block.chunks_exact(2)) {
                *byte = (nearest(pair[0], scale) << 4) | nearest(pair[1], scale);
            }
        });
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
    let sum = values.iter().map(|v| f64::from(*v)).sum::<f64>() as f32;
    sum / values.len() as f32
}

#[cfg(test)]
mod tests {
    use super::*;

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
