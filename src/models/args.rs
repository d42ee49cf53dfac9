//! `ModelArgs`: everything the decoder needs to know about an architecture, read from a
//! Hugging Face `config.json`. Family differences live here as fields, never as separate
//! model copies.

use std::path::Path;

use serde_json::Value;

use super::ModelError;
pub use super::family::Family;
pub use super::moe_args::{ExpertNaming, MoeArgs};
use super::multimodal::VisionArgs;
use super::text_tower::{self, TextTower};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    Silu,
    /// `gelu_pytorch_tanh` / `gelu` as Gemma uses it (tanh approximation).
    GeluTanh,
    /// gpt-oss's experts: `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with
    /// `g = min(gate, limit)` (`swiglu_alpha`, `swiglu_limit`).
    ClampedSwiglu {
        alpha: f64,
        limit: f64,
    },
}

/// RoPE frequency scaling, as transformers' `rope_type`.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    Linear {
        factor: f64,
    },
    /// YaRN (gpt-oss, long-context Qwen 3): frequencies blended between interpolated and
    /// extrapolated by a linear ramp over the dimensions, and cos/sin scaled by
    /// `attention_factor`, as transformers' `_compute_yarn_parameters`.
    Yarn {
        factor: f64,
        attention_factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        original_max_position_embeddings: f64,
        /// Round the ramp's ends to whole dimensions (transformers' default, true).
        truncate: bool,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelArgs {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// A `*ForSequenceClassification` checkpoint (a reward or value model, torchtune's
    /// `ModelType.REWARD`): its head `score` projects to this many classes instead of the
    /// vocabulary, and is never tied to the embeddings.
    pub num_labels: Option<usize>,
    /// Qwen2: q/k/v projections carry a bias.
    pub attention_bias: bool,
    /// The output projection carries a bias too (`attention_bias` in the families whose
    /// `o_proj` follows it in transformers: Llama, Qwen 3, Gemma, SmolLM3, gpt-oss).
    pub o_proj_bias: bool,
    /// gpt-oss: each head's learned sink logit (`self_attn.sinks`), one more entry in the
    /// softmax's denominator that attends to nothing.
    pub attention_sinks: bool,
    pub mlp_bias: bool,
    /// Qwen3: RMSNorm over each head of q and k before RoPE.
    pub qk_norm: bool,
    /// Gemma: RMSNorm multiplies by `1 + weight`.
    pub norm_weight_offset: bool,
    /// Gemma: embeddings are multiplied by sqrt(hidden_size).
    pub scale_embeddings: bool,
    pub activation: Activation,
    /// Phi-3 stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` on disk.
    pub fused_projections: bool,
    /// The attention scores' scale: `query_pre_attn_scalar ** -0.5` for Gemma 2/3, else
    /// `head_dim ** -0.5`.
    pub attn_scale: f64,
    /// Gemma 2: attention scores become `tanh(s / cap) * cap` before the mask.
    pub attn_logit_softcap: Option<f64>,
    /// Gemma 2: logits become `tanh(l / cap) * cap`.
    pub final_logit_softcap: Option<f64>,
    /// Layers that attend only to the last `sliding_window` positions (query i sees keys j
    /// with `i - window < j <= i`), by layer index; empty when none does.
    pub sliding_layers: Vec<bool>,
    pub sliding_window: Option<usize>,
    /// SmolLM3: which layers rotate q and k (`no_rope_layers`, 1 = RoPE), by layer index;
    /// empty when every layer does.
    pub rope_layers: Vec<bool>,
    /// Gemma 2/3: the attention and MLP outputs are normalised too (`post_attention_layernorm`
    /// on the attention output, `pre_feedforward_layernorm` / `post_feedforward_layernorm`
    /// around the MLP).
    pub sandwich_norms: bool,
    /// Gemma 3: the RoPE base of the sliding layers (the full layers use `rope_theta` and
    /// `rope_scaling`).
    pub local_rope_theta: Option<f64>,
    /// Mixture-of-experts layers (Qwen2/3-MoE, Mixtral); `None` for a dense model.
    pub moe: Option<MoeArgs>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    /// The language model of a multimodal checkpoint (Gemma 3 4B+, Mistral 3, Qwen2-VL), built
    /// from its `text_config`; `None` for a text checkpoint.
    pub tower: Option<TextTower>,
    /// Qwen2-VL's M-RoPE: how many of each head's rotary frequencies take the temporal, height
    /// and width position (`mrope_section`, summing to `head_dim / 2`); `None`: one position.
    pub mrope_section: Option<[usize; 3]>,
    /// The vision encoder tune reads with the language model (Qwen2-VL's), and the tokens that
    /// stand for its images.
    pub vision: Option<VisionArgs>,
    /// The `config.json` object as read (a multimodal checkpoint's whole one), written back
    /// unchanged when saving.
    pub raw: Value,
}

impl ModelArgs {
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        let raw = Self::read_json(path)?;
        Self::from_json(raw).map_err(|message| ModelError::BadConfig {
            path: path.to_path_buf(),
            message,
        })
    }

    /// A config.json as JSON.
    pub fn read_json(path: &Path) -> Result<Value, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        serde_json::from_str(&text).map_err(|e| ModelError::BadConfig {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// Parses both the classic layout (`rope_theta`, `rope_scaling`, `torch_dtype`) and the
    /// transformers 5 layout (`rope_parameters`, `dtype`).
    pub fn from_json(raw: Value) -> Result<Self, String> {
        match text_tower::text_config(&raw) {
            Some(tower) => {
                let (tower, text) = tower?;
                let mut args =
                    Self::from_text_json(text).map_err(|e| format!("text_config: {e}"))?;
                if tower.reads_vision() {
                    args.vision = Some(VisionArgs::from_config(&raw)?);
                    if args.mrope_section.is_none() {
                        return Err(format!(
                            "text_config: a \"{}\" checkpoint's language model needs its M-RoPE sections (rope_parameters.mrope_section)",
                            tower.wrapper
                        ));
                    }
                }
                args.tower = Some(tower);
                args.raw = raw;
                Ok(args)
            }
            None => Self::from_text_json(raw),
        }
    }

    /// [`Self::from_json`] for a text checkpoint's config (or a multimodal one's `text_config`).
    fn from_text_json(raw: Value) -> Result<Self, String> {
        let model_type = raw
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                "missing \"model_type\"; tune needs it to pick the architecture".to_string()
            })?;
        let family = Family::from_model_type(model_type).ok_or_else(|| {
            format!(
                "unsupported model_type \"{model_type}\"; supported: {}",
                Family::KNOWN.join(", ")
            )
        })?;
        let req = |key: &str| -> Result<usize, String> {
            raw.get(key)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| format!("missing or non-integer \"{key}\""))
        };
        let hidden_size = req("hidden_size")?;
        let num_heads = req("num_attention_heads")?;
        let num_kv_heads = raw
            .get("num_key_value_heads")
            .and_then(Value::as_u64)
            .map_or(num_heads, |v| v as usize);
        let head_dim = raw
            .get("head_dim")
            .and_then(Value::as_u64)
            .map_or(hidden_size / num_heads.max(1), |v| v as usize);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(format!(
                "num_attention_heads ({num_heads}) must be a positive multiple of num_key_value_heads ({num_kv_heads})"
            ));
        }
        let f = |key: &str| raw.get(key).and_then(Value::as_f64);
        let b = |key: &str| raw.get(key).and_then(Value::as_bool);
        let rope_params = raw.get("rope_parameters").filter(|v| v.is_object());
        // Gemma 3 in the transformers 5 layout: one RoPE per layer type.
        let (rope_params, local_rope) = match rope_params.and_then(|p| p.get("full_attention")) {
            Some(full) => (
                Some(full),
                rope_params.and_then(|p| p.get("sliding_attention")),
            ),
            None => (rope_params, None),
        };
        let rope_theta = f("rope_theta")
            .or_else(|| {
                rope_params
                    .and_then(|p| p.get("rope_theta"))
                    .and_then(Value::as_f64)
            })
            .unwrap_or(if family == Family::GptOss {
                150_000.0
            } else {
                10_000.0
            });
        // gpt-oss's config class fills in its YaRN when the file has none.
        let gpt_oss_yarn = serde_json::json!({"rope_type": "yarn", "factor": 32.0,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false,
            "original_max_position_embeddings": 4096});
        let scaling = raw
            .get("rope_scaling")
            .filter(|v| v.is_object())
            .or(rope_params)
            .or((family == Family::GptOss).then_some(&gpt_oss_yarn));
        let max_position_embeddings = raw
            .get("max_position_embeddings")
            .and_then(Value::as_u64)
            .unwrap_or(if family == Family::GptOss {
                131_072
            } else {
                4096
            }) as usize;
        let rope_scaling = match scaling {
            None => RopeScaling::None,
            Some(s) => parse_rope_scaling(s, max_position_embeddings)?,
        };
        let mrope_section = match scaling.and_then(|s| s.get("mrope_section")) {
            None | Some(Value::Null) => None,
            Some(v) => Some(parse_mrope_section(v, head_dim)?),
        };
        let activation = match raw
            .get("hidden_activation")
            .or_else(|| raw.get("hidden_act"))
            .and_then(Value::as_str)
            .unwrap_or("silu")
        {
            // gpt-oss's experts apply their own gate whatever `hidden_act` says.
            _ if family == Family::GptOss => Activation::ClampedSwiglu {
                alpha: f("swiglu_alpha").unwrap_or(1.702),
                limit: f("swiglu_limit").unwrap_or(7.0),
            },
            "silu" | "swish" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu" | "gelu_new" => Activation::GeluTanh,
            other => {
                return Err(format!(
                    "unsupported hidden_act \"{other}\"; supported: silu, gelu_pytorch_tanh"
                ));
            }
        };
        let ids = |key: &str| -> Vec<u32> {
            match raw.get(key) {
                Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
                Some(Value::Array(a)) => a
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|v| v as u32)
                    .collect(),
                _ => Vec::new(),
            }
        };
        let gemma = family.is_gemma();
        let num_labels = classifier_labels(&raw);
        let num_layers = req("num_hidden_layers")?;
        let sliding_window = raw
            .get("sliding_window")
            .and_then(Value::as_u64)
            .map(|w| w as usize);
        let sliding_layers = sliding_layers(&raw, family, num_layers, sliding_window)?;
        let rope_layers = rope_layers(&raw, family, num_layers)?;
        let local_rope_theta = match family {
            Family::Gemma3 => Some(
                local_rope
                    .and_then(|p| p.get("rope_theta"))
                    .and_then(Value::as_f64)
                    .or_else(|| f("rope_local_base_freq"))
                    .unwrap_or(10_000.0),
            ),
            _ => None,
        };
        let query_scalar = f("query_pre_attn_scalar")
            .filter(|_| matches!(family, Family::Gemma2 | Family::Gemma3));
        let cap = |key: &str| f(key).filter(|c| *c > 0.0);
        let softcaps = family == Family::Gemma2;
        let moe = MoeArgs::from_config(&raw, family, num_layers)?;
        // Qwen2-MoE names its q/k/v bias `qkv_bias` (on by default); the Qwen 2 family's is
        // `attention_bias` (on by default).
        let attention_bias = match family {
            Family::Qwen2Moe => b("qkv_bias")
                .or_else(|| b("attention_bias"))
                .unwrap_or(true),
            _ => b("attention_bias").unwrap_or(matches!(family, Family::Qwen2 | Family::GptOss)),
        };
        let o_proj_bias = attention_bias
            && !matches!(
                family,
                Family::Qwen2 | Family::Qwen2Moe | Family::Mistral | Family::Phi3 | Family::Mixtral
            );
        Ok(Self {
            family,
            vocab_size: req("vocab_size")?,
            hidden_size,
            intermediate_size: req("intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: f("rms_norm_eps").unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            // transformers defaults tie_word_embeddings to true for Gemma and SmolLM3, false for
            // Llama.
            tie_word_embeddings: num_labels.is_none()
                && b("tie_word_embeddings").unwrap_or(gemma || family == Family::SmolLm3),
            num_labels,
            attention_bias,
            o_proj_bias,
            attention_sinks: family == Family::GptOss,
            mlp_bias: b("mlp_bias").unwrap_or(false),
            qk_norm: matches!(family, Family::Qwen3 | Family::Qwen3Moe | Family::Gemma3),
            norm_weight_offset: gemma,
            scale_embeddings: gemma,
            activation,
            fused_projections: family == Family::Phi3,
            attn_scale: 1.0 / query_scalar.unwrap_or(head_dim as f64).sqrt(),
            // Gemma 3 defines no soft-capping (transformers ignores the keys for it).
            attn_logit_softcap: cap("attn_logit_softcapping").filter(|_| softcaps),
            final_logit_softcap: cap("final_logit_softcapping").filter(|_| softcaps),
            sliding_window: sliding_window.filter(|_| sliding_layers.iter().any(|s| *s)),
            sliding_layers,
            rope_layers,
            sandwich_norms: matches!(family, Family::Gemma2 | Family::Gemma3),
            local_rope_theta,
            moe,
            bos_token_id: ids("bos_token_id").first().copied(),
            eos_token_ids: ids("eos_token_id"),
            pad_token_id: ids("pad_token_id").first().copied(),
            tower: None,
            mrope_section,
            vision: None,
            raw,
        })
    }

    /// The output head's name in a Hugging Face checkpoint: `score` for a classifier,
    /// `lm_head` for a causal model.
    pub fn head_name(&self) -> &'static str {
        if self.num_labels.is_some() {
            "score"
        } else {
            "lm_head"
        }
    }

    /// The output head's width: the classes of a classifier, else the vocabulary.
    pub fn output_size(&self) -> usize {
        self.num_labels.unwrap_or(self.vocab_size)
    }

    /// A parameter's name in the Hugging Face checkpoint, from its module path here: the same,
    /// except for a sparse layer's block (`moe` here; `mlp` in Qwen's checkpoints,
    /// `block_sparse_moe` with experts `w1`/`w3`/`w2` in Mixtral's).
    pub fn hf_name(&self, path: &str) -> String {
        match &self.moe {
            Some(moe) => moe.hf_name(path),
            None => path.to_string(),
        }
    }

    /// LoRA's target leaf names as this checkpoint names its layers: the MLP's
    /// `gate_proj`/`up_proj`/`down_proj` are Mixtral's experts' `w1`/`w3`/`w2` (peft's
    /// `target_modules` for Mixtral name them so).
    pub fn lora_targets(&self, targets: &[String]) -> Vec<String> {
        match self.moe.as_ref().map(|m| m.naming) {
            Some(ExpertNaming::Mixtral) => targets
                .iter()
                .map(|t| {
                    match t.as_str() {
                        "gate_proj" => "w1",
                        "up_proj" => "w3",
                        "down_proj" => "w2",
                        other => other,
                    }
                    .to_string()
                })
                .collect(),
            _ => targets.to_vec(),
        }
    }

    /// Whether LoRA adapts the linear layer `name` (a checkpoint name) when its leaf is a
    /// target: in a sparse model, the MLP targets mean what peft 0.21 adapts when it loads the
    /// adapter on transformers 5 ([`MoeArgs::lora_on_experts`]), so that what tune trains is
    /// what peft loads.
    pub fn lora_adapts(&self, name: &str) -> bool {
        let Some(moe) = &self.moe else {
            return true;
        };
        let mlp_leaf = ["gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"]
            .iter()
            .any(|leaf| name.ends_with(&format!(".{leaf}")));
        !mlp_leaf || name.contains(".experts.") == moe.lora_on_experts
    }

    /// Whether the checkpoint stores several of the model's weights in one tensor that a
    /// rank's rows cannot be read from (Phi-3's `qkv_proj`/`gate_up_proj`, gpt-oss's experts):
    /// such a model loads whole and saves gathered.
    pub fn fused_on_disk(&self) -> bool {
        self.fused_projections
            || self
                .moe
                .as_ref()
                .is_some_and(|m| m.naming == ExpertNaming::GptOss)
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Parameter count of the base model (no adapters), counting tied weights once.
    pub fn num_params(&self) -> usize {
        self.count_params(false)
    }

    /// The parameters one token computes with: [`Self::num_params`] with each sparse layer's
    /// experts counted `top_k` times, not `num_experts` (the same for a dense model).
    pub fn active_params(&self) -> usize {
        self.count_params(true)
    }

    fn count_params(&self, active: bool) -> usize {
        let h = self.hidden_size;
        let attn = h * self.q_dim() * 2
            + h * self.kv_dim() * 2
            + if self.attention_bias {
                self.q_dim() + 2 * self.kv_dim()
            } else {
                0
            }
            + if self.qk_norm { 2 * self.head_dim } else { 0 }
            + if self.o_proj_bias { h } else { 0 }
            + if self.attention_sinks {
                self.num_heads
            } else {
                0
            };
        let dense = 3 * h * self.intermediate_size;
        let mlps: usize = (0..self.num_layers)
            .map(|l| match &self.moe {
                Some(moe) if moe.is_sparse(l) => moe.params(h, active),
                _ => dense,
            })
            .sum();
        let layer = attn + if self.sandwich_norms { 4 * h } else { 2 * h };
        let embed = self.vocab_size * h;
        embed * if self.tie_word_embeddings { 1 } else { 2 } + self.num_layers * layer + mlps + h
    }
}

/// Which layers use sliding-window attention, as transformers decides it: `layer_types` when
/// the config has it; else Gemma 2 alternates (even layers slide), Gemma 3 slides except every
/// `sliding_window_pattern`-th layer, and Mistral and Phi-3 slide everywhere when `sliding_window` is
/// set. Families that define windows only behind a switch (Qwen's `use_sliding_window`) are
/// refused when it is on.
fn sliding_layers(
    raw: &Value,
    family: Family,
    num_layers: usize,
    window: Option<usize>,
) -> Result<Vec<bool>, String> {
    // SmolLM3 slides only behind its switch (transformers ignores `layer_types` without it).
    let switched_off = raw.get("use_sliding_window").and_then(Value::as_bool) != Some(true);
    if window.is_none() || (family == Family::SmolLm3 && switched_off) {
        return Ok(Vec::new());
    }
    if let Some(types) = raw.get("layer_types").and_then(Value::as_array) {
        if types.len() != num_layers {
            return Err(format!(
                "\"layer_types\" has {} entries for {num_layers} layers",
                types.len()
            ));
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                other => Err(format!(
                    "unsupported layer type {other:?} in \"layer_types\"; supported: sliding_attention, full_attention"
                )),
            })
            .collect();
    }
    Ok(match family {
        Family::Gemma2 | Family::GptOss => (0..num_layers).map(|i| (i + 1) % 2 != 0).collect(),
        Family::Gemma3 => {
            let pattern = raw
                .get("sliding_window_pattern")
                .and_then(Value::as_u64)
                .unwrap_or(6) as usize;
            (0..num_layers)
                .map(|i| (i + 1) % pattern.max(1) != 0)
                .collect()
        }
        Family::Mistral | Family::Mixtral | Family::Phi3 => vec![true; num_layers],
        // With its switch on, SmolLM3's NoPE layers slide.
        Family::SmolLm3 => rope_layers(raw, family, num_layers)?
            .into_iter()
            .map(|rope| !rope)
            .collect(),
        Family::Qwen2 | Family::Qwen3 | Family::Qwen2Moe | Family::Qwen3Moe
            if raw.get("use_sliding_window").and_then(Value::as_bool) == Some(true) =>
        {
            return Err(
                "\"use_sliding_window\": true is not supported for Qwen models (their released checkpoints leave it off)".into(),
            );
        }
        _ => Vec::new(),
    })
}

/// Which layers apply RoPE, as transformers' SmolLM3 decides it: `no_rope_layers` (one 0/1 per
/// layer) when the config has it, else every `no_rope_layer_interval`-th layer (default 4)
/// goes without. Every other family rotates every layer (empty).
fn rope_layers(raw: &Value, family: Family, num_layers: usize) -> Result<Vec<bool>, String> {
    if family != Family::SmolLm3 {
        return Ok(Vec::new());
    }
    if let Some(flags) = raw.get("no_rope_layers").filter(|v| !v.is_null()) {
        let flags = flags
            .as_array()
            .ok_or("\"no_rope_layers\" must be a list of 0 and 1, one per layer")?;
        if flags.len() != num_layers {
            return Err(format!(
                "\"no_rope_layers\" has {} entries for {num_layers} layers",
                flags.len()
            ));
        }
        return flags
            .iter()
            .map(|f| match f.as_u64() {
                Some(0) => Ok(false),
                Some(1) => Ok(true),
                _ => Err(format!(
                    "\"no_rope_layers\" holds {f}; each entry is 1 (RoPE) or 0 (none)"
                )),
            })
            .collect();
    }
    let interval = raw
        .get("no_rope_layer_interval")
        .and_then(Value::as_u64)
        .unwrap_or(4)
        .max(1) as usize;
    Ok((0..num_layers).map(|i| (i + 1) % interval != 0).collect())
}

/// The classes of a `*ForSequenceClassification` checkpoint (transformers' `num_labels`, or the
/// size of `id2label`, which is what `PretrainedConfig` saves; 2 when neither is there, its
/// default); `None` for any other architecture.
fn classifier_labels(raw: &Value) -> Option<usize> {
    let architecture = raw.get("architectures")?.as_array()?.first()?.as_str()?;
    if !architecture.ends_with("ForSequenceClassification") {
        return None;
    }
    let labels = raw
        .get("num_labels")
        .and_then(Value::as_u64)
        .map(|n| n as usize)
        .or_else(|| raw.get("id2label")?.as_object().map(|m| m.len()));
    Some(labels.unwrap_or(2))
}

/// `mrope_section`: three counts of rotary frequencies summing to half the head size.
fn parse_mrope_section(v: &Value, head_dim: usize) -> Result<[usize; 3], String> {
    let counts: Option<Vec<usize>> = v
        .as_array()
        .map(|a| a.iter().map(|n| n.as_u64().map(|n| n as usize)).collect())
        .unwrap_or(None);
    match counts.as_deref() {
        Some(&[t, h, w]) if t + h + w == head_dim / 2 => Ok([t, h, w]),
        _ => Err(format!(
            "mrope_section {v}: needs three counts of rotary frequencies summing to head_dim / 2 ({})",
            head_dim / 2
        )),
    }
}

fn parse_rope_scaling(s: &Value, max_position_embeddings: usize) -> Result<RopeScaling, String> {
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |key: &str| -> Result<f64, String> {
        s.get(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("rope scaling \"{kind}\" needs \"{key}\""))
    };
    Ok(match kind {
        // Qwen2-VL's older files say `mrope`: default frequencies, the sections read beside.
        "default" | "mrope" => RopeScaling::None,
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        },
        "linear" => RopeScaling::Linear {
            factor: num("factor")?,
        },
        "yarn" => {
            let opt = |key: &str| s.get(key).and_then(Value::as_f64);
            let original = num("original_max_position_embeddings")?;
            let factor = opt("factor").unwrap_or(max_position_embeddings as f64 / original);
            // transformers' `get_mscale`.
            let mscale = |scale: f64, m: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            let attention_factor = match (
                opt("attention_factor"),
                opt("mscale"),
                opt("mscale_all_dim"),
            ) {
                (Some(a), _, _) => a,
                (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                    mscale(factor, m) / mscale(factor, all)
                }
                _ => mscale(factor, 1.0),
            };
            RopeScaling::Yarn {
                factor,
                attention_factor,
                beta_fast: opt("beta_fast").filter(|b| *b != 0.0).unwrap_or(32.0),
                beta_slow: opt("beta_slow").filter(|b| *b != 0.0).unwrap_or(1.0),
                original_max_position_embeddings: original,
                truncate: s.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            }
        }
        other => {
            return Err(format!(
                "unsupported rope scaling type \"{other}\"; supported: default, llama3, linear, yarn"
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    /// `o_proj` takes `attention_bias` where transformers' attention gives it one (Llama, Qwen 3,
    /// Gemma, SmolLM3, gpt-oss), never in Qwen 2, Qwen2-MoE, Mistral, Phi-3 or Mixtral.
    #[test]
    fn the_output_projection_is_biased_as_transformers_builds_it() {
        use super::*;
        let biased = |model_type: &str| {
            let raw = serde_json::json!({"model_type": model_type, "hidden_size": 32,
                "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 64,
                "vocab_size": 100, "attention_bias": true, "num_local_experts": 4,
                "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 16});
            let a = ModelArgs::from_json(raw).unwrap();
            assert!(a.attention_bias, "{model_type}");
            a.o_proj_bias
        };
        for model_type in ["llama", "qwen3", "gemma", "smollm3", "gpt_oss", "qwen3_moe"] {
            assert!(biased(model_type), "{model_type}");
        }
        for model_type in ["qwen2", "qwen2_moe", "mistral", "phi3", "mixtral"] {
            assert!(!biased(model_type), "{model_type}");
        }
    }

    /// openai/gpt-oss-20b's config.json as the Hub holds it (transformers 4.55's layout:
    /// `rope_scaling` and a top-level `rope_theta`, MXFP4 experts, no `swiglu_alpha`).
    #[test]
    fn gpt_oss_20b_reads_as_the_hub_stores_it() {
        use super::*;
        let raw = serde_json::json!({
            "architectures": ["GptOssForCausalLM"], "attention_bias": true,
            "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
            "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
            "initial_context_length": 4096, "initializer_range": 0.02,
            "intermediate_size": 2880, "max_position_embeddings": 131072,
            "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
            "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
            "output_router_logits": false, "pad_token_id": 199999,
            "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router",
                "model.embed_tokens", "lm_head"]},
            "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0,
                "factor": 32.0, "original_max_position_embeddings": 4096, "rope_type": "yarn",
                "truncate": false},
            "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
            "swiglu_limit": 7.0, "tie_word_embeddings": false, "use_cache": true,
            "vocab_size": 201088
        });
        let a = ModelArgs::from_json(raw).unwrap();
        assert_eq!(a.family, Family::GptOss);
        assert!(a.attention_bias && a.o_proj_bias && a.attention_sinks);
        assert!(!a.tie_word_embeddings && a.fused_on_disk());
        assert_eq!(a.sliding_window, Some(128));
        assert_eq!(a.sliding_layers[..4], [true, false, true, false]);
        assert_eq!(a.rope_theta, 150_000.0);
        assert!(matches!(
            a.rope_scaling,
            RopeScaling::Yarn {
                factor: 32.0,
                truncate: false,
                ..
            }
        ));
        assert_eq!(
            a.activation,
            Activation::ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0
            }
        );
        let moe = a.moe.clone().unwrap();
        assert_eq!((moe.num_experts, moe.top_k), (32, 4));
        assert!(moe.norm_topk_prob && !moe.lora_on_experts);
        assert_eq!(moe.aux_loss_coef, None);
        assert_eq!(
            a.hf_name("model.layers.3.moe.gate.bias"),
            "model.layers.3.mlp.router.bias"
        );
        // OpenAI's model card: 20.91B parameters, 3.61B active per token (the input
        // embeddings not counted among the active ones).
        let billions = |n: usize| n as f64 / 1e9;
        assert!(
            (billions(a.num_params()) - 20.91).abs() < 0.01,
            "{}",
            a.num_params()
        );
        let active = a.active_params() - a.vocab_size * a.hidden_size;
        assert!((billions(active) - 3.61).abs() < 0.01, "{active}");
    }

    fn smollm3(extra: serde_json::Value) -> Result<ModelArgs, String> {
        let mut raw = serde_json::json!({"model_type": "smollm3", "hidden_size": 64,
            "num_attention_heads": 4, "num_hidden_layers": 8, "intermediate_size": 128,
            "vocab_size": 100});
        for (k, v) in extra.as_object().unwrap() {
            raw[k] = v.clone();
        }
        ModelArgs::from_json(raw)
    }

    #[test]
    fn smollm3_reads_its_nope_layers_and_ties_by_default() {
        let every_fourth = smollm3(serde_json::json!({})).unwrap();
        let expected: Vec<bool> = (0..8).map(|i| (i + 1) % 4 != 0).collect();
        assert_eq!(every_fourth.rope_layers, expected);
        assert!(every_fourth.tie_word_embeddings);
        assert!(every_fourth.sliding_layers.is_empty());
        let listed =
            smollm3(serde_json::json!({"no_rope_layers": [1, 1, 0, 1, 1, 1, 0, 1]})).unwrap();
        assert_eq!(listed.rope_layers.iter().filter(|r| !**r).count(), 2);
        // Sliding only behind `use_sliding_window`, on the NoPE layers.
        let sliding = smollm3(
            serde_json::json!({"use_sliding_window": true, "sliding_window": 16,
            "no_rope_layer_interval": 2}),
        )
        .unwrap();
        assert_eq!(
            sliding.sliding_layers,
            vec![false, true, false, true, false, true, false, true]
        );
        let switched_off = smollm3(serde_json::json!({"sliding_window": 16})).unwrap();
        assert_eq!(switched_off.sliding_window, None);
        // Other families rotate every layer.
        let llama =
            ModelArgs::from_json(serde_json::json!({"model_type": "llama", "hidden_size": 64,
            "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
            "vocab_size": 100, "no_rope_layers": [0, 0]}))
            .unwrap();
        assert!(llama.rope_layers.is_empty());
    }

    #[test]
    fn smollm3_refuses_a_malformed_no_rope_list_naming_it() {
        let short = smollm3(serde_json::json!({"no_rope_layers": [1, 0]})).unwrap_err();
        assert!(
            short.contains("\"no_rope_layers\" has 2 entries for 8 layers"),
            "{short}"
        );
        let bad =
            smollm3(serde_json::json!({"no_rope_layers": [1, 1, 2, 1, 1, 1, 0, 1]})).unwrap_err();
        assert!(bad.contains("holds 2"), "{bad}");
    }

    use super::*;

    #[test]
    fn both_config_layouts_give_the_same_rope() {
        let classic = serde_json::json!({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
            "num_hidden_layers":2,"intermediate_size":128,"vocab_size":10,"rope_theta":5e5,
            "rope_scaling":{"rope_type":"llama3","factor":32.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":64}});
        let v5 = serde_json::json!({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
            "num_hidden_layers":2,"intermediate_size":128,"vocab_size":10,
            "rope_parameters":{"rope_type":"llama3","rope_theta":5e5,"factor":32.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":64}});
        let a = ModelArgs::from_json(classic).unwrap();
        let b = ModelArgs::from_json(v5).unwrap();
        assert_eq!(a.rope_theta, b.rope_theta);
        assert_eq!(a.rope_scaling, b.rope_scaling);
    }

    #[test]
    fn unknown_model_type_names_supported_ones() {
        let err = ModelArgs::from_json(serde_json::json!({"model_type":"gpt2"})).unwrap_err();
        assert!(err.contains("unsupported model_type \"gpt2\""), "{err}");
        assert!(err.contains("llama"), "{err}");
    }
}
