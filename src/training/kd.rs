//! Knowledge distillation: torchtune's KD losses (`ForwardKLLoss`, `ReverseKLLoss`,
//! `SymmetricKLLoss`) and the loss step that mixes them with the student's cross-entropy.
//!
//! Every loss is computed in fp32 over the positions whose *shifted* label is not -100: the
//! logits at position t are compared where `labels[t + 1]` counts, exactly as torchtune's
//! recipe shifts the labels (`hstack(labels[..., 1:], ignore)`) before calling the loss.
//! Positions where a logit is infinite contribute nothing (torchtune's `inf_mask`).

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor};

use super::activation_checkpointing::{self, Checkpointing};
use super::error::TrainError;
use super::load_balancing;
use super::loss::{self, flat_logits, next_token_targets};
use super::loss_step::{EvalOutput, LossStep, StepInfo, StepOutput};
use super::sft::{labelled_tokens, padding_free, token_batch};
use crate::data::Batch;
use crate::kernels;
use crate::models::CausalLm;
use crate::modules::ForwardMode;
use crate::precision;

/// Which divergence the student minimises against the teacher (`kd_loss._component_`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KdObjective {
    /// KL(teacher || student), up to the teacher's entropy: -sum_v p_t log p_s.
    ForwardKl,
    /// KL(student || teacher): sum_v p_s (log p_s - log p_t).
    ReverseKl,
    /// `sym_kd_ratio * forward + (1 - sym_kd_ratio) * reverse`.
    SymmetricKl { sym_kd_ratio: f64 },
}

impl KdObjective {
    pub fn loss<B: Backend>(
        self,
        student: Tensor<B, 3>,
        teacher: Tensor<B, 3>,
        labels: &[i64],
    ) -> Tensor<B, 1> {
        match self {
            Self::ForwardKl => forward_kl(student, teacher, labels),
            Self::ReverseKl => reverse_kl(student, teacher, labels),
            Self::SymmetricKl { sym_kd_ratio } => {
                symmetric_kl(student, teacher, labels, sym_kd_ratio)
            }
        }
    }
}

/// The shifted `[rows, vocab]` logits of both models, the `[rows]` mask and how many rows count.
struct Shifted<B: Backend> {
    student: Tensor<B, 2>,
    teacher: Tensor<B, 2>,
    mask: Tensor<B, 1>,
    count: usize,
}

fn shifted<B: Backend>(student: Tensor<B, 3>, teacher: Tensor<B, 3>, labels: &[i64]) -> Shifted<B> {
    assert_eq!(
        student.dims(),
        teacher.dims(),
        "student and teacher logits must have the same shape"
    );
    let batch = student.dims()[0];
    let device = student.device();
    let (_, mask) = next_token_targets(labels, batch);
    let count = mask.iter().filter(|m| **m > 0.0).count();
    let n = mask.len();
    let mask = precision::f32_tensor::<B, 1>(mask, [n], &device);
    Shifted {
        student: flat_logits(precision::to_f32(student)),
        teacher: flat_logits(precision::to_f32(teacher)),
        mask,
        count,
    }
}

/// `-sum(x * mask) / sum(mask)` for per-position sums `x` `[rows, 1]`; zero when nothing counts.
fn negative_masked_mean<B: Backend>(
    x: Tensor<B, 2>,
    mask: Tensor<B, 1>,
    count: usize,
) -> Tensor<B, 1> {
    let rows = mask.dims()[0];
    (x.reshape([rows]) * mask).sum().neg() / count.max(1) as f64
}

/// torchtune `ForwardKLLoss`: `-sum_v softmax(teacher) * log_softmax(student)`, averaged over
/// the counted positions.
pub fn forward_kl<B: Backend>(
    student: Tensor<B, 3>,
    teacher: Tensor<B, 3>,
    labels: &[i64],
) -> Tensor<B, 1> {
    let s = shifted(student, teacher, labels);
    let inf = s.student.clone().is_inf();
    let teacher_prob = kernels::softmax(s.teacher);
    let student_logprob = log_softmax(s.student, 1);
    let prod = (teacher_prob * student_logprob).mask_fill(inf, 0.0);
    negative_masked_mean(prod.sum_dim(1), s.mask, s.count)
}

/// torchtune `ReverseKLLoss`: `-sum_v softmax(student) * (log_softmax(teacher) - log_softmax(student))`.
pub fn reverse_kl<B: Backend>(
    student: Tensor<B, 3>,
    teacher: Tensor<B, 3>,
    labels: &[i64],
) -> Tensor<B, 1> {
    let s = shifted(student, teacher, labels);
    let inf = s
        .student
        .clone()
        .is_inf()
        .bool_or(s.teacher.clone().is_inf());
    let student_prob = kernels::softmax(s.student.clone());
    let student_logprob = log_softmax(s.student, 1);
    let teacher_logprob = log_softmax(s.teacher, 1);
    let cross = (student_prob.clone() * teacher_logprob).mask_fill(inf.clone(), 0.0);
    let own = (student_prob * student_logprob).mask_fill(inf, 0.0);
    negative_masked_mean((cross - own).sum_dim(1), s.mask, s.count)
}

/// torchtune `SymmetricKLLoss`: `sym_kd_ratio * forward_kl + (1 - sym_kd_ratio) * reverse_kl`.
pub fn symmetric_kl<B: Backend>(
    student: Tensor<B, 3>,
    teacher: Tensor<B, 3>,
    labels: &[i64],
    sym_kd_ratio: f64,
) -> Tensor<B, 1> {
    let fkl = forward_kl(student.clone(), teacher.clone(), labels);
    let rkl = reverse_kl(student, teacher, labels);
    fkl * sym_kd_ratio + rkl * (1.0 - sym_kd_ratio)
}

/// The recipe's objective: `(1 - kd_ratio) * class_loss + kd_ratio * kd_loss`.
pub fn total_loss<B: Backend>(
    class_loss: Tensor<B, 1>,
    kd_loss: Tensor<B, 1>,
    kd_ratio: f64,
) -> Tensor<B, 1> {
    class_loss * (1.0 - kd_ratio) + kd_loss * kd_ratio
}

/// The KD loss step: the student forward with autodiff; the teacher forward on the inner
/// (non-autodiff) backend, so it records no graph and holds no gradients, its logits
/// entering the student's graph as constants.
pub struct KdLoss<B: AutodiffBackend> {
    pub teacher: CausalLm<B::InnerBackend>,
    pub objective: KdObjective,
    pub kd_ratio: f64,
    /// `enable_activation_checkpointing`: recompute each student layer in the backward pass.
    pub activation_checkpointing: Checkpointing,
}

impl<B: AutodiffBackend> KdLoss<B> {
    /// The teacher's logits for `batch`, as a constant of the autodiff graph. Its adapters
    /// (a PEFT teacher) apply; dropout does not (the teacher is in eval mode).
    pub fn teacher_logits(&self, batch: &Batch) -> Tensor<B, 3> {
        let mode = ForwardMode {
            adapters: true,
            fake_quant: false,
            train: false,
        };
        Tensor::from_inner(self.teacher.forward(token_batch(batch), mode))
    }
}

impl<B: AutodiffBackend> LossStep<B> for KdLoss<B> {
    fn step(
        &mut self,
        model: &CausalLm<B>,
        batch: &Batch,
        info: StepInfo,
    ) -> Result<StepOutput<B>, TrainError> {
        let mode = ForwardMode {
            adapters: true,
            fake_quant: false,
            train: true,
        };
        let tokens = labelled_tokens(batch);
        // Padding-free, as the SFT step: both models see the rows' real tokens in packs.
        let unpadded = padding_free(model, batch);
        let batch = unpadded.as_ref().unwrap_or(batch);
        let teacher_logits = self.teacher_logits(batch);
        super::parallel::fsdp::check(&self.teacher)?;
        let weight = batch.num_trained_tokens;
        let mut metrics = Vec::new();
        let loss_of_logits = |logits: Tensor<B, 3>| {
            let class_loss = loss::cross_entropy(logits.clone(), &batch.labels);
            let kd_loss = self.objective.loss(logits, teacher_logits, &batch.labels);
            // Left on the device: the trainer reads them with the loss, once per step.
            metrics.push(("class_loss", class_loss.clone().inner()));
            metrics.push(("kd_loss", kd_loss.clone().inner()));
            total_loss(class_loss, kd_loss, self.kd_ratio)
        };
        // The student's load-balancing loss, as its SFT step adds it; the teacher's is not
        // computed.
        let pass = activation_checkpointing::loss_and_grads(
            model,
            token_batch(batch),
            mode,
            (self.activation_checkpointing, info.seed),
            weight as f64,
            load_balancing::aux_loss_coef(model),
            loss_of_logits,
        );
        metrics.extend(pass.aux_metric());
        Ok(StepOutput {
            loss: pass.loss,
            weight,
            tokens,
            metrics,
            grads: pass.grads,
        })
    }

    /// The distillation loss of a validation batch, with its class and KD parts.
    fn evaluate(
        &mut self,
        model: &CausalLm<B::InnerBackend>,
        batch: &Batch,
        _info: StepInfo,
    ) -> Result<EvalOutput, TrainError> {
        let mode = ForwardMode {
            adapters: true,
            fake_quant: false,
            train: false,
        };
        let unpadded = padding_free(model, batch);
        let batch = unpadded.as_ref().unwrap_or(batch);
        let teacher = self.teacher.forward(token_batch(batch), mode);
        super::parallel::fsdp::check(&self.teacher)?;
        let (student, aux) = load_balancing::forward_with_aux(model, token_batch(batch), mode);
        let class_loss = loss::cross_entropy(student.clone(), &batch.labels);
        let kd_loss = self.objective.loss(student, teacher, &batch.labels);
        let (class, kd) = (scalar(&class_loss), scalar(&kd_loss));
        let total = scalar(&total_loss(class_loss, kd_loss, self.kd_ratio));
        let metrics = vec![("class_loss".into(), class), ("kd_loss".into(), kd)];
        let (loss, metrics) = load_balancing::with_aux(total, metrics, aux);
        Ok(EvalOutput {
            loss,
            weight: batch.num_trained_tokens,
            metrics,
        })
    }
}

fn scalar<B: Backend>(t: &Tensor<B, 1>) -> f64 {
    t.clone().into_scalar().elem()
}
