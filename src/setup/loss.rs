//! Loss settings from the `loss` section.

use crate::config::components::LossKind;
use crate::config::schema::LossConfig;
use crate::training::dpo::DpoSettings;
use crate::training::grpo_loss::{
    GrpoObjective, ImportanceSamplingLevel, TorchtuneGrpoSettings, TrlGrpoSettings, TrlLossType,
};

/// `DPOLoss(beta, label_smoothing)` (their ranges are the keys' own).
pub fn dpo(cfg: &LossConfig) -> DpoSettings {
    DpoSettings {
        beta: cfg.dpo_beta(),
        label_smoothing: cfg.label_smoothing(),
    }
}

/// The GRPO policy loss `loss._component_` names, with its settings; TRL's `dr_grpo`
/// divides by the longest completion, `max_generated_tokens` (TRL's `max_completion_length`).
pub fn grpo(cfg: &LossConfig, max_generated_tokens: usize) -> GrpoObjective {
    let epsilon = cfg.epsilon();
    match cfg.component {
        LossKind::TrlGrpo => GrpoObjective::Trl(TrlGrpoSettings {
            loss_type: cfg.loss_type.unwrap_or(TrlLossType::Dapo),
            importance_sampling_level: cfg
                .importance_sampling_level
                .unwrap_or(ImportanceSamplingLevel::Token),
            epsilon_low: epsilon,
            epsilon_high: cfg.epsilon_high.unwrap_or(epsilon),
            beta: cfg.grpo_kl_weight(),
            use_bias_correction_kl: cfg.use_bias_correction_kl.unwrap_or(true),
            max_completion_length: max_generated_tokens,
        }),
        LossKind::Grpo(loss) => GrpoObjective::Torchtune(TorchtuneGrpoSettings {
            loss,
            epsilon,
            kl_coeff: cfg.kl_coeff(),
        }),
        // The recipe's loss rule admits only GRPO losses for the GRPO recipes.
        _ => GrpoObjective::default(),
    }
}
