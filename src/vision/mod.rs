//! Images in: decoded and converted to RGB as Pillow does (`image`), resized with Pillow's
//! filters (`resize`), and turned into the pixels each vision encoder takes, as the reference
//! processors make them (`qwen2_vl`, `gemma3`: transformers' image processors).
//!
//! Invariants: the same file gives the pixels the reference Python stack gives (PNG, GIF,
//! lossless WebP exactly; JPEG within libjpeg-turbo's and zune-jpeg's rounding, see the tests);
//! a bad image is an error naming it, never a panic.

pub mod error;
pub mod gemma3;
pub mod image;
pub mod mrope;
mod normalize;
pub mod preprocessor;
pub mod qwen2_vl;
pub mod resize;

pub use error::VisionError;
pub use image::{DecodedImage, ImageSource, RgbImage};
