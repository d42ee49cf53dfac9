//! GRPO's and PPO's passes over rollouts with each prompt computed once for all its
//! completions (`training::rollout_pack`) must give the rows' log-probabilities, loss and
//! gradients, run as collated.

use burn::tensor::{Tensor, TensorData};
use tune::models::{CausalLm, Trainable};
use tune::modules::ForwardMode;
use tune::training::activation_checkpointing::Checkpointing;
use tune::training::grpo::{GrpoLoss, score_input};
use tune::training::grpo_loss::{GrpoObjective, TorchtuneGrpoLoss, TorchtuneGrpoSettings};
use tune::training::rollout_pack::RolloutInput;
use tune::training::rollouts::{RolloutRow, Rollouts, collate_rollouts};
use tune::training::{LossStep, StepInfo};

use crate::support::*;

const TRAIN: ForwardMode = ForwardMode {
    adapters: true,
    fake_quant: true,
    train: true,
};
const SCORING: ForwardMode = ForwardMode {
    adapters: true,
    fake_quant: true,
    train: false,
};
const TEMPERATURE: f64 = 0.7;

/// Two prompts with three completions each, of different lengths: one of a single token,
/// one truncated and not counted (`mask_truncated_completions`).
fn rollouts() -> Rollouts {
    let (p1, p2) = (vec![1u32, 15, 27, 300, 42], vec![1u32, 99, 7]);
    let completions: [Vec<u32>; 6] = [
        vec![5, 6, 7, 8],
        vec![9],
        vec![10, 11, 12, 13, 14, 15],
        vec![16, 17],
        vec![18, 19, 20],
        vec![21, 22, 23, 24],
    ];
    let prompts = [&p1, &p1, &p1, &p2, &p2, &p2];
    let rows: Vec<RolloutRow<'_>> = prompts
        .iter()
        .zip(&completions)
        .enumerate()
        .map(|(i, (prompt, completion))| RolloutRow {
            prompt,
            completion,
            counts: i != 4,
        })
        .collect();
    let mut r = collate_rollouts(&rows, 0);
    r.advantages = vec![0.5, -1.0, 0.25, 1.5, -0.5, -0.75];
    r
}

fn full_model() -> CausalLm<CpuAutodiff> {
    tune::model_io::hf::load_model::<CpuAutodiff>(&fixture("tiny-llama"), None, &Default::default())
        .unwrap()
        .model
        .set_trainable(Trainable::All)
}

/// Per-token values `[rows, width]` as a flat vector.
fn values(t: Tensor<CpuAutodiff, 2>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

/// `input`'s completion log-probabilities, and the gradients of their sum weighted per token.
fn scored(
    model: &CausalLm<CpuAutodiff>,
    r: &Rollouts,
    input: &RolloutInput,
    mode: ForwardMode,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let lp = score_input(model, r, input, mode, TEMPERATURE);
    let [rows, width] = lp.dims();
    let weights: Vec<f32> = (0..rows * width)
        .map(|i| ((i * 7) % 5) as f32 - 2.0)
        .collect();
    let weights = Tensor::<CpuAutodiff, 2>::from_data(
        TensorData::new(weights, [rows, width]),
        &Default::default(),
    );
    let grads = (lp.clone() * weights).sum().backward();
    let grads = burn::optim::GradientsParams::from_grads(grads, model);
    (values(lp), grad_values(model, grads))
}

#[test]
fn each_prompt_once_gives_every_rows_log_probabilities_and_gradients() {
    let r = rollouts();
    for (name, model) in [("full", full_model()), ("lora", lora_model())] {
        let rows = RolloutInput::rows(&r);
        let packed = RolloutInput::of(&model, &r, TRAIN);
        // Two prompts of 5 and 3 tokens and the completions less their last token (the
        // uncounted one left out): 5 + 3 + 0 + 5 + 3 + 1 + 3 = 20 positions, against
        // 6 rows of 11.
        assert_eq!((rows.positions(), packed.positions()), (66, 20), "{name}");
        for mode in [TRAIN, SCORING] {
            let (want, want_grads) = scored(&model, &r, &rows, mode);
            let (got, got_grads) = scored(&model, &r, &packed, mode);
            let diff = want
                .iter()
                .zip(&got)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(diff < 1e-5, "{name}: log-probabilities differ by {diff}");
            // Counted positions are real log-probabilities (the padding's are 1.0).
            assert!(want.iter().filter(|&&v| v < 0.0).count() >= 10, "{want:?}");
            assert_same_grads(&want_grads, &got_grads);
        }
    }
}

/// A GRPO update (torchtune's clipped per-token loss with its KL term, so old and reference
/// log-probabilities are read too) through shared prompts and through the rows: the same loss
/// and gradients, with activation checkpointing and without.
#[test]
fn a_grpo_update_with_each_prompt_once_makes_the_rows_update() {
    let model = lora_model();
    let mut r = rollouts();
    let rows_input = RolloutInput::rows(&r);
    let policy = values(score_input(&model, &r, &rows_input, SCORING, TEMPERATURE));
    r.old_log_probs = Some(policy.iter().map(|v| v - 0.05).collect());
    r.ref_log_probs = Some(policy.iter().map(|v| v + 0.1).collect());
    let batch = r.batch.clone();
    let info = StepInfo {
        epoch: 0,
        global_step: 0,
        seed: 0,
    };
    for checkpointing in [false, true] {
        let update = |share_prompts: bool| {
            let mut loss = GrpoLoss {
                loss: GrpoObjective::Torchtune(TorchtuneGrpoSettings {
                    loss: TorchtuneGrpoLoss::Token,
                    epsilon: 0.2,
                    kl_coeff: 0.1,
                }),
                temperature: TEMPERATURE,
                activation_checkpointing: Checkpointing::layers_if(checkpointing),
                rollouts: Some(r.clone()),
                share_prompts,
            };
            let out = loss.step(&model, &batch, info).unwrap();
            let value: f32 = out.loss.clone().into_scalar();
            (value, step_grads(&model, out))
        };
        let (want, want_grads) = update(false);
        let (got, got_grads) = update(true);
        assert!(
            (got - want).abs() < 1e-5,
            "checkpointing {checkpointing}: loss {got} vs {want}"
        );
        assert_same_grads(&want_grads, &got_grads);
    }
}

/// A training pass with dropout draws masks per row in torchtune and TRL: it runs the rows as
/// collated; scoring (no dropout) still computes each prompt once.
#[test]
fn passes_that_would_change_run_the_rows_as_collated() {
    let r = rollouts();
    let mut model = lora_model();
    for (_, linear) in model.linears_mut() {
        if let Some(lora) = linear.lora.as_mut() {
            lora.dropout = 0.1;
        }
    }
    assert_eq!(RolloutInput::of(&model, &r, TRAIN), RolloutInput::rows(&r));
    assert!(RolloutInput::of(&model, &r, SCORING).positions() < RolloutInput::rows(&r).positions());
}
