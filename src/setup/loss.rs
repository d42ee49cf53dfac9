//! Loss settings from the `loss` section.

use crate::config::schema::LossConfig;
use crate::training::dpo::DpoSettings;

/// `DPOLoss(beta, label_smoothing)` (their ranges are the keys' own).
pub fn dpo(cfg: &LossConfig) -> DpoSettings {
    DpoSettings {
        beta: cfg.beta,
        label_smoothing: cfg.label_smoothing,
    }
}

/// torchtune's GRPO loss class from `loss._component_`, with `kl_coeff` and `epsilon`.
pub fn grpo(cfg: &LossConfig) -> crate::training::grpo_loss::TorchtuneGrpoSettings {
    use crate::config::components::LossKind;
    use crate::training::grpo_loss::{TorchtuneGrpoLoss, TorchtuneGrpoSettings};
    let loss = match cfg.component {
        LossKind::Grpo(class) => class,
        // The recipe's loss rule admits only GRPO losses for the GRPO recipes.
        _ => TorchtuneGrpoLoss::Simple,
    };
    TorchtuneGrpoSettings {
        loss,
        epsilon: cfg.epsilon(),
        kl_coeff: cfg.kl_coeff(),
    }
}
