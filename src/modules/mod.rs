//! Building blocks shared by every model: linear layers with LoRA and fake quantization, norms.

pub mod dropout;
pub mod fake_quant;
pub mod frozen_nf4;
pub mod linear;
pub mod lora;
pub mod nf4;
pub mod nf4_linear;
pub mod nf4_panels;
pub mod norm;

pub use linear::{ForwardMode, Linear};

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// `t` as a constant: no autodiff graph and no gradient. burn's `detach` keeps a parameter's
/// `require_grad`, so ops on a detached parameter would still be recorded, their inputs kept
/// until the next backward pass and a gradient computed that nobody reads.
pub fn constant<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    t.set_require_grad(false)
}
pub use lora::{Lora, LoraSettings};
pub use norm::RmsNorm;
