//! NF4 weights exactly as torchao's `to_nf4` stores them (torchtune's QLoRA base weights):
//! blocks of 64 values share a bf16 absmax scale; each value is the index of the nearest of 16
//! normal-float levels, two to a byte (first value in the high nibble); the block scales are
//! themselves quantized to int8 in blocks of 256 after subtracting their mean
//! ("double quantization"): 0.516 bytes per parameter in all.
//!
//! torchao computes everything in the weight's dtype (bf16 for torchtune's QLoRA): every
//! intermediate is rounded to bf16 here as torch rounds it (each op in f32, then
//! round-to-nearest-even), so codes, scales and the dequantized weight match it bit for bit
//! (tests/suite/nf4.rs against tests/fixtures/reference/nf4.safetensors).

use half::bf16;

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

/// A weight in torchao's NF4 layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4Weight {
    pub shape: Vec<usize>,
    /// Two 4-bit level indices per byte, the first value in the high nibble.
    pub codes: Vec<u8>,
    /// Each block's absmax minus `mean`, quantized to int8 per scaler block.
    pub scalers: Vec<i8>,
    /// Per scaler block: `256 / (2 * absmax)` of its mean-subtracted block scales.
    pub factors: Vec<bf16>,
    /// The mean of the block scales.
    pub mean: bf16,
}

/// One torch bf16 op: computed in f32, rounded to bf16 (round to nearest, ties to even).
fn r(x: f32) -> bf16 {
    bf16::from_f32(x)
}

fn levels() -> [bf16; 16] {
    NF4_LEVELS.map(r)
}

impl Nf4Weight {
    /// torchao's `to_nf4(weight)` for a bf16 weight (row-major, any shape).
    pub fn quantize(weight: &[bf16], shape: &[usize]) -> Result<Self, Nf4Error> {
        let numel = weight.len();
        if numel == 0 || !numel.is_multiple_of(BLOCK_SIZE * SCALER_BLOCK_SIZE) {
            return Err(Nf4Error::Shape { numel });
        }
        let absmax: Vec<bf16> = weight
            .chunks(BLOCK_SIZE)
            .map(|b| {
                b.iter()
                    .map(|v| r(v.to_f32().abs()))
                    .fold(r(0.0), bf16::max)
            })
            .collect();
        // torch's bf16 mean accumulates in f32 and rounds once.
        let mean = r(absmax.iter().map(|v| v.to_f32()).sum::<f32>() / absmax.len() as f32);
        let centred: Vec<bf16> = absmax
            .iter()
            .map(|v| r(v.to_f32() - mean.to_f32()))
            .collect();
        let mut scalers = Vec::with_capacity(centred.len());
        let mut factors = Vec::with_capacity(centred.len() / SCALER_BLOCK_SIZE);
        for block in centred.chunks(SCALER_BLOCK_SIZE) {
            let max = block
                .iter()
                .map(|v| r(v.to_f32().abs()))
                .fold(r(0.0), bf16::max);
            let factor = r(256.0 / r(2.0 * max.to_f32()).to_f32());
            factors.push(factor);
            for v in block {
                let q = r(v.to_f32() * factor.to_f32()).to_f32().round_ties_even();
                scalers.push(q.clamp(-128.0, 127.0) as i8);
            }
        }
        let nf4 = levels();
        let mut indices = Vec::with_capacity(numel);
        for (block, scale) in weight.chunks(BLOCK_SIZE).zip(&absmax) {
            for v in block {
                let scaled = r(v.to_f32() / scale.to_f32()).to_f32();
                // the first level at the smallest distance, as torch's min(dim).indices
                let mut best = 0;
                let mut best_diff = f32::INFINITY;
                for (i, level) in nf4.iter().enumerate() {
                    let diff = r((scaled - level.to_f32()).abs()).to_f32();
                    if diff < best_diff {
                        best = i;
                        best_diff = diff;
                    }
                }
                indices.push(best as u8);
            }
        }
        let codes = indices.chunks(2).map(|p| (p[0] << 4) | p[1]).collect();
        Ok(Nf4Weight {
            shape: shape.to_vec(),
            codes,
            scalers,
            factors,
            mean,
        })
    }

    /// The block scales as torchao dequantizes them: `int8 / factor + mean`, in bf16.
    pub fn block_scales(&self) -> Vec<bf16> {
        self.scalers
            .chunks(SCALER_BLOCK_SIZE)
            .zip(&self.factors)
            .flat_map(|(block, factor)| {
                block.iter().map(move |q| {
                    r(r(f32::from(*q) / factor.to_f32()).to_f32() + self.mean.to_f32())
                })
            })
            .collect()
    }

    /// torchao's `get_original_weight()`: each level times its block's scale, in bf16.
    pub fn dequantize(&self) -> Vec<bf16> {
        let nf4 = levels();
        let scales = self.block_scales();
        let mut out = Vec::with_capacity(self.codes.len() * 2);
        for (i, byte) in self.codes.iter().enumerate() {
            let scale = scales[i * 2 / BLOCK_SIZE].to_f32();
            for code in [byte >> 4, byte & 0x0f] {
                out.push(r(nf4[usize::from(code)].to_f32() * scale));
            }
        }
        out
    }

    /// Bytes held: codes, int8 scalers, bf16 factors and the mean.
    pub fn bytes(&self) -> usize {
        self.codes.len() + self.scalers.len() + 2 * self.factors.len() + 2
    }

    /// Unpacked level indices, one per value in row-major order (for tests and inspection).
    pub fn indices(&self) -> Vec<u8> {
        self.codes.iter().flat_map(|b| [b >> 4, b & 0x0f]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_torchao_refuses_are_errors_naming_the_rule() {
        let w = vec![bf16::ZERO; 64 * 100];
        let err = Nf4Weight::quantize(&w, &[100, 64]).unwrap_err();
        assert!(err.to_string().contains("6400 values"), "{err}");
    }

    #[test]
    fn the_levels_round_trip_through_their_codes() {
        // A block that holds each level times 0.5 (its absmax is 0.5) decodes to itself.
        let mut w: Vec<bf16> = Vec::new();
        while w.len() < BLOCK_SIZE * SCALER_BLOCK_SIZE {
            w.extend(NF4_LEVELS.iter().map(|l| r(l * 0.5)));
        }
        let q = Nf4Weight::quantize(&w, &[256, 64]).unwrap();
        assert_eq!(&q.indices()[..16], (0..16).collect::<Vec<u8>>().as_slice());
        assert!(
            q.bytes() * 1000 < w.len() * 517,
            "0.516 bytes per parameter"
        );
    }
}
