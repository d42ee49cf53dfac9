//! What a recipe is, as config validation sees it ([`RecipeSpec`]): its names (tune's short
//! one, torchtune's `*_single_device` and `*_distributed` scripts), what it trains and reads,
//! and its own keys. Each recipe declares its spec in its own file (`recipes/`), whose
//! registry lists them; nothing here knows which recipes there are.

use std::any::Any;
use std::fmt;

use serde_yaml::Mapping;

use crate::config::keys::{Checker, FingerprintEntries, KeyGroup, KeyInfo};
use crate::config::schema::TrainConfig;
use crate::config::suggest;

/// A recipe, declared once in its file: the registry (`recipes::RECIPES`) lists them all.
#[derive(Debug)]
pub struct RecipeSpec {
    /// tune's name (`lora_finetune`).
    pub name: &'static str,
    /// torchtune's script names for one device (`lora_finetune_single_device`); the first is
    /// the one config headers name.
    pub aliases: &'static [&'static str],
    /// torchtune's `*_distributed` name, for recipes that train on several workers.
    pub distributed: Option<&'static str>,
    pub description: &'static str,
    /// What its `model` section must be.
    pub trains: Trains,
    /// What its dataset's rows are.
    pub data: DataKind,
    /// How its top level reads.
    pub layout: Layout,
    /// Its own keys, besides the ones every training recipe reads.
    pub own: OwnKeysSpec,
}

/// The builder a recipe trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trains {
    /// LoRA adapters on a frozen base: a `lora_*` (or `qlora_*`) builder.
    Lora,
    /// Every weight: a full builder.
    Full,
    /// Either (knowledge distillation's student).
    Either,
    /// Nothing: generation.
    Nothing,
}

/// The rows a recipe's `dataset` holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataKind {
    /// Responses to train on (instruct, chat, text).
    Responses,
    /// Preference pairs (chosen and rejected).
    Pairs,
    /// Prompts to generate from (GRPO).
    Prompts,
    /// Prompts, or text whose start is the prompt (PPO's text completion datasets).
    PromptsOrText,
    /// No dataset (generation).
    None,
}

/// How a recipe's top level reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// The keys every training recipe reads ([`TrainConfig`]), then its own.
    Training,
    /// [`TrainConfig`]'s keys as PPO's configs write them (`policy_model` for `model`, no
    /// `epochs`: `config::schema::ppo`), then its own.
    Policy,
    /// Its own keys only (generation).
    Alone,
}

/// A recipe's own keys: their declarations and their reader, which runs the recipe's rules
/// over them and the shared keys (`None` for a recipe whose layout has none, or when those
/// did not read).
#[derive(Debug, Clone, Copy)]
pub struct OwnKeysSpec {
    pub keys: &'static [KeyInfo],
    pub read: ReadOwnKeys,
}

/// A recipe's reader of its own keys: the top level, the shared keys when they read, and the
/// walk's state.
pub type ReadOwnKeys = fn(&Mapping, Option<&TrainConfig>, &mut Checker) -> Option<Box<dyn OwnKeys>>;

impl OwnKeysSpec {
    /// Keys read as `K` declares them, with no rule of the recipe's own.
    pub const fn of<K: KeyGroup + Send + Sync>() -> Self {
        Self {
            keys: K::KEYS,
            read: read_boxed::<K>,
        }
    }
}

/// Reads keys as `K` declares them, then runs `rules` over them with the shared keys (when
/// those read): a recipe's own reader is `|root, train, cx| read_checked(root, train, cx,
/// rules)`.
pub fn read_checked<K: KeyGroup + Send + Sync>(
    root: &Mapping,
    train: Option<&TrainConfig>,
    cx: &mut Checker,
    rules: fn(&TrainConfig, &K, &mut Checker),
) -> Option<Box<dyn OwnKeys>> {
    let keys = K::read_keys(root, "", cx)?;
    if let Some(train) = train {
        rules(train, &keys, cx);
    }
    Some(Box::new(keys))
}

fn read_boxed<K: KeyGroup + Send + Sync>(
    root: &Mapping,
    _: Option<&TrainConfig>,
    cx: &mut Checker,
) -> Option<Box<dyn OwnKeys>> {
    K::read_keys(root, "", cx).map(|k| Box::new(k) as Box<dyn OwnKeys>)
}

/// A recipe's own keys, typed by the recipe (its `run` takes them as their own type).
pub trait OwnKeys: Any + fmt::Debug + Send + Sync {
    /// Adds their fingerprint entries.
    fn fingerprint_keys(&self, out: &mut FingerprintEntries);
    fn clone_box(&self) -> Box<dyn OwnKeys>;
    fn eq_box(&self, other: &dyn OwnKeys) -> bool;
    fn as_any(&self) -> &dyn Any;
}

impl<K: KeyGroup + Send + Sync> OwnKeys for K {
    fn fingerprint_keys(&self, out: &mut FingerprintEntries) {
        KeyGroup::fingerprint_keys(self, "", crate::config::keys::Fingerprint::Inherit, out);
    }

    fn clone_box(&self) -> Box<dyn OwnKeys> {
        Box::new(self.clone())
    }

    fn eq_box(&self, other: &dyn OwnKeys) -> bool {
        other.as_any().downcast_ref::<K>() == Some(self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl dyn OwnKeys {
    /// The keys as the type the recipe declared them.
    pub fn get<K: 'static>(&self) -> Option<&K> {
        self.as_any().downcast_ref()
    }
}

impl Clone for Box<dyn OwnKeys> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

impl RecipeSpec {
    /// torchtune's script name for this recipe (used in config header comments).
    pub fn torchtune_name(&self) -> &'static str {
        self.aliases.first().copied().unwrap_or(self.name)
    }

    /// torchtune's script name for this recipe with `distributed` workers or on one device.
    pub fn script_name(&self, distributed: bool) -> &'static str {
        match (distributed, self.distributed) {
            (true, Some(name)) => name,
            _ => self.torchtune_name(),
        }
    }

    pub fn is_training(&self) -> bool {
        self.layout != Layout::Alone
    }

    /// Whether `name` (a `.py` suffix ignored) is one of this recipe's names.
    pub fn answers_to(&self, name: &str) -> bool {
        let bare = name.trim().trim_end_matches(".py");
        self.name == bare || self.aliases.contains(&bare) || self.distributed == Some(bare)
    }

    /// Whether `name` is this recipe's `*_distributed` name (its dev recipe
    /// `dev/grpo_full_finetune_distributed` included).
    pub fn is_distributed_name(&self, name: &str) -> bool {
        let bare = name.trim().trim_end_matches(".py");
        self.distributed == Some(bare)
            || (bare.ends_with("_distributed") && self.aliases.contains(&bare))
    }

    /// Every key of the top level, the shared ones first, as the reference lists them.
    pub fn top_keys(&self) -> Vec<&'static KeyInfo> {
        let shared: Vec<&'static KeyInfo> = match self.layout {
            Layout::Training => TrainConfig::KEYS.iter().collect(),
            Layout::Policy => crate::config::schema::ppo::SHARED_KEYS.iter().collect(),
            Layout::Alone => Vec::new(),
        };
        shared.into_iter().chain(self.own.keys).collect()
    }
}

impl PartialEq for RecipeSpec {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl fmt::Display for RecipeSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown recipe `{name}`{hint}; known recipes: {known}")]
pub struct UnknownRecipe {
    pub name: String,
    pub hint: String,
    pub known: String,
}

/// Finds a recipe of `registry` by canonical name or torchtune alias; a `.py` suffix is
/// ignored.
pub fn find_in(
    registry: &'static [&'static RecipeSpec],
    name: &str,
) -> Result<&'static RecipeSpec, UnknownRecipe> {
    if let Some(spec) = registry.iter().find(|r| r.answers_to(name)) {
        return Ok(spec);
    }
    let bare = name.trim().trim_end_matches(".py");
    let all = registry.iter().flat_map(|r| {
        std::iter::once(&r.name)
            .chain(r.aliases)
            .chain(r.distributed.iter())
    });
    let hint = suggest::did_you_mean(&suggest::similar(bare, all.copied()));
    Err(UnknownRecipe {
        name: name.to_string(),
        hint: if hint.is_empty() {
            hint
        } else {
            format!(" ({hint})")
        },
        known: registry
            .iter()
            .map(|r| r.name)
            .collect::<Vec<_>>()
            .join(", "),
    })
}
