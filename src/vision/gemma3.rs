//! Gemma 3's image processor, as transformers' `Gemma3ImageProcessor` computes it with its
//! Pillow backend: transparency over white, optionally pan and scan (crops of a tall or wide
//! image besides the whole), each resized with Pillow's BILINEAR to the square SigLIP takes,
//! rescaled by 1/255 and normalised with mean and std 0.5.

use super::normalize::channels_first;
use super::resize::{Filter, resize};
use super::{DecodedImage, RgbImage, VisionError};

/// Pan and scan's settings (`preprocessor_config.json`'s `pan_and_scan_*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PanAndScan {
    pub min_crop_size: usize,
    pub max_num_crops: usize,
    pub min_ratio_to_activate: f64,
}

/// The processor's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3ImageProcessor {
    /// The square side every image and crop is resized to (896 on the Hub).
    pub size: usize,
    pub pan_and_scan: Option<PanAndScan>,
    /// Pillow's filter (`resample`: 2, BILINEAR, on the Hub).
    pub resample: Filter,
    /// `rescale_factor` (1/255).
    pub rescale_factor: f64,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
}

/// One image's pixels: the whole image first, then its crops.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3Pixels {
    /// `[1 + num_crops, 3, size, size]`, row-major.
    pub pixel_values: Vec<f32>,
    pub num_crops: usize,
}

impl Gemma3ImageProcessor {
    pub fn process(&self, image: &DecodedImage, what: &str) -> Result<Gemma3Pixels, VisionError> {
        let image = image.over_white();
        let crops = match &self.pan_and_scan {
            Some(pas) => pan_and_scan(&image, pas, what)?,
            None => Vec::new(),
        };
        let mut pixel_values = Vec::with_capacity((1 + crops.len()) * 3 * self.size * self.size);
        for part in std::iter::once(&image).chain(&crops) {
            let resized = resize(part, self.size, self.size, self.resample, what)?;
            pixel_values.extend(channels_first(
                &resized,
                self.rescale_factor,
                &self.image_mean,
                &self.image_std,
            ));
        }
        Ok(Gemma3Pixels {
            pixel_values,
            num_crops: crops.len(),
        })
    }
}

/// transformers' `pan_and_scan`: a wide (or tall) enough image cut into 2 to
/// `max_num_crops` side-by-side crops close to its aspect ratio, none smaller than
/// `min_crop_size`; none otherwise.
fn pan_and_scan(
    image: &RgbImage,
    pas: &PanAndScan,
    what: &str,
) -> Result<Vec<RgbImage>, VisionError> {
    let (h, w) = (image.height as f64, image.width as f64);
    let (long, short, wide) = if w >= h { (w, h, true) } else { (h, w, false) };
    if long / short < pas.min_ratio_to_activate {
        return Ok(Vec::new());
    }
    let crops = ((long / short + 0.5).floor() as usize)
        .min((long / pas.min_crop_size as f64).floor() as usize)
        .max(2)
        .min(pas.max_num_crops);
    let (crops_w, crops_h) = if wide { (crops, 1) } else { (1, crops) };
    let crop_w = (w / crops_w as f64).ceil() as usize;
    let crop_h = (h / crops_h as f64).ceil() as usize;
    if crop_w.min(crop_h) < pas.min_crop_size {
        return Ok(Vec::new());
    }
    let mut out = Vec::with_capacity(crops);
    for row in 0..crops_h {
        for col in 0..crops_w {
            // numpy's slice past the end is cut at the edge.
            let (y0, x0) = (row * crop_h, col * crop_w);
            let (y1, x1) = (
                (y0 + crop_h).min(image.height),
                (x0 + crop_w).min(image.width),
            );
            if y1 <= y0 || x1 <= x0 {
                // transformers fails here too (an empty crop cannot be resized).
                return Err(VisionError::Resize {
                    what: what.to_string(),
                    width: crop_w,
                    height: crop_h,
                    message: format!(
                        "pan and scan's crop {} of {crops} is empty (pan_and_scan_min_crop_size {} is too small for this image)",
                        row * crops_w + col + 1,
                        pas.min_crop_size
                    ),
                });
            }
            let mut data = Vec::with_capacity((y1 - y0) * (x1 - x0) * 3);
            for y in y0..y1 {
                data.extend_from_slice(
                    &image.data[(y * image.width + x0) * 3..(y * image.width + x1) * 3],
                );
            }
            out.push(RgbImage {
                width: x1 - x0,
                height: y1 - y0,
                data,
            });
        }
    }
    Ok(out)
}
