//! Every linear layer of the decoder: a frozen-or-trainable base weight in Hugging Face's
//! `[out, in]` layout (or a frozen NF4 one, for QLoRA), an optional bias, and an optional LoRA
//! adapter kept separate so it can be disabled (DPO's reference model) or merged (export).

use std::sync::Arc;

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::constant;
use super::fake_quant::{self, QuantScheme};
use super::frozen_nf4::{FrozenNf4, Nf4Rows};
use super::lora::{self, Lora};
use crate::kernels::matmul;

#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// The float base weight; `None` exactly when `nf4` holds it (two fields, not an enum, so
    /// burn names the parameter `weight` as Hugging Face does). Read through [`Linear::base`].
    weight: Option<Param<Tensor<B, 2>>>,
    /// The base weight in NF4 (QLoRA): frozen, dequantized per use, no gradient.
    #[module(skip)]
    nf4: Option<Arc<FrozenNf4>>,
    /// FSDP: this rank's rows of the NF4 base weight instead of `nf4`; the layer runs only
    /// once gathered (`Linear::with_gathered_nf4`).
    #[module(skip)]
    nf4_rows: Option<Arc<Nf4Rows>>,
    /// FSDP's per-rank load: the whole weight's rows, when `weight` holds only this rank's.
    #[module(skip)]
    full_out: Option<usize>,
    pub bias: Option<Param<Tensor<B, 1>>>,
    pub lora: Option<Lora<B>>,
    /// Fake quantization for QAT; `None` trains in plain floating point.
    pub quant: Option<QuantScheme>,
}

/// A linear layer's base weight.
enum Base<'a, B: Backend> {
    Float(&'a Param<Tensor<B, 2>>),
    /// Frozen NF4 (QLoRA).
    Nf4(&'a Arc<FrozenNf4>),
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
            weight: Some(Param::from_tensor(weight)),
            nf4: None,
            nf4_rows: None,
            full_out: None,
            bias: bias.map(Param::from_tensor),
            lora: None,
            quant: None,
        }
    }

    /// A layer whose frozen base weight is stored in NF4.
    pub fn new_nf4(weight: FrozenNf4, bias: Option<Tensor<B, 1>>) -> Self {
        Self {
            weight: None,
            nf4: Some(Arc::new(weight)),
            nf4_rows: None,
            full_out: None,
            bias: bias.map(Param::from_tensor),
            lora: None,
            quant: None,
        }
    }

    /// FSDP's per-rank load of an NF4 base: a layer holding only this rank's quantized rows
    /// of its base weight (it runs once gathered, as a layer [`Self::shard_nf4`] made).
    pub fn new_nf4_rows(rows: Nf4Rows, bias: Option<Tensor<B, 1>>) -> Self {
        Self {
            weight: None,
            nf4: None,
            nf4_rows: Some(Arc::new(rows)),
            full_out: None,
            bias: bias.map(Param::from_tensor),
            lora: None,
            quant: None,
        }
    }

    /// Replaces the base weight with a frozen NF4 one (the float weight is released).
    pub fn set_nf4(&mut self, weight: FrozenNf4) {
        self.nf4 = Some(Arc::new(weight));
        self.nf4_rows = None;
        self.weight = None;
    }

    /// The NF4 base weight, when the layer has one.
    pub fn nf4(&self) -> Option<&FrozenNf4> {
        self.nf4.as_deref()
    }

    /// FSDP: keeps quantized rows `rows` of the NF4 base weight only. A float weight, or an
    /// NF4 one whose rows do not hold whole blocks, stays as it is (whole on every rank).
    pub fn shard_nf4(&mut self, rows: std::ops::Range<usize>) {
        if let Some(piece) = self.nf4.as_ref().and_then(|q| q.rows(rows)) {
            self.nf4_rows = Some(Arc::new(piece));
            self.nf4 = None;
        }
    }

    /// This rank's rows of the NF4 base weight, when sharded.
    pub fn nf4_rows(&self) -> Option<&Nf4Rows> {
        self.nf4_rows.as_deref()
    }

    /// The layer with `whole` (gathered from every rank's [`Self::nf4_rows`]) as its NF4 base.
    pub fn with_gathered_nf4(&self, whole: FrozenNf4) -> Self {
        let mut gathered = self.clone();
        gathered.nf4 = Some(Arc::new(whole));
        gathered.nf4_rows = None;
        gathered
    }

    /// The base weight, float or NF4: every constructor and setter leaves exactly one.
    fn base(&self) -> Base<'_, B> {
        match (&self.weight, &self.nf4) {
            (Some(w), _) => Base::Float(w),
            (None, Some(q)) => Base::Nf4(q),
            (None, None) if self.nf4_rows.is_some() => panic!(
                "invariant: a layer holding rows of an NF4 weight runs only gathered (`CausalLm::layer`)"
            ),
            (None, None) => panic!(
                "a linear layer without a base weight: `Linear`'s constructors and setters always set one"
            ),
        }
    }

    /// FSDP's per-rank load: the layer holds this rank's rows of a `rows`-row weight.
    pub fn set_full_rows(&mut self, rows: usize) {
        self.full_out = Some(rows);
    }

    /// `[out, in]` (the whole weight's, for FSDP's rows of it).
    fn shape(&self) -> [usize; 2] {
        if let Some(rows) = &self.nf4_rows {
            return rows.full;
        }
        match self.base() {
            Base::Float(w) => {
                let [out, inp] = w.val().dims();
                [self.full_out.unwrap_or(out), inp]
            }
            Base::Nf4(q) => q.shape(),
        }
    }

    pub fn in_features(&self) -> usize {
        self.shape()[1]
    }

    pub fn out_features(&self) -> usize {
        self.shape()[0]
    }

    /// The base weight `[out, in]` (dequantized when stored in NF4), without the adapter.
    pub fn base_weight(&self) -> Tensor<B, 2> {
        self.base_weight_on(&self.device())
    }

    /// [`Self::base_weight`], an NF4 one dequantized onto `device` (an NF4 layer with neither
    /// adapter nor bias holds no tensor to take the device from).
    pub fn base_weight_on(&self, device: &B::Device) -> Tensor<B, 2> {
        match self.base() {
            Base::Float(w) => w.val(),
            // In the device's float dtype, as the float weight would be.
            Base::Nf4(q) => q.to_tensor::<B>(device),
        }
    }

    /// The base weight as an export holds it: an NF4 base dequantized to bf16, as torchtune's
    /// QLoRA state-dict hook saves it whatever the model dtype.
    pub fn export_base_weight(&self) -> Tensor<B, 2> {
        match self.base() {
            Base::Nf4(q) => {
                let [out, inp] = q.shape();
                let values = q.dequantize_for_export();
                Tensor::from_data(
                    burn::tensor::TensorData::new(values, [out, inp]),
                    &self.device(),
                )
            }
            Base::Float(_) => self.base_weight(),
        }
    }

    /// The float base weight's parameter (`None` for an NF4 base, which has none).
    pub fn weight_param(&self) -> Option<&Param<Tensor<B, 2>>> {
        self.weight.as_ref()
    }

    /// Replaces the base weight with a float one (a merged export's).
    pub fn set_weight(&mut self, weight: Tensor<B, 2>) {
        self.weight = Some(Param::from_tensor(weight));
        self.nf4 = None;
        self.nf4_rows = None;
    }

    fn device(&self) -> B::Device {
        match (&self.weight, &self.lora, &self.bias) {
            (Some(w), _, _) => w.val().device(),
            (_, Some(l), _) => l.a.val().device(),
            (_, _, Some(b)) => b.val().device(),
            _ => Default::default(),
        }
    }

    /// `x` is `[..., in]` flattened to `[rows, in]`; returns `[rows, out]`.
    pub fn forward(&self, x: Tensor<B, 2>, mode: ForwardMode) -> Tensor<B, 2> {
        let quant = self.quant.filter(|_| mode.fake_quant);
        let xw = match self.base() {
            Base::Float(weight) => {
                let mut weight = weight.val();
                let base_in = match quant {
                    Some(scheme) => {
                        weight = fake_quant::weight(weight, scheme);
                        fake_quant::activation(x.clone(), scheme)
                    }
                    None => x.clone(),
                };
                matmul(base_in, weight.transpose())
            }
            Base::Nf4(q) => super::nf4_linear::nf4_linear(x.clone(), q),
        };
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
                    let weight = self.dora_base_weight(quant);
                    let scale = dora_scale(weight, lora, magnitude.val()).unsqueeze_dim(0);
                    (y + lora.forward(x, mode.train)) * scale
                }
            },
            _ => y,
        }
    }

    /// The base weight DoRA normalises: the fake-quantized one under QAT (refused with DoRA
    /// by the config checks, kept consistent here), the dequantized one for NF4.
    fn dora_base_weight(&self, quant: Option<QuantScheme>) -> Tensor<B, 2> {
        let weight = self.base_weight();
        match quant {
            Some(scheme) if self.weight.is_some() => fake_quant::weight(weight, scheme),
            _ => weight,
        }
    }

    /// The base weight with the adapter folded in, for export: `W + scale * B A`, and for DoRA
    /// that weight's rows rescaled to the magnitude (as peft's `merge_and_unload`); an NF4 `W`
    /// as exported (bf16), as torchtune merges it.
    pub fn merged_weight(&self) -> Tensor<B, 2> {
        match &self.lora {
            Some(lora) => {
                // Constants: an export records nothing for a backward pass (what autodiff
                // recorded here would be kept until the next step's backward).
                let adapted = constant(self.export_base_weight()) + constant(lora.delta_weight());
                match &lora.magnitude {
                    Some(m) => {
                        let scale = constant(m.val()) / lora::row_norms(adapted.clone());
                        adapted * scale.unsqueeze_dim(1)
                    }
                    None => adapted,
                }
            }
            None => self.export_base_weight(),
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
    // From constant inputs, so autodiff records none of it (no weight-sized tensor is kept
    // for a backward pass that would not use it).
    let delta = matmul(constant(lora.b.val()), constant(lora.a.val())) * lora.scale;
    let norm = lora::row_norms(constant(weight) + delta);
    magnitude / norm
}
