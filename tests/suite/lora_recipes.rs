//! End to end: the LoRA recipe through the binary on the shipped tiny model and data.

use crate::support;

use support::*;

/// The README's main job (tiny LoRA) into `out`, with overrides; its metrics.
pub(crate) fn lora_run(out: &TempDir, extra: &[&str]) -> Vec<serde_json::Value> {
    run_recipe(
        "lora_finetune_single_device",
        "tiny/lora_single_device",
        out,
        extra,
    )
}

#[test]
fn thirty_lora_steps_lower_the_loss_and_write_a_peft_adapter() {
    let out = temp_dir("lora30");
    let metrics = lora_run(&out, &["batch_size=2", "max_steps_per_epoch=30"]);
    assert_eq!(metrics.len(), 30, "one metrics line per step");
    let loss = column(&metrics, "loss");
    let (first, last) = (mean(&loss[..5]), mean(&loss[25..]));
    assert!(
        last < first - 1.0,
        "loss should fall well below its start: first {first:.3}, last {last:.3}"
    );
    for key in [
        "step",
        "epoch",
        "loss",
        "lr",
        "tokens_per_second",
        "peak_memory_bytes",
    ] {
        assert!(
            metrics[0].get(key).is_some(),
            "metrics.jsonl lacks {key}: {}",
            metrics[0]
        );
    }
    let ckpt = out.path().join("epoch_0");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["task_type"], "CAUSAL_LM");
    assert_eq!(config["r"], 8);
    let adapter = tune::checkpoint::safetensors_io::SafetensorsFile::open(
        &ckpt.join("adapter_model.safetensors"),
    )
    .unwrap();
    assert!(
        adapter.names().contains(
            &"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight".to_string()
        )
    );
    assert_eq!(
        adapter.shape("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"),
        Some(vec![64, 8])
    );
    // The merged model loads as a plain HF checkpoint.
    let merged = tune::model_io::hf::load_model::<Cpu>(&ckpt, None, &Default::default()).unwrap();
    assert_eq!(merged.model.args.num_layers, 2);
}

#[test]
fn the_same_seed_gives_identical_losses() {
    let (a, b) = (temp_dir("seed-a"), temp_dir("seed-b"));
    // Dropout on, so the per-step reseeding is exercised too.
    let args = ["max_steps_per_epoch=8", "model.lora_dropout=0.1"];
    let la = column(&lora_run(&a, &args), "loss");
    let lb = column(&lora_run(&b, &args), "loss");
    assert_eq!(la, lb);
}

#[test]
fn clipping_logs_the_gradient_norm() {
    let out = temp_dir("clip");
    let metrics = lora_run(&out, &["max_steps_per_epoch=3", "clip_grad_norm=1.0"]);
    assert!(
        column(&metrics, "grad_norm")
            .iter()
            .all(|n| n.is_finite() && *n > 0.0)
    );
}

#[test]
fn a_diverging_run_stops_with_a_clear_message() {
    let out = temp_dir("nan");
    let res = tiny_lora(
        &out,
        &[
            "optimizer.lr=1e30",
            "~lr_scheduler",
            "max_steps_per_epoch=10",
        ],
    );
    assert_eq!(res.status.code(), Some(1));
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(err.contains("the loss became"), "{err}");
    assert!(err.contains("Lower optimizer.lr"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// A `tokenizer.max_seq_len` past the model's positions is lowered to them with a warning.
#[test]
fn max_seq_len_past_the_models_positions_is_lowered_with_a_warning() {
    let out = temp_dir("positions");
    let output_dir = format!("output_dir={}", out.path().display());
    let res = tune_ok(&[
        "run",
        "lora_finetune_single_device",
        "--config",
        "tiny/lora_single_device",
        &output_dir,
        "tokenizer.max_seq_len=4096",
        "epochs=1",
        "max_steps_per_epoch=1",
    ]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(
        err.contains("tokenizer.max_seq_len=4096 is more than the model's 256 positions")
            && err.contains("truncated to 256 tokens"),
        "{err}"
    );
}

/// An output_dir or log_dir that cannot be created: the error names the key and the path
/// (the plain "Not a directory (os error 20)" named neither).
#[test]
fn an_unusable_output_or_log_dir_is_named_with_its_key() {
    let tmp = temp_dir("unusable");
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "not a directory").unwrap();
    let under_file = file.join("out");
    for (key, extra) in [
        ("output_dir", format!("output_dir={}", under_file.display())),
        (
            "metric_logger.log_dir",
            format!("metric_logger.log_dir={}", under_file.display()),
        ),
    ] {
        let out_dir = format!("output_dir={}", tmp.path().join("ok").display());
        let res = tune(&[
            "run",
            "lora_finetune_single_device",
            "--config",
            "tiny/lora_single_device",
            &out_dir,
            &extra,
        ]);
        let err = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(1), "{err}");
        assert!(
            err.contains(&format!("{key} {}: ", under_file.display())),
            "{key}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// After `cargo install`, no source tree: the tiny configs run from any directory on the copy
/// of the tiny model and data embedded in the binary, written once into the user cache.
#[test]
fn the_tiny_config_runs_from_a_directory_outside_the_repository() {
    let cwd = temp_dir("outside");
    let cache = temp_dir("outside-cache");
    let out = cwd.path().join("run");
    let run = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_tune"))
            .args([
                "run",
                "lora_finetune_single_device",
                "--config",
                "tiny/lora_single_device",
                &format!("output_dir={}", out.display()),
                "max_steps_per_epoch=5",
                "overwrite_output_dir=True",
            ])
            .current_dir(cwd.path())
            .env("XDG_CACHE_HOME", cache.path())
            .output()
            .unwrap()
    };
    for _ in 0..2 {
        let res = run();
        let err = String::from_utf8_lossy(&res.stderr);
        assert!(res.status.success(), "{err}");
    }
    let copies: Vec<_> = std::fs::read_dir(cache.path().join("tune"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(copies.len(), 1, "one copy, reused: {copies:?}");
    assert!(copies[0].starts_with("assets-"), "{copies:?}");
    let copy = cache.path().join("tune").join(&copies[0]);
    assert_eq!(
        std::fs::read(copy.join("assets/tiny-llama/model.safetensors")).unwrap(),
        std::fs::read(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("assets/tiny-llama/model.safetensors")
        )
        .unwrap()
    );
    let saved = std::fs::read_to_string(out.join("tune_config.yaml")).unwrap();
    assert!(saved.contains(&copy.display().to_string()), "{saved}");
    let metrics = read_metrics(&out.join("logs/metrics.jsonl"));
    assert_eq!(metrics.len(), 5);
}

/// Outside the repository with a cache that cannot be written (XDG_CACHE_HOME is a file): the
/// error names the config key, its value, the path that failed and the ways out; no panic.
#[test]
fn an_unwritable_cache_for_the_shipped_assets_is_named() {
    let cwd = temp_dir("outside-nocache");
    let blocker = cwd.path().join("not-a-dir");
    std::fs::write(&blocker, "x").unwrap();
    let res = std::process::Command::new(env!("CARGO_BIN_EXE_tune"))
        .args(["validate", "tiny/lora_single_device"])
        .current_dir(cwd.path())
        .env("XDG_CACHE_HOME", &blocker)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success(), "{err}");
    assert!(
        err.contains("config key ")
            && err.contains("`assets/")
            && err.contains(&blocker.display().to_string())
            && err.contains("set XDG_CACHE_HOME to a writable directory"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// `tune push --dry-run` on a checkpoint a run wrote: what a Hub user loads and the card, not
/// the optimizer state or the manifest; no token or network needed (offline mode set).
#[test]
fn push_dry_run_lists_what_a_hub_user_loads() {
    let out = temp_dir("push-dry-run");
    lora_run(&out, &["max_steps_per_epoch=2"]);
    let checkpoint = out.path().join("epoch_0");
    assert!(checkpoint.join("optimizer.safetensors").is_file());
    let res = tune_command(&[
        "push",
        &checkpoint.display().to_string(),
        "me/tiny-lora",
        "--dry-run",
    ])
    .env("HF_HUB_OFFLINE", "1")
    .env_remove("HF_TOKEN")
    .output()
    .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&res.stdout),
        String::from_utf8_lossy(&res.stderr),
    );
    assert!(res.status.success(), "{stderr}");
    let listed: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .collect();
    assert!(
        listed.contains(&"adapter_model.safetensors")
            && listed.contains(&"adapter_config.json")
            && listed.contains(&"README.md"),
        "{stdout}"
    );
    assert!(
        !listed.contains(&"optimizer.safetensors") && !listed.contains(&"tune_checkpoint.json"),
        "{stdout}"
    );
    assert!(stderr.contains("--include-training-state"), "{stderr}");
    // Without --dry-run, offline mode refuses the push by name.
    let res = tune_command(&["push", &checkpoint.display().to_string(), "me/tiny-lora"])
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_TOKEN", "hf_x")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success());
    assert!(stderr.contains("HF_HUB_OFFLINE is set"), "{stderr}");
}

#[test]
fn a_generic_builders_architecture_must_match_the_checkpoint() {
    let out = temp_dir("arch");
    let output_dir = format!("output_dir={}", out.path().display());
    let run = tiny_lora(
        &out,
        &[
            "model=torchtune.models.llama3.lora_llama3",
            "model.lora_rank=8",
            "model.lora_alpha=16",
            "model.lora_attn_modules=[q_proj,v_proj]",
            "model.num_layers=3",
        ],
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(
        stderr.contains("model.num_layers")
            && stderr.contains("num_hidden_layers = 2")
            && stderr.contains("config.json"),
        "{stderr}"
    );
    // The same check for generation's model and for distillation's teacher.
    let run = tune(&[
        "run",
        "generate",
        "--config",
        "tiny/generation",
        "model=torchtune.models.llama3.llama3",
        "model.embed_dim=128",
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(
        stderr.contains("model.embed_dim") && stderr.contains("hidden_size = 64"),
        "{stderr}"
    );
    let run = tune(&[
        "run",
        "knowledge_distillation_single_device",
        "--config",
        "tiny/kd_lora_single_device",
        &output_dir,
        "teacher_model.num_layers=2",
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(
        stderr.contains("teacher_model.num_layers") && stderr.contains("num_hidden_layers = 3"),
        "{stderr}"
    );
}

/// `use_dora: True` trains DoRA (the magnitudes too), saves it as peft does and exports the
/// merged model; `tune run generate` applies the saved adapter.
#[test]
fn dora_trains_and_saves_a_peft_dora_adapter() {
    let out = temp_dir("dora");
    let metrics = lora_run(
        &out,
        &[
            "model.use_dora=True",
            "max_steps_per_epoch=20",
            "batch_size=2",
        ],
    );
    let loss = column(&metrics, "loss");
    assert!(
        mean(&loss[15..]) < mean(&loss[..5]) - 0.5,
        "DoRA's loss should fall: {loss:?}"
    );
    let ckpt = out.path().join("epoch_0");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["use_dora"], true);
    let adapter = tune::checkpoint::safetensors_io::SafetensorsFile::open(
        &ckpt.join("adapter_model.safetensors"),
    )
    .unwrap();
    let key = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector";
    assert_eq!(adapter.shape(key), Some(vec![64]));
    // The magnitudes trained: they moved from the base weight's row norms.
    let base = tune::model_io::hf::load_model::<Cpu>(
        std::path::Path::new(&format!("{}/assets/tiny-llama", env!("CARGO_MANIFEST_DIR"))),
        None,
        &Default::default(),
    )
    .unwrap()
    .model;
    let w = base
        .hf_state_dict()
        .into_iter()
        .find(|(n, _)| n == "model.layers.0.self_attn.q_proj.weight")
        .unwrap()
        .1;
    let m = adapter.read(key).unwrap();
    let moved = w
        .data
        .chunks(64)
        .zip(&m.data)
        .any(|(row, m)| (row.iter().map(|v| v * v).sum::<f32>().sqrt() - m).abs() > 1e-4);
    assert!(moved, "magnitudes did not train");
    let merged = tune::model_io::hf::load_model::<Cpu>(&ckpt, None, &Default::default()).unwrap();
    assert_eq!(merged.model.args.num_layers, 2);
    let adapter_dir = format!("adapter_dir={}", ckpt.display());
    let run = tune(&[
        "run",
        "generate",
        "--config",
        "tiny/generation",
        &adapter_dir,
        "max_new_tokens=4",
        "temperature=0",
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// `device: wgpu` in a build without the feature says how to get it (tests/suite/gpu.rs runs
/// the recipes on wgpu in a build with it).
#[cfg(not(feature = "wgpu"))]
#[test]
fn device_wgpu_without_the_feature_says_how_to_build_it() {
    let out = temp_dir("no-wgpu");
    let res = tiny_lora(&out, &["device=wgpu"]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(2), "{err}");
    assert!(err.contains("--features wgpu"), "{err}");
}

/// `attention: composed` runs burn's composed attention instead of tune's fused kernel: the
/// same losses within float rounding, and not bit for bit the fused run's (the key took effect).
#[test]
fn composed_attention_trains_as_the_fused_kernel() {
    let losses = |attention: &str| {
        let out = temp_dir(&format!("lora-attention-{attention}"));
        let run = tiny_lora(
            &out,
            &[&format!("attention={attention}"), "max_steps_per_epoch=6"],
        );
        assert!(
            run.status.success(),
            "attention={attention}:\n{}",
            String::from_utf8_lossy(&run.stderr)
        );
        column(
            &read_metrics(&out.path().join("logs/metrics.jsonl")),
            "loss",
        )
    };
    let (fused, composed) = (losses("fused"), losses("composed"));
    assert_eq!(fused.len(), composed.len());
    for (f, c) in fused.iter().zip(&composed) {
        assert!((f - c).abs() <= 1e-4 * f.abs(), "{fused:?} vs {composed:?}");
    }
    assert_ne!(fused, composed, "the two paths round differently");
}

/// torchtune's `log_level`: `WARN` keeps warnings only (no start-up, save or report lines),
/// `DEBUG` adds what each stage loaded and decided; `log_peak_memory_stats: False` leaves the
/// memory metrics out of metrics.jsonl.
#[test]
fn log_level_and_log_peak_memory_stats_shape_what_a_run_says() {
    let run = |tag: &str, extra: &[&str]| {
        let out = temp_dir(tag);
        let output_dir = format!("output_dir={}", out.path().display());
        let mut args = vec![
            "run",
            "lora_finetune_single_device",
            "--config",
            "tiny/lora_single_device",
            output_dir.as_str(),
            "max_steps_per_epoch=2",
        ];
        args.extend_from_slice(extra);
        let done = tune_ok(&args);
        let metrics = read_metrics(&out.path().join("logs/metrics.jsonl"));
        (String::from_utf8_lossy(&done.stderr).into_owned(), metrics)
    };
    let (info, metrics) = run("log-info", &[]);
    assert!(
        info.contains("LoRA fine-tuning") && info.contains("checkpoint: saved"),
        "{info}"
    );
    assert!(!info.contains("debug:"), "{info}");
    assert!(
        metrics[0].get("peak_memory_bytes").is_some(),
        "{}",
        metrics[0]
    );
    let (quiet, metrics) = run(
        "log-warn",
        &["log_level=WARN", "log_peak_memory_stats=False"],
    );
    for line in ["LoRA fine-tuning", "checkpoint: saved", "Trained 2 steps"] {
        assert!(
            !quiet.contains(line),
            "{line:?} with log_level=WARN:\n{quiet}"
        );
    }
    for key in [
        "peak_memory_bytes",
        "parameter_bytes",
        "optimizer_state_bytes",
    ] {
        assert!(metrics[0].get(key).is_none(), "{key}: {}", metrics[0]);
    }
    assert!(metrics[0].get("loss").is_some());
    let (debug, _) = run("log-debug", &["log_level=DEBUG"]);
    for line in [
        "debug: checkpointer: loaded",
        "debug: parallelism: 1 worker(s)",
        "debug: dataset:",
        "debug: fingerprint",
    ] {
        assert!(
            debug.contains(line),
            "{line:?} with log_level=DEBUG:\n{debug}"
        );
    }
}
