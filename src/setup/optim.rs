//! Optimizer settings and learning-rate schedule from `optimizer` and `lr_scheduler`.

use crate::config::schema::{
    LrSchedulerConfig, OptimizerConfig, OptimizerSettings as Keys, SchedulerSettings,
};
use crate::training::optimizer::{OptimizerKind, OptimizerSettings};
use crate::training::schedule::Schedule;

pub fn optimizer(cfg: &OptimizerConfig) -> OptimizerSettings {
    // Adam's moments are unused by SGD, SGD's momentum by Adam: the training side's settings
    // are one struct for every update rule.
    let (kind, weight_decay, moments, momentum) = match &cfg.settings {
        Keys::AdamW(k) => (OptimizerKind::AdamW, k.weight_decay, Some(&k.moments), 0.0),
        Keys::Adam(k) => (OptimizerKind::Adam, k.weight_decay, Some(&k.moments), 0.0),
        Keys::Sgd(k) => (OptimizerKind::Sgd, k.weight_decay, None, k.momentum),
    };
    OptimizerSettings {
        kind,
        weight_decay,
        betas: moments.map_or((0.0, 0.0), |m| m.betas),
        eps: moments.map_or(0.0, |m| m.eps),
        momentum,
    }
}

pub fn schedule(cfg: Option<&LrSchedulerConfig>) -> Schedule {
    let Some(c) = cfg else {
        return Schedule::Constant;
    };
    match &c.settings {
        SchedulerSettings::Cosine(k) => Schedule::CosineWithWarmup {
            warmup: k.warmup.num_warmup_steps,
            num_cycles: k.num_cycles,
        },
        SchedulerSettings::Linear(k) => Schedule::LinearWithWarmup {
            warmup: k.warmup.num_warmup_steps,
        },
        SchedulerSettings::Constant(k) => Schedule::ConstantWithWarmup {
            warmup: k.warmup.num_warmup_steps,
        },
    }
}
