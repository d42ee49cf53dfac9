//! Every linear layer of the decoder: a frozen-or-trainable base weight in Hugging Face's
//! `[out, in]` layout, an optional bias, and an optional LoRA adapter kept separate so it can
//! be disabled (DPO's reference model) or merged (export).

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::fake_quant::{self, QuantScheme};
use super::lora::Lora;

#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
    pub lora: Option<Lora<B>>,
    /// Fake quantization for QAT; `None` trains in plain floating point.
    pub quant: Option<QuantScheme>,
}

/// Per-forward switches, so one model serves as policy and reference, or trains with
/// fake quantization enabled only after a warm-up.
#[derive(Debug, Clone, Copy)]
pub struct ForwardMode {
    pub adapters: bool,
    pub fake_quant: bool,
    /// Training mode enables LoRA dropout.
    pub train: bool,
}

impl Default for ForwardMode {
    fn default() -> Self {
        Self {
            adapters: true,
            fake_quant: true,
            train: false,
        }
    }
}

impl<B: Backend> Linear<B> {
    pub fn new(weight: Tensor<B, 2>, bias: Option<Tensor<B, 1>>) -> Self {
        Self {
            weight: Param::from_tensor(weight),
            bias: bias.map(Param::from_tensor),
            lora: None,
            quant: None,
        }
    }

    pub fn in_features(&self) -> usize {
        self.weight.val().dims()[1]
    }

    pub fn out_features(&self) -> usize {
        self.weight.val().dims()[0]
    }

    /// `x` is `[..., in]` flattened to `[rows, in]`; returns `[rows, out]`.
    pub fn forward(&self, x: Tensor<B, 2>, mode: ForwardMode) -> Tensor<B, 2> {
        let quant = self.quant.filter(|_| mode.fake_quant);
        let mut weight = self.weight.val();
        let base_in = match quant {
            Some(scheme) => {
                weight = fake_quant::weight(weight, scheme);
                fake_quant::activation(x.clone(), scheme)
            }
            None => x.clone(),
        };
        let mut y = base_in.matmul(weight.transpose());
        if let Some(bias) = &self.bias {
            y = y + bias.val().unsqueeze_dim(0);
        }
        match &self.lora {
            // The adapter sees the unquantized input, as torchao's QAT+LoRA does.
            Some(lora) if mode.adapters => y + lora.forward(x, mode.train),
            _ => y,
        }
    }

    /// The base weight with the adapter folded in, for export.
    pub fn merged_weight(&self) -> Tensor<B, 2> {
        match &self.lora {
            Some(lora) => self.weight.val() + lora.delta_weight(),
            None => self.weight.val(),
        }
    }
}
