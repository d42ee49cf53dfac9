//! The losses' settings, from the recipes' typed `loss` sections (each component's keys carry
//! their defaults: `config::schema::loss`).

use crate::config::schema::{
    DpoLoss, DpoSettings as DpoKeysOf, GrpoLoss, GrpoSettings, PpoLoss, TorchtuneGrpoKeys,
};
use crate::training::dpo::DpoSettings;
use crate::training::grpo_loss::{
    GrpoObjective, TorchtuneGrpoLoss, TorchtuneGrpoSettings, TrlGrpoSettings,
};
use crate::training::ppo::PpoLossSettings;

/// `DPOLoss(beta, label_smoothing)`.
pub fn dpo(loss: &DpoLoss) -> DpoSettings {
    let DpoKeysOf::Dpo(keys) = &loss.settings;
    DpoSettings {
        beta: keys.beta,
        label_smoothing: keys.label_smoothing,
    }
}

/// The GRPO policy loss `loss._component_` names, with its settings; TRL's `dr_grpo`
/// divides by the longest completion, `max_generated_tokens` (TRL's `max_completion_length`).
pub fn grpo(loss: &GrpoLoss, max_generated_tokens: usize) -> GrpoObjective {
    let torchtune = |loss, k: &TorchtuneGrpoKeys| {
        GrpoObjective::Torchtune(TorchtuneGrpoSettings {
            loss,
            epsilon: k.epsilon,
            kl_coeff: k.kl_coeff,
        })
    };
    match &loss.settings {
        GrpoSettings::Token(k) => torchtune(TorchtuneGrpoLoss::Token, k),
        GrpoSettings::Completion(k) => torchtune(TorchtuneGrpoLoss::Completion, k),
        GrpoSettings::Simple(k) => torchtune(TorchtuneGrpoLoss::Simple, k),
        GrpoSettings::Trl(k) => GrpoObjective::Trl(TrlGrpoSettings {
            loss_type: k.loss_type,
            importance_sampling_level: k.importance_sampling_level,
            epsilon_low: k.epsilon,
            epsilon_high: k.epsilon_high.unwrap_or(k.epsilon),
            beta: k.beta,
            use_bias_correction_kl: k.use_bias_correction_kl,
            max_completion_length: max_generated_tokens,
        }),
    }
}

/// `PPOLoss(epsilon, value_clip_range, value_coeff)`.
pub fn ppo(loss: &PpoLoss) -> PpoLossSettings {
    let crate::config::schema::PpoSettings::Ppo(k) = &loss.settings;
    PpoLossSettings {
        epsilon: k.epsilon,
        value_clip_range: k.value_clip_range,
        value_coeff: k.value_coeff,
    }
}
