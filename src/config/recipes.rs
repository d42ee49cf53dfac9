//! Recipe names. `tune` has short canonical names; torchtune's `*_single_device` and
//! `*_distributed` names (with or without `.py`) are accepted as aliases. A distributed recipe
//! is its single-device recipe run by several data-parallel workers, so both names lead to
//! one [`Recipe`]; [`is_distributed_name`] tells which was asked for.

use std::fmt;

use crate::config::suggest;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Recipe {
    FullFinetune,
    LoraFinetune,
    LoraDpo,
    FullDpo,
    Qat,
    QatLora,
    KnowledgeDistillation,
    GrpoFull,
    GrpoLora,
    PpoFull,
    Generate,
}

pub struct RecipeInfo {
    pub recipe: Recipe,
    pub name: &'static str,
    pub aliases: &'static [&'static str],
    /// torchtune's `*_distributed` name, for recipes that train.
    pub distributed: Option<&'static str>,
    pub description: &'static str,
}

static FULL_FINETUNE: RecipeInfo = RecipeInfo {
    recipe: Recipe::FullFinetune,
    name: "full_finetune",
    aliases: &["full_finetune_single_device"],
    distributed: Some("full_finetune_distributed"),
    description: "Full fine-tuning of every weight (SFT)",
};

static LORA_FINETUNE: RecipeInfo = RecipeInfo {
    recipe: Recipe::LoraFinetune,
    name: "lora_finetune",
    aliases: &["lora_finetune_single_device"],
    distributed: Some("lora_finetune_distributed"),
    description: "LoRA fine-tuning: frozen base, trainable low-rank adapters (SFT)",
};

static LORA_DPO: RecipeInfo = RecipeInfo {
    recipe: Recipe::LoraDpo,
    name: "lora_dpo",
    aliases: &["lora_dpo_single_device"],
    distributed: Some("lora_dpo_distributed"),
    description: "DPO preference alignment with LoRA (reference = adapters disabled)",
};

static FULL_DPO: RecipeInfo = RecipeInfo {
    recipe: Recipe::FullDpo,
    name: "full_dpo",
    aliases: &["full_dpo_single_device"],
    distributed: Some("full_dpo_distributed"),
    description: "DPO preference alignment of every weight against a frozen reference",
};

static QAT: RecipeInfo = RecipeInfo {
    recipe: Recipe::Qat,
    name: "qat",
    aliases: &["qat_single_device"],
    distributed: Some("qat_distributed"),
    description: "Quantization-aware full fine-tuning (fake-quantized int4/int8)",
};

static QAT_LORA: RecipeInfo = RecipeInfo {
    recipe: Recipe::QatLora,
    name: "qat_lora",
    aliases: &["qat_lora_finetune_single_device"],
    distributed: Some("qat_lora_finetune_distributed"),
    description: "Quantization-aware LoRA fine-tuning",
};

static KNOWLEDGE_DISTILLATION: RecipeInfo = RecipeInfo {
    recipe: Recipe::KnowledgeDistillation,
    name: "knowledge_distillation",
    aliases: &[
        "knowledge_distillation_single_device",
        "kd_single_device",
        "kd",
    ],
    distributed: Some("knowledge_distillation_distributed"),
    description: "Knowledge distillation from a frozen teacher into a (LoRA) student",
};

static GRPO_FULL: RecipeInfo = RecipeInfo {
    recipe: Recipe::GrpoFull,
    name: "grpo_full_finetune",
    // torchtune's GRPO recipe is a dev recipe, run as `dev/grpo_full_finetune_distributed`.
    aliases: &[
        "grpo_full_finetune_single_device",
        "dev/grpo_full_finetune_distributed",
    ],
    distributed: Some("grpo_full_finetune_distributed"),
    description: "GRPO: reinforcement learning from rewards on sampled completions, every weight",
};

static GRPO_LORA: RecipeInfo = RecipeInfo {
    recipe: Recipe::GrpoLora,
    name: "grpo_lora_finetune",
    aliases: &["grpo_lora_finetune_single_device"],
    distributed: Some("grpo_lora_finetune_distributed"),
    description: "GRPO with LoRA (reference = adapters disabled)",
};

static PPO_FULL: RecipeInfo = RecipeInfo {
    recipe: Recipe::PpoFull,
    name: "ppo_full_finetune",
    aliases: &["ppo_full_finetune_single_device"],
    // torchtune has PPO on one device only.
    distributed: None,
    description: "PPO (RLHF): the policy trains on a reward model's scores, with a value model and a KL penalty against a frozen reference",
};

static GENERATE: RecipeInfo = RecipeInfo {
    recipe: Recipe::Generate,
    name: "generate",
    aliases: &[],
    distributed: None,
    description: "Text generation from a checkpoint (optionally with a LoRA adapter)",
};

/// Every recipe, in `tune ls` order.
pub static RECIPES: &[&RecipeInfo] = &[
    &FULL_FINETUNE,
    &LORA_FINETUNE,
    &LORA_DPO,
    &FULL_DPO,
    &QAT,
    &QAT_LORA,
    &KNOWLEDGE_DISTILLATION,
    &GRPO_FULL,
    &GRPO_LORA,
    &PPO_FULL,
    &GENERATE,
];

impl Recipe {
    pub fn info(self) -> &'static RecipeInfo {
        match self {
            Self::FullFinetune => &FULL_FINETUNE,
            Self::LoraFinetune => &LORA_FINETUNE,
            Self::LoraDpo => &LORA_DPO,
            Self::FullDpo => &FULL_DPO,
            Self::Qat => &QAT,
            Self::QatLora => &QAT_LORA,
            Self::KnowledgeDistillation => &KNOWLEDGE_DISTILLATION,
            Self::GrpoFull => &GRPO_FULL,
            Self::GrpoLora => &GRPO_LORA,
            Self::PpoFull => &PPO_FULL,
            Self::Generate => &GENERATE,
        }
    }

    pub fn name(self) -> &'static str {
        self.info().name
    }

    /// torchtune's script name for this recipe (used in config header comments).
    pub fn torchtune_name(self) -> &'static str {
        self.info().aliases.first().copied().unwrap_or(self.name())
    }

    /// torchtune's script name for this recipe with `distributed` workers or on one device.
    pub fn script_name(self, distributed: bool) -> &'static str {
        match (distributed, self.info().distributed) {
            (true, Some(name)) => name,
            _ => self.torchtune_name(),
        }
    }

    pub fn is_training(self) -> bool {
        self != Self::Generate
    }

    /// Recipes whose `model` must be a LoRA builder.
    pub fn needs_lora(self) -> Option<bool> {
        match self {
            Self::LoraFinetune | Self::LoraDpo | Self::QatLora | Self::GrpoLora => Some(true),
            Self::FullFinetune | Self::FullDpo | Self::Qat | Self::GrpoFull | Self::PpoFull => {
                Some(false)
            }
            Self::KnowledgeDistillation | Self::Generate => None,
        }
    }

    pub fn is_dpo(self) -> bool {
        matches!(self, Self::LoraDpo | Self::FullDpo)
    }

    /// The reinforcement-learning recipes: they generate from prompts and train on rewards.
    pub fn is_grpo(self) -> bool {
        matches!(self, Self::GrpoFull | Self::GrpoLora)
    }

    /// PPO: a policy, a value model, a reward model and a reference (`policy_model` and
    /// `reward_and_value_model` in place of `model`).
    pub fn is_ppo(self) -> bool {
        self == Self::PpoFull
    }

    /// The recipes that generate from prompts: GRPO's and PPO's.
    pub fn generates(self) -> bool {
        self.is_grpo() || self.is_ppo()
    }

    pub fn is_qat(self) -> bool {
        matches!(self, Self::Qat | Self::QatLora)
    }
}

impl fmt::Display for Recipe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown recipe `{name}`{hint}; known recipes: {known}")]
pub struct UnknownRecipe {
    pub name: String,
    pub hint: String,
    pub known: String,
}

/// Finds a recipe by canonical name or torchtune alias; a `.py` suffix is ignored.
pub fn find(name: &str) -> Result<Recipe, UnknownRecipe> {
    let bare = name.trim().trim_end_matches(".py");
    if let Some(info) = RECIPES
        .iter()
        .find(|r| r.name == bare || r.aliases.contains(&bare) || r.distributed == Some(bare))
    {
        return Ok(info.recipe);
    }
    let all = RECIPES.iter().flat_map(|r| {
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
        known: RECIPES
            .iter()
            .map(|r| r.name)
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// Whether `name` is one of torchtune's `*_distributed` recipe names (its dev recipe
/// `dev/grpo_full_finetune_distributed` included).
pub fn is_distributed_name(name: &str) -> bool {
    let bare = name.trim().trim_end_matches(".py");
    RECIPES.iter().any(|r| {
        r.distributed == Some(bare) || (bare.ends_with("_distributed") && r.aliases.contains(&bare))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases_and_py_suffix() {
        assert_eq!(find("lora_finetune"), Ok(Recipe::LoraFinetune));
        assert_eq!(
            find("lora_finetune_single_device"),
            Ok(Recipe::LoraFinetune)
        );
        assert_eq!(
            find("lora_finetune_single_device.py"),
            Ok(Recipe::LoraFinetune)
        );
        assert_eq!(
            find("knowledge_distillation_single_device"),
            Ok(Recipe::KnowledgeDistillation)
        );
        assert_eq!(
            Recipe::QatLora.torchtune_name(),
            "qat_lora_finetune_single_device"
        );
        assert_eq!(find("lora_finetune_distributed"), Ok(Recipe::LoraFinetune));
        assert_eq!(
            find("knowledge_distillation_distributed.py"),
            Ok(Recipe::KnowledgeDistillation)
        );
        assert!(is_distributed_name("full_dpo_distributed"));
        assert!(!is_distributed_name("full_dpo_single_device"));
        assert_eq!(Recipe::Qat.script_name(true), "qat_distributed");
        assert_eq!(Recipe::Generate.script_name(true), "generate");
        // torchtune's GRPO recipe is a dev recipe, distributed by name.
        assert_eq!(
            find("dev/grpo_full_finetune_distributed"),
            Ok(Recipe::GrpoFull)
        );
        assert!(is_distributed_name("dev/grpo_full_finetune_distributed.py"));
        assert!(!is_distributed_name("grpo_full_finetune_single_device"));
    }

    #[test]
    fn unknown_lists_known() {
        let err = find("lora_finetun").unwrap_err().to_string();
        assert!(
            err.starts_with("unknown recipe `lora_finetun` (did you mean"),
            "{err}"
        );
        assert!(
            err.contains("known recipes: full_finetune, lora_finetune"),
            "{err}"
        );
    }
}
