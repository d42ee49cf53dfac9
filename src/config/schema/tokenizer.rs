//! `tokenizer`: the vocabulary (a Hugging Face tokenizer.json), the message format its
//! component writes, and the prompt template.

use std::path::{Path, PathBuf};

use serde::{Serialize, Serializer};
use serde_yaml::Value;

use crate::config::components::TokenizerKind;
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{
    Checker, ConfigValue, Fingerprint, FingerprintEntries, Ty, default, join, keys, optional,
};
use crate::config::paths;
use crate::config::values::choices;
use crate::tokenizer::PromptTemplate;

/// Which end of a too-long sample is cut (torchtune main's `truncation_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TruncationType {
    /// Keep the last `max_seq_len` tokens.
    Left,
    /// Keep the first `max_seq_len` tokens (torchtune's default).
    Right,
}

choices!(TruncationType {
    "left" => TruncationType::Left,
    "right" => TruncationType::Right,
});

/// `tokenizer.prompt_template` as the config gives it.
#[derive(Debug, Clone, PartialEq)]
pub enum TemplateChoice {
    /// Left out: the component's default (Llama2ChatTemplate for `llama2_tokenizer`,
    /// MistralChatTemplate for `mistral_tokenizer`, none otherwise).
    ComponentDefault,
    /// `null`: no template.
    Off,
    /// A template tune knows, and the YAML that named it.
    Given {
        template: PromptTemplate,
        written: Value,
    },
}

impl ConfigValue for TemplateChoice {
    const TY: &'static Ty = &Ty::Nullable(&Ty::Any);

    fn read(value: &Value, path: &str, cx: &mut Checker) -> Option<Self> {
        if value.is_null() {
            return Some(Self::Off);
        }
        let parsed = serde_json::to_value(value)
            .map_err(|e| e.to_string())
            .and_then(|json| PromptTemplate::from_value(&json).map_err(|e| e.to_string()));
        match parsed {
            Ok(template) => Some(Self::Given {
                template,
                written: value.clone(),
            }),
            Err(message) => {
                cx.problem(
                    Problem::new(ProblemKind::InvalidValue, path, message).with_fix(
                        "name a built-in template or give a mapping {role: [prefix, suffix]}",
                    ),
                );
                None
            }
        }
    }

    /// Left out, it is absent from the fingerprint, as the YAML has it.
    fn fingerprint(&self, path: &str, mode: Fingerprint, out: &mut FingerprintEntries) {
        if mode != Fingerprint::Inherit && *self != Self::ComponentDefault {
            out.insert(path, mode, serde_json::to_value(self).unwrap_or_default());
        }
    }
}

impl Serialize for TemplateChoice {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::ComponentDefault | Self::Off => s.serialize_none(),
            Self::Given { written, .. } => written.serialize(s),
        }
    }
}

keys! {
    /// The tokenizer: its vocabulary is the model's tokenizer.json; the component picks the
    /// message format (torchtune's, or the checkpoint's chat template) and the prompt template.
    pub struct TokenizerConfig {
        section: "tokenizer",
        component: TokenizerKind,
        rule: tokenizer_rules,
    }
    /// The tokenizer.json, or a file beside it (torchtune's `original/tokenizer.model`).
    path: Option<PathBuf> = optional(),
    /// Phi-4's vocab.json (the tokenizer.json beside it is read).
    vocab_path: Option<PathBuf> = optional(),
    /// Phi-4's (and Qwen's) merges.txt: the tokenizer.json tune reads holds the merges, which
    /// must be this file's (checked when the tokenizer loads).
    merges_path: Option<PathBuf> = optional(),
    /// Another spelling of `merges_path` (torchtune's Qwen tokenizers').
    merges_file: Option<PathBuf> = optional(),
    /// Samples are cut to this many tokens (null: the model's positions).
    max_seq_len: Option<usize> = optional().range(|v| v >= 2.0, "at least 2, or null for no limit"),
    /// The prompt template: a built-in's torchtune name, `{role: [prefix, suffix]}`, or null.
    prompt_template: TemplateChoice = default(|| TemplateChoice::ComponentDefault),
    /// A tokenizer.json whose `added_tokens` must give the special tokens the model's ids.
    special_tokens_path: Option<PathBuf> = optional(),
    /// Which end of a too-long sample is cut (default right).
    truncation_type: Option<TruncationType> = optional(),
    /// HuggingFaceModelTokenizer's tokenizer.json.
    tokenizer_json_path: Option<PathBuf> = optional(),
    /// HuggingFaceModelTokenizer's tokenizer_config.json (default: beside the tokenizer.json).
    tokenizer_config_json_path: Option<PathBuf> = optional(),
    /// HuggingFaceModelTokenizer's generation_config.json (default: beside the tokenizer.json).
    generation_config_path: Option<PathBuf> = optional(),
}

impl TokenizerConfig {
    /// What points at the vocabulary and its key: `path`, `tokenizer_json_path` or
    /// `vocab_path` (validation requires one).
    pub fn location(&self) -> Option<(&'static str, &Path)> {
        [
            ("tokenizer.path", &self.path),
            ("tokenizer.tokenizer_json_path", &self.tokenizer_json_path),
            ("tokenizer.vocab_path", &self.vocab_path),
        ]
        .into_iter()
        .find_map(|(key, p)| p.as_deref().map(|p| (key, p)))
    }

    /// The components that format with the checkpoint's chat template.
    pub fn uses_chat_template(&self) -> bool {
        matches!(
            self.component,
            TokenizerKind::HuggingFace | TokenizerKind::SmolLM2
        )
    }

    /// The template that wraps each message: the configured one, or the component's default.
    pub fn prompt_template(&self) -> Option<PromptTemplate> {
        match &self.prompt_template {
            TemplateChoice::ComponentDefault => match self.component {
                TokenizerKind::Llama2 => Some(PromptTemplate::Llama2Chat),
                TokenizerKind::Mistral => Some(PromptTemplate::MistralChat),
                _ => None,
            },
            TemplateChoice::Off => None,
            TemplateChoice::Given { template, .. } => Some(template.clone()),
        }
    }
}

/// The vocabulary must be named, a prompt template needs a torchtune component to wrap
/// messages, and the files must exist.
fn tokenizer_rules(t: &TokenizerConfig, path: &str, cx: &mut Checker) {
    if t.location().is_none() {
        cx.problem(
            Problem::new(
                ProblemKind::MissingKey,
                join(path, "path"),
                "missing: the tokenizer needs `path` (or Phi-4's `vocab_path`)",
            )
            .with_fix("point `tokenizer.path` at the model's tokenizer.json"),
        );
    }
    if t.uses_chat_template() && matches!(t.prompt_template, TemplateChoice::Given { .. }) {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                join(path, "prompt_template"),
                "this tokenizer component formats with the checkpoint's chat template, which a prompt template cannot wrap",
            )
            .with_fix("remove `prompt_template`, or name a torchtune tokenizer component (e.g. torchtune.models.llama3.llama3_tokenizer)"),
        );
    }
    if !cx.check_paths {
        return;
    }
    for (key, file) in [
        ("tokenizer_config_json_path", &t.tokenizer_config_json_path),
        ("generation_config_path", &t.generation_config_path),
    ] {
        if let Some(file) = file {
            let shown = file.display().to_string();
            paths::require(
                file.is_file(),
                cx,
                &join(path, key),
                "file",
                &shown,
                "a JSON file",
            );
        }
    }
    if let Some((key, location)) = t.location() {
        let shown = location.display();
        match paths::resolve_tokenizer_json(location) {
            Ok(found) if found != location && !location.is_dir() => cx.warn(
                key,
                format!(
                    "`{shown}` is not a tokenizer.json; using {}",
                    found.display()
                ),
            ),
            Ok(_) => {}
            Err(e) => cx.problem(
                Problem::new(ProblemKind::MissingPath, key, e.to_string())
                    .with_fix(format!("point `{key}` at the model's tokenizer.json")),
            ),
        }
    }
}
