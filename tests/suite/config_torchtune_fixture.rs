//! torchtune's own `llama3_2/1B_lora_single_device.yaml`, verbatim, validates once
//! its paths point at real files.

use crate::support::{args, path_in, temp_dir, touch};
use tune::config::load_config;

use tune::recipes::validate;

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/torchtune_llama3_2_1B_lora_single_device.yaml"
);

#[test]
fn torchtune_config_validates_after_path_overrides() {
    let model = temp_dir("llama32");
    touch(model.path(), "epoch_2/ft-model-00001-of-00001.safetensors");
    touch(model.path(), "tokenizer.json");
    touch(model.path(), "original/tokenizer.model");
    let cfg = load_config(
        FIXTURE,
        &args(&[
            &format!("checkpointer.checkpoint_dir={}", path_in(model.path(), "")),
            &format!(
                "tokenizer.path={}",
                path_in(model.path(), "original/tokenizer.model")
            ),
            "output_dir=/tmp/tune-test/llama3_2_1b",
        ]),
    )
    .expect("loads");
    let (typed, warnings) =
        validate("lora_finetune_single_device", &cfg).unwrap_or_else(|e| panic!("{e}"));
    let t = typed.as_train().expect("train config");
    assert_eq!(t.optimizer.lr(), 3e-4);
    assert_eq!(t.model.lora().map(|l| l.lora_rank), Some(64));
    assert_eq!(
        t.metric_logger
            .as_ref()
            .and_then(|m| m.log_dir().cloned())
            .map(|p| p.display().to_string()),
        Some("/tmp/tune-test/llama3_2_1b/logs".into())
    );
    // original/tokenizer.model is mapped to the tokenizer.json beside it, with a warning.
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].key, "tokenizer.path");
    assert!(
        warnings[0]
            .message
            .contains("is not a tokenizer.json; using"),
        "{warnings:?}"
    );
}

#[test]
fn torchtune_config_without_overrides_reports_missing_paths() {
    let cfg = load_config(FIXTURE, &[]).expect("loads");
    let e = validate("lora_finetune_single_device", &cfg).unwrap_err();
    assert!(
        e.has(
            "checkpointer.checkpoint_dir",
            "directory `/tmp/Llama-3.2-1B-Instruct/` does not exist"
        ),
        "{e}"
    );
    assert!(e.has("tokenizer.path", "no tokenizer.json found"), "{e}");
    assert!(e.to_string().contains(FIXTURE));
}

/// Configs from torchtune main's recipes/configs (commit bd2a0fc, verbatim in
/// tests/fixtures/torchtune_configs), each with something the first one lacks: QLoRA's
/// `low_cpu_ram`, `checkpointer.keep_last_n_checkpoints`, a generic builder with architecture
/// arguments, Phi-4's `vocab_path`/`merges_path` tokenizer, Qwen3, the older `fsdp:` block
/// (Llama 2 7B and Llama 3.1 405B QLoRA). They validate (paths aside); a vision config, a Llama 4
/// config are refused by name, torchtune's two PPO configs validate, and a 70B full config's `fsdp_cpu_offload: True`
/// validates on its cuda and is said to change nothing on the CPU.
/// (benches/torchtune_configs.py runs `tune validate` on all of torchtune's multi-device configs.)
#[test]
fn torchtune_main_configs_validate_or_are_refused_by_name() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/torchtune_configs"
    );
    let no_paths = tune::config::ValidateOptions { check_paths: false };
    for (file, recipe) in [
        (
            "gemma2_9B_qlora_single_device.yaml",
            "lora_finetune_single_device",
        ),
        (
            "llama3_2_1B_full_single_device.yaml",
            "full_finetune_single_device",
        ),
        ("llama2_1B_qat_single_device.yaml", "qat_single_device"),
        (
            "phi4_14B_lora_single_device.yaml",
            "lora_finetune_single_device",
        ),
        (
            "qwen3_0.6B_lora_single_device.yaml",
            "lora_finetune_single_device",
        ),
        // Its LoRA teacher gives no rank: torchtune's builder default (commit 3c9fb79).
        (
            "qwen2_5_14B_to_7B_KD_lora_single_device.yaml",
            "knowledge_distillation_single_device",
        ),
        ("llama2_7B_qlora.yaml", "lora_finetune_distributed"),
        ("llama3_1_405B_qlora.yaml", "lora_finetune_distributed"),
    ] {
        let path = format!("{dir}/{file}");
        assert_eq!(
            tune::cli::commands::infer_recipe(&path).map(|r| r.name),
            tune::recipes::find(recipe).ok().map(|r| r.name),
            "{file}"
        );
        let cfg = load_config(&path, &[]).unwrap_or_else(|e| panic!("{file}: {e}"));
        let (typed, _) = tune::recipes::validate_with(recipe, &cfg, &no_paths)
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        // The `fsdp:` block's `cpu_offload: False` is read as fsdp_cpu_offload.
        let train = typed.as_train().expect("a training config");
        assert!(!train.fsdp_cpu_offload, "{file}");
    }
    let qlora = load_config(&format!("{dir}/llama2_7B_qlora.yaml"), &[]).unwrap();
    let (typed, _) = tune::recipes::validate_with("lora_finetune_distributed", &qlora, &no_paths)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        typed.as_train().and_then(|t| t.fsdp.as_ref()).is_some()
            && typed.as_train().is_some_and(|t| !t.fsdp_cpu_offload)
    );

    // Llama 3.3 70B full: `fsdp_cpu_offload: True` on its `device: cuda` offloads; on the CPU
    // it changes nothing, and says so.
    let full_70b = format!("{dir}/llama3_3_70B_full.yaml");
    assert_eq!(
        tune::cli::commands::infer_recipe(&full_70b).map(|r| r.name),
        tune::recipes::find("full_finetune_distributed")
            .ok()
            .map(|r| r.name)
    );
    let cfg = load_config(&full_70b, &[]).unwrap();
    let (typed, warnings) =
        tune::recipes::validate_with("full_finetune_distributed", &cfg, &no_paths)
            .unwrap_or_else(|e| panic!("{e}"));
    assert!(typed.as_train().is_some_and(|t| t.fsdp_cpu_offload));
    assert!(
        !warnings.iter().any(|w| w.key == "fsdp_cpu_offload"),
        "{warnings:?}"
    );
    let cfg = load_config(&full_70b, &args(&["device=cpu"])).unwrap();
    let (typed, warnings) =
        tune::recipes::validate_with("full_finetune_distributed", &cfg, &no_paths)
            .unwrap_or_else(|e| panic!("{e}"));
    assert!(typed.as_train().is_some_and(|t| t.fsdp_cpu_offload));
    assert_eq!(
        warnings
            .iter()
            .filter(|w| w.key == "fsdp_cpu_offload")
            .count(),
        1,
        "{warnings:?}"
    );

    // Llama 4: refused as Llama 4, at the model's component (and its tokenizer's).
    let llama4 = load_config(&format!("{dir}/llama4_scout_17B_16E_lora.yaml"), &[]).unwrap();
    let e =
        tune::recipes::validate_with("lora_finetune_distributed", &llama4, &no_paths).unwrap_err();
    for key in ["model._component_", "tokenizer._component_"] {
        assert!(e.has(key, "Llama 4 is not supported"), "{key}: {e}");
    }
    // Only those two: the refused components' own arguments (`model.decoder_trainable`,
    // `tokenizer.max_num_tiles`) are not listed as unknown keys besides.
    assert_eq!(e.problems.len(), 2, "{e}");
    assert!(
        e.has(
            "model._component_",
            "torchtune.models.llama4.lora_llama4_scout_17b_16e"
        ),
        "{e}"
    );
    let vision = load_config(
        &format!("{dir}/llama3_2_vision_11B_lora_single_device.yaml"),
        &[],
    )
    .unwrap();
    let err = tune::recipes::validate_with("lora_finetune_single_device", &vision, &no_paths)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("vision-language models are not supported"),
        "{err}"
    );
    // PPO: Mistral's (its reward and value model a `torchtune.modules.classifier_model` over
    // `mistral_7b`) and TinyLlama's (a `llama2_classifier` with architecture arguments).
    for file in [
        "mistral_7B_full_ppo_low_memory.yaml",
        "llama2_1B_full_ppo_low_memory_single_device.yaml",
    ] {
        let path = format!("{dir}/{file}");
        assert_eq!(
            tune::cli::commands::infer_recipe(&path),
            tune::recipes::find("ppo_full_finetune").ok(),
            "{file}"
        );
        let cfg = load_config(&path, &[]).unwrap();
        let (typed, _) =
            tune::recipes::validate_with("ppo_full_finetune_single_device", &cfg, &no_paths)
                .unwrap_or_else(|e| panic!("{file}: {e}"));
        let ppo = typed
            .own::<tune::config::schema::PpoKeys>()
            .expect("PPO's keys");
        assert_eq!(ppo.reward_and_value_model.classes(), Some(1), "{file}");
    }
    let mistral = load_config(&format!("{dir}/mistral_7B_full_ppo_low_memory.yaml"), &[]).unwrap();
    let (typed, _) =
        tune::recipes::validate_with("ppo_full_finetune_single_device", &mistral, &no_paths)
            .unwrap();
    let scorer = &typed
        .own::<tune::config::schema::PpoKeys>()
        .expect("PPO's keys")
        .reward_and_value_model;
    assert_eq!(
        scorer.component.canonical_name(),
        "tune.models.mistral.mistral_classifier"
    );
    let no_base = load_config(
        &format!("{dir}/mistral_7B_full_ppo_low_memory.yaml"),
        &args(&["~reward_and_value_model.base_model_path"]),
    )
    .unwrap();
    let e = tune::recipes::validate_with("ppo_full_finetune_single_device", &no_base, &no_paths)
        .unwrap_err();
    assert!(
        e.has("reward_and_value_model.base_model_path", "mistral_7b"),
        "{e}"
    );
}
