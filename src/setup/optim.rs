//! Optimizer settings and learning-rate schedule from `optimizer` and `lr_scheduler`.

use crate::config::components::{Component, OptimizerKind as ConfigOptimizer, SchedulerKind};
use crate::config::schema::{LrSchedulerConfig, OptimizerConfig};
use crate::training::optimizer::{OptimizerKind, OptimizerSettings};
use crate::training::schedule::Schedule;

pub fn optimizer(cfg: &OptimizerConfig) -> OptimizerSettings {
    let (kind, default_wd) = match cfg.component {
        Component::Optimizer(ConfigOptimizer::Sgd) => (
            OptimizerKind::Sgd {
                momentum: cfg.momentum,
            },
            0.0,
        ),
        Component::Optimizer(ConfigOptimizer::Adam) => (OptimizerKind::Adam, 0.0),
        // torch.optim.AdamW's default weight decay is 0.01.
        _ => (OptimizerKind::AdamW, 0.01),
    };
    OptimizerSettings {
        kind,
        weight_decay: cfg.weight_decay.unwrap_or(default_wd),
        betas: cfg.betas,
        eps: cfg.eps,
    }
}

pub fn schedule(cfg: Option<&LrSchedulerConfig>) -> Schedule {
    match cfg {
        None => Schedule::Constant,
        Some(c) => match c.component {
            Component::LrScheduler(SchedulerKind::LinearWithWarmup) => Schedule::LinearWithWarmup {
                warmup: c.num_warmup_steps,
            },
            Component::LrScheduler(SchedulerKind::ConstantWithWarmup) => {
                Schedule::ConstantWithWarmup {
                    warmup: c.num_warmup_steps,
                }
            }
            _ => Schedule::CosineWithWarmup {
                warmup: c.num_warmup_steps,
                num_cycles: c.num_cycles,
            },
        },
    }
}
