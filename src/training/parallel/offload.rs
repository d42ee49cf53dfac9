//! FSDP's CPU offload (`fsdp_cpu_offload: True`), the trainer's side. The model's rows and
//! their gradients are parked in host memory by its shards (`models::host_rows`); this keeps
//! their optimizer state there too and runs their optimizer step there, with the CPU's fused
//! AdamW (`kernels::optim`), as torchtune's FSDP2 `CPUOffloadPolicy` steps its CPU optimizer.
//!
//! Invariants:
//! - The state of a parked parameter lives here only (the device's optimizer holds none of it:
//!   a resumed run's restored state is moved here, [`Offload::adopt_state`]); the state of
//!   every other parameter (LoRA's adapters, which do not shard) stays on the device.
//! - Both optimizers count the same steps: this one takes the device's count at each update.
//! - The update, the gradient norm and the checkpointed state are the same values as without
//!   offload: the same optimizer code on the same rows, the norm summed in the same order and
//!   precision.

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor};

use crate::checkpoint::HostTensor;
use crate::models::CausalLm;
use crate::models::host_rows::{Host, HostRows, to_device, to_host};
use crate::training::optimizer::{Optimizer, OptimizerSettings};

/// The optimizer state of the rows an offloading run keeps in host memory.
#[derive(Debug)]
pub struct Offload {
    optimizer: Optimizer<Host>,
}

/// The host rows of `model`'s shards; `None` when it does not offload.
fn host_rows<B: Backend>(model: &CausalLm<B>) -> Option<&HostRows> {
    model.shards.as_ref()?.offloaded()
}

impl Offload {
    pub fn new(settings: OptimizerSettings) -> Self {
        Self {
            optimizer: Optimizer::new(settings),
        }
    }

    /// The squared L2 norm of the step's gradient rows in host memory, summed in fp32 in the
    /// model's parameter order as the device sums its own (`step::squared_grad_norm`).
    pub fn squared_grad_norm<B: Backend>(model: &CausalLm<B>) -> f64 {
        let Some(host) = host_rows(model) else {
            return 0.0;
        };
        let mut total: Option<Tensor<Host, 1>> = None;
        for p in model.trainable_params() {
            if let Some(g) = host.grad(&p.id) {
                let square = crate::precision::to_f32(g).powi_scalar(2).sum();
                total = Some(match total.take() {
                    Some(t) => t + square,
                    None => square,
                });
            }
        }
        total.map_or(0.0, |t| t.into_scalar().elem::<f64>())
    }

    /// Bytes of the step's gradient rows in host memory.
    pub fn gradient_bytes<B: Backend>(model: &CausalLm<B>) -> usize {
        host_rows(model).map_or(0, HostRows::grad_bytes)
    }

    /// The optimizer step of every parked row that has a gradient this step (each multiplied by
    /// `scale` first, as on the device), the device's optimizer being at step `step`.
    pub fn update<B: AutodiffBackend>(
        &mut self,
        model: &CausalLm<B>,
        (lr, scale): (f64, f64),
        step: u64,
    ) {
        let Some(host) = host_rows(model) else {
            return;
        };
        self.optimizer.step = step;
        let mut grads = host.take_grads();
        for p in model.trainable_params() {
            let Some(grad) = grads.remove(&p.id) else {
                continue;
            };
            let Some(value) = host.take_value(&p.id) else {
                continue;
            };
            let updated = self.optimizer.update(&p.name, value, grad, scale, lr);
            host.park(p.id, updated);
        }
    }

    /// Parameter `name`'s moments, as [`Optimizer::moments`] lists them, copied to `device`.
    pub fn moments_on<X: Backend>(
        &self,
        name: &str,
        device: &X::Device,
    ) -> Vec<(&'static str, Option<Tensor<X, 1>>)> {
        self.optimizer
            .moments(name)
            .into_iter()
            .map(|(kind, t)| (kind, t.map(|t| to_device::<X, 1>(t, device))))
            .collect()
    }

    /// The state as named host tensors, as [`Optimizer::state_dict`] names them.
    pub fn state_dict(&self) -> Vec<(String, HostTensor)> {
        self.optimizer.state_dict()
    }

    /// Bytes of the state kept in host memory.
    pub fn state_bytes(&self) -> usize {
        self.optimizer.state_bytes()
    }

    /// After a resume restored the state into the device's `optimizer` (and its rows were
    /// kept): moves the state of every parked parameter of `model` here, in its dtype.
    pub fn adopt_state<B: AutodiffBackend>(
        &mut self,
        model: &CausalLm<B>,
        optimizer: &mut Optimizer<B::InnerBackend>,
    ) {
        let Some(shards) = model.shards.as_ref() else {
            return;
        };
        self.optimizer.step = optimizer.step;
        for p in model.trainable_params() {
            if !shards.is_parked(&p.id) {
                continue;
            }
            if let Some((m, v)) = optimizer.take_moments(&p.name) {
                self.optimizer
                    .put_moments(&p.name, to_host(m), v.map(to_host));
            }
        }
    }
}
