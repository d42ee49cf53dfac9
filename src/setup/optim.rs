//! Optimizer settings and learning-rate schedule from `optimizer` and `lr_scheduler`.

use crate::config::components::SchedulerKind;
use crate::config::schema::{LrSchedulerConfig, OptimizerConfig};
use crate::training::optimizer::OptimizerSettings;
use crate::training::schedule::Schedule;

pub fn optimizer(cfg: &OptimizerConfig) -> OptimizerSettings {
    OptimizerSettings {
        kind: cfg.component,
        weight_decay: cfg.weight_decay(),
        betas: cfg.betas,
        eps: cfg.eps,
        momentum: cfg.momentum,
    }
}

pub fn schedule(cfg: Option<&LrSchedulerConfig>) -> Schedule {
    let Some(c) = cfg else {
        return Schedule::Constant;
    };
    let warmup = c.num_warmup_steps;
    match c.component {
        SchedulerKind::CosineWithWarmup => Schedule::CosineWithWarmup {
            warmup,
            num_cycles: c.num_cycles,
        },
        SchedulerKind::LinearWithWarmup => Schedule::LinearWithWarmup { warmup },
        SchedulerKind::ConstantWithWarmup => Schedule::ConstantWithWarmup { warmup },
    }
}
