//! `optimizer` and `lr_scheduler`.

use crate::config::components::{OptimizerKind, SchedulerKind};
use crate::config::keys::off;
use crate::config::keys::{default, keys, optional, required};

keys! {
    /// The optimizer: AdamW, Adam or SGD with PyTorch's update rules.
    pub struct OptimizerConfig {
        section: "optimizer",
        component: OptimizerKind,
    }
    /// The peak learning rate (a resume may lower it: the optimizer's moments stay valid).
    lr: f64 = required()
        .range(|v| v > 0.0, "greater than 0 (e.g. 2e-5)")
        .resume_may_change(),
    /// Weight decay (default: PyTorch's for the optimizer, AdamW 0.01, Adam and SGD 0).
    weight_decay: Option<f64> = optional(),
    /// Adam's moment decays.
    betas: (f64, f64) = default(|| (0.9, 0.999)),
    /// Adam's denominator term.
    eps: f64 = default(|| 1e-8),
    /// SGD's momentum.
    momentum: f64 = default(|| 0.0),
    /// PyTorch's fused kernel choice; the update is the same.
    fused: Option<bool> = optional(),
    /// AMSGrad: only False.
    amsgrad: bool = off().refuse("AMSGrad is not supported; remove `amsgrad` or set it to False"),
}

impl OptimizerConfig {
    /// `weight_decay`, or PyTorch's default for the optimizer (torch.optim.AdamW's is 0.01).
    pub fn weight_decay(&self) -> f64 {
        self.weight_decay.unwrap_or(match self.component {
            OptimizerKind::AdamW => 0.01,
            OptimizerKind::Adam | OptimizerKind::Sgd => 0.0,
        })
    }
}

keys! {
    /// The learning-rate schedule (none: a constant rate).
    pub struct LrSchedulerConfig {
        section: "lr_scheduler",
        component: SchedulerKind,
    }
    /// Steps of linear warm-up from 0.
    num_warmup_steps: usize = default(|| 0),
    /// Cosine schedule: the number of half-periods over the run (torchtune's 0.5 decays once).
    num_cycles: f64 = default(|| 0.5),
}
