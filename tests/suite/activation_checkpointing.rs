//! Activation checkpointing: the per-layer recomputation gives the gradients of a plain
//! backward pass (LoRA adapters and full fine-tuning with tied embeddings), with each layer's
//! input kept on the device or offloaded to host memory, and the recipe trains with it.

use crate::support;

use support::*;
use tune::model_io::hf::load_model;
use tune::models::{CausalLm, TokenBatch, Trainable};
use tune::modules::ForwardMode;
use tune::training::{activation_checkpointing, loss, step};

fn compare_with_plain_backward(model: CausalLm<CpuAutodiff>, expected_params: usize) {
    let r = Reference::open("tiny-llama.safetensors");
    let (tokens, labels, batch) = r.tokens();
    let pos = positions(batch, tokens.len() / batch);
    let input = TokenBatch {
        tokens: &tokens,
        positions: &pos,
        document_ids: None,
        continued_documents: None,
        left_padding: None,
        padding: None,
        images: None,
        batch,
    };
    let mode = ForwardMode {
        train: true,
        ..ForwardMode::default()
    };
    let weight = 3.0;

    let plain_loss = loss::cross_entropy(model.forward(input, mode), &labels);
    let mut acc = step::GradAccumulator::default();
    acc.add(&model, (plain_loss.clone() * weight).backward());
    let plain = grad_values(&model, acc.take());

    let head = |head: &tune::models::decoder::OutputHead<_>, top| {
        let logits = head.logits(head.norm(top), mode);
        let loss = loss::cross_entropy(logits, &labels);
        let grads = (loss.clone() * weight).backward();
        (loss, vec![grads])
    };
    let a: f32 = plain_loss.into_scalar();
    assert_eq!(
        plain.len(),
        expected_params,
        "trainable parameters with gradients"
    );
    // Each layer's input kept on the device, or offloaded to host memory and brought back one
    // layer ahead of its backward: the same loss and gradients.
    for offload in [false, true] {
        let (ckpt_loss, parts) =
            activation_checkpointing::forward_backward(&model, input, mode, offload, 7, head);
        assert!(
            parts.len() > model.args.num_layers,
            "one backward per layer plus the head"
        );
        let mut acc = step::GradAccumulator::default();
        for g in parts {
            acc.add(&model, g);
        }
        let ckpt = grad_values(&model, acc.take());
        let b: f32 = ckpt_loss.into_scalar();
        assert!((a - b).abs() < 1e-6, "offload {offload}: loss {a} vs {b}");
        assert_same_grads(&plain, &ckpt);
    }
}

#[test]
fn lora_gradients_equal_a_plain_backward() {
    let model = lora_model();
    // The fixture adapts q, k, v, o, gate and up: A and B for each.
    let adapters = model.args.num_layers * 6 * 2;
    compare_with_plain_backward(model, adapters);
}

#[test]
fn full_gradients_equal_a_plain_backward_including_tied_embeddings() {
    let device = Default::default();
    let model = load_model::<CpuAutodiff>(&fixture("tiny-llama"), None, &device)
        .unwrap()
        .model
        .set_trainable(Trainable::All);
    assert!(model.lm_head.is_none(), "the fixture ties its embeddings");
    // Per layer: 7 projections and 2 norms; plus embeddings and the final norm.
    let params = model.args.num_layers * 9 + 2;
    compare_with_plain_backward(model, params);
}

#[test]
fn the_recipe_trains_with_checkpointing_and_matches_the_plain_losses() {
    let run = |tag: &str, extra: &[&str]| {
        let out = temp_dir(tag);
        let mut args = vec!["max_steps_per_epoch=12", "batch_size=2"];
        args.extend_from_slice(extra);
        let metrics = run_recipe(
            "lora_finetune_single_device",
            "tiny/lora_single_device",
            &out,
            &args,
        );
        column(&metrics, "loss")
    };
    let plain = run("ac-plain", &[]);
    let ckpt = run("ac-on", &["enable_activation_checkpointing=true"]);
    assert_eq!(plain.len(), ckpt.len());
    for (a, b) in plain.iter().zip(&ckpt) {
        assert!(
            (a - b).abs() < 1e-3,
            "losses diverge: {plain:?} vs {ckpt:?}"
        );
    }
    assert!(
        mean(&ckpt[9..]) < mean(&ckpt[..3]) - 0.5,
        "loss falls: {ckpt:?}"
    );
}
