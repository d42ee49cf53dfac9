//! `model` (and knowledge distillation's `teacher_model`): the builder, its LoRA adapters and a
//! generic builder's architecture arguments.

use serde::Serialize;

use crate::config::components::{ModelBuilder, ModelVariant};
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{Checker, default, join, keys, off, optional};
use crate::config::recipes::Recipe;
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
    /// The model: which builder (family, full or LoRA, QLoRA) and its adapters. The
    /// architecture always comes from the checkpoint's config.json.
    pub struct ModelConfig {
        section: "model",
        component: ModelBuilder,
        rule: model_rules,
    }
    /// The attention projections that get LoRA adapters.
    lora_attn_modules: Vec<LoraModule> = default(Vec::new),
    /// LoRA on the MLP's gate, up and down projections too.
    apply_lora_to_mlp: bool = off(),
    /// LoRA on the output projection too (not where it is tied to the embeddings).
    apply_lora_to_output: bool = off(),
    /// The adapters' rank (LoRA builders in training recipes need it, as in torchtune).
    lora_rank: Option<u32> = optional().range(|v| v >= 1.0, "at least 1 (e.g. 8)"),
    /// The adapters' scale is `lora_alpha / lora_rank` (LoRA builders in training recipes need it).
    lora_alpha: Option<f64> = optional().range(|v| v > 0.0, "greater than 0 (usually 2 x lora_rank)"),
    /// Dropout on the adapters' input while training.
    lora_dropout: f64 = default(|| 0.0).range(
        |v| (0.0..1.0).contains(&v),
        "from 0 up to, not including, 1",
    ),
    /// DoRA: a trained magnitude per output row over the adapted weight (peft's `use_dora`).
    use_dora: bool = off(),
    /// LoRA on a mixture-of-experts model: `True` trains each sparse layer's router in full
    /// too, saved with the adapter as peft's `modules_to_save`; unset or `False`, the routers
    /// stay frozen. A dense model has no router: refused at load. (Optional rather than a
    /// default `False`: unset it leaves the run's fingerprint as checkpoints written before
    /// the key hold it, so they still resume.)
    train_router: Option<bool> = optional(),
    /// QLoRA: the decoder's linear base weights in NF4 (LoRA builders only).
    quantize_base: bool = off(),
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

impl ModelConfig {
    /// `train_router: True`: the routers train beside the adapters.
    pub fn trains_router(&self) -> bool {
        self.train_router == Some(true)
    }

    /// Adapters train on a frozen base (LoRA, QLoRA, DoRA builders).
    pub fn is_lora(&self) -> bool {
        self.component.is_lora()
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
            "classifier" => self.num_classes,
            size if size.starts_with("reward") => Some(1),
            _ => None,
        }
    }

    /// The base's linear weights are stored in NF4: torchtune's `qlora_*` builders, or
    /// `quantize_base: True`.
    pub fn quantizes_base(&self) -> bool {
        self.component.variant == ModelVariant::QLora || self.quantize_base
    }
}

/// What only makes sense for some builders and recipes: LoRA builders for LoRA recipes and
/// full ones for full recipes, their adapter keys, and the QLoRA/DoRA combinations torchtune
/// has.
fn model_rules(m: &ModelConfig, path: &str, cx: &mut Checker) {
    let builder = &m.component;
    let name = builder.canonical_name();
    let key = join(path, "_component_");
    let (module, size) = (builder.family.module(), &builder.size);
    let recipe = cx.recipe;
    match recipe.and_then(Recipe::needs_lora) {
        Some(true) if !builder.is_lora() => cx.problem(
            Problem::new(
                ProblemKind::WrongComponentKind,
                &key,
                format!(
                    "recipe `{}` trains LoRA adapters, but `{name}` is a full model builder",
                    recipe.map_or("?", Recipe::name)
                ),
            )
            .with_fix(format!(
                "use the LoRA builder `tune.models.{module}.lora_{module}_{size}`"
            )),
        ),
        Some(false) if builder.is_lora() => cx.problem(
            Problem::new(
                ProblemKind::WrongComponentKind,
                &key,
                format!(
                    "recipe `{}` trains every weight, but `{name}` is a LoRA builder",
                    recipe.map_or("?", Recipe::name)
                ),
            )
            .with_fix(format!(
                "use the full builder `tune.models.{module}.{module}_{size}`, or a LoRA recipe"
            )),
        ),
        _ => {}
    }
    classifier_rules(m, path, cx);
    if m.quantize_base && !builder.is_lora() {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                join(path, "quantize_base"),
                format!("`{name}` is a full model builder; NF4 base weights (QLoRA) are for LoRA builders, as in torchtune"),
            )
            .with_fix(format!(
                "remove `quantize_base`, or use `tune.models.{module}.qlora_{module}_{size}` with a LoRA recipe"
            )),
        );
    }
    if m.quantizes_base() && recipe == Some(Recipe::QatLora) {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                &key,
                format!("`{name}` stores the base in NF4 (QLoRA), but QAT fake-quantizes a float base to int4: torchtune and torchao do not combine the two"),
            )
            .with_fix(format!(
                "use `tune.models.{module}.lora_{module}_{size}` without `quantize_base` for QAT + LoRA, or lora_finetune_single_device for QLoRA"
            )),
        );
    }
    if m.use_dora && recipe == Some(Recipe::QatLora) {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                join(path, "use_dora"),
                "DoRA under QAT's fake quantization has no reference implementation to match (torchao and torchtune combine QAT with plain LoRA)",
            )
            .with_fix("set `use_dora: False`, or train DoRA with lora_finetune_single_device"),
        );
    }
    train_router_rules(m, path, recipe, cx);
    if builder.is_lora() && recipe.is_some_and(Recipe::is_training) {
        let no_targets =
            m.lora_attn_modules.is_empty() && !m.apply_lora_to_mlp && !m.apply_lora_to_output;
        let missing = [
            (
                "lora_attn_modules",
                no_targets,
                "e.g. `lora_attn_modules: [q_proj, v_proj]`",
            ),
            ("lora_rank", m.lora_rank.is_none(), "e.g. `lora_rank: 8`"),
            (
                "lora_alpha",
                m.lora_alpha.is_none(),
                "e.g. `lora_alpha: 16` (usually 2 x rank)",
            ),
        ];
        for (k, _, fix) in missing.into_iter().filter(|(_, missing, _)| *missing) {
            cx.problem(
                Problem::new(
                    ProblemKind::MissingKey,
                    join(path, k),
                    format!("missing required key `{k}` for LoRA builder `{name}`"),
                )
                .with_fix(fix),
            );
        }
    } else if !builder.is_lora() {
        let set = [
            ("lora_attn_modules", !m.lora_attn_modules.is_empty()),
            ("lora_rank", m.lora_rank.is_some()),
            ("lora_alpha", m.lora_alpha.is_some()),
            ("apply_lora_to_mlp", m.apply_lora_to_mlp),
            ("apply_lora_to_output", m.apply_lora_to_output),
            ("lora_dropout", m.lora_dropout != 0.0),
            ("train_router", m.trains_router()),
        ];
        for (k, _) in set.into_iter().filter(|(_, set)| *set) {
            cx.warn(
                join(path, k),
                format!("ignored: `{name}` is not a LoRA builder"),
            );
        }
    }
}

/// `train_router` works where a LoRA recipe trains this section's model; elsewhere it is
/// refused by name, except `True` on a full builder, which trains the routers anyway (the
/// LoRA keys' warning says so).
fn train_router_rules(m: &ModelConfig, path: &str, recipe: Option<Recipe>, cx: &mut Checker) {
    // A section read on its own (no recipe) has no rules to follow.
    let (Some(asked), Some(recipe)) = (m.train_router, recipe) else {
        return;
    };
    let key = join(path, "train_router");
    let recipe_name = recipe.name();
    let trained_here = path == "model" && recipe.is_training();
    if !trained_here {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                &key,
                format!("`{path}` is not trained by recipe `{recipe_name}`, so it has no routers to train or keep frozen"),
            )
            .with_fix("remove it; `model.train_router` is for the LoRA training recipes"),
        );
    } else if !m.component.is_lora() && !asked {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                &key,
                format!("`{}` is a full model builder: full fine-tuning trains every weight, the routers included", m.component.canonical_name()),
            )
            .with_fix("remove it, or use a LoRA builder to keep the routers frozen"),
        );
    } else if asked && matches!(recipe, Recipe::LoraDpo | Recipe::GrpoLora) {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                &key,
                format!(
                    "recipe `{recipe_name}` takes its reference model from this one with the adapters switched off, where peft (and so TRL) would also switch trained routers back to the base's; tune keeps no frozen copy of the routers for that"
                ),
            )
            .with_fix("set `train_router: False`, which keeps the routers frozen, or train them with lora_finetune_single_device"),
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
    if m.num_classes.is_some() && m.component.size != "classifier" {
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
