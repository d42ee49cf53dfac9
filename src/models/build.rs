//! Builds a `CausalLm` from named tensors: a checkpoint on disk, or seeded random weights
//! for benchmarks and tests. Names are Hugging Face's; Phi-3's fused projections are split here
//! and fused again on save, so the rest of the program sees one layout.

use burn::tensor::backend::Backend;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};

use super::args::ModelArgs;
use super::decoder::{Attention, CausalLm, DecoderBody, DecoderLayer, Embedding, Mlp};
use super::rope::Rope;
use crate::checkpoint::{CheckpointError, HostTensor, Weights};
use crate::modules::{Linear, RmsNorm};
use burn::module::Param;

/// Where a model's parameters come from.
pub trait ParamSource {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<HostTensor, CheckpointError>;
}

impl ParamSource for Weights {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<HostTensor, CheckpointError> {
        Weights::take(self, name, shape)
    }
}

/// Seeded random weights as transformers initialises them (normal, std 0.02), norms at one
/// (zero for Gemma's `1 + w` norms), biases at zero.
pub struct RandomInit {
    rng: StdRng,
    std: f32,
    norm_value: f32,
}

impl RandomInit {
    pub fn new(seed: u64, args: &ModelArgs) -> Self {
        let norm_value = if args.norm_weight_offset { 0.0 } else { 1.0 };
        Self {
            rng: StdRng::seed_from_u64(seed),
            std: 0.02,
            norm_value,
        }
    }
}

impl ParamSource for RandomInit {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<HostTensor, CheckpointError> {
        let n: usize = shape.iter().product();
        let data = if name.ends_with("norm.weight") {
            vec![self.norm_value; n]
        } else if name.ends_with(".bias") {
            vec![0.0; n]
        } else {
            let normal = Normal::new(0.0f32, self.std).map_err(|e| CheckpointError::Invalid {
                path: name.into(),
                message: e.to_string(),
            })?;
            (0..n).map(|_| normal.sample(&mut self.rng)).collect()
        };
        Ok(HostTensor::new(shape.to_vec(), data))
    }
}

struct Builder<'a, B: Backend> {
    args: &'a ModelArgs,
    src: &'a mut dyn ParamSource,
    device: &'a B::Device,
}

impl<B: Backend> Builder<'_, B> {
    fn tensor<const D: usize>(
        &mut self,
        name: &str,
        shape: &[usize],
    ) -> Result<burn::tensor::Tensor<B, D>, CheckpointError> {
        Ok(self.src.take(name, shape)?.to_tensor(self.device))
    }

    fn linear(
        &mut self,
        prefix: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Linear<B>, CheckpointError> {
        let w = self.tensor(&format!("{prefix}.weight"), &[out, inp])?;
        let b = if bias {
            Some(self.tensor(&format!("{prefix}.bias"), &[out])?)
        } else {
            None
        };
        Ok(Linear::new(w, b))
    }

    fn linear_from(&self, weight: HostTensor, bias: Option<HostTensor>) -> Linear<B> {
        Linear::new(
            weight.to_tensor(self.device),
            bias.map(|b| b.to_tensor(self.device)),
        )
    }

    fn norm(&mut self, name: &str, dim: usize) -> Result<RmsNorm<B>, CheckpointError> {
        let w = self.tensor(&format!("{name}.weight"), &[dim])?;
        Ok(RmsNorm::new(
            w,
            self.args.rms_norm_eps,
            self.args.norm_weight_offset,
        ))
    }

    fn attention(&mut self, p: &str, layer: usize) -> Result<Attention<B>, CheckpointError> {
        let a = self.args;
        let (h, q, kv, bias) = (a.hidden_size, a.q_dim(), a.kv_dim(), a.attention_bias);
        let (q_proj, k_proj, v_proj) = if a.fused_projections {
            let w = self
                .src
                .take(&format!("{p}.qkv_proj.weight"), &[q + 2 * kv, h])?;
            let b = if bias {
                Some(
                    self.src
                        .take(&format!("{p}.qkv_proj.bias"), &[q + 2 * kv])?,
                )
            } else {
                None
            };
            let part = |t: &HostTensor, s, n| t.rows(s, n);
            (
                self.linear_from(part(&w, 0, q), b.as_ref().map(|b| part(b, 0, q))),
                self.linear_from(part(&w, q, kv), b.as_ref().map(|b| part(b, q, kv))),
                self.linear_from(
                    part(&w, q + kv, kv),
                    b.as_ref().map(|b| part(b, q + kv, kv)),
                ),
            )
        } else {
            (
                self.linear(&format!("{p}.q_proj"), q, h, bias)?,
                self.linear(&format!("{p}.k_proj"), kv, h, bias)?,
                self.linear(&format!("{p}.v_proj"), kv, h, bias)?,
            )
        };
        let o_proj = self.linear(&format!("{p}.o_proj"), h, q, false)?;
        let (q_norm, k_norm) = if a.qk_norm {
            (
                Some(self.norm(&format!("{p}.q_norm"), a.head_dim)?),
                Some(self.norm(&format!("{p}.k_norm"), a.head_dim)?),
            )
        } else {
            (None, None)
        };
        Ok(Attention {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            q_norm,
            k_norm,
            num_heads: a.num_heads,
            num_kv_heads: a.num_kv_heads,
            head_dim: a.head_dim,
            scale: a.attn_scale,
            softcap: a.attn_logit_softcap,
            sliding: a.sliding_layers.get(layer).copied().unwrap_or(false),
        })
    }

    fn mlp(&mut self, p: &str) -> Result<Mlp<B>, CheckpointError> {
        let a = self.args;
        let (h, i, bias) = (a.hidden_size, a.intermediate_size, a.mlp_bias);
        let (gate_proj, up_proj) = if a.fused_projections {
            let w = self
                .src
                .take(&format!("{p}.gate_up_proj.weight"), &[2 * i, h])?;
            (
                self.linear_from(w.rows(0, i), None),
                self.linear_from(w.rows(i, i), None),
            )
        } else {
            (
                self.linear(&format!("{p}.gate_proj"), i, h, bias)?,
                self.linear(&format!("{p}.up_proj"), i, h, bias)?,
            )
        };
        let down_proj = self.linear(&format!("{p}.down_proj"), h, i, bias)?;
        Ok(Mlp {
            gate_proj,
            up_proj,
            down_proj,
            activation: a.activation,
        })
    }

    fn build(mut self) -> Result<CausalLm<B>, CheckpointError> {
        let a = self.args;
        let embed = self.tensor("model.embed_tokens.weight", &[a.vocab_size, a.hidden_size])?;
        let mut layers = Vec::with_capacity(a.num_layers);
        for l in 0..a.num_layers {
            let p = format!("model.layers.{l}");
            let mut sandwich = |name: &str| -> Result<Option<RmsNorm<B>>, CheckpointError> {
                if a.sandwich_norms {
                    Ok(Some(self.norm(&format!("{p}.{name}"), a.hidden_size)?))
                } else {
                    Ok(None)
                }
            };
            let pre_feedforward_layernorm = sandwich("pre_feedforward_layernorm")?;
            let post_feedforward_layernorm = sandwich("post_feedforward_layernorm")?;
            layers.push(DecoderLayer {
                input_layernorm: self.norm(&format!("{p}.input_layernorm"), a.hidden_size)?,
                self_attn: self.attention(&format!("{p}.self_attn"), l)?,
                post_attention_layernorm: self
                    .norm(&format!("{p}.post_attention_layernorm"), a.hidden_size)?,
                pre_feedforward_layernorm,
                post_feedforward_layernorm,
                mlp: self.mlp(&format!("{p}.mlp"))?,
            });
        }
        let norm = self.norm("model.norm", a.hidden_size)?;
        let lm_head = if a.tie_word_embeddings {
            None
        } else {
            Some(self.linear("lm_head", a.vocab_size, a.hidden_size, false)?)
        };
        Ok(CausalLm {
            model: DecoderBody {
                embed_tokens: Embedding {
                    weight: Param::from_tensor(embed),
                },
                layers,
                norm,
            },
            lm_head,
            args: a.clone(),
            rope: Rope::new(a),
            rope_local: Rope::local(a),
        })
    }
}

pub fn build<B: Backend>(
    args: &ModelArgs,
    src: &mut dyn ParamSource,
    device: &B::Device,
) -> Result<CausalLm<B>, CheckpointError> {
    Builder { args, src, device }.build()
}

/// Tensors a Hugging Face checkpoint may hold that the model legitimately does not use.
pub fn ignorable_tensor(args: &ModelArgs, name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq") || (args.tie_word_embeddings && name == "lm_head.weight")
}
