//! Exact resume and crash safety, through the binary: an interrupted run resumed from its last
//! complete checkpoint ends bit-identical to an uninterrupted one.

use crate::support;

use std::path::Path;
use std::time::{Duration, Instant};

use support::*;

const RUN: &[&str] = &[
    "run",
    "lora_finetune_single_device",
    "--config",
    "tiny/lora_single_device",
    "max_steps_per_epoch=8",
    "batch_size=2",
    "save_adapter_weights_only=True",
];

fn args<'a>(out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v: Vec<&str> = RUN.to_vec();
    v.push(out);
    v.extend_from_slice(extra);
    v
}

fn losses(dir: &Path) -> Vec<(u64, f64)> {
    read_metrics(&dir.join("logs/metrics.jsonl"))
        .iter()
        .map(|m| (m["step"].as_u64().unwrap(), m["loss"].as_f64().unwrap()))
        .collect()
}

fn adapter_bytes(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("epoch_1/adapter_model.safetensors")).unwrap()
}

#[test]
fn a_run_stopped_halfway_and_resumed_matches_an_uninterrupted_one() {
    let full = temp_dir("resume-full");
    let out_full = format!("output_dir={}", full.path().display());
    // A constant LR: stopping after one epoch here means `epochs=1`, which would otherwise
    // change the cosine schedule's length. (The SIGKILL test below keeps the schedule.)
    tune_ok(&args(&out_full, &["epochs=2", "~lr_scheduler"]));

    let split = temp_dir("resume-split");
    let out_split = format!("output_dir={}", split.path().display());
    tune_ok(&args(&out_split, &["epochs=1", "~lr_scheduler"]));
    assert!(split.path().join("epoch_0/tune_checkpoint.json").is_file());
    tune_ok(&args(
        &out_split,
        &["epochs=2", "~lr_scheduler", "resume_from_checkpoint=True"],
    ));

    assert_eq!(
        losses(full.path()),
        losses(split.path()),
        "every step's loss is bit-identical"
    );
    assert_eq!(
        adapter_bytes(full.path()),
        adapter_bytes(split.path()),
        "final adapters are identical"
    );
}

#[test]
fn resuming_with_a_changed_dataset_is_refused_naming_the_key() {
    let dir = temp_dir("resume-changed");
    let out = format!("output_dir={}", dir.path().display());
    tune_ok(&args(&out, &["epochs=1", "max_steps_per_epoch=2"]));
    let res = tune(&args(
        &out,
        &[
            "epochs=2",
            "resume_from_checkpoint=True",
            "dataset.train_on_input=False",
        ],
    ));
    assert_eq!(res.status.code(), Some(1));
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(
        err.contains("the config changed since it was written (dataset)"),
        "{err}"
    );
}

/// Kills training with SIGKILL the moment a checkpoint's temporary directory appears (a save in
/// progress), then resumes; repeated at three different checkpoints. Every resume must succeed
/// from the last complete checkpoint and end identical to an uninterrupted run.
#[test]
fn sigkill_during_a_checkpoint_write_loses_nothing() {
    let extra = ["epochs=2", "save_every_n_steps=2"];
    let reference = temp_dir("crash-ref");
    let out_ref = format!("output_dir={}", reference.path().display());
    tune_ok(&args(&out_ref, &extra));

    for kill_at in [2usize, 6, 10] {
        let dir = temp_dir("crash");
        let out = format!("output_dir={}", dir.path().display());
        let mut child = tune_command(&args(&out, &extra))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let target = format!(".tmp-step_{kill_at}-");
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut killed_mid_write = false;
        while Instant::now() < deadline {
            let entries: Vec<String> = std::fs::read_dir(dir.path())
                .map(|rd| {
                    rd.filter_map(|e| e.ok())
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            if entries.iter().any(|n| n.starts_with(&target)) {
                child.kill().unwrap();
                killed_mid_write = true;
                break;
            }
            if entries.iter().any(|n| n == &format!("step_{kill_at}"))
                || child.try_wait().unwrap().is_some()
            {
                // The save finished before we saw it: kill right after it instead.
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let _ = child.wait();
        eprintln!("kill at step {kill_at}: mid-write = {killed_mid_write}");

        // A complete checkpoint, published or not: a save killed after its last file but
        // before the rename is restored into place on resume (clean_partial), so it counts.
        let had_checkpoint = tune::checkpoint_client::list_checkpoints(dir.path())
            .unwrap()
            .iter()
            .any(|entry| entry.status.is_complete());
        let resumed = tune_ok(&args(
            &out,
            &[&extra[..], &["resume_from_checkpoint=True"]].concat(),
        ));
        let err = String::from_utf8_lossy(&resumed.stderr);
        assert_eq!(err.contains("Resuming from"), had_checkpoint, "{err}");
        let leftovers: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".tmp"))
            .collect();
        assert!(
            leftovers.is_empty(),
            "partial checkpoints are cleaned up: {leftovers:?}"
        );
        assert_eq!(
            adapter_bytes(reference.path()),
            adapter_bytes(dir.path()),
            "kill at step {kill_at}"
        );
    }
}

/// A checkpoint damaged after it was saved (one byte flipped) is reported by `tune checkpoints`
/// (exit 1) and skipped on resume, which continues from the newest checkpoint that verifies.
#[test]
fn a_damaged_checkpoint_is_reported_and_skipped_on_resume() {
    let dir = temp_dir("resume-damaged");
    let out = format!("output_dir={}", dir.path().display());
    tune_ok(&args(
        &out,
        &["epochs=1", "max_steps_per_epoch=6", "save_every_n_steps=2"],
    ));
    let damaged = dir.path().join("epoch_0/adapter_model.safetensors");
    let mut bytes = std::fs::read(&damaged).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x5a;
    std::fs::write(&damaged, bytes).unwrap();

    let listed = tune(&["checkpoints", &dir.path().display().to_string()]);
    assert_eq!(listed.status.code(), Some(1));
    let err = String::from_utf8_lossy(&listed.stderr);
    assert!(err.contains("1 checkpoint is corrupt: epoch_0"), "{err}");

    let resumed = tune_ok(&args(
        &out,
        &[
            "epochs=1",
            "max_steps_per_epoch=6",
            "save_every_n_steps=2",
            "resume_from_checkpoint=True",
        ],
    ));
    let log = String::from_utf8_lossy(&resumed.stderr);
    assert!(log.contains("skipping") && log.contains("epoch_0"), "{log}");
    assert!(log.contains("checksum mismatch"), "{log}");
    assert!(log.contains("step_4 at step 4"), "{log}");
}

/// Starts `tune <args>` in the background and returns once it is training (its metrics file
/// in `output_dir` exists, or after a minute).
fn training_in(output_dir: &Path, args: &[&str]) -> std::process::Child {
    let child = tune_command(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !output_dir.join("logs/metrics.jsonl").is_file() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    child
}

/// One run per output directory: a second `tune run` on the directory of a run in progress
/// fails at once naming the holder's pid, and leaves the first run's files alone.
#[test]
fn a_second_run_on_a_busy_output_dir_is_refused_naming_the_holder() {
    let dir = temp_dir("locked");
    let out = format!("output_dir={}", dir.path().display());
    let mut first = training_in(dir.path(), &args(&out, &["epochs=50"]));
    let config_before = std::fs::read(dir.path().join("tune_config.yaml")).unwrap();
    let second = tune(&args(&out, &["epochs=1", "seed=7"]));
    let _ = first.kill();
    let _ = first.wait();
    let err = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(1), "{err}");
    assert!(
        err.contains("another run is using it") && err.contains(&format!("pid {}", first.id())),
        "{err}"
    );
    assert_eq!(
        std::fs::read(dir.path().join("tune_config.yaml")).unwrap(),
        config_before,
        "the first run's config is untouched"
    );
    // The lock dies with its process: the directory is free again.
    tune_ok(&args(&out, &["epochs=1", "max_steps_per_epoch=2"]));
}

/// The lock is on the directory checkpoints are written to: two runs with their own
/// `output_dir` (config, metrics) but one `checkpointer.output_dir` would mix checkpoints, so
/// the second is refused naming that key and the holder, and writes nothing there.
#[test]
fn a_second_run_sharing_only_the_checkpoint_dir_is_refused() {
    let first_dir = temp_dir("locked-ckpt-a");
    let second_dir = temp_dir("locked-ckpt-b");
    let checkpoints = temp_dir("locked-ckpt-shared");
    let shared = format!("checkpointer.output_dir={}", checkpoints.path().display());
    let out_first = format!("output_dir={}", first_dir.path().display());
    let out_second = format!("output_dir={}", second_dir.path().display());
    let mut first = training_in(first_dir.path(), &args(&out_first, &["epochs=50", &shared]));
    let second = tune(&args(&out_second, &["epochs=1", "seed=7", &shared]));
    let _ = first.kill();
    let _ = first.wait();
    let err = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "checkpointer.output_dir {}: another run is using it (pid {})",
            checkpoints.path().display(),
            first.id()
        )),
        "{err}"
    );
    assert!(
        !second_dir.path().join("tune_config.yaml").exists(),
        "the refused run wrote nothing"
    );
}

/// `resume_from_checkpoint=True` with nothing to resume says so, then trains from the start.
#[test]
fn resuming_with_nothing_to_resume_says_so() {
    let dir = temp_dir("resume-nothing");
    let out = format!("output_dir={}", dir.path().display());
    let run = tune_ok(&args(
        &out,
        &[
            "epochs=1",
            "max_steps_per_epoch=2",
            "resume_from_checkpoint=True",
        ],
    ));
    let log = String::from_utf8_lossy(&run.stderr);
    assert!(
        log.contains("resume_from_checkpoint: no complete checkpoint in")
            && log.contains("training starts from the beginning"),
        "{log}"
    );
}

/// A fresh run into a directory that holds another run's checkpoints is refused with the ways
/// out, touching nothing; `overwrite_output_dir=True` deletes them first. A new run's metrics
/// start a new file (the old one is kept beside it); a rerun of the same run is allowed.
#[test]
fn a_fresh_run_into_another_runs_output_dir_is_refused() {
    let dir = temp_dir("rerun");
    let out = format!("output_dir={}", dir.path().display());
    let short = ["epochs=1", "max_steps_per_epoch=2"];
    tune_ok(&args(&out, &short));
    let adapter = dir.path().join("epoch_0/adapter_model.safetensors");
    let before = |name: &str| std::fs::read(dir.path().join(name)).unwrap();
    let (adapter_before, config_before, metrics_before) = (
        std::fs::read(&adapter).unwrap(),
        before("tune_config.yaml"),
        before("logs/metrics.jsonl"),
    );

    let other = [&short[..], &["seed=7"]].concat();
    let refused = tune(&args(&out, &other));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{err}");
    for part in [
        "holds checkpoints of another run",
        "epoch_0",
        "differs in: seed",
        "resume_from_checkpoint=True",
        "overwrite_output_dir=True",
    ] {
        assert!(err.contains(part), "missing `{part}`: {err}");
    }
    assert_eq!(std::fs::read(&adapter).unwrap(), adapter_before);
    assert_eq!(before("tune_config.yaml"), config_before);
    assert_eq!(before("logs/metrics.jsonl"), metrics_before);

    let replaced = tune_ok(&args(
        &out,
        &[&other[..], &["overwrite_output_dir=True"]].concat(),
    ));
    let log = String::from_utf8_lossy(&replaced.stderr);
    assert!(log.contains("deleted the other run's checkpoints") && log.contains("epoch_0"));
    assert_ne!(std::fs::read(&adapter).unwrap(), adapter_before);
    assert!(String::from_utf8_lossy(&before("tune_config.yaml")).contains("seed: 7"));
    let steps: Vec<u64> = losses(dir.path()).iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, [1, 2], "the new run's metrics are not appended");
    let aside: Vec<_> = std::fs::read_dir(dir.path().join("logs"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name() != "metrics.jsonl")
        .map(|e| std::fs::read(e.path()).unwrap())
        .collect();
    assert_eq!(aside, [metrics_before], "the old metrics are kept beside");

    // The same run again replaces its own checkpoints, as torchtune does.
    tune_ok(&args(&out, &other));
}

/// A run that diverges never publishes the diverged weights and names the last healthy
/// checkpoint; a resume may change only the learning rate (here: to a diverging one).
#[test]
fn a_diverged_run_publishes_nothing_and_names_the_last_healthy_checkpoint() {
    let dir = temp_dir("diverged");
    let out = format!("output_dir={}", dir.path().display());
    let base = ["max_steps_per_epoch=3", "~lr_scheduler"];
    tune_ok(&args(&out, &[&base[..], &["epochs=1"]].concat()));
    let res = tune(&args(
        &out,
        &[
            &base[..],
            &[
                "epochs=2",
                "resume_from_checkpoint=True",
                "optimizer.lr=1e30",
                "save_every_n_steps=1",
            ],
        ]
        .concat(),
    ));
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(1), "{err}");
    assert!(err.contains("optimizer.lr changed since"), "{err}");
    assert!(err.contains("training diverged at step 4"), "{err}");
    assert!(
        err.contains("holds"),
        "the trained weights are checked: {err}"
    );
    let last = dir.path().join("epoch_0");
    assert!(
        err.contains(&format!(
            "The last complete checkpoint is {}",
            last.display()
        )),
        "{err}"
    );
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names
            .iter()
            .any(|n| n.contains("step_4") || n.starts_with(".tmp")),
        "{names:?}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// SIGINT and SIGTERM (with `save_on_preempt`) while a checkpoint is being written: the run
/// stops at the step boundary, the save completes, the message names the last checkpoint and
/// the command that resumes, the exit code is 128 + the signal; the resumed run's losses and
/// final adapter equal an uninterrupted run's.
#[test]
fn a_signal_stops_at_a_step_boundary_and_the_resumed_run_matches() {
    let extra = ["epochs=3", "save_every_n_steps=2"];
    let reference = temp_dir("signal-ref");
    let out_ref = format!("output_dir={}", reference.path().display());
    tune_ok(&args(&out_ref, &extra));

    for (signal, code, preempt) in [("INT", 130, false), ("TERM", 143, true)] {
        let dir = temp_dir("signal");
        let out = format!("output_dir={}", dir.path().display());
        let preempt_arg = format!("save_on_preempt={}", if preempt { "True" } else { "False" });
        let child = tune_command(&args(&out, &[&extra[..], &[&preempt_arg]].concat()))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Signal while step_2 is being written (or just after it was).
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let writing = std::fs::read_dir(dir.path()).is_ok_and(|rd| {
                rd.filter_map(|e| e.ok()).any(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    name.starts_with(".tmp-step_2-") || name == "step_2"
                })
            });
            if writing || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let sent = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let stopped = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&stopped.stderr);
        assert_eq!(stopped.status.code(), Some(code), "SIG{signal}: {err}");
        assert!(
            err.contains(&format!("stopped by SIG{signal} at the end of step")),
            "{err}"
        );
        assert!(err.contains("The last complete checkpoint is"), "{err}");
        assert!(err.contains("resume_from_checkpoint=True"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        let step: usize = err
            .split("at the end of step ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap();
        if preempt && !step.is_multiple_of(8) {
            assert!(dir.path().join(format!("step_{step}")).is_dir(), "{err}");
        }
        assert!(
            std::fs::read_dir(dir.path()).unwrap().all(|e| !e
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with(".tmp")),
            "the save in flight completed"
        );

        tune_ok(&args(
            &out,
            &[&extra[..], &["resume_from_checkpoint=True"]].concat(),
        ));
        assert_eq!(losses(reference.path()), losses(dir.path()), "SIG{signal}");
        assert_eq!(
            std::fs::read(reference.path().join("epoch_2/adapter_model.safetensors")).unwrap(),
            std::fs::read(dir.path().join("epoch_2/adapter_model.safetensors")).unwrap(),
        );
    }
}
