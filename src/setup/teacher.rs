//! Knowledge distillation's extra sections: the frozen teacher from `teacher_checkpointer`
//! and the divergence from `kd_loss`.
//!
//! Distillation compares the two models' distributions over the same vocabulary, token id by
//! token id, so the teacher must share the student's tokenizer. That is checked from the
//! teacher's config.json (and its tokenizer.json when it ships one) *before* its weights are
//! read, so a wrong teacher fails in milliseconds with a message saying what differs.

use std::path::PathBuf;

use burn::tensor::backend::Backend;

use super::SetupError;
use super::model::Checkpoint;
use crate::config::schema::{CheckpointerConfig, KdLoss, KdSettings, ModelConfig};
use crate::models::build::RowsOf;
use crate::models::{CausalLm, ModelArgs, Trainable};
use crate::tokenizer::Tokenizer;
use crate::training::kd::KdObjective;

const KEY: &str = "teacher_checkpointer";

/// A teacher that cannot teach this student: they must share the vocabulary, id by id.
#[derive(Debug, thiserror::Error)]
pub enum TeacherError {
    #[error(
        "teacher_checkpointer.checkpoint_dir: teacher vocab_size {teacher} != student vocab_size {student}: the teacher must share the student's tokenizer"
    )]
    VocabSize { teacher: usize, student: usize },
    #[error(
        "teacher_checkpointer.checkpoint_dir: the teacher's tokenizer ({}) differs from the student's ({}): {difference}; the teacher must share the student's tokenizer",
        teacher.display(),
        student.display()
    )]
    Tokenizer {
        teacher: PathBuf,
        student: PathBuf,
        difference: String,
    },
}

/// The KD divergence `kd_loss` names.
pub fn kd_objective(loss: &KdLoss) -> KdObjective {
    match &loss.settings {
        KdSettings::ForwardKl(_) => KdObjective::ForwardKl,
        KdSettings::ReverseKl(_) => KdObjective::ReverseKl,
        KdSettings::SymmetricKl(k) => KdObjective::SymmetricKl {
            sym_kd_ratio: k.sym_kd_ratio,
        },
    }
}

/// Checks that the teacher `teacher` can teach a student with `student` args and
/// `tokenizer`: the same vocabulary size, and (if the teacher ships a tokenizer.json) the same
/// token for every id.
pub fn check_compatible(
    student: &ModelArgs,
    tokenizer: &Tokenizer,
    teacher: &Checkpoint,
) -> Result<(), SetupError> {
    if teacher.args.vocab_size != student.vocab_size {
        return Err(TeacherError::VocabSize {
            teacher: teacher.args.vocab_size,
            student: student.vocab_size,
        }
        .into());
    }
    let teacher_tokenizer_path = teacher.dir.join("tokenizer.json");
    if teacher_tokenizer_path.is_file() {
        let theirs = Tokenizer::from_path(&teacher_tokenizer_path)?;
        if let Some(difference) = tokenizer_difference(tokenizer, &theirs) {
            return Err(TeacherError::Tokenizer {
                teacher: teacher_tokenizer_path,
                student: tokenizer.path().to_path_buf(),
                difference,
            }
            .into());
        }
    }
    Ok(())
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

/// Loads the frozen teacher on a plain (non-autodiff) backend, after checking it against the
/// student (from its config.json and tokenizer, before its weights are read); with
/// `teacher_checkpointer.adapter_checkpoint`, its PEFT adapter applies. With FSDP (`rows`) it
/// is read as this rank's rows only (an NF4 one's quantized alone).
pub fn load<B: Backend>(
    cfg: &CheckpointerConfig,
    model: &ModelConfig,
    rows: Option<RowsOf>,
    student: &ModelArgs,
    tokenizer: &Tokenizer,
    device: &B::Device,
) -> Result<CausalLm<B>, SetupError> {
    let teacher = super::model::open(cfg, KEY)?;
    check_compatible(student, tokenizer, &teacher)?;
    let base = super::model::base_weights::<B>(model, device)?;
    let mut teacher = super::model::load::<B>(&teacher, base, rows, device)?.model;
    super::adapters::load_adapter_checkpoint(
        &mut teacher,
        cfg,
        "teacher_checkpointer.adapter_checkpoint",
    )?;
    super::model::check_architecture("teacher_model", model, &teacher.args)?;
    Ok(teacher.set_trainable(Trainable::Nothing))
}
