//! Generation from a checkpoint (torchtune's `generate.py`).
//!
//! Loads the model (architecture from the checkpoint's config.json) on the non-autodiff
//! backend, applies a PEFT adapter if given, formats the prompt (the checkpoint's chat
//! template with `chat: True`, else plain text with the tokenizer's own special tokens),
//! decodes with the KV cache and prints only the completion on stdout. Logs and timings go
//! to stderr so `tune run generate ... > out.txt` captures just the text.

use std::time::Instant;

use anyhow::Context;
use burn::tensor::backend::AutodiffBackend;

use crate::config::recipes::{DataKind, Layout, OwnKeysSpec, RecipeSpec, Trains};
use crate::config::schema::GenerateConfig;
use crate::generation::{GenerateOptions, SamplingParams, StopReason, generate};
use crate::model_io::peft;
use crate::precision;
use crate::setup::{data, model};
use crate::tokenizer::Tokenizer;

use super::RunContext;

pub static RECIPE: RecipeSpec = RecipeSpec {
    name: "generate",
    aliases: &[],
    distributed: None,
    description: "Text generation from a checkpoint (optionally with a LoRA adapter)",
    trains: Trains::Nothing,
    data: DataKind::None,
    layout: Layout::Alone,
    own: OwnKeysSpec::of::<GenerateConfig>(),
};

pub fn run<B: AutodiffBackend>(cfg: &GenerateConfig, ctx: &RunContext<B>) -> anyhow::Result<()> {
    if let Some(level) = cfg.log_level {
        crate::verbosity::set(level);
    }
    // Model: gradients are never needed, so load on the inner (non-autodiff) backend, in
    // `dtype` (set before the first tensor exists; fp32 on the CPU backend).
    let dtype = precision::generation_dtype::<B::InnerBackend>(cfg.dtype);
    precision::set_device_dtype::<B::InnerBackend>(&ctx.device, dtype, precision::Use::Generation)?;
    let started = Instant::now();
    let checkpoint = model::open(&cfg.checkpointer, "checkpointer")?;
    let loaded =
        model::load_base::<B::InnerBackend>(&checkpoint, &cfg.model, None, &ctx.device)?;
    model::check_architecture("model", &cfg.model, &loaded.model.args)?;
    let mut lm = loaded.model;
    if let Some(dir) = &cfg.adapter_dir {
        peft::load_adapter(&mut lm, dir).with_context(|| {
            format!("adapter_dir: loading the PEFT adapter in {}", dir.display())
        })?;
        crate::say!("Applied the LoRA adapter in {}", dir.display());
    }
    crate::say!(
        "Loaded {} ({} model, {:.1}M parameters, {}) in {:.2}s",
        cfg.checkpointer.checkpoint_dir.display(),
        lm.args.family.model_type(),
        lm.args.num_params() as f64 / 1e6,
        precision::name(dtype),
        started.elapsed().as_secs_f64()
    );

    // Prompt.
    let tokenizer = data::tokenizer(&cfg.tokenizer)?;
    let prompt = prompt_ids(cfg, &tokenizer)?;
    let positions = lm.args.max_position_embeddings;
    if prompt.len() >= positions {
        anyhow::bail!(
            "prompt: {} tokens, but the model has {positions} positions (max_position_embeddings in {}): shorten the prompt",
            prompt.len(),
            cfg.checkpointer
                .checkpoint_dir
                .join("config.json")
                .display()
        );
    }
    let room = positions - prompt.len();
    let max_new_tokens = if cfg.max_new_tokens > room {
        crate::say_warn!(
            "max_new_tokens={} would run past the model's {positions} positions after a {}-token prompt: generating at most {room}",
            cfg.max_new_tokens,
            prompt.len()
        );
        room
    } else {
        cfg.max_new_tokens
    };

    // Decode.
    let seed = cfg.seed.unwrap_or_else(clock_seed);
    let sampling = SamplingParams {
        temperature: cfg.temperature,
        top_k: cfg.sampling.top_k,
        top_p: cfg.sampling.top_p,
    };
    let mut stop_ids = tokenizer.stop_ids().to_vec();
    for id in &lm.args.eos_token_ids {
        if !stop_ids.contains(id) {
            stop_ids.push(*id);
        }
    }
    let opts = GenerateOptions {
        max_new_tokens,
        sampling,
        seed,
        stop_ids,
        stop_at_eos: cfg.stop_at_eos,
        use_kv_cache: cfg.enable_kv_cache,
    };
    let how = if sampling.is_greedy() {
        "greedy".to_string()
    } else {
        format!("sampling, seed {seed}")
    };
    crate::say!(
        "Generating up to {} tokens after a {}-token prompt ({how})",
        max_new_tokens,
        prompt.len()
    );
    let out = generate(&lm, &prompt, &opts, |_| {}).context("generation failed")?;

    // Only the completion on stdout.
    let text = tokenizer
        .decode(&out.tokens, true)
        .context("decoding the generated tokens")?;
    println!("{text}");

    let stop = match out.stop {
        StopReason::StopToken(id) => format!("stop token {id}"),
        StopReason::MaxNewTokens => "max_new_tokens".to_string(),
    };
    crate::say!(
        "Prefill: {} tokens in {:.3}s ({:.1} tokens/s); generated {} tokens in {:.3}s, {} tokens/s after the first; stopped at {stop}",
        out.prompt_len,
        out.prefill.as_secs_f64(),
        out.prefill_tokens_per_sec().unwrap_or(0.0),
        out.tokens.len(),
        (out.prefill + out.decode).as_secs_f64(),
        out.decode_tokens_per_sec()
            .map_or("-".to_string(), |t| format!("{t:.1}")),
    );
    Ok(())
}

/// A torchtune tokenizer component (`llama3_tokenizer`, ...) formats the prompt as torchtune's
/// generate recipe does: the system and user messages and an empty assistant turn, which gets
/// its header and no end tokens (torchtune's Qwen, Mistral, Gemma and Phi-3 tokenizers append
/// EOS there too, which ends the answer before it starts; tune does not). Otherwise, with
/// `chat: True` the messages go through the checkpoint's chat template, BOS first as in
/// training, and without it the user prompt is plain text with the tokenizer's own special
/// tokens (e.g. BOS). One definition with the RL recipes' prompts (`data::prompt_tokens`).
fn prompt_ids(cfg: &GenerateConfig, tokenizer: &Tokenizer) -> anyhow::Result<Vec<u32>> {
    // Validation refuses `chat` with a torchtune tokenizer component, and a system prompt
    // without `chat` for the others.
    let torchtune = tokenizer.format().format.is_torchtune();
    if cfg.chat && !torchtune && !tokenizer.has_chat_template() {
        anyhow::bail!(
            "chat: True, but {} has no chat template (tokenizer_config.json `chat_template` or chat_template.jinja); set chat=False",
            tokenizer.path().display()
        );
    }
    let system = cfg.prompt.system.as_deref();
    crate::data::prompt_tokens(tokenizer, system, &cfg.prompt.user, cfg.chat || torchtune)
        .context("prompt")
}

/// torchtune draws a random seed when none is given; report it so the text can be repeated.
fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64 % 1_000_000)
}
