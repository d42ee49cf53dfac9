//! The trainer's step (`Trainer::train_step`, what `fit` runs and `tune bench` times):
//! gradient accumulation gives the step over the whole batch, clipping bounds the update to
//! `clip_grad_norm` and logs the norm before it, and the divergence guard refuses a diverging
//! step, naming it.

use burn::module::AutodiffModule;
use tune::data::{Batch, SftSample, collate_sft};
use tune::models::{CausalLm, Trainable};
use tune::training::metrics::MetricLoggers;
use tune::training::optimizer::{Optimizer, OptimizerKind, OptimizerSettings};
use tune::training::parallel::Parallelism;
use tune::training::schedule::Schedule;
use tune::training::sft::SftLoss;
use tune::training::{TrainError, TrainState, Trainer, TrainerSettings};

use crate::support::*;

/// Rows of 9 to 30 tokens with their prompts masked.
pub(crate) fn rows() -> Vec<SftSample> {
    vec![
        masked_row(9, 3, 1),
        masked_row(30, 8, 2),
        masked_row(17, 0, 3),
        masked_row(22, 5, 4),
    ]
}

pub(crate) fn batch(rows: &[SftSample]) -> Batch {
    collate_sft(&rows.iter().collect::<Vec<_>>(), 0)
}

/// Plain SGD at learning rate 1: the update is minus the (clipped) mean gradient.
fn trainer(clip_grad_norm: Option<f64>) -> Trainer<CpuAutodiff> {
    let model = tune::model_io::hf::load_model::<CpuAutodiff>(
        &fixture("tiny-llama"),
        None,
        &Default::default(),
    )
    .unwrap()
    .model
    .set_trainable(Trainable::All);
    let optimizer = Optimizer::new(OptimizerSettings {
        kind: OptimizerKind::Sgd,
        weight_decay: 0.0,
        betas: (0.9, 0.999),
        eps: 1e-8,
        momentum: 0.0,
    });
    let settings = settings(1, clip_grad_norm, 1.0);
    Trainer::new(
        settings,
        model,
        optimizer,
        TrainState::default(),
        MetricLoggers { sinks: Vec::new() },
        Parallelism::single(),
    )
}

/// One epoch at a constant `lr`, logging every step, no saves.
pub(crate) fn settings(accumulation: usize, clip: Option<f64>, lr: f64) -> TrainerSettings {
    TrainerSettings {
        epochs: 1,
        max_steps_per_epoch: None,
        gradient_accumulation_steps: accumulation,
        clip_grad_norm: clip,
        log_every_n_steps: 1,
        save_every_n_steps: None,
        lr,
        schedule: Schedule::Constant,
        seed: 0,
        save_on_preempt: false,
        log_memory: true,
        show_progress: false,
        time_phases: false,
    }
}

fn weights(model: &CausalLm<CpuAutodiff>) -> Vec<f32> {
    let mut out = Vec::new();
    for (_, t) in model.clone().valid().hf_state_dict() {
        out.extend(t.data);
    }
    out
}

fn sft() -> SftLoss {
    SftLoss {
        output_chunks: 1,
        ..SftLoss::default()
    }
}

#[test]
fn accumulating_micro_batches_is_the_step_over_their_whole_batch() {
    let rows = rows();
    let (whole, done_whole) = trainer(None)
        .train_step(&[batch(&rows)], &mut sft())
        .unwrap();
    let micro = [batch(&rows[..1]), batch(&rows[1..3]), batch(&rows[3..])];
    let (accumulated, done_micro) = trainer(None).train_step(&micro, &mut sft()).unwrap();
    // The loss and update are means over every labelled token of the step, not means of the
    // micro-batches' means (their token counts differ: 6, 22 + 17, 17).
    assert!(
        (done_whole.loss - done_micro.loss).abs() < 1e-5,
        "{} vs {}",
        done_whole.loss,
        done_micro.loss
    );
    assert_eq!(done_whole.tokens, done_micro.tokens);
    let (a, b) = (weights(&whole.model), weights(&accumulated.model));
    let before = weights(&trainer(None).model);
    let moved = a.iter().zip(&before).filter(|(x, y)| x != y).count();
    assert!(moved > a.len() / 2, "the step moved {moved} weights");
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-5, "largest weight difference {worst}");
    assert_eq!(accumulated.state.global_step, 1);
    assert_eq!(accumulated.state.tokens_seen, done_micro.tokens as u64);
}

#[test]
fn clipping_bounds_the_update_to_the_clip_norm_and_logs_the_norm_before_it() {
    let rows = rows();
    let before = weights(&trainer(None).model);
    let (unclipped, free) = trainer(None)
        .train_step(&[batch(&rows)], &mut sft())
        .unwrap();
    assert_eq!(
        free.grad_norm, None,
        "the norm is logged when clipping is on"
    );
    let step_norm = |w: &[f32]| {
        w.iter()
            .zip(&before)
            .map(|(x, y)| f64::from(x - y).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    // At learning rate 1 the unclipped update is the mean gradient.
    let norm = step_norm(&weights(&unclipped.model));
    let max = norm / 4.0;
    let (clipped, done) = trainer(Some(max))
        .train_step(&[batch(&rows)], &mut sft())
        .unwrap();
    let logged = done.grad_norm.expect("clip_grad_norm logs the norm");
    assert!(
        (logged - norm).abs() < 1e-4 * norm,
        "logged {logged}, update {norm}"
    );
    let update = step_norm(&weights(&clipped.model));
    assert!(
        (update - max).abs() < 1e-4 * max,
        "clipped update {update}, clip_grad_norm {max}"
    );
    // A norm under the limit is not scaled.
    let (loose, _) = trainer(Some(norm * 2.0))
        .train_step(&[batch(&rows)], &mut sft())
        .unwrap();
    assert!((step_norm(&weights(&loose.model)) - norm).abs() < 1e-4 * norm);
}

/// A learning rate of 1e4 wrecks the weights in one step; the next step's loss is caught by
/// the guard (exploding or not finite, or its gradient), naming that step.
#[test]
fn a_diverging_step_is_refused_naming_it() {
    let rows = rows();
    let mut t = trainer(None);
    t.settings.lr = 1e4;
    let (t, first) = t.train_step(&[batch(&rows)], &mut sft()).unwrap();
    assert!(first.loss.is_finite());
    let err = match t.train_step(&[batch(&rows)], &mut sft()) {
        Err(e) => e,
        Ok((_, done)) => panic!(
            "a loss of {} after a first of {} trained on",
            done.loss, first.loss
        ),
    };
    match err {
        TrainError::Diverged { step, .. } => assert_eq!(step, 2),
        other => panic!("{other}"),
    }
}

/// A run whose memory runs out ends with an error naming the request, what the process held,
/// its memory limit and the ways out (more ranks with FSDP, LoRA, a smaller batch), with
/// status 1: not Rust's bare "memory allocation failed" abort. The limit (`prlimit --as`,
/// 105 MB of address space) lets tune start and fail in its first allocations of the run.
#[test]
fn a_run_out_of_memory_ends_naming_the_limit_and_the_ways_out() {
    let out = temp_dir("out-of-memory");
    let res = std::process::Command::new("prlimit")
        .arg("--as=105000000")
        .arg(env!("CARGO_BIN_EXE_tune"))
        .args([
            "run",
            "full_finetune_single_device",
            "--config",
            "tiny/full",
            &format!("output_dir={}", out.path().display()),
            "batch_size=8",
        ])
        .env("RUST_BACKTRACE", "0")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("prlimit (util-linux) runs");
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(1), "{err}");
    for part in [
        "error: out of memory: a request for",
        "address-space limit of 105 MB",
        "--nproc_per_node N",
        "LoRA or QLoRA",
    ] {
        assert!(err.contains(part), "{part}: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}
