//! What one optimizer step reports ([`StepDone`]) and where its time went ([`StepTimes`]).

use std::time::Duration;

use super::metrics::MetricName;
use super::parallel::GradientBytes;
use crate::interrupt::Signal;

/// Where a step's time went, measured when `TrainerSettings::time_phases` is set.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// The loss steps' forward passes.
    pub forward: Duration,
    /// The backward passes and summing the micro-batches' gradients. A loss step that computes
    /// its gradients itself (activation checkpointing, the chunked output) interleaves them
    /// with its forward pass: all of its time counts here.
    pub backward: Duration,
    /// Clipping, the optimizer step and, with ZeRO-1, gathering the updated parameters.
    pub optimizer: Duration,
}

/// One optimizer step, done.
#[derive(Debug, Clone, PartialEq)]
pub struct StepDone {
    /// The mean loss over the step's units (over the world).
    pub loss: f64,
    pub lr: f64,
    /// The gradient norm before clipping, when clipping is on (as torchtune logs it).
    pub grad_norm: Option<f64>,
    /// Tokens for throughput (over the world).
    pub tokens: usize,
    /// The recipe's metrics, means over the step's units.
    pub metrics: Vec<(MetricName, f64)>,
    /// A stop signal came during the step (on any worker): the run ends after it.
    pub stop: Option<Signal>,
    /// With `TrainerSettings::time_phases`.
    pub times: Option<StepTimes>,
    /// Bytes of the step's gradients this rank held (with FSDP its rows of the sharded
    /// parameters'), on the device and, with FSDP's CPU offload, in host memory.
    pub gradient_bytes: GradientBytes,
    /// Activation offloading: the most bytes of layer inputs one pass of the step held in host
    /// memory (0 without it).
    pub offloaded_activation_bytes: usize,
    /// On a GPU: the most device memory the step's samples saw (`device::sample_device_memory`).
    pub device_memory: Option<crate::device::DeviceMemory>,
}
