//! Knowledge distillation's extra sections: the frozen teacher from `teacher_checkpointer`
//! and the divergence from `kd_loss`.
//!
//! Distillation compares the two models' distributions over the same vocabulary, token id by
//! token id, so the teacher must share the student's tokenizer. That is checked from the
//! teacher's config.json (and its tokenizer.json when it ships one) *before* its weights are
//! read, so a wrong teacher fails in milliseconds with a message saying what differs.

use std::path::Path;

use burn::tensor::backend::Backend;

use super::SetupError;
use super::model::{checkpoint_files, load_adapter_checkpoint};
use crate::config::components::{Component, LossKind};
use crate::config::schema::{CheckpointerConfig, LossConfig};
use crate::model_io::hf::{load_args, load_model_with};
use crate::models::{CausalLm, ModelArgs, Trainable};
use crate::tokenizer::Tokenizer;
use crate::training::kd::KdObjective;

const KEY: &str = "teacher_checkpointer";

/// The KD divergence `kd_loss` names (torchtune's default `sym_kd_ratio` is 0.5).
pub fn kd_objective(cfg: &LossConfig) -> Result<KdObjective, SetupError> {
    match cfg.component {
        Component::Loss(LossKind::ForwardKl) => Ok(KdObjective::ForwardKl),
        Component::Loss(LossKind::ReverseKl) => Ok(KdObjective::ReverseKl),
        Component::Loss(LossKind::SymmetricKl) => {
            let sym_kd_ratio = cfg.sym_kd_ratio.unwrap_or(0.5);
            if !(0.0..=1.0).contains(&sym_kd_ratio) {
                return Err(SetupError::Invalid {
                    key: "kd_loss.sym_kd_ratio".into(),
                    message: format!(
                        "{sym_kd_ratio} is outside [0, 1]: it weighs forward against reverse KL"
                    ),
                });
            }
            Ok(KdObjective::SymmetricKl { sym_kd_ratio })
        }
        _ => Err(SetupError::Invalid {
            key: "kd_loss._component_".into(),
            message: "not a distillation loss: use ForwardKLLoss, ReverseKLLoss or SymmetricKLLoss"
                .into(),
        }),
    }
}

/// The `kd_ratio` mixing class and KD losses, which must lie in [0, 1].
pub fn kd_ratio(ratio: f64) -> Result<f64, SetupError> {
    if (0.0..=1.0).contains(&ratio) {
        Ok(ratio)
    } else {
        Err(SetupError::Invalid {
            key: "kd_ratio".into(),
            message: format!(
                "{ratio} is outside [0, 1]: the loss is (1 - kd_ratio) * class_loss + kd_ratio * kd_loss"
            ),
        })
    }
}

/// Checks that the teacher in `teacher_dir` can teach a student with `student` args and
/// `tokenizer`: the same vocabulary size, and (if the teacher ships a tokenizer.json) the same
/// token for every id. Returns the teacher's args.
pub fn check_compatible(
    student: &ModelArgs,
    tokenizer: &Tokenizer,
    teacher_dir: &Path,
) -> Result<ModelArgs, SetupError> {
    let teacher =
        load_args(teacher_dir).map_err(|source| SetupError::Model { key: KEY, source })?;
    let invalid = |message: String| SetupError::Invalid {
        key: format!("{KEY}.checkpoint_dir"),
        message,
    };
    if teacher.vocab_size != student.vocab_size {
        return Err(invalid(format!(
            "teacher vocab_size {} != student vocab_size {}: the teacher must share the student's tokenizer",
            teacher.vocab_size, student.vocab_size
        )));
    }
    let teacher_tokenizer_path = teacher_dir.join("tokenizer.json");
    if teacher_tokenizer_path.is_file() {
        let theirs = Tokenizer::from_path(&teacher_tokenizer_path)?;
        if let Some(diff) = tokenizer_difference(tokenizer, &theirs) {
            return Err(invalid(format!(
                "the teacher's tokenizer ({}) differs from the student's ({}): {diff}; the teacher must share the student's tokenizer",
                teacher_tokenizer_path.display(),
                tokenizer.path().display()
            )));
        }
    }
    Ok(teacher)
}

/// The first way two tokenizers map ids differently, if any.
fn tokenizer_difference(student: &Tokenizer, teacher: &Tokenizer) -> Option<String> {
    if student.vocab_size() != teacher.vocab_size() {
        return Some(format!(
            "teacher tokenizer vocab size {} != student tokenizer vocab size {}",
            teacher.vocab_size(),
            student.vocab_size()
        ));
    }
    (0..student.vocab_size() as u32).find_map(|id| {
        let (s, t) = (student.id_to_token(id), teacher.id_to_token(id));
        (s != t)
            .then(|| format!("token id {id} is {t:?} for the teacher but {s:?} for the student"))
    })
}

/// Loads the frozen teacher on a plain (non-autodiff) backend, after checking it against
/// the student; with `teacher_checkpointer.adapter_checkpoint`, its PEFT adapter applies.
pub fn load<B: Backend>(
    cfg: &CheckpointerConfig,
    base: crate::models::BaseWeights,
    student: &ModelArgs,
    tokenizer: &Tokenizer,
    device: &B::Device,
) -> Result<CausalLm<B>, SetupError> {
    check_compatible(student, tokenizer, &cfg.checkpoint_dir)?;
    let files = checkpoint_files(cfg);
    let mut teacher = load_model_with::<B>(&cfg.checkpoint_dir, files.as_deref(), device, base)
        .map_err(|source| SetupError::Model { key: KEY, source })?
        .model;
    load_adapter_checkpoint(&mut teacher, cfg, "teacher_checkpointer.adapter_checkpoint")?;
    Ok(teacher.set_trainable(Trainable::Nothing))
}
