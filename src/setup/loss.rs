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
