//! `tune bench --json`: the object `benches/compare.py` reads beside the PyTorch reference's,
//! with the same keys and measured (non-zero) figures; an unknown shape or attention is bad input.

use crate::support;

use support::*;

/// `tune bench` of one tiny LoRA step of 16 tokens with `extra` arguments.
fn tiny_bench(extra: &[&str]) -> std::process::Output {
    let mut args = vec![
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
    ];
    args.extend_from_slice(extra);
    tune(&args)
}

fn report(run: &std::process::Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    serde_json::from_str(stdout.trim()).expect("one JSON object")
}

#[test]
fn bench_json_has_the_reference_keys_and_real_figures() {
    let report = report(&tiny_bench(&[]));
    assert_eq!(report["impl"], "tune");
    assert_eq!(report["shape"], "tiny");
    assert_eq!(report["mode"], "lora");
    assert_eq!(report["batch_size"], 1);
    assert_eq!(report["seq_len"], 16);
    assert_eq!(report["attention"], "fused");
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

/// `--attention composed` measures burn's composed attention and says so; another value is
/// refused with the choices.
#[test]
fn bench_attention_switch_is_reported_and_checked() {
    let report = report(&tiny_bench(&["--attention", "composed"]));
    assert_eq!(report["attention"], "composed");
    assert!(report["tokens_per_second"].as_f64().unwrap_or(0.0) > 0.0);
    let run = tiny_bench(&["--attention", "flash"]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("fused, composed"), "{stderr}");
}

/// `--attention-block` caps the cubecl kernels' block: on the CPU, which has no such kernels, it
/// is refused by name rather than ignored.
#[test]
fn attention_block_is_refused_on_the_cpu() {
    let run = tiny_bench(&["--attention-block", "32"]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--attention-block") && stderr.contains("cuda or wgpu"),
        "{stderr}"
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

/// `--row-lengths`: rows of the file's lengths (cut to `--seq-len`), padded per batch; tokens/s
/// counts the rows' tokens, not the padding, whether the rows run padding-free or padded. A
/// missing or malformed file is refused by name.
#[test]
fn bench_row_lengths_count_real_tokens_and_bad_files_are_named() {
    let dir = temp_dir("bench-rows");
    let lengths = dir.path().join("lengths.json");
    // Steps take 2 rows each: 2 warm-up steps (5+40 -> 5+16, 9+3), then the timed 12 + 7.
    std::fs::write(&lengths, r#"{"lengths": [5, 40, 9, 3, 12, 7]}"#).unwrap();
    let path = lengths.to_str().unwrap();
    for extra in [&[][..], &["--keep-padding"][..]] {
        let mut args = vec![
            "bench",
            "--shape",
            "tiny",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--steps",
            "1",
            "--json",
            "--row-lengths",
            path,
        ];
        args.extend_from_slice(extra);
        let report = report(&tune(&args));
        assert_eq!(report["row_lengths"], true);
        let padding = if extra.is_empty() { "free" } else { "kept" };
        assert_eq!(report["padding"], padding);
        let tokens = report["tokens_per_second"].as_f64().unwrap()
            * report["step_seconds"].as_f64().unwrap();
        assert!(
            (tokens - 19.0).abs() < 1e-6,
            "{padding}: {tokens} tokens per step"
        );
    }

    std::fs::write(&lengths, r#"{"lengths": []}"#).unwrap();
    for (file, says) in [
        (path, "at least one length"),
        ("/no/such.json", "/no/such.json"),
    ] {
        let run = tiny_bench(&["--row-lengths", file]);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(!run.status.success());
        assert!(stderr.contains(says) && stderr.contains(file), "{stderr}");
    }
}
