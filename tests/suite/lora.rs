//! Golden tests for LoRA: the fixture PEFT adapter's logits, loss, gradients and one AdamW
//! step against peft + torch, and a byte-exact PEFT round trip.

use crate::support;

use burn::tensor::backend::AutodiffBackend;
use support::*;
use tune::checkpoint::safetensors_io::SafetensorsFile;
use tune::model_io::peft::{AdapterConfig, adapter_state_dict, peft_key, save_adapter};
use tune::modules::ForwardMode;
use tune::training::optimizer::{Optimizer, OptimizerKind, OptimizerSettings};
use tune::training::step;

/// Internal module path of an adapter tensor -> its PEFT key.
fn to_peft(name: &str) -> String {
    let (module, which) = name.rsplit_once(".lora.").unwrap();
    peft_key(module, if which == "a" { 'A' } else { 'B' })
}

#[test]
fn lora_logits_loss_grads_and_adamw_step_match_peft() {
    check_lora_and_adamw_step::<CpuAutodiff>(&Default::default());
}

/// The adapter's logits, loss and gradients, then one AdamW step, against peft + torch, on `B`.
pub fn check_lora_and_adamw_step<B: AutodiffBackend>(device: &B::Device) {
    let r = Reference::open("tiny-llama-lora.safetensors");
    let base = Reference::open("tiny-llama.safetensors");
    let (tokens, labels, batch) = base.tokens();
    let model = lora_model_on::<B>(device);
    let logits = forward_rows(&model, &tokens, batch, ForwardMode::default());
    let loss = assert_logits_and_loss(&r, logits, &labels);

    let grads = loss.backward();
    let named = crate::grads::named_grads(&model, &grads);
    let expected = r.grad_count();
    assert_eq!(named.len(), expected, "gradients exist for adapters only");
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
}

#[test]
fn peft_adapter_round_trips_byte_identical() {
    let mut model = lora_model();
    let dir = temp_dir("peft-roundtrip");
    let config = AdapterConfig::read(&fixture("tiny-llama-lora")).unwrap();
    save_adapter(&mut model, &config, dir.path()).unwrap();
    let original =
        SafetensorsFile::open(&fixture("tiny-llama-lora/adapter_model.safetensors")).unwrap();
    let saved = SafetensorsFile::open(&dir.path().join("adapter_model.safetensors")).unwrap();
    let mut a = original.names();
    let mut b = saved.names();
    a.sort();
    b.sort();
    assert_eq!(a, b, "identical keys");
    for name in &a {
        let x = original.read(name).unwrap();
        let y = saved.read(name).unwrap();
        assert_eq!(x.shape, y.shape, "{name}");
        let xb: Vec<u32> = x.data.iter().map(|v| v.to_bits()).collect();
        let yb: Vec<u32> = y.data.iter().map(|v| v.to_bits()).collect();
        assert_eq!(xb, yb, "{name}: bytes differ");
    }
    let written: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(written["r"], 4);
    assert_eq!(written["peft_type"], "LORA");
    assert_eq!(written["task_type"], "CAUSAL_LM");
}
