//! Load and forward throughput of a SmolLM2-135M-shaped model on the CPU, with random
//! weights (no download): saves the model as a Hugging Face checkpoint in a temp dir, times
//! `load_model`, then times forward passes of batch 1 x 256 tokens after a warm-up.
//!
//!     cargo run --release --example forward_bench [-- ITERATIONS]

use std::time::Instant;

use tune::checkpoint::StorageDtype;
use tune::generation::{GenerateOptions, generate};
use tune::model_io::hf::{DEFAULT_MAX_SHARD_BYTES, load_model, save_model};
use tune::models::{ModelArgs, RandomInit, TokenBatch, build};
use tune::modules::ForwardMode;

type B = burn::backend::Flex;

const SEQ: usize = 256;

fn smollm2_135m() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": false,
        "bos_token_id": 0, "eos_token_id": 0, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 576, "initializer_range": 0.041666666666666664, "intermediate_size": 1536,
        "max_position_embeddings": 8192, "mlp_bias": false, "num_attention_heads": 9,
        "num_hidden_layers": 30, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
        "rope_scaling": null, "rope_theta": 100000, "tie_word_embeddings": true,
        "torch_dtype": "bfloat16", "vocab_size": 49152
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let iterations: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let device = Default::default();
    let args = ModelArgs::from_json(smollm2_135m())?;
    println!(
        "model: SmolLM2-135M shape, {:.1}M parameters, random weights",
        args.num_params() as f64 / 1e6
    );

    let dir = std::env::temp_dir().join(format!("tune-forward-bench-{}", std::process::id()));
    let model = build::<B>(&args, &mut RandomInit::new(0, &args), &device)?;
    for (dtype, name) in [(StorageDtype::BF16, "bf16"), (StorageDtype::F32, "f32")] {
        let _ = std::fs::remove_dir_all(&dir);
        save_model(&model, &dir, None, dtype, DEFAULT_MAX_SHARD_BYTES)?;
        let started = Instant::now();
        let loaded = load_model::<B>(&dir, None, &device)?;
        println!(
            "load_model ({name} safetensors): {:.3} s",
            started.elapsed().as_secs_f64()
        );
        drop(loaded);
    }
    drop(model);
    let model = load_model::<B>(&dir, None, &device)?.model;
    let _ = std::fs::remove_dir_all(&dir);

    let tokens: Vec<u32> = (0..SEQ as u32).map(|i| (i * 7919) % 49152).collect();
    let positions: Vec<u32> = (0..SEQ as u32).collect();
    let forward = || {
        let input = TokenBatch {
            tokens: &tokens,
            positions: &positions,
            document_ids: None,
            continued_documents: None,
            left_padding: None,
            padding: None,
            images: None,
            batch: 1,
        };
        let logits = model.forward(input, ForwardMode::default());
        // Reading back forces the lazy backend to finish the work.
        logits.into_data()
    };
    let started = Instant::now();
    forward();
    println!(
        "warm-up forward (1 x {SEQ}): {:.3} s",
        started.elapsed().as_secs_f64()
    );
    let started = Instant::now();
    for _ in 0..iterations {
        forward();
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "forward 1 x {SEQ}, {iterations} iterations: {:.3} s/iteration, {:.0} tokens/s",
        secs / iterations as f64,
        (iterations * SEQ) as f64 / secs
    );

    // Decoding with the KV cache: prefill 256 tokens, then 32 single-token steps.
    let opts = GenerateOptions {
        max_new_tokens: 32,
        stop_at_eos: false,
        ..Default::default()
    };
    let out = generate(&model, &tokens, &opts, |_| {})?;
    println!(
        "generate (kv cache): prefill {SEQ} tokens {:.3} s; decode {:.1} tokens/s",
        out.prefill.as_secs_f64(),
        out.decode_tokens_per_sec().unwrap_or(0.0)
    );
    Ok(())
}
