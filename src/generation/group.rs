//! Sampling groups of completions of a batch of prompts, as GRPO's and PPO's rollouts need
//! them: each prompt is prefilled once, its KV cache repeated for every completion, then all of
//! them decode in lockstep, one batched forward pass per token. A completion that stops (at a
//! stop token) keeps being fed (its later tokens are discarded) until every one has stopped, as
//! torchtune's `generate` runs its batch; `agree` lets several ranks decide together when to stop, since
//! with FSDP every forward pass is a collective call that every rank must make.

use burn::tensor::backend::Backend;

use super::sampling::{Sampler, SamplingParams};
use super::{GenerateError, check_prompt};
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

/// Samples one completion per seed of `seeds` after `prompt`: [`sample_groups`] with one
/// prompt.
pub fn sample_group<B: Backend>(
    model: &CausalLm<B>,
    prompt: &[u32],
    opts: &GroupSampling,
    seeds: &[u64],
    agree: &mut dyn FnMut(bool) -> bool,
) -> Result<SampledGroup, GenerateError> {
    let prompts = [GroupPrompt {
        tokens: prompt,
        seeds,
    }];
    let mut groups = sample_groups(model, &prompts, opts, agree)?;
    Ok(groups.pop().unwrap_or(SampledGroup {
        completions: Vec::new(),
        stopped: Vec::new(),
    }))
}

/// One prompt of a batch and the seeds of its completions.
#[derive(Debug, Clone, Copy)]
pub struct GroupPrompt<'a> {
    pub tokens: &'a [u32],
    /// One completion per seed, each drawn from its own seeded stream.
    pub seeds: &'a [u64],
}

/// Samples every prompt's completions in one batch: the prompts, left-padded to the longest,
/// are prefilled together once; each prompt's cache is repeated for its completions; then every
/// completion of every prompt decodes in lockstep, one batched forward pass per token (the
/// weights read once per token for all of them, where one group at a time would read them once
/// per group). Padding is masked out of attention and each row's positions count from its
/// prompt's first token, so a completion is the one its prompt's group alone would sample, up
/// to the order of floating-point sums. `agree` gets, after each token, whether every
/// completion has stopped, and returns whether to stop decoding: the identity on one device;
/// with FSDP, whether every rank's batch has stopped.
pub fn sample_groups<B: Backend>(
    model: &CausalLm<B>,
    prompts: &[GroupPrompt<'_>],
    opts: &GroupSampling,
    agree: &mut dyn FnMut(bool) -> bool,
) -> Result<Vec<SampledGroup>, GenerateError> {
    let vocab = model.args.vocab_size;
    for prompt in prompts {
        check_prompt(prompt.tokens, vocab)?;
    }
    let mut groups: Vec<SampledGroup> = prompts
        .iter()
        .map(|p| SampledGroup {
            completions: vec![Vec::with_capacity(opts.max_new_tokens); p.seeds.len()],
            stopped: vec![false; p.seeds.len()],
        })
        .collect();
    // Rows: every prompt's completions, prompt by prompt, as `KvCache::repeat_rows` lays them.
    let per_prompt = prompts.first().map_or(0, |p| p.seeds.len());
    if prompts.iter().any(|p| p.seeds.len() != per_prompt) {
        return Err(GenerateError::BadSampling(
            "every prompt of a batch needs as many completions".into(),
        ));
    }
    let rows = prompts.len() * per_prompt;
    if rows == 0 || opts.max_new_tokens == 0 {
        return Ok(groups);
    }
    let mut samplers = prompts
        .iter()
        .flat_map(|p| p.seeds.iter())
        .map(|&seed| Sampler::new(opts.sampling, seed))
        .collect::<Result<Vec<_>, _>>()?;
    let mode = ForwardMode {
        adapters: true,
        fake_quant: true,
        train: false,
    };
    // Prefill: the prompts left-padded to the longest (padding repeats the prompt's first
    // token: any valid id, never seen by a real position).
    let longest = prompts.iter().map(|p| p.tokens.len()).max().unwrap_or(0);
    let padding: Vec<usize> = prompts.iter().map(|p| longest - p.tokens.len()).collect();
    let mut tokens = Vec::with_capacity(prompts.len() * longest);
    let mut positions = Vec::with_capacity(prompts.len() * longest);
    for (prompt, &pad) in prompts.iter().zip(&padding) {
        tokens.extend(std::iter::repeat_n(prompt.tokens[0], pad));
        tokens.extend_from_slice(prompt.tokens);
        positions.extend(std::iter::repeat_n(0, pad));
        positions.extend(0..prompt.tokens.len() as u32);
    }
    let padded = padding.iter().any(|&p| p > 0);
    let mut cache = model.new_cache();
    let input = TokenBatch {
        tokens: &tokens,
        positions: &positions,
        document_ids: None,
        continued_documents: None,
        left_padding: padded.then_some(padding.as_slice()),
        padding: None,
        images: None,
        batch: prompts.len(),
    };
    let hidden = model.hidden(input, mode, Some(&mut cache));
    let last = hidden.narrow(1, longest - 1, 1);
    let logits = HostTensor::from_tensor(&model.logits(last, mode)).data;
    cache.repeat_rows(per_prompt, opts.max_new_tokens);
    let row_padding: Vec<usize> = padding
        .iter()
        .flat_map(|&pad| std::iter::repeat_n(pad, per_prompt))
        .collect();
    let mut next = vec![0u32; rows];
    sample_rows(&mut samplers, &mut next, |row| {
        let prompt = row / per_prompt;
        &logits[prompt * vocab..(prompt + 1) * vocab]
    });
    // Tokens sampled per row so far: the same on every rank, whatever each row did.
    let mut steps = 0;
    loop {
        steps += 1;
        for (row, &token) in next.iter().enumerate() {
            let group = &mut groups[row / per_prompt];
            let k = row % per_prompt;
            if group.stopped[k] {
                continue;
            }
            group.completions[k].push(token);
            group.stopped[k] = opts.stop_ids.contains(&token);
        }
        let all_stopped = groups.iter().all(|g| g.stopped.iter().all(|&s| s));
        // `agree` first, every step: with FSDP every rank makes the same calls.
        if agree(all_stopped) || steps == opts.max_new_tokens {
            break;
        }
        let at = cache.len();
        let positions: Vec<u32> = row_padding.iter().map(|&pad| (at - pad) as u32).collect();
        let input = TokenBatch {
            tokens: &next,
            positions: &positions,
            document_ids: None,
            continued_documents: None,
            left_padding: padded.then_some(row_padding.as_slice()),
            padding: None,
            images: None,
            batch: rows,
        };
        let hidden = model.hidden(input, mode, Some(&mut cache));
        let logits = HostTensor::from_tensor(&model.logits(hidden, mode)).data;
        sample_rows(&mut samplers, &mut next, |row| {
            &logits[row * vocab..(row + 1) * vocab]
        });
    }
    Ok(groups)
}

/// `next[row]` drawn by `samplers[row]` from `logits_of(row)`, the rows on every thread: each
/// row's sampler has its own seeded stream, so the draws do not depend on which thread takes
/// which row. Why: a draw reads the whole vocabulary (SmolLM2's 49 152 logits), and GRPO's
/// 16 rows drawn on one core while the other waited were 9% of a rollout.
fn sample_rows<'a>(
    samplers: &mut [Sampler],
    next: &mut [u32],
    logits_of: impl Fn(usize) -> &'a [f32] + Sync,
) {
    use rayon::prelude::*;
    samplers
        .par_iter_mut()
        .zip(next.par_iter_mut())
        .enumerate()
        .for_each(|(row, (sampler, token))| *token = sampler.sample(logits_of(row)));
}
