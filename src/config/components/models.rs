//! Model builder names are parsed rather than listed: `<ns>.models.<family>.[lora_|qlora_]<family>_<size>`.
//! The size is only a hint: the architecture always comes from the checkpoint's config.json.

use super::{Component, Lookup};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFamily {
    Llama2,
    Llama3,
    Llama3_1,
    Llama3_2,
    Qwen2,
    Qwen2_5,
    Qwen3,
    Mistral,
    Phi3,
    /// Phi-4's checkpoints are the Phi-3 architecture (`Phi3ForCausalLM`).
    Phi4,
    Gemma,
    Gemma2,
    /// Not a torchtune module (torchtune has no Gemma 3); `tune.models.gemma3.*` names it.
    Gemma3,
    Llama3_3,
    SmolLM2,
    /// Not a torchtune module (torchtune has no SmolLM3); `tune.models.smollm3.*` names it.
    SmolLM3,
    /// Not torchtune modules (torchtune has no mixture-of-experts models):
    /// `tune.models.qwen3_moe.*`, `tune.models.qwen2_moe.*`, `tune.models.mixtral.*`.
    Qwen3Moe,
    Qwen2Moe,
    Mixtral,
    /// Not a torchtune module: `tune.models.gpt_oss.*`.
    GptOss,
    /// Not a torchtune module (torchtune has no Qwen2-VL): `tune.models.qwen2_vl.*`, the
    /// language model with its vision tower.
    Qwen2Vl,
}

/// (family, module name, sizes torchtune ships — used only for suggestions).
const FAMILIES: &[(ModelFamily, &str, &[&str])] = &[
    (ModelFamily::Llama2, "llama2", &["7b", "13b", "70b"]),
    (ModelFamily::Llama3, "llama3", &["8b", "70b"]),
    (ModelFamily::Llama3_1, "llama3_1", &["8b", "70b", "405b"]),
    (ModelFamily::Llama3_2, "llama3_2", &["1b", "3b"]),
    (ModelFamily::Qwen2, "qwen2", &["0_5b", "1_5b", "7b"]),
    (
        ModelFamily::Qwen2_5,
        "qwen2_5",
        &[
            "0_5b",
            "1_5b_instruct",
            "1_5b_base",
            "3b",
            "7b_instruct",
            "7b_base",
            "14b_instruct",
        ],
    ),
    (
        ModelFamily::Qwen3,
        "qwen3",
        &[
            "0_6b_instruct",
            "0_6b_base",
            "1_7b_instruct",
            "4b_instruct",
            "8b_instruct",
        ],
    ),
    (ModelFamily::Mistral, "mistral", &["7b"]),
    (ModelFamily::Phi3, "phi3", &["mini"]),
    (ModelFamily::Phi4, "phi4", &["14b"]),
    (ModelFamily::Gemma, "gemma", &["2b", "7b"]),
    (ModelFamily::Gemma2, "gemma2", &["2b", "9b", "27b"]),
    (ModelFamily::Gemma3, "gemma3", &["1b", "4b", "12b", "27b"]),
    (ModelFamily::Llama3_3, "llama3_3", &["70b"]),
    (ModelFamily::SmolLM2, "smollm2", &["135m", "360m", "1_7b"]),
    (ModelFamily::SmolLM3, "smollm3", &["3b"]),
    (
        ModelFamily::Qwen3Moe,
        "qwen3_moe",
        &["30b_a3b", "235b_a22b"],
    ),
    (ModelFamily::Qwen2Moe, "qwen2_moe", &["a2_7b", "57b_a14b"]),
    (ModelFamily::Mixtral, "mixtral", &["8x7b", "8x22b"]),
    (ModelFamily::GptOss, "gpt_oss", &["20b", "120b"]),
    (ModelFamily::Qwen2Vl, "qwen2_vl", &["2b", "7b", "72b"]),
];

impl ModelFamily {
    pub fn module(self) -> &'static str {
        FAMILIES
            .iter()
            .find(|(f, _, _)| *f == self)
            .map_or("?", |(_, m, _)| m)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelVariant {
    Full,
    Lora,
    /// LoRA over a 4-bit base in torchtune; here the base stays in `dtype` (warned).
    QLora,
}

impl ModelVariant {
    fn prefix(self) -> &'static str {
        match self {
            Self::Full => "",
            Self::Lora => "lora_",
            Self::QLora => "qlora_",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelBuilder {
    pub family: ModelFamily,
    pub variant: ModelVariant,
    /// Size hint from the name (`1b`, `0_5b`, `mini`, `tiny`); informational only.
    pub size: String,
}

impl ModelBuilder {
    pub fn canonical_name(&self) -> String {
        let m = self.family.module();
        if self.size == GENERIC {
            return format!("tune.models.{m}.{}{m}", self.variant.prefix());
        }
        format!("tune.models.{m}.{}{m}_{}", self.variant.prefix(), self.size)
    }

    pub fn is_lora(&self) -> bool {
        self.variant != ModelVariant::Full
    }
}

pub(super) fn parse(name: &str) -> Option<Lookup> {
    let rest = name
        .strip_prefix("torchtune.models.")
        .or_else(|| name.strip_prefix("tune.models."))?;
    let (module, builder) = rest.split_once('.')?;
    let (variant, body) = [ModelVariant::QLora, ModelVariant::Lora]
        .into_iter()
        .find_map(|v| builder.strip_prefix(v.prefix()).map(|b| (v, b)))
        .unwrap_or((ModelVariant::Full, builder));
    // torchtune's generic builders (`torchtune.models.llama2.llama2`, `lora_llama2`) take the
    // architecture as arguments; tune reads it from config.json and checks the two agree.
    if let Some((family, _, _)) = FAMILIES.iter().find(|(_, m, _)| *m == body && *m == module) {
        let builder = ModelBuilder {
            family: *family,
            variant,
            size: GENERIC.to_string(),
        };
        return Some(Lookup {
            canonical: format!("tune.models.{module}.{}{module}", variant.prefix()),
            component: Component::Model(builder),
            warning: None,
        });
    }
    // Longest family prefix wins so `llama3_2_1b` is llama3_2, not llama3 size `2_1b`.
    let (family, fam_module, _) = FAMILIES
        .iter()
        .filter(|(_, m, _)| body.strip_prefix(m).is_some_and(|r| r.starts_with('_')))
        .max_by_key(|(_, m, _)| m.len())?;
    if *fam_module != module {
        return None;
    }
    let size = &body[fam_module.len() + 1..];
    let valid_size = !size.is_empty()
        && !size.contains("vision")
        && size.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !valid_size || size.ends_with("tokenizer") {
        return None;
    }
    let builder = ModelBuilder {
        family: *family,
        variant,
        size: size.to_string(),
    };
    Some(Lookup {
        canonical: builder.canonical_name(),
        component: Component::Model(builder),
        warning: None,
    })
}

/// The size of a generic builder (`llama2`, `lora_qwen2`): its architecture is in the section.
pub const GENERIC: &str = "generic";

/// torchtune and tune names for every family/variant/size we know, for suggestions.
pub(super) fn example_names() -> Vec<String> {
    let mut out = Vec::new();
    for (_, m, sizes) in FAMILIES {
        for size in sizes.iter().chain(&["tiny"]) {
            for prefix in ["", "lora_", "qlora_"] {
                out.push(format!("tune.models.{m}.{prefix}{m}_{size}"));
                if *size != "tiny" {
                    out.push(format!("torchtune.models.{m}.{prefix}{m}_{size}"));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builder(name: &str) -> ModelBuilder {
        match parse(name).map(|l| l.component) {
            Some(Component::Model(b)) => b,
            other => panic!("{name}: {other:?}"),
        }
    }

    #[test]
    fn parses_families_and_variants() {
        let b = builder("torchtune.models.llama3_2.lora_llama3_2_1b");
        assert_eq!(
            (b.family, b.variant, b.size.as_str()),
            (ModelFamily::Llama3_2, ModelVariant::Lora, "1b")
        );
        let b = builder("torchtune.models.qwen2_5.qwen2_5_1_5b_instruct");
        assert_eq!(
            (b.family, b.size.as_str()),
            (ModelFamily::Qwen2_5, "1_5b_instruct")
        );
        assert_eq!(
            builder("torchtune.models.phi3.lora_phi3_mini").family,
            ModelFamily::Phi3
        );
        assert_eq!(
            builder("tune.models.smollm2.lora_smollm2_135m").family,
            ModelFamily::SmolLM2
        );
        assert_eq!(builder("tune.models.llama3.lora_llama3_tiny").size, "tiny");
        // the longest family name wins: qwen3_moe, not qwen3 of size `moe_30b_a3b`
        let b = builder("tune.models.qwen3_moe.lora_qwen3_moe_30b_a3b");
        assert_eq!(
            (b.family, b.variant, b.size.as_str()),
            (ModelFamily::Qwen3Moe, ModelVariant::Lora, "30b_a3b")
        );
        assert_eq!(
            builder("tune.models.mixtral.qlora_mixtral_8x7b").family,
            ModelFamily::Mixtral
        );
        assert_eq!(
            builder("torchtune.models.llama3.qlora_llama3_8b").variant,
            ModelVariant::QLora
        );
        assert!(
            parse("torchtune.models.llama3.qlora_llama3_8b")
                .unwrap()
                .warning
                .is_none(),
            "QLoRA is supported: no warning"
        );
    }

    #[test]
    fn rejects_mismatches() {
        assert!(parse("torchtune.models.llama3.llama3_2_1b").is_none());
        assert!(parse("torchtune.models.llama3.llama3_tokenizer").is_none());
        assert!(parse("torchtune.models.llama3_2.llama3_2_vision_11b").is_none());
        assert!(parse("torchtune.models.falcon.falcon_7b").is_none());
        assert!(parse("torchtune.models.llama3.llama3_").is_none());
    }
}
