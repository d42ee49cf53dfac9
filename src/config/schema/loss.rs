//! `loss` and knowledge distillation's `kd_loss`.

use serde::Serialize;

use crate::config::components::LossKind;
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{Checker, join, keys, optional, refuse_unread_settings};
use crate::config::values::choices;
use crate::training::grpo_loss::{ImportanceSamplingLevel, TrlLossType};

choices!(TrlLossType {
    "grpo" => TrlLossType::Grpo,
    "bnpo" => TrlLossType::Bnpo,
    "dr_grpo" => TrlLossType::DrGrpo,
    "dapo" => TrlLossType::Dapo,
});

impl Serialize for TrlLossType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(match self {
            Self::Grpo => "grpo",
            Self::Bnpo => "bnpo",
            Self::DrGrpo => "dr_grpo",
            Self::Dapo => "dapo",
        })
    }
}

choices!(ImportanceSamplingLevel {
    "token" => ImportanceSamplingLevel::Token,
    "sequence" => ImportanceSamplingLevel::Sequence,
});

impl Serialize for ImportanceSamplingLevel {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(match self {
            Self::Token => "token",
            Self::Sequence => "sequence",
        })
    }
}

keys! {
    /// A loss: token cross-entropy, DPO's, a distillation divergence or a GRPO policy loss.
    /// Each component reads only its own settings ([`LossConfig::settings`]); a setting of
    /// another component is refused by name.
    pub struct LossConfig {
        section: "loss",
        component: LossKind,
        rule: loss_settings,
    }
    /// DPO: the KL penalty's strength (it scales the log-ratio margin; default 0.1,
    /// torchtune's). TRL's GRPO loss: the KL coefficient (default 0, TRL's: no reference).
    beta: Option<f64> = optional().range(|v| v.is_finite() && v >= 0.0, "0 or a positive number"),
    /// DPO: the assumed probability that a preference label is flipped (conservative DPO).
    label_smoothing: Option<f64> = optional().range(
        |v| (0.0..0.5).contains(&v),
        "from 0 up to, not including, 0.5",
    ),
    /// Row chunks of the output projection and cross-entropy (memory, not maths; default 8,
    /// 1 for none).
    num_output_chunks: Option<usize> = optional(),
    /// torchtune's GRPO losses: the weight of the KL penalty against the reference (default
    /// 0.1, torchtune's; 0 skips the reference's forward pass).
    kl_coeff: Option<f64> = optional().range(
        |v| v.is_finite() && v >= 0.0,
        "0 or a positive number",
    ),
    /// GRPO: the policy ratio's clip range `[1 - epsilon, 1 + epsilon]` (default 0.1 for
    /// torchtune's losses, 0.2 for TRL's; `GRPOSimpleLoss` has no clipping).
    epsilon: Option<f64> = optional().range(
        |v| v.is_finite() && v > 0.0,
        "a positive number",
    ),
    /// TRL's GRPO loss: how the per-token losses are averaged (TRL's `loss_type`, default
    /// `dapo`).
    loss_type: Option<TrlLossType> = optional(),
    /// TRL's GRPO loss: the upper clip `1 + epsilon_high` (DAPO's clip-higher; default
    /// `epsilon`).
    epsilon_high: Option<f64> = optional().range(
        |v| v.is_finite() && v > 0.0,
        "a positive number",
    ),
    /// TRL's GRPO loss: one importance ratio per `token`, or per `sequence` (GSPO).
    importance_sampling_level: Option<ImportanceSamplingLevel> = optional(),
    /// TRL's GRPO loss: the k3 KL times the importance ratio (TRL's default, true).
    use_bias_correction_kl: Option<bool> = optional(),
    /// `PPOLoss`: the clip range of the value model's new values around its old ones
    /// (default 0.2, torchtune's).
    value_clip_range: Option<f64> = optional().range(
        |v| v.is_finite() && v >= 0.0,
        "0 or a positive number",
    ),
    /// `PPOLoss`: the value loss's weight in the loss (default 0.1, torchtune's).
    value_coeff: Option<f64> = optional().range(
        |v| v.is_finite() && v >= 0.0,
        "0 or a positive number",
    ),
    /// `SymmetricKLLoss`: the forward KL's share (default 0.5).
    sym_kd_ratio: Option<f64> = optional().range(
        |v| (0.0..=1.0).contains(&v),
        "from 0 to 1: it weighs forward against reverse KL",
    ),
}

impl LossConfig {
    /// The settings each loss reads: torchtune's class's own arguments. `num_output_chunks`
    /// (torchtune's chunked cross-entropy and KL classes) shapes memory, not the result.
    fn settings(kind: LossKind) -> &'static [&'static str] {
        match kind {
            LossKind::CrossEntropy | LossKind::ForwardKl | LossKind::ReverseKl => {
                &["num_output_chunks"]
            }
            LossKind::SymmetricKl => &["num_output_chunks", "sym_kd_ratio"],
            LossKind::Dpo => &["beta", "label_smoothing"],
            LossKind::Grpo(_) => &["kl_coeff", "epsilon"],
            LossKind::Ppo => &["epsilon", "value_clip_range", "value_coeff"],
            LossKind::TrlGrpo => &[
                "beta",
                "epsilon",
                "epsilon_high",
                "loss_type",
                "importance_sampling_level",
                "use_bias_correction_kl",
            ],
        }
    }

    /// The settings this section sets.
    fn set(&self) -> Vec<&'static str> {
        [
            ("beta", self.beta.is_some()),
            ("label_smoothing", self.label_smoothing.is_some()),
            ("num_output_chunks", self.num_output_chunks.is_some()),
            ("kl_coeff", self.kl_coeff.is_some()),
            ("epsilon", self.epsilon.is_some()),
            ("loss_type", self.loss_type.is_some()),
            ("epsilon_high", self.epsilon_high.is_some()),
            (
                "importance_sampling_level",
                self.importance_sampling_level.is_some(),
            ),
            (
                "use_bias_correction_kl",
                self.use_bias_correction_kl.is_some(),
            ),
            ("value_clip_range", self.value_clip_range.is_some()),
            ("value_coeff", self.value_coeff.is_some()),
            ("sym_kd_ratio", self.sym_kd_ratio.is_some()),
        ]
        .into_iter()
        .filter_map(|(k, on)| on.then_some(k))
        .collect()
    }

    /// DPO's `beta`, torchtune's 0.1 when left out.
    pub fn dpo_beta(&self) -> f64 {
        self.beta.unwrap_or(0.1)
    }

    /// DPO's `label_smoothing`, torchtune's 0 when left out.
    pub fn label_smoothing(&self) -> f64 {
        self.label_smoothing.unwrap_or(0.0)
    }

    /// torchtune's GRPO KL coefficient, 0.1 when left out.
    pub fn kl_coeff(&self) -> f64 {
        self.kl_coeff.unwrap_or(0.1)
    }

    /// GRPO's clip range: torchtune's 0.1, or TRL's 0.2 for its loss, when left out.
    pub fn epsilon(&self) -> f64 {
        let default = if self.component == LossKind::TrlGrpo {
            0.2
        } else {
            0.1
        };
        self.epsilon.unwrap_or(default)
    }

    /// The weight of a GRPO loss's KL term (`kl_coeff`, or TRL's `beta`, default 0): 0 means
    /// no reference model is run.
    pub fn grpo_kl_weight(&self) -> f64 {
        match self.component {
            LossKind::TrlGrpo => self.beta.unwrap_or(0.0),
            _ => self.kl_coeff(),
        }
    }

    /// `beta` and `label_smoothing` had defaults (0.1, 0) before each loss read only its own
    /// settings, so every earlier checkpoint's fingerprint holds a value for them: the
    /// fingerprint (entries under `section`) holds the values the loss uses, and those
    /// checkpoints resume.
    pub fn keep_earlier_fingerprints(
        &self,
        section: &str,
        entries: &mut serde_json::Map<String, serde_json::Value>,
    ) {
        let beta = match self.component {
            LossKind::TrlGrpo => self.grpo_kl_weight(),
            _ => self.dpo_beta(),
        };
        entries.insert(join(section, "beta"), beta.into());
        entries.insert(
            join(section, "label_smoothing"),
            self.label_smoothing().into(),
        );
    }

    /// `PPOLoss`'s settings, torchtune's defaults (epsilon 0.1, value clip range 0.2, value
    /// coefficient 0.1) where left out.
    pub fn ppo(&self) -> crate::training::ppo::PpoLossSettings {
        crate::training::ppo::PpoLossSettings {
            epsilon: self.epsilon(),
            value_clip_range: self.value_clip_range.unwrap_or(0.2),
            value_coeff: self.value_coeff.unwrap_or(0.1),
        }
    }

    /// `sym_kd_ratio`, torchtune's 0.5 when left out.
    pub fn sym_kd_ratio(&self) -> f64 {
        self.sym_kd_ratio.unwrap_or(0.5)
    }
}

/// A setting the component does not read is refused by name (a `kl_coeff` on TRL's loss,
/// which reads `beta`, would otherwise be silently ignored).
fn loss_settings(loss: &LossConfig, path: &str, cx: &mut Checker) {
    let reads = LossConfig::settings(loss.component);
    let name = crate::config::components::Component::Loss(loss.component).canonical_name();
    let hint = |key: &str| match (loss.component, key) {
        (LossKind::TrlGrpo, "kl_coeff") => Some("TRL's loss calls its KL coefficient `beta`"),
        (LossKind::Grpo(_), "beta") => {
            Some("torchtune's GRPO losses call their KL coefficient `kl_coeff`")
        }
        (LossKind::Ppo, "kl_coeff") => {
            Some("PPO's KL coefficient is the top-level `kl_coeff`, as in torchtune's configs")
        }
        _ => None,
    };
    refuse_unread_settings(cx, path, &name, (&loss.set(), reads), hint);
    if loss.component == LossKind::Dpo && loss.beta == Some(0.0) {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                join(path, "beta"),
                "DPO's beta must be positive: at 0 its loss is constant and nothing trains",
            )
            .with_fix("torchtune's default is 0.1"),
        );
    }
}

/// The losses a recipe computes: DPO's for the DPO recipes, GRPO's for the GRPO recipes,
/// cross-entropy for the others.
pub(super) fn recipe_loss(loss: &LossConfig, path: &str, cx: &mut Checker) {
    use crate::training::grpo_loss::TorchtuneGrpoLoss;
    let expected: &[LossKind] = match cx.recipe {
        Some(r) if r.is_dpo() => &[LossKind::Dpo],
        Some(r) if r.is_ppo() => &[LossKind::Ppo],
        Some(r) if r.is_grpo() => &[
            LossKind::Grpo(TorchtuneGrpoLoss::Simple),
            LossKind::Grpo(TorchtuneGrpoLoss::Token),
            LossKind::Grpo(TorchtuneGrpoLoss::Completion),
            LossKind::TrlGrpo,
        ],
        _ => &[LossKind::CrossEntropy],
    };
    allowed(loss, path, expected, cx);
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
