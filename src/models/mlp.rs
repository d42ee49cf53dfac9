//! A gated MLP (SwiGLU, or GeGLU for Gemma): the dense feed-forward block of a decoder layer,
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
        };
        self.down_proj.forward(hidden_activation, mode)
    }
}

/// `gelu_pytorch_tanh`: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
fn gelu_tanh<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let inner =
        (x.clone() + x.clone().powi_scalar(3) * 0.044715) * (2.0 / std::f64::consts::PI).sqrt();
    x * (inner.tanh() + 1.0) * 0.5
}
