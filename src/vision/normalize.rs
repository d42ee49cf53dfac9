//! transformers' `rescale` then `normalize`, as numpy runs them: `v * rescale_factor` in f64
//! cast to f32, then `(v - mean) / std` in f32, channels first.

use super::RgbImage;

/// `[3, height, width]` values of `image`.
pub fn channels_first(
    image: &RgbImage,
    rescale_factor: f64,
    mean: &[f32; 3],
    std: &[f32; 3],
) -> Vec<f32> {
    let plane = image.width * image.height;
    let mut out = vec![0.0f32; 3 * plane];
    for (i, pixel) in image.data.chunks_exact(3).enumerate() {
        for c in 0..3 {
            let v = (pixel[c] as f64 * rescale_factor) as f32;
            out[c * plane + i] = (v - mean[c]) / std[c];
        }
    }
    out
}
