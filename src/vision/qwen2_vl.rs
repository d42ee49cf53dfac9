//! Qwen2-VL's and Qwen2.5-VL's image processor, as transformers' `Qwen2VLImageProcessor`
//! computes it with its Pillow backend: transparency over white, `smart_resize` to a multiple of 28 within
//! `[min_pixels, max_pixels]`, Pillow's BICUBIC, rescale by 1/255, CLIP's mean and std, then
//! 14px patches, each repeated over the temporal patch of 2, ordered 2x2 merge block by block.

use super::normalize::channels_first;
use super::resize::{Filter, resize};
use super::{DecodedImage, VisionError};

/// CLIP's channel means and deviations (transformers' `OPENAI_CLIP_MEAN` / `_STD`), written
/// as transformers writes them; f32 rounds them as numpy's `np.array(mean, dtype=float32)`.
#[allow(clippy::excessive_precision)]
pub const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
#[allow(clippy::excessive_precision)]
pub const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_58, 0.275_777_11];

/// The processor's settings (`preprocessor_config.json`'s names; defaults as transformers').
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2VlImageProcessor {
    /// The fewest pixels an image is resized to (`size.shortest_edge`, 56 * 56).
    pub min_pixels: usize,
    /// The most pixels (`size.longest_edge`, 28 * 28 * 1280).
    pub max_pixels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    /// Pillow's filter (`resample`: 3, BICUBIC).
    pub resample: Filter,
    /// `rescale_factor` (1/255).
    pub rescale_factor: f64,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
}

impl Default for Qwen2VlImageProcessor {
    fn default() -> Self {
        Self {
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            resample: Filter::Bicubic,
            rescale_factor: 1.0 / 255.0,
            image_mean: CLIP_MEAN,
            image_std: CLIP_STD,
        }
    }
}

/// One image's pixels as the vision tower takes them.
#[derive(Debug, Clone, PartialEq)]
pub struct ImagePatches {
    /// `[grid_h * grid_w, 3 * temporal_patch_size * patch_size^2]`, row-major.
    pub pixel_values: Vec<f32>,
    /// Values per patch row of `pixel_values`.
    pub patch_dim: usize,
    /// `image_grid_thw`: `[1, grid_h, grid_w]` (one frame).
    pub grid_thw: [usize; 3],
}

impl ImagePatches {
    pub fn patches(&self) -> usize {
        self.grid_thw.iter().product()
    }
}

impl Qwen2VlImageProcessor {
    /// The multiple both sides are resized to (`patch_size * merge_size`).
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// How many image tokens the text holds for an image of this size (the merged patches).
    pub fn image_tokens(
        &self,
        height: usize,
        width: usize,
        what: &str,
    ) -> Result<usize, VisionError> {
        let (h, w) = smart_resize(
            height,
            width,
            self.factor(),
            (self.min_pixels, self.max_pixels),
            what,
        )?;
        Ok((h / self.patch_size) * (w / self.patch_size) / (self.merge_size * self.merge_size))
    }

    /// `pixel_values` and `image_grid_thw` of one image.
    pub fn process(&self, image: &DecodedImage, what: &str) -> Result<ImagePatches, VisionError> {
        let image = image.over_white();
        let (h, w) = smart_resize(
            image.height,
            image.width,
            self.factor(),
            (self.min_pixels, self.max_pixels),
            what,
        )?;
        let resized = resize(&image, w, h, self.resample, what)?;
        let normalized = channels_first(
            &resized,
            self.rescale_factor,
            &self.image_mean,
            &self.image_std,
        );
        Ok(self.patchify(&normalized, h, w))
    }

    /// transformers' `patchify`: `[C, H, W]` viewed as `[C, gh/m, m, P, gw/m, m, P]`,
    /// transposed to `[gh/m, gw/m, m, m, C, P, P]`, each patch repeated over the temporal
    /// patch (`[.., C, T, P, P]`), flattened to one row per patch.
    fn patchify(&self, chw: &[f32], height: usize, width: usize) -> ImagePatches {
        let (p, m, t) = (self.patch_size, self.merge_size, self.temporal_patch_size);
        let (gh, gw) = (height / p, width / p);
        let patch_dim = 3 * t * p * p;
        let mut out = Vec::with_capacity(gh * gw * patch_dim);
        let plane = height * width;
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let (row0, col0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                        for c in 0..3 {
                            for _ in 0..t {
                                for y in 0..p {
                                    let start = c * plane + (row0 + y) * width + col0;
                                    out.extend_from_slice(&chw[start..start + p]);
                                }
                            }
                        }
                    }
                }
            }
        }
        ImagePatches {
            pixel_values: out,
            patch_dim,
            grid_thw: [1, gh, gw],
        }
    }
}

/// transformers' `smart_resize`: both sides a multiple of `factor`, the area within
/// `[min_pixels, max_pixels]`, the aspect ratio kept as closely as that allows (Python's
/// `round` rounds half to even).
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    (min_pixels, max_pixels): (usize, usize),
    what: &str,
) -> Result<(usize, usize), VisionError> {
    let (hf, wf, ff) = (height as f64, width as f64, factor as f64);
    let ratio = hf.max(wf) / hf.min(wf);
    if ratio > 200.0 {
        return Err(VisionError::AspectRatio {
            what: what.to_string(),
            width,
            height,
            ratio,
        });
    }
    let mut h_bar = (hf / ff).round_ties_even() as usize * factor;
    let mut w_bar = (wf / ff).round_ties_even() as usize * factor;
    if h_bar * w_bar > max_pixels {
        let beta = (hf * wf / max_pixels as f64).sqrt();
        h_bar = factor.max((hf / beta / ff).floor() as usize * factor);
        w_bar = factor.max((wf / beta / ff).floor() as usize * factor);
    } else if h_bar * w_bar < min_pixels {
        let beta = (min_pixels as f64 / (hf * wf)).sqrt();
        h_bar = (hf * beta / ff).ceil() as usize * factor;
        w_bar = (wf * beta / ff).ceil() as usize * factor;
    }
    Ok((h_bar, w_bar))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_rounds_half_to_even_and_keeps_within_the_bounds() {
        let bounds = (56 * 56, 28 * 28 * 1280);
        // 42 / 28 = 1.5 rounds to 2 (half to even), 70 / 28 = 2.5 to 2.
        assert_eq!(smart_resize(42, 70, 28, bounds, "x").unwrap(), (56, 56));
        // Too small: grown to at least min_pixels.
        assert_eq!(smart_resize(5, 7, 28, bounds, "x").unwrap(), (56, 84));
        // Too large: shrunk under max_pixels.
        let (h, w) = smart_resize(4000, 3000, 28, bounds, "x").unwrap();
        assert!(h * w <= bounds.1 && h % 28 == 0 && w % 28 == 0, "{h}x{w}");
        let err = smart_resize(1, 201, 28, bounds, "a.png")
            .unwrap_err()
            .to_string();
        assert!(err.contains("a.png") && err.contains("over 200"), "{err}");
    }
}
