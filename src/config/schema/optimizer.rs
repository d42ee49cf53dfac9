//! `optimizer` and `lr_scheduler`: each optimizer and each schedule owns its keys, with
//! PyTorch's and torchtune's defaults (a key of another one is refused, saying whose it is).

use crate::config::components::{OptimizerKind, SchedulerKind};
use crate::config::keys::off;
use crate::config::keys::{choice, default, group, keys, optional, required};

keys! {
    /// What every optimizer takes.
    pub struct OptimizerCommon {
        group: "optimizer",
    }
    /// The peak learning rate (a resume may lower it: the optimizer's moments stay valid).
    lr: f64 = required()
        .range(|v| v > 0.0, "greater than 0 (e.g. 2e-5)")
        .resume_may_change(),
    /// PyTorch's fused kernel choice; the update is the same.
    fused: Option<bool> = optional(),
}

keys! {
    /// Adam's and AdamW's moments.
    pub struct AdamMoments {
        group: "Adam's moments",
    }
    /// The moment decays.
    betas: (f64, f64) = default(|| (0.9, 0.999)),
    /// The denominator term.
    eps: f64 = default(|| 1e-8),
    /// AMSGrad: only False.
    amsgrad: bool = off().refuse("AMSGrad is not supported; remove `amsgrad` or set it to False"),
}

keys! {
    /// `torch.optim.AdamW`'s settings.
    pub struct AdamWKeys {}
    /// Its learning rate.
    #[serde(flatten)]
    common: OptimizerCommon = group(),
    /// Decoupled weight decay (torch.optim.AdamW's default, 0.01).
    weight_decay: f64 = default(|| 0.01),
    /// Its moments.
    #[serde(flatten)]
    moments: AdamMoments = group(),
}

keys! {
    /// `torch.optim.Adam`'s settings.
    pub struct AdamKeys {}
    /// Its learning rate.
    #[serde(flatten)]
    common: OptimizerCommon = group(),
    /// The L2 penalty added to the gradient (torch.optim.Adam's default, 0).
    weight_decay: f64 = default(|| 0.0),
    /// Its moments.
    #[serde(flatten)]
    moments: AdamMoments = group(),
}

keys! {
    /// `torch.optim.SGD`'s settings.
    pub struct SgdKeys {}
    /// Its learning rate.
    #[serde(flatten)]
    common: OptimizerCommon = group(),
    /// The L2 penalty added to the gradient (torch.optim.SGD's default, 0).
    weight_decay: f64 = default(|| 0.0),
    /// Momentum (0: plain SGD).
    momentum: f64 = default(|| 0.0),
}

choice! {
    /// The optimizer: AdamW, Adam or SGD with PyTorch's update rules.
    pub struct OptimizerConfig {
        section: "optimizer",
        component: OptimizerKind,
        settings: OptimizerSettings,
    }
    "tune.optim.AdamW": OptimizerKind::AdamW => AdamW(AdamWKeys),
    "tune.optim.Adam": OptimizerKind::Adam => Adam(AdamKeys),
    "tune.optim.SGD": OptimizerKind::Sgd => Sgd(SgdKeys),
}

impl OptimizerConfig {
    /// The peak learning rate.
    pub fn lr(&self) -> f64 {
        match &self.settings {
            OptimizerSettings::AdamW(k) => k.common.lr,
            OptimizerSettings::Adam(k) => k.common.lr,
            OptimizerSettings::Sgd(k) => k.common.lr,
        }
    }
}

keys! {
    /// A schedule's linear warm-up.
    pub struct Warmup {
        group: "warm-up",
    }
    /// Steps of linear warm-up from 0.
    num_warmup_steps: usize = default(|| 0),
}

keys! {
    /// `get_cosine_schedule_with_warmup`'s settings.
    pub struct CosineKeys {}
    /// Its warm-up.
    #[serde(flatten)]
    warmup: Warmup = group(),
    /// The number of half-periods over the run (torchtune's 0.5 decays once).
    num_cycles: f64 = default(|| 0.5),
}

keys! {
    /// A warm-up then a linear decay to 0, or a constant rate.
    pub struct WarmupKeys {}
    /// Its warm-up.
    #[serde(flatten)]
    warmup: Warmup = group(),
}

choice! {
    /// The learning-rate schedule (none: a constant rate).
    pub struct LrSchedulerConfig {
        section: "lr_scheduler",
        component: SchedulerKind,
        settings: SchedulerSettings,
    }
    "tune.lr_schedulers.cosine_with_warmup":
        SchedulerKind::CosineWithWarmup => Cosine(CosineKeys),
    "tune.lr_schedulers.linear_with_warmup":
        SchedulerKind::LinearWithWarmup => Linear(WarmupKeys),
    "tune.lr_schedulers.constant_with_warmup":
        SchedulerKind::ConstantWithWarmup => Constant(WarmupKeys),
}
