//! Padding-free batches: the SFT and distillation steps run a right-padded batch's real tokens
//! as block-causal packs (`data::unpad`) and must give the padded batch's loss, gradients and
//! validation loss.

use burn::module::AutodiffModule;
use burn::tensor::Tensor;
use tune::data::{Batch, collate_sft, unpad};
use tune::models::{CausalLm, Trainable};
use tune::modules::ForwardMode;
use tune::training::kd::{KdLoss, KdObjective, forward_kl, total_loss};
use tune::training::sft::{SftLoss, loss_and_grads, padding_free, token_batch};
use tune::training::{LossStep, StepInfo, loss, step};

use crate::kd::teacher_on;
use crate::support::*;

const TRAIN: ForwardMode = ForwardMode {
    adapters: true,
    fake_quant: false,
    train: true,
};
const INFO: StepInfo = StepInfo {
    epoch: 0,
    global_step: 0,
    seed: 0,
};

/// Five rows of 5 to 40 tokens: prompts masked, one with trailing ignored labels, one with no
/// counted label at all; padded to 40 (200 positions, 79 of them needed).
fn padded_batch() -> Batch {
    let row = masked_row;
    let mut trailing = row(17, 4, 3);
    trailing.labels[13..].fill(-100);
    let rows = [
        row(5, 0, 1),
        row(40, 9, 2),
        trailing,
        row(5, 5, 4),
        row(21, 0, 5),
    ];
    collate_sft(&rows.iter().collect::<Vec<_>>(), 0)
}

fn full_model() -> CausalLm<CpuAutodiff> {
    tune::model_io::hf::load_model::<CpuAutodiff>(&fixture("tiny-llama"), None, &Default::default())
        .unwrap()
        .model
        .set_trainable(Trainable::All)
}

#[test]
fn the_packs_compute_fewer_positions() {
    let padded = padded_batch();
    let packed = unpad(&padded, 0).expect("padding to drop");
    // Needed: 40, 21, 13 and 5 (the other 5-token row counts nothing): packs [40], [21 + 13 + 5].
    assert_eq!((padded.batch_size, padded.seq_len), (5, 40));
    assert_eq!((packed.batch_size, packed.seq_len), (2, 40));
    assert_eq!(packed.num_trained_tokens, padded.num_trained_tokens);
    // The CPU's fused attention skips hidden tiles: one row of all four.
    let long = padding_free(&full_model(), &padded).expect("padding to drop");
    assert_eq!((long.batch_size, long.seq_len), (1, 79));
}

/// `batch` through the SFT loss exactly as laid out (no packing), and the summed gradients of
/// `loss * weight`.
fn loss_and_grad_values(
    model: &CausalLm<CpuAutodiff>,
    batch: &Batch,
    settings: (bool, usize),
    weight: f64,
) -> (f32, Vec<Vec<f32>>) {
    let (loss, parts) = loss_and_grads(
        model,
        token_batch(batch),
        &batch.labels,
        TRAIN,
        (
            tune::training::activation_checkpointing::Checkpointing::layers_if(settings.0),
            settings.1,
        ),
        0,
        weight,
    );
    let parts = parts.unwrap_or_else(|| vec![(loss.clone() * weight).backward()]);
    let mut acc = step::GradAccumulator::default();
    for g in parts {
        acc.add(model, g);
    }
    (loss.into_scalar(), grad_values(model, acc.take()))
}

/// The SFT step (padding-free inside: one long pack on the CPU) and two-row packs against the padded batch's own loss and gradients,
/// for full fine-tuning and LoRA, with the chunked output and without, and with activation
/// checkpointing.
#[test]
fn sft_step_gives_the_padded_loss_and_gradients() {
    let batch = padded_batch();
    let weight = batch.num_trained_tokens as f64;
    for (name, model) in [("full", full_model()), ("lora", lora_model())] {
        for (checkpointing, chunks) in [(false, 8), (false, 1), (true, 8)] {
            let what = format!("{name}, checkpointing {checkpointing}, {chunks} chunks");
            let settings = (checkpointing, chunks);
            let (want_loss, want) = loss_and_grad_values(&model, &batch, settings, weight);
            // Packs no longer than the rows (what backends whose attention computes every
            // score get): two rows of documents.
            let packs = unpad(&batch, 0).unwrap();
            let (loss, grads) = loss_and_grad_values(&model, &packs, settings, weight);
            assert!(
                (loss - want_loss).abs() < 1e-5,
                "{what}, packs: {loss} vs {want_loss}"
            );
            assert_same_grads(&want, &grads);

            let mut sft = SftLoss {
                fake_quant_after: None,
                activation_checkpointing:
                    tune::training::activation_checkpointing::Checkpointing::layers_if(
                        checkpointing,
                    ),
                output_chunks: chunks,
                padding_free: true,
            };
            let out = sft.step(&model, &batch, INFO).unwrap();
            assert_eq!(out.weight, batch.num_trained_tokens, "{what}");
            // torchtune's num_tokens: labels that are not -100, unshifted (5 + 31 + 9 + 21).
            assert_eq!(out.tokens, 66, "{what}");
            let got_loss: f32 = out.loss.clone().into_scalar();
            assert!(
                (got_loss - want_loss).abs() < 1e-5,
                "{what}: loss {got_loss} vs padded {want_loss}"
            );
            let got = step_grads(&model, out);
            if name == "full" {
                // Embeddings (tied) and the final norm, then 7 projections and 2 norms a layer.
                assert_eq!(got.len(), 2 + 9 * model.args.num_layers, "{what}");
            }
            assert_same_grads(&want, &got);
        }
    }
}

#[test]
fn sft_validation_gives_the_padded_loss() {
    let batch = padded_batch();
    let model = lora_model().valid();
    let mode = ForwardMode {
        train: false,
        ..TRAIN
    };
    let hidden = model.hidden(token_batch(&batch), mode, None);
    let want: f32 = loss::chunked_cross_entropy(&model, hidden, &batch.labels, mode) as f32;
    let got =
        LossStep::<CpuAutodiff>::evaluate(&mut SftLoss::default(), &model, &batch, INFO).unwrap();
    assert_eq!(got.weight, batch.num_trained_tokens);
    assert!(
        (got.loss as f32 - want).abs() < 1e-5,
        "{} vs {want}",
        got.loss
    );
}

/// The distillation step (both models padding-free) against the padded batch's total loss,
/// its class and KD parts, and the student's LoRA gradients.
#[test]
fn kd_step_gives_the_padded_losses_and_gradients() {
    let batch = padded_batch();
    let model = lora_model();
    let mut kd = KdLoss::<CpuAutodiff> {
        teacher: teacher_on::<Cpu>(&Default::default()),
        objective: KdObjective::ForwardKl,
        kd_ratio: 0.5,
        activation_checkpointing: tune::training::activation_checkpointing::Checkpointing::Off,
    };
    let teacher_logits = kd.teacher_logits(&batch);
    let student_logits = model.forward(token_batch(&batch), TRAIN);
    let class: Tensor<CpuAutodiff, 1> = loss::cross_entropy(student_logits.clone(), &batch.labels);
    let kd_part = forward_kl(student_logits, teacher_logits, &batch.labels);
    let (want_class, want_kd): (f32, f32) =
        (class.clone().into_scalar(), kd_part.clone().into_scalar());
    let total = total_loss(class, kd_part, 0.5);
    let weight = batch.num_trained_tokens as f64;
    let mut acc = step::GradAccumulator::default();
    acc.add(&model, (total.clone() * weight).backward());
    let want = grad_values(&model, acc.take());
    let want_total: f32 = total.into_scalar();

    let out = kd.step(&model, &batch, INFO).unwrap();
    let close = |what: &str, got: f64, want: f32| {
        assert!(
            (got as f32 - want).abs() < 1e-5,
            "{what}: {got} vs padded {want}"
        );
    };
    close("class_loss", out.metric("class_loss").unwrap(), want_class);
    close("kd_loss", out.metric("kd_loss").unwrap(), want_kd);
    close("loss", out.loss.clone().into_scalar() as f64, want_total);
    assert_eq!(out.tokens, 66);
    assert_same_grads(&want, &step_grads(&model, out));
}
