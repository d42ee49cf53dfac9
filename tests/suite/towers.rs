//! The language model of a multimodal checkpoint (Gemma 3 4B+, Mistral 3) trained text-only:
//! read from either key layout, matching transformers' text-only forward, and saved back with
//! the vision tower copied through untouched.

use crate::support::*;

use std::path::Path;

use tune::checkpoint::StorageDtype;
use tune::checkpoint::safetensors_io::SafetensorsFile;
use tune::model_io::hf::{DEFAULT_MAX_SHARD_BYTES, load_model, save_model};
use tune::models::{ModelArgs, RandomInit, build};
use tune::modules::ForwardMode;

/// The fixtures (tests/fixtures/make_text_tower_fixtures.py) and their key layouts.
const TOWERS: [&str; 4] = ["gemma3_hub", "gemma3", "mistral3", "mistral3_prefixed"];

fn is_language_model(name: &str) -> bool {
    name.contains("language_model.") || name == "lm_head.weight"
}

/// Each fixture's language model gives the logits and loss of transformers' multimodal class
/// on text alone: both key layouts, and Gemma 3's sparse Hub config (defaults filled in as
/// transformers fills them, RoPE scaling on the global layers only).
#[test]
fn multimodal_language_models_match_transformers() {
    for name in TOWERS {
        let r = Reference::open(&format!("tower-{name}.safetensors"));
        let (tokens, labels, batch) = r.tokens();
        let dir = fixture(&format!("towers/{name}"));
        let model = load_model::<Cpu>(&dir, None, &Default::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .model;
        assert!(model.args.tower.is_some(), "{name}");
        let logits = forward_rows(&model, &tokens, batch, ForwardMode::default());
        assert_logits_and_loss(&r, logits, &labels);
    }
}

/// A save keeps the checkpoint's layout: the same tensor names, and every tensor that is not
/// the language model's (vision tower, projector) byte for byte as the source stored it.
#[test]
fn a_save_copies_the_vision_tower_through_in_the_sources_layout() {
    for name in TOWERS {
        let src = fixture(&format!("towers/{name}"));
        let lm = load_model::<Cpu>(&src, None, &Default::default())
            .unwrap()
            .model;
        let out = temp_dir(&format!("tower-save-{name}"));
        save_model(
            &lm,
            out.path(),
            Some(&src),
            StorageDtype::BF16,
            DEFAULT_MAX_SHARD_BYTES,
        )
        .unwrap();
        let (want, got) = (stored_tensors(&src), stored_tensors(out.path()));
        assert_eq!(
            want.keys().collect::<Vec<_>>(),
            got.keys().collect::<Vec<_>>(),
            "{name}: tensor names"
        );
        let mut copied = 0;
        for (tensor, stored) in &want {
            if is_language_model(tensor) {
                assert_eq!(
                    got[tensor].0, "BF16",
                    "{name}: {tensor} in the save's dtype"
                );
            } else {
                assert!(got[tensor] == *stored, "{name}: {tensor} differs");
                copied += 1;
            }
        }
        assert!(copied >= 15, "{name}: {copied} vision tensors");
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
                .unwrap();
        assert!(config["vision_config"].is_object(), "{name}: {config}");
    }
}

/// A Gemma 3 multimodal checkpoint the tiny tokenizer fits: the fixture's vision tower beside a
/// random language model with the tiny tokenizer's 2048-token vocabulary.
fn tiny_gemma3_tower() -> TempDir {
    let src = fixture("towers/gemma3");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["text_config"]["vocab_size"] = 2048.into();
    config["text_config"]["max_position_embeddings"] = 256.into();
    let args = ModelArgs::from_json(config).unwrap();
    let mut init = RandomInit::new(3, &args);
    let lm = build::<Cpu>(&args, &mut init, &Default::default()).unwrap();
    let dir = temp_dir("tiny-gemma3-tower");
    save_model(
        &lm,
        dir.path(),
        Some(&src),
        StorageDtype::F32,
        DEFAULT_MAX_SHARD_BYTES,
    )
    .unwrap();
    let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-llama");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(assets.join(file), dir.path().join(file)).unwrap();
    }
    dir
}

/// LoRA adapts only the language model, under the module paths peft gives it in transformers'
/// multimodal class, with `target_modules` a pattern that leaves the vision tower's `q_proj`s
/// alone; the merged export changes q and v and copies everything else, vision tower included.
#[test]
fn lora_on_a_multimodal_checkpoint_adapts_only_its_language_model() {
    let ckpt = tiny_gemma3_tower();
    let out = temp_dir("tower-lora");
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let metrics = run_recipe(
        "lora_finetune_single_device",
        "tiny/lora_single_device",
        &out,
        &[
            "model=tune.models.gemma3.lora_gemma3_tiny",
            "model.lora_attn_modules=[q_proj,v_proj]",
            "model.apply_lora_to_mlp=False",
            "model.lora_rank=8",
            "model.lora_alpha=16",
            &checkpoint_dir,
            "max_steps_per_epoch=25",
        ],
    );
    let (first, last) = first_and_last_mean(&column(&metrics, "loss"));
    assert!(last < first, "loss {first} -> {last}");

    let epoch = out.path().join("epoch_0");
    let adapter = SafetensorsFile::open(&epoch.join("adapter_model.safetensors")).unwrap();
    let names = adapter.names();
    let key = "base_model.model.model.language_model.layers.3.self_attn.v_proj.lora_B.weight";
    assert!(names.iter().any(|n| n == key), "{names:?}");
    assert_eq!(names.len(), 2 * 2 * 4, "{names:?}");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(epoch.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        config["target_modules"],
        r"model\.language_model\..*\.(q_proj|v_proj)"
    );

    let (before, after) = (stored_tensors(ckpt.path()), stored_tensors(&epoch));
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>()
    );
    for (name, tensor) in &before {
        let adapted =
            is_language_model(name) && (name.contains("q_proj") || name.contains("v_proj"));
        assert_eq!(after[name] == *tensor, !adapted, "{name}");
    }
}

/// FSDP over two workers takes one device's steps on a multimodal checkpoint, and its save
/// (gathered for rank 0, which copies the vision tower through) equals the one-device save.
#[test]
fn fsdp_on_a_multimodal_checkpoint_matches_one_device_and_keeps_the_vision_tower() {
    let ckpt = tiny_gemma3_tower();
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let extra = [
        "model=tune.models.gemma3.gemma3_tiny",
        checkpoint_dir.as_str(),
    ];
    let (one, two) = crate::distributed::one_device_and_fsdp_agree("tower-fsdp", &extra, 4);
    let source = stored_tensors(ckpt.path());
    let (a, b) = (
        stored_tensors(&one.path().join("epoch_0")),
        stored_tensors(&two.path().join("epoch_0")),
    );
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        source.keys().collect::<Vec<_>>()
    );
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, stored) in &source {
        if !is_language_model(name) {
            assert!(a[name] == *stored && b[name] == *stored, "{name}");
        } else {
            assert!(a[name] != *stored, "{name} did not train");
        }
    }
}

/// QAT's int4 export holds one text decoder: for a multimodal checkpoint it is refused by key
/// before training.
#[test]
fn the_int4_export_of_a_multimodal_checkpoint_is_refused_by_key() {
    let ckpt = tiny_gemma3_tower();
    let out = temp_dir("tower-qat");
    let output_dir = format!("output_dir={}", out.path().display());
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let stderr = tune_refuses(&[
        "run",
        "qat_lora_finetune_single_device",
        "--config",
        "tiny/qat_lora_single_device",
        &output_dir,
        &checkpoint_dir,
        "model=tune.models.gemma3.lora_gemma3_tiny",
    ]);
    assert!(
        stderr.contains("quantizer") && stderr.contains("\"gemma3\""),
        "{stderr}"
    );
    let log = out.path().join("logs/metrics.jsonl");
    let steps = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !steps.contains("\"loss\""),
        "trained before refusing: {steps}"
    );
}

/// A multimodal checkpoint stored as DCP shard files is refused at load, naming the directory
/// and the fix, before any training whose saves could not copy its vision tower through.
#[test]
fn a_multimodal_checkpoint_in_dcp_shards_is_refused_at_load() {
    let dir = temp_dir("tower-dcp");
    std::fs::copy(
        fixture("towers/gemma3/config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let shard = tune::checkpoint::dcp::shard_file_name(0, 1, 1);
    std::fs::write(dir.path().join(shard), b"").unwrap();
    let err = match load_model::<Cpu>(dir.path(), None, &Default::default()) {
        Ok(_) => panic!("loaded a DCP multimodal checkpoint"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(&dir.path().display().to_string())
            && err.contains("\"gemma3\"")
            && err.contains("consolidate"),
        "{err}"
    );
}
