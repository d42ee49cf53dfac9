//! Built-in configs, embedded at compile time from `configs/` (paths are relative to
//! this file so the same code works in this crate and in the main repo).

use crate::config::recipes::Recipe;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuiltinConfig {
    /// `<family>/<name>` without `.yaml`, e.g. `llama3_2/1B_lora_single_device`.
    pub name: &'static str,
    pub recipe: Recipe,
    /// A config for the recipe's `*_distributed` script (torchtune's multi-device configs).
    pub distributed: bool,
    pub yaml: &'static str,
}

macro_rules! builtin {
    ($name:literal, $recipe:ident) => {
        BuiltinConfig {
            name: $name,
            recipe: Recipe::$recipe,
            distributed: false,
            yaml: include_str!(concat!("../../configs/", $name, ".yaml")),
        }
    };
    ($name:literal, $recipe:ident, distributed) => {
        BuiltinConfig {
            name: $name,
            recipe: Recipe::$recipe,
            distributed: true,
            yaml: include_str!(concat!("../../configs/", $name, ".yaml")),
        }
    };
}

static BUILTINS: &[BuiltinConfig] = &[
    builtin!("gemma/2B_lora_single_device", LoraFinetune),
    builtin!("gemma/2B_qlora_single_device", LoraFinetune),
    builtin!("gemma3/4B_lora_single_device", LoraFinetune),
    builtin!("generation", Generate),
    builtin!("gpt_oss/20B_lora_single_device", LoraFinetune),
    builtin!("llama3/8B_qat_full", Qat, distributed),
    builtin!("llama3/8B_qat_lora", QatLora, distributed),
    builtin!("llama3_1/8B_full", FullFinetune, distributed),
    builtin!("llama3_1/8B_full_dpo", FullDpo, distributed),
    builtin!("llama3_1/8B_lora", LoraFinetune, distributed),
    builtin!("llama3_1/8B_lora_dpo", LoraDpo, distributed),
    builtin!("llama3_1/8B_lora_dpo_single_device", LoraDpo),
    builtin!("llama3_1/8B_lora_single_device", LoraFinetune),
    builtin!("llama3_1/8B_qlora_single_device", LoraFinetune),
    builtin!("llama3_2/1B_full", FullFinetune, distributed),
    builtin!("llama3_2/1B_full_single_device", FullFinetune),
    builtin!("llama3_2/1B_lora", LoraFinetune, distributed),
    builtin!("llama3_2/1B_lora_single_device", LoraFinetune),
    builtin!("llama3_2/1B_qat_lora", QatLora, distributed),
    builtin!("llama3_2/1B_qlora_single_device", LoraFinetune),
    builtin!("llama3_2/3B_lora_single_device", LoraFinetune),
    builtin!("llama3_2/3B_qlora_single_device", LoraFinetune),
    builtin!(
        "llama3_2/8B_to_1B_KD_lora_distributed",
        KnowledgeDistillation,
        distributed
    ),
    builtin!(
        "llama3_2/8B_to_1B_KD_lora_single_device",
        KnowledgeDistillation
    ),
    builtin!("mistral/7B_lora_single_device", LoraFinetune),
    builtin!("mistral/7B_qlora_single_device", LoraFinetune),
    builtin!("mixtral/8x7B_qlora_single_device", LoraFinetune),
    builtin!("phi3/mini_lora_single_device", LoraFinetune),
    builtin!("phi3/mini_qlora_single_device", LoraFinetune),
    builtin!(
        "qwen2/1.5_to_0.5B_KD_lora_distributed",
        KnowledgeDistillation,
        distributed
    ),
    builtin!(
        "qwen2/1.5_to_0.5B_KD_lora_single_device",
        KnowledgeDistillation
    ),
    builtin!("qwen2_5/0.5B_full_single_device", FullFinetune),
    builtin!("qwen2_5/0.5B_lora_single_device", LoraFinetune),
    builtin!("qwen2_5/1.5B_lora_single_device", LoraFinetune),
    builtin!("qwen2_5/7B_lora", LoraFinetune, distributed),
    builtin!("qwen3_moe/30B_A3B_lora", LoraFinetune, distributed),
    builtin!("qwen3_moe/30B_A3B_qlora_single_device", LoraFinetune),
    builtin!("smollm2/135M_full_single_device", FullFinetune),
    builtin!("smollm2/135M_grpo_lora_single_device", GrpoLora),
    builtin!("smollm2/135M_lora_single_device", LoraFinetune),
    builtin!("smollm3/3B_lora_single_device", LoraFinetune),
    builtin!("tiny/full", FullFinetune, distributed),
    builtin!("tiny/full_dpo", FullDpo, distributed),
    builtin!("tiny/full_dpo_single_device", FullDpo),
    builtin!("tiny/full_single_device", FullFinetune),
    builtin!("tiny/generation", Generate),
    builtin!("tiny/grpo_full", GrpoFull, distributed),
    builtin!("tiny/grpo_full_single_device", GrpoFull),
    builtin!("tiny/grpo_lora", GrpoLora, distributed),
    builtin!("tiny/grpo_lora_single_device", GrpoLora),
    builtin!(
        "tiny/kd_lora_distributed",
        KnowledgeDistillation,
        distributed
    ),
    builtin!("tiny/kd_lora_single_device", KnowledgeDistillation),
    builtin!("tiny/lora", LoraFinetune, distributed),
    builtin!("tiny/lora_dpo", LoraDpo, distributed),
    builtin!("tiny/lora_dpo_single_device", LoraDpo),
    builtin!("tiny/lora_single_device", LoraFinetune),
    builtin!("tiny/ppo_full_single_device", PpoFull),
    builtin!("tiny/qat_full", Qat, distributed),
    builtin!("tiny/qat_lora", QatLora, distributed),
    builtin!("tiny/qat_lora_single_device", QatLora),
    builtin!("tiny/qat_single_device", Qat),
];

/// Every built-in config, sorted by name.
pub fn list() -> Vec<BuiltinConfig> {
    BUILTINS.to_vec()
}

/// A built-in config by name; a trailing `.yaml` is ignored.
pub fn get(name: &str) -> Option<BuiltinConfig> {
    let bare = name.trim().trim_end_matches(".yaml");
    BUILTINS.iter().find(|b| b.name == bare).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorted_unique_and_headed() {
        let names: Vec<&str> = BUILTINS.iter().map(|b| b.name).collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(names, sorted);
        for b in BUILTINS {
            // Like torchtune, the first line says which recipe the config is for.
            let first = b.yaml.lines().next().unwrap_or_default();
            assert!(
                first.starts_with("# Config for")
                    && first.contains(b.recipe.script_name(b.distributed)),
                "{}: first line `{first}` must name {}",
                b.name,
                b.recipe.script_name(b.distributed)
            );
        }
        assert_eq!(
            get("tiny/generation.yaml").map(|b| b.recipe),
            Some(Recipe::Generate)
        );
    }
}
