//! The chunked output projection and cross-entropy: the same loss and gradients as the plain
//! loss, alone and under activation checkpointing, and the same training run.

use crate::lora_recipes::lora_run;
use crate::support;

use support::*;
use tune::model_io::hf::load_model;
use tune::models::{CausalLm, TokenBatch, Trainable};
use tune::modules::ForwardMode;
use tune::training::{activation_checkpointing, chunked_loss, loss, step};

const MODE: ForwardMode = ForwardMode {
    adapters: true,
    fake_quant: false,
    train: true,
};

/// Uneven chunks over all rows, so a chunk boundary falls inside a sequence.
fn uneven_chunks(rows: usize) -> Vec<std::ops::Range<usize>> {
    vec![0..5, 5..13, 13..rows]
}

fn summed(
    model: &CausalLm<CpuAutodiff>,
    parts: Vec<<CpuAutodiff as burn::tensor::backend::AutodiffBackend>::Gradients>,
) -> Vec<Vec<f32>> {
    let mut acc = step::GradAccumulator::default();
    for g in parts {
        acc.add(model, g);
    }
    grad_values(model, acc.take())
}

#[test]
fn chunked_cross_entropy_gives_the_plain_loss_and_gradients() {
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
    let model = lora_model();
    assert!(!chunked_loss::output_projection_trains(&model));
    let weight = 3.0;

    let plain_loss = loss::cross_entropy(model.forward(input, MODE), &labels);
    let plain = summed(&model, vec![(plain_loss.clone() * weight).backward()]);
    let plain_loss: f32 = plain_loss.into_scalar();

    let chunks = uneven_chunks(tokens.len());
    let (loss, parts) = chunked_loss::cross_entropy_backward(
        &model.head(),
        model.hidden(input, MODE, None),
        &labels,
        MODE,
        weight,
        &chunks,
    );
    assert_eq!(
        parts.len(),
        chunks.len() + 1,
        "one backward per chunk, then the body"
    );
    let chunked = summed(&model, parts);
    let chunked_loss: f32 = loss.into_scalar();
    assert!(
        (plain_loss - chunked_loss).abs() < 1e-5,
        "loss {plain_loss} vs {chunked_loss}"
    );
    assert_eq!(
        plain.len(),
        model.args.num_layers * 6 * 2,
        "every adapter has a gradient"
    );
    assert_same_grads(&plain, &chunked);

    // The same head under per-layer recomputation.
    let (loss, parts) =
        activation_checkpointing::forward_backward(&model, input, MODE, false, 7, |head, top| {
            chunked_loss::cross_entropy_backward(
                head,
                head.norm(top),
                &labels,
                MODE,
                weight,
                &chunks,
            )
        });
    let both: f32 = loss.into_scalar();
    assert!(
        (plain_loss - both).abs() < 1e-5,
        "loss {plain_loss} vs {both}"
    );
    assert_same_grads(&plain, &summed(&model, parts));
}

#[test]
fn full_fine_tuning_keeps_the_unchunked_loss() {
    let device = Default::default();
    let model = load_model::<CpuAutodiff>(&fixture("tiny-llama"), None, &device)
        .unwrap()
        .model
        .set_trainable(Trainable::All);
    // Tied embeddings train: every chunk would carry a full embedding gradient.
    assert!(chunked_loss::output_projection_trains(&model));
}

#[test]
fn the_lora_recipe_gives_the_same_losses_chunked_or_not() {
    // 8 rows of up to 512 tokens: more than one 256-row chunk per step.
    let args = [
        "batch_size=8",
        "max_steps_per_epoch=4",
        "tokenizer.max_seq_len=512",
    ];
    let (a, b) = (temp_dir("chunks-8"), temp_dir("chunks-1"));
    let chunked = column(&lora_run(&a, &args), "loss");
    let plain = column(
        &lora_run(&b, &[&args[..], &["loss.num_output_chunks=1"]].concat()),
        "loss",
    );
    assert_eq!(chunked.len(), 4);
    for (x, y) in chunked.iter().zip(&plain) {
        assert!(
            (x - y).abs() < 1e-4,
            "losses differ: {chunked:?} vs {plain:?}"
        );
    }
}
