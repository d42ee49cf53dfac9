//! End-to-end: the GRPO recipes through the binary on the tiny configs, whose reward (the
//! letters "e" of each completion, counted by an awk program through `tune.rewards.command`)
//! the tiny model can learn: the reward rises, every metric is logged, two workers sample and
//! train as one device, a killed run resumes with the uninterrupted run's rewards and losses,
//! and a reward program that fails stops the run naming it.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::distributed::{assert_same_curve, assert_same_tensors, column_by_step, model_of};
use crate::support::{column, mean, read_metrics, temp_dir, tune, tune_command, tune_ok};

const LORA: &str = "grpo_lora_finetune_single_device";
const FULL: &str = "grpo_full_finetune_single_device";

fn run_args<'a>(recipe: &'a str, config: &'a str, out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["run", recipe, "--config", config, out];
    a.extend_from_slice(extra);
    a
}

fn output(dir: &Path) -> String {
    format!("output_dir={}", dir.display())
}

/// The reward's first and last quarter of steps: it must rise.
fn assert_reward_rises(dir: &Path) {
    let metrics = read_metrics(&dir.join("logs/metrics.jsonl"));
    let rewards = column(&metrics, "rewards");
    let q = rewards.len() / 4;
    let (first, last) = (mean(&rewards[..q]), mean(&rewards[rewards.len() - q..]));
    assert!(
        last > first * 1.3 && last > first + 1.0,
        "the reward did not rise: first steps {first:.3}, last steps {last:.3} ({rewards:?})"
    );
}

#[test]
fn lora_grpo_raises_its_reward_logs_every_metric_and_saves_a_peft_adapter() {
    let dir = temp_dir("grpo-lora");
    let out = output(dir.path());
    tune_ok(&run_args(LORA, "tiny/grpo_lora_single_device", &out, &[]));
    assert_reward_rises(dir.path());
    let metrics = read_metrics(&dir.path().join("logs/metrics.jsonl"));
    assert_eq!(metrics.len(), 30, "num_steps: 30 batches, one update each");
    for key in [
        "loss",
        "lr",
        "grad_norm",
        "rewards",
        "rewards_std",
        "rewards/letter_e",
        "frac_reward_zero_std",
        "response_lengths",
        "num_stop_tokens",
        "rollout_tokens_per_second",
        "policy_loss",
        "ratios",
        "clipfrac",
        "approx_policy_kl",
    ] {
        assert!(
            metrics[0].get(key).is_some(),
            "{key} missing in {}",
            metrics[0]
        );
    }
    // kl_coeff: 0 runs no reference pass and logs no KL.
    assert!(metrics[0].get("kl_loss").is_none());
    let lengths = column(&metrics, "response_lengths");
    assert!(
        lengths.iter().all(|&l| (1.0..=16.0).contains(&l)),
        "{lengths:?}"
    );
    let adapter = dir.path().join("epoch_0/adapter_model.safetensors");
    assert!(adapter.is_file(), "{} missing", adapter.display());
    assert!(dir.path().join("epoch_0/adapter_config.json").is_file());
}

#[test]
fn full_grpo_raises_its_reward_against_a_frozen_reference() {
    let dir = temp_dir("grpo-full");
    let out = output(dir.path());
    tune_ok(&run_args(FULL, "tiny/grpo_full_single_device", &out, &[]));
    assert_reward_rises(dir.path());
    let metrics = read_metrics(&dir.path().join("logs/metrics.jsonl"));
    let kl = column(&metrics, "kl_loss");
    // The policy starts as the reference, then moves away from it.
    assert!(kl[0].abs() < 1e-6, "{kl:?}");
    assert!(kl.iter().skip(5).any(|&k| k > 1e-6), "{kl:?}");
    assert!(dir.path().join("epoch_0/model.safetensors").is_file());
}

/// `loss: tune.loss.TRLGRPOLoss` trains on TRL's GRPOTrainer loss (here Dr. GRPO's constant
/// normaliser with GSPO's sequence-level ratio and a KL term), logging TRL's metrics.
#[test]
fn trls_grpo_loss_raises_the_reward_and_logs_trls_metrics() {
    let dir = temp_dir("grpo-trl");
    let out = output(dir.path());
    tune_ok(&run_args(
        LORA,
        "tiny/grpo_lora_single_device",
        &out,
        &[
            "loss={_component_: tune.loss.TRLGRPOLoss, loss_type: dr_grpo, beta: 0.04, importance_sampling_level: sequence, epsilon_high: 0.28}",
            "ppo_epochs=2",
        ],
    ));
    assert_reward_rises(dir.path());
    let metrics = read_metrics(&dir.path().join("logs/metrics.jsonl"));
    // The second pass over a batch moves the ratio away from 1: some sequences clip.
    let clipped = column(&metrics, "clip_ratio/region_mean");
    assert!(clipped.iter().any(|&c| c > 0.0), "{clipped:?}");
    let kl = column(&metrics, "kl");
    assert!(
        kl[0].abs() < 1e-6,
        "the policy starts as the reference: {kl:?}"
    );
    assert!(kl.iter().any(|&k| k > 1e-4), "{kl:?}");
    // torchtune's loss metrics belong to torchtune's losses.
    assert!(metrics[0].get("clipfrac").is_none() && metrics[0].get("kl_loss").is_none());
}

/// GRPO in bf16 (weights, rollouts, the reference, the update; losses in fp32): LoRA with
/// torchtune's loss and full GRPO with TRL's and its KL term both raise the reward.
#[test]
fn grpo_in_bf16_raises_its_reward() {
    for (recipe, config, extra) in [
        (LORA, "tiny/grpo_lora_single_device", &[][..]),
        (
            FULL,
            "tiny/grpo_full_single_device",
            &["loss={_component_: tune.loss.TRLGRPOLoss, loss_type: dapo, beta: 0.01}"][..],
        ),
    ] {
        let dir = temp_dir("grpo-bf16");
        let out = output(dir.path());
        tune_ok(&run_args(
            recipe,
            config,
            &out,
            &[&["dtype=bf16"][..], extra].concat(),
        ));
        assert_reward_rises(dir.path());
    }
}

/// `mask_truncated_completions: True` (TRL's): completions cut off by `max_generated_tokens`
/// leave the loss. The tiny model rarely stops on its own, so with no extra stop tokens every
/// completion is cut off and nothing trains; with a third of the vocabulary as stop tokens,
/// most stop, and the runs with and without the mask part at the first batch with a cut-off
/// completion.
#[test]
fn truncated_completions_leave_the_loss_when_masked() {
    let run = |mask: bool, extra: &[&str]| {
        let dir = temp_dir("grpo-mask-truncated");
        let out = output(dir.path());
        let mask = format!("mask_truncated_completions={mask}");
        let args = [&["num_steps=3", mask.as_str()][..], extra].concat();
        tune_ok(&run_args(LORA, "tiny/grpo_lora_single_device", &out, &args));
        read_metrics(&dir.path().join("logs/metrics.jsonl"))
    };
    let all_cut = run(true, &[]);
    assert_eq!(column(&all_cut, "num_stop_tokens"), vec![0.0; 3]);
    assert_eq!(
        column(&all_cut, "grad_norm"),
        vec![0.0; 3],
        "nothing trains"
    );

    let ids: Vec<String> = (0..2048).step_by(3).map(|i| i.to_string()).collect();
    let stops = format!("stop_token_ids=[{}]", ids.join(","));
    let (masked, plain) = (run(true, &[&stops]), run(false, &[&stops]));
    let rows = 16.0; // batch_size 2 x grpo_samples 8
    let stopped = column(&plain, "num_stop_tokens");
    let first_cut = stopped
        .iter()
        .position(|&s| s < rows)
        .expect("some batch has a cut-off completion");
    assert!(
        stopped[first_cut] > 0.0,
        "and some that stopped: {stopped:?}"
    );
    let (gm, gp) = (column(&masked, "grad_norm"), column(&plain, "grad_norm"));
    for step in 0..first_cut {
        assert_eq!(
            gm[step], gp[step],
            "every completion stopped at step {step}"
        );
    }
    assert!(
        (gm[first_cut] - gp[first_cut]).abs() > 1e-3 * gp[first_cut],
        "the cut-off completion changed nothing: {gm:?} vs {gp:?}"
    );
}

/// Two batches of 2 prompts, two updates each: one device, and two workers (FSDP, the
/// default: the LoRA base and the full policy and its reference sharded) with one prompt each.
///
/// Why two batches: from the second on, each side samples from weights trained on gradients
/// summed in another order (one device sums both prompts' rows in one product, two workers
/// each their own, then reduce), equal within float32 rounding but not bit for bit. That
/// rounding grows with each update until a sampled token goes the other way: on an AVX2 AMD
/// EPYC the fourth batch's samples differed in two of the four runs below (rewards 5.94 and
/// 5.81), where the earlier AVX-512 runs had kept them. The first batch samples from the same
/// weights and the second from weights two updates' rounding apart: a sharded second batch,
/// which the comparison needs, and little room for a flip.
#[test]
fn two_grpo_workers_sample_and_train_like_one_device() {
    // The third run normalises the advantages over the whole batch (gathered from both ranks);
    // the fourth trains on TRL's dapo loss, whose normaliser counts the tokens of every rank,
    // with a KL term against the adapters-disabled base.
    let batch_scale: &[&str] = &["scale_rewards=batch"];
    let trl_dapo: &[&str] =
        &["loss={_component_: tune.loss.TRLGRPOLoss, loss_type: dapo, beta: 0.04}"];
    let lora = (
        LORA,
        "grpo_lora_finetune_distributed",
        "tiny/grpo_lora_single_device",
    );
    let full = (
        FULL,
        "dev/grpo_full_finetune_distributed",
        "tiny/grpo_full_single_device",
    );
    for ((single, distributed, config), extra) in [
        (lora, &[][..]),
        (full, &[][..]),
        (lora, batch_scale),
        (lora, trl_dapo),
    ] {
        let steps = [&["num_steps=2", "ppo_epochs=2"][..], extra].concat();
        let one = temp_dir("grpo-one");
        let two = temp_dir("grpo-two");
        let (o1, o2) = (output(one.path()), output(two.path()));
        tune_ok(&run_args(single, config, &o1, &steps));
        let per_rank = [&steps[..], &["batch_size=1", "forward_batch_size=1"]].concat();
        let mut args = vec!["run", "--nproc_per_node", "2"];
        args.extend(
            run_args(distributed, config, &o2, &per_rank)[1..]
                .iter()
                .copied(),
        );
        tune_ok(&args);
        let mut keys = vec!["rewards", "rewards_std", "response_lengths", "grad_norm"];
        if single == FULL {
            keys.push("kl_loss");
        }
        if extra == trl_dapo {
            keys.extend(["kl", "clip_ratio/region_mean"]);
        }
        for key in keys {
            assert_same_curve(
                &format!("{distributed}: {key}"),
                &column_by_step(two.path(), key),
                &column_by_step(one.path(), key),
                1e-4,
            );
        }
        // GRPOSimpleLoss's value is minus the mean advantage plus the KL term, TRL's a token
        // mean of the same: near zero, so compared absolutely.
        let (l2, l1) = (
            column_by_step(two.path(), "loss"),
            column_by_step(one.path(), "loss"),
        );
        assert_eq!(l2.len(), l1.len());
        for ((s, a), (_, b)) in l2.iter().zip(&l1) {
            assert!(
                (a - b).abs() < 1e-6,
                "{distributed}: loss at step {s}: {a} vs {b}"
            );
        }
        if single == LORA && extra.is_empty() {
            // One device decoding one prompt at a time (`forward_batch_size`, torchtune's
            // micro-batches) samples and trains as when both decode together, left-padded.
            let apart = temp_dir("grpo-apart");
            let o3 = output(apart.path());
            let one_by_one = [&steps[..], &["forward_batch_size=1"]].concat();
            tune_ok(&run_args(single, config, &o3, &one_by_one));
            for key in ["rewards", "response_lengths", "grad_norm"] {
                assert_same_curve(
                    &format!("forward_batch_size=1: {key}"),
                    &column_by_step(apart.path(), key),
                    &column_by_step(one.path(), key),
                    1e-4,
                );
            }
        }
        let epoch = |d: &Path| model_of(&d.join("epoch_0"));
        // With the KL term the reference's log-probabilities are scored in passes of other
        // sizes on each rank: AdamW's normalised steps carry their rounding further.
        let tol = if extra == trl_dapo { 3e-5 } else { 1e-5 };
        assert_same_tensors(distributed, epoch(two.path()), epoch(one.path()), tol);
    }
}

#[test]
fn a_killed_grpo_run_resumes_with_the_uninterrupted_runs_rewards_and_losses() {
    let extra = [
        "num_steps=6",
        "save_every_n_steps=2",
        "save_adapter_weights_only=True",
    ];
    let reference = temp_dir("grpo-ref");
    let out_ref = output(reference.path());
    tune_ok(&run_args(
        LORA,
        "tiny/grpo_lora_single_device",
        &out_ref,
        &extra,
    ));

    let dir = temp_dir("grpo-killed");
    let out = output(dir.path());
    let mut child = tune_command(&run_args(
        LORA,
        "tiny/grpo_lora_single_device",
        &out,
        &extra,
    ))
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null())
    .spawn()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !dir.path().join("step_2").is_dir() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap();
    let _ = child.wait();
    assert!(dir.path().join("step_2").is_dir(), "step_2 was published");
    tune_ok(&run_args(
        LORA,
        "tiny/grpo_lora_single_device",
        &out,
        &[&extra[..], &["resume_from_checkpoint=True"]].concat(),
    ));
    // The resumed run's lines from step 3 on equal the uninterrupted run's.
    for key in ["rewards", "loss"] {
        let want: Vec<_> = column_by_step(reference.path(), key);
        let got: Vec<_> = column_by_step(dir.path(), key)
            .into_iter()
            .filter(|(s, _)| *s > 2)
            .collect();
        let want: Vec<_> = want.into_iter().filter(|(s, _)| *s > 2).collect();
        assert_same_curve(key, &got, &want, 1e-6);
    }
    let adapter = |d: &Path| std::fs::read(d.join("epoch_0/adapter_model.safetensors")).unwrap();
    assert_eq!(adapter(dir.path()), adapter(reference.path()));
}

#[test]
fn a_reward_program_that_fails_stops_the_run_naming_it_and_the_row() {
    let dir = temp_dir("grpo-bad-reward");
    let out = output(dir.path());
    let out = tune(&run_args(
        LORA,
        "tiny/grpo_lora_single_device",
        &out,
        &[
            "reward_functions=[{_component_: tune.rewards.command, command: [sh, -c, 'read line; echo not-a-number']}]",
        ],
    ));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("reward command `sh -c"), "{err}");
    assert!(err.contains("not-a-number"), "{err}");
    assert!(err.contains("\"completion\""), "the row: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// One of two workers fails (its reward program crashes on its prompt) while the other has
/// gone on to the step's collectives: the run ends at once, naming the rank, the program and
/// the row, never waiting forever.
#[test]
fn a_rank_whose_reward_fails_stops_every_rank_naming_it() {
    let dir = temp_dir("grpo-rank-fails");
    // Rows alternate: rank 0 reads the even ones, rank 1 the odd ones (no shuffle).
    let rows: Vec<String> = (0..8)
        .map(|i| {
            let prompt = if i % 2 == 1 {
                "poison this one"
            } else {
                "tell me about trees"
            };
            format!("{{\"instruction\": \"{prompt}\"}}")
        })
        .collect();
    let data = dir.path().join("prompts.json");
    std::fs::write(&data, format!("[{}]", rows.join(","))).unwrap();
    let out = output(&dir.path().join("run"));
    let data_files = format!("dataset.data_files={}", data.display());
    let started = Instant::now();
    let result = tune(&[
        "run",
        "--nproc_per_node",
        "2",
        "grpo_lora_finetune_distributed",
        "--config",
        "tiny/grpo_lora_single_device",
        &out,
        &data_files,
        "shuffle=False",
        "batch_size=1",
        "forward_batch_size=1",
        "num_steps=2",
        "reward_functions=[{_component_: tune.rewards.command, name: picky, command: [sh, -c, 'while read l; do case \"$l\" in *poison*) echo boom >&2; exit 3;; esac; echo 1; done']}]",
    ]);
    let err = String::from_utf8_lossy(&result.stderr);
    assert!(!result.status.success(), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "it waited: {err}"
    );
    assert!(err.contains("rank 1 failed"), "{err}");
    assert!(
        err.contains("poison this one") && err.contains("boom"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn grpo_configs_refuse_what_they_would_ignore_by_name() {
    let cases: &[(&str, &[&str], &str)] = &[
        (
            LORA,
            &["gradient_accumulation_steps=2"],
            "gradient_accumulation_steps",
        ),
        (
            LORA,
            &["dataset._component_=torchtune.datasets.alpaca_dataset"],
            "holds responses to train on",
        ),
        (
            LORA,
            &["reward_functions=[{_component_: tune.rewards.command, command: [cat], target: 5}]"],
            "`target` is not a setting of `tune.rewards.command`",
        ),
        (
            LORA,
            &["reward_functions=[{_component_: tune.rewards.length}]"],
            "reward_functions.0.target: missing required key `target`",
        ),
        (
            LORA,
            &[
                "reward_functions=[{_component_: torchtune.dev.rl.rewards.FormattedMathCorrectnessReward}]",
            ],
            "math_verify",
        ),
        (
            LORA,
            &["loss._component_=torchtune.rlhf.loss.DPOLoss"],
            "cannot be `loss` for this recipe",
        ),
        (
            LORA,
            &[
                "ref_checkpointer={_component_: torchtune.training.FullModelHFCheckpointer, checkpoint_dir: assets/tiny-llama}",
            ],
            "adapters disabled",
        ),
        (
            FULL,
            &["~ref_checkpointer"],
            "full GRPO needs the frozen reference",
        ),
        (LORA, &["temperature=0"], "every advantage 0"),
        (
            LORA,
            &["loss={_component_: tune.loss.TRLGRPOLoss, kl_coeff: 0.1}"],
            "TRL's loss calls its KL coefficient `beta`",
        ),
        (
            LORA,
            &["loss.beta=0.04"],
            "call their KL coefficient `kl_coeff`",
        ),
        (
            LORA,
            &["loss={_component_: tune.loss.TRLGRPOLoss, loss_type: gspo}"],
            "expected one of grpo, bnpo, dr_grpo, dapo",
        ),
    ];
    for (recipe, over, want) in cases {
        let config = if *recipe == LORA {
            "tiny/grpo_lora_single_device"
        } else {
            "tiny/grpo_full_single_device"
        };
        let mut a = vec!["validate", config, "--recipe", recipe];
        a.extend_from_slice(over);
        let out = tune(&a);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.status.success(), "{over:?} validated:\n{text}");
        assert!(
            text.contains(want),
            "{over:?}: expected {want:?} in:\n{text}"
        );
    }
    // The shipped configs validate as they are.
    for (recipe, config) in [
        (LORA, "tiny/grpo_lora_single_device"),
        (FULL, "tiny/grpo_full_single_device"),
        (
            "dev/grpo_full_finetune_distributed",
            "tiny/grpo_full_single_device",
        ),
    ] {
        tune_ok(&["validate", config, "--recipe", recipe]);
    }
}

/// `enable_activation_checkpointing: True` recomputes each policy layer in GRPO's backward
/// pass: the same first update (its rollouts are the same) as without it.
#[test]
fn grpo_with_activation_checkpointing_makes_the_same_update() {
    let plain = temp_dir("grpo-plain");
    let checkpointed = temp_dir("grpo-ac");
    // A constant rate from the first step, so the update moves the adapters.
    let common = [
        "num_steps=1",
        "save_adapter_weights_only=False",
        "lr_scheduler._component_=torchtune.training.lr_schedulers.get_constant_schedule_with_warmup",
        "lr_scheduler.num_warmup_steps=0",
    ];
    let (o1, o2) = (output(plain.path()), output(checkpointed.path()));
    tune_ok(&run_args(
        LORA,
        "tiny/grpo_lora_single_device",
        &o1,
        &common,
    ));
    let with_ac = [&common[..], &["enable_activation_checkpointing=True"]].concat();
    tune_ok(&run_args(
        LORA,
        "tiny/grpo_lora_single_device",
        &o2,
        &with_ac,
    ));
    for key in ["rewards", "grad_norm"] {
        assert_same_curve(
            key,
            &column_by_step(checkpointed.path(), key),
            &column_by_step(plain.path(), key),
            1e-5,
        );
    }
    let epoch = |d: &Path| model_of(&d.join("epoch_0"));
    assert_same_tensors(
        "epoch_0",
        epoch(checkpointed.path()),
        epoch(plain.path()),
        1e-6,
    );
}
