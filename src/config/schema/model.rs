//! `model` (and knowledge distillation's `teacher_model`): the builder, its LoRA adapters and a
//! generic builder's architecture arguments.

use serde::Serialize;

use crate::config::components::{ModelBuilder, ModelVariant};
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{Checker, choice, default, group, join, keys, off, optional};
use crate::config::recipes::Trains;
use crate::config::values::choices;

/// An attention projection LoRA can adapt, by torchtune's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoraModule {
    QProj,
    KProj,
    VProj,
    OutputProj,
}

choices!(LoraModule {
    "q_proj" => LoraModule::QProj,
    "k_proj" => LoraModule::KProj,
    "v_proj" => LoraModule::VProj,
    "output_proj" => LoraModule::OutputProj,
});

impl LoraModule {
    /// The Hugging Face name of the projection (torchtune's `output_proj` is `o_proj`).
    pub fn hf_name(self) -> &'static str {
        match self {
            Self::QProj => "q_proj",
            Self::KProj => "k_proj",
            Self::VProj => "v_proj",
            Self::OutputProj => "o_proj",
        }
    }
}

keys! {
    /// The architecture arguments a builder may repeat (torchtune's generic builders take
    /// them): tune builds the model from the checkpoint's config.json, so each must equal it.
    pub struct ArchKeys {
        group: "architecture",
    }
    /// A generic builder's `vocab_size`: must equal config.json's.
    vocab_size: Option<usize> = optional(),
    /// A generic builder's `num_layers`: must equal config.json's `num_hidden_layers`.
    num_layers: Option<usize> = optional(),
    /// A generic builder's `num_heads`: must equal config.json's `num_attention_heads`.
    num_heads: Option<usize> = optional(),
    /// A generic builder's `num_kv_heads`: must equal config.json's `num_key_value_heads`.
    num_kv_heads: Option<usize> = optional(),
    /// A generic builder's `embed_dim`: must equal config.json's `hidden_size`.
    embed_dim: Option<usize> = optional(),
    /// A generic builder's `intermediate_dim`: must equal config.json's `intermediate_size`.
    intermediate_dim: Option<usize> = optional(),
    /// A generic builder's `head_dim`: must equal config.json's.
    head_dim: Option<usize> = optional(),
    /// A generic builder's `max_seq_len`: must equal config.json's `max_position_embeddings`.
    max_seq_len: Option<usize> = optional(),
    /// A generic builder's `norm_eps`: must equal config.json's `rms_norm_eps`.
    norm_eps: Option<f64> = optional(),
    /// A generic builder's `rope_base`: must equal config.json's `rope_theta`.
    rope_base: Option<f64> = optional(),
    /// A generic builder's `tie_word_embeddings`: must equal config.json's.
    tie_word_embeddings: Option<bool> = optional(),
    /// A classifier builder's classes (`llama2_classifier`, `mistral_classifier`): must equal
    /// the checkpoint's labels (`*ForSequenceClassification`); PPO's reward and value models
    /// have 1.
    num_classes: Option<usize> = optional().range(|v| v >= 1.0, "at least 1"),
    /// Attention dropout: only 0 (torchtune's configs all use 0.0).
    attn_dropout: Option<f64> = optional().refuse(
        "attention dropout is not implemented (torchtune's configs all use 0.0); set `attn_dropout: 0.0`",
    ),
}

keys! {
    /// A LoRA builder's adapters, with the defaults of torchtune's `lora_*` builders.
    pub struct LoraKeys {
        group: "lora",
    }
    /// The attention projections that get LoRA adapters.
    lora_attn_modules: Vec<LoraModule> = default(Vec::new),
    /// LoRA on the MLP's gate, up and down projections too.
    apply_lora_to_mlp: bool = off(),
    /// LoRA on the output projection too (not where it is tied to the embeddings).
    apply_lora_to_output: bool = off(),
    /// The adapters' rank.
    lora_rank: u32 = default(|| 8).range(|v| v >= 1.0, "at least 1 (e.g. 8)"),
    /// The adapters' scale is `lora_alpha / lora_rank`.
    lora_alpha: f64 = default(|| 16.0).range(|v| v > 0.0, "greater than 0 (usually 2 x lora_rank)"),
    /// Dropout on the adapters' input while training.
    lora_dropout: f64 = default(|| 0.0).range(
        |v| (0.0..1.0).contains(&v),
        "from 0 up to, not including, 1",
    ),
    /// DoRA: a trained magnitude per output row over the adapted weight (peft's `use_dora`).
    use_dora: bool = off(),
    /// LoRA on a mixture-of-experts model: each sparse layer's router trains in full too,
    /// saved with the adapter as peft's `modules_to_save`; `False` keeps the routers frozen. A
    /// dense model has no router: refused at load.
    train_router: bool = off(),
    /// QLoRA: the decoder's linear base weights in NF4 (torchtune's `qlora_*` builders set it).
    quantize_base: bool = off(),
}

keys! {
    /// A full builder's keys.
    pub struct FullModelKeys {}
    /// The architecture arguments.
    #[serde(flatten)]
    arch: ArchKeys = group(),
}

keys! {
    /// A LoRA builder's keys.
    pub struct LoraModelKeys {}
    /// The architecture arguments.
    #[serde(flatten)]
    arch: ArchKeys = group(),
    /// The adapters.
    #[serde(flatten)]
    lora: LoraKeys = group(),
}

choice! {
    /// The model: which builder (family, full or LoRA, QLoRA) and, for a LoRA builder, its
    /// adapters. The architecture always comes from the checkpoint's config.json.
    pub struct ModelConfig {
        section: "model",
        component: ModelBuilder,
        settings: ModelSettings,
        rule: model_rules,
    }
    "full builders (e.g. `torchtune.models.llama3_2.llama3_2_1b`)":
        b if !b.is_lora() => Full(FullModelKeys),
    "LoRA builders (e.g. `torchtune.models.llama3_2.lora_llama3_2_1b`, `qlora_*`)":
        b if b.is_lora() => Lora(LoraModelKeys),
}

impl ModelConfig {
    /// The architecture arguments.
    pub fn arch(&self) -> &ArchKeys {
        match &self.settings {
            ModelSettings::Full(k) => &k.arch,
            ModelSettings::Lora(k) => &k.arch,
        }
    }

    /// A LoRA builder's adapters.
    pub fn lora(&self) -> Option<&LoraKeys> {
        match &self.settings {
            ModelSettings::Lora(k) => Some(&k.lora),
            ModelSettings::Full(_) => None,
        }
    }

    /// `train_router: True`: the routers train beside the adapters.
    pub fn trains_router(&self) -> bool {
        self.lora().is_some_and(|l| l.train_router)
    }

    /// Adapters train on a frozen base (LoRA, QLoRA, DoRA builders).
    pub fn is_lora(&self) -> bool {
        self.lora().is_some()
    }

    /// A classifier builder (`*_classifier`, torchtune's `*_reward_7b`): a reward or value
    /// model's scores instead of next-token logits.
    pub fn is_classifier(&self) -> bool {
        let size = self.component.size.as_str();
        size == "classifier" || size.starts_with("reward")
    }

    /// A classifier builder's classes: `num_classes` for `*_classifier` (which validation
    /// requires), one for `*_reward_7b`; `None` for a language model.
    pub fn classes(&self) -> Option<usize> {
        match self.component.size.as_str() {
            "classifier" => self.arch().num_classes,
            size if size.starts_with("reward") => Some(1),
            _ => None,
        }
    }

    /// The base's linear weights are stored in NF4: torchtune's `qlora_*` builders, or
    /// `quantize_base: True`.
    pub fn quantizes_base(&self) -> bool {
        self.component.variant == ModelVariant::QLora
            || self.lora().is_some_and(|l| l.quantize_base)
    }
}

/// What only makes sense for some builders and recipes: LoRA builders for LoRA recipes and
/// full ones for full recipes, and a LoRA builder's adapters.
fn model_rules(m: &ModelConfig, path: &str, cx: &mut Checker) {
    let builder = &m.component;
    let name = builder.canonical_name();
    let key = join(path, "_component_");
    let (module, size) = (builder.family.module(), &builder.size);
    let recipe = cx.recipe;
    let trained = path == "model" || path == "policy_model";
    match recipe.map(|r| r.trains).filter(|_| trained) {
        Some(Trains::Lora) if !builder.is_lora() => cx.problem(
            Problem::new(
                ProblemKind::WrongComponentKind,
                &key,
                format!(
                    "recipe `{}` trains LoRA adapters, but `{name}` is a full model builder",
                    recipe.map_or("?", |r| r.name)
                ),
            )
            .with_fix(format!(
                "use the LoRA builder `tune.models.{module}.lora_{module}_{size}`"
            )),
        ),
        Some(Trains::Full) if builder.is_lora() => cx.problem(
            Problem::new(
                ProblemKind::WrongComponentKind,
                &key,
                format!(
                    "recipe `{}` trains every weight, but `{name}` is a LoRA builder",
                    recipe.map_or("?", |r| r.name)
                ),
            )
            .with_fix(format!(
                "use the full builder `tune.models.{module}.{module}_{size}`, or a LoRA recipe"
            )),
        ),
        _ => {}
    }
    classifier_rules(m, path, cx);
    let Some(lora) = m.lora() else {
        return;
    };
    // A section read on its own (no recipe) has no rules to follow.
    let Some(recipe) = recipe else {
        return;
    };
    if lora.train_router && !(path == "model" && recipe.is_training()) {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                join(path, "train_router"),
                format!(
                    "`{path}` is not trained by recipe `{}`, so it has no routers to train",
                    recipe.name
                ),
            )
            .with_fix("remove it; `model.train_router` is for the LoRA training recipes"),
        );
    }
    let no_targets =
        lora.lora_attn_modules.is_empty() && !lora.apply_lora_to_mlp && !lora.apply_lora_to_output;
    if no_targets && recipe.is_training() {
        cx.problem(
            Problem::new(
                ProblemKind::MissingKey,
                join(path, "lora_attn_modules"),
                format!("missing required key `lora_attn_modules` for LoRA builder `{name}`"),
            )
            .with_fix("e.g. `lora_attn_modules: [q_proj, v_proj]`"),
        );
    }
}

/// A classifier builder (a reward or value model, scores instead of next-token logits) is what
/// PPO's `reward_and_value_model` is, and nothing else is: it needs its `num_classes` (1).
fn classifier_rules(m: &ModelConfig, path: &str, cx: &mut Checker) {
    let name = m.component.canonical_name();
    let key = join(path, "_component_");
    let scores = path == "reward_and_value_model";
    match (m.is_classifier(), m.classes()) {
        (false, _) if scores => cx.problem(
            Problem::new(
                ProblemKind::WrongComponentKind,
                &key,
                format!("PPO's reward and value models score sequences, but `{name}` is a language model builder"),
            )
            .with_fix(format!(
                "use the classifier builder `torchtune.models.{module}.{module}_classifier` with `num_classes: 1`",
                module = m.component.family.module()
            )),
        ),
        (true, _) if !scores => cx.problem(
            Problem::new(
                ProblemKind::WrongComponentKind,
                &key,
                format!("`{name}` is a classifier (a reward model's scores), not a language model to train or generate with"),
            )
            .with_fix("use a language model builder here; classifiers are PPO's `reward_and_value_model`"),
        ),
        (true, None) => cx.problem(
            Problem::new(
                ProblemKind::MissingKey,
                join(path, "num_classes"),
                format!("`{name}` needs `num_classes`"),
            )
            .with_fix("PPO's reward and value models have `num_classes: 1`"),
        ),
        (true, Some(n)) if n != 1 => cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                join(path, "num_classes"),
                format!("is {n}, but PPO's reward and value models give one score per token"),
            )
            .with_fix("set `num_classes: 1`"),
        ),
        _ => {}
    }
    if m.arch().num_classes.is_some() && m.component.size != "classifier" {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                join(path, "num_classes"),
                format!("`{name}` takes no `num_classes` (only `*_classifier` builders do)"),
            )
            .with_fix("remove it"),
        );
    }
}

/// For the recipes whose reference model is the policy with its adapters switched off (LoRA
/// DPO, LoRA GRPO): peft's `disable_adapter` (and so TRL) would also switch trained routers
/// back to the base's, and tune keeps no frozen copy of them, so `train_router` is refused.
pub fn refuse_router_training(cfg: &super::TrainConfig, recipe: &str, cx: &mut Checker) {
    if cfg.model.trains_router() {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "model.train_router",
                format!(
                    "recipe `{recipe}` takes its reference model from this one with the adapters switched off, where peft (and so TRL) would also switch trained routers back to the base's; tune keeps no frozen copy of the routers for that"
                ),
            )
            .with_fix("set `train_router: False`, which keeps the routers frozen, or train them with lora_finetune_single_device"),
        );
    }
}
