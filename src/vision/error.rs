//! What can go wrong reading an image or preparing its pixels.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum VisionError {
    #[error("cannot read image {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("image {what} cannot be decoded: {source} (tune reads PNG, JPEG, GIF and WebP)")]
    Decode {
        what: String,
        #[source]
        source: ::image::ImageError,
    },
    #[error(
        "image {what} has {color} pixels, which tune does not convert as Pillow would; save it as 8-bit RGB (e.g. `Image.open(p).convert(\"RGB\").save(q)`)"
    )]
    UnsupportedColor { what: String, color: String },
    #[error("image {what} is {width}x{height}: an image needs at least one pixel")]
    Empty {
        what: String,
        width: u32,
        height: u32,
    },
    #[error(
        "image {what} is {width}x{height}: its aspect ratio {ratio:.1} is over 200, which Qwen2-VL's processor refuses too; crop it"
    )]
    AspectRatio {
        what: String,
        width: usize,
        height: usize,
        ratio: f64,
    },
    #[error(
        "{tokens} image tokens at position {at}{}",
        match expected {
            Some(n) => format!(" but their image's grid has {n} merged patches: the placeholders were not expanded for this image"),
            None => " but no image is left for them: the row has more images' tokens than images".to_string(),
        }
    )]
    ImageTokens {
        at: usize,
        tokens: usize,
        expected: Option<usize>,
    },
    #[error("image {what}: resizing to {width}x{height} failed: {message}")]
    Resize {
        what: String,
        width: usize,
        height: usize,
        message: String,
    },
}
