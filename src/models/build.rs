//! Builds a `CausalLm` from named tensors: a checkpoint on disk, or seeded random weights
//! for benchmarks and tests. Names are Hugging Face's; Phi-3's fused projections are split here
//! and fused again on save, so the rest of the program sees one layout.

use burn::tensor::backend::Backend;

use super::args::{ExpertNaming, MoeArgs};
use super::args::{Family, ModelArgs};
use super::decoder::{Attention, CausalLm, DecoderBody, DecoderLayer, Embedding, Mlp};
use super::moe::SparseMoe;
use super::qwen2_vl_vision::Qwen2VlVision;
use super::rope::Rope;
use crate::checkpoint::{CheckpointError, HostTensor, StorageDtype, mxfp4};
use crate::modules::frozen_nf4::{FrozenNf4, Nf4Rows, RowOrder};
use crate::modules::nf4::{BLOCK_SIZE, Nf4Dtype};
use crate::modules::{Linear, RmsNorm};
use burn::module::Param;
use std::ops::Range;

pub use super::param_source::{ParamSource, RandomInit, RowsOf, build_rows};

/// How the decoder layers' linear base weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BaseWeights {
    #[default]
    Float,
    /// QLoRA: every decoder linear (attention and MLP; not the embeddings or the output
    /// projection, as torchtune's `qlora_*` builders) in NF4, quantized as each tensor is read
    /// (so the float model never exists as a whole) in the dtype the checkpoint stores it in,
    /// as torchao's `copy_` does on torchtune's load, and dequantized in this dtype (the
    /// model's).
    Nf4(Nf4Dtype),
}

struct Builder<'a, B: Backend> {
    args: &'a ModelArgs,
    src: &'a mut dyn ParamSource,
    device: &'a B::Device,
    base: BaseWeights,
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
        let name = format!("{prefix}.weight");
        let stored = self.src.stored_dtype(&name);
        if let Some(linear) = self.nf4_rows_linear(prefix, [out, inp], stored, bias)? {
            return Ok(linear);
        }
        let w = self.src.take(&name, &[out, inp])?;
        let b = if bias {
            Some(self.src.take(&format!("{prefix}.bias"), &[out])?)
        } else {
            None
        };
        self.linear_from(prefix, w, stored, b)
    }

    /// FSDP's per-rank load of an NF4 base: a decoder layer's linear holding only this rank's
    /// quantized rows, quantized from reads of a few rows of the weight at a time, as the whole
    /// weight's quantization would give them ([`Nf4Rows::quantize`]); `None` when the base is
    /// float, the source hands out whole tensors, or a row does not hold whole blocks (then
    /// the weight loads whole and stays whole on every rank, as `Linear::shard_nf4` leaves it).
    fn nf4_rows_linear(
        &mut self,
        prefix: &str,
        [out, inp]: [usize; 2],
        stored: Option<StorageDtype>,
        bias: bool,
    ) -> Result<Option<Linear<B>>, CheckpointError> {
        let BaseWeights::Nf4(compute) = self.base else {
            return Ok(None);
        };
        let Some(rows) = self.src.own_rows(out) else {
            return Ok(None);
        };
        if !prefix.starts_with("model.layers.") || !inp.is_multiple_of(BLOCK_SIZE) {
            return Ok(None);
        }
        let name = format!("{prefix}.weight");
        let dtype = stored.map(nf4_dtype).unwrap_or(compute);
        let order = nf4_row_order(self.args, prefix);
        let src = &mut *self.src;
        let read = |r: Range<usize>| src.read_rows(&name, &[out, inp], r).map(|t| t.data);
        let q = Nf4Rows::quantize(read, [out, inp], rows, (dtype, compute), order)?;
        self.src.done(&name);
        let q = q.map_err(|source| CheckpointError::Nf4 {
            name: name.clone(),
            shape: vec![out, inp],
            source,
        })?;
        let bias = if bias {
            Some(
                self.src
                    .take(&format!("{prefix}.bias"), &[out])?
                    .to_tensor(self.device),
            )
        } else {
            None
        };
        Ok(Some(Linear::new_nf4_rows(q, bias)))
    }

    /// A linear layer from its tensors; a decoder layer's weight goes straight from the host
    /// into NF4 when the base is quantized (in `stored`, the weight's dtype on disk, when
    /// known).
    fn linear_from(
        &self,
        prefix: &str,
        weight: HostTensor,
        stored: Option<StorageDtype>,
        bias: Option<HostTensor>,
    ) -> Result<Linear<B>, CheckpointError> {
        let bias = bias.map(|b| b.to_tensor(self.device));
        match self.base {
            BaseWeights::Nf4(compute) if prefix.starts_with("model.layers.") => {
                let dtype = stored.map(nf4_dtype).unwrap_or(compute);
                let q = quantize_linear(self.args, prefix, &weight, dtype, compute)?;
                Ok(Linear::new_nf4(q, bias))
            }
            _ => Ok(Linear::new(weight.to_tensor(self.device), bias)),
        }
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
            let name = format!("{p}.qkv_proj.weight");
            let stored = self.src.stored_dtype(&name);
            let w = self.src.take(&name, &[q + 2 * kv, h])?;
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
                self.linear_from(
                    &format!("{p}.q_proj"),
                    part(&w, 0, q),
                    stored,
                    b.as_ref().map(|b| part(b, 0, q)),
                )?,
                self.linear_from(
                    &format!("{p}.k_proj"),
                    part(&w, q, kv),
                    stored,
                    b.as_ref().map(|b| part(b, q, kv)),
                )?,
                self.linear_from(
                    &format!("{p}.v_proj"),
                    part(&w, q + kv, kv),
                    stored,
                    b.as_ref().map(|b| part(b, q + kv, kv)),
                )?,
            )
        } else {
            (
                self.linear(&format!("{p}.q_proj"), q, h, bias)?,
                self.linear(&format!("{p}.k_proj"), kv, h, bias)?,
                self.linear(&format!("{p}.v_proj"), kv, h, bias)?,
            )
        };
        let o_proj = self.linear(&format!("{p}.o_proj"), h, q, a.o_proj_bias)?;
        let sinks = if a.attention_sinks {
            Some(Param::from_tensor(
                self.tensor(&format!("{p}.sinks"), &[a.num_heads])?,
            ))
        } else {
            None
        };
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
            rope: a.rope_layers.get(layer).copied().unwrap_or(true),
            sinks,
        })
    }

    /// A sparse layer's block: router, experts and (Qwen2-MoE) the gated shared expert, read by
    /// the family's checkpoint names ([`ModelArgs::hf_name`]).
    fn moe(&mut self, p: &str, moe: &MoeArgs) -> Result<SparseMoe<B>, CheckpointError> {
        let a = self.args;
        let name = |path: String| a.hf_name(&path);
        let fused = moe.naming == ExpertNaming::GptOss;
        let gate = self.router(&name(format!("{p}.gate")), moe.num_experts, fused)?;
        let experts = if fused {
            self.fused_experts(&name(format!("{p}.experts")), moe)?
        } else {
            let mut experts = Vec::with_capacity(moe.num_experts);
            for e in 0..moe.num_experts {
                let expert = format!("{p}.experts.{e}");
                experts.push(self.swiglu(&expert, moe.expert_intermediate_size, &name)?);
            }
            experts
        };
        let (shared_expert, shared_expert_gate) = match moe.shared_expert_intermediate_size {
            Some(i) => (
                Some(self.swiglu(&format!("{p}.shared_expert"), i, &name)?),
                Some(self.router(&name(format!("{p}.shared_expert_gate")), 1, false)?),
            ),
            None => (None, None),
        };
        Ok(SparseMoe {
            gate,
            experts,
            shared_expert,
            shared_expert_gate,
            top_k: moe.top_k,
            norm_topk_prob: moe.norm_topk_prob,
        })
    }

    /// A router (`[out, hidden]`, with a bias for gpt-oss): kept in float whatever the base
    /// weights' storage, as QLoRA keeps everything but the decoder's projections (bitsandbytes'
    /// and torchtune's QLoRA quantize linear projections; a router is a few thousand values
    /// LoRA never adapts).
    fn router(
        &mut self,
        prefix: &str,
        out: usize,
        bias: bool,
    ) -> Result<Linear<B>, CheckpointError> {
        let w = self
            .src
            .take(&format!("{prefix}.weight"), &[out, self.args.hidden_size])?;
        let b = if bias {
            Some(self.tensor(&format!("{prefix}.bias"), &[out])?)
        } else {
            None
        };
        Ok(Linear::new(w.to_tensor(self.device), b))
    }

    /// gpt-oss's experts, stored fused ([`ExpertNaming::GptOss`], under `p`, e.g.
    /// `model.layers.0.mlp.experts`), split into one biased SwiGLU per expert: the gate and up
    /// projections are the even and odd output columns of `gate_up_proj`. Each expert's
    /// projections are named as if stored apart (`{p}.{e}.gate_proj`), the names LoRA and NF4
    /// see and `params.rs` fuses back on save.
    fn fused_experts(&mut self, p: &str, moe: &MoeArgs) -> Result<Vec<Mlp<B>>, CheckpointError> {
        let (experts, h, i) = (
            moe.num_experts,
            self.args.hidden_size,
            moe.expert_intermediate_size,
        );
        if let Some(rows) = self.src.own_rows(i) {
            return self.fused_experts_rows(p, [experts, h, i], rows);
        }
        // Each expert's weights as `[out, in]` rows.
        let gate_up = self.expert_weights(&format!("{p}.gate_up_proj"), experts, h, 2 * i)?;
        let gate_up_bias = self
            .src
            .take(&format!("{p}.gate_up_proj_bias"), &[experts, 2 * i])?;
        let down = self.expert_weights(&format!("{p}.down_proj"), experts, i, h)?;
        let down_bias = self
            .src
            .take(&format!("{p}.down_proj_bias"), &[experts, h])?;
        let mut out = Vec::with_capacity(experts);
        for e in 0..experts {
            let gate_up = gate_up.rows(e * 2 * i, 2 * i);
            let gate_up_bias = gate_up_bias.rows(e, 1).reshaped(vec![2 * i, 1]);
            let name = |proj: &str| format!("{p}.{e}.{proj}");
            let half = |proj: &str, first: usize| {
                let bias = every_other_row(&gate_up_bias, first).reshaped(vec![i]);
                self.linear_from(
                    &name(proj),
                    every_other_row(&gate_up, first),
                    None,
                    Some(bias),
                )
            };
            let (gate_proj, up_proj) = (half("gate_proj", 0)?, half("up_proj", 1)?);
            let down_proj = self.linear_from(
                &name("down_proj"),
                down.rows(e * h, h),
                None,
                Some(down_bias.rows(e, 1).reshaped(vec![h])),
            )?;
            out.push(Mlp::new(
                gate_proj,
                up_proj,
                down_proj,
                self.args.activation,
            ));
        }
        Ok(out)
    }

    /// The fused expert weight `name`, stored `[experts, in, out]` (or in MXFP4 as
    /// `{name}_blocks` / `{name}_scales`, `[experts, out, ..]`), as `[experts * out, in]`: each
    /// expert's `[out, in]` linear weight, one after the other.
    fn expert_weights(
        &mut self,
        name: &str,
        experts: usize,
        inp: usize,
        out: usize,
    ) -> Result<HostTensor, CheckpointError> {
        if let FusedExpertWeight::Mxfp4 { codes, scales, .. } =
            FusedExpertWeight::open(self.src, name, [experts, inp, out])?
        {
            let values = mxfp4::dequantize(&codes, &scales);
            return Ok(HostTensor::new(vec![experts * out, inp], values));
        }
        let stored = self.src.take(name, &[experts, inp, out])?;
        let mut values = vec![0.0f32; experts * out * inp];
        for (src, dst) in stored
            .data
            .chunks_exact(inp * out)
            .zip(values.chunks_exact_mut(inp * out))
        {
            for r in 0..inp {
                for c in 0..out {
                    dst[c * inp + r] = src[r * out + c];
                }
            }
        }
        Ok(HostTensor::new(vec![experts * out, inp], values))
    }

    /// FSDP's per-rank load of gpt-oss's fused experts (`[experts, hidden, intermediate]`):
    /// each expert's weights are read (MXFP4: dequantized) one expert at a time and only this
    /// rank's `rows` of each projection kept, so the rank never holds a layer's experts whole
    /// in float, let alone the model.
    fn fused_experts_rows(
        &mut self,
        p: &str,
        [experts, h, i]: [usize; 3],
        rows: Range<usize>,
    ) -> Result<Vec<Mlp<B>>, CheckpointError> {
        let gate_up =
            FusedExpertWeight::open(self.src, &format!("{p}.gate_up_proj"), [experts, h, 2 * i])?;
        let down = FusedExpertWeight::open(self.src, &format!("{p}.down_proj"), [experts, i, h])?;
        let whole = |src: &mut dyn ParamSource, name: String, shape: [usize; 2]| {
            let t = src.read_rows(&name, &shape, 0..shape[0]);
            src.done(&name);
            t
        };
        let gate_up_bias = whole(self.src, format!("{p}.gate_up_proj_bias"), [experts, 2 * i])?;
        let down_bias = whole(self.src, format!("{p}.down_proj_bias"), [experts, h])?;
        let down_rows = self.src.own_rows(h).unwrap_or(0..h);
        let mut out = Vec::with_capacity(experts);
        for e in 0..experts {
            let name = |proj: &str| format!("{p}.{e}.{proj}");
            let fused = gate_up.expert(self.src, e)?;
            let fused_bias = gate_up_bias.rows(e, 1).reshaped(vec![2 * i, 1]);
            let mut half = |proj: &str, first: usize| {
                let bias = every_other_row(&fused_bias, first).reshaped(vec![i]);
                self.linear_rows(
                    &name(proj),
                    every_other_row(&fused, first),
                    bias,
                    rows.clone(),
                )
            };
            let (gate_proj, up_proj) = (half("gate_proj", 0)?, half("up_proj", 1)?);
            let bias = down_bias.rows(e, 1).reshaped(vec![h]);
            let weight = down.expert(self.src, e)?;
            let down_proj =
                self.linear_rows(&name("down_proj"), weight, bias, down_rows.clone())?;
            out.push(Mlp::new(
                gate_proj,
                up_proj,
                down_proj,
                self.args.activation,
            ));
        }
        gate_up.done(self.src);
        down.done(self.src);
        Ok(out)
    }

    /// FSDP's per-rank load of a linear layer cut from a fused tensor: `rows` of `weight`
    /// (`[out, in]`, whole on the host) and of `bias`, the whole shapes recorded for the
    /// shards; an NF4 base holds its quantized rows as the whole weight's quantization gives
    /// them ([`Nf4Rows::quantize`]), or, when a row does not hold whole blocks, the whole
    /// weight on every rank (as `Linear::shard_nf4` leaves such a weight).
    fn linear_rows(
        &mut self,
        prefix: &str,
        weight: HostTensor,
        bias: HostTensor,
        rows: Range<usize>,
    ) -> Result<Linear<B>, CheckpointError> {
        let [out, inp] = [weight.shape[0], weight.shape[1]];
        if let BaseWeights::Nf4(compute) = self.base {
            if !inp.is_multiple_of(BLOCK_SIZE) {
                return self.linear_from(prefix, weight, None, Some(bias));
            }
            let order = nf4_row_order(self.args, prefix);
            let read =
                |r: Range<usize>| Ok::<_, CheckpointError>(weight.rows(r.start, r.len()).data);
            let q = Nf4Rows::quantize(read, [out, inp], rows.clone(), (compute, compute), order)?;
            let q = q.map_err(|source| CheckpointError::Nf4 {
                name: format!("{prefix}.weight"),
                shape: vec![out, inp],
                source,
            })?;
            self.record_rows(prefix, [out, inp]);
            let bias = bias.rows(rows.start, rows.len()).to_tensor(self.device);
            return Ok(Linear::new_nf4_rows(q, Some(bias)));
        }
        self.record_rows(prefix, [out, inp]);
        Ok(Linear::new(
            weight.rows(rows.start, rows.len()).to_tensor(self.device),
            Some(bias.rows(rows.start, rows.len()).to_tensor(self.device)),
        ))
    }

    /// The whole shapes of the linear `prefix`'s weight and bias, kept as rows.
    fn record_rows(&mut self, prefix: &str, [out, inp]: [usize; 2]) {
        self.src
            .record_full_shape(&format!("{prefix}.weight"), &[out, inp]);
        self.src
            .record_full_shape(&format!("{prefix}.bias"), &[out]);
    }

    /// An expert's SwiGLU MLP of width `i` (no biases), its projections named by `name`.
    fn swiglu(
        &mut self,
        p: &str,
        i: usize,
        name: &dyn Fn(String) -> String,
    ) -> Result<Mlp<B>, CheckpointError> {
        let h = self.args.hidden_size;
        Ok(Mlp::new(
            self.linear(&name(format!("{p}.gate_proj")), i, h, false)?,
            self.linear(&name(format!("{p}.up_proj")), i, h, false)?,
            self.linear(&name(format!("{p}.down_proj")), h, i, false)?,
            self.args.activation,
        ))
    }

    fn mlp(&mut self, p: &str) -> Result<Mlp<B>, CheckpointError> {
        let a = self.args;
        let (h, i, bias) = (a.hidden_size, a.intermediate_size, a.mlp_bias);
        let (gate_proj, up_proj) = if a.fused_projections {
            let name = format!("{p}.gate_up_proj.weight");
            let stored = self.src.stored_dtype(&name);
            let w = self.src.take(&name, &[2 * i, h])?;
            (
                self.linear_from(&format!("{p}.gate_proj"), w.rows(0, i), stored, None)?,
                self.linear_from(&format!("{p}.up_proj"), w.rows(i, i), stored, None)?,
            )
        } else {
            (
                self.linear(&format!("{p}.gate_proj"), i, h, bias)?,
                self.linear(&format!("{p}.up_proj"), i, h, bias)?,
            )
        };
        let down_proj = self.linear(&format!("{p}.down_proj"), h, i, bias)?;
        Ok(Mlp::new(gate_proj, up_proj, down_proj, a.activation))
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
            // Read in this order (attention, then the MLP): random initialisation draws values
            // in it, and a refused NF4 weight is the first one read.
            let input_layernorm = self.norm(&format!("{p}.input_layernorm"), a.hidden_size)?;
            let self_attn = self.attention(&format!("{p}.self_attn"), l)?;
            let post_attention_layernorm =
                self.norm(&format!("{p}.post_attention_layernorm"), a.hidden_size)?;
            let (mlp, moe) = match &a.moe {
                Some(moe) if moe.is_sparse(l) => (None, Some(self.moe(&format!("{p}.moe"), moe)?)),
                _ => (Some(self.mlp(&format!("{p}.mlp"))?), None),
            };
            layers.push(DecoderLayer {
                input_layernorm,
                self_attn,
                post_attention_layernorm,
                pre_feedforward_layernorm,
                post_feedforward_layernorm,
                mlp,
                moe,
            });
        }
        let norm = self.norm("model.norm", a.hidden_size)?;
        let visual = match &a.vision {
            Some(vision) => Some(Qwen2VlVision::load(
                self.src,
                "visual",
                vision.encoder.clone(),
                self.device,
            )?),
            None => None,
        };
        let lm_head = if a.tie_word_embeddings {
            None
        } else {
            Some(self.linear(a.head_name(), a.output_size(), a.hidden_size, false)?)
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
            visual,
            shards: None,
        })
    }
}

pub fn build<B: Backend>(
    args: &ModelArgs,
    src: &mut dyn ParamSource,
    device: &B::Device,
) -> Result<CausalLm<B>, CheckpointError> {
    build_with(args, src, device, BaseWeights::Float)
}

/// [`build`] with the decoder's linear base weights stored as `base` says.
pub fn build_with<B: Backend>(
    args: &ModelArgs,
    src: &mut dyn ParamSource,
    device: &B::Device,
    base: BaseWeights,
) -> Result<CausalLm<B>, CheckpointError> {
    Builder {
        args,
        src,
        device,
        base,
    }
    .build()
}

/// The NF4 quantization dtype of a weight stored in `dtype`.
fn nf4_dtype(dtype: StorageDtype) -> Nf4Dtype {
    match dtype {
        StorageDtype::BF16 => Nf4Dtype::Bf16,
        StorageDtype::F16 => Nf4Dtype::F16,
        StorageDtype::F32 => Nf4Dtype::F32,
    }
}

/// The row order torchtune quantizes the linear layer `prefix` in: it converts q_proj/k_proj
/// rows to its interleaved RoPE order for every family but Qwen2/Qwen3 (whose torchtune RoPE
/// rotates halves, as Hugging Face's does), and quantizes that layout.
fn nf4_row_order(args: &ModelArgs, prefix: &str) -> RowOrder {
    let rope_projection = prefix.ends_with(".q_proj") || prefix.ends_with(".k_proj");
    let permuted = !matches!(args.family, Family::Qwen2 | Family::Qwen3);
    if rope_projection && permuted {
        RowOrder::RopeInterleaved {
            head_dim: args.head_dim,
        }
    } else {
        RowOrder::Stored
    }
}

/// torchtune's NF4 of the decoder linear `prefix`'s weight (`[out, in]`, Hugging Face order):
/// quantized in `dtype`, in torchtune's row order, dequantized in `compute`; torchao's shape
/// rule broken is an error naming the weight.
fn quantize_linear(
    args: &ModelArgs,
    prefix: &str,
    weight: &HostTensor,
    dtype: Nf4Dtype,
    compute: Nf4Dtype,
) -> Result<FrozenNf4, CheckpointError> {
    let shape = [weight.shape[0], weight.shape[1]];
    let order = nf4_row_order(args, prefix);
    FrozenNf4::quantize(&weight.data, shape, dtype, compute, order).map_err(|source| {
        CheckpointError::Nf4 {
            name: format!("{prefix}.weight"),
            shape: shape.to_vec(),
            source,
        }
    })
}

impl<B: Backend> CausalLm<B> {
    /// Stores every decoder linear's base weight in NF4 (a model already built in float,
    /// e.g. a QAT int4 export), quantized and dequantized in `dtype`.
    pub fn quantize_base_nf4(&mut self, dtype: Nf4Dtype) -> Result<(), CheckpointError> {
        let args = self.args.clone();
        for (prefix, linear) in self.linears_mut() {
            if !prefix.starts_with("model.layers.") || linear.nf4().is_some() {
                continue;
            }
            let weight = HostTensor::from_tensor(&linear.base_weight());
            linear.set_nf4(quantize_linear(&args, &prefix, &weight, dtype, dtype)?);
        }
        Ok(())
    }
}

/// A fused expert weight (gpt-oss's `gate_up_proj`, `down_proj`) read one expert at a time.
enum FusedExpertWeight {
    /// MXFP4 codes and scales (`{name}_blocks`, `{name}_scales`, `[experts, out, ..]`), held
    /// whole and dequantized an expert at a time.
    Mxfp4 {
        codes: Vec<u8>,
        scales: Vec<u8>,
        /// `[experts, in, out]`
        shape: [usize; 3],
    },
    /// Float, stored `[experts, in, out]`: read an expert's slab at a time.
    Float { name: String, shape: [usize; 3] },
}

impl FusedExpertWeight {
    fn open(
        src: &mut dyn ParamSource,
        name: &str,
        shape: [usize; 3],
    ) -> Result<Self, CheckpointError> {
        let [experts, inp, out] = shape;
        let (blocks, scales) = (format!("{name}_blocks"), format!("{name}_scales"));
        if !src.has(&blocks) {
            return Ok(Self::Float {
                name: name.to_string(),
                shape,
            });
        }
        if !inp.is_multiple_of(32) {
            return Err(CheckpointError::Invalid {
                path: blocks.into(),
                message: format!("MXFP4 rows of {inp} values are not whole blocks of 32"),
            });
        }
        let per_row = inp / 32;
        let codes = src.take_u8(&blocks, &[experts, out, per_row, mxfp4::BLOCK_BYTES])?;
        let scales = src.take_u8(&scales, &[experts, out, per_row])?;
        Ok(Self::Mxfp4 {
            codes,
            scales,
            shape,
        })
    }

    /// Expert `e`'s weight as its linear layer's `[out, in]`.
    fn expert(&self, src: &mut dyn ParamSource, e: usize) -> Result<HostTensor, CheckpointError> {
        match self {
            Self::Mxfp4 {
                codes,
                scales,
                shape: [_, inp, out],
            } => {
                let per_row = inp / 32;
                let (c, s) = (out * per_row * mxfp4::BLOCK_BYTES, out * per_row);
                let values =
                    mxfp4::dequantize(&codes[e * c..(e + 1) * c], &scales[e * s..(e + 1) * s]);
                Ok(HostTensor::new(vec![*out, *inp], values))
            }
            Self::Float { name, shape } => {
                let [_, inp, out] = *shape;
                let slab = src.read_rows(name, shape, e..e + 1)?;
                let mut values = vec![0.0f32; out * inp];
                for r in 0..inp {
                    for c in 0..out {
                        values[c * inp + r] = slab.data[r * out + c];
                    }
                }
                Ok(HostTensor::new(vec![out, inp], values))
            }
        }
    }

    /// Read for good (a float weight's pages released).
    fn done(&self, src: &mut dyn ParamSource) {
        if let Self::Float { name, .. } = self {
            src.done(name);
        }
    }
}

/// Rows `first, first + 2, ...` of a `[rows, cols]` tensor: gpt-oss interleaves its gate
/// (even) and up (odd) projections' output rows.
fn every_other_row(t: &HostTensor, first: usize) -> HostTensor {
    let cols = t.shape[1];
    let data: Vec<f32> = t
        .data
        .chunks_exact(cols)
        .skip(first)
        .step_by(2)
        .flatten()
        .copied()
        .collect();
    HostTensor::new(vec![data.len() / cols.max(1), cols], data)
}

/// Tensors a Hugging Face checkpoint may hold that the model legitimately does not use.
pub fn ignorable_tensor(args: &ModelArgs, name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq") || (args.tie_word_embeddings && name == "lm_head.weight")
}
