//! The model families tune understands, by the `model_type` of a checkpoint's `config.json`.

/// The model families `tune` understands, from `model_type` in `config.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Phi3,
    Gemma,
    Gemma2,
    /// Gemma 3's text-only models (`Gemma3ForCausalLM`, model_type `gemma3_text`).
    Gemma3,
    /// SmolLM3: Llama with layers that apply no RoPE (`no_rope_layers`).
    SmolLm3,
    /// Qwen2-MoE: Qwen 2 attention, sparse layers with a gated shared expert.
    Qwen2Moe,
    /// Qwen3-MoE: Qwen 3 attention, sparse layers.
    Qwen3Moe,
    /// Mixtral: Mistral attention, every layer sparse (`block_sparse_moe`, experts `w1/w3/w2`).
    Mixtral,
    /// gpt-oss: every layer sparse (a biased router, biased experts with a clamped SwiGLU,
    /// stored fused), attention sinks, alternating sliding-window layers, YaRN RoPE.
    GptOss,
}

impl Family {
    pub const KNOWN: &'static [&'static str] = &[
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "phi3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "smollm3",
        "qwen2_moe",
        "qwen3_moe",
        "mixtral",
        "gpt_oss",
    ];

    pub fn from_model_type(model_type: &str) -> Option<Self> {
        Some(match model_type {
            "llama" => Self::Llama,
            "mistral" => Self::Mistral,
            "qwen2" => Self::Qwen2,
            "qwen3" => Self::Qwen3,
            "phi3" => Self::Phi3,
            "gemma" => Self::Gemma,
            "gemma2" => Self::Gemma2,
            "gemma3_text" => Self::Gemma3,
            "smollm3" => Self::SmolLm3,
            "qwen2_moe" => Self::Qwen2Moe,
            "qwen3_moe" => Self::Qwen3Moe,
            "mixtral" => Self::Mixtral,
            "gpt_oss" => Self::GptOss,
            _ => return None,
        })
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Phi3 => "phi3",
            Self::Gemma => "gemma",
            Self::Gemma2 => "gemma2",
            Self::Gemma3 => "gemma3_text",
            Self::SmolLm3 => "smollm3",
            Self::Qwen2Moe => "qwen2_moe",
            Self::Qwen3Moe => "qwen3_moe",
            Self::Mixtral => "mixtral",
            Self::GptOss => "gpt_oss",
        }
    }

    /// Gemma's conventions: `1 + w` norms, embeddings scaled by sqrt(hidden), tied output.
    pub fn is_gemma(self) -> bool {
        matches!(self, Self::Gemma | Self::Gemma2 | Self::Gemma3)
    }
}
