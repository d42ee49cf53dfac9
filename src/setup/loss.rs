//! Loss settings from the `loss` section.

use super::SetupError;
use crate::config::schema::LossConfig;
use crate::training::dpo::DpoSettings;

/// `DPOLoss(beta, label_smoothing)`, checked: beta scales the log-ratio margin, so it must be
/// positive; label smoothing is a flip probability below one half.
pub fn dpo(cfg: &LossConfig) -> Result<DpoSettings, SetupError> {
    if !(cfg.beta.is_finite() && cfg.beta > 0.0) {
        return Err(SetupError::Invalid {
            key: "loss.beta".into(),
            message: format!(
                "must be a positive number (torchtune's default is 0.1), found {}",
                cfg.beta
            ),
        });
    }
    if !(0.0..0.5).contains(&cfg.label_smoothing) {
        return Err(SetupError::Invalid {
            key: "loss.label_smoothing".into(),
            message: format!(
                "must be in [0, 0.5): the assumed probability that a preference label is flipped (default 0), found {}",
                cfg.label_smoothing
            ),
        });
    }
    Ok(DpoSettings {
        beta: cfg.beta,
        label_smoothing: cfg.label_smoothing,
    })
}
