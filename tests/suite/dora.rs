//! Golden tests for DoRA (peft's `use_dora`, torchtune's `DoRALinear`): the fixture adapter's
//! logits, loss, gradients of A, B and the magnitudes, one AdamW step and the merged weights
//! against peft + torch (tests/fixtures/make_dora_fixtures.py); the magnitude a fresh adapter
//! starts from; greedy decoding with the adapter equal to peft's; a byte-exact PEFT round trip.

use crate::support;

use burn::tensor::backend::AutodiffBackend;
use support::*;
use tune::checkpoint::safetensors_io::SafetensorsFile;
use tune::model_io::peft::{
    AdapterConfig, adapter_state_dict, load_adapter, magnitude_key, save_adapter,
};
use tune::modules::ForwardMode;
use tune::training::optimizer::{Optimizer, OptimizerKind, OptimizerSettings};
use tune::training::step;

fn dora_model() -> tune::models::CausalLm<CpuAutodiff> {
    dora_model_on(&Default::default())
}

fn dora_model_on<B: AutodiffBackend>(device: &B::Device) -> tune::models::CausalLm<B> {
    let mut model = tune::model_io::hf::load_model::<B>(&fixture("tiny-llama"), None, device)
        .unwrap()
        .model;
    let config = load_adapter(&mut model, &fixture("tiny-llama-dora")).unwrap();
    assert!(config.use_dora);
    model.set_trainable(tune::models::Trainable::AdaptersOnly)
}

#[test]
fn dora_logits_loss_grads_adamw_step_and_merge_match_peft() {
    check_dora::<CpuAutodiff>(&Default::default());
}

/// Logits, loss, gradients of A, B and the magnitudes, one AdamW step and the merged weights
/// against peft, on `B`.
pub fn check_dora<B: AutodiffBackend>(device: &B::Device) {
    let r = Reference::open("tiny-llama-dora.safetensors");
    let base = Reference::open("tiny-llama.safetensors");
    let (tokens, labels, batch) = base.tokens();
    let model = dora_model_on::<B>(device);
    let logits = forward_rows(&model, &tokens, batch, ForwardMode::default());
    let loss = assert_logits_and_loss(&r, logits, &labels);

    let grads = loss.backward();
    let named = crate::grads::named_grads(&model, &grads);
    assert_eq!(
        named.len(),
        r.grad_count(),
        "gradients of A, B and magnitude only"
    );
    assert!(named.iter().any(|(n, _)| n.ends_with(".lora.magnitude")));
    for (name, grad) in &named {
        assert_grad_close(name, grad, &r.f32(&format!("grad.{}", to_peft(name))));
    }

    let mut acc = step::GradAccumulator::default();
    acc.add(&model, grads);
    let settings = OptimizerSettings {
        kind: OptimizerKind::AdamW,
        weight_decay: 0.01,
        betas: (0.9, 0.999),
        eps: 1e-8,
        momentum: 0.0,
    };
    let mut opt = Optimizer::new(settings);
    let mut model = step::apply(model, acc.take(), &mut opt, (1e-3, 1.0), None);
    for (key, value) in adapter_state_dict(&mut model) {
        let want = r.f32(&format!("after_adamw_step.{key}"));
        assert_close(&key, &value, &want, 1e-6);
    }

    // The merged export of the fixture adapter (before the step) equals peft's merge_and_unload.
    let mut fresh = dora_model_on::<B>(device);
    let merged = fresh.merged_hf_state_dict();
    let mut checked = 0;
    for (name, value) in &merged {
        if let Ok(want) = r.0.read(&format!("merged.{name}")) {
            assert_close(&format!("merged {name}"), value, &want, 1e-5);
            checked += 1;
        }
    }
    assert_eq!(checked, 2 * 6, "q/v/o/gate/up/down of both layers");
}

/// A fresh DoRA adapter starts with the magnitude peft computes: the row norms of the adapted
/// weight (`init_magnitude.*`, for the fixture's A and B).
#[test]
fn dora_magnitude_starts_at_the_adapted_weights_row_norms() {
    let r = Reference::open("tiny-llama-dora.safetensors");
    let mut model = dora_model();
    for (module, linear) in model.linears_mut() {
        let Some(lora) = linear.lora.take() else {
            continue;
        };
        let fresh = lora.with_magnitude(linear.base_weight(), None);
        let got = tune::checkpoint::HostTensor::from_tensor(&fresh.magnitude.unwrap().val());
        let key = magnitude_key(&module);
        assert_close(&key, &got, &r.f32(&format!("init_magnitude.{key}")), 1e-5);
    }
}

#[test]
fn greedy_decoding_with_a_dora_adapter_matches_peft() {
    let text = std::fs::read_to_string(fixture("reference/tiny-llama-dora-greedy.json")).unwrap();
    let want: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        want[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    let device = Default::default();
    let mut model = tune::model_io::hf::load_model::<Cpu>(&fixture("tiny-llama"), None, &device)
        .unwrap()
        .model;
    load_adapter(&mut model, &fixture("tiny-llama-dora")).unwrap();
    let prompt = ids("prompt_ids");
    let opts = tune::generation::GenerateOptions {
        max_new_tokens: want["max_new_tokens"].as_u64().unwrap() as usize,
        sampling: tune::generation::SamplingParams::GREEDY,
        seed: 0,
        stop_ids: vec![],
        stop_at_eos: false,
        use_kv_cache: true,
    };
    let out = tune::generation::generate(&model, &prompt, &opts, |_| {}).unwrap();
    assert_eq!(out.tokens, ids("greedy_output_ids")[prompt.len()..]);
}

#[test]
fn dora_adapter_round_trips_byte_identical() {
    let mut model = dora_model();
    let dir = temp_dir("dora-roundtrip");
    let config = AdapterConfig::read(&fixture("tiny-llama-dora")).unwrap();
    save_adapter(&mut model, &config, dir.path()).unwrap();
    let original =
        SafetensorsFile::open(&fixture("tiny-llama-dora/adapter_model.safetensors")).unwrap();
    let saved = SafetensorsFile::open(&dir.path().join("adapter_model.safetensors")).unwrap();
    let (mut a, mut b) = (original.names(), saved.names());
    a.sort();
    b.sort();
    assert_eq!(a, b, "identical keys");
    for name in &a {
        let (x, y) = (original.read(name).unwrap(), saved.read(name).unwrap());
        assert_eq!(x.shape, y.shape, "{name}");
        assert!(
            x.data
                .iter()
                .zip(&y.data)
                .all(|(p, q)| p.to_bits() == q.to_bits()),
            "{name}: bytes differ"
        );
    }
    let written: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(written["use_dora"], true);
}
