//! Fake quantization as torchao computes it for QAT, with straight-through gradients: the
//! forward pass sees quantized values, the backward pass treats quantization as identity.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// Which quantization a linear layer simulates during training.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantScheme {
    /// torchao `Int8DynActInt4WeightQATQuantizer`: int8 per-token asymmetric dynamic
    /// activations, int4 symmetric per-group weights.
    Int8DynActInt4Weight { group_size: usize },
    /// torchao `Int4WeightOnlyQATQuantizer`: int4 per-group weights only.
    Int4WeightOnly { group_size: usize },
    /// A model loaded from a quantized export of an `Int8DynActInt4Weight` run: its weights
    /// already hold int4 values (dequantized on load), so only the int8 dynamic activation
    /// quantization remains to simulate. Re-quantizing the weights would not be idempotent.
    Int8DynActOnly,
}

impl QuantScheme {
    /// The weight group size; `None` when the weights are not fake-quantized.
    pub fn group_size(self) -> Option<usize> {
        match self {
            Self::Int8DynActInt4Weight { group_size } | Self::Int4WeightOnly { group_size } => Some(group_size),
            Self::Int8DynActOnly => None,
        }
    }

    pub fn quantizes_activations(self) -> bool {
        matches!(self, Self::Int8DynActInt4Weight { .. } | Self::Int8DynActOnly)
    }

    /// The scheme for the same model after its weights were quantized for real (export).
    pub fn after_weight_export(self) -> Option<Self> {
        match self {
            Self::Int8DynActInt4Weight { .. } | Self::Int8DynActOnly => Some(Self::Int8DynActOnly),
            Self::Int4WeightOnly { .. } => None,
        }
    }
}

/// Quantized forward, identity backward. Written `q + (x - x.detach())` rather than the usual
/// `x + (q - x).detach()` because `x - x` is exactly zero, so the forward value is `q` to the
/// bit (the other form can be one ulp off), which the quantized export relies on.
fn straight_through<B: Backend, const D: usize>(x: Tensor<B, D>, quantized: Tensor<B, D>) -> Tensor<B, D> {
    quantized.detach() + (x.clone() - x.detach())
}

/// Symmetric int4 per group of `group_size` input features:
/// `scale = max|g| / 7.5` (at least f32 eps), `q = clamp(round(w * (1/scale)), -8, 7)`,
/// `w' = q * scale`. The multiplication by the reciprocal matches torchao to the bit.
pub fn int4_weight_values<B: Backend>(w: Tensor<B, 2>, group_size: usize) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let [out, inp] = w.dims();
    let groups = w.reshape([out * inp / group_size, group_size]);
    let scale = (groups.clone().abs().max_dim(1) / 7.5).clamp_min(f32::EPSILON);
    let q = (groups * scale.clone().recip()).round().clamp(-8.0, 7.0);
    (q, scale)
}

pub fn fake_quantize_weight<B: Backend>(w: Tensor<B, 2>, group_size: usize) -> Tensor<B, 2> {
    let shape = w.dims();
    let (q, scale) = int4_weight_values(w, group_size);
    (q * scale).reshape(shape)
}

/// Asymmetric int8 per token (last dimension), dynamic, as torchao's
/// `_choose_qparams_per_token_asymmetric` + `fake_quantize_per_token`.
pub fn fake_quantize_activation<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let (qmin, qmax) = (-128.0f32, 127.0f32);
    let min_val = x.clone().min_dim(D - 1).clamp_max(0.0);
    let max_val = x.clone().max_dim(D - 1).clamp_min(0.0);
    let scale = ((max_val.clone() - min_val.clone()) / (qmax - qmin)).clamp_min(f32::EPSILON);
    let descaled_min = min_val / scale.clone();
    let descaled_max = max_val / scale.clone();
    let from_min_error = descaled_min.clone() + qmin;
    let from_max_error = descaled_max.clone() + qmax;
    let use_min = (from_min_error + from_max_error).greater_elem(0.0);
    let zero_point = (descaled_max.neg() + qmax).mask_where(use_min, descaled_min.neg() + qmin);
    let zero_point = zero_point.clamp(qmin, qmax).round();
    let q = ((x * scale.clone().recip()).round() + zero_point.clone()).clamp(qmin, qmax);
    (q - zero_point) * scale
}

pub fn weight<B: Backend>(w: Tensor<B, 2>, scheme: QuantScheme) -> Tensor<B, 2> {
    match scheme.group_size() {
        Some(group_size) => {
            let quantized = fake_quantize_weight(w.clone().detach(), group_size);
            straight_through(w, quantized)
        }
        None => w,
    }
}

pub fn activation<B: Backend>(x: Tensor<B, 2>, scheme: QuantScheme) -> Tensor<B, 2> {
    if !scheme.quantizes_activations() {
        return x;
    }
    let quantized = fake_quantize_activation(x.clone().detach());
    straight_through(x, quantized)
}
