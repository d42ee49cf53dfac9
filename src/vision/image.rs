//! Decoding an image file to 8-bit RGB as Pillow gives it: gray copied to the three channels, a
//! palette looked up, an animated GIF's first frame. Alpha is kept beside the colour, since the
//! references differ on it: Pillow's `convert("RGB")` (torchtune's transforms) drops it, and
//! transformers' `convert_to_rgb` (its processors' `do_convert_rgb`) composites over white.
//!
//! Why the `image` crate: one well-kept crate decodes PNG, JPEG (zune-jpeg), GIF and WebP in
//! pure Rust, with no system library.

use std::path::Path;

use ::image::{DynamicImage, ImageReader};

use super::VisionError;

/// Where an image of a dataset row is: a file, or bytes held in the row (a parquet cell's,
/// as the_cauldron stores them), named for errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSource {
    Path(std::path::PathBuf),
    Bytes {
        bytes: std::sync::Arc<[u8]>,
        /// What errors call it (the cell's `path`, or its file, row and column).
        name: String,
    },
}

impl ImageSource {
    pub fn decode(&self) -> Result<DecodedImage, VisionError> {
        match self {
            Self::Path(path) => DecodedImage::open(path),
            Self::Bytes { bytes, name } => DecodedImage::decode(bytes, name),
        }
    }

    /// What errors call it.
    pub fn name(&self) -> String {
        match self {
            Self::Path(path) => path.display().to_string(),
            Self::Bytes { name, .. } => name.clone(),
        }
    }
}

/// An 8-bit RGB image, rows top to bottom, each pixel `[r, g, b]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: usize,
    pub height: usize,
    /// `height * width * 3` bytes.
    pub data: Vec<u8>,
}

/// A decoded image: its colour as RGB, and its alpha when the file has one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedImage {
    /// The colour with any alpha dropped: Pillow's `convert("RGB")`.
    pub rgb: RgbImage,
    /// `height * width` alpha values (a PNG's alpha or transparent palette entries, a GIF's
    /// transparent index), `None` for an opaque format.
    pub alpha: Option<Vec<u8>>,
}

impl DecodedImage {
    /// Reads and decodes the image file at `path`.
    pub fn open(path: &Path) -> Result<Self, VisionError> {
        let bytes = std::fs::read(path).map_err(|source| VisionError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::decode(&bytes, &path.display().to_string())
    }

    /// Decodes an image held in memory (a parquet cell's bytes); `what` names it in errors.
    pub fn decode(bytes: &[u8], what: &str) -> Result<Self, VisionError> {
        let decode_error = |source| VisionError::Decode {
            what: what.to_string(),
            source,
        };
        let reader = ImageReader::new(std::io::Cursor::new(bytes))
            .with_guessed_format()
            .map_err(|e| decode_error(::image::ImageError::IoError(e)))?;
        // Pillow does not apply EXIF orientation on open (transformers' processors and
        // torchtune's load_image neither): the pixels are used as stored.
        let decoder = reader.into_decoder().map_err(decode_error)?;
        let image = DynamicImage::from_decoder(decoder).map_err(decode_error)?;
        split(image, what)
    }

    /// transformers' `convert_to_rgb`: an image with alpha is composited over opaque white
    /// as Pillow's `alpha_composite` computes it (7 fractional bits, divisions by 255
    /// rounded), an opaque one is its RGB.
    pub fn over_white(&self) -> RgbImage {
        let Some(alpha) = &self.alpha else {
            return self.rgb.clone();
        };
        const PRECISION_BITS: u32 = 7;
        let div255 = |v: u32| ((v >> 8) + v) >> 8;
        let mut data = self.rgb.data.clone();
        for (pixel, &a) in data.chunks_exact_mut(3).zip(alpha) {
            let a = a as u32;
            if a == 0 {
                pixel.fill(255);
                continue;
            }
            // Pillow's ImagingAlphaComposite with the destination opaque white.
            let blend = 255 * (255 - a);
            let outa255 = a * 255 + blend;
            let coef1 = a * 255 * 255 * (1 << PRECISION_BITS) / outa255;
            let coef2 = 255 * (1 << PRECISION_BITS) - coef1;
            for v in pixel.iter_mut() {
                let tmp = *v as u32 * coef1 + 255 * coef2;
                *v = (div255(tmp + (0x80 << PRECISION_BITS)) >> PRECISION_BITS) as u8;
            }
        }
        RgbImage {
            data,
            ..self.rgb.clone()
        }
    }
}

impl RgbImage {
    /// Reads the image file at `path` as Pillow's `Image.open(path).convert("RGB")`.
    pub fn open(path: &Path) -> Result<Self, VisionError> {
        DecodedImage::open(path).map(|d| d.rgb)
    }
}

/// The decoded pixels as RGB and alpha, Pillow's conversions: gray copied to three channels.
fn split(image: DynamicImage, what: &str) -> Result<DecodedImage, VisionError> {
    let (width, height) = (image.width(), image.height());
    if width == 0 || height == 0 {
        return Err(VisionError::Empty {
            what: what.to_string(),
            width,
            height,
        });
    }
    let (data, alpha) = match image {
        DynamicImage::ImageRgb8(rgb) => (rgb.into_raw(), None),
        DynamicImage::ImageRgba8(rgba) => {
            let raw = rgba.into_raw();
            let rgb = raw
                .chunks_exact(4)
                .flat_map(|p| [p[0], p[1], p[2]])
                .collect();
            (rgb, Some(raw.chunks_exact(4).map(|p| p[3]).collect()))
        }
        DynamicImage::ImageLuma8(gray) => (
            gray.into_raw().iter().flat_map(|&v| [v, v, v]).collect(),
            None,
        ),
        DynamicImage::ImageLumaA8(gray) => {
            let raw = gray.into_raw();
            let rgb = raw
                .chunks_exact(2)
                .flat_map(|p| [p[0], p[0], p[0]])
                .collect();
            (rgb, Some(raw.chunks_exact(2).map(|p| p[1]).collect()))
        }
        // Pillow opens 16-bit and float images in modes ("I;16", "I", "F", "RGB" with
        // rounding of its own) whose conversion to RGB clips rather than scales: refused
        // rather than converted differently.
        other => {
            return Err(VisionError::UnsupportedColor {
                what: what.to_string(),
                color: format!("{:?}", other.color()),
            });
        }
    };
    Ok(DecodedImage {
        rgb: RgbImage {
            width: width as usize,
            height: height as usize,
            data,
        },
        alpha,
    })
}
