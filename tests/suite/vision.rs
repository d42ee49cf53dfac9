//! Images in, as the Python stack reads them: every fixture image decodes to Pillow's RGB, and
//! Qwen2-VL's processor gives transformers' pixel values, grid and image-token counts
//! (tests/fixtures/make_vision_fixtures.py, README "Vision").

use std::sync::OnceLock;

use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use tune::checkpoint::HostTensor;
use tune::vision::preprocessor::{ImageProcessor, PREPROCESSOR_CONFIG};
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

/// The case's processor, read from the preprocessor_config.json transformers saved for it.
fn saved_processor(case: &Value) -> ImageProcessor {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = serde_json::to_string(&case["preprocessor_config"]).expect("json");
    std::fs::write(dir.path().join(PREPROCESSOR_CONFIG), config).expect("write");
    ImageProcessor::read(dir.path()).unwrap_or_else(|e| panic!("{e}"))
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
        let ImageProcessor::Qwen2Vl(processor) = saved_processor(case) else {
            panic!("{name}: not read as Qwen2-VL's processor");
        };
        assert_eq!(
            (processor.min_pixels as u64, processor.max_pixels as u64),
            (
                case["min_pixels"].as_u64().expect("min"),
                case["max_pixels"].as_u64().expect("max")
            ),
            "{name}"
        );
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
    let cases = reference().1["gemma3"]["cases"]
        .as_array()
        .expect("gemma3 cases");
    assert!(cases.len() >= 7);
    for case in cases {
        let name = case["case"].as_str().expect("case");
        let ImageProcessor::Gemma3(processor) = saved_processor(case) else {
            panic!("{name}: not read as Gemma 3's processor");
        };
        let size = processor.size;
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

/// The Hub's files as they are: Qwen2-VL's `min_pixels`/`max_pixels` at the top level and no
/// size, Gemma 3's nulls for what it leaves to the defaults.
#[test]
fn hub_preprocessor_configs_read_with_transformers_defaults() {
    let read = |json: &str| {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(PREPROCESSOR_CONFIG), json).expect("write");
        ImageProcessor::read(dir.path())
    };
    let qwen = read(
        r#"{"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
            "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}"#,
    )
    .unwrap();
    let ImageProcessor::Qwen2Vl(q) = qwen else {
        panic!("{qwen:?}")
    };
    assert_eq!(
        (q.min_pixels, q.max_pixels, q.patch_size, q.merge_size),
        (3136, 12845056, 14, 2)
    );
    assert_eq!(q.resample, Filter::Bicubic);
    assert_eq!(q.rescale_factor, 1.0 / 255.0);

    let gemma = read(
        r#"{"do_convert_rgb": null, "do_normalize": true, "do_pan_and_scan": null, "do_rescale": true,
            "do_resize": true, "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor",
            "image_seq_length": 256, "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": null,
            "pan_and_scan_min_crop_size": null, "pan_and_scan_min_ratio_to_activate": null,
            "processor_class": "Gemma3Processor", "resample": 2, "rescale_factor": 0.00392156862745098,
            "size": {"height": 896, "width": 896}}"#,
    )
    .unwrap();
    let ImageProcessor::Gemma3(g) = gemma else {
        panic!("{gemma:?}")
    };
    assert_eq!(
        (g.size, g.pan_and_scan, g.resample),
        (896, None, Filter::Bilinear)
    );
}

#[test]
fn preprocessor_settings_tune_does_not_carry_out_are_refused_by_name() {
    let read = |json: &str| {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(PREPROCESSOR_CONFIG), json).expect("write");
        ImageProcessor::read(dir.path()).unwrap_err().to_string()
    };
    let cases = [
        (
            r#"{"image_processor_type": "MllamaImageProcessor"}"#,
            "image_processor_type: MllamaImageProcessor",
        ),
        (
            r#"{"image_processor_type": "Qwen2VLImageProcessor", "resample": 1}"#,
            "resample: 1",
        ),
        (
            r#"{"image_processor_type": "Qwen2VLImageProcessor", "do_normalize": false}"#,
            "do_normalize: false",
        ),
        (
            r#"{"image_processor_type": "Qwen2VLImageProcessor", "patch_size": "14"}"#,
            "`patch_size` is \"14\"",
        ),
        (
            r#"{"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 896, "width": 448}}"#,
            "takes a square",
        ),
        ("{not json", "not valid JSON"),
    ];
    for (json, needle) in cases {
        let err = read(json);
        assert!(
            err.contains(PREPROCESSOR_CONFIG) && err.contains(needle),
            "{json}: {err}"
        );
    }
}

#[test]
fn qwen2_vl_mrope_positions_are_transformers_get_rope_index() {
    use tune::vision::mrope::{TokenKind, rope_index};
    let r = &reference().1["qwen2_vl"]["rope_index"];
    let ints = |v: &Value| -> Vec<i64> {
        v.as_array()
            .expect("list")
            .iter()
            .map(|x| x.as_i64().expect("int"))
            .collect()
    };
    let merge = r["spatial_merge_size"].as_u64().expect("merge") as usize;
    let grids: Vec<[usize; 3]> = r["image_grid_thw"]
        .as_array()
        .expect("grids")
        .iter()
        .map(|g| {
            let g = ints(g);
            [g[0] as usize, g[1] as usize, g[2] as usize]
        })
        .collect();
    let mut grids = grids.into_iter();
    let rows = r["token_types"].as_array().expect("rows");
    for (b, row) in rows.iter().enumerate() {
        let mask = ints(&r["attention_mask"][b]);
        let kinds: Vec<TokenKind> = ints(row)
            .iter()
            .zip(&mask)
            .filter(|(_, m)| **m == 1)
            .map(|(&t, _)| {
                if t == 1 {
                    TokenKind::Image
                } else {
                    TokenKind::Text
                }
            })
            .collect();
        let index =
            rope_index(&kinds, &mut grids, merge).unwrap_or_else(|e| panic!("row {b}: {e}"));
        for (section, ours) in index.positions.iter().enumerate() {
            let want: Vec<i64> = ints(&r["position_ids"][section][b])[..kinds.len()].to_vec();
            assert_eq!(ours, &want, "row {b}, section {section}");
        }
        assert_eq!(
            index.delta,
            r["rope_deltas"][b].as_i64().expect("delta"),
            "row {b}"
        );
    }
    assert!(grids.next().is_none(), "every grid used");

    // Placeholders not expanded to the image's size, or more images' tokens than images.
    let kinds = [
        TokenKind::Text,
        TokenKind::Image,
        TokenKind::Image,
        TokenKind::Text,
    ];
    let err = rope_index(&kinds, &mut [[1, 4, 6]].into_iter(), 2)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("2 image tokens at position 1") && err.contains("6 merged patches"),
        "{err}"
    );
    let err = rope_index(&kinds, &mut std::iter::empty(), 2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no image is left"), "{err}");
}

/// The fixture's tower on `B`, its golden file, and the images' grids.
fn qwen2_vl_tower<B: burn::tensor::backend::Backend>() -> (
    tune::models::qwen2_vl_vision::Qwen2VlVision<B>,
    crate::support::Reference,
    Vec<[usize; 3]>,
) {
    use tune::checkpoint::weights::Weights;
    use tune::models::qwen2_vl_vision::{Qwen2VlVision, Qwen2VlVisionArgs};

    let dir = fixture("qwen2_vl_vision");
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("config.json")).expect("config.json"),
    )
    .expect("json");
    let args = Qwen2VlVisionArgs::from_config(&config).unwrap_or_else(|e| panic!("{e}"));
    let mut weights = Weights::open(&dir, None).unwrap_or_else(|e| panic!("{e}"));
    let tower = Qwen2VlVision::<B>::load(&mut weights, "model.visual", args, &Default::default())
        .unwrap_or_else(|e| panic!("{e}"));
    let r = crate::support::Reference::open("qwen2_vl_vision.safetensors");
    let grids = r
        .i64("image_grid_thw")
        .chunks_exact(3)
        .map(|g| [g[0] as usize, g[1] as usize, g[2] as usize])
        .collect();
    (tower, r, grids)
}

/// Qwen2-VL's vision tower against transformers' on two images of other sizes (a 4x6 and a
/// 22x2 grid): every patch's last hidden state and the merged tokens.
#[test]
fn qwen2_vl_vision_tower_is_transformers() {
    use crate::support::{Cpu, assert_close};

    let (tower, r, grids) = qwen2_vl_tower::<Cpu>();
    let device = Default::default();
    let pixels = r.f32("pixel_values");
    let out = tower.forward(pixels.to_tensor::<Cpu, 2>(&device), &grids);
    let got = HostTensor::from_tensor(&out.last_hidden_state);
    assert_close("last_hidden_state", &got, &r.f32("last_hidden_state"), 2e-5);
    let merged = HostTensor::from_tensor(&out.merged);
    assert_eq!(merged.shape, vec![17, 48]);
    assert_close("pooler_output", &merged, &r.f32("pooler_output"), 2e-5);
}

/// Every parameter's gradient of `sum(merged * probe)`, against torch autograd's (31
/// parameters: the patch embedding, 12 per block, the merger's 6).
#[test]
fn qwen2_vl_vision_tower_gradients_are_torchs() {
    use burn::module::Param;
    use burn::tensor::Tensor;
    use tune::modules::linear::Linear;

    use crate::support::{CpuAutodiff, assert_close};
    type B = CpuAutodiff;

    let (tower, r, grids) = qwen2_vl_tower::<B>();
    let device = Default::default();
    let out = tower.forward(r.f32("pixel_values").to_tensor::<B, 2>(&device), &grids);
    let probe: Tensor<B, 2> = r.f32("probe").to_tensor(&device);
    let grads = (out.merged * probe).sum().backward();

    let mut checked = 0;
    let mut check = |name: String, got: HostTensor| {
        let want = r.f32(&format!("grad.model.visual.{name}"));
        let got = got.reshaped(want.shape.clone());
        assert_close(&name, &got, &want, 1e-4);
        checked += 1;
    };
    let grad1 =
        |p: &Param<Tensor<B, 1>>| HostTensor::from_tensor(&p.grad(&grads).expect("a gradient"));
    let grad2 =
        |p: &Param<Tensor<B, 2>>| HostTensor::from_tensor(&p.grad(&grads).expect("a gradient"));
    let weight = |l: &Linear<B>| grad2(l.weight_param().expect("a float weight"));
    let bias = |l: &Linear<B>| grad1(l.bias.as_ref().expect("a bias"));
    check(
        "patch_embed.proj.weight".into(),
        weight(&tower.patch_embed.proj),
    );
    for (i, b) in tower.blocks.iter().enumerate() {
        let p = format!("blocks.{i}");
        for (part, norm) in [("norm1", &b.norm1), ("norm2", &b.norm2)] {
            check(format!("{p}.{part}.weight"), grad1(&norm.weight));
            check(format!("{p}.{part}.bias"), grad1(&norm.bias));
        }
        for (part, linear) in [
            ("attn.qkv", &b.attn.qkv),
            ("attn.proj", &b.attn.proj),
            ("mlp.fc1", &b.mlp.fc1),
            ("mlp.fc2", &b.mlp.fc2),
        ] {
            check(format!("{p}.{part}.weight"), weight(linear));
            check(format!("{p}.{part}.bias"), bias(linear));
        }
    }
    check(
        "merger.ln_q.weight".into(),
        grad1(&tower.merger.ln_q.weight),
    );
    check("merger.ln_q.bias".into(), grad1(&tower.merger.ln_q.bias));
    for (part, linear) in [
        ("merger.mlp.0", &tower.merger.fc1),
        ("merger.mlp.2", &tower.merger.fc2),
    ] {
        check(format!("{part}.weight"), weight(linear));
        check(format!("{part}.bias"), bias(linear));
    }
    assert_eq!(checked, 31, "every parameter's gradient");
}
