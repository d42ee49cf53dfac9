//! Validation: reads the resolved tree into the recipe's typed config, key by key as each key
//! declares itself (`config::schema`), collecting every problem and warning.

use serde_yaml::Value;

use crate::config::error::{Problem, ProblemKind, ValidationErrors, Warning};
use crate::config::keys::{Checker, ConfigValue};
use crate::config::load::ResolvedConfig;
use crate::config::recipes::{self, Recipe};
use crate::config::schema::{GenerateConfig, RecipeConfig, RecipeKeys, TrainConfig};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValidateOptions {
    /// Check that checkpoint dirs, checkpoint files, tokenizer and data files exist.
    pub check_paths: bool,
}

impl Default for ValidateOptions {
    fn default() -> Self {
        Self { check_paths: true }
    }
}

/// Validates `cfg` for `recipe` (canonical name or torchtune alias) with every check on.
pub fn validate(
    recipe: &str,
    cfg: &ResolvedConfig,
) -> Result<(RecipeConfig, Vec<Warning>), ValidationErrors> {
    validate_with(recipe, cfg, &ValidateOptions::default())
}

pub fn validate_with(
    recipe: &str,
    cfg: &ResolvedConfig,
    opts: &ValidateOptions,
) -> Result<(RecipeConfig, Vec<Warning>), ValidationErrors> {
    let fail = |problems| ValidationErrors {
        source_name: cfg.source.clone(),
        problems,
    };
    let recipe = recipes::find(recipe).map_err(|e| {
        fail(vec![Problem::new(
            ProblemKind::UnknownRecipe,
            "recipe",
            e.to_string(),
        )])
    })?;
    let Some(root) = cfg.value.as_mapping() else {
        return Err(fail(vec![Problem::new(
            ProblemKind::WrongType,
            "<root>",
            "the config must be a mapping of keys to values",
        )]));
    };
    // The one value a rule needs before its own key is read: a resumed run's checkpointer must
    // also find its `recipe_checkpoint`.
    let resuming = root.get("resume_from_checkpoint").and_then(Value::as_bool) == Some(true);
    let mut cx = Checker::new(Some(recipe), opts.check_paths, resuming);
    let config = match recipe {
        Recipe::Generate => {
            cx.unknown_keys(
                &without_variables(root, cfg),
                "",
                &[GenerateConfig::KEYS],
                false,
            );
            GenerateConfig::read_keys(root, "", &mut cx)
                .map(|g| RecipeConfig::Generate(Box::new(g)))
        }
        Recipe::PpoFull => {
            use crate::config::schema::ppo;
            // The config's own top level, less what `train_view` refuses itself.
            let mut top = without_variables(root, cfg);
            top.remove("model");
            top.remove("epochs");
            cx.unknown_keys(
                &top,
                "",
                &[&ppo::SHARED_KEYS, RecipeKeys::keys_of(recipe)],
                false,
            );
            let view = ppo::train_view(root, &mut cx);
            let (problems, warnings) = (cx.problems.len(), cx.warnings.len());
            let common = TrainConfig::read_keys(&view, "", &mut cx);
            ppo::rename_policy_paths(&mut cx, problems, warnings);
            let own_view = ppo::own_view(root, &mut cx);
            let own = RecipeKeys::read(recipe, &own_view, &mut cx);
            if let (Some(common), Some(own)) = (&common, own.as_ref().and_then(RecipeKeys::ppo)) {
                ppo::ppo_rules(common, own, &mut cx);
            }
            common
                .zip(own)
                .map(|(common, own)| RecipeConfig::Train(own, Box::new(common)))
        }
        training => {
            cx.unknown_keys(
                &without_variables(root, cfg),
                "",
                &[TrainConfig::KEYS, RecipeKeys::keys_of(training)],
                false,
            );
            let common = TrainConfig::read_keys(root, "", &mut cx);
            let own = RecipeKeys::read(training, root, &mut cx);
            common
                .zip(own)
                .map(|(common, own)| RecipeConfig::Train(own, Box::new(common)))
        }
    };
    match config {
        Some(config) if cx.problems.is_empty() => Ok((config, cx.warnings)),
        // Every key that could not be read reported why.
        _ if !cx.problems.is_empty() => Err(fail(cx.problems)),
        _ => Err(fail(vec![Problem::new(
            ProblemKind::InvalidValue,
            "<root>",
            "the config could not be read, and no key said why (a bug in tune: please report it)",
        )])),
    }
}

/// The top-level mapping without the config's variables (keys only `${...}` read, see
/// [`ResolvedConfig::variables`]): their values went into the keys that reference them.
fn without_variables(root: &serde_yaml::Mapping, cfg: &ResolvedConfig) -> serde_yaml::Mapping {
    root.iter()
        .filter(|(k, _)| !cfg.variables.contains(&crate::config::yaml::key_str(k)))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Reads one section on its own (no recipe's rules, no file checks): what deserialising a
/// section type does.
pub fn read_section<T: ConfigValue>(name: &str, value: &Value) -> Result<T, ValidationErrors> {
    let mut cx = Checker::new(None, false, false);
    let read = cx.value::<T>(value, name);
    match read {
        Some(section) if cx.problems.is_empty() => Ok(section),
        _ => Err(ValidationErrors {
            source_name: format!("`{name}`"),
            problems: cx.problems,
        }),
    }
}
