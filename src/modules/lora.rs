//! LoRA adapter: `y += scale * B(A(dropout(x)))`, with A `[r, in]` and B `[out, r]` stored in
//! PEFT's layout so adapters load and save without transposes. With a magnitude vector it is
//! DoRA (peft's `use_dora`, torchtune's `DoRALinear`): the adapted weight `W + scale * B A` is
//! normalised per output row and rescaled by a trained magnitude (see `Linear::forward`).

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::kernels::matmul;

/// What a LoRA adapter is made of; the rest of the program never needs more than this.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSettings {
    pub rank: usize,
    pub alpha: f64,
    pub dropout: f64,
    /// DoRA: a trained magnitude per output row.
    pub dora: bool,
}

impl LoraSettings {
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }
}

#[derive(Module, Debug)]
pub struct Lora<B: Backend> {
    /// PEFT `lora_A.weight`, `[rank, in_features]`.
    pub a: Param<Tensor<B, 2>>,
    /// PEFT `lora_B.weight`, `[out_features, rank]`.
    pub b: Param<Tensor<B, 2>>,
    pub scale: f64,
    pub dropout: f64,
    /// DoRA's magnitude, `[out_features]` (PEFT `lora_magnitude_vector`); `None` is plain LoRA.
    pub magnitude: Option<Param<Tensor<B, 1>>>,
}

impl<B: Backend> Lora<B> {
    /// A fresh adapter as PEFT and torchtune initialise it: A Kaiming-uniform (a = sqrt(5),
    /// bound 1/sqrt(in)), B zero, so the adapted model starts equal to the base model. The
    /// seeded host RNG keeps this identical across backends.
    pub fn init(
        in_features: usize,
        out_features: usize,
        settings: &LoraSettings,
        rng: &mut StdRng,
        device: &B::Device,
    ) -> Self {
        let bound = 1.0 / (in_features as f64).sqrt();
        let a: Vec<f32> = (0..settings.rank * in_features)
            .map(|_| rng.random_range(-bound..bound) as f32)
            .collect();
        let a = Tensor::from_data(TensorData::new(a, [settings.rank, in_features]), device);
        let b = Tensor::zeros([out_features, settings.rank], device);
        Self::from_tensors(a, b, settings)
    }

    pub fn from_tensors(a: Tensor<B, 2>, b: Tensor<B, 2>, settings: &LoraSettings) -> Self {
        Self {
            a: Param::from_tensor(a),
            b: Param::from_tensor(b),
            scale: settings.scale(),
            dropout: settings.dropout,
            magnitude: None,
        }
    }

    /// Makes this a DoRA adapter: `magnitude` given (a saved adapter), or initialised as PEFT
    /// and torchtune do, to the row norms of the adapted weight `base + scale * B A` (the
    /// base weight's own norms for a fresh adapter, whose B is zero).
    pub fn with_magnitude(mut self, base: Tensor<B, 2>, magnitude: Option<Tensor<B, 1>>) -> Self {
        // A leaf of its own: computed from other parameters, but trained independently.
        let m = magnitude.unwrap_or_else(|| {
            let adapted = super::constant(base) + super::constant(self.delta_weight());
            row_norms(adapted)
        });
        self.magnitude = Some(Param::from_tensor(m));
        self
    }

    pub fn rank(&self) -> usize {
        self.a.val().dims()[0]
    }

    /// `x` is `[rows, in]`; returns the adapter's contribution `[rows, out]`.
    pub fn forward(&self, x: Tensor<B, 2>, train: bool) -> Tensor<B, 2> {
        let x = if train && self.dropout > 0.0 {
            let keep = 1.0 - self.dropout;
            let mask = super::dropout::keep_mask(&x, keep);
            x * mask / keep
        } else {
            x
        };
        // The scale applied to the rank-r intermediate rather than to the `[rows, out]` result:
        // the same product, one pass over `rows * r` values instead of `rows * out`.
        matmul(
            matmul(x, self.a.val().transpose()) * self.scale,
            self.b.val().transpose(),
        )
    }

    /// `scale * B @ A`, the update merged into the base weight on export.
    pub fn delta_weight(&self) -> Tensor<B, 2> {
        matmul(self.b.val(), self.a.val()) * self.scale
    }
}

/// The L2 norm of each row of `w` `[out, in]`: `[out]`.
pub fn row_norms<B: Backend>(w: Tensor<B, 2>) -> Tensor<B, 1> {
    let out = w.dims()[0];
    w.powi_scalar(2).sum_dim(1).sqrt().reshape([out])
}

/// Seeded RNG for adapter initialisation.
pub fn init_rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}
