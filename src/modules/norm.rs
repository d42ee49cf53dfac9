//! RMSNorm as transformers computes it (in fp32, weight applied after normalising).

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::precision;

#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub eps: f64,
    /// Gemma scales by `1 + weight` instead of `weight`.
    pub weight_offset: bool,
}

impl<B: Backend> RmsNorm<B> {
    pub fn new(weight: Tensor<B, 1>, eps: f64, weight_offset: bool) -> Self {
        Self {
            weight: Param::from_tensor(weight),
            eps,
            weight_offset,
        }
    }

    /// In bf16 runs the normalisation is computed in fp32 and cast back before the weight
    /// multiplies it, as transformers' `LlamaRMSNorm` does.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dtype = x.dtype();
        let x = precision::to_f32(x);
        let variance = x.clone().powi_scalar(2).mean_dim(D - 1);
        let normed = precision::to_dtype(x * (variance + self.eps).sqrt().recip(), dtype);
        let mut w = self.weight.val();
        if self.weight_offset {
            w = w + 1.0;
        }
        let mut shape = [1usize; D];
        shape[D - 1] = w.dims()[0];
        let w = w.reshape(shape);
        if precision::is_half(&normed) && crate::kernels::is_flex::<B>() {
            // The CPU backend multiplies a broadcast bf16 row one element at a time on one
            // core (and sums the weight's gradient the same way). The product of two bf16
            // values is exact in fp32, so multiplying there and rounding once gives the bf16
            // product's bits; the weight gradient is summed in fp32 before its rounding.
            let y = precision::to_f32(normed) * precision::to_f32(w);
            return precision::to_dtype(y, dtype);
        }
        normed * w
    }
}
