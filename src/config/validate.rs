//! Validation: reads the resolved tree into the recipe's typed config, key by key as each key
//! declares itself (`config::schema`), collecting every problem and warning.

use serde_yaml::Value;

use crate::config::error::{Problem, ProblemKind, ValidationErrors, Warning};
use crate::config::keys::{Checker, ConfigValue};
use crate::config::load::ResolvedConfig;
use crate::config::recipes::{Layout, RecipeSpec};
use crate::config::schema::{RecipeConfig, TrainConfig};

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

/// Validates `cfg` for `recipe` with every check on.
pub fn validate(
    recipe: &'static RecipeSpec,
    cfg: &ResolvedConfig,
) -> Result<(RecipeConfig, Vec<Warning>), ValidationErrors> {
    validate_with(recipe, cfg, &ValidateOptions::default())
}

pub fn validate_with(
    recipe: &'static RecipeSpec,
    cfg: &ResolvedConfig,
    opts: &ValidateOptions,
) -> Result<(RecipeConfig, Vec<Warning>), ValidationErrors> {
    let fail = |problems| ValidationErrors {
        source_name: cfg.source.clone(),
        problems,
    };
    let Some(root) = cfg.value.as_mapping() else {
        return Err(fail(vec![Problem::new(
            ProblemKind::WrongType,
            "<root>",
            "the config must be a mapping of keys to values",
        )]));
    };
    let mut cx = Checker::new(Some(recipe), opts.check_paths).with_root(root);
    let top = without_variables(root, cfg);
    let read = match recipe.layout {
        Layout::Alone => {
            cx.unknown_keys(&top, "", &[recipe.own.keys], false);
            (recipe.own.read)(root, None, &mut cx).map(|own| (None, own))
        }
        Layout::Training => {
            cx.unknown_keys(&top, "", &[TrainConfig::KEYS, recipe.own.keys], false);
            let train = TrainConfig::read_keys(root, "", &mut cx);
            let own = (recipe.own.read)(root, train.as_ref(), &mut cx);
            train.zip(own).map(|(t, own)| (Some(Box::new(t)), own))
        }
        Layout::Policy => {
            use crate::config::schema::ppo;
            // The config's own top level, less what `train_view` refuses itself.
            let mut top = top;
            top.remove("model");
            top.remove("epochs");
            cx.unknown_keys(&top, "", &[&ppo::SHARED_KEYS, recipe.own.keys], false);
            let view = ppo::train_view(root, &mut cx);
            let (problems, warnings) = (cx.problems.len(), cx.warnings.len());
            let train = TrainConfig::read_keys(&view, "", &mut cx);
            ppo::rename_policy_paths(&mut cx, problems, warnings);
            let own_view = ppo::own_view(root, &mut cx);
            let own = (recipe.own.read)(&own_view, train.as_ref(), &mut cx);
            train.zip(own).map(|(t, own)| (Some(Box::new(t)), own))
        }
    };
    match read {
        Some((train, own)) if cx.problems.is_empty() => {
            Ok((RecipeConfig { recipe, train, own }, cx.warnings))
        }
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
    let mut cx = Checker::new(None, false);
    let read = cx.value::<T>(value, name);
    match read {
        Some(section) if cx.problems.is_empty() => Ok(section),
        _ => Err(ValidationErrors {
            source_name: format!("`{name}`"),
            problems: cx.problems,
        }),
    }
}
