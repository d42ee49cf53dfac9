//! The same training tokens as torchtune: every case in tests/fixtures/torchtune_tokens/cases.json
//! (made by torchtune 0.6.1 itself with `make_torchtune_tokens.py`, on real Llama 3, Qwen and
//! SentencePiece vocabularies) is rebuilt through tune's config -> tokenizer -> dataset path and
//! must give the same tokens and labels (and, packed, the same positions and sequence lengths).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::Value;
use tune::config::schema::{DatasetConfig, TokenizerConfig};
use tune::data::Samples;
use tune::setup::data as setup_data;
use tune::tokenizer::Tokenizer;

use crate::support::fixture;

fn root() -> PathBuf {
    fixture("torchtune_tokens")
}

fn as_config<T: serde::de::DeserializeOwned>(v: &Value, what: &str) -> T {
    let yaml: serde_yaml::Value = serde_yaml::to_value(v).expect("json -> yaml");
    serde_yaml::from_value(yaml).unwrap_or_else(|e| panic!("{what}: {e}: {v}"))
}

fn ids<T: serde::de::DeserializeOwned>(v: &Value, key: &str) -> Vec<T> {
    serde_json::from_value(v[key].clone()).unwrap_or_else(|e| panic!("{key}: {e}"))
}

/// Where two sequences first differ, for a readable failure.
fn first_difference<T: PartialEq + std::fmt::Debug>(a: &[T], b: &[T]) -> Option<String> {
    if a == b {
        return None;
    }
    let i = a
        .iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()));
    let window = |v: &[T]| format!("{:?}", &v[i.saturating_sub(3)..(i + 4).min(v.len())]);
    Some(format!(
        "lengths {} vs {}, first difference at {i}: tune {} torchtune {}",
        a.len(),
        b.len(),
        window(a),
        window(b)
    ))
}

#[test]
fn every_torchtune_case_gives_the_same_tokens_and_labels() {
    let text = std::fs::read_to_string(root().join("cases.json")).expect("cases.json");
    let doc: Value = serde_json::from_str(&text).expect("cases.json is JSON");
    let cases = doc["cases"].as_array().expect("cases");
    assert!(cases.len() >= 50, "only {} cases", cases.len());
    let mut vocabularies: BTreeMap<String, Tokenizer> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut refusals = Vec::new();
    let mut checked = 0;
    for case in cases {
        let name = case["name"].as_str().unwrap_or("?");
        let t = &case["tokenizer"];
        let dir = root().join(t["dir"].as_str().expect("tokenizer.dir"));
        let mut tok_cfg = serde_json::json!({
            "_component_": t["component"],
            "path": dir.join("tokenizer.json"),
            "max_seq_len": t["max_seq_len"],
        });
        if let Some(p) = t.get("prompt_template") {
            tok_cfg["prompt_template"] = p.clone();
        }
        let tok_cfg: TokenizerConfig = as_config(&tok_cfg, name);
        let base = vocabularies
            .entry(dir.display().to_string())
            .or_insert_with(|| Tokenizer::from_path(&dir).expect("tokenizer"));
        let mut tok = base.clone();
        let format = setup_data::model_format(&tok_cfg);
        tok.set_format(format).expect("set_format");
        let ds: DatasetConfig = as_config(&case["dataset"], name);
        let built = setup_data::dataset(
            std::slice::from_ref(&ds),
            &tok,
            tok_cfg.max_seq_len,
            &crate::support::fixture(""),
            None,
        );
        // torchtune refused this case (e.g. a system prompt under MistralChatTemplate): tune
        // must refuse it too, not train on something else.
        if let Some(error) = case.get("error").and_then(Value::as_str) {
            match built {
                Ok(_) => failures.push(format!("{name}: torchtune fails ({error}), tune does not")),
                Err(e) => refusals.push(format!("{name}: {e}")),
            }
            checked += 1;
            continue;
        }
        let expected = case["samples"].as_array().expect("samples");
        let dataset = match built {
            Ok(d) => d,
            Err(e) => {
                failures.push(format!("{name}: tune failed: {e}"));
                continue;
            }
        };
        let mut mismatch = |what: &str, i: usize, d: Option<String>| {
            if let Some(d) = d {
                failures.push(format!("{name} sample {i} {what}: {d}"));
            }
        };
        match (dataset.samples(), case["kind"].as_str()) {
            (Samples::Sft(s), Some("sft")) => {
                assert!(s.len() >= expected.len(), "{name}: {} samples", s.len());
                for (i, e) in expected.iter().enumerate() {
                    mismatch(
                        "tokens",
                        i,
                        first_difference(&s[i].tokens, &ids::<u32>(e, "tokens")),
                    );
                    mismatch(
                        "labels",
                        i,
                        first_difference(&s[i].labels, &ids::<i64>(e, "labels")),
                    );
                }
            }
            (Samples::Packed(s), Some("packed")) => {
                assert!(s.len() >= expected.len(), "{name}: {} packs", s.len());
                for (i, e) in expected.iter().enumerate() {
                    mismatch(
                        "tokens",
                        i,
                        first_difference(&s[i].tokens, &ids::<u32>(e, "tokens")),
                    );
                    mismatch(
                        "labels",
                        i,
                        first_difference(&s[i].labels, &ids::<i64>(e, "labels")),
                    );
                    mismatch(
                        "input_pos",
                        i,
                        first_difference(&s[i].position_ids, &ids::<u32>(e, "input_pos")),
                    );
                    mismatch(
                        "seq_lens",
                        i,
                        first_difference(&s[i].seq_lens(), &ids::<usize>(e, "seq_lens")),
                    );
                }
            }
            (Samples::Preference(s), Some("preference")) => {
                assert!(s.len() >= expected.len(), "{name}: {} pairs", s.len());
                for (i, e) in expected.iter().enumerate() {
                    let p = &s[i];
                    mismatch(
                        "chosen",
                        i,
                        first_difference(&p.chosen.tokens, &ids::<u32>(e, "chosen_input_ids")),
                    );
                    mismatch(
                        "chosen_labels",
                        i,
                        first_difference(&p.chosen.labels, &ids::<i64>(e, "chosen_labels")),
                    );
                    mismatch(
                        "rejected",
                        i,
                        first_difference(&p.rejected.tokens, &ids::<u32>(e, "rejected_input_ids")),
                    );
                    mismatch(
                        "rejected_labels",
                        i,
                        first_difference(&p.rejected.labels, &ids::<i64>(e, "rejected_labels")),
                    );
                }
            }
            (_, kind) => failures.push(format!("{name}: tune built another kind than {kind:?}")),
        }
        checked += 1;
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} cases differ from torchtune:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        refusals.iter().all(|r| r.contains("MistralChatTemplate")),
        "{refusals:#?}"
    );
}

/// A torchtune config's first step trains on the batch torchtune builds and reports the loss
/// PyTorch computes on it: tiny-qwen2 through `qwen2_5_tokenizer` + `alpaca_dataset`, the first 4
/// rows unshuffled (three of them padded), scored by transformers (first_batch_loss.json). LoRA's
/// B starts at zero, so step 1's loss is the base model's.
#[test]
fn the_first_batch_and_its_loss_equal_torchtunes_and_pytorchs() {
    let text = std::fs::read_to_string(root().join("first_batch_loss.json")).expect("fixture");
    let want: Value = serde_json::from_str(&text).unwrap();
    let qwen = fixture("tiny-qwen2");
    let tokenizer = format!("tokenizer.path={}", qwen.join("tokenizer.json").display());
    let checkpoint = format!("checkpointer.checkpoint_dir={}", qwen.display());
    let data = format!(
        "dataset.data_files={}",
        fixture("alpaca_tiny.json").display()
    );
    let overrides = [
        "model=torchtune.models.qwen2_5.lora_qwen2_5_0_5b",
        "tokenizer._component_=torchtune.models.qwen2_5.qwen2_5_tokenizer",
        tokenizer.as_str(),
        "tokenizer.max_seq_len=256",
        checkpoint.as_str(),
        "checkpointer.model_type=QWEN2",
        data.as_str(),
        "shuffle=False",
        "batch_size=4",
        "max_steps_per_epoch=1",
    ];

    // The batch itself, through the config -> tokenizer -> dataset path.
    let cfg =
        tune::config::load_config("tiny/lora_single_device", &crate::support::args(&overrides))
            .unwrap();
    let (typed, _) = tune::recipes::validate_with(
        "lora_finetune_single_device",
        &cfg,
        &tune::config::ValidateOptions { check_paths: false },
    )
    .unwrap();
    let train = typed.as_train().expect("a training config");
    let tok = setup_data::tokenizer(&train.tokenizer).unwrap();
    let ds = setup_data::dataset(&train.dataset, &tok, Some(256), &fixture(""), None).unwrap();
    let batch = ds.collate(&[0, 1, 2, 3]).unwrap();
    let rows = |key: &str| -> Vec<i64> {
        want[key]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r.as_array().unwrap().iter().map(|v| v.as_i64().unwrap()))
            .collect()
    };
    let tokens: Vec<i64> = batch.tokens.iter().map(|&t| i64::from(t)).collect();
    assert_eq!(batch.seq_len, 186);
    assert_eq!(tokens, rows("tokens"), "tokens (pad {})", want["pad_id"]);
    assert_eq!(batch.labels, rows("labels"));

    // The recipe's first step on it.
    let out = crate::support::temp_dir("first-batch");
    let metrics = crate::support::run_recipe(
        "lora_finetune_single_device",
        "tiny/lora_single_device",
        &out,
        &overrides,
    );
    let loss = metrics[0]["loss"].as_f64().unwrap();
    let expected = want["loss"].as_f64().unwrap();
    assert!(
        (loss - expected).abs() < 1e-4,
        "tune's step-1 loss {loss} vs PyTorch's {expected}"
    );
}

/// A shuffled epoch visits the samples in the order torchtune's sampler draws them
/// (sample_order.json: torchdata's StatefulDistributedSampler with torchtune's seed 0), on one
/// rank and split across ranks.
#[test]
fn shuffled_epochs_visit_samples_in_torchtunes_order() {
    let text = std::fs::read_to_string(root().join("sample_order.json")).expect("fixture");
    let doc: Value = serde_json::from_str(&text).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for case in cases {
        let n = case["n"].as_u64().unwrap() as usize;
        let epoch = case["epoch"].as_u64().unwrap();
        let world = case["world"].as_u64().unwrap() as usize;
        let loader = tune::data::DataLoader::new(
            n,
            tune::data::LoaderConfig {
                batch_size: 1,
                shuffle: true,
                seed: setup_data::TORCHTUNE_SAMPLER_SEED,
                drop_last: false,
            },
        )
        .unwrap();
        for (rank, want) in case["ranks"].as_array().unwrap().iter().enumerate() {
            let got: Vec<usize> = loader
                .rank_batches(epoch, rank, world)
                .into_iter()
                .flatten()
                .collect();
            let want: Vec<usize> = serde_json::from_value(want.clone()).unwrap();
            assert_eq!(got, want, "n {n} epoch {epoch} world {world} rank {rank}");
        }
    }
}
