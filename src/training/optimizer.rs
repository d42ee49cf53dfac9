//! Optimizers with PyTorch's exact update rules (`torch.optim.AdamW`, `Adam`, `SGD`), keeping
//! their state by parameter name so checkpoints are readable and resumable.

use std::collections::BTreeMap;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::checkpoint::HostTensor;
use crate::kernels::{self, optim::AdamStep};

/// Which update rule: the optimizer a config's `optimizer._component_` names resolves to one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerKind {
    /// Decoupled weight decay (`torch.optim.AdamW`).
    AdamW,
    /// L2 penalty added to the gradient (`torch.optim.Adam`).
    Adam,
    /// `torch.optim.SGD`, with `momentum` when it is not 0.
    Sgd,
}

#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerSettings {
    pub kind: OptimizerKind,
    pub weight_decay: f64,
    /// Adam's moment decays (unused by SGD).
    pub betas: (f64, f64),
    pub eps: f64,
    /// SGD's momentum (unused by Adam).
    pub momentum: f64,
}

/// Per-parameter state, flattened to 1-D so one code path serves every rank.
#[derive(Debug)]
struct ParamState<B: Backend> {
    exp_avg: Tensor<B, 1>,
    exp_avg_sq: Option<Tensor<B, 1>>,
}

#[derive(Debug)]
pub struct Optimizer<B: Backend> {
    pub settings: OptimizerSettings,
    /// Completed optimizer steps (PyTorch's per-parameter `step`, equal for all parameters).
    pub step: u64,
    state: BTreeMap<String, ParamState<B>>,
}

impl<B: Backend> Optimizer<B> {
    pub fn new(settings: OptimizerSettings) -> Self {
        Self {
            settings,
            step: 0,
            state: BTreeMap::new(),
        }
    }

    /// Call once per optimizer step, before the per-parameter updates.
    pub fn begin_step(&mut self) {
        self.step += 1;
    }

    /// Updates one parameter (`[n]`, flattened) with its gradient (any shape of `n` elements:
    /// the fused CPU update reads a transposed weight gradient without copying it first) times
    /// `grad_scale` (token normalisation and clipping folded together) and returns the new value.
    pub fn update<const D: usize>(
        &mut self,
        name: &str,
        param: Tensor<B, 1>,
        grad: Tensor<B, D>,
        grad_scale: f64,
        lr: f64,
    ) -> Tensor<B, 1> {
        let n = param.dims()[0];
        let s = &self.settings;
        let t = self.step.max(1) as i32;
        match s.kind {
            OptimizerKind::AdamW | OptimizerKind::Adam => {
                let (beta1, beta2) = s.betas;
                // The moments are taken out of the map (and put back below) so each tensor
                // has one owner and can be updated in place.
                let (exp_avg, exp_avg_sq) = match self.state.remove(name) {
                    Some(ParamState {
                        exp_avg,
                        exp_avg_sq: Some(sq),
                    }) => (exp_avg, sq),
                    _ => (param.zeros_like(), param.zeros_like()),
                };
                let adamw = s.kind == OptimizerKind::AdamW;
                let bias1 = 1.0 - beta1.powi(t);
                let bias2_sqrt = (1.0 - beta2.powi(t)).sqrt();
                let constants = AdamStep {
                    grad_scale: grad_scale as f32,
                    decay: if adamw {
                        (1.0 - lr * s.weight_decay) as f32
                    } else {
                        1.0
                    },
                    l2: if adamw { 0.0 } else { s.weight_decay as f32 },
                    beta1: beta1 as f32,
                    one_minus_beta1: (1.0 - beta1) as f32,
                    beta2: beta2 as f32,
                    one_minus_beta2: (1.0 - beta2) as f32,
                    bias2_sqrt: bias2_sqrt as f32,
                    eps: s.eps as f32,
                    step_size: (lr / bias1) as f32,
                };
                let (new, m, v) =
                    match kernels::optim::adam(param, grad, exp_avg, exp_avg_sq, constants) {
                        Ok(updated) => updated,
                        // Composed from burn's ops on other backends.
                        Err((param, grad, exp_avg, exp_avg_sq)) => {
                            let grad = scaled(grad, grad_scale);
                            let grad = if adamw || s.weight_decay == 0.0 {
                                grad
                            } else {
                                grad + param.clone() * s.weight_decay
                            };
                            let param = if adamw {
                                param * (1.0 - lr * s.weight_decay)
                            } else {
                                param
                            };
                            let m = exp_avg * beta1 + grad.clone() * (1.0 - beta1);
                            let v = exp_avg_sq * beta2 + grad.clone() * grad * (1.0 - beta2);
                            let denom = v.clone().sqrt() / bias2_sqrt + s.eps;
                            let new = param - m.clone() / denom * (lr / bias1);
                            (new, m, v)
                        }
                    };
                self.state.insert(
                    name.to_string(),
                    ParamState {
                        exp_avg: m,
                        exp_avg_sq: Some(v),
                    },
                );
                new
            }
            OptimizerKind::Sgd => {
                let momentum = s.momentum;
                let grad = scaled(grad.reshape([n]), grad_scale);
                let grad = if s.weight_decay != 0.0 {
                    grad + param.clone() * s.weight_decay
                } else {
                    grad
                };
                let step = if momentum != 0.0 {
                    let buf = match self.state.get(name) {
                        Some(state) => state.exp_avg.clone() * momentum + grad,
                        None => grad,
                    };
                    self.state.insert(
                        name.to_string(),
                        ParamState {
                            exp_avg: buf.clone(),
                            exp_avg_sq: None,
                        },
                    );
                    buf
                } else {
                    grad
                };
                param - step * lr
            }
        }
    }

    /// The kinds of state this optimizer keeps per parameter (`exp_avg`, `exp_avg_sq`), each
    /// with `name`'s tensor where this optimizer holds one. The kinds depend only on the
    /// settings, so every data-parallel rank lists the same ones (see
    /// `sharded_optimizer::gather_optimizer_state`).
    pub fn moments(&self, name: &str) -> Vec<(&'static str, Option<Tensor<B, 1>>)> {
        let state = self.state.get(name);
        match self.settings.kind {
            OptimizerKind::AdamW | OptimizerKind::Adam => vec![
                ("exp_avg", state.map(|s| s.exp_avg.clone())),
                ("exp_avg_sq", state.and_then(|s| s.exp_avg_sq.clone())),
            ],
            OptimizerKind::Sgd if self.settings.momentum != 0.0 => {
                vec![("exp_avg", state.map(|s| s.exp_avg.clone()))]
            }
            OptimizerKind::Sgd => Vec::new(),
        }
    }

    /// Takes parameter `name`'s moments out (`exp_avg`, and `exp_avg_sq` where kept), to be
    /// kept by another optimizer ([`Self::put_moments`]: FSDP's CPU offload after a resume).
    pub fn take_moments(&mut self, name: &str) -> Option<(Tensor<B, 1>, Option<Tensor<B, 1>>)> {
        self.state.remove(name).map(|s| (s.exp_avg, s.exp_avg_sq))
    }

    /// Keeps moments another optimizer held for parameter `name` ([`Self::take_moments`]).
    pub fn put_moments(
        &mut self,
        name: &str,
        exp_avg: Tensor<B, 1>,
        exp_avg_sq: Option<Tensor<B, 1>>,
    ) {
        self.state.insert(
            name.to_string(),
            ParamState {
                exp_avg,
                exp_avg_sq,
            },
        );
    }

    /// Keeps the state of the parameters `keep` selects (a sharded rank after a resume).
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.state.retain(|name, _| keep(name));
    }

    /// FSDP after a resume restored whole moments: keeps elements `range(name)` of each
    /// parameter's moments that `range` names (a rank's rows); a moment already that short is
    /// kept as it is.
    pub fn narrow(&mut self, range: impl Fn(&str) -> Option<std::ops::Range<usize>>) {
        for (name, s) in self.state.iter_mut() {
            let Some(r) = range(name) else { continue };
            s.exp_avg = rows_of(&s.exp_avg, &r);
            s.exp_avg_sq = s.exp_avg_sq.as_ref().map(|t| rows_of(t, &r));
        }
    }

    /// Bytes of state held on the device (the moments of the parameters this optimizer
    /// updates: all of them, or a ZeRO-1 rank's share), for the metrics.
    pub fn state_bytes(&self) -> usize {
        let bytes = |t: &Tensor<B, 1>| t.shape().num_elements() * t.dtype().size();
        self.state
            .values()
            .map(|s| bytes(&s.exp_avg) + s.exp_avg_sq.as_ref().map_or(0, bytes))
            .sum()
    }

    /// The state as named host tensors (`exp_avg.<name>`, `exp_avg_sq.<name>`), for checkpoints.
    pub fn state_dict(&self) -> Vec<(String, HostTensor)> {
        let mut out = Vec::new();
        for (name, s) in &self.state {
            out.push((
                format!("exp_avg.{name}"),
                HostTensor::from_tensor(&s.exp_avg),
            ));
            if let Some(v) = &s.exp_avg_sq {
                out.push((format!("exp_avg_sq.{name}"), HostTensor::from_tensor(v)));
            }
        }
        out
    }

    /// Restores state saved by [`Self::state_dict`].
    pub fn load_state_dict(
        &mut self,
        step: u64,
        tensors: Vec<(String, HostTensor)>,
        device: &B::Device,
    ) {
        self.step = step;
        self.state.clear();
        let mut sq = BTreeMap::new();
        for (key, t) in tensors {
            if let Some(name) = key.strip_prefix("exp_avg_sq.") {
                sq.insert(name.to_string(), t);
            } else if let Some(name) = key.strip_prefix("exp_avg.") {
                let flat = HostTensor::new(vec![t.numel()], t.data);
                self.state.insert(
                    name.to_string(),
                    ParamState {
                        exp_avg: flat.to_tensor(device),
                        exp_avg_sq: None,
                    },
                );
            }
        }
        for (name, t) in sq {
            if let Some(s) = self.state.get_mut(&name) {
                s.exp_avg_sq = Some(HostTensor::new(vec![t.numel()], t.data).to_tensor(device));
            }
        }
    }
}

/// Elements `r` of a whole moment; one already that short is this rank's own.
fn rows_of<B: Backend>(t: &Tensor<B, 1>, r: &std::ops::Range<usize>) -> Tensor<B, 1> {
    if t.shape().num_elements() == r.len() {
        t.clone()
    } else {
        t.clone().slice(r.clone())
    }
}

/// `grad * scale`, skipping the pass over the gradient when the scale is 1.
fn scaled<B: Backend>(grad: Tensor<B, 1>, scale: f64) -> Tensor<B, 1> {
    if scale == 1.0 { grad } else { grad * scale }
}
