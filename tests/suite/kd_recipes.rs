//! End-to-end: `tune run knowledge_distillation_single_device --config tiny/kd_lora_single_device`
//! through the binary, on the tiny assets. Distillation lowers the KD loss; resuming from a
//! mid-run checkpoint reproduces the uninterrupted run exactly; a teacher with another
//! vocabulary is refused with the documented message.

use crate::support;

use std::path::Path;

use support::{read_metrics, temp_dir, tune_command};

const RECIPE: &str = "knowledge_distillation_single_device";
const CONFIG: &str = "tiny/kd_lora_single_device";

/// Runs the recipe with `overrides`; returns (success, stderr).
fn tune_run(output_dir: &Path, overrides: &[String]) -> (bool, String) {
    let out = tune_command(&["run", RECIPE, "--config", CONFIG])
        .arg(format!("output_dir={}", output_dir.display()))
        .args(overrides)
        .output()
        .expect("run the tune binary");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn overrides(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// Every logged step of `<output_dir>/logs/metrics.jsonl`.
fn metrics(output_dir: &Path) -> Vec<serde_json::Value> {
    read_metrics(&output_dir.join("logs/metrics.jsonl"))
}

fn series(rows: &[serde_json::Value], key: &str) -> Vec<(u64, f64)> {
    rows.iter()
        .filter_map(|r| Some((r["step"].as_u64()?, r[key].as_f64()?)))
        .collect()
}

fn mean_value(xs: &[(u64, f64)]) -> f64 {
    xs.iter().map(|(_, v)| v).sum::<f64>() / xs.len() as f64
}

#[test]
fn distillation_lowers_the_kd_loss() {
    let out = temp_dir("kd-train");
    let (ok, stderr) = tune_run(
        out.path(),
        &overrides(&[
            "epochs=2",
            "max_steps_per_epoch=20",
            "save_adapter_weights_only=True",
        ]),
    );
    assert!(ok, "{stderr}");
    let rows = metrics(out.path());
    let kd = series(&rows, "kd_loss");
    let class = series(&rows, "class_loss");
    assert_eq!(kd.len(), 40, "one kd_loss per step: {rows:?}");
    assert_eq!(class.len(), 40, "one class_loss per step");
    let (first, last) = (mean_value(&kd[..5]), mean_value(&kd[35..]));
    assert!(
        last < first - 0.5,
        "kd_loss should fall: first steps {first:.4}, last steps {last:.4}"
    );
    // The trainer's loss is the kd_ratio mix of the two.
    let loss = series(&rows, "loss");
    for ((_, l), ((_, c), (_, k))) in loss.iter().zip(class.iter().zip(&kd)) {
        assert!(
            (l - (0.5 * c + 0.5 * k)).abs() < 1e-3 * l.abs().max(1.0),
            "loss {l} != 0.5 * {c} + 0.5 * {k}"
        );
    }
    let last_ckpt = out.path().join("epoch_1");
    assert!(
        last_ckpt.join("adapter_model.safetensors").is_file(),
        "the student's adapter is saved"
    );
    assert!(last_ckpt.join("adapter_config.json").is_file());
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        let to = dst.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &to);
        } else {
            std::fs::copy(entry.path(), to).unwrap();
        }
    }
}

#[test]
fn resuming_from_a_mid_run_checkpoint_is_exact() {
    let common_args = [
        "epochs=1",
        "max_steps_per_epoch=8",
        "save_every_n_steps=4",
        "save_adapter_weights_only=True",
    ];
    // The uninterrupted run: 8 steps, with a checkpoint at step 4.
    let full = temp_dir("kd-full");
    let (ok, stderr) = tune_run(full.path(), &overrides(&common_args));
    assert!(ok, "{stderr}");
    // Half of it resumed: a fresh output_dir holding only the step-4 checkpoint.
    let resumed = temp_dir("kd-resumed");
    copy_dir(&full.path().join("step_4"), &resumed.path().join("step_4"));
    let mut args = overrides(&common_args);
    args.push("resume_from_checkpoint=True".into());
    let (ok, stderr) = tune_run(resumed.path(), &args);
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("at step 4"),
        "resumed from step 4: {stderr}"
    );

    let (a, b) = (metrics(full.path()), metrics(resumed.path()));
    for key in ["loss", "class_loss", "kd_loss", "lr"] {
        let want: Vec<(u64, f64)> = series(&a, key)
            .into_iter()
            .filter(|(s, _)| *s > 4)
            .collect();
        let got = series(&b, key);
        assert_eq!(got.len(), 4, "{key}: the resumed run logs steps 5..8");
        assert_eq!(got, want, "{key}: per-step values identical after resuming");
    }
    let adapter =
        |dir: &Path| std::fs::read(dir.join("epoch_0/adapter_model.safetensors")).unwrap();
    assert!(
        adapter(full.path()) == adapter(resumed.path()),
        "the final adapters are byte-identical"
    );
}

#[test]
fn a_teacher_with_another_vocabulary_is_refused() {
    // A copy of the teacher whose config.json claims a 32000-token vocabulary.
    let teacher = temp_dir("kd-bad-teacher");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-llama-teacher");
    copy_dir(&src, teacher.path());
    let config_path = teacher.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["vocab_size"] = 32000.into();
    std::fs::write(&config_path, config.to_string()).unwrap();

    let out = temp_dir("kd-refused");
    let (ok, stderr) = tune_run(
        out.path(),
        &[format!(
            "teacher_checkpointer.checkpoint_dir={}",
            teacher.path().display()
        )],
    );
    assert!(!ok, "a mismatched teacher must be refused");
    assert!(
        stderr.contains("teacher vocab_size 32000 != student vocab_size 2048: the teacher must share the student's tokenizer"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("panicked"),
        "a clear error, not a panic: {stderr}"
    );
}
