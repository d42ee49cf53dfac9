//! Every config key, walked from its one declaration (`config::schema`): documented, read as
//! its declared type (and refused, at its own path, as any other), and the resume fingerprint
//! derived from the declarations equal to the one tune wrote before they existed.

use serde_yaml::{Mapping, Value};

use tune::config::keys::{KeyInfo, Ty, shape_ok};
use tune::config::recipes::RecipeSpec;
use tune::config::reference::entries_for;
use tune::config::{ProblemKind, ValidateOptions, load_config};
use tune::recipes::{RECIPES, validate_with};

const NO_PATHS: ValidateOptions = ValidateOptions { check_paths: false };

/// Every key a recipe reads, by dotted path, as its tiny config writes them (a section picked
/// by a `_component_` with its component's keys), with its declaration.
fn keys_of(recipe: &RecipeSpec) -> Vec<(String, &'static KeyInfo)> {
    let base = load_config(tiny_config(recipe), &[]).expect("tiny config");
    entries_for(recipe, &base.value)
        .into_iter()
        .map(|e| (e.path, e.key))
        .collect()
}

/// A value whose shape `ty` refuses (`None` for `Any`, which takes every value).
fn wrong_value(ty: &Ty) -> Option<Value> {
    let candidates: [Value; 5] = [
        Value::from("text"),
        Value::from(1.5),
        serde_yaml::from_str("[1]").unwrap(),
        serde_yaml::from_str("{x: 1}").unwrap(),
        Value::from(true),
    ];
    candidates.into_iter().find(|v| !shape_ok(v, ty))
}

/// Sets `path` in `root`, replacing any parent that is not a mapping with one.
fn set(root: &mut Value, path: &str, value: Value) {
    let mut node = root;
    let segments: Vec<&str> = path.split('.').collect();
    for (i, seg) in segments.iter().enumerate() {
        if !node.is_mapping() {
            *node = Value::Mapping(Mapping::new());
        }
        let map = node.as_mapping_mut().expect("a mapping");
        if i + 1 == segments.len() {
            map.insert(Value::from(*seg), value);
            return;
        }
        node = map
            .entry(Value::from(*seg))
            .or_insert(Value::Mapping(Mapping::new()));
    }
}

/// A tiny config for each recipe: the shipped one for its one-device script.
fn tiny_config(recipe: &RecipeSpec) -> &'static str {
    let name = recipe.torchtune_name();
    tune::config::builtin::list()
        .into_iter()
        .filter(|b| b.name.starts_with("tiny/"))
        .find(|b| tune::recipes::builtin_recipe(b) == Some((recipe, false)))
        .map(|b| b.name)
        .unwrap_or_else(|| panic!("no tiny config for {name}"))
}

#[test]
fn every_key_is_declared_with_a_doc_line_and_a_name_of_its_own() {
    let mut count = 0;
    for &info in RECIPES {
        let keys = keys_of(info);
        for (path, key) in &keys {
            assert!(
                !key.doc.trim().is_empty(),
                "{}: `{path}` has no doc line",
                info.name
            );
            let twins = keys.iter().filter(|(p, _)| p == path).count();
            assert_eq!(
                twins, 1,
                "{}: `{path}` is declared {twins} times",
                info.name
            );
        }
        count += keys.len();
    }
    // Every recipe reads at least the training keys' sections: the walk did go into them.
    assert!(count > 500, "{count} keys walked");
}

/// Each key is read as the type its declaration gives it: a value of another shape is refused
/// at exactly that key, naming what it expected.
#[test]
fn every_key_refuses_a_value_of_another_type_at_its_own_path() {
    let mut checked = 0;
    for &info in RECIPES {
        let base = load_config(tiny_config(info), &[]).expect("tiny config");
        for (path, key) in keys_of(info) {
            let Some(wrong) = wrong_value(key.ty) else {
                continue;
            };
            let mut cfg = base.clone();
            set(&mut cfg.value, &path, wrong.clone());
            let errors = match validate_with(info.name, &cfg, &NO_PATHS) {
                Ok(_) => panic!("{}: `{path}: {wrong:?}` validated", info.name),
                Err(e) => e,
            };
            assert!(
                errors
                    .problems
                    .iter()
                    .any(|p| p.key == path && p.kind == ProblemKind::WrongType),
                "{}: `{path}: {wrong:?}` is not refused as the wrong type at its path: {errors}",
                info.name
            );
            checked += 1;
        }
    }
    assert!(checked > 500, "{checked} keys checked");
}

/// Unknown keys anywhere get the closest declared name.
#[test]
fn a_misspelt_key_is_offered_its_declared_name() {
    for &info in RECIPES {
        let base = load_config(tiny_config(info), &[]).expect("tiny config");
        for (path, key) in keys_of(info) {
            // Only keys whose section the tiny config writes: a misspelt key of an absent
            // section is reported with the section's missing keys.
            let parent = path.rsplit_once('.').map(|(p, _)| p);
            if parent.is_some_and(|p| tune::config::yaml::get(&base.value, p).is_none())
                || key.name.len() < 5
            {
                continue;
            }
            let misspelt = format!("{}{}", &path[..path.len() - 1], "z");
            let mut cfg = base.clone();
            set(&mut cfg.value, &misspelt, Value::Null);
            let errors = validate_with(info.name, &cfg, &NO_PATHS)
                .err()
                .unwrap_or_else(|| panic!("{}: `{misspelt}` validated", info.name));
            assert!(
                errors.has(&misspelt, &format!("`{}`", key.name)),
                "{}: `{misspelt}` is not offered `{}`: {errors}",
                info.name,
                key.name
            );
        }
    }
}

/// String values naming a file of the shipped assets, whichever directory they resolve to.
fn normalise(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::String(s) => {
            if let Some(i) = s.rfind("assets/") {
                *s = format!("<assets>/{}", &s[i + "assets/".len()..]);
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(normalise),
        serde_json::Value::Object(map) => map.values_mut().for_each(normalise),
        _ => {}
    }
}

/// The fingerprints the tiny configs' checkpoints held before fingerprints were derived from
/// the key declarations (tests/fixtures/fingerprints, written by tune at d568262) equal the
/// derived ones: checkpoints written before resume after it, and no key was lost or added.
#[test]
fn the_derived_fingerprint_equals_the_one_earlier_checkpoints_hold() {
    let fixtures = crate::support::fixture("fingerprints");
    let mut compared = 0;
    // The GRPO and PPO recipes came after those checkpoints: they have none to resume.
    for &info in RECIPES.iter().filter(|r| {
        r.is_training()
            && matches!(
                r.data,
                tune::config::recipes::DataKind::Responses | tune::config::recipes::DataKind::Pairs
            )
    }) {
        let config = tiny_config(info);
        let file = fixtures.join(format!("{}.json", config.trim_start_matches("tiny/")));
        let text = std::fs::read_to_string(&file).expect("fingerprint fixture");
        let saved: tune::training::checkpointing::RunFingerprint =
            serde_json::from_str(&text).expect("fingerprint json");
        let cfg = load_config(config, &[]).unwrap();
        let (typed, _) = validate_with(info.name, &cfg, &NO_PATHS).unwrap();
        let train = typed.as_train().expect("a training config");
        let seed = train.seed.expect("the tiny configs set a seed");
        let mut derived = tune::setup::run::fingerprint(&typed, seed, 1);
        for value in derived.entries.values_mut() {
            normalise(value);
        }
        assert_eq!(
            saved.differences(&derived),
            Vec::<String>::new(),
            "{config}: {}",
            serde_json::to_string_pretty(&derived.entries).unwrap()
        );
        compared += 1;
    }
    assert_eq!(compared, 7);
}

/// What a resume must keep, may change, and may ignore, as the declarations say.
#[test]
fn a_changed_fingerprint_key_is_named_and_only_the_learning_rate_may_change() {
    let fingerprint = |overrides: &[&str]| {
        let cfg = load_config("tiny/lora_single_device", &crate::support::args(overrides)).unwrap();
        let (typed, _) = validate_with("lora_finetune", &cfg, &NO_PATHS).unwrap();
        tune::setup::run::fingerprint(&typed, 42, 1)
    };
    let base = fingerprint(&[]);
    for (over, key) in [
        ("model.lora_rank=16", "model.lora_rank"),
        ("dataset.train_on_input=False", "dataset"),
        ("tokenizer.max_seq_len=64", "tokenizer.max_seq_len"),
        ("optimizer.weight_decay=0.1", "optimizer.weight_decay"),
        (
            "gradient_accumulation_steps=2",
            "gradient_accumulation_steps",
        ),
        ("optimizer.lr=1e-4", "optimizer.lr"),
    ] {
        assert_eq!(base.differences(&fingerprint(&[over])), [key], "{over}");
    }
    assert_eq!(base.resume_may_change, ["optimizer.lr"]);
    for over in ["log_every_n_steps=5", "epochs=3", "save_every_n_steps=2"] {
        assert!(base.differences(&fingerprint(&[over])).is_empty(), "{over}");
    }
}
