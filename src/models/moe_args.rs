//! The mixture-of-experts part of [`ModelArgs`](super::ModelArgs), read from `config.json` as
//! transformers reads it: which layers are sparse, how tokens are routed, and how the
//! checkpoint names a sparse layer's tensors.

use serde_json::Value;

use super::family::Family;

/// How a family's checkpoints name a sparse layer's block and its experts' projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertNaming {
    /// `mlp.gate`, `mlp.experts.{e}.gate_proj/up_proj/down_proj` (Qwen2-MoE, Qwen3-MoE).
    Qwen,
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1/w3/w2` (Mixtral).
    Mixtral,
    /// `mlp.router` (weight and bias) and every expert fused in four tensors (gpt-oss):
    /// `mlp.experts.gate_up_proj` `[experts, hidden, 2 * intermediate]` (gate and up columns
    /// interleaved), `gate_up_proj_bias`, `down_proj` `[experts, intermediate, hidden]` and
    /// `down_proj_bias`; the Hub's release stores the two weights in MXFP4
    /// (`*_blocks`/`*_scales`). Here each expert is its own biased `gate_proj`/`up_proj`/
    /// `down_proj`, split on load and fused again on save (`build.rs`, `params.rs`).
    GptOss,
}

impl ExpertNaming {
    /// The router's module below a decoder layer in transformers 5 (`model.layers.{i}.` before
    /// it): what peft's `modules_to_save` names and its adapter file keys by. Mixtral's
    /// checkpoints store it as `block_sparse_moe.gate`, but transformers 5 builds it as
    /// `mlp.gate`, and peft matches module names.
    pub fn router_module(self) -> &'static str {
        match self {
            Self::Qwen | Self::Mixtral => "mlp.gate",
            Self::GptOss => "mlp.router",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct MoeArgs {
    pub num_experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub top_k: usize,
    /// Each expert's SwiGLU width (`moe_intermediate_size`; Mixtral's `intermediate_size`).
    pub expert_intermediate_size: usize,
    /// The chosen experts' probabilities renormalised to sum to 1 (always for Mixtral).
    pub norm_topk_prob: bool,
    /// Qwen2-MoE: a shared expert of this width on every token, gated by a sigmoid.
    pub shared_expert_intermediate_size: Option<usize>,
    /// Which layers are sparse, by layer index (the others keep a dense MLP of
    /// `intermediate_size`).
    pub sparse_layers: Vec<bool>,
    pub naming: ExpertNaming,
    /// What LoRA's MLP targets (`gate_proj`/`up_proj`/`down_proj`) adapt, as peft 0.21 does
    /// on transformers 5, which holds the routed experts fused in 3-D tensors: for Qwen3-MoE
    /// and Mixtral peft maps the targets onto the fused experts (and loads per-expert
    /// adapters, the layout it wrote on transformers 4, into them), so the routed experts and
    /// not a dense layer's MLP; for Qwen2-MoE it has no such mapping and adapts the linear
    /// modules of those names, the shared experts and dense MLPs, not the routed experts.
    pub lora_on_experts: bool,
    /// `output_router_logits: true`: training adds `router_aux_loss_coef` (transformers'
    /// default 0.001) times the load-balancing loss to the loss, as transformers' `*ForCausalLM`
    /// does; `None` when the config leaves it off (the released checkpoints do).
    pub aux_loss_coef: Option<f64>,
}

impl MoeArgs {
    /// `None` for a dense family. Refuses, by key, what tune would otherwise ignore: Mixtral's
    /// router noise.
    pub fn from_config(
        raw: &Value,
        family: Family,
        num_layers: usize,
    ) -> Result<Option<Self>, String> {
        let naming = match family {
            Family::Qwen2Moe | Family::Qwen3Moe => ExpertNaming::Qwen,
            Family::Mixtral => ExpertNaming::Mixtral,
            Family::GptOss => ExpertNaming::GptOss,
            _ => return Ok(None),
        };
        let int = |key: &str| raw.get(key).and_then(Value::as_u64).map(|v| v as usize);
        let need = |key: &str| int(key).ok_or_else(|| format!("missing or non-integer \"{key}\""));
        // transformers 5 writes Qwen3-MoE's expert count as `num_local_experts`; the Hub's
        // configs say `num_experts`.
        let num_experts = int("num_experts")
            .or_else(|| int("num_local_experts"))
            .ok_or("missing \"num_experts\" (or \"num_local_experts\")")?;
        let top_k = need("num_experts_per_tok")?;
        if top_k == 0 || top_k > num_experts {
            return Err(format!(
                "\"num_experts_per_tok\" is {top_k}; it must be between 1 and the {num_experts} experts"
            ));
        }
        let aux_loss_coef =
            (raw.get("output_router_logits").and_then(Value::as_bool) == Some(true)).then(|| {
                raw.get("router_aux_loss_coef")
                    .and_then(Value::as_f64)
                    .unwrap_or(0.001)
            });
        if let Some(noise) = raw.get("router_jitter_noise").and_then(Value::as_f64)
            && noise > 0.0
        {
            return Err(format!(
                "\"router_jitter_noise\": {noise} is not supported (tune routes without noise); set it to 0.0"
            ));
        }
        let sparse_layers = match naming {
            ExpertNaming::Mixtral | ExpertNaming::GptOss => vec![true; num_layers],
            ExpertNaming::Qwen => {
                let step = int("decoder_sparse_step").unwrap_or(1).max(1);
                let dense: Vec<u64> = raw
                    .get("mlp_only_layers")
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(Value::as_u64).collect())
                    .unwrap_or_default();
                (0..num_layers)
                    .map(|l| !dense.contains(&(l as u64)) && (l + 1) % step == 0)
                    .collect()
            }
        };
        let (expert_intermediate_size, norm_topk_prob) = match naming {
            // gpt-oss's router takes the softmax of the top-k logits: the renormalised top-k
            // probabilities, with the same gradient (none to the logits not chosen).
            ExpertNaming::Mixtral | ExpertNaming::GptOss => (need("intermediate_size")?, true),
            ExpertNaming::Qwen => (
                need("moe_intermediate_size")?,
                raw.get("norm_topk_prob")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
            ),
        };
        let shared_expert_intermediate_size = match family {
            Family::Qwen2Moe => Some(need("shared_expert_intermediate_size")?).filter(|n| *n > 0),
            _ => None,
        };
        Ok(Some(Self {
            num_experts,
            top_k,
            expert_intermediate_size,
            norm_topk_prob,
            shared_expert_intermediate_size,
            sparse_layers,
            naming,
            // gpt-oss's experts are 3-D parameters peft adapts only through
            // `target_parameters` (its `ParamWrapper`): never by module name, but through
            // `model_io::peft_experts`.
            lora_on_experts: !matches!(family, Family::Qwen2Moe | Family::GptOss),
            aux_loss_coef,
        }))
    }

    pub fn is_sparse(&self, layer: usize) -> bool {
        self.sparse_layers.get(layer).copied().unwrap_or(false)
    }

    /// Parameters of one sparse layer's block: router, experts and shared expert; with
    /// `active`, the experts one token computes with (`top_k` of them).
    pub fn params(&self, hidden: usize, active: bool) -> usize {
        let shared = self
            .shared_expert_intermediate_size
            .map_or(0, |i| 3 * hidden * i + hidden);
        let experts = if active { self.top_k } else { self.num_experts };
        let i = self.expert_intermediate_size;
        // gpt-oss: a router bias, and each expert's three projections' biases.
        let biases = match self.naming {
            ExpertNaming::GptOss => self.num_experts + experts * (2 * i + hidden),
            _ => 0,
        };
        self.num_experts * hidden + experts * 3 * hidden * i + shared + biases
    }

    /// The checkpoint name of a module path (`model.layers.0.moe.experts.1.gate_proj.weight`
    /// -> `...mlp.experts.1.gate_proj.weight`, or Mixtral's `...block_sparse_moe.experts.1.w1.weight`).
    pub fn hf_name(&self, path: &str) -> String {
        let parts: Vec<&str> = path.split('.').collect();
        let Some(block) = parts.iter().position(|p| *p == "moe") else {
            return path.to_string();
        };
        let mut out: Vec<&str> = parts.clone();
        out[block] = match self.naming {
            ExpertNaming::Qwen | ExpertNaming::GptOss => "mlp",
            ExpertNaming::Mixtral => "block_sparse_moe",
        };
        if self.naming == ExpertNaming::GptOss && parts.get(block + 1) == Some(&"gate") {
            out[block + 1] = "router";
        }
        // `moe.experts.{e}.<projection>`
        if self.naming == ExpertNaming::Mixtral
            && parts.get(block + 1) == Some(&"experts")
            && let Some(projection) = out.get_mut(block + 3)
        {
            *projection = match *projection {
                "gate_proj" => "w1",
                "up_proj" => "w3",
                "down_proj" => "w2",
                other => other,
            };
        }
        out.join(".")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::ModelArgs;

    fn args(model_type: &str, extra: Value) -> Result<ModelArgs, String> {
        let mut raw = serde_json::json!({"model_type": model_type, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "vocab_size": 256, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24});
        for (k, v) in extra.as_object().into_iter().flatten() {
            raw[k] = v.clone();
        }
        ModelArgs::from_json(raw)
    }

    #[test]
    fn qwen_sparse_layers_follow_the_step_and_the_dense_list() {
        let a = args(
            "qwen3_moe",
            serde_json::json!({"num_experts": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]}),
        )
        .unwrap();
        let moe = a.moe.clone().unwrap();
        assert_eq!(moe.sparse_layers, [false, true, false, false]);
        // one sparse layer: 8 experts of 3 * 32 * 16 and a router of 8 * 32; 2 of 8 active
        assert_eq!(a.num_params() - a.active_params(), (8 - 2) * 3 * 32 * 16);
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
            (8, 2, 16)
        );
        assert!(!moe.norm_topk_prob);
        assert_eq!(moe.shared_expert_intermediate_size, None);
    }

    #[test]
    fn qwen3_moe_reads_the_expert_count_transformers_5_writes() {
        let a = args("qwen3_moe", serde_json::json!({"num_local_experts": 6})).unwrap();
        assert_eq!(a.moe.unwrap().num_experts, 6);
    }

    #[test]
    fn mixtral_is_sparse_everywhere_and_renormalises() {
        let a = args("mixtral", serde_json::json!({"num_local_experts": 8})).unwrap();
        let moe = a.moe.clone().unwrap();
        assert_eq!(moe.sparse_layers, [true; 4]);
        assert!(moe.norm_topk_prob);
        assert_eq!(moe.expert_intermediate_size, 64);
        assert_eq!(
            a.hf_name("model.layers.3.moe.experts.7.up_proj.weight"),
            "model.layers.3.block_sparse_moe.experts.7.w3.weight"
        );
        assert_eq!(
            a.hf_name("model.layers.3.moe.gate.weight"),
            "model.layers.3.block_sparse_moe.gate.weight"
        );
        assert_eq!(
            a.hf_name("model.layers.3.self_attn.q_proj.weight"),
            "model.layers.3.self_attn.q_proj.weight"
        );
    }

    #[test]
    fn qwen2_moe_has_a_shared_expert_and_qkv_bias() {
        let a = args("qwen2_moe", serde_json::json!({"num_experts": 4})).unwrap();
        assert_eq!(
            a.moe.as_ref().unwrap().shared_expert_intermediate_size,
            Some(24)
        );
        assert!(a.attention_bias);
        assert_eq!(
            a.hf_name("model.layers.0.moe.shared_expert_gate.weight"),
            "model.layers.0.mlp.shared_expert_gate.weight"
        );
        let unbiased = args(
            "qwen2_moe",
            serde_json::json!({"num_experts": 4, "qkv_bias": false}),
        )
        .unwrap();
        assert!(!unbiased.attention_bias);
    }

    /// peft 0.21 on transformers 5: Qwen3-MoE's and Mixtral's MLP targets are the routed
    /// experts; Qwen2-MoE's are its linear modules of those names (shared expert, dense MLPs).
    #[test]
    fn lora_adapts_what_peft_adapts_per_family() {
        let qwen3 = args("qwen3_moe", serde_json::json!({"num_experts": 4})).unwrap();
        assert!(qwen3.lora_adapts("model.layers.0.mlp.experts.2.up_proj"));
        assert!(!qwen3.lora_adapts("model.layers.1.mlp.up_proj"));
        assert!(qwen3.lora_adapts("model.layers.1.self_attn.q_proj"));
        let qwen2 = args("qwen2_moe", serde_json::json!({"num_experts": 4})).unwrap();
        assert!(!qwen2.lora_adapts("model.layers.0.mlp.experts.2.up_proj"));
        assert!(qwen2.lora_adapts("model.layers.0.mlp.shared_expert.up_proj"));
        let mixtral = args("mixtral", serde_json::json!({"num_local_experts": 4})).unwrap();
        assert!(mixtral.lora_adapts("model.layers.0.block_sparse_moe.experts.1.w3"));
        assert_eq!(
            mixtral.lora_targets(&["q_proj".into(), "gate_proj".into(), "down_proj".into()]),
            ["q_proj", "w1", "w2"]
        );
    }

    #[test]
    fn what_tune_would_ignore_is_refused_by_key() {
        let aux = |extra| args("qwen3_moe", extra).unwrap().moe.unwrap().aux_loss_coef;
        let on = serde_json::json!({"num_experts": 4, "output_router_logits": true});
        assert_eq!(aux(on), Some(0.001));
        let coef = serde_json::json!({"num_experts": 4, "output_router_logits": true,
            "router_aux_loss_coef": 0.02});
        assert_eq!(aux(coef), Some(0.02));
        let off = serde_json::json!({"num_experts": 4, "router_aux_loss_coef": 0.02});
        assert_eq!(aux(off), None);
        let noise = args(
            "mixtral",
            serde_json::json!({"num_local_experts": 4, "router_jitter_noise": 0.1}),
        )
        .unwrap_err();
        assert!(noise.contains("router_jitter_noise"), "{noise}");
        let too_many = args("qwen3_moe", serde_json::json!({"num_experts": 1})).unwrap_err();
        assert!(too_many.contains("num_experts_per_tok"), "{too_many}");
    }
}
