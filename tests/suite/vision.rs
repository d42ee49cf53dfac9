//! Images in, as the Python stack reads them: every fixture image decodes to Pillow's RGB, and
//! Qwen2-VL's processor gives transformers' pixel values, grid and image-token counts
//! (tests/fixtures/make_vision_fixtures.py, README "Vision").

use std::sync::OnceLock;

use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use tune::vision::qwen2_vl::Qwen2VlImageProcessor;
use tune::vision::resize::{Filter, resize};
use tune::vision::{DecodedImage, RgbImage, VisionError};

use crate::support::fixture;

fn reference() -> &'static (Vec<u8>, Value) {
    static REFERENCE: OnceLock<(Vec<u8>, Value)> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let bytes = std::fs::read(fixture("reference/vision-pixels.safetensors")).expect("pixels");
        let meta =
            std::fs::read_to_string(fixture("reference/vision-fixtures.json")).expect("json");
        (
            bytes,
            serde_json::from_str(&meta).expect("vision-fixtures.json parses"),
        )
    })
}

/// Tensor `name` of the reference file: its dtype, shape and bytes.
fn tensor(name: &str) -> (Dtype, Vec<usize>, Vec<u8>) {
    let file = SafeTensors::deserialize(&reference().0).expect("safetensors");
    let t = file.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    (t.dtype(), t.shape().to_vec(), t.data().to_vec())
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn cases() -> &'static [Value] {
    reference().1["qwen2_vl"]["cases"]
        .as_array()
        .expect("cases")
}

fn image_file(case: &Value) -> std::path::PathBuf {
    fixture(&format!(
        "images/{}",
        case["image"].as_str().expect("image")
    ))
}

/// Pillow's `convert("RGB")` (gray copied, alpha dropped, palettes looked up, a GIF's first
/// frame) and transformers' `convert_to_rgb` (alpha over white): PNG, GIF and lossless WebP
/// exactly, JPEG within the two decoders' rounding.
#[test]
fn every_image_decodes_to_pillows_rgb() {
    let images = reference().1["images"].as_object().expect("images");
    assert!(images.len() >= 12, "{} images", images.len());
    for (name, file) in images {
        let file = file.as_str().expect("file");
        let decoded = DecodedImage::open(&fixture(&format!("images/{file}")))
            .unwrap_or_else(|e| panic!("{e}"));
        for (conversion, image) in [
            ("rgb", decoded.rgb.clone()),
            ("rgb_over_white", decoded.over_white()),
        ] {
            let (dtype, shape, want) = tensor(&format!("{name}.{conversion}"));
            assert_eq!(dtype, Dtype::U8);
            assert_eq!(shape, vec![image.height, image.width, 3], "{file}");
            let worst = max_level_diff(&image.data, &want);
            let allowed = if file.ends_with(".jpg") {
                JPEG_LEVELS
            } else {
                0
            };
            assert!(
                worst <= allowed,
                "{file} ({conversion}): off by {worst} levels from Pillow"
            );
        }
    }
}

/// zune-jpeg (the `image` crate's JPEG decoder) and libjpeg-turbo (Pillow's) round the inverse
/// DCT and the chroma upsampling differently: at most this many levels apart on the fixture.
const JPEG_LEVELS: u8 = 4;

fn max_level_diff(a: &[u8], b: &[u8]) -> u8 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap_or(0)
}

/// Pillow's BICUBIC, byte for byte, on Pillow's own decoded pixels.
#[test]
fn the_resize_is_pillows_bicubic() {
    let images = reference().1["images"].as_object().expect("images");
    for case in cases() {
        let name = case["case"].as_str().expect("case");
        let image_name = images
            .iter()
            .find(|(_, f)| *f == &case["image"])
            .map(|(n, _)| n.clone())
            .expect("the case's image");
        let (_, shape, rgb) = tensor(&format!("{image_name}.rgb_over_white"));
        let source = RgbImage {
            height: shape[0],
            width: shape[1],
            data: rgb,
        };
        let size = case["resized"].as_array().expect("resized");
        let (h, w) = (
            size[0].as_u64().expect("h") as usize,
            size[1].as_u64().expect("w") as usize,
        );
        let resized =
            resize(&source, w, h, Filter::Bicubic, name).unwrap_or_else(|e| panic!("{e}"));
        let (_, _, want) = tensor(&format!("{name}.resized"));
        let worst = max_level_diff(&resized.data, &want);
        assert_eq!(
            worst, 0,
            "{name}: {}x{} -> {w}x{h} off by {worst} levels",
            source.width, source.height
        );
    }
}

#[test]
fn qwen2_vl_pixels_grids_and_token_counts_are_transformers() {
    for case in cases() {
        let name = case["case"].as_str().expect("case");
        let processor = Qwen2VlImageProcessor {
            min_pixels: case["min_pixels"].as_u64().expect("min") as usize,
            max_pixels: case["max_pixels"].as_u64().expect("max") as usize,
            ..Qwen2VlImageProcessor::default()
        };
        let path = image_file(case);
        let image = DecodedImage::open(&path).unwrap_or_else(|e| panic!("{e}"));
        let what = path.display().to_string();
        let out = processor
            .process(&image, &what)
            .unwrap_or_else(|e| panic!("{e}"));

        let (_, _, grid) = tensor(&format!("{name}.image_grid_thw"));
        let grid: Vec<usize> = grid
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
            .collect();
        assert_eq!(out.grid_thw.to_vec(), grid, "{name}");
        let tokens = case["image_tokens"].as_u64().expect("tokens") as usize;
        assert_eq!(
            processor
                .image_tokens(image.rgb.height, image.rgb.width, &what)
                .unwrap(),
            tokens,
            "{name}"
        );

        let (dtype, shape, want) = tensor(&format!("{name}.pixel_values"));
        assert_eq!(dtype, Dtype::F32);
        assert_eq!(shape, vec![out.patches(), out.patch_dim], "{name}");
        let want = f32s(&want);
        // A JPEG's decoded pixels may differ (see above): one level is 1/255/std, under
        // 0.0151 after normalising.
        let allowed = if path.extension().is_some_and(|e| e == "jpg") {
            JPEG_LEVELS as f32 * 0.0151
        } else {
            0.0
        };
        let worst = out
            .pixel_values
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst <= allowed, "{name}: pixel values off by {worst}");
    }
}

#[test]
fn a_bad_image_is_an_error_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let corrupt = dir.path().join("corrupt.png");
    let mut bytes = std::fs::read(fixture("images/odd.png")).expect("odd.png");
    bytes.truncate(bytes.len() / 2);
    std::fs::write(&corrupt, &bytes).expect("write");
    let err = RgbImage::open(&corrupt).unwrap_err();
    assert!(matches!(err, VisionError::Decode { .. }), "{err:?}");
    assert!(err.to_string().contains("corrupt.png"), "{err}");

    let not_an_image = dir.path().join("notes.txt");
    std::fs::write(&not_an_image, "not an image").expect("write");
    let err = RgbImage::open(&not_an_image).unwrap_err().to_string();
    assert!(
        err.contains("notes.txt") && err.contains("PNG, JPEG, GIF and WebP"),
        "{err}"
    );

    let missing = dir.path().join("missing.jpg");
    let err = RgbImage::open(&missing).unwrap_err().to_string();
    assert!(err.contains("missing.jpg"), "{err}");
}

#[test]
fn gemma3_pixels_and_pan_and_scan_crops_are_transformers() {
    use tune::vision::gemma3::{Gemma3ImageProcessor, PanAndScan};
    let cases = reference().1["gemma3"]["cases"]
        .as_array()
        .expect("gemma3 cases");
    assert!(cases.len() >= 7);
    for case in cases {
        let name = case["case"].as_str().expect("case");
        let settings = &case["settings"];
        let size = settings["size"]["height"].as_u64().expect("size") as usize;
        let pan_and_scan = (settings["do_pan_and_scan"] == true).then(|| PanAndScan {
            min_crop_size: settings["pan_and_scan_min_crop_size"]
                .as_u64()
                .expect("min") as usize,
            max_num_crops: settings["pan_and_scan_max_num_crops"]
                .as_u64()
                .expect("max") as usize,
            min_ratio_to_activate: settings["pan_and_scan_min_ratio_to_activate"]
                .as_f64()
                .expect("ratio"),
        });
        let processor = Gemma3ImageProcessor {
            size,
            pan_and_scan,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
        };
        let path = image_file(case);
        let image = DecodedImage::open(&path).unwrap_or_else(|e| panic!("{e}"));
        let out = processor
            .process(&image, &path.display().to_string())
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            out.num_crops as u64,
            case["num_crops"].as_u64().expect("crops"),
            "{name}"
        );
        let (_, shape, want) = tensor(&format!("{name}.pixel_values"));
        assert_eq!(shape, vec![1 + out.num_crops, 3, size, size], "{name}");
        let want = f32s(&want);
        let differ: Vec<usize> = (0..want.len())
            .filter(|&i| out.pixel_values[i] != want[i])
            .collect();
        assert!(
            differ.is_empty(),
            "{name}: {} of {} pixel values differ, the first at {:?} ({} vs {})",
            differ.len(),
            want.len(),
            differ.first(),
            differ.first().map_or(0.0, |&i| out.pixel_values[i]),
            differ.first().map_or(0.0, |&i| want[i]),
        );
    }
}
