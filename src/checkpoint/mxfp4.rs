//! MXFP4, the 4-bit format gpt-oss's release stores its experts' weights in: each weight row
//! in blocks of 32 values, two 4-bit E2M1 codes per byte (`*_blocks`, `[.., rows, blocks, 16]`)
//! and one shared power-of-two scale per block, biased by 127 (`*_scales`, `[.., rows, blocks]`).
//! Dequantized on load exactly as transformers' `convert_moe_packed_tensors` does (every value
//! a code times a power of two, so exact in bf16 and f32), to the row-major `[.., rows, 32 *
//! blocks]` it yields before its final transpose: each row is one output row of the weight.

/// E2M1's sixteen values, by code (transformers' `FP4_VALUES`).
const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Bytes per block: 32 codes.
pub const BLOCK_BYTES: usize = 16;

/// The values of `blocks` (one byte per entry, `[n, 16]` flattened) with `scales` (`[n]`):
/// `32 * n` values, each block's low nibble first.
pub fn dequantize(blocks: &[u8], scales: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(blocks.len() * 2);
    for (block, &scale) in blocks.chunks_exact(BLOCK_BYTES).zip(scales) {
        let factor = 2f32.powi(scale as i32 - 127);
        for &byte in block {
            out.push(E2M1[(byte & 0x0f) as usize] * factor);
            out.push(E2M1[(byte >> 4) as usize] * factor);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_take_their_blocks_power_of_two_low_nibble_first() {
        let mut block = [0u8; BLOCK_BYTES];
        block[0] = 0x71; // low 1 (0.5), high 7 (6.0)
        block[1] = 0xf9; // low 9 (-0.5), high 15 (-6.0)
        let values = dequantize(&block, &[128]);
        assert_eq!(values.len(), 32);
        assert_eq!(&values[..4], &[1.0, 12.0, -1.0, -12.0]);
        assert!(values[4..].iter().all(|v| *v == 0.0));
        let small = dequantize(&block, &[125]);
        assert_eq!(&small[..2], &[0.125, 1.5]);
    }
}
