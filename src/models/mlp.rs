//! A gated MLP (SwiGLU, GeGLU for Gemma, gpt-oss's clamped SwiGLU): the dense feed-forward block of a decoder layer,
//! and each expert of a mixture-of-experts block.

use burn::module::Module;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::args::Activation;
use crate::kernels::swiglu;
use crate::modules::{ForwardMode, Linear, Lora};

#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    pub gate_proj: Linear<B>,
    pub up_proj: Linear<B>,
    pub down_proj: Linear<B>,
    /// gpt-oss's experts: peft's LoRA of the fused `gate_up_proj` parameter (`target_parameters`,
    /// its `ParamWrapper`), one adapter over both halves: A `[rank, hidden]`, B
    /// `[2 * intermediate, rank]` whose rows interleave the gate's and the up projection's
    /// outputs as the fused weight's columns do (gate at even, up at odd). Its factors are this
    /// expert's slice of peft's stacked ones ([`crate::model_io::peft_experts`]).
    pub lora: Option<Lora<B>>,
    pub activation: Activation,
}

impl<B: Backend> Mlp<B> {
    pub fn new(
        gate_proj: Linear<B>,
        up_proj: Linear<B>,
        down_proj: Linear<B>,
        activation: Activation,
    ) -> Self {
        Self {
            gate_proj,
            up_proj,
            down_proj,
            lora: None,
            activation,
        }
    }

    pub fn forward(&self, x: Tensor<B, 3>, mode: ForwardMode) -> Tensor<B, 3> {
        let [batch, seq, hidden] = x.dims();
        self.forward_rows(x.reshape([batch * seq, hidden]), mode)
            .reshape([batch, seq, hidden])
    }

    /// `[rows, hidden]` -> `[rows, hidden]`.
    pub fn forward_rows(&self, rows: Tensor<B, 2>, mode: ForwardMode) -> Tensor<B, 2> {
        let mut gate = self.gate_proj.forward(rows.clone(), mode);
        let mut up = self.up_proj.forward(rows.clone(), mode);
        if let Some(lora) = self.lora.as_ref().filter(|_| mode.adapters) {
            let [n, width] = gate.dims();
            let delta = lora.forward(rows, mode.train).reshape([n, width, 2]);
            let half = |i: usize| delta.clone().narrow(2, i, 1).reshape([n, width]);
            gate = gate + half(0);
            up = up + half(1);
        }
        let hidden_activation = match self.activation {
            Activation::Silu => swiglu(gate, up),
            Activation::GeluTanh => gelu_tanh(gate) * up,
            Activation::ClampedSwiglu { alpha, limit } => clamped_swiglu(gate, up, alpha, limit),
        };
        self.down_proj.forward(hidden_activation, mode)
    }

    /// The gate and up weights with the fused gate/up adapter folded in (constants: an export
    /// records nothing for a backward pass), when the expert has one.
    pub fn merged_gate_up(&self) -> Option<(Tensor<B, 2>, Tensor<B, 2>)> {
        let lora = self.lora.as_ref()?;
        let delta = crate::modules::constant(lora.delta_weight());
        let [rows, hidden] = delta.dims();
        let pairs = delta.reshape([rows / 2, 2, hidden]);
        let half = |i: usize| pairs.clone().narrow(1, i, 1).reshape([rows / 2, hidden]);
        let merged = |linear: &Linear<B>, i: usize| {
            let base = crate::modules::constant(linear.merged_weight());
            let device = base.device();
            base + half(i).to_device(&device)
        };
        Some((merged(&self.gate_proj, 0), merged(&self.up_proj, 1)))
    }
}

/// gpt-oss's gate: `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with
/// `g = min(gate, limit)`, as transformers' `GptOssExperts._apply_gate`.
fn clamped_swiglu<B: Backend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
    alpha: f64,
    limit: f64,
) -> Tensor<B, D> {
    let gate = gate.clamp_max(limit);
    let up = up.clamp(-limit, limit);
    let glu = gate.clone() * burn::tensor::activation::sigmoid(gate * alpha);
    (up + 1.0) * glu
}

/// `gelu_pytorch_tanh`: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
fn gelu_tanh<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let inner =
        (x.clone() + x.clone().powi_scalar(3) * 0.044715) * (2.0 / std::f64::consts::PI).sqrt();
    x * (inner.tanh() + 1.0) * 0.5
}
