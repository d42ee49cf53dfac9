//! Golden tests: the decoder against transformers' logits, losses and gradients.

use crate::support;

use crate::grads::named_grads;
use burn::tensor::backend::AutodiffBackend;
use support::*;
use tune::checkpoint::HostTensor;
use tune::model_io::hf::load_model;
use tune::models::TokenBatch;
use tune::modules::ForwardMode;

fn check_model(dir: &str, reference: &str) {
    check_model_on::<CpuAutodiff>(dir, reference, &Default::default());
}

/// Logits, loss and every gradient of the checkpoint in `dir` against `reference`, on `B`.
pub fn check_model_on<B: AutodiffBackend>(dir: &str, reference: &str, device: &B::Device) {
    let r = Reference::open(reference);
    let (tokens, labels, batch) = r.tokens();
    let model = load_model::<B>(&fixture(dir), None, device).unwrap().model;
    let logits = forward_rows(&model, &tokens, batch, ForwardMode::default());
    let loss = assert_logits_and_loss(&r, logits, &labels);
    let grads = loss.backward();
    // in the checkpoint's layout: Phi-3's q/k/v and gate/up gradients fused as its weights are
    let named = model.to_hf_layout(named_grads(&model, &grads));
    assert_eq!(named.len(), r.grad_count(), "one gradient per parameter");
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

/// A packed row (two samples, positions restarting, document ids) gives each sample exactly
/// the logits it gets alone: packed samples never attend to each other.
#[test]
fn packed_samples_do_not_attend_to_each_other() {
    let r = Reference::open("tiny-llama.safetensors");
    let (tokens, _, _) = r.tokens();
    let device = Default::default();
    let model = load_model::<Cpu>(&fixture("tiny-llama"), None, &device)
        .unwrap()
        .model;
    let (a, b) = (&tokens[0..7], &tokens[16..25]);
    let alone = |t: &[u32]| {
        let pos: Vec<u32> = (0..t.len() as u32).collect();
        let input = TokenBatch {
            tokens: t,
            positions: &pos,
            document_ids: None,
            continued_documents: None,
            left_padding: None,
            padding: None,
            images: None,
            batch: 1,
        };
        HostTensor::from_tensor(&model.forward(input, ForwardMode::default()))
    };
    let packed: Vec<u32> = a.iter().chain(b).copied().collect();
    let pos: Vec<u32> = (0..a.len() as u32).chain(0..b.len() as u32).collect();
    let docs: Vec<u32> = std::iter::repeat_n(0, a.len())
        .chain(std::iter::repeat_n(1, b.len()))
        .collect();
    let input = TokenBatch {
        tokens: &packed,
        positions: &pos,
        document_ids: Some(&docs),
        continued_documents: None,
        left_padding: None,
        padding: None,
        images: None,
        batch: 1,
    };
    let both = HostTensor::from_tensor(&model.forward(input, ForwardMode::default()));
    let vocab = 2048;
    let split = a.len() * vocab;
    let first = HostTensor::new(vec![1, a.len(), vocab], both.data[..split].to_vec());
    let second = HostTensor::new(vec![1, b.len(), vocab], both.data[split..].to_vec());
    assert_close("first packed sample", &first, &alone(a), 1e-5);
    assert_close("second packed sample", &second, &alone(b), 1e-5);
}

// Families made by transformers 5.24 (tests/fixtures/make_family_fixtures.py): random tiny
// models with perturbed norm weights, logits, loss and every gradient.

#[test]
fn gemma_matches_transformers() {
    check_model("families/gemma", "family-gemma.safetensors");
}

#[test]
fn mistral_matches_transformers() {
    check_model("families/mistral", "family-mistral.safetensors");
}

#[test]
fn phi3_matches_transformers() {
    check_model("families/phi3", "family-phi3.safetensors");
}

#[test]
fn qwen3_matches_transformers() {
    check_model("families/qwen3", "family-qwen3.safetensors");
}

#[test]
fn gemma2_matches_transformers() {
    check_model("families/gemma2", "family-gemma2.safetensors");
}

#[test]
fn gemma3_matches_transformers() {
    check_model("families/gemma3", "family-gemma3.safetensors");
}

/// SmolLM3's NoPE layers (1 and 3 of 4) attend without rotating q and k: rotating them would
/// move the logits by 2.9 (the fixture script checks that).
#[test]
fn smollm3_matches_transformers() {
    check_model("families/smollm3", "family-smollm3.safetensors");
}

/// Qwen3-MoE: two sparse layers (4 experts, top 2, renormalised) around a dense one
/// (`mlp_only_layers`); every expert's, the router's and the dense MLP's gradients, by the
/// checkpoint's per-expert names.
#[test]
fn qwen3_moe_matches_transformers() {
    check_model("families/qwen3_moe", "family-qwen3_moe.safetensors");
}

/// Qwen2-MoE: probabilities not renormalised, and a shared expert gated by a sigmoid.
#[test]
fn qwen2_moe_matches_transformers() {
    check_model("families/qwen2_moe", "family-qwen2_moe.safetensors");
}

/// Mixtral: `block_sparse_moe` with experts `w1`/`w3`/`w2` on disk.
#[test]
fn mixtral_matches_transformers() {
    check_model("families/mixtral", "family-mixtral.safetensors");
}

/// gpt-oss: attention sinks (their gradient too), biased q/k/v/o, alternating sliding
/// windows, YaRN, a biased router and fused biased experts with the clamped SwiGLU (the clamps
/// bind in the fixture); gradients in the fused layout its checkpoints store.
#[test]
fn gpt_oss_matches_transformers() {
    check_model("families/gpt_oss", "family-gpt_oss.safetensors");
}
