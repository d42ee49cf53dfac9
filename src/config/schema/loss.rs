//! The losses: each recipe's `loss` section (and knowledge distillation's `kd_loss`) is a
//! choice among the components that recipe computes ([`choice!`]), and each component owns
//! its settings, with torchtune's (or TRL's) defaults. A setting of another loss is refused by
//! name, saying whose it is.

use serde::Serialize;

use crate::config::components::LossKind;
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{Checker, Choice, choice, default, join, keys, optional};
use crate::config::values::choices;
use crate::training::grpo_loss::{ImportanceSamplingLevel, TorchtuneGrpoLoss, TrlLossType};

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

const NON_NEGATIVE: &str = "0 or a positive number";

keys! {
    /// The settings of a loss computed over the output projection in row chunks.
    pub struct ChunkedKeys {}
    /// Row chunks of the output projection and its loss (memory, not maths; 1 for none).
    num_output_chunks: usize = default(|| crate::training::chunked_loss::DEFAULT_CHUNKS)
        .range(|v| v >= 1.0, "at least 1 (1: no chunks)"),
}

keys! {
    /// A loss computed over the whole output at once (knowledge distillation's: it has no
    /// settings, and no `num_output_chunks`, since its output is not chunked).
    pub struct WholeOutputKeys {}
}

keys! {
    /// `SymmetricKLLoss`'s settings.
    pub struct SymmetricKlKeys {}
    /// The forward KL's share (the reverse KL has the rest).
    sym_kd_ratio: f64 = default(|| 0.5).range(
        |v| (0.0..=1.0).contains(&v),
        "from 0 to 1: it weighs forward against reverse KL",
    ),
}

keys! {
    /// `DPOLoss`'s settings (torchtune's defaults).
    pub struct DpoKeys {
        rule: dpo_rules,
    }
    /// The KL penalty's strength: it scales the log-ratio margin.
    beta: f64 = default(|| 0.1).range(|v| v.is_finite() && v >= 0.0, NON_NEGATIVE),
    /// The assumed probability that a preference label is flipped (conservative DPO).
    label_smoothing: f64 = default(|| 0.0).range(
        |v| (0.0..0.5).contains(&v),
        "from 0 up to, not including, 0.5",
    ),
}

/// At `beta: 0` DPO's loss is constant: refused rather than a run that trains nothing.
fn dpo_rules(k: &DpoKeys, path: &str, cx: &mut Checker) {
    if k.beta == 0.0 {
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

keys! {
    /// torchtune's GRPO losses' settings (`GRPOLoss`, `GRPOCompletionLoss`, `GRPOSimpleLoss`).
    pub struct TorchtuneGrpoKeys {}
    /// The weight of the KL penalty against the reference (0 skips the reference's forward
    /// pass).
    kl_coeff: f64 = default(|| 0.1).range(|v| v.is_finite() && v >= 0.0, NON_NEGATIVE),
    /// The policy ratio's clip range `[1 - epsilon, 1 + epsilon]` (`GRPOSimpleLoss` has no
    /// clipping).
    epsilon: f64 = default(|| 0.1).range(|v| v.is_finite() && v > 0.0, "a positive number"),
}

keys! {
    /// TRL's `GRPOTrainer` loss settings (`GRPOConfig`'s names and defaults).
    pub struct TrlGrpoKeys {}
    /// The KL coefficient (0, TRL's default: no reference model is run).
    beta: f64 = default(|| 0.0).range(|v| v.is_finite() && v >= 0.0, NON_NEGATIVE),
    /// The ratio's lower clip `1 - epsilon` (and upper, unless `epsilon_high`).
    epsilon: f64 = default(|| 0.2).range(|v| v.is_finite() && v > 0.0, "a positive number"),
    /// The upper clip `1 + epsilon_high` (DAPO's clip-higher; null: `epsilon`, as TRL).
    epsilon_high: Option<f64> = optional().range(
        |v| v.is_finite() && v > 0.0,
        "a positive number",
    ),
    /// How the per-token losses are averaged.
    loss_type: TrlLossType = default(|| TrlLossType::Dapo),
    /// One importance ratio per `token`, or per `sequence` (GSPO).
    importance_sampling_level: ImportanceSamplingLevel = default(|| ImportanceSamplingLevel::Token),
    /// The k3 KL times the importance ratio.
    use_bias_correction_kl: bool = default(|| true),
}

keys! {
    /// torchtune's `PPOLoss` settings.
    pub struct PpoLossKeys {}
    /// The policy ratio's clip range `[1 - epsilon, 1 + epsilon]`.
    epsilon: f64 = default(|| 0.1).range(|v| v.is_finite() && v > 0.0, "a positive number"),
    /// The clip range of the value model's new values around its old ones.
    value_clip_range: f64 = default(|| 0.2).range(|v| v.is_finite() && v >= 0.0, NON_NEGATIVE),
    /// The value loss's weight in the loss.
    value_coeff: f64 = default(|| 0.1).range(|v| v.is_finite() && v >= 0.0, NON_NEGATIVE),
}

choice! {
    /// The token cross-entropy every supervised recipe trains on (torchtune's
    /// `CEWithChunkedOutputLoss` and `LinearCrossEntropyLoss` are the same loss: chunking is a
    /// memory trick).
    pub struct CrossEntropyLoss {
        section: "loss",
        component: LossKind,
        settings: CrossEntropySettings,
        hint: loss_hint,
    }
    "tune.loss.CrossEntropyLoss": LossKind::CrossEntropy => CrossEntropy(ChunkedKeys),
}

choice! {
    /// Knowledge distillation's cross-entropy: over the whole output (the teacher's logits are
    /// whole too).
    pub struct WholeCrossEntropyLoss {
        section: "loss",
        component: LossKind,
        settings: WholeCrossEntropySettings,
        hint: loss_hint,
    }
    "tune.loss.CrossEntropyLoss": LossKind::CrossEntropy => CrossEntropy(WholeOutputKeys),
}

choice! {
    /// DPO's loss.
    pub struct DpoLoss {
        section: "loss",
        component: LossKind,
        settings: DpoSettings,
        hint: loss_hint,
    }
    "tune.loss.DPOLoss": LossKind::Dpo => Dpo(DpoKeys),
}

choice! {
    /// Knowledge distillation's divergence between the student's and the teacher's
    /// distributions (`kd_loss`).
    pub struct KdLoss {
        section: "kd_loss",
        component: LossKind,
        settings: KdSettings,
        hint: loss_hint,
    }
    "tune.loss.ForwardKLLoss": LossKind::ForwardKl => ForwardKl(WholeOutputKeys),
    "tune.loss.ReverseKLLoss": LossKind::ReverseKl => ReverseKl(WholeOutputKeys),
    "tune.loss.SymmetricKLLoss": LossKind::SymmetricKl => SymmetricKl(SymmetricKlKeys),
}

choice! {
    /// The GRPO recipes' policy loss: one of torchtune's, or TRL's.
    pub struct GrpoLoss {
        section: "loss",
        component: LossKind,
        settings: GrpoSettings,
        hint: loss_hint,
    }
    "tune.loss.GRPOLoss": LossKind::Grpo(TorchtuneGrpoLoss::Token) => Token(TorchtuneGrpoKeys),
    "tune.loss.GRPOCompletionLoss":
        LossKind::Grpo(TorchtuneGrpoLoss::Completion) => Completion(TorchtuneGrpoKeys),
    "tune.loss.GRPOSimpleLoss":
        LossKind::Grpo(TorchtuneGrpoLoss::Simple) => Simple(TorchtuneGrpoKeys),
    "tune.loss.TRLGRPOLoss": LossKind::TrlGrpo => Trl(TrlGrpoKeys),
}

choice! {
    /// The PPO recipe's clipped policy and value losses.
    pub struct PpoLoss {
        section: "loss",
        component: LossKind,
        settings: PpoSettings,
        hint: loss_hint,
    }
    "tune.loss.PPOLoss": LossKind::Ppo => Ppo(PpoLossKeys),
}

/// Whose setting a loss key is, over every loss: a setting of DPO's written under the
/// cross-entropy says so, and the KL coefficient's two names point at each other.
fn loss_hint(component: &str, key: &str) -> Option<String> {
    let trl = component.contains("TRL");
    match key {
        "kl_coeff" if trl => return Some("TRL's loss calls its KL coefficient `beta`".into()),
        "beta" if component.contains("GRPO") && !trl => {
            return Some("torchtune's GRPO losses call their KL coefficient `kl_coeff`".into());
        }
        "kl_coeff" if component.contains("PPO") => {
            return Some(
                "PPO's KL coefficient is the top-level `kl_coeff`, as in torchtune's configs"
                    .into(),
            );
        }
        _ => {}
    }
    let losses = [
        CrossEntropyLoss::INFO,
        DpoLoss::INFO,
        KdLoss::INFO,
        GrpoLoss::INFO,
        PpoLoss::INFO,
    ];
    let mut owners: Vec<&str> = losses
        .iter()
        .flat_map(|c| c.variants.iter())
        .filter(|v| v.keys.iter().any(|k| k.name == key))
        .map(|v| v.label)
        .collect();
    owners.dedup();
    (!owners.is_empty()).then(|| format!("it is a setting of {}", owners.join(", ")))
}

impl CrossEntropyLoss {
    /// Its row chunks.
    pub fn output_chunks(&self) -> usize {
        let CrossEntropySettings::CrossEntropy(keys) = &self.settings;
        keys.num_output_chunks
    }
}

impl GrpoLoss {
    /// The weight of its KL term (`kl_coeff`, or TRL's `beta`): 0 means no reference model is
    /// run.
    pub fn kl_weight(&self) -> f64 {
        match &self.settings {
            GrpoSettings::Token(k) | GrpoSettings::Completion(k) | GrpoSettings::Simple(k) => {
                k.kl_coeff
            }
            GrpoSettings::Trl(k) => k.beta,
        }
    }
}
