//! `tune bench --json`: the object `benches/compare.py` reads beside the PyTorch reference's,
//! with the same keys and measured (non-zero) figures; an unknown shape is bad input.

use crate::support;

use support::*;

#[test]
fn bench_json_has_the_reference_keys_and_real_figures() {
    let run = tune_ok(&[
        "bench",
        "--shape",
        "tiny",
        "--mode",
        "lora",
        "--batch-size",
        "1",
        "--seq-len",
        "16",
        "--steps",
        "1",
        "--json",
    ]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    assert_eq!(report["impl"], "tune");
    assert_eq!(report["shape"], "tiny");
    assert_eq!(report["mode"], "lora");
    assert_eq!(report["batch_size"], 1);
    assert_eq!(report["seq_len"], 16);
    for key in [
        "tokens_per_second",
        "step_seconds",
        "forward_seconds",
        "backward_seconds",
        "peak_memory_bytes",
        "params",
    ] {
        let v = report[key].as_f64().unwrap_or(0.0);
        assert!(v > 0.0, "{key} = {v} in {report}");
    }
    let step = report["step_seconds"].as_f64().unwrap();
    let tps = report["tokens_per_second"].as_f64().unwrap();
    assert!(
        (tps * step - 16.0).abs() < 1e-6,
        "tokens/s is tokens per step over step time"
    );
}

#[test]
fn unknown_shape_is_bad_input() {
    let run = tune(&["bench", "--shape", "gpt5", "--json"]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("unknown shape `gpt5`") && stderr.contains("smollm2-135m"),
        "{stderr}"
    );
}
