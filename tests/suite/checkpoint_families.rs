//! Families without fixtures (Qwen3, Mistral, Phi-3, Gemma): realistic config.json objects
//! with tiny sizes, random weights, saved as transformers saves them and loaded back bit-exactly.

use crate::support;

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Value, json};
use support::*;
use tune::checkpoint::safetensors_io::SafetensorsFile;
use tune::checkpoint::{HostTensor, StorageDtype};
use tune::model_io::hf::{DEFAULT_MAX_SHARD_BYTES, load_model, save_model};
use tune::models::{CausalLm, ModelArgs, RandomInit, TokenBatch, build};
use tune::modules::ForwardMode;

fn qwen3() -> Value {
    json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": false,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 32,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
        "max_position_embeddings": 512, "max_window_layers": 2, "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_scaling": null,
        "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": true,
        "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": true,
        "use_sliding_window": false, "vocab_size": 320
    })
}

fn mistral() -> Value {
    json!({
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
        "initializer_range": 0.02, "intermediate_size": 160, "max_position_embeddings": 1024,
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": null,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.42.0",
        "use_cache": true, "vocab_size": 300
    })
}

fn phi3() -> Value {
    json!({
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_bias": false,
        "attention_dropout": 0.0, "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
        "max_position_embeddings": 4096, "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 4, "original_max_position_embeddings": 4096, "pad_token_id": 32000,
        "resid_pdrop": 0.0, "rms_norm_eps": 1e-5, "rope_scaling": null, "rope_theta": 10000.0,
        "sliding_window": 2047, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.2", "use_cache": true, "vocab_size": 352
    })
}

fn gemma() -> Value {
    json!({
        "architectures": ["GemmaForCausalLM"], "model_type": "gemma", "attention_bias": false,
        "attention_dropout": 0.0, "bos_token_id": 2, "eos_token_id": 1, "head_dim": 16,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 192,
        "max_position_embeddings": 8192, "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 1, "pad_token_id": 0, "rms_norm_eps": 1e-6, "rope_scaling": null,
        "rope_theta": 10000.0, "torch_dtype": "bfloat16", "transformers_version": "4.38.0",
        "use_cache": true, "vocab_size": 256
    })
}

fn random_model(config: Value) -> CausalLm<Cpu> {
    let args = ModelArgs::from_json(config).unwrap();
    let mut init = RandomInit::new(7, &args);
    let mut lm = build::<Cpu>(&args, &mut init, &Default::default()).unwrap();
    // RandomInit sets norms to their identity; perturb them so a norm loaded into the wrong
    // slot (or Gemma's `1 + w` applied twice) changes the logits.
    perturb_norms(&mut lm);
    lm
}

fn perturb_norms(lm: &mut CausalLm<Cpu>) {
    let device = Default::default();
    let bump = |n: &mut tune::modules::RmsNorm<Cpu>, k: f32| {
        let w = HostTensor::from_tensor(&n.weight.val());
        let data = w
            .data
            .iter()
            .enumerate()
            .map(|(i, v)| v + k * ((i % 7) as f32 - 3.0) * 0.01)
            .collect();
        n.weight =
            burn::module::Param::from_tensor(HostTensor::new(w.shape, data).to_tensor(&device));
    };
    for (i, layer) in lm.model.layers.iter_mut().enumerate() {
        bump(&mut layer.input_layernorm, 1.0 + i as f32);
        bump(&mut layer.post_attention_layernorm, 2.0 + i as f32);
        if let Some(n) = &mut layer.self_attn.q_norm {
            bump(n, 3.0);
        }
        if let Some(n) = &mut layer.self_attn.k_norm {
            bump(n, 4.0);
        }
    }
    bump(&mut lm.model.norm, 5.0);
}

fn logits(lm: &CausalLm<Cpu>) -> HostTensor {
    let tokens: Vec<u32> = vec![3, 14, 15, 92, 65, 35, 89, 79, 32, 38];
    let pos = positions(2, 5);
    HostTensor::from_tensor(&lm.forward(
        TokenBatch {
            tokens: &tokens,
            positions: &pos,
            document_ids: None,
            continued_documents: None,
            left_padding: None,
            padding: None,
            images: None,
            batch: 2,
        },
        ForwardMode::default(),
    ))
}

/// Every tensor name and shape on disk, across shards.
fn on_disk(dir: &Path) -> BTreeMap<String, Vec<usize>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let f = SafetensorsFile::open(&path).unwrap();
            for n in f.names() {
                out.insert(n.clone(), f.shape(&n).unwrap());
            }
        }
    }
    out
}

/// Saves, checks the on-disk names, reloads, and checks tensors and logits are identical.
fn round_trip(config: Value, max_shard_bytes: usize) -> (TempDir, BTreeMap<String, Vec<usize>>) {
    let lm = random_model(config);
    let tmp = temp_dir(lm.args.family.model_type());
    save_model(&lm, tmp.path(), None, StorageDtype::F32, max_shard_bytes).unwrap();
    let names = on_disk(tmp.path());
    assert_eq!(
        names.contains_key("lm_head.weight"),
        !lm.args.tie_word_embeddings,
        "lm_head.weight only when untied"
    );

    let back = load_model::<Cpu>(tmp.path(), None, &Default::default())
        .unwrap()
        .model;
    assert_eq!(back.args.family, lm.args.family);
    let (a, b) = (lm.hf_state_dict(), back.hf_state_dict());
    assert_eq!(a.len(), b.len());
    for ((n1, t1), (n2, t2)) in a.iter().zip(&b) {
        assert_eq!(n1, n2);
        assert_eq!(t1.shape, names[n1], "{n1}: shape on disk");
        assert_eq!(t1.shape, t2.shape, "{n1}");
        let bits = |t: &HostTensor| t.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert!(bits(t1) == bits(t2), "{n1} did not round-trip bit-exactly");
    }
    let (la, lb) = (logits(&lm), logits(&back));
    assert!(la.data.iter().all(|v| v.is_finite()));
    assert_eq!(la, lb, "reloaded model's logits differ");
    (tmp, names)
}

#[test]
fn qwen3_round_trips_with_qk_norm() {
    let (_t, names) = round_trip(qwen3(), DEFAULT_MAX_SHARD_BYTES);
    // head_dim 32 is not hidden / heads (16): q is [heads * head_dim, hidden].
    assert_eq!(
        names["model.layers.0.self_attn.q_proj.weight"],
        vec![128, 64]
    );
    assert_eq!(
        names["model.layers.0.self_attn.k_proj.weight"],
        vec![64, 64]
    );
    assert_eq!(names["model.layers.1.self_attn.q_norm.weight"], vec![32]);
    assert_eq!(names["model.layers.1.self_attn.k_norm.weight"], vec![32]);
    assert_eq!(
        names["model.layers.0.self_attn.o_proj.weight"],
        vec![64, 128]
    );
}

#[test]
fn mistral_round_trips_untied() {
    let (_t, names) = round_trip(mistral(), DEFAULT_MAX_SHARD_BYTES);
    assert_eq!(names["lm_head.weight"], vec![300, 64]);
    assert_eq!(
        names["model.layers.0.self_attn.k_proj.weight"],
        vec![16, 64]
    );
    assert!(
        !names
            .keys()
            .any(|n| n.contains("norm") && n.contains("self_attn"))
    );
}

#[test]
fn phi3_stores_fused_projections() {
    let (_t, names) = round_trip(phi3(), DEFAULT_MAX_SHARD_BYTES);
    assert_eq!(
        names["model.layers.0.self_attn.qkv_proj.weight"],
        vec![3 * 64, 64]
    );
    assert_eq!(
        names["model.layers.1.mlp.gate_up_proj.weight"],
        vec![2 * 128, 64]
    );
    for split in ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"] {
        assert!(
            !names.keys().any(|n| n.contains(&format!(".{split}."))),
            "{split} on disk: Phi-3 stores it fused"
        );
    }
}

/// Gemma 2 and Gemma 3 configs as transformers 5 writes them (tests/fixtures/families): the
/// sandwich norms and q/k norms save under transformers' names and reload bit-exactly, and the
/// architecture keys survive in config.json.
#[test]
fn gemma2_and_gemma3_round_trip_with_their_extra_norms() {
    for family in ["gemma2", "gemma3"] {
        let dir = fixture(&format!("families/{family}"));
        let config: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        let (tmp, names) = round_trip(config.clone(), DEFAULT_MAX_SHARD_BYTES);
        for norm in [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ] {
            assert_eq!(
                names[&format!("model.layers.3.{norm}.weight")],
                vec![32],
                "{family} {norm}"
            );
        }
        assert_eq!(
            names.contains_key("model.layers.0.self_attn.q_norm.weight"),
            family == "gemma3"
        );
        let saved: Value =
            serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json")).unwrap())
                .unwrap();
        for key in [
            "layer_types",
            "sliding_window",
            "query_pre_attn_scalar",
            "rope_parameters",
        ] {
            assert_eq!(saved[key], config[key], "{family}: {key}");
        }
    }
}

#[test]
fn gemma_round_trips_tied_with_offset_norms() {
    let (_t, names) = round_trip(gemma(), DEFAULT_MAX_SHARD_BYTES);
    assert_eq!(names["model.embed_tokens.weight"], vec![256, 64]);
    assert_eq!(names["model.layers.0.mlp.gate_proj.weight"], vec![192, 64]);
    let args = ModelArgs::from_json(gemma()).unwrap();
    assert!(args.tie_word_embeddings && args.norm_weight_offset && args.scale_embeddings);
    assert_eq!(args.activation, tune::models::args::Activation::GeluTanh);
}

#[test]
fn small_shards_are_written_like_transformers() {
    for config in [qwen3(), phi3()] {
        let (tmp, names) = round_trip(config, 40_000);
        let index: Value = serde_json::from_str(
            &std::fs::read_to_string(tmp.path().join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        let map = index["weight_map"].as_object().unwrap();
        let files: std::collections::BTreeSet<&str> =
            map.values().map(|v| v.as_str().unwrap()).collect();
        let n = files.len();
        assert!(n > 2, "expected several shards, got {n}");
        let expected: std::collections::BTreeSet<String> = (1..=n)
            .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
            .collect();
        assert_eq!(
            files
                .iter()
                .map(|s| s.to_string())
                .collect::<std::collections::BTreeSet<_>>(),
            expected
        );
        assert!(!tmp.path().join("model.safetensors").exists());
        // Every tensor listed once, in the shard the index says; total_size = tensor bytes.
        assert_eq!(map.len(), names.len());
        let mut total = 0u64;
        for (name, file) in map {
            let f = SafetensorsFile::open(&tmp.path().join(file.as_str().unwrap())).unwrap();
            let shape = f
                .shape(name)
                .unwrap_or_else(|| panic!("{name} not in {file}"));
            total += 4 * shape.iter().product::<usize>() as u64;
        }
        assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total));
        let tied = ModelArgs::from_json(
            serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json")).unwrap())
                .unwrap(),
        )
        .unwrap()
        .tie_word_embeddings;
        assert_eq!(map.contains_key("lm_head.weight"), !tied);
    }
}

#[test]
fn bf16_storage_rounds_once() {
    let lm = random_model(gemma());
    let tmp = temp_dir("gemma-bf16");
    save_model(
        &lm,
        tmp.path(),
        None,
        StorageDtype::BF16,
        DEFAULT_MAX_SHARD_BYTES,
    )
    .unwrap();
    let loaded = load_model::<Cpu>(tmp.path(), None, &Default::default()).unwrap();
    assert_eq!(loaded.storage_dtype, StorageDtype::BF16);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    for ((n, a), (_, b)) in lm.hf_state_dict().iter().zip(&loaded.model.hf_state_dict()) {
        let rounded: Vec<f32> = a
            .data
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        assert_eq!(rounded, b.data, "{n}");
    }
}
