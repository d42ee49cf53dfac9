//! RMSNorm as transformers computes it (in fp32, weight applied after normalising).

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

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

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let variance = x.clone().powi_scalar(2).mean_dim(D - 1);
        let normed = x * (variance + self.eps).sqrt().recip();
        let mut w = self.weight.val();
        if self.weight_offset {
            w = w + 1.0;
        }
        let mut shape = [1usize; D];
        shape[D - 1] = w.dims()[0];
        normed * w.reshape(shape)
    }
}
