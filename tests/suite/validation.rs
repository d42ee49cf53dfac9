//! Validation loss (`dataset_val`, `run_val_every_n_steps`, `batch_size_val`): logged at the
//! configured steps and at each epoch end, equal to a recomputation on the saved model, in the
//! SFT, DPO, KD and QAT recipes; `tune plot` draws it.

use crate::support;

use burn::tensor::ElementConversion;
use support::*;
use tune::data::{DatasetKind, DatasetSpec};
use tune::modules::ForwardMode;

/// The first 8 alpaca rows, as a validation set.
const ALPACA_VAL: &str = "dataset_val={_component_: torchtune.datasets.alpaca_dataset, source: json, data_files: assets/data/alpaca_tiny.json, split: 'train[:8]'}";

/// The lines of `metrics` that carry `key`.
fn lines_with<'a>(metrics: &'a [serde_json::Value], key: &str) -> Vec<&'a serde_json::Value> {
    metrics.iter().filter(|m| m.get(key).is_some()).collect()
}

fn steps(lines: &[&serde_json::Value]) -> Vec<u64> {
    lines.iter().map(|m| m["step"].as_u64().unwrap()).collect()
}

#[test]
fn lora_validation_runs_at_the_configured_steps_without_dropout_and_equals_a_recomputation() {
    let out = temp_dir("val-lora");
    // Dropout on: validation must switch it off, or the recomputation below would not match.
    let metrics = crate::lora_recipes::lora_run(
        &out,
        &[
            "max_steps_per_epoch=5",
            "model.lora_dropout=0.1",
            "run_val_every_n_steps=2",
            "batch_size_val=3",
            ALPACA_VAL,
        ],
    );
    let val = lines_with(&metrics, "val_loss");
    // Steps 2 and 4, then the epoch's end at step 5.
    assert_eq!(steps(&val), [2, 4, 5], "{val:?}");
    assert_eq!(
        lines_with(&metrics, "loss").len(),
        5,
        "one training line per step"
    );
    let logged = val[2]["val_loss"].as_f64().unwrap();

    // The same set scored by hand on the saved (merged) model: batches of 3 in file order,
    // the partial last batch (rows 6-7) dropped, the mean over every label token.
    let ckpt = out.path().join("epoch_0");
    let model = tune::model_io::hf::load_model::<Cpu>(&ckpt, None, &Default::default())
        .unwrap()
        .model;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let tok = tune::tokenizer::Tokenizer::from_path(root.join("assets/tiny-llama")).unwrap();
    let spec = DatasetSpec {
        source: Some("json".into()),
        data_files: vec!["assets/data/alpaca_tiny.json".into()],
        split: "train[:8]".into(),
        ..DatasetSpec::new(DatasetKind::Alpaca)
    };
    let data = tune::data::Dataset::build(&spec, &tok, Some(128), root).unwrap();
    assert_eq!(data.len(), 8);
    let (mut nll, mut count) = (0.0, 0usize);
    for rows in [[0, 1, 2], [3, 4, 5]] {
        let batch = data.collate(&rows).unwrap();
        let logits = forward_rows(&model, &batch.tokens, 3, ForwardMode::default());
        let mean: f64 = tune::training::loss::cross_entropy(logits, &batch.labels)
            .into_scalar()
            .elem();
        nll += mean * batch.num_trained_tokens as f64;
        count += batch.num_trained_tokens;
    }
    let recomputed = nll / count as f64;
    assert!(
        (logged - recomputed).abs() < 1e-4,
        "logged val_loss {logged} vs recomputed {recomputed}"
    );

    // tune plot reads and draws it.
    let curves = tune::plot::read_metrics(&out.path().join("logs/metrics.jsonl")).unwrap();
    assert_eq!(curves.val_loss.len(), 3);
    let png = out.path().join("loss.png");
    tune::plot::plot(&curves, &png, (640, 480)).unwrap();
    assert!(std::fs::metadata(&png).unwrap().len() > 1000);
}

#[test]
fn validation_needs_a_validation_set_and_enough_rows_for_a_batch() {
    let out = temp_dir("val-errors");
    let err = tiny_lora(&out, &["run_val_every_n_steps=2"]);
    let stderr = String::from_utf8_lossy(&err.stderr);
    assert!(!err.status.success());
    assert!(
        stderr.contains("run_val_every_n_steps") && stderr.contains("dataset_val"),
        "{stderr}"
    );
    let err = tiny_lora(&out, &[ALPACA_VAL, "batch_size_val=9"]);
    let stderr = String::from_utf8_lossy(&err.stderr);
    assert!(!err.status.success());
    assert!(
        stderr.contains("dataset_val") && stderr.contains("batch_size_val=9"),
        "{stderr}"
    );
}

#[test]
fn dpo_kd_and_qat_recipes_validate_too() {
    let pairs = "dataset_val={_component_: torchtune.datasets.stack_exchange_paired_dataset, source: json, data_files: assets/data/alpaca_pairs_tiny.json, split: 'train[:4]'}";
    for (recipe, config, val, own) in [
        (
            "lora_dpo_single_device",
            "tiny/lora_dpo_single_device",
            pairs,
            "val_rewards/accuracies",
        ),
        (
            "knowledge_distillation_single_device",
            "tiny/kd_lora_single_device",
            ALPACA_VAL,
            "val_kd_loss",
        ),
        (
            "qat_lora_finetune_single_device",
            "tiny/qat_lora_single_device",
            ALPACA_VAL,
            "val_loss",
        ),
    ] {
        let out = temp_dir("val-recipes");
        let metrics = run_recipe(
            recipe,
            config,
            &out,
            &[
                "max_steps_per_epoch=2",
                "epochs=1",
                "run_val_every_n_steps=1",
                val,
            ],
        );
        let lines = lines_with(&metrics, "val_loss");
        assert_eq!(steps(&lines), [1, 2], "{recipe}: {lines:?}");
        for line in lines {
            for key in ["val_loss", own] {
                let v = line[key].as_f64().unwrap_or(f64::NAN);
                assert!(v.is_finite(), "{recipe}: {key} = {v} in {line}");
            }
        }
    }
    // DPO validates on pairs: an SFT validation set is refused by name.
    let out = temp_dir("val-dpo-sft");
    let output_dir = format!("output_dir={}", out.path().display());
    let err = tune(&[
        "run",
        "lora_dpo_single_device",
        "--config",
        "tiny/lora_dpo_single_device",
        &output_dir,
        ALPACA_VAL,
    ]);
    let stderr = String::from_utf8_lossy(&err.stderr);
    assert!(
        !err.status.success() && stderr.contains("dataset_val"),
        "{stderr}"
    );
}
