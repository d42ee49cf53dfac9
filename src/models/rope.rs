//! Rotary position embeddings as transformers computes them (`rotate_half` layout, fp32
//! frequencies, llama3 frequency scaling).

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::args::{ModelArgs, RopeScaling};

#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    /// YaRN's `attention_factor`: cos and sin are multiplied by it (1 otherwise).
    attention_scaling: f32,
    /// Qwen2-VL's M-RoPE: how many frequencies take each of three positions.
    sections: Option<[usize; 3]>,
}

impl Rope {
    pub fn new(args: &ModelArgs) -> Self {
        let mut rope = Self::with_base(args.head_dim, args.rope_theta, &args.rope_scaling);
        rope.sections = args.mrope_section;
        rope
    }

    /// Gemma 3's sliding layers: their own base, no scaling.
    pub fn local(args: &ModelArgs) -> Option<Self> {
        args.local_rope_theta
            .map(|base| Self::with_base(args.head_dim, base, &RopeScaling::None))
    }

    fn with_base(dim: usize, base: f64, scaling: &RopeScaling) -> Self {
        let mut attention_scaling = 1.0;
        let mut inv_freq: Vec<f64> = (0..dim / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / dim as f32;
                1.0 / base.powf(exponent as f64)
            })
            .collect();
        match scaling {
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
            RopeScaling::Yarn {
                factor,
                attention_factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings,
                truncate,
            } => {
                attention_scaling = *attention_factor as f32;
                let (low, high) = yarn_correction_range(
                    (*beta_fast, *beta_slow),
                    dim,
                    base,
                    *original_max_position_embeddings,
                    *truncate,
                );
                let high = if low == high { high + 0.001 } else { high };
                for (i, f) in inv_freq.iter_mut().enumerate() {
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    let extrapolation = 1.0 - ramp;
                    *f = *f / factor * (1.0 - extrapolation) + *f * extrapolation;
                }
            }
        }
        Self {
            inv_freq: inv_freq.into_iter().map(|f| f as f32).collect(),
            attention_scaling,
            sections: None,
        }
    }

    /// cos and sin tables `[batch, seq, heads, head_dim]` for the given position ids
    /// (`[batch * seq]`), already repeated over the heads so that applying them is a plain
    /// same-shape element-wise product (Flex's SIMD path; a broadcast over the head axis
    /// falls back to a strided scalar loop that cost 5% of a SmolLM2-135M forward).
    pub fn tables<B: Backend>(
        &self,
        positions: &[u32],
        batch: usize,
        heads: usize,
        device: &B::Device,
    ) -> RopeTables<B> {
        self.tables_by(positions.len(), batch, heads, device, |token, _| {
            positions[token]
        })
    }

    /// M-RoPE's tables (Qwen2-VL, transformers' `apply_multimodal_rotary_pos_emb`): frequency
    /// `f` of each half of the head turns by the temporal, height or width position as
    /// `mrope_section` assigns it. `positions` holds the three sections one after another,
    /// each `[batch * seq]`. Without sections (a text model) the first section is the position.
    pub fn tables_3d<B: Backend>(
        &self,
        positions: &[u32],
        batch: usize,
        heads: usize,
        device: &B::Device,
    ) -> RopeTables<B> {
        let tokens = positions.len() / 3;
        let [t, h, _] = self.sections.unwrap_or([self.inv_freq.len(), 0, 0]);
        self.tables_by(tokens, batch, heads, device, |token, f| {
            let section = usize::from(f >= t) + usize::from(f >= t + h);
            positions[section * tokens + token]
        })
    }

    /// Whether this is M-RoPE (positions come in three sections).
    pub fn is_3d(&self) -> bool {
        self.sections.is_some()
    }

    /// The tables of `tokens` positions, frequency `f` of token `i` turning by
    /// `position(i, f)`.
    fn tables_by<B: Backend>(
        &self,
        tokens: usize,
        batch: usize,
        heads: usize,
        device: &B::Device,
        position: impl Fn(usize, usize) -> u32,
    ) -> RopeTables<B> {
        let half = self.inv_freq.len();
        let dim = half * 2;
        let seq = tokens / batch.max(1);
        let mut cos = Vec::with_capacity(tokens * heads * dim);
        let mut sin = Vec::with_capacity(cos.capacity());
        let scale = self.attention_scaling;
        for token in 0..tokens {
            let (c, s): (Vec<f32>, Vec<f32>) = self
                .inv_freq
                .iter()
                .enumerate()
                .map(|(f, inv)| {
                    let a = position(token, f) as f32 * inv;
                    (a.cos() * scale, a.sin() * scale)
                })
                .unzip();
            for _ in 0..heads {
                for _ in 0..2 {
                    cos.extend_from_slice(&c);
                    sin.extend_from_slice(&s);
                }
            }
        }
        let shape = [batch, seq, heads, dim];
        RopeTables {
            cos: Tensor::from_data(TensorData::new(cos, shape), device),
            sin: Tensor::from_data(TensorData::new(sin, shape), device),
            rotate_half: rotate_half_matrix(dim, device),
        }
    }
}

/// YaRN's ramp: the dimensions (of `dim / 2` frequencies) between which rotations blend
/// from extrapolated (fast, `beta_fast` rotations over the original context) to interpolated
/// (slow, `beta_slow`), as transformers' `find_correction_range`.
fn yarn_correction_range(
    (beta_fast, beta_slow): (f64, f64),
    dim: usize,
    base: f64,
    original_max_position_embeddings: f64,
    truncate: bool,
) -> (f64, f64) {
    let correction_dim = |rotations: f64| {
        dim as f64
            * (original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * base.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    (low.max(0.0), high.min(dim as f64 - 1.0))
}

/// The tables one forward pass applies to queries or keys.
#[derive(Debug, Clone)]
pub struct RopeTables<B: Backend> {
    pub cos: Tensor<B, 4>,
    pub sin: Tensor<B, 4>,
    /// `[head_dim, head_dim]` with `x @ R == rotate_half(x) == cat(-x2, x1)`.
    pub rotate_half: Tensor<B, 2>,
}

impl<B: Backend> RopeTables<B> {
    /// Tables of cos and sin computed elsewhere (`[batch, seq, heads, head_dim]`: a vision
    /// tower's 2D positions).
    pub fn new(cos: Tensor<B, 4>, sin: Tensor<B, 4>, device: &B::Device) -> Self {
        let dim = cos.dims()[3];
        Self {
            cos,
            sin,
            rotate_half: rotate_half_matrix(dim, device),
        }
    }
}

/// The signed permutation matrix of `rotate_half`. One small matmul on contiguous rows is
/// exact (each output is one `±x` plus zeros) and far cheaper on Flex than narrowing the
/// last axis into strided halves and concatenating them.
fn rotate_half_matrix<B: Backend>(dim: usize, device: &B::Device) -> Tensor<B, 2> {
    let half = dim / 2;
    let mut r = vec![0.0f32; dim * dim];
    for j in 0..half {
        r[(j + half) * dim + j] = -1.0;
        r[j * dim + j + half] = 1.0;
    }
    Tensor::from_data(TensorData::new(r, [dim, dim]), device)
}

/// `x * cos + rotate_half(x) * sin` with `x` `[batch, seq, heads, head_dim]` contiguous.
pub fn apply<B: Backend>(x: Tensor<B, 4>, tables: &RopeTables<B>) -> Tensor<B, 4> {
    let [batch, seq, heads, dim] = x.dims();
    let rows = x.clone().reshape([batch * seq * heads, dim]);
    let rotated =
        crate::kernels::matmul(rows, tables.rotate_half.clone()).reshape([batch, seq, heads, dim]);
    x * tables.cos.clone() + rotated * tables.sin.clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn rotate_half_matrix_matches_cat_of_negated_halves() {
        let device = Default::default();
        let x = Tensor::<Flex, 2>::from_data(
            TensorData::new((1..=8).map(|v| v as f32).collect::<Vec<_>>(), [2, 4]),
            &device,
        );
        let got = x.matmul(rotate_half_matrix::<Flex>(4, &device));
        let want = vec![-3.0, -4.0, 1.0, 2.0, -7.0, -8.0, 5.0, 6.0];
        assert_eq!(got.into_data().to_vec::<f32>().unwrap(), want);
    }

    /// Qwen3's long-context YaRN (factor 4 over 32768, `truncate` left at its default, true),
    /// against transformers 5.24's `_compute_yarn_parameters`:
    /// `ROPE_INIT_FUNCTIONS["yarn"](Qwen3Config(head_dim=128, hidden_size=1024,
    /// num_attention_heads=8, rope_theta=1e6, max_position_embeddings=131072,
    /// rope_scaling={"rope_type": "yarn", "factor": 4.0,
    /// "original_max_position_embeddings": 32768}))`.
    #[test]
    fn yarn_frequencies_and_scaling_match_transformers() {
        let scaling = RopeScaling::Yarn {
            factor: 4.0,
            attention_factor: 0.1 * 4f64.ln() + 1.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_position_embeddings: 32768.0,
            truncate: true,
        };
        let rope = Rope::with_base(128, 1e6, &scaling);
        let want = [
            (0, 1.0),
            (10, 0.115_478_202_700_614_93),
            (20, 0.013_335_214_927_792_55),
            (30, 0.001_064_360_956_661_403_2),
            (40, 4.445_698_505_151_085_6e-5),
            (50, 5.133_812_464_919_174e-6),
            (63, 3.102_344_408_034_696e-7),
        ];
        for (i, want) in want {
            let got = rope.inv_freq[i] as f64;
            assert!(
                (got - want).abs() <= 2e-6 * want,
                "inv_freq[{i}]: {got} vs {want}"
            );
        }
        assert!((rope.attention_scaling as f64 - 1.138_629_436_111_989).abs() < 1e-6);
    }
}
