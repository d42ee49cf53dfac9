//! Model shapes benchmarks run on, as Hugging Face `config.json` objects (random weights, so
//! nothing is downloaded).

use serde_json::{Value, json};

pub const SHAPES: &[&str] = &["tiny", "smollm2-135m", "llama3.2-1b"];

pub fn config(shape: &str) -> Option<Value> {
    Some(match shape {
        // The shipped tiny llama's shape.
        "tiny" => json!({
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 2048, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": true,
            "max_position_embeddings": 256, "torch_dtype": "float32"
        }),
        // HuggingFaceTB/SmolLM2-135M's config.json.
        "smollm2-135m" => json!({
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
            "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": true,
            "max_position_embeddings": 8192, "torch_dtype": "float32"
        }),
        // meta-llama/Llama-3.2-1B's config.json.
        "llama3.2-1b" => json!({
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": true,
            "max_position_embeddings": 131072, "torch_dtype": "float32",
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}
        }),
        _ => return None,
    })
}
