//! `loss` and knowledge distillation's `kd_loss`.

use crate::config::components::LossKind;
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{Checker, default, join, keys, optional};

keys! {
    /// A loss: token cross-entropy, DPO's, or a distillation divergence.
    pub struct LossConfig {
        section: "loss",
        component: LossKind,
    }
    /// DPO: the KL penalty's strength (it scales the log-ratio margin).
    beta: f64 = default(|| 0.1).range(
        |v| v.is_finite() && v > 0.0,
        "a positive number (torchtune's default is 0.1)",
    ),
    /// DPO: the assumed probability that a preference label is flipped (conservative DPO).
    label_smoothing: f64 = default(|| 0.0).range(
        |v| (0.0..0.5).contains(&v),
        "from 0 up to, not including, 0.5",
    ),
    /// Row chunks of the output projection and cross-entropy (memory, not maths; default 8,
    /// 1 for none).
    num_output_chunks: Option<usize> = optional(),
    /// GRPO: the weight of the KL penalty against the reference (default 0.1, torchtune's;
    /// 0 skips the reference's forward pass).
    kl_coeff: Option<f64> = optional().range(
        |v| v.is_finite() && v >= 0.0,
        "0 or a positive number",
    ),
    /// GRPO: the policy ratio is clipped to `[1 - epsilon, 1 + epsilon]` (default 0.1,
    /// torchtune's; `GRPOSimpleLoss` has no clipping).
    epsilon: Option<f64> = optional().range(
        |v| v.is_finite() && v > 0.0,
        "a positive number",
    ),
    /// `SymmetricKLLoss`: the forward KL's share (default 0.5).
    sym_kd_ratio: Option<f64> = optional().range(
        |v| (0.0..=1.0).contains(&v),
        "from 0 to 1: it weighs forward against reverse KL",
    ),
}

impl LossConfig {
    /// GRPO's KL coefficient, torchtune's 0.1 when left out.
    pub fn kl_coeff(&self) -> f64 {
        self.kl_coeff.unwrap_or(0.1)
    }

    /// GRPO's clip range, torchtune's 0.1 when left out.
    pub fn epsilon(&self) -> f64 {
        self.epsilon.unwrap_or(0.1)
    }

    /// `sym_kd_ratio`, torchtune's 0.5 when left out.
    pub fn sym_kd_ratio(&self) -> f64 {
        self.sym_kd_ratio.unwrap_or(0.5)
    }
}

/// The losses a recipe computes: DPO's for the DPO recipes, GRPO's for the GRPO recipes,
/// cross-entropy for the others.
pub(super) fn recipe_loss(loss: &LossConfig, path: &str, cx: &mut Checker) {
    use crate::training::grpo_loss::TorchtuneGrpoLoss;
    let expected: &[LossKind] = match cx.recipe {
        Some(r) if r.is_dpo() => &[LossKind::Dpo],
        Some(r) if r.is_grpo() => &[
            LossKind::Grpo(TorchtuneGrpoLoss::Simple),
            LossKind::Grpo(TorchtuneGrpoLoss::Token),
            LossKind::Grpo(TorchtuneGrpoLoss::Completion),
        ],
        _ => &[LossKind::CrossEntropy],
    };
    allowed(loss, path, expected, cx);
    if !matches!(loss.component, LossKind::Grpo(_)) {
        for (key, set) in [
            ("kl_coeff", loss.kl_coeff.is_some()),
            ("epsilon", loss.epsilon.is_some()),
        ] {
            if set {
                cx.problem(
                    Problem::new(
                        ProblemKind::UnknownKey,
                        join(path, key),
                        format!("`{key}` is a GRPO loss setting; this loss does not read it"),
                    )
                    .with_fix(format!("remove `{path}.{key}`")),
                );
            }
        }
    }
}

/// Distillation's divergence.
pub(super) fn kd_loss(loss: &LossConfig, path: &str, cx: &mut Checker) {
    let divergences = [
        LossKind::ForwardKl,
        LossKind::ReverseKl,
        LossKind::SymmetricKl,
    ];
    allowed(loss, path, &divergences, cx);
}

fn allowed(loss: &LossConfig, path: &str, allowed: &[LossKind], cx: &mut Checker) {
    let kind = loss.component;
    if !allowed.contains(&kind) {
        let name = crate::config::components::Component::Loss(kind).canonical_name();
        cx.problem(Problem::new(
            ProblemKind::WrongComponentKind,
            join(path, "_component_"),
            format!(
                "`{name}` ({kind:?}) cannot be used as `{path}` for this recipe (expected {allowed:?})"
            ),
        ));
    }
}
