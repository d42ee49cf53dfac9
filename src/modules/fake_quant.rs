//! Fake quantization as torchao computes it for QAT: the forward pass sees quantized values;
//! the backward pass is torchao's masked straight-through estimator.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::precision;

/// Which quantization a linear layer simulates during training.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantScheme {
    /// torchao `Int8DynActInt4WeightQATQuantizer`: int8 per-token asymmetric dynamic
    /// activations, int4 symmetric per-group weights.
    Int8DynActInt4Weight { group_size: usize },
    /// torchao `Int4WeightOnlyQATQuantizer`: int4 per-group weights only. Simplification:
    /// the same symmetric int4 weights as above (f32 scales), where torchao simulates
    /// tinygemm's asymmetric uint4 with bf16 scales and float zero points.
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
            Self::Int8DynActInt4Weight { group_size } | Self::Int4WeightOnly { group_size } => {
                Some(group_size)
            }
            Self::Int8DynActOnly => None,
        }
    }

    pub fn quantizes_activations(self) -> bool {
        matches!(
            self,
            Self::Int8DynActInt4Weight { .. } | Self::Int8DynActOnly
        )
    }

    /// The scheme for the same model after its weights were quantized for real (export).
    pub fn after_weight_export(self) -> Option<Self> {
        match self {
            Self::Int8DynActInt4Weight { .. } | Self::Int8DynActOnly => Some(Self::Int8DynActOnly),
            Self::Int4WeightOnly { .. } => None,
        }
    }
}

/// torchao's `_GenericFakeQuantize`: the forward value is the fake-quantized `dq`; the
/// gradient passes straight through to `x` where the integer value `q` lies strictly inside
/// `(qmin, qmax)` and is zero where it sits on a bound (torchao's mask is strict), and no
/// gradient flows into the dynamically chosen scales. `x - x.detach()` is exactly zero, so
/// the forward value is `dq` to the bit (which the quantized export relies on).
fn masked_straight_through<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    dq: Tensor<B, D>,
    q: Tensor<B, D>,
    (qmin, qmax): (f32, f32),
) -> Tensor<B, D> {
    let dtype = x.dtype();
    let inside = q.clone().greater_elem(qmin).float() * q.lower_elem(qmax).float();
    let inside = precision::to_dtype(inside, dtype);
    precision::to_dtype(dq, dtype).detach() + (x.clone() - x.detach()) * inside.detach()
}

/// Symmetric int4 per group of `group_size` input features, torchao's formula to the bit:
/// `scale = max|g| / 7.5` (at least f32 eps), `q = clamp(round(w * (1/scale)), -8, 7)`.
/// Returns `q` `[groups, group_size]` and `scale` `[groups, 1]`, both without gradient.
pub fn int4_weight_values<B: Backend>(
    w: Tensor<B, 2>,
    group_size: usize,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let [out, inp] = w.dims();
    // fp32 quantization parameters whatever the weight's dtype, as torchao computes them.
    let groups =
        precision::to_f32(super::constant(w)).reshape([out * inp / group_size, group_size]);
    let scale = (groups.clone().abs().max_dim(1) / 7.5).clamp_min(f32::EPSILON);
    // `+ 0.0` turns round's -0 into +0, as torchao's integer arithmetic does.
    let q = ((groups * scale.clone().recip()).round() + 0.0).clamp(-8.0, 7.0);
    (q, scale)
}

/// The fake-quantized weight `q * scale`, same shape as `w`, with torchao's masked
/// straight-through gradient.
pub fn fake_quantize_weight<B: Backend>(w: Tensor<B, 2>, group_size: usize) -> Tensor<B, 2> {
    let shape = w.dims();
    let (q, scale) = int4_weight_values(w.clone(), group_size);
    let dq = (q.clone() * scale).reshape(shape);
    masked_straight_through(w, dq, q.reshape(shape), (-8.0, 7.0))
}

/// Asymmetric int8 per token (last dimension), dynamic, as torchao's `IntxFakeQuantizer`
/// computes it (`choose_qparams_affine` + fake quantization): `scale = (max(x, 0) -
/// min(x, 0)) / 255` (at least f32 eps), `zp = clamp(-128 - round(min / scale), -128, 127)`,
/// `q = clamp(round(x * (1/scale)) + zp, -128, 127)`, `x' = (q - zp) * scale`; gradient as
/// [`masked_straight_through`].
pub fn fake_quantize_activation<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let (qmin, qmax) = (-128.0f32, 127.0f32);
    let v = precision::to_f32(x.clone().detach());
    let min_val = v.clone().min_dim(D - 1).clamp_max(0.0);
    let max_val = v.clone().max_dim(D - 1).clamp_min(0.0);
    let scale = ((max_val - min_val.clone()) / (qmax - qmin) as f64).clamp_min(f32::EPSILON);
    let zero_point = ((min_val / scale.clone()).round().neg() + qmin as f64).clamp(qmin, qmax);
    let q = ((v * scale.clone().recip()).round() + zero_point.clone()).clamp(qmin, qmax);
    let dq = (q.clone() - zero_point) * scale;
    masked_straight_through(x, dq, q, (qmin, qmax))
}

pub fn weight<B: Backend>(w: Tensor<B, 2>, scheme: QuantScheme) -> Tensor<B, 2> {
    match scheme.group_size() {
        Some(group_size) => fake_quantize_weight(w, group_size),
        None => w,
    }
}

pub fn activation<B: Backend>(x: Tensor<B, 2>, scheme: QuantScheme) -> Tensor<B, 2> {
    if !scheme.quantizes_activations() {
        return x;
    }
    fake_quantize_activation(x)
}
