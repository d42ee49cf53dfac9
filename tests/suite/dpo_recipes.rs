//! End-to-end: the `lora_dpo_single_device` and `full_dpo_single_device` recipes through the
//! binary on the tiny configs: preference learning shows in the logged rewards, the saved
//! adapter has the PEFT layout, resuming is exact, and bad preference data is a clear error.

use crate::support::temp_dir;

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use tune::checkpoint::safetensors_io::SafetensorsFile;

/// Runs `tune run <recipe> --config tiny/<config> output_dir=<out> <overrides>` from the
/// repository root; returns (success, stderr).
fn tune(recipe: &str, config: &str, out: &Path, overrides: &[&str]) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_tune"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["run", recipe, "--config", &format!("tiny/{config}")])
        .arg(format!("output_dir={}", out.display()))
        .args(overrides)
        .output()
        .expect("run tune");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn run_ok(recipe: &str, config: &str, out: &Path, overrides: &[&str]) {
    let (ok, stderr) = tune(recipe, config, out, overrides);
    assert!(ok, "tune run {recipe} failed:\n{stderr}");
}

fn metrics(out: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(out.join("logs/metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .map(|l| serde_json::from_str(l).expect("metrics line"))
        .collect()
}

fn series(rows: &[Value], key: &str) -> Vec<f64> {
    rows.iter()
        .map(|r| {
            r[key]
                .as_f64()
                .unwrap_or_else(|| panic!("{key} missing in {r}"))
        })
        .collect()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// Every tensor of a safetensors file, by name, as raw bits (for exact comparison).
fn tensors(path: &Path) -> Vec<(String, Vec<u32>)> {
    let file = SafetensorsFile::open(path).expect("open safetensors");
    let mut names = file.names();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let bits = file
                .read(&n)
                .expect("read")
                .data
                .iter()
                .map(|v| v.to_bits())
                .collect();
            (n, bits)
        })
        .collect()
}

/// Preference pairs in the stack_exchange_paired layout that fit the tiny config's 128-token
/// limit: the shipped stack_exchange_paired_tiny questions run to thousands of tokens, so
/// truncation leaves most pairs without a response to score. Each short alpaca_tiny row gives a
/// pair: its own output is chosen, the next short row's output is rejected.
fn alpaca_pairs(dir: &Path) -> String {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/data/alpaca_tiny.json"),
    )
    .expect("alpaca_tiny.json");
    let rows: Vec<Value> = serde_json::from_str(&text).expect("json");
    let field = |r: &Value, k: &str| r[k].as_str().unwrap_or_default().to_string();
    let short: Vec<(String, String)> = rows
        .iter()
        .map(|r| {
            let input = field(r, "input");
            let q = if input.is_empty() {
                field(r, "instruction")
            } else {
                format!("{}\n\n{input}", field(r, "instruction"))
            };
            (q, field(r, "output"))
        })
        .filter(|(q, a)| q.len() + a.len() < 200)
        .take(21)
        .collect();
    assert_eq!(short.len(), 21, "enough short alpaca rows");
    let pairs: Vec<Value> = (0..20)
        .map(|i| serde_json::json!({"question": short[i].0, "response_j": short[i].1, "response_k": short[i + 1].1}))
        .collect();
    let path = dir.join("alpaca_pairs.json");
    std::fs::write(&path, serde_json::to_string(&pairs).unwrap()).unwrap();
    format!("dataset.data_files={}", path.display())
}

/// The tiny LoRA DPO config on 20 pairs: 2 pairs a step, 10 steps an epoch, 4 epochs = 40
/// steps, a constant learning rate so a run stopped after an epoch and resumed sees the same
/// schedule as one run straight through.
const LORA: &[&str] = &[
    "batch_size=2",
    "lr_scheduler._component_=torchtune.training.lr_schedulers.get_constant_schedule_with_warmup",
    "lr_scheduler.num_warmup_steps=0",
    "save_adapter_weights_only=True",
];

#[test]
fn lora_dpo_learns_preferences_saves_peft_and_resumes_exactly() {
    let full = temp_dir("dpo-lora-full");
    let data = alpaca_pairs(full.path());
    let mut args = LORA.to_vec();
    args.extend(["epochs=4", &data]);
    run_ok(
        "lora_dpo_single_device",
        "lora_dpo_single_device",
        full.path(),
        &args,
    );

    // Preference learning: the implicit reward margin and the share of pairs ranked right rise.
    let rows = metrics(full.path());
    assert_eq!(rows.len(), 40, "one metrics line per step");
    let margins = series(&rows, "rewards/margins");
    let accuracies = series(&rows, "rewards/accuracies");
    let losses = series(&rows, "loss");
    let (m0, m1) = (mean(&margins[..8]), mean(&margins[32..]));
    let (a0, a1) = (mean(&accuracies[..8]), mean(&accuracies[32..]));
    let (l0, l1) = (mean(&losses[..8]), mean(&losses[32..]));
    eprintln!("margins {m0:.4} -> {m1:.4}; accuracies {a0:.3} -> {a1:.3}; loss {l0:.4} -> {l1:.4}");
    assert!(m1 > m0 + 0.05, "margins should rise: {m0} -> {m1}");
    assert!(a1 > a0, "accuracies should rise: {a0} -> {a1}");
    assert!(l1 < l0, "loss should fall: {l0} -> {l1}");
    for key in [
        "rewards/chosen",
        "rewards/rejected",
        "log_probs/chosen",
        "log_probs/rejected",
        "logits/chosen",
    ] {
        assert!(rows[0][key].is_number(), "{key} logged");
    }

    // The adapter in PEFT layout.
    let last = full.path().join("epoch_3");
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(last.join("adapter_config.json")).expect("adapter_config.json"),
    )
    .expect("json");
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 8);
    let adapter = tensors(&last.join("adapter_model.safetensors"));
    assert!(
        adapter
            .iter()
            .any(|(n, _)| n == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
        "PEFT keys: {:?}",
        adapter.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    assert!(
        adapter
            .iter()
            .all(|(n, _)| n.starts_with("base_model.model.") && n.contains(".lora_"))
    );

    // Resume: 2 epochs, stop; then resume to 4. Same per-step losses and the same adapter.
    let split = temp_dir("dpo-lora-split");
    let mut first = LORA.to_vec();
    first.extend(["epochs=2", &data]);
    run_ok(
        "lora_dpo_single_device",
        "lora_dpo_single_device",
        split.path(),
        &first,
    );
    assert_eq!(metrics(split.path()).len(), 20);
    let mut second = LORA.to_vec();
    second.extend(["epochs=4", "resume_from_checkpoint=True", &data]);
    let (ok, stderr) = tune(
        "lora_dpo_single_device",
        "lora_dpo_single_device",
        split.path(),
        &second,
    );
    assert!(ok, "resume failed:\n{stderr}");
    assert!(stderr.contains("Resuming from"), "{stderr}");
    let resumed = metrics(split.path());
    assert_eq!(series(&resumed, "step"), series(&rows, "step"));
    assert_eq!(
        series(&resumed, "loss"),
        losses,
        "per-step losses of the resumed run"
    );
    assert_eq!(series(&resumed, "rewards/margins"), margins);
    assert_eq!(
        tensors(&split.path().join("epoch_3/adapter_model.safetensors")),
        adapter,
        "final adapter"
    );
}

/// Full DPO at the config's learning rate (1e-5): 3 epochs over the 20 pairs, 10 steps each;
/// the last epoch ranks the pairs it has seen better than the first did.
#[test]
fn full_dpo_trains_against_frozen_reference() {
    let out = temp_dir("dpo-full");
    let data = alpaca_pairs(out.path());
    run_ok(
        "full_dpo_single_device",
        "full_dpo_single_device",
        out.path(),
        &["batch_size=2", "epochs=3", &data],
    );
    let rows = metrics(out.path());
    assert_eq!(rows.len(), 30);
    let margins = series(&rows, "rewards/margins");
    let accuracies = series(&rows, "rewards/accuracies");
    let losses = series(&rows, "loss");
    let (m0, m1) = (mean(&margins[..10]), mean(&margins[20..]));
    let (a0, a1) = (mean(&accuracies[..10]), mean(&accuracies[20..]));
    let (l0, l1) = (mean(&losses[..10]), mean(&losses[20..]));
    eprintln!(
        "full DPO: margins {m0:.4} -> {m1:.4}; accuracies {a0:.3} -> {a1:.3}; loss {l0:.4} -> {l1:.4}"
    );
    assert!(
        m1 > m0 + 0.05 && a1 > a0 && l1 < l0,
        "margins {m0} -> {m1}, accuracies {a0} -> {a1}, loss {l0} -> {l1}"
    );
    // At step 1 the policy is the reference, so the loss is ln 2.
    assert!(
        (losses[0] - std::f64::consts::LN_2).abs() < 1e-5,
        "first loss {}",
        losses[0]
    );
    assert!(
        out.path().join("epoch_2/config.json").is_file(),
        "a full Hugging Face model is saved"
    );
    assert!(
        out.path().join("epoch_2/model.safetensors").is_file(),
        "a full Hugging Face model is saved"
    );
}

#[test]
fn dpo_on_bad_data_names_the_row() {
    let out = temp_dir("dpo-bad");
    let data = out.path().join("pairs.json");
    std::fs::write(
        &data,
        r#"[{"question": "q", "response_j": "a", "response_k": "b"}, {"question": "q", "response_j": "", "response_k": "b"}]"#,
    )
    .unwrap();
    let file = format!("dataset.data_files={}", data.display());
    let (ok, stderr) = tune(
        "lora_dpo_single_device",
        "lora_dpo_single_device",
        out.path(),
        &[&file],
    );
    assert!(!ok);
    assert!(
        stderr.contains("pairs.json")
            && stderr.contains("row 1")
            && stderr.contains("`response_j`"),
        "{stderr}"
    );

    // An SFT dataset has no rejected side.
    let (ok, stderr) = tune(
        "lora_dpo_single_device",
        "lora_dpo_single_device",
        out.path(),
        &[
            "dataset._component_=torchtune.datasets.alpaca_dataset",
            "dataset.data_files=assets/data/alpaca_tiny.json",
        ],
    );
    assert!(!ok);
    assert!(
        stderr.contains("dataset") && stderr.contains("preference"),
        "{stderr}"
    );

    let (ok, stderr) = tune(
        "lora_dpo_single_device",
        "lora_dpo_single_device",
        out.path(),
        &["loss.beta=-1"],
    );
    assert!(!ok);
    assert!(
        stderr.contains("loss.beta") && stderr.contains("positive"),
        "{stderr}"
    );
}
