//! Images in SFT samples, for a vision-language model (Qwen2-VL): what the dataset keeps of
//! each image, the expansion of the chat template's one placeholder per image into the image's
//! token count, and a batch's pixels and M-RoPE positions.
//!
//! Invariants:
//! - A sample's image placeholders are its images' tokens, in order, and are never trained
//!   (labels `IGNORE_INDEX`), as TRL's and transformers' collators mask them.
//! - An image is never truncated: a sample longer than `max_seq_len` once its images are
//!   expanded is refused, naming the row ([`ImagesError::TooLong`]).
//! - A dataset keeps each image's source and token count, not its pixels: a batch decodes and
//!   processes its images again ([`batch_images`]), so memory does not grow with the dataset.

pub use super::sample::SampleImage;
use super::sample::{IGNORE_INDEX, SftSample};
use crate::models::multimodal::{ImageInput, ImageInputError, VisionArgs};
use crate::vision::mrope::{TokenKind, rope_index};
use crate::vision::qwen2_vl::Qwen2VlImageProcessor;
use crate::vision::{ImageSource, VisionError};

/// How a dataset turns images into tokens for its model: the model's processor settings
/// (preprocessor_config.json) and vision config.
#[derive(Debug, Clone, PartialEq)]
pub struct ImagePlan {
    pub processor: Qwen2VlImageProcessor,
    pub vision: VisionArgs,
}

/// What is wrong with a row's images.
#[derive(Debug, thiserror::Error)]
pub enum ImagesError {
    #[error(transparent)]
    Image(#[from] VisionError),
    #[error(
        "the chat template wrote {placeholders} image placeholders for the row's {images} images; each image part of a message needs its placeholder (a template that renders `{{\"type\": \"image\"}}` parts)"
    )]
    Placeholders { placeholders: usize, images: usize },
    #[error(
        "with its images the sample is {tokens} tokens, more than max_seq_len {max_seq_len}, and an image is never cut; raise tokenizer.max_seq_len, lower the processor's max_pixels (preprocessor_config.json), or drop the row"
    )]
    TooLong { tokens: usize, max_seq_len: usize },
    #[error(
        "the row has images, but the model reads none; train a vision-language checkpoint (Qwen2-VL) or drop the images"
    )]
    NoVisionModel,
    #[error("{at}: {problem}")]
    Source { at: String, problem: String },
    #[error(
        "its `{column}` column holds images, but ShareGPT rows take theirs from the `image` column (torchtune's ShareGPTToMessages); point it there with `column_map: {{image: {column}}}`, or write the rows as OpenAI messages (`conversation_style: openai`)"
    )]
    ShareGptImages { column: String },
    #[error(
        "its first user message has {tags} `{tag}` tags for the row's {images} images; torchtune's image_tag puts one image at each tag, so write one tag per image, or set `image_tag: null` to put the images before the message's text"
    )]
    Tags {
        tag: String,
        tags: usize,
        images: usize,
    },
    #[error("the row has images but no user message to put them in")]
    NoUserMessage,
    #[error(
        "`train_on_input: true` does not apply to ShareGPT rows with images: torchtune masks their prompts whatever it says; set `train_on_input: false`"
    )]
    TrainOnInput,
    #[error(transparent)]
    Input(#[from] ImageInputError),
    #[error(
        "column {column} holds {images} images but the messages have image parts for {parts} of them (one `{{\"type\": \"image\"}}` part without a path per image); add the parts or drop the extra images"
    )]
    Unused {
        column: String,
        images: usize,
        parts: usize,
    },
}

impl ImagePlan {
    /// Decodes `source` (so a corrupt or missing image fails here, naming it) and counts its
    /// tokens at the processor's resolution.
    pub fn sample_image(&self, source: ImageSource) -> Result<SampleImage, ImagesError> {
        let image = source.decode()?;
        let tokens =
            self.processor
                .image_tokens(image.rgb.height, image.rgb.width, &source.name())?;
        Ok(SampleImage { source, tokens })
    }

    /// `sample` (rendered with one placeholder per image) with each placeholder repeated to its
    /// image's token count, none of them trained; refused when longer than `max_seq_len`.
    pub fn expand(
        &self,
        sample: SftSample,
        images: &[SampleImage],
        max_seq_len: Option<usize>,
    ) -> Result<SftSample, ImagesError> {
        let id = self.vision.image_token_id;
        let placeholders = sample.tokens.iter().filter(|&&t| t == id).count();
        if placeholders != images.len() {
            return Err(ImagesError::Placeholders {
                placeholders,
                images: images.len(),
            });
        }
        let extra: usize = images.iter().map(|i| i.tokens.saturating_sub(1)).sum();
        let mut out = SftSample {
            tokens: Vec::with_capacity(sample.len() + extra),
            labels: Vec::with_capacity(sample.len() + extra),
            images: images.to_vec(),
        };
        let mut next = images.iter();
        for (&token, &label) in sample.tokens.iter().zip(&sample.labels) {
            if token == id {
                let n = next.next().map_or(0, |i| i.tokens);
                out.tokens.extend(std::iter::repeat_n(id, n));
                out.labels.extend(std::iter::repeat_n(IGNORE_INDEX, n));
            } else {
                out.tokens.push(token);
                out.labels.push(label);
            }
        }
        if let Some(max) = max_seq_len
            && out.len() > max
        {
            return Err(ImagesError::TooLong {
                tokens: out.len(),
                max_seq_len: max,
            });
        }
        Ok(out)
    }
}

/// A right-padded batch's images: every row's images processed in order, and M-RoPE's three
/// positions of each row's real tokens (`real[i]` of them, from its start) as transformers'
/// `get_rope_index` gives them, padding at position 1 as there.
pub fn batch_images(
    plan: &ImagePlan,
    tokens: &[u32],
    rows: usize,
    real: &[usize],
    images: &[&SampleImage],
) -> Result<ImageInput, ImagesError> {
    let seq = tokens.len() / rows.max(1);
    let mut pixels = Vec::new();
    let mut grids = Vec::with_capacity(images.len());
    for image in images {
        let decoded = image.source.decode()?;
        let patches = plan.processor.process(&decoded, &image.source.name())?;
        pixels.extend_from_slice(&patches.pixel_values);
        grids.push(patches.grid_thw);
    }
    let mut positions = vec![1u32; 3 * tokens.len()];
    let mut next_grid = grids.iter().copied();
    let id = plan.vision.image_token_id;
    for row in 0..rows {
        let start = row * seq;
        let kinds: Vec<TokenKind> = tokens[start..start + real[row]]
            .iter()
            .map(|&t| {
                if t == id {
                    TokenKind::Image
                } else {
                    TokenKind::Text
                }
            })
            .collect();
        let index = rope_index(
            &kinds,
            &mut next_grid,
            plan.vision.encoder.spatial_merge_size,
        )?;
        for (section, values) in index.positions.iter().enumerate() {
            let at = section * tokens.len() + start;
            for (slot, &p) in positions[at..at + values.len()].iter_mut().zip(values) {
                *slot = p as u32;
            }
        }
    }
    Ok(ImageInput::new(
        pixels,
        grids,
        positions,
        tokens,
        &plan.vision,
    )?)
}

/// Where a message part's or an `images` cell's image is: a path (relative to `base`), a
/// `data:` URL, or `{"bytes": ..., "path": ...}` as Hugging Face datasets store images (the bytes
/// base64 in a parquet row as tune reads it). `what` names bytes held in the row, for the errors
/// decoding them later; the error here is the problem alone, for the caller to place.
pub fn image_source(
    value: &serde_json::Value,
    base: &std::path::Path,
    what: &str,
) -> Result<ImageSource, String> {
    use base64::Engine;
    use serde_json::Value;
    let path = |p: &str| -> Result<ImageSource, String> {
        if let Some(data) = p.strip_prefix("data:") {
            let (_, encoded) = data.split_once(";base64,").ok_or_else(|| {
                "a data: URL must be base64 (`data:image/png;base64,...`)".to_string()
            })?;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(encoded.trim())
                .map_err(|e| format!("the data: URL is not valid base64: {e}"))?;
            return Ok(ImageSource::Bytes {
                bytes: bytes.into(),
                name: what.to_string(),
            });
        }
        if p.starts_with("http://") || p.starts_with("https://") {
            return Err(format!(
                "{p} is a URL; tune reads images from local files or the dataset's own bytes (download them, and give their paths)"
            ));
        }
        Ok(ImageSource::Path(base.join(p)))
    };
    match value {
        Value::String(p) => path(p),
        Value::Object(cell) => match (cell.get("bytes"), cell.get("path")) {
            (Some(Value::String(b)), name) => {
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(b)
                    .map_err(|e| {
                        format!("its `bytes` are not base64 as tune reads parquet bytes: {e}")
                    })?;
                let name = match name {
                    Some(Value::String(n)) if !n.is_empty() => format!("{what} ({n})"),
                    _ => what.to_string(),
                };
                Ok(ImageSource::Bytes {
                    bytes: bytes.into(),
                    name,
                })
            }
            (_, Some(Value::String(p))) => path(p),
            _ => Err("an image object needs `bytes` or `path`".to_string()),
        },
        other => Err(format!(
            "expected an image path or {{\"bytes\": ..., \"path\": ...}}, found {other}"
        )),
    }
}
