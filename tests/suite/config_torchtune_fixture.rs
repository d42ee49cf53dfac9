//! torchtune's own `llama3_2/1B_lora_single_device.yaml`, verbatim, validates once
//! its paths point at real files.

use crate::common;

use common::{TempDir, args};
use tune::config::{load_config, validate};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/torchtune_llama3_2_1B_lora_single_device.yaml"
);

#[test]
fn torchtune_config_validates_after_path_overrides() {
    let model = TempDir::new("llama32");
    model.touch("epoch_2/ft-model-00001-of-00001.safetensors");
    model.touch("tokenizer.json");
    model.touch("original/tokenizer.model");
    let cfg = load_config(
        FIXTURE,
        &args(&[
            &format!("checkpointer.checkpoint_dir={}", model.path("")),
            &format!("tokenizer.path={}", model.path("original/tokenizer.model")),
            "output_dir=/tmp/tune-test/llama3_2_1b",
        ]),
    )
    .expect("loads");
    let (typed, warnings) =
        validate("lora_finetune_single_device", &cfg).unwrap_or_else(|e| panic!("{e}"));
    let t = typed.as_train().expect("train config");
    assert_eq!(t.optimizer.lr, 3e-4);
    assert_eq!(t.model.lora_rank, Some(64));
    assert_eq!(
        t.metric_logger
            .as_ref()
            .and_then(|m| m.log_dir.clone())
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
