//! Every linear layer of the decoder: a frozen-or-trainable base weight in Hugging Face's
//! `[out, in]` layout, an optional bias, and an optional LoRA adapter kept separate so it can
//! be disabled (DPO's reference model) or merged (export).

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::fake_quant::{self, QuantScheme};
use super::lora::{self, Lora};

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
        let xw = base_in.matmul(weight.clone().transpose());
        let y = match &self.bias {
            Some(bias) => xw + bias.val().unsqueeze_dim(0),
            None => xw,
        };
        match &self.lora {
            Some(lora) if mode.adapters => match &lora.magnitude {
                // The adapter sees the unquantized input, as torchao's QAT+LoRA does.
                None => y + lora.forward(x, mode.train),
                // torchtune's DoRALinear: the whole output, bias included, rescaled per row;
                // dropout only on the adapter's input. (peft agrees without dropout or bias;
                // with dropout it rescales the base product of the dropped input instead.)
                Some(magnitude) => {
                    let scale = dora_scale(weight, lora, magnitude.val()).unsqueeze_dim(0);
                    (y + lora.forward(x, mode.train)) * scale
                }
            },
            _ => y,
        }
    }

    /// The base weight with the adapter folded in, for export: `W + scale * B A`, and for DoRA
    /// that weight's rows rescaled to the magnitude (as peft's `merge_and_unload`).
    pub fn merged_weight(&self) -> Tensor<B, 2> {
        match &self.lora {
            Some(lora) => {
                let adapted = self.weight.val() + lora.delta_weight();
                match &lora.magnitude {
                    Some(m) => {
                        let scale = m.val() / lora::row_norms(adapted.clone());
                        adapted * scale.unsqueeze_dim(1)
                    }
                    None => adapted,
                }
            }
            None => self.weight.val(),
        }
    }
}

/// DoRA's per-row factor `magnitude / ||W + scale * B A||` `[out]`, the norm detached as peft
/// and torchtune detach it (the DoRA paper's cheaper gradient: the norm is a constant to the
/// backward pass).
fn dora_scale<B: Backend>(
    weight: Tensor<B, 2>,
    lora: &Lora<B>,
    magnitude: Tensor<B, 1>,
) -> Tensor<B, 1> {
    // From detached inputs, so autodiff records none of it (no weight-sized tensor is kept
    // for a backward pass that would not use it).
    let delta = lora.b.val().detach().matmul(lora.a.val().detach()) * lora.scale;
    let norm = lora::row_norms(weight.detach() + delta);
    magnitude / norm
}
