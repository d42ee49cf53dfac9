//! The decoding loop: prefill the prompt once, then feed one token per step. With the KV
//! cache each step attends over cached keys; without it the whole sequence is recomputed
//! (the reference the cached path is tested against).

use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;

use super::sampling::{Sampler, SamplingParams};
use super::{GenerateError, check_prompt};
use crate::checkpoint::HostTensor;
use crate::models::{CausalLm, KvCache, TokenBatch};
use crate::modules::ForwardMode;

/// Feeds tokens to a model and returns the logits of the last position.
pub struct Decoder<'m, B: Backend> {
    model: &'m CausalLm<B>,
    cache: Option<KvCache<B>>,
    /// Every token fed so far (the full-recompute path needs them all).
    tokens: Vec<u32>,
    mode: ForwardMode,
}

impl<'m, B: Backend> Decoder<'m, B> {
    pub fn new(model: &'m CausalLm<B>, use_kv_cache: bool) -> Self {
        // Inference: adapters on (if any), no dropout.
        let mode = ForwardMode {
            adapters: true,
            fake_quant: true,
            train: false,
        };
        Self {
            model,
            cache: use_kv_cache.then(|| model.new_cache()),
            tokens: Vec::new(),
            mode,
        }
    }

    /// Tokens fed so far.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Appends `new` and returns the vocabulary logits at the last position.
    pub fn feed(&mut self, new: &[u32]) -> Result<Vec<f32>, GenerateError> {
        check_prompt(new, self.model.args.vocab_size)?;
        self.tokens.extend_from_slice(new);
        let hidden = match &mut self.cache {
            Some(cache) => {
                // Positions continue from what the cache already holds.
                let start = cache.len() as u32;
                let positions: Vec<u32> = (start..start + new.len() as u32).collect();
                let input = TokenBatch {
                    tokens: new,
                    positions: &positions,
                    document_ids: None,
                    continued_documents: None,
                    left_padding: None,
                    padding: None,
                    images: None,
                    batch: 1,
                };
                self.model.hidden(input, self.mode, Some(cache))
            }
            None => {
                let positions: Vec<u32> = (0..self.tokens.len() as u32).collect();
                let input = TokenBatch {
                    tokens: &self.tokens,
                    positions: &positions,
                    document_ids: None,
                    continued_documents: None,
                    left_padding: None,
                    padding: None,
                    images: None,
                    batch: 1,
                };
                self.model.hidden(input, self.mode, None)
            }
        };
        // Project only the last position: the vocabulary matmul dominates small models.
        let seq = hidden.dims()[1];
        let last = hidden.narrow(1, seq - 1, 1);
        let logits = self.model.logits(last, self.mode);
        Ok(HostTensor::from_tensor(&logits).data)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub seed: u64,
    /// Generation ends after emitting any of these (the tokenizer's `stop_ids`).
    pub stop_ids: Vec<u32>,
    pub stop_at_eos: bool,
    pub use_kv_cache: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_new_tokens: 16,
            sampling: SamplingParams::GREEDY,
            seed: 0,
            stop_ids: Vec::new(),
            stop_at_eos: true,
            use_kv_cache: true,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// Emitted this stop token (included in `tokens`).
    StopToken(u32),
    MaxNewTokens,
}

#[derive(Debug, Clone)]
pub struct Generation {
    /// The new tokens only (the prompt excluded), ending with the stop token if one was hit.
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    pub prompt_len: usize,
    /// Time to process the prompt and pick the first token.
    pub prefill: Duration,
    /// Time for the remaining tokens, one forward pass each.
    pub decode: Duration,
}

impl Generation {
    /// Tokens per second after the first one (each costs one single-token forward pass).
    pub fn decode_tokens_per_sec(&self) -> Option<f64> {
        let steps = self.tokens.len().saturating_sub(1);
        let secs = self.decode.as_secs_f64();
        (steps > 0 && secs > 0.0).then(|| steps as f64 / secs)
    }

    pub fn prefill_tokens_per_sec(&self) -> Option<f64> {
        let secs = self.prefill.as_secs_f64();
        (secs > 0.0).then(|| self.prompt_len as f64 / secs)
    }
}

/// Generates up to `max_new_tokens` after `prompt`; `on_token` sees each token as it is
/// chosen (for streaming).
pub fn generate<B: Backend>(
    model: &CausalLm<B>,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32),
) -> Result<Generation, GenerateError> {
    if prompt.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    let mut sampler = Sampler::new(opts.sampling, opts.seed)?;
    let mut out = Generation {
        tokens: Vec::with_capacity(opts.max_new_tokens),
        stop: StopReason::MaxNewTokens,
        prompt_len: prompt.len(),
        prefill: Duration::ZERO,
        decode: Duration::ZERO,
    };
    if opts.max_new_tokens == 0 {
        return Ok(out);
    }
    let mut decoder = Decoder::new(model, opts.use_kv_cache);
    let started = Instant::now();
    let mut logits = decoder.feed(prompt)?;
    let mut token = sampler.sample(&logits);
    out.prefill = started.elapsed();
    let started = Instant::now();
    loop {
        out.tokens.push(token);
        on_token(token);
        if opts.stop_at_eos && opts.stop_ids.contains(&token) {
            out.stop = StopReason::StopToken(token);
            break;
        }
        if out.tokens.len() == opts.max_new_tokens {
            break;
        }
        logits = decoder.feed(&[token])?;
        token = sampler.sample(&logits);
    }
    out.decode = started.elapsed();
    // Each token was read from the device: a task that failed there has been recorded.
    if let Some(fault) = crate::device::take_device_fault() {
        return Err(GenerateError::Device(fault));
    }
    Ok(out)
}
