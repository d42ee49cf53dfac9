//! Bad checkpoints give one clear error naming the file or tensor, never a panic.

use crate::support;

use serde_json::{Value, json};
use support::*;
use tune::checkpoint::StorageDtype;
use tune::model_io::hf::{DEFAULT_MAX_SHARD_BYTES, load_model, save_model};
use tune::models::{ModelArgs, RandomInit, build};

fn config() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
        "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": true, "torch_dtype": "float32"
    })
}

/// A saved random llama: one file, or shards of at most `max_shard_bytes`.
fn saved(tag: &str, max_shard_bytes: usize) -> TempDir {
    let args = ModelArgs::from_json(config()).unwrap();
    let lm = build::<Cpu>(&args, &mut RandomInit::new(1, &args), &Default::default()).unwrap();
    let tmp = temp_dir(tag);
    save_model(&lm, tmp.path(), None, StorageDtype::F32, max_shard_bytes).unwrap();
    tmp
}

fn load_err(dir: &std::path::Path) -> String {
    match load_model::<Cpu>(dir, None, &Default::default()) {
        Ok(_) => panic!("{} loaded, but it should not", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_has(err: &str, parts: &[&str]) {
    for p in parts {
        assert!(err.contains(p), "`{p}` missing from: {err}");
    }
}

#[test]
fn the_good_checkpoints_load() {
    load_model::<Cpu>(
        saved("ok", DEFAULT_MAX_SHARD_BYTES).path(),
        None,
        &Default::default(),
    )
    .unwrap();
    load_model::<Cpu>(
        saved("ok-sharded", 10_000).path(),
        None,
        &Default::default(),
    )
    .unwrap();
}

#[test]
fn missing_shard() {
    let t = saved("missing-shard", 10_000);
    let files: Vec<String> = std::fs::read_dir(t.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("model-00002-of-"))
        .collect();
    assert_eq!(files.len(), 1, "expected several shards: {files:?}");
    let shard = files[0].as_str();
    std::fs::remove_file(t.path().join(shard)).unwrap();
    let err = load_err(t.path());
    assert_has(
        &err,
        &[
            "model.safetensors.index.json",
            shard,
            "does not exist",
            "download the missing shard",
        ],
    );
}

#[test]
fn truncated_safetensors() {
    let t = saved("truncated", DEFAULT_MAX_SHARD_BYTES);
    let path = t.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_err(t.path());
    assert_has(&err, &[&path.display().to_string(), "truncated"]);
    // Cut inside the header too.
    std::fs::write(&path, &bytes[..20]).unwrap();
    let err = load_err(t.path());
    assert_has(
        &err,
        &[&path.display().to_string(), "not a valid safetensors file"],
    );
}

#[test]
fn wrong_tensor_shape() {
    let t = saved("shape", DEFAULT_MAX_SHARD_BYTES);
    let mut cfg = config();
    cfg["hidden_size"] = json!(48);
    std::fs::write(t.path().join("config.json"), cfg.to_string()).unwrap();
    let err = load_err(t.path());
    assert_has(
        &err,
        &[
            "model.embed_tokens.weight",
            "model.safetensors",
            "[128, 32]",
            "[128, 48]",
            "config.json",
        ],
    );
}

#[test]
fn unknown_model_type() {
    let t = saved("model-type", DEFAULT_MAX_SHARD_BYTES);
    let mut cfg = config();
    cfg["model_type"] = json!("gpt2");
    std::fs::write(t.path().join("config.json"), cfg.to_string()).unwrap();
    let err = load_err(t.path());
    assert_has(
        &err,
        &[
            "config.json",
            "unsupported model_type \"gpt2\"",
            "llama",
            "qwen2",
        ],
    );
}

/// A checkpoint another library quantized is refused by `quantization_config`, naming its
/// method, before a tensor is read; MXFP4 is read only as gpt-oss's experts.
#[test]
fn a_checkpoint_quantized_elsewhere_is_refused_naming_its_method() {
    for (method, named) in [
        (
            json!({"quant_method": "bitsandbytes", "load_in_4bit": true}),
            "\"bitsandbytes\"",
        ),
        (json!({"quant_method": "mxfp4"}), "\"mxfp4\""),
        (json!({"bits": 4}), "is missing"),
    ] {
        let t = saved("quantized", DEFAULT_MAX_SHARD_BYTES);
        let mut cfg = config();
        cfg["quantization_config"] = method;
        std::fs::write(t.path().join("config.json"), cfg.to_string()).unwrap();
        let err = load_err(t.path());
        assert_has(
            &err,
            &[
                "config.json",
                "quantization_config.quant_method",
                named,
                "unquantized",
            ],
        );
    }
}

#[test]
fn corrupt_index() {
    let t = saved("index", 10_000);
    let index = t.path().join("model.safetensors.index.json");
    std::fs::write(
        &index,
        "{\"metadata\": {\"total_size\": 1}, \"weight_map\": {",
    )
    .unwrap();
    let err = load_err(t.path());
    assert_has(&err, &[&index.display().to_string(), "invalid index"]);
    std::fs::write(&index, "{\"metadata\": {}}").unwrap();
    assert_has(
        &load_err(t.path()),
        &["model.safetensors.index.json", "weight_map"],
    );
}

#[test]
fn missing_config() {
    let t = saved("no-config", DEFAULT_MAX_SHARD_BYTES);
    std::fs::remove_file(t.path().join("config.json")).unwrap();
    let err = load_err(t.path());
    assert_has(
        &err,
        &[
            &t.path().join("config.json").display().to_string(),
            "missing",
        ],
    );
}

#[test]
fn missing_directory_and_weights() {
    let t = temp_dir("empty");
    std::fs::write(t.path().join("config.json"), config().to_string()).unwrap();
    assert_has(
        &load_err(t.path()),
        &["no checkpoint in", "model.safetensors"],
    );
    let gone = t.path().join("nope");
    assert_has(&load_err(&gone), &["config.json"]);
}

/// torchtune's `checkpointer.model_type` names the checkpoint's architecture: a family other
/// than config.json's means the checkpointer points at another model than the config was
/// written for, and is refused by key before any weight is read; the right one (or a
/// classifier's REWARD on a reward model) opens.
#[test]
fn a_model_type_of_another_family_is_refused_naming_both() {
    let checkpointer = |model_type: &str, dir: &str| {
        let yaml = format!(
            "_component_: torchtune.training.FullModelHFCheckpointer\ncheckpoint_dir: {}\nmodel_type: {model_type}\n",
            crate::support::fixture(dir).display()
        );
        let cfg: tune::config::schema::CheckpointerConfig = serde_yaml::from_str(&yaml).unwrap();
        tune::setup::model::open(&cfg, "checkpointer")
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let e = checkpointer("QWEN2", "tiny-llama").unwrap_err();
    assert!(
        e.starts_with("checkpointer.model_type: is QWEN2, but checkpoint_dir holds a llama model"),
        "{e}"
    );
    checkpointer("LLAMA3_2", "tiny-llama").expect("a llama checkpoint");
    checkpointer("REWARD", "tiny-llama-reward").expect("a reward model");
    let e = checkpointer("REWARD", "tiny-llama").unwrap_err();
    assert!(e.contains("llama language model (no `score` head)"), "{e}");
}
