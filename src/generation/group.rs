//! Sampling a group of completions of one prompt, as GRPO's rollouts need them: the prompt is
//! prefilled once, its KV cache repeated for every completion, then all of them decode in
//! lockstep, one batched forward pass per token. A completion that stops (at a stop token) keeps
//! being fed (its later tokens are discarded) until every one has stopped, as torchtune's
//! `generate` runs its batch; `agree` lets several ranks decide together when to stop, since
//! with FSDP every forward pass is a collective call that every rank must make.

use burn::tensor::backend::Backend;

use super::GenerateError;
use super::sampling::{Sampler, SamplingParams};
use crate::checkpoint::HostTensor;
use crate::models::{CausalLm, TokenBatch};
use crate::modules::ForwardMode;

/// How a group is sampled.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupSampling {
    /// The longest completion, in tokens.
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// A completion ends after emitting any of these (included in it).
    pub stop_ids: Vec<u32>,
}

/// A prompt's completions.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledGroup {
    /// Each completion's tokens, ending with its stop token when it stopped.
    pub completions: Vec<Vec<u32>>,
    /// Whether each completion ended at a stop token (else at `max_new_tokens`).
    pub stopped: Vec<bool>,
}

impl SampledGroup {
    /// Tokens generated over the group.
    pub fn tokens(&self) -> usize {
        self.completions.iter().map(Vec::len).sum()
    }
}

/// Samples one completion per seed of `seeds` after `prompt` (each completion draws from its own
/// seeded stream, so a completion does not depend on the others'). `agree` gets, after each
/// token, whether every completion has stopped, and returns whether to stop decoding: the
/// identity on one device; with FSDP, whether every rank's group has stopped.
pub fn sample_group<B: Backend>(
    model: &CausalLm<B>,
    prompt: &[u32],
    opts: &GroupSampling,
    seeds: &[u64],
    agree: &mut dyn FnMut(bool) -> bool,
) -> Result<SampledGroup, GenerateError> {
    if prompt.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    let vocab = model.args.vocab_size;
    if let Some(&id) = prompt.iter().find(|&&id| id as usize >= vocab) {
        return Err(GenerateError::TokenOutOfRange { id, vocab });
    }
    let rows = seeds.len();
    let mut samplers = seeds
        .iter()
        .map(|&seed| Sampler::new(opts.sampling, seed))
        .collect::<Result<Vec<_>, _>>()?;
    let mut group = SampledGroup {
        completions: vec![Vec::with_capacity(opts.max_new_tokens); rows],
        stopped: vec![false; rows],
    };
    if rows == 0 || opts.max_new_tokens == 0 {
        return Ok(group);
    }
    let mode = ForwardMode {
        adapters: true,
        fake_quant: true,
        train: false,
    };
    let mut cache = model.new_cache();
    let positions: Vec<u32> = (0..prompt.len() as u32).collect();
    let input = TokenBatch {
        tokens: prompt,
        positions: &positions,
        document_ids: None,
        batch: 1,
    };
    let hidden = model.hidden(input, mode, Some(&mut cache));
    let last = hidden.narrow(1, prompt.len() - 1, 1);
    let logits = HostTensor::from_tensor(&model.logits(last, mode)).data;
    cache.repeat_rows(rows);
    let mut next: Vec<u32> = samplers.iter_mut().map(|s| s.sample(&logits)).collect();
    // Tokens sampled per row so far: the same on every rank, whatever each row did.
    let mut steps = 0;
    loop {
        steps += 1;
        for (row, &token) in next.iter().enumerate() {
            if group.stopped[row] {
                continue;
            }
            group.completions[row].push(token);
            group.stopped[row] = opts.stop_ids.contains(&token);
        }
        let all_stopped = group.stopped.iter().all(|&s| s);
        // `agree` first, every step: with FSDP every rank makes the same calls.
        if agree(all_stopped) || steps == opts.max_new_tokens {
            break;
        }
        let position = cache.len() as u32;
        let positions = vec![position; rows];
        let input = TokenBatch {
            tokens: &next,
            positions: &positions,
            document_ids: None,
            batch: rows,
        };
        let hidden = model.hidden(input, mode, Some(&mut cache));
        let logits = HostTensor::from_tensor(&model.logits(hidden, mode)).data;
        for (row, sampler) in samplers.iter_mut().enumerate() {
            next[row] = sampler.sample(&logits[row * vocab..(row + 1) * vocab]);
        }
    }
    Ok(group)
}
