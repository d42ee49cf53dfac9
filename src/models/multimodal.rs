//! What a vision-language checkpoint adds to the one decoder: its vision encoder's shape and the
//! tokens that stand for images ([`VisionArgs`], from config.json), the images of one pass
//! ([`ImageInput`]), and where the encoder's tokens go in the sequence ([`place_image_tokens`]).
//!
//! Invariants:
//! - Each image placeholder (`image_token_id`) of a batch, in row-major order, takes the next
//!   merged vision token, as transformers' `masked_scatter`: the data layer checks that their
//!   counts agree before a pass is built ([`ImageInput::new`]).
//! - A placeholder's own embedding row is replaced, never added to, so it takes no gradient.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use serde_json::Value;

use super::qwen2_vl_vision::Qwen2VlVisionArgs;

/// The vision side of a Qwen2-VL checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionArgs {
    pub encoder: Qwen2VlVisionArgs,
    /// The placeholder each merged vision token replaces (`image_token_id`).
    pub image_token_id: u32,
}

impl VisionArgs {
    /// From a Qwen2-VL config.json (transformers' `Qwen2VLConfig` default for the id).
    pub fn from_config(raw: &Value) -> Result<Self, String> {
        let vision = raw.get("vision_config").cloned().unwrap_or(Value::Null);
        let encoder = Qwen2VlVisionArgs::from_config(&vision).map_err(|e| e.to_string())?;
        let image_token_id = match raw.get("image_token_id") {
            None | Some(Value::Null) => 151_655,
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| format!("image_token_id: {v} is not a token id"))?,
        };
        Ok(Self {
            encoder,
            image_token_id,
        })
    }
}

/// The images of one forward pass, in the order their placeholders appear (row by row).
#[derive(Debug, Clone, PartialEq)]
pub struct ImageInput {
    /// The processor's patch rows of every image, concatenated (`[patches, patch_dim]`).
    pub pixels: Vec<f32>,
    /// Each image's `[t, h, w]` in patches (`image_grid_thw`).
    pub grids: Vec<[usize; 3]>,
    /// M-RoPE's temporal, height and width positions, each `[batch * seq]` (transformers'
    /// `position_ids` of shape `[3, batch, seq]`), flattened section by section.
    pub positions: Vec<u32>,
}

/// What is wrong with a pass's images.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ImageInputError {
    #[error(
        "the batch has {placeholders} image placeholder tokens and its images make {tokens} vision tokens"
    )]
    Count { placeholders: usize, tokens: usize },
    #[error(
        "{values} pixel values are not whole patch rows of {patch_dim}, or not the grids' {patches} patches"
    )]
    Pixels {
        values: usize,
        patch_dim: usize,
        patches: usize,
    },
    #[error("M-RoPE positions: {given} values for 3 sections of {tokens} tokens")]
    Positions { given: usize, tokens: usize },
}

impl ImageInput {
    /// Checks the images against the batch's tokens: one merged vision token per placeholder,
    /// whole patch rows, three positions per token.
    pub fn new(
        pixels: Vec<f32>,
        grids: Vec<[usize; 3]>,
        positions: Vec<u32>,
        tokens: &[u32],
        args: &VisionArgs,
    ) -> Result<Self, ImageInputError> {
        let patch_dim = args.encoder.patch_dim();
        let patches = patches_of(&grids);
        if pixels.len() != patches * patch_dim {
            return Err(ImageInputError::Pixels {
                values: pixels.len(),
                patch_dim,
                patches,
            });
        }
        let m = args.encoder.spatial_merge_size;
        let vision_tokens = patches / (m * m);
        let placeholders = tokens.iter().filter(|&&t| t == args.image_token_id).count();
        if placeholders != vision_tokens {
            return Err(ImageInputError::Count {
                placeholders,
                tokens: vision_tokens,
            });
        }
        if positions.len() != 3 * tokens.len() {
            return Err(ImageInputError::Positions {
                given: positions.len(),
                tokens: tokens.len(),
            });
        }
        Ok(Self {
            pixels,
            grids,
            positions,
        })
    }

    pub fn patches(&self) -> usize {
        patches_of(&self.grids)
    }
}

/// The patches of images of these grids.
fn patches_of(grids: &[[usize; 3]]) -> usize {
    grids.iter().map(|[t, h, w]| t * h * w).sum()
}

/// `embeddings` (`[batch * seq, hidden]`) with each `image_token_id` row replaced by the next
/// row of `vision` (`[placeholders, hidden]`): one gather over both, so the gradient of each
/// output row goes to the row it came from.
pub fn place_image_tokens<B: Backend>(
    embeddings: Tensor<B, 2>,
    tokens: &[u32],
    image_token_id: u32,
    vision: Tensor<B, 2>,
) -> Tensor<B, 2> {
    let rows = tokens.len();
    let mut next = rows;
    let index: Vec<i32> = tokens
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            if t == image_token_id {
                next += 1;
                (next - 1) as i32
            } else {
                i as i32
            }
        })
        .collect();
    assert_eq!(
        next - rows,
        vision.dims()[0],
        "ImageInput::new checks one vision token per placeholder"
    );
    let device = embeddings.device();
    let index = Tensor::<B, 1, Int>::from_data(TensorData::new(index, [rows]), &device);
    Tensor::cat(vec![embeddings, vision], 0).select(0, index)
}
