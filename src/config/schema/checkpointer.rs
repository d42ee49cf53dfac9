//! `checkpointer` (and `teacher_checkpointer`, `ref_checkpointer`): which Hugging Face
//! checkpoint a model loads from, and where a run's checkpoints go.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_yaml::Value;

use crate::config::components::HfCheckpointer;
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{Checker, ConfigValue, Ty, join, keys, on, optional, required};
use crate::config::paths;

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
    /// torchtune's training-state file; tune resumes from its own checkpoints.
    recipe_checkpoint: Option<String> = optional(),
    /// Where the run's checkpoints go (default: the top-level `output_dir`).
    output_dir: Option<PathBuf> = optional(),
    /// Informational: the architecture comes from config.json.
    model_type: Option<String> = optional(),
    /// Checkpoints are always safetensors.
    safe_serialization: bool = on(),
    /// torchtune main's place for the top-level `keep_last_n_checkpoints`.
    keep_last_n_checkpoints: Option<usize> = optional().range(|v| v >= 1.0, "at least 1, or null to keep all"),
}

impl CheckpointerConfig {
    /// The files `checkpoint_files` names (`None`: every safetensors file of the directory).
    pub fn files(&self) -> Option<Vec<String>> {
        self.checkpoint_files.as_ref().map(CheckpointFiles::names)
    }
}

/// Every path the checkpointer reads must exist (the recipe checkpoint only when resuming).
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
    let resuming = cx.resuming;
    for (key, file) in [
        ("adapter_checkpoint", &c.adapter_checkpoint),
        (
            "recipe_checkpoint",
            &c.recipe_checkpoint.clone().filter(|_| resuming),
        ),
    ] {
        if let Some(f) = file {
            let full = dir.join(Path::new(f));
            paths::require(
                full.exists(),
                cx,
                &join(path, key),
                "file",
                &full.display().to_string(),
                "a file inside checkpoint_dir",
            );
        }
    }
}
