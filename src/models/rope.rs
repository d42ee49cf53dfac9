//! Rotary position embeddings as transformers computes them (`rotate_half` layout, fp32
//! frequencies, llama3 frequency scaling).

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::args::{ModelArgs, RopeScaling};

#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(args: &ModelArgs) -> Self {
        let dim = args.head_dim;
        let base = args.rope_theta;
        let mut inv_freq: Vec<f64> = (0..dim / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / dim as f32;
                1.0 / base.powf(exponent as f64)
            })
            .collect();
        match &args.rope_scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old_ctx = *original_max_position_embeddings;
                let low_freq_wavelen = old_ctx / low_freq_factor;
                let high_freq_wavelen = old_ctx / high_freq_factor;
                for f in &mut inv_freq {
                    let wavelen = 2.0 * std::f64::consts::PI / *f;
                    let scaled = if wavelen > low_freq_wavelen {
                        *f / factor
                    } else {
                        *f
                    };
                    let medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
                    *f = if medium {
                        let smooth = (old_ctx / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    };
                }
            }
        }
        Self {
            inv_freq: inv_freq.into_iter().map(|f| f as f32).collect(),
        }
    }

    /// cos and sin tables `[batch, 1, seq, head_dim]` for the given position ids (`[batch * seq]`).
    pub fn tables<B: Backend>(
        &self,
        positions: &[u32],
        batch: usize,
        device: &B::Device,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let half = self.inv_freq.len();
        let dim = half * 2;
        let seq = positions.len() / batch.max(1);
        let mut cos = Vec::with_capacity(positions.len() * dim);
        let mut sin = Vec::with_capacity(positions.len() * dim);
        for &p in positions {
            let row: Vec<f32> = self.inv_freq.iter().map(|f| p as f32 * f).collect();
            for _ in 0..2 {
                cos.extend(row.iter().map(|a| a.cos()));
                sin.extend(row.iter().map(|a| a.sin()));
            }
        }
        let shape = [batch, 1, seq, dim];
        (
            Tensor::from_data(TensorData::new(cos, shape), device),
            Tensor::from_data(TensorData::new(sin, shape), device),
        )
    }
}

/// `x * cos + rotate_half(x) * sin` with `x` `[batch, heads, seq, head_dim]`.
pub fn apply<B: Backend>(x: Tensor<B, 4>, cos: &Tensor<B, 4>, sin: &Tensor<B, 4>) -> Tensor<B, 4> {
    let d = x.dims()[3];
    let x1 = x.clone().narrow(3, 0, d / 2);
    let x2 = x.clone().narrow(3, d / 2, d / 2);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    x * cos.clone() + rotated * sin.clone()
}
