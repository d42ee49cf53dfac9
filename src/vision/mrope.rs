//! Qwen2-VL's M-RoPE positions (transformers' `get_rope_index`): text tokens count up on all
//! three sections (temporal, height, width) alike; an image's merged patches take the
//! position where it starts plus their frame, row and column; the text after it resumes at
//! that start plus the larger of its merged height and width.

use super::VisionError;

/// What a token of a row is, for its position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    Text,
    Image,
}

/// One row's positions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RopeIndex {
    /// `[temporal, height, width]`, each one position per token.
    pub positions: [Vec<i64>; 3],
    /// transformers' `rope_deltas`: the largest position + 1 minus the row's length (what
    /// decoding adds to a plain position after the prompt).
    pub delta: i64,
}

/// The positions of one row (its tokens without padding). Each run of image tokens is one
/// image and takes the next grid of `grids` (`image_grid_thw`, shared by the batch in order),
/// whose `t * h * w / merge^2` tokens it must hold.
pub fn rope_index(
    kinds: &[TokenKind],
    grids: &mut impl Iterator<Item = [usize; 3]>,
    spatial_merge_size: usize,
) -> Result<RopeIndex, VisionError> {
    let mut positions: [Vec<i64>; 3] = std::array::from_fn(|_| Vec::with_capacity(kinds.len()));
    let mut current: i64 = 0;
    let mut start = 0;
    while start < kinds.len() {
        let kind = kinds[start];
        let end = kinds[start..]
            .iter()
            .position(|&k| k != kind)
            .map_or(kinds.len(), |n| start + n);
        match kind {
            TokenKind::Text => {
                for i in 0..(end - start) as i64 {
                    for section in &mut positions {
                        section.push(current + i);
                    }
                }
                current += (end - start) as i64;
            }
            TokenKind::Image => {
                let [t, h, w] = grids.next().ok_or(VisionError::ImageTokens {
                    at: start,
                    tokens: end - start,
                    expected: None,
                })?;
                let (h, w) = (h / spatial_merge_size, w / spatial_merge_size);
                if t * h * w != end - start {
                    return Err(VisionError::ImageTokens {
                        at: start,
                        tokens: end - start,
                        expected: Some(t * h * w),
                    });
                }
                for frame in 0..t as i64 {
                    for row in 0..h as i64 {
                        for col in 0..w as i64 {
                            positions[0].push(current + frame);
                            positions[1].push(current + row);
                            positions[2].push(current + col);
                        }
                    }
                }
                current += h.max(w) as i64;
            }
        }
        start = end;
    }
    let largest = positions.iter().flatten().copied().max().unwrap_or(-1);
    Ok(RopeIndex {
        delta: largest + 1 - kinds.len() as i64,
        positions,
    })
}
