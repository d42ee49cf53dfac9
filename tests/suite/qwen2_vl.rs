//! Qwen2-VL: the one decoder with M-RoPE and its vision tower's tokens in the image
//! placeholders' rows, against transformers' `Qwen2VLForConditionalGeneration`
//! (tests/fixtures/make_qwen2_vl_fixture.py): a batch of an image row, another image row of
//! another grid and a text-only row, right-padded.

use burn::tensor::backend::Backend;

use crate::grads::named_grads;
use crate::support::{CpuAutodiff, Reference, assert_close, assert_grad_close, fixture, positions};
use tune::checkpoint::HostTensor;
use tune::model_io::hf::load_model;
use tune::models::multimodal::ImageInput;
use tune::models::{CausalLm, TokenBatch};
use tune::modules::ForwardMode;
use tune::vision::mrope::{TokenKind, rope_index};

struct Batch {
    tokens: Vec<u32>,
    /// Each row's plain positions (what M-RoPE's sections replace where the pass has images).
    positions: Vec<u32>,
    labels: Vec<i64>,
    mask: Vec<i64>,
    batch: usize,
    images: ImageInput,
}

impl Batch {
    /// The pass over the batch, with its images or without.
    fn input(&self, with_images: bool) -> TokenBatch<'_> {
        TokenBatch {
            tokens: &self.tokens,
            positions: &self.positions,
            document_ids: None,
            continued_documents: None,
            left_padding: None,
            padding: None,
            images: with_images.then_some(&self.images),
            batch: self.batch,
        }
    }
}

fn reference_batch<B: Backend>(r: &Reference, model: &CausalLm<B>) -> Batch {
    let (tokens, labels, batch) = r.tokens();
    let grids: Vec<[usize; 3]> = r
        .i64("image_grid_thw")
        .chunks_exact(3)
        .map(|g| [g[0] as usize, g[1] as usize, g[2] as usize])
        .collect();
    let mrope: Vec<u32> = r.i64("position_ids").iter().map(|&p| p as u32).collect();
    let vision = model
        .args
        .vision
        .as_ref()
        .expect("Qwen2-VL reads its vision config");
    let images = ImageInput::new(r.f32("pixel_values").data, grids, mrope, &tokens, vision)
        .expect("the fixture's placeholders match its images");
    Batch {
        positions: positions(batch, tokens.len() / batch),
        tokens,
        labels,
        mask: r.i64("attention_mask"),
        batch,
        images,
    }
}

/// Values at the real (unpadded) positions only: transformers' padded queries attend
/// differently, and nothing reads them.
fn real_positions(t: &HostTensor, mask: &[i64]) -> HostTensor {
    let per = t.data.len() / mask.len();
    let data = t
        .data
        .chunks_exact(per)
        .zip(mask)
        .flat_map(|(row, &m)| row.iter().map(move |&v| if m == 1 { v } else { 0.0 }))
        .collect();
    HostTensor::new(t.shape.clone(), data)
}

/// Logits, loss and all 58 gradients (language model and vision tower) as transformers'.
#[test]
fn qwen2_vl_matches_transformers() {
    type B = CpuAutodiff;
    let r = Reference::open("qwen2_vl.safetensors");
    let device = Default::default();
    let model = load_model::<B>(&fixture("qwen2_vl"), None, &device)
        .unwrap()
        .model;
    assert!(model.visual.is_some(), "the vision tower is the model's");
    let b = reference_batch(&r, &model);
    let input = b.input(true);
    let logits = model.forward(input, ForwardMode::default());
    let got = real_positions(&HostTensor::from_tensor(&logits), &b.mask);
    let want = real_positions(&r.f32("logits"), &b.mask);
    assert_close("logits", &got, &want, 1e-4);
    let loss = tune::training::loss::cross_entropy(logits, &b.labels);
    assert_close(
        "loss",
        &HostTensor::from_tensor(&loss),
        &r.f32("loss"),
        1e-5,
    );

    let grads = loss.backward();
    let named = model.to_hf_layout(named_grads(&model, &grads));
    assert_eq!(named.len(), r.grad_count(), "one gradient per parameter");
    assert!(
        named
            .iter()
            .any(|(n, _)| n == "visual.patch_embed.proj.weight")
    );
    for (name, grad) in named {
        assert_grad_close(&name, &grad, &r.f32(&format!("grad.{name}")));
    }
}

/// Without its images the same model is plain Qwen 2 on the placeholders' own embeddings:
/// the images are what moved the logits (so the test above cannot pass by ignoring them).
#[test]
fn qwen2_vl_images_change_the_logits() {
    type B = crate::support::Cpu;
    let r = Reference::open("qwen2_vl.safetensors");
    let device = Default::default();
    let model = load_model::<B>(&fixture("qwen2_vl"), None, &device)
        .unwrap()
        .model;
    let b = reference_batch(&r, &model);
    let input = b.input(false);
    let without = real_positions(
        &HostTensor::from_tensor(&model.forward(input, ForwardMode::default())),
        &b.mask,
    );
    let want = real_positions(&r.f32("logits"), &b.mask);
    let diff = crate::support::max_abs_diff("logits", &without, &want);
    assert!(diff > 1e-2, "images moved the logits by only {diff}");
    // The text-only row (2) is the same either way.
    let row = |t: &HostTensor| t.data[2 * t.data.len() / 3..].to_vec();
    let (a, w) = (row(&without), row(&want));
    let most = a
        .iter()
        .zip(&w)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    assert!(most < 1e-4, "the text-only row moved by {most}");
}

/// tune's M-RoPE positions are transformers' `get_rope_index` on each row's real tokens.
#[test]
fn qwen2_vl_positions_are_get_rope_index() {
    let r = Reference::open("qwen2_vl.safetensors");
    let (tokens, _, batch) = r.tokens();
    let mask = r.i64("attention_mask");
    let want = r.i64("position_ids");
    let seq = tokens.len() / batch;
    let mut grids = r
        .i64("image_grid_thw")
        .chunks_exact(3)
        .map(|g| [g[0] as usize, g[1] as usize, g[2] as usize])
        .collect::<Vec<_>>()
        .into_iter();
    for row in 0..batch {
        let real = mask[row * seq..(row + 1) * seq]
            .iter()
            .filter(|&&m| m == 1)
            .count();
        let kinds: Vec<TokenKind> = tokens[row * seq..row * seq + real]
            .iter()
            .map(|&t| {
                if t == 120 {
                    TokenKind::Image
                } else {
                    TokenKind::Text
                }
            })
            .collect();
        let got = rope_index(&kinds, &mut grids, 2).unwrap();
        for section in 0..3 {
            let start = (section * batch + row) * seq;
            assert_eq!(
                got.positions[section],
                want[start..start + real],
                "row {row} section {section}"
            );
        }
    }
}

/// A save writes every tensor back under the name, shape and bytes it was read with (the
/// vision tower's Conv3d kernel and merger MLP included), and config.json keeps the wrapper's
/// keys, so transformers loads it into `Qwen2VLForConditionalGeneration` again.
#[test]
fn qwen2_vl_saves_as_it_was_read() {
    use tune::checkpoint::StorageDtype;
    use tune::model_io::hf::{DEFAULT_MAX_SHARD_BYTES, save_model};

    let device = Default::default();
    let source = fixture("qwen2_vl");
    let model = load_model::<crate::support::Cpu>(&source, None, &device)
        .unwrap()
        .model;
    let out = crate::support::temp_dir("qwen2-vl-save");
    save_model(
        &model,
        out.path(),
        Some(&source),
        StorageDtype::F32,
        DEFAULT_MAX_SHARD_BYTES,
    )
    .unwrap();
    let (saved, original) = (
        crate::support::stored_tensors(out.path()),
        crate::support::stored_tensors(&source),
    );
    assert_eq!(
        saved.keys().collect::<Vec<_>>(),
        original.keys().collect::<Vec<_>>()
    );
    for (name, tensor) in &original {
        assert!(saved[name] == *tensor, "{name} changed on the way through");
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["model_type"], "qwen2_vl");
    assert_eq!(config["vision_config"]["depth"], 2);
    assert_eq!(config["image_token_id"], 120);
    assert!(
        out.path().join("preprocessor_config.json").is_file(),
        "the processor's settings go with the model"
    );
}
