//! Every built-in config loads and validates for its recipe.

use crate::support;

use tune::config::builtin;
use tune::config::components::ModelVariant;
use tune::config::{ValidateOptions, load_config};

use tune::recipes::{validate, validate_with};

/// The torchtune script a built-in config's first line names.
fn script(b: &builtin::BuiltinConfig) -> &'static str {
    let (recipe, distributed) = tune::recipes::builtin_recipe(b)
        .unwrap_or_else(|| panic!("{}: its first line names no recipe", b.name));
    recipe.script_name(distributed)
}

/// Like torchtune's, each config's first line says which recipe it is for; the names are
/// the files', sorted and unique.
#[test]
fn every_builtin_names_its_recipe_in_its_first_line() {
    let all = builtin::list();
    let names: Vec<&str> = all.iter().map(|b| b.name).collect();
    let mut sorted = names.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(names, sorted);
    for b in &all {
        let first = b.yaml.lines().next().unwrap_or_default();
        assert!(
            first.starts_with("# Config for") && first.contains(script(b)),
            "{}: first line `{first}` must name its recipe",
            b.name
        );
    }
    let generation = builtin::get("tiny/generation.yaml").expect("tiny/generation");
    assert_eq!(script(&generation), "generate");
}

#[test]
fn every_builtin_validates_without_path_checks() {
    let opts = ValidateOptions { check_paths: false };
    let all = builtin::list();
    assert!(all.len() >= 28);
    for b in all {
        let cfg = load_config(b.name, &[]).unwrap_or_else(|e| panic!("{}: {e}", b.name));
        if let Err(e) = validate_with(script(&b), &cfg, &opts) {
            panic!("{} does not validate:\n{e}", b.name);
        }
    }
}

#[test]
fn tiny_configs_validate_with_path_checks_on_shipped_assets() {
    let assets = support::tiny_assets();
    let tiny: Vec<_> = builtin::list()
        .into_iter()
        .filter(|b| b.name.starts_with("tiny/"))
        .collect();
    // One per torchtune script: 11 single-device (generate and PPO included) and 9 distributed,
    // and the vision-language LoRA (lora_finetune_single_device's second).
    assert_eq!(
        tiny.len(),
        21,
        "one tiny config per recipe script, and the vision one"
    );
    let mut scripts: Vec<&str> = tiny.iter().map(script).collect();
    scripts.sort_unstable();
    scripts.dedup();
    assert_eq!(scripts.len(), 20);
    for b in tiny {
        let mut cfg = load_config(b.name, &[]).expect("loads");
        support::rebase_assets(&mut cfg.value, assets.path());
        match validate(script(&b), &cfg) {
            Ok((_, warnings)) => assert!(warnings.is_empty(), "{}: {warnings:?}", b.name),
            Err(e) => panic!("{}:\n{e}", b.name),
        }
    }
}

#[test]
fn tiny_lora_typed_values() {
    let cfg = load_config("tiny/lora_single_device", &[]).unwrap();
    let (typed, _) = validate_with(
        "lora_finetune",
        &cfg,
        &ValidateOptions { check_paths: false },
    )
    .unwrap();
    assert_eq!(typed.recipe.name, "lora_finetune");
    let t = typed.as_train().expect("a training config");
    assert_eq!(
        t.output_dir.to_str(),
        Some("/tmp/tune/tiny/lora_finetune_single_device")
    );
    assert_eq!(t.model.lora().map(|l| l.lora_rank), Some(8));
    assert_eq!(t.optimizer.lr(), 1e-3);
    assert_eq!(t.seed, Some(42));
    assert_eq!(t.batch_size, 4);
    assert_eq!(t.max_steps_per_epoch, Some(60));
    assert_eq!(t.dataset.len(), 1);
    assert_eq!(
        t.metric_logger
            .as_ref()
            .and_then(|m| m.log_dir())
            .and_then(|p| p.to_str()),
        Some("/tmp/tune/tiny/lora_finetune_single_device/logs")
    );
    assert_eq!(t.model.component.variant, ModelVariant::Lora);
    assert_eq!(t.model.component.size, "tiny");
}

#[test]
fn generation_typed_values() {
    let cfg = load_config(
        "tiny/generation",
        &support::args(&["prompt=Hi there", "chat=True"]),
    )
    .unwrap();
    let (typed, _) =
        validate_with("generate", &cfg, &ValidateOptions { check_paths: false }).unwrap();
    let g = typed.as_generate().expect("generate config");
    assert_eq!(g.prompt.user, "Hi there");
    assert_eq!(g.prompt.system, None);
    assert!(g.chat);
    assert_eq!(g.max_new_tokens, 16);
    assert!(g.stop_at_eos);
}

#[test]
fn multi_dataset_is_concatenated() {
    let cfg = load_config(
        "tiny/lora_single_device",
        &support::args(&[
            "dataset=[{_component_: torchtune.datasets.alpaca_dataset, source: json, data_files: a.json}, {_component_: torchtune.datasets.slimorca_dataset}]",
        ]),
    )
    .unwrap();
    let (typed, _) = validate_with(
        "lora_finetune",
        &cfg,
        &ValidateOptions { check_paths: false },
    )
    .unwrap();
    assert_eq!(typed.as_train().map(|t| t.dataset.len()), Some(2));
}
