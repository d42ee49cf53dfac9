//! Training: losses, optimizers, schedules, metrics and the trainer core every recipe shares.

pub mod grads;
pub mod loss;
pub mod optimizer;
pub mod schedule;
pub mod step;
