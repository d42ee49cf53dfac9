//! A gated MLP (SwiGLU, GeGLU for Gemma, gpt-oss's clamped SwiGLU): the dense feed-forward block of a decoder layer,
//! and each expert of a mixture-of-experts block.

use burn::module::Module;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::args::Activation;
use crate::kernels::swiglu;
use crate::modules::{ForwardMode, Linear};

#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    pub gate_proj: Linear<B>,
    pub up_proj: Linear<B>,
    pub down_proj: Linear<B>,
    pub activation: Activation,
}

impl<B: Backend> Mlp<B> {
    pub fn forward(&self, x: Tensor<B, 3>, mode: ForwardMode) -> Tensor<B, 3> {
        let [batch, seq, hidden] = x.dims();
        self.forward_rows(x.reshape([batch * seq, hidden]), mode)
            .reshape([batch, seq, hidden])
    }

    /// `[rows, hidden]` -> `[rows, hidden]`.
    pub fn forward_rows(&self, rows: Tensor<B, 2>, mode: ForwardMode) -> Tensor<B, 2> {
        let gate = self.gate_proj.forward(rows.clone(), mode);
        let up = self.up_proj.forward(rows, mode);
        let hidden_activation = match self.activation {
            Activation::Silu => swiglu(gate, up),
            Activation::GeluTanh => gelu_tanh(gate) * up,
            Activation::ClampedSwiglu { alpha, limit } => clamped_swiglu(gate, up, alpha, limit),
        };
        self.down_proj.forward(hidden_activation, mode)
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
