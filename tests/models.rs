//! Golden tests: the decoder against transformers' logits, losses and gradients.

mod support;

use support::*;
use tune::checkpoint::HostTensor;
use tune::checkpoint::hf::load_model;
use tune::models::TokenBatch;
use tune::modules::ForwardMode;
use tune::training::{grads::named_grads, loss};

fn check_model(dir: &str, reference: &str) {
    let r = Reference::open(reference);
    let (tokens, labels, batch) = r.tokens();
    let seq = tokens.len() / batch;
    let device = Default::default();
    let model = load_model::<CpuAutodiff>(&fixture(dir), None, &device)
        .unwrap()
        .model;
    let pos = positions(batch, seq);
    let input = TokenBatch {
        tokens: &tokens,
        positions: &pos,
        document_ids: None,
        batch,
    };
    let logits = model.forward(input, ForwardMode::default());
    assert_close(
        "logits",
        &HostTensor::from_tensor(&logits),
        &r.f32("logits"),
        1e-4,
    );
    let loss = loss::cross_entropy(logits, &labels);
    assert_close(
        "loss",
        &HostTensor::from_tensor(&loss),
        &r.f32("loss"),
        1e-4,
    );
    let grads = loss.backward();
    let named = named_grads(&model, &grads);
    let expected: Vec<String> = r
        .names()
        .into_iter()
        .filter(|n| n.starts_with("grad."))
        .collect();
    assert_eq!(named.len(), expected.len(), "one gradient per parameter");
    for (name, grad) in named {
        assert_grad_close(&name, &grad, &r.f32(&format!("grad.{name}")));
    }
}

#[test]
fn tiny_llama_matches_transformers() {
    check_model("tiny-llama", "tiny-llama.safetensors");
}

#[test]
fn tiny_qwen2_matches_transformers() {
    check_model("tiny-qwen2", "tiny-qwen2.safetensors");
}

#[test]
fn sharded_bf16_loads_to_tiny_llama_rounded() {
    let device = Default::default();
    let full = load_model::<Cpu>(&fixture("tiny-llama"), None, &device)
        .unwrap()
        .model
        .hf_state_dict();
    let sharded = load_model::<Cpu>(&fixture("tiny-llama-sharded-bf16"), None, &device)
        .unwrap()
        .model
        .hf_state_dict();
    assert_eq!(full.len(), sharded.len());
    for ((n1, a), (n2, b)) in full.iter().zip(&sharded) {
        assert_eq!(n1, n2);
        let rounded: Vec<f32> = a
            .data
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        assert_eq!(rounded, b.data, "{n1}");
    }
}
