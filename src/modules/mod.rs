//! Building blocks shared by every model: linear layers with LoRA and fake quantization, norms.

pub mod fake_quant;
pub mod frozen_nf4;
pub mod linear;
pub mod lora;
pub mod nf4;
pub mod norm;

pub use linear::{ForwardMode, Linear};
pub use lora::{Lora, LoraSettings};
pub use norm::RmsNorm;
