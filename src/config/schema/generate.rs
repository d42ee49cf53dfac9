//! The `generate` recipe's keys.

use std::path::PathBuf;

use serde::Serialize;
use serde_yaml::Value;

use super::{CheckpointerConfig, Device, ModelConfig, QuantizerConfig, Sampling, TokenizerConfig};
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{
    Checker, ConfigValue, Ty, default, group, keys, off, on, optional, required,
};
use crate::config::paths;
use crate::precision::Dtype;
use crate::verbosity::LogLevel;

keys! {
    /// The prompt's turns.
    pub struct PromptTurns {
        section: "prompt",
    }
    /// The system message.
    system: Option<String> = optional(),
    /// The user message.
    user: String = required(),
}

/// `prompt:` a string (the user turn) or `{system, user}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prompt {
    pub system: Option<String>,
    pub user: String,
}

impl ConfigValue for Prompt {
    const TY: &'static Ty = &Ty::Either(&Ty::Str, PromptTurns::TY);
    fn read(value: &Value, path: &str, cx: &mut Checker) -> Option<Self> {
        match value {
            Value::String(user) => Some(Prompt {
                system: None,
                user: user.clone(),
            }),
            turns => cx.value::<PromptTurns>(turns, path).map(|t| Prompt {
                system: t.system,
                user: t.user,
            }),
        }
    }
}

keys! {
    /// The generate recipe: text from a checkpoint (optionally with a PEFT adapter).
    pub struct GenerateConfig {
        rule: prompt_rules,
    }
    /// The model's builder.
    model: ModelConfig = required(),
    /// The checkpoint to generate from.
    checkpointer: CheckpointerConfig = required(),
    /// Its tokenizer.
    tokenizer: TokenizerConfig = required(),
    /// torchtune's generation configs set it (for `${output_dir}` in other keys); generation
    /// writes no files.
    output_dir: Option<PathBuf> = optional().validation_only("generation writes no files"),
    /// `cpu`, `cuda` or `wgpu` (null: CUDA in a CUDA build, else the CPU).
    device: Option<Device> = optional(),
    /// The float precision to compute in.
    dtype: Dtype = default(Dtype::default),
    /// Seeds sampling (null: a random seed).
    seed: Option<u64> = optional(),
    /// How much tune says on stderr: `DEBUG`, `INFO` (null), `WARN` or `ERROR`.
    log_level: Option<LogLevel> = optional(),
    /// The prompt: the user turn, or `{system, user}`.
    prompt: Prompt = required(),
    /// Format the prompt with the tokenizer's chat template.
    chat: bool = off(),
    /// Stop after this many new tokens.
    max_new_tokens: usize = default(|| 300).range(|v| v >= 1.0, "at least 1"),
    /// Sampling temperature (0: greedy).
    temperature: f64 = default(|| 0.6).range(
        |v| v >= 0.0 && v.is_finite(),
        "0 (greedy) or greater",
    ),
    /// Which tokens it samples among.
    #[serde(flatten)]
    sampling: Sampling = group(),
    /// Stop at the end-of-sequence token.
    stop_at_eos: bool = on(),
    /// A PEFT adapter directory applied on top of the checkpoint.
    adapter_dir: Option<PathBuf> = optional().rule(adapter_exists),
    /// Decode with the KV cache.
    enable_kv_cache: bool = on(),
    /// Quantized generation: only null.
    quantizer: Option<QuantizerConfig> = optional().refuse(
        "quantized generation is not supported, and generating in `dtype` instead would not be the model asked for; set `quantizer: null` (a QAT run's int4 export is in its checkpoint's quantized/ folder)",
    ),
    /// An old torchtune key: only null.
    instruct_template: Option<String> = optional().refuse(
        "an old torchtune key tune cannot honour; format the prompt with `tokenizer.prompt_template`, or the checkpoint's chat template (`chat: True` with the HuggingFaceModelTokenizer component), and set `instruct_template: null`",
    ),
    /// An old torchtune key: only null.
    chat_format: Option<String> = optional().refuse(
        "an old torchtune key tune cannot honour; the tokenizer component sets the format (or `chat: True` with the HuggingFaceModelTokenizer component for the chat template); set `chat_format: null`",
    ),
}

/// The chat template formats the prompt only for the components that write it; the others
/// format it as torchtune's tokenizers do, and only there does a system prompt without the
/// template reach the model.
fn prompt_rules(g: &GenerateConfig, _: &str, cx: &mut Checker) {
    let template = g.tokenizer.uses_chat_template();
    if g.chat && !template {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "chat",
                "True formats the prompt with the checkpoint's chat template, but `tokenizer._component_` names a torchtune tokenizer, which formats it as torchtune does",
            )
            .with_fix("drop `chat`, or set `tokenizer._component_: torchtune.modules.transforms.tokenizers.HuggingFaceModelTokenizer` to use the chat template"),
        );
    }
    if template && !g.chat && g.prompt.system.is_some() {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "prompt.system",
                "a system prompt needs the chat template here (the user prompt is plain text without it)",
            )
            .with_fix("set `chat: True`, or remove `prompt.system`"),
        );
    }
}

fn adapter_exists(dir: &Option<PathBuf>, path: &str, cx: &mut Checker) {
    if let Some(dir) = dir.as_ref().filter(|_| cx.check_paths) {
        paths::require(
            dir.is_dir(),
            cx,
            path,
            "directory",
            &dir.display().to_string(),
            "a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)",
        );
    }
}
