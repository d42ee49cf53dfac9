//! Golden tests for DPO: the fixture pair's policy and reference log-probabilities, loss,
//! rewards and LoRA gradients against peft + torch (policy = tiny-llama + the fixture adapter,
//! reference = the same model with the adapter disabled, beta 0.1); the loss formula with
//! label smoothing; and bad preference data.

use crate::support;

use std::path::Path;

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use support::*;
use tune::checkpoint::HostTensor;
use tune::data::{Batch, Dataset, DatasetKind, DatasetSpec};
use tune::model_io::hf::load_model;
use tune::model_io::peft::peft_key;
use tune::tokenizer::Tokenizer;
use tune::training::dpo::{DpoLoss, DpoReference, DpoSettings, dpo_loss};
use tune::training::{LossStep, StepInfo};

fn to_peft(name: &str) -> String {
    let (module, which) = name.rsplit_once(".lora.").unwrap();
    peft_key(module, if which == "a" { 'A' } else { 'B' })
}

/// The fixture's rows (chosen, then rejected) as a preference batch.
fn fixture_batch(r: &Reference) -> Batch {
    let (tokens, labels, batch) = r.tokens();
    let seq_len = tokens.len() / batch;
    let num_trained_tokens = labels
        .chunks(seq_len)
        .map(|row| row[1..].iter().filter(|&&l| l != -100).count())
        .sum();
    Batch {
        position_ids: positions(batch, seq_len),
        tokens,
        labels,
        document_ids: None,
        padding: None,
        batch_size: batch,
        seq_len,
        num_trained_tokens,
        images: None,
    }
}

fn scalar<B: Backend>(t: &Tensor<B, 1>) -> HostTensor {
    HostTensor::from_tensor(t)
}

/// `DPOLoss()` as the fixture script builds it: torchtune's defaults (the fixture records its
/// beta; the defaults themselves are checked against torchtune's source in setup::loss).
const FIXTURE_SETTINGS: DpoSettings = DpoSettings {
    beta: 0.1,
    label_smoothing: 0.0,
};

#[test]
fn lora_dpo_matches_torch() {
    check_lora_dpo::<CpuAutodiff>(&Default::default());
}

/// Log-probabilities, rewards, loss, metrics and LoRA gradients of the fixture pair, on `B`.
pub fn check_lora_dpo<B: AutodiffBackend>(device: &B::Device) {
    let r = Reference::open("dpo.safetensors");
    assert_eq!(r.f32("beta").data, vec![0.1]);
    let batch = fixture_batch(&r);
    let model = lora_model_on::<B>(device);
    let dpo = DpoLoss::<B>::new(FIXTURE_SETTINGS, DpoReference::AdaptersDisabled);

    let out = dpo.forward(&model, &batch).unwrap();
    assert_close(
        "policy_chosen_logps",
        &scalar(&out.policy.chosen),
        &r.f32("policy_chosen_logps"),
        1e-4,
    );
    assert_close(
        "policy_rejected_logps",
        &scalar(&out.policy.rejected),
        &r.f32("policy_rejected_logps"),
        1e-4,
    );
    assert_close(
        "reference_chosen_logps",
        &scalar(&out.reference.chosen),
        &r.f32("reference_chosen_logps"),
        1e-4,
    );
    assert_close(
        "reference_rejected_logps",
        &scalar(&out.reference.rejected),
        &r.f32("reference_rejected_logps"),
        1e-4,
    );
    assert_close(
        "chosen_reward",
        &scalar(&out.terms.chosen_rewards),
        &r.f32("chosen_reward"),
        1e-4,
    );
    assert_close(
        "rejected_reward",
        &scalar(&out.terms.rejected_rewards),
        &r.f32("rejected_reward"),
        1e-4,
    );

    // The loss step: mean over the one pair, weighted by pairs, with the gradient of torch.
    let mut step = dpo;
    let out = step
        .step(
            &model,
            &batch,
            StepInfo {
                epoch: 0,
                global_step: 0,
                seed: 0,
            },
        )
        .unwrap();
    assert_eq!(out.weight, 1, "one pair");
    assert_close("loss", &scalar(&out.loss), &r.f32("loss"), 1e-4);
    let metric = |k: &str| out.metric(k).unwrap_or_else(|| panic!("metric {k}"));
    let (c, rj) = (
        r.f32("chosen_reward").data[0] as f64,
        r.f32("rejected_reward").data[0] as f64,
    );
    assert!((metric("rewards/chosen") - c).abs() < 1e-4);
    assert!((metric("rewards/rejected") - rj).abs() < 1e-4);
    assert!((metric("rewards/margins") - (c - rj)).abs() < 1e-4);
    assert_eq!(metric("rewards/accuracies"), if c > rj { 1.0 } else { 0.0 });
    assert!(
        (metric("log_probs/chosen") - r.f32("policy_chosen_logps").data[0] as f64).abs() < 1e-4
    );
    assert!(
        (metric("log_probs/rejected") - r.f32("policy_rejected_logps").data[0] as f64).abs() < 1e-4
    );

    let grads = out.loss.backward();
    let named = crate::grads::named_grads(&model, &grads);
    let expected = r.grad_count();
    assert_eq!(
        named.len(),
        expected,
        "gradients for every adapter tensor and nothing else"
    );
    for (name, grad) in &named {
        assert_grad_close(name, grad, &r.f32(&format!("grad.{}", to_peft(name))));
    }
}

/// Full DPO: a frozen reference model on the inner backend gives the same scores as the
/// adapter-disabled reference when it holds the same base weights.
#[test]
fn frozen_reference_model_matches_adapters_disabled() {
    let r = Reference::open("dpo.safetensors");
    let batch = fixture_batch(&r);
    let device = Default::default();
    let reference = load_model::<Cpu>(&fixture("tiny-llama"), None, &device)
        .unwrap()
        .model;
    let dpo =
        DpoLoss::<CpuAutodiff>::new(FIXTURE_SETTINGS, DpoReference::Frozen(Box::new(reference)));
    let out = dpo.forward(&lora_model(), &batch).unwrap();
    assert_close(
        "reference_chosen_logps",
        &scalar(&out.reference.chosen),
        &r.f32("reference_chosen_logps"),
        1e-4,
    );
    assert_close(
        "reference_rejected_logps",
        &scalar(&out.reference.rejected),
        &r.f32("reference_rejected_logps"),
        1e-4,
    );
    assert_close("loss", &scalar(&out.terms.losses), &r.f32("loss"), 1e-4);
}

fn t(v: &[f32]) -> Tensor<Cpu, 1> {
    Tensor::from_data(TensorData::new(v.to_vec(), [v.len()]), &Default::default())
}

fn log_sigmoid(x: f64) -> f64 {
    -(1.0 + (-x).exp()).ln()
}

#[test]
fn loss_formula_with_label_smoothing() {
    let (pc, pr, rc, rr) = ([-10.0, -3.0], [-12.0, -2.0], [-11.0, -2.5], [-11.5, -2.5]);
    for ls in [0.0, 0.2] {
        let settings = DpoSettings {
            beta: 0.5,
            label_smoothing: ls,
        };
        let terms = dpo_loss(settings, t(&pc), t(&pr), t(&rc), t(&rr));
        let losses = HostTensor::from_tensor(&terms.losses).data;
        let chosen = HostTensor::from_tensor(&terms.chosen_rewards).data;
        let rejected = HostTensor::from_tensor(&terms.rejected_rewards).data;
        for i in 0..2 {
            let logits = ((pc[i] - pr[i]) - (rc[i] - rr[i])) as f64;
            let want = -log_sigmoid(0.5 * logits) * (1.0 - ls) - log_sigmoid(-0.5 * logits) * ls;
            assert!(
                (losses[i] as f64 - want).abs() < 1e-6,
                "ls {ls} pair {i}: {} vs {want}",
                losses[i]
            );
            assert!((chosen[i] - 0.5 * (pc[i] - rc[i])).abs() < 1e-6);
            assert!((rejected[i] - 0.5 * (pr[i] - rr[i])).abs() < 1e-6);
        }
    }
}

/// A batch that is not chosen-then-rejected pairs (an odd number of rows) is a clear error.
#[test]
fn odd_batch_is_an_error() {
    let r = Reference::open("dpo.safetensors");
    let mut batch = fixture_batch(&r);
    let seq = batch.seq_len;
    batch.tokens.truncate(seq);
    batch.labels.truncate(seq);
    batch.position_ids.truncate(seq);
    batch.batch_size = 1;
    let dpo = DpoLoss::<CpuAutodiff>::new(FIXTURE_SETTINGS, DpoReference::AdaptersDisabled);
    let err = dpo
        .forward(&lora_model(), &batch)
        .err()
        .expect("odd batch")
        .to_string();
    assert!(
        err.contains("preference dataset") && err.contains("1 rows"),
        "{err}"
    );
}

fn build_pairs(name: &str, text: &str, kind: DatasetKind) -> String {
    let dir = temp_dir("dpo-data");
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    let tok = Tokenizer::from_path(fixture("tiny-llama")).unwrap();
    let spec = DatasetSpec {
        source: Some(path.display().to_string()),
        ..DatasetSpec::new(kind)
    };
    Dataset::build(&spec, &tok, None, Path::new("/"))
        .expect_err("bad row")
        .to_string()
}

#[test]
fn bad_preference_rows_name_the_row() {
    let ok = r#"{"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                 "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go away"}]}"#;
    let msg = build_pairs(
        "no_rejected.json",
        &format!(
            r#"[{ok}, {{"chosen": [{{"role": "user", "content": "hi"}}, {{"role": "assistant", "content": "yo"}}]}}]"#
        ),
        DatasetKind::Preference,
    );
    assert!(
        msg.contains("no_rejected.json") && msg.contains("row 1") && msg.contains("`rejected`"),
        "{msg}"
    );
    let msg = build_pairs(
        "empty_answer.json",
        r#"[{"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}],
              "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"}]}]"#,
        DatasetKind::Preference,
    );
    assert!(
        msg.contains("row 0") && msg.contains("`chosen`") && msg.contains("empty"),
        "{msg}"
    );
    let msg = build_pairs(
        "se_empty.json",
        r#"[{"question": "q", "response_j": "a", "response_k": "b"}, {"question": "q", "response_j": "a", "response_k": ""}]"#,
        DatasetKind::StackExchangePaired,
    );
    assert!(
        msg.contains("se_empty.json") && msg.contains("row 1") && msg.contains("`response_k`"),
        "{msg}"
    );
    let msg = build_pairs(
        "se_missing.json",
        r#"[{"question": "q", "response_k": "b"}]"#,
        DatasetKind::StackExchangePaired,
    );
    assert!(
        msg.contains("row 0") && msg.contains("`response_j`"),
        "{msg}"
    );
}

#[test]
fn dpo_step_with_activation_checkpointing_matches_the_plain_step() {
    let r = Reference::open("dpo.safetensors");
    let batch = fixture_batch(&r);
    let model = lora_model();
    let info = StepInfo {
        epoch: 0,
        global_step: 0,
        seed: 0,
    };
    let run = |checkpointing: bool| {
        let mut step = DpoLoss::new(
            DpoSettings {
                beta: 0.1,
                ..FIXTURE_SETTINGS
            },
            DpoReference::AdaptersDisabled,
        );
        step.activation_checkpointing =
            tune::training::activation_checkpointing::Checkpointing::layers_if(checkpointing);
        let out = step.step(&model, &batch, info).unwrap();
        let loss: f32 = out.loss.clone().into_scalar();
        let metrics: Vec<(&str, f64)> = out
            .metrics
            .iter()
            .map(|(k, _)| (*k, out.metric(k).unwrap()))
            .collect();
        (loss, metrics, step_grads(&model, out))
    };
    let (plain_loss, plain_metrics, plain) = run(false);
    let (ckpt_loss, ckpt_metrics, ckpt) = run(true);
    assert!((plain_loss - ckpt_loss).abs() < 1e-6);
    for ((k, a), (_, b)) in plain_metrics.iter().zip(&ckpt_metrics) {
        assert!((a - b).abs() < 1e-5, "{k}: {a} vs {b}");
    }
    assert_same_grads(&plain, &ckpt);
}
