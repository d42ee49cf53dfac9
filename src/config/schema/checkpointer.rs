//! `checkpointer` (and `teacher_checkpointer`, `ref_checkpointer`): which Hugging Face
//! checkpoint a model loads from, and where a run's checkpoints go.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_yaml::Value;

use crate::config::components::HfCheckpointer;
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{Checker, ConfigValue, Ty, join, keys, on, optional, required};
use crate::config::paths;
use crate::config::values::choices;

/// `max_filename` of torchtune's `{filename_format, max_filename}`: a string (`"00004"`) or a
/// number.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum StrOrInt {
    Str(String),
    Int(u64),
}

impl ConfigValue for StrOrInt {
    const TY: &'static Ty = &Ty::Either(&Ty::Str, &Ty::UInt);
    fn read(value: &Value, _: &str, _: &mut Checker) -> Option<Self> {
        match value {
            Value::String(s) => Some(Self::Str(s.clone())),
            other => other.as_u64().map(Self::Int),
        }
    }
}

keys! {
    /// torchtune's `checkpoint_files: {filename_format: model-{}-of-{}.safetensors,
    /// max_filename: "00004"}`.
    pub struct CheckpointFilesFormat {
        section: "checkpoint_files",
    }
    /// The file name with two `{}`: the file's number and the last number.
    filename_format: String = required(),
    /// The last file's number, zero-padded as in the file names.
    max_filename: StrOrInt = required(),
}

/// `checkpoint_files`: the safetensors files to load.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum CheckpointFiles {
    List(Vec<String>),
    Format(CheckpointFilesFormat),
}

impl ConfigValue for CheckpointFiles {
    const TY: &'static Ty = &Ty::Either(&Ty::List(&Ty::Str), CheckpointFilesFormat::TY);
    fn read(value: &Value, path: &str, cx: &mut Checker) -> Option<Self> {
        if value.is_sequence() {
            cx.value(value, path).map(Self::List)
        } else {
            cx.value(value, path).map(Self::Format)
        }
    }
}

impl CheckpointFiles {
    /// The file names, expanding the `{filename_format, max_filename}` form.
    pub fn names(&self) -> Vec<String> {
        match self {
            Self::List(files) => files.clone(),
            Self::Format(format) => {
                let max = match &format.max_filename {
                    StrOrInt::Str(s) => s.clone(),
                    StrOrInt::Int(i) => format!("{i:05}"),
                };
                let n: usize = max.parse().unwrap_or(0);
                (1..=n)
                    .map(|i| {
                        let idx = format!("{i:0width$}", width = max.len());
                        format
                            .filename_format
                            .replacen("{}", &idx, 1)
                            .replacen("{}", &max, 1)
                    })
                    .collect()
            }
        }
    }
}

/// torchtune's `ModelType` names (and tune's own for the families torchtune lacks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum CheckpointModelType {
    Gemma,
    Gemma2,
    Gemma3,
    Llama2,
    Llama3,
    #[serde(rename = "LLAMA3_2")]
    Llama3_2,
    #[serde(rename = "LLAMA3_VISION")]
    LlamaVision,
    Llama4,
    Mistral,
    Mixtral,
    Phi3Mini,
    Phi4,
    Phi4Mini,
    Qwen2,
    Qwen2Moe,
    Qwen3,
    Qwen3Moe,
    Smollm3,
    GptOss,
    Reward,
    ClipText,
    T5Encoder,
}

choices!(CheckpointModelType {
    "GEMMA" => CheckpointModelType::Gemma,
    "GEMMA2" => CheckpointModelType::Gemma2,
    "GEMMA3" => CheckpointModelType::Gemma3,
    "LLAMA2" => CheckpointModelType::Llama2,
    "LLAMA3" => CheckpointModelType::Llama3,
    "LLAMA3_2" => CheckpointModelType::Llama3_2,
    "LLAMA3_VISION" => CheckpointModelType::LlamaVision,
    "LLAMA4" => CheckpointModelType::Llama4,
    "MISTRAL" => CheckpointModelType::Mistral,
    "MIXTRAL" => CheckpointModelType::Mixtral,
    "PHI3_MINI" => CheckpointModelType::Phi3Mini,
    "PHI4" => CheckpointModelType::Phi4,
    "PHI4_MINI" => CheckpointModelType::Phi4Mini,
    "QWEN2" => CheckpointModelType::Qwen2,
    "QWEN2_MOE" => CheckpointModelType::Qwen2Moe,
    "QWEN3" => CheckpointModelType::Qwen3,
    "QWEN3_MOE" => CheckpointModelType::Qwen3Moe,
    "SMOLLM3" => CheckpointModelType::Smollm3,
    "GPT_OSS" => CheckpointModelType::GptOss,
    "REWARD" => CheckpointModelType::Reward,
    "CLIP_TEXT" => CheckpointModelType::ClipText,
    "T5_ENCODER" => CheckpointModelType::T5Encoder,
});

impl CheckpointModelType {
    /// The text families (config.json's `model_type`s) a checkpoint of this type has; `None`
    /// for `REWARD`, a classifier of any family.
    pub fn families(self) -> Option<&'static [&'static str]> {
        Some(match self {
            Self::Gemma => &["gemma"],
            Self::Gemma2 => &["gemma2"],
            Self::Gemma3 => &["gemma3_text"],
            Self::Llama2 | Self::Llama3 | Self::Llama3_2 => &["llama"],
            Self::Mistral => &["mistral"],
            Self::Mixtral => &["mixtral"],
            Self::Phi3Mini | Self::Phi4 | Self::Phi4Mini => &["phi3"],
            Self::Qwen2 => &["qwen2"],
            Self::Qwen2Moe => &["qwen2_moe"],
            Self::Qwen3 => &["qwen3"],
            Self::Qwen3Moe => &["qwen3_moe"],
            Self::Smollm3 => &["smollm3"],
            Self::GptOss => &["gpt_oss"],
            Self::Reward => return None,
            Self::LlamaVision | Self::Llama4 | Self::ClipText | Self::T5Encoder => &[],
        })
    }
}

/// CLIP's and T5's text encoders are no language model tune trains or generates with.
fn a_language_model(t: &Option<CheckpointModelType>, path: &str, cx: &mut Checker) {
    if let Some(t @ (CheckpointModelType::ClipText | CheckpointModelType::T5Encoder)) = t {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                path,
                format!(
                    "{} is a text encoder (of an image model), not a language model tune trains",
                    serde_json::to_value(t).unwrap_or_default()
                ),
            )
            .with_fix(
                "point the checkpointer at a language model and set its model_type (e.g. LLAMA3)",
            ),
        );
    }
}

/// `safe_serialization: False` asks for PyTorch `.bin` files.
fn safetensors_only(safe: &bool, path: &str, cx: &mut Checker) {
    if !safe {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                path,
                "False asks for PyTorch .bin checkpoints; tune writes safetensors only (which transformers, peft and torchtune all load)",
            )
            .with_fix("remove `safe_serialization`, or set it to True"),
        );
    }
}

keys! {
    /// A Hugging Face checkpoint (config.json + safetensors) to load, and where a run's
    /// checkpoints go.
    pub struct CheckpointerConfig {
        section: "checkpointer",
        component: HfCheckpointer,
        rule: checkpointer_rules,
    }
    /// The model's directory.
    checkpoint_dir: PathBuf = required().fingerprint(),
    /// The safetensors files to load (default: every one in checkpoint_dir, by its index).
    checkpoint_files: Option<CheckpointFiles> = optional(),
    /// A PEFT adapter (directory, or a file in it) applied on top of the model.
    adapter_checkpoint: Option<String> = optional().fingerprint(),
    /// torchtune's training-state file (`recipe_state.pt`): only null. tune resumes from the
    /// latest complete checkpoint in its checkpoint directory (`resume_from_checkpoint: True`).
    recipe_checkpoint: Option<String> = optional().refuse(
        "tune cannot read torchtune's recipe state; with `resume_from_checkpoint: True` it resumes from the latest complete checkpoint in its checkpoint directory (each holds its optimizer state and position): set `recipe_checkpoint: null`",
    ),
    /// Where the run's checkpoints go (default: the top-level `output_dir`).
    output_dir: Option<PathBuf> = optional(),
    /// torchtune's name for the checkpoint's architecture: the architecture comes from
    /// config.json, which must be of this family (a mismatch is refused when the checkpoint
    /// loads: the checkpointer points at another model than the config says).
    model_type: Option<CheckpointModelType> = optional().rule(a_language_model),
    /// Checkpoints are safetensors: True, or left out (False asks for `.bin` files, which tune
    /// does not write).
    safe_serialization: bool = on().rule(safetensors_only).validation_only(
        "True is what tune does; False is refused",
    ),
}

impl CheckpointerConfig {
    /// The files `checkpoint_files` names (`None`: every safetensors file of the directory).
    pub fn files(&self) -> Option<Vec<String>> {
        self.checkpoint_files.as_ref().map(CheckpointFiles::names)
    }
}

/// Every path the checkpointer reads must exist.
fn checkpointer_rules(c: &CheckpointerConfig, path: &str, cx: &mut Checker) {
    if !cx.check_paths {
        return;
    }
    let dir = &c.checkpoint_dir;
    let shown = dir.display().to_string();
    if !dir.is_dir() {
        let what = if dir.exists() {
            format!("`{shown}` is not a directory")
        } else {
            format!("directory `{shown}` does not exist")
        };
        cx.problem(
            Problem::new(ProblemKind::MissingPath, join(path, "checkpoint_dir"), what)
            .with_fix(format!(
                "download the model there (`tune download <repo_id> --output-dir {shown}`) or pass `{path}.checkpoint_dir=<dir>`"
            )),
        );
        return;
    }
    if let Some(CheckpointFiles::List(files)) = &c.checkpoint_files {
        for (i, f) in files.iter().enumerate() {
            let full = dir.join(f);
            if !full.is_file() {
                cx.problem(
                    Problem::new(
                        ProblemKind::MissingPath,
                        format!("{path}.checkpoint_files.{i}"),
                        format!("file `{}` does not exist", full.display()),
                    )
                    .with_fix(format!(
                        "list files that exist in `{shown}`, or remove `{path}.checkpoint_files` to load every *.safetensors there"
                    )),
                );
            }
        }
    }
    if let Some(f) = &c.adapter_checkpoint {
        let full = dir.join(Path::new(f));
        paths::require(
            full.exists(),
            cx,
            &join(path, "adapter_checkpoint"),
            "file",
            &full.display().to_string(),
            "a file inside checkpoint_dir",
        );
    }
}
