//! Golden tests for knowledge distillation against torchtune's losses (see
//! `tests/fixtures/README.md`, `kd.safetensors`): student = tiny-llama + the fixture LoRA
//! adapter, teacher = tiny-llama-teacher, kd_ratio 0.5. Plus the other KD divergences against
//! a plain f64 re-statement of torchtune's formulas, and the teacher compatibility checks.

use crate::support;

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use support::*;
use tune::checkpoint::HostTensor;
use tune::data::Batch;
use tune::model_io::hf::load_model;
use tune::model_io::peft::peft_key;
use tune::models::{CausalLm, Trainable};
use tune::setup::teacher::check_compatible;
use tune::tokenizer::Tokenizer;
use tune::training::kd::{KdLoss, KdObjective, forward_kl, reverse_kl, symmetric_kl};
use tune::training::{LossStep, StepInfo};

fn teacher() -> CausalLm<Cpu> {
    teacher_on::<Cpu>(&Default::default())
}

pub fn teacher_on<B: Backend>(device: &B::Device) -> CausalLm<B> {
    load_model::<B>(&fixture("tiny-llama-teacher"), None, device)
        .unwrap()
        .model
        .set_trainable(Trainable::Nothing)
}

fn reference_batch(r: &Reference) -> Batch {
    let (tokens, labels, batch) = r.tokens();
    let seq = tokens.len() / batch;
    let num_trained_tokens = labels
        .chunks(seq)
        .map(|row| row[1..].iter().filter(|l| **l != -100).count())
        .sum();
    Batch {
        position_ids: positions(batch, seq),
        tokens,
        labels,
        document_ids: None,
        padding: None,
        batch_size: batch,
        seq_len: seq,
        num_trained_tokens,
        images: None,
    }
}

/// Internal module path of an adapter tensor -> its PEFT key.
fn to_peft(name: &str) -> String {
    let (module, which) = name.rsplit_once(".lora.").unwrap();
    peft_key(module, if which == "a" { 'A' } else { 'B' })
}

fn scalar<B: Backend>(t: &Tensor<B, 1>) -> HostTensor {
    HostTensor::from_tensor(t)
}

#[test]
fn kd_step_matches_torchtune_logits_losses_and_lora_grads() {
    check_kd_step::<CpuAutodiff>(&Default::default());
}

/// Teacher and student logits, the KD and total losses, metrics and the student's LoRA
/// gradients against torchtune, on `B`.
pub fn check_kd_step<B: AutodiffBackend>(device: &B::Device) {
    let r = Reference::open("kd.safetensors");
    let batch = reference_batch(&r);
    let model = lora_model_on::<B>(device);
    let kd_ratio = r.f32("kd_ratio").data[0] as f64;
    let mut step = KdLoss::<B> {
        teacher: teacher_on::<B::InnerBackend>(device),
        objective: KdObjective::ForwardKl,
        kd_ratio,
        activation_checkpointing: tune::training::activation_checkpointing::Checkpointing::Off,
    };

    // Both forwards.
    let teacher_logits = step.teacher_logits(&batch);
    assert_close(
        "teacher_logits",
        &HostTensor::from_tensor(&teacher_logits),
        &r.f32("teacher_logits"),
        1e-4,
    );
    let student_logits = model.forward(
        tune::training::sft::token_batch(&batch),
        tune::modules::ForwardMode {
            adapters: true,
            fake_quant: false,
            train: true,
        },
    );
    assert_close(
        "student_logits",
        &HostTensor::from_tensor(&student_logits),
        &r.f32("student_logits"),
        1e-4,
    );
    let kd = forward_kl(student_logits, teacher_logits, &batch.labels);
    assert_close(
        "kd_loss (forward_kl)",
        &scalar(&kd),
        &r.f32("kd_loss"),
        1e-4,
    );

    // The loss step the recipe trains with: total loss, its metrics, and the LoRA gradients.
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
    assert_eq!(out.weight, batch.num_trained_tokens);
    assert_close("loss", &scalar(&out.loss), &r.f32("loss"), 1e-4);
    let metric = |name: &str| out.metric(name).unwrap() as f32;
    assert!(
        (metric("class_loss") - r.f32("class_loss").data[0]).abs() <= 1e-4,
        "class_loss metric"
    );
    assert!(
        (metric("kd_loss") - r.f32("kd_loss").data[0]).abs() <= 1e-4,
        "kd_loss metric"
    );

    let grads = out.loss.backward();
    let named = crate::grads::named_grads(&model, &grads);
    let expected = r.grad_count();
    assert_eq!(
        named.len(),
        expected,
        "gradients exist for the student's adapters only"
    );
    for (name, grad) in &named {
        assert_grad_close(name, grad, &r.f32(&format!("grad.{}", to_peft(name))));
    }
}

/// torchtune's formulas in f64 on host rows, over positions whose shifted label counts:
/// returns (forward KL, reverse KL).
fn host_kl(student: &HostTensor, teacher: &HostTensor, labels: &[i64]) -> (f64, f64) {
    let [b, t, v] = [student.shape[0], student.shape[1], student.shape[2]];
    let log_softmax = |row: &[f32]| -> Vec<f64> {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, x| m.max(*x as f64));
        let lse = max
            + row
                .iter()
                .map(|x| (*x as f64 - max).exp())
                .sum::<f64>()
                .ln();
        row.iter().map(|x| *x as f64 - lse).collect()
    };
    let (mut fkl, mut rkl, mut count) = (0.0, 0.0, 0usize);
    for i in 0..b {
        for pos in 0..t - 1 {
            if labels[i * t + pos + 1] == -100 {
                continue;
            }
            let off = (i * t + pos) * v;
            let ls = log_softmax(&student.data[off..off + v]);
            let lt = log_softmax(&teacher.data[off..off + v]);
            fkl -= ls.iter().zip(&lt).map(|(s, t)| t.exp() * s).sum::<f64>();
            rkl -= ls
                .iter()
                .zip(&lt)
                .map(|(s, t)| s.exp() * (t - s))
                .sum::<f64>();
            count += 1;
        }
    }
    (fkl / count as f64, rkl / count as f64)
}

fn logits(h: &HostTensor) -> Tensor<Cpu, 3> {
    let device = Default::default();
    Tensor::from_data(
        TensorData::new(h.data.clone(), [h.shape[0], h.shape[1], h.shape[2]]),
        &device,
    )
}

#[test]
fn forward_reverse_and_symmetric_kl_follow_torchtune_definitions() {
    let r = Reference::open("kd.safetensors");
    let (_, labels, _) = r.tokens();
    let (s, t) = (r.f32("student_logits"), r.f32("teacher_logits"));
    let (fkl, rkl) = host_kl(&s, &t, &labels);
    let value = |x: Tensor<Cpu, 1>| x.into_scalar() as f64;
    assert!(
        (fkl - r.f32("kd_loss").data[0] as f64).abs() < 1e-4,
        "host forward KL agrees with the fixture"
    );
    assert!((value(forward_kl(logits(&s), logits(&t), &labels)) - fkl).abs() < 1e-4);
    assert!((value(reverse_kl(logits(&s), logits(&t), &labels)) - rkl).abs() < 1e-4);
    assert!(
        rkl > 0.0,
        "reverse KL of different distributions is positive"
    );
    let sym = value(symmetric_kl(logits(&s), logits(&t), &labels, 0.3));
    assert!(
        (sym - (0.3 * fkl + 0.7 * rkl)).abs() < 1e-4,
        "symmetric = ratio * forward + (1 - ratio) * reverse"
    );
    let objective = KdObjective::SymmetricKl { sym_kd_ratio: 0.3 };
    assert!((value(objective.loss(logits(&s), logits(&t), &labels)) - sym).abs() < 1e-6);

    // Against itself: reverse KL is zero, forward KL is the entropy (not zero).
    assert!(value(reverse_kl(logits(&t), logits(&t), &labels)).abs() < 1e-5);
    assert!(value(forward_kl(logits(&t), logits(&t), &labels)) > 0.0);
}

#[test]
fn kd_losses_ignore_masked_positions_and_infinite_logits() {
    let r = Reference::open("kd.safetensors");
    let (_, labels, _) = r.tokens();
    let (s, t) = (r.f32("student_logits"), r.f32("teacher_logits"));
    // Changing logits at a position whose shifted label is ignored changes nothing.
    let seq = s.shape[1];
    let vocab = s.shape[2];
    let ignored = (0..labels.len())
        .find(|&i| i % seq != seq - 1 && labels[i + 1] == -100)
        .expect("an ignored position");
    let mut s2 = s.clone();
    s2.data[ignored * vocab..(ignored + 1) * vocab]
        .iter_mut()
        .for_each(|x| *x = 7.0);
    let value = |x: Tensor<Cpu, 1>| x.into_scalar() as f64;
    let base = value(forward_kl(logits(&s), logits(&t), &labels));
    assert_eq!(value(forward_kl(logits(&s2), logits(&t), &labels)), base);
    // A -inf student logit (a token masked out of the vocabulary) contributes nothing instead
    // of NaN, as torchtune's inf_mask does.
    let mut s3 = s.clone();
    s3.data[5] = f32::NEG_INFINITY;
    assert!(value(forward_kl(logits(&s3), logits(&t), &labels)).is_finite());
    assert!(value(reverse_kl(logits(&s3), logits(&t), &labels)).is_finite());
    // Nothing counted: zero, as torchtune returns.
    let none = vec![-100i64; labels.len()];
    assert_eq!(value(forward_kl(logits(&s), logits(&t), &none)), 0.0);
}

fn student_tokenizer() -> Tokenizer {
    Tokenizer::from_path(fixture("tiny-llama/tokenizer.json")).unwrap()
}

/// A teacher directory whose config.json is the real teacher's with `edit` applied (no
/// weights: the check must run before any are read).
fn teacher_dir(tag: &str, edit: impl FnOnce(&mut serde_json::Value)) -> TempDir {
    let dir = temp_dir(&format!("kd-teacher-{tag}"));
    let text = std::fs::read_to_string(fixture("tiny-llama-teacher/config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut config);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    dir
}

/// A teacher's directory, opened as `teacher_checkpointer` opens it (config.json only).
fn teacher_checkpoint(dir: &std::path::Path) -> tune::setup::model::Checkpoint {
    tune::setup::model::Checkpoint {
        key: "teacher_checkpointer",
        source: tune::model_io::source::ModelSource::open(dir, None).expect("a config.json"),
    }
}

#[test]
fn teacher_with_another_vocabulary_is_refused_before_loading() {
    let student_args = tune::model_io::source::ModelSource::open(&fixture("tiny-llama"), None)
        .unwrap()
        .args;
    let shipped = teacher_checkpoint(&fixture("tiny-llama-teacher"));
    assert_eq!(shipped.args.num_layers, 3);
    check_compatible(&student_args, &student_tokenizer(), &shipped)
        .expect("the shipped teacher is compatible");

    let dir = teacher_dir("vocab", |c| c["vocab_size"] = 32000.into());
    let err = check_compatible(
        &student_args,
        &student_tokenizer(),
        &teacher_checkpoint(dir.path()),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("teacher_checkpointer.checkpoint_dir"), "{err}");
    assert!(
        err.contains("teacher vocab_size 32000 != student vocab_size 2048: the teacher must share the student's tokenizer"),
        "{err}"
    );
}

#[test]
fn teacher_with_another_tokenizer_is_refused() {
    let student_args = tune::model_io::source::ModelSource::open(&fixture("tiny-llama"), None)
        .unwrap()
        .args;
    // Same vocab_size, but Qwen2's tokenizer.
    let dir = teacher_dir("tokenizer", |_| {});
    std::fs::copy(
        fixture("tiny-qwen2/tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    let err = check_compatible(
        &student_args,
        &student_tokenizer(),
        &teacher_checkpoint(dir.path()),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("the teacher's tokenizer"), "{err}");
    assert!(err.contains("differs from the student's"), "{err}");
    assert!(
        err.contains("the teacher must share the student's tokenizer"),
        "{err}"
    );
}

#[test]
fn teacher_with_a_peft_adapter_loads_it() {
    // tiny-llama + the fixture adapter as the teacher: its logits are peft's for that pair.
    let yaml = format!(
        "_component_: torchtune.training.FullModelHFCheckpointer\ncheckpoint_dir: {}\nadapter_checkpoint: {}\nmodel_type: LLAMA3\n",
        fixture("tiny-llama").display(),
        fixture("tiny-llama-lora").display()
    );
    let cfg: tune::config::schema::CheckpointerConfig = serde_yaml::from_str(&yaml).unwrap();
    let student_args = tune::model_io::source::ModelSource::open(&fixture("tiny-llama"), None)
        .unwrap()
        .args;
    let device = Default::default();
    let model: tune::config::schema::ModelConfig =
        serde_yaml::from_str("_component_: tune.models.llama3.llama3_tiny").unwrap();
    let load = |cfg: &tune::config::schema::CheckpointerConfig| {
        tune::setup::teacher::load::<Cpu>(
            cfg,
            &model,
            None,
            &student_args,
            &student_tokenizer(),
            &device,
        )
        .map_err(|e| e.to_string())
    };
    let teacher = load(&cfg).unwrap();
    let step = KdLoss::<CpuAutodiff> {
        teacher,
        objective: KdObjective::ForwardKl,
        kd_ratio: 0.5,
        activation_checkpointing: tune::training::activation_checkpointing::Checkpointing::Off,
    };
    let base = Reference::open("tiny-llama.safetensors");
    let logits = step.teacher_logits(&reference_batch(&base));
    let want = Reference::open("tiny-llama-lora.safetensors").f32("logits");
    assert_close(
        "teacher logits with adapter",
        &HostTensor::from_tensor(&logits),
        &want,
        1e-4,
    );

    // A missing adapter names the teacher's key.
    let bad: tune::config::schema::CheckpointerConfig =
        serde_yaml::from_str(&yaml.replace("tiny-llama-lora", "no-such-adapter")).unwrap();
    let err = load(&bad).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("teacher_checkpointer.adapter_checkpoint"),
        "{err}"
    );
}

#[test]
fn kd_step_with_activation_checkpointing_matches_the_plain_step() {
    let r = Reference::open("kd.safetensors");
    let batch = reference_batch(&r);
    let model = lora_model();
    let info = StepInfo {
        epoch: 0,
        global_step: 0,
        seed: 0,
    };
    let run = |checkpointing: bool| {
        let mut step = KdLoss::<CpuAutodiff> {
            teacher: teacher(),
            objective: KdObjective::ForwardKl,
            kd_ratio: 0.5,
            activation_checkpointing:
                tune::training::activation_checkpointing::Checkpointing::layers_if(checkpointing),
        };
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
    assert_eq!(plain_metrics.len(), ckpt_metrics.len());
    for ((k, a), (_, b)) in plain_metrics.iter().zip(&ckpt_metrics) {
        assert!((a - b).abs() < 1e-6, "{k}: {a} vs {b}");
    }
    assert_same_grads(&plain, &ckpt);
}
