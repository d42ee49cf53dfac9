//! The input of a pass that scores rollouts (GRPO's and PPO's updates, their old-policy and
//! reference passes): each prompt once, followed by every completion of it.
//!
//! A GRPO step samples `grpo_samples` completions of each prompt, and TRL and torchtune train
//! on rows of prompt then completion, so the model runs each prompt once per completion.
//! A causal model's states at a prompt's positions do not depend on what follows, so here a
//! prompt's positions are computed once and each completion attends to them: a pack holds a
//! prompt (a document of its own) and then its completions, each a document that continues
//! the prompt's ([`crate::models::mask::Separations::continued_documents`]) with its positions
//! counted from the prompt's end. The log-probabilities are the rows' (the same sums in
//! another order); the prompt's gradient is the sum of its completions'. Why: with
//! SmolLM2-135M-Instruct's chat template a prompt is about 40 tokens and a completion 32, so
//! the update's 16 rows of a step ran 1 150 positions where this runs about 560.
//!
//! The last token of a completion predicts nothing the loss reads, so it is left out; a row
//! whose tokens the loss does not count (a truncated completion with
//! `mask_truncated_completions`) is left out whole. Rows with distinct prompts (PPO's) pack
//! padding-free. Packs are at most [`LONG_PACK`] positions where attention skips the tiles a
//! mask hides (the fused CPU kernel), else no longer than the rollouts' rows.
//!
//! Not packed, and why ([`RolloutInput::of`] then feeds the rows as they are):
//! - a model with the load-balancing loss: its routing statistics count every row's prompt
//!   (TRL's `attention_mask`), and a shared prompt would count once;
//! - a training pass with dropout: each row's prompt draws its own masks in TRL and
//!   torchtune, and a shared prompt would draw one.

use super::load_balancing;
use super::rollouts::Rollouts;
use crate::data::LONG_PACK;
use crate::kernels;
use crate::models::CausalLm;
use crate::models::TokenBatch;
use crate::models::decoder::LogitRows;
use crate::modules::ForwardMode;
use burn::tensor::backend::Backend;

/// The tokens a scoring pass runs and where each completion position's logits come from.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutInput {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    /// Packed only: each position's document and the document it continues.
    documents: Option<(Vec<u32>, Vec<u32>)>,
    padding: Option<Vec<bool>>,
    sequences: usize,
    /// Per rollout row and completion position (`[rows * width]`), the flattened position
    /// whose hidden state predicts that completion token.
    window: Vec<usize>,
    width: usize,
}

impl RolloutInput {
    /// What a pass of `model` in `mode` runs for `rollouts`: packed when that gives the same
    /// results and fewer positions, else the rows as collated.
    pub fn of<B: Backend>(model: &CausalLm<B>, rollouts: &Rollouts, mode: ForwardMode) -> Self {
        let exact =
            load_balancing::aux_loss_coef(model).is_none() && !(mode.train && model.has_dropout());
        let capacity = if kernels::attention_skips_hidden_tiles::<B>() {
            LONG_PACK
        } else {
            0
        };
        exact
            .then(|| pack(rollouts, capacity))
            .flatten()
            .unwrap_or_else(|| Self::rows(rollouts))
    }

    /// The rows as collated: prompt, completion, right padding.
    pub fn rows(rollouts: &Rollouts) -> Self {
        let b = &rollouts.batch;
        Self {
            tokens: b.tokens.clone(),
            positions: b.position_ids.clone(),
            documents: None,
            padding: b.padding.clone(),
            sequences: b.batch_size,
            window: rollouts.window_rows(),
            width: rollouts.width,
        }
    }

    pub fn token_batch(&self) -> TokenBatch<'_> {
        TokenBatch {
            tokens: &self.tokens,
            positions: &self.positions,
            document_ids: self.documents.as_ref().map(|(d, _)| d.as_slice()),
            continued_documents: self.documents.as_ref().map(|(_, c)| c.as_slice()),
            left_padding: None,
            padding: self.padding.as_deref(),
            images: None,
            batch: self.sequences,
        }
    }

    /// The completion positions' rows, `width` per rollout row.
    pub fn logit_rows(&self) -> LogitRows<'_> {
        LogitRows {
            rows: &self.window,
            width: self.width,
        }
    }

    /// Positions the pass runs.
    pub fn positions(&self) -> usize {
        self.tokens.len()
    }
}

/// One prompt and the completions that follow it in a pack.
struct Segment {
    /// The first row's prompt (every row of the segment has the same).
    prompt_row: usize,
    prompt_len: usize,
    /// Rows and how many completion positions the loss reads in each (`n`: the completion's
    /// first `n - 1` tokens run; the last predicts nothing read).
    completions: Vec<(usize, usize)>,
    len: usize,
}

/// `rollouts` packed in sequences of at most `capacity` positions (at least the rows' own
/// length), or `None` when packing saves nothing.
fn pack(rollouts: &Rollouts, capacity: usize) -> Option<RolloutInput> {
    let b = &rollouts.batch;
    let (seq, width) = (b.seq_len, rollouts.width);
    let capacity = capacity.max(seq);
    let prompt = |r: usize| &b.tokens[r * seq..r * seq + rollouts.prompt_lens[r]];
    // Per row, the completion positions the loss reads: the mask is a prefix of each row's.
    let counted = |r: usize| {
        rollouts.mask[r * width..(r + 1) * width]
            .iter()
            .rposition(|&m| m)
            .map_or(0, |c| c + 1)
    };

    let mut segments: Vec<Segment> = Vec::new();
    for r in 0..b.batch_size {
        let n = counted(r);
        if n == 0 {
            continue;
        }
        let p = rollouts.prompt_lens[r];
        let run = n - 1;
        match segments.last_mut() {
            Some(s) if prompt(s.prompt_row) == prompt(r) && s.len + run <= capacity => {
                s.completions.push((r, n));
                s.len += run;
            }
            _ => segments.push(Segment {
                prompt_row: r,
                prompt_len: p,
                completions: vec![(r, n)],
                len: p + run,
            }),
        }
    }
    // First fit, in order: a pack holds whole segments.
    let mut packs: Vec<(usize, Vec<Segment>)> = Vec::new();
    for s in segments {
        match packs.iter_mut().find(|(used, _)| used + s.len <= capacity) {
            Some((used, held)) => {
                *used += s.len;
                held.push(s);
            }
            None => packs.push((s.len, vec![s])),
        }
    }
    let pack_len = packs.iter().map(|(used, _)| *used).max()?;
    if packs.len() * pack_len >= b.batch_size * seq {
        return None;
    }

    let cells = packs.len() * pack_len;
    let mut tokens = Vec::with_capacity(cells);
    let mut positions = Vec::with_capacity(cells);
    let mut documents = Vec::with_capacity(cells);
    let mut continued = Vec::with_capacity(cells);
    let mut padding = Vec::with_capacity(cells);
    let mut window = vec![0usize; b.batch_size * width];
    for (i, (used, held)) in packs.iter().enumerate() {
        let base = i * pack_len;
        let mut doc = 0u32;
        for s in held {
            let (r0, p) = (s.prompt_row, s.prompt_len);
            let prompt_doc = doc;
            let prompt_last = tokens.len() + p - 1;
            tokens.extend_from_slice(prompt(r0));
            positions.extend_from_slice(&b.position_ids[r0 * seq..r0 * seq + p]);
            documents.extend(std::iter::repeat_n(prompt_doc, p));
            continued.extend(std::iter::repeat_n(prompt_doc, p));
            for &(r, n) in &s.completions {
                doc += 1;
                let start = tokens.len();
                let from = r * seq + p;
                tokens.extend_from_slice(&b.tokens[from..from + n - 1]);
                positions.extend_from_slice(&b.position_ids[from..from + n - 1]);
                documents.extend(std::iter::repeat_n(doc, n - 1));
                continued.extend(std::iter::repeat_n(prompt_doc, n - 1));
                // Completion position c is predicted at the prompt's last position (c = 0),
                // else at the completion's position c - 1; uncounted positions read the
                // first (their values are masked out).
                let row = &mut window[r * width..(r + 1) * width];
                row.fill(prompt_last);
                for (c, at) in row.iter_mut().enumerate().take(n).skip(1) {
                    *at = start + c - 1;
                }
            }
            doc += 1;
            padding.extend(std::iter::repeat_n(false, s.len));
        }
        let tail = pack_len - used;
        let last_position = positions.last().copied().unwrap_or(0);
        tokens.extend(std::iter::repeat_n(0, tail));
        positions.extend((1..=tail as u32).map(|k| last_position + k));
        documents.extend(std::iter::repeat_n(doc, tail));
        continued.extend(std::iter::repeat_n(doc, tail));
        padding.extend(std::iter::repeat_n(true, tail));
        debug_assert_eq!(tokens.len(), base + pack_len);
    }
    Some(RolloutInput {
        tokens,
        positions,
        documents: Some((documents, continued)),
        padding: padding.contains(&true).then_some(padding),
        sequences: packs.len(),
        window,
        width,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::training::rollouts::{RolloutRow, collate_rollouts};

    /// Three completions of prompt [5 6 7] (one of a single token), then prompt [4] twice, its
    /// first completion truncated and not counted.
    fn rollouts() -> Rollouts {
        let (p, q) = (vec![5u32, 6, 7], vec![4u32]);
        let completions = [
            vec![8u32, 9],
            vec![3, 4, 2],
            vec![1],
            vec![9, 9],
            vec![7, 8],
        ];
        let prompts = [&p, &p, &p, &q, &q];
        let rows: Vec<RolloutRow<'_>> = prompts
            .iter()
            .zip(&completions)
            .enumerate()
            .map(|(i, (prompt, completion))| RolloutRow {
                prompt,
                completion,
                counts: i != 3,
            })
            .collect();
        collate_rollouts(&rows, 0)
    }

    #[test]
    fn each_prompt_runs_once_before_its_completions_less_their_last_token() {
        let r = rollouts();
        assert_eq!((r.batch.batch_size, r.batch.seq_len, r.width), (5, 6, 3));
        // Packs no longer than the rows: [5 6 7 | 8 | 3 4 | -] and [4 | 7] with filler.
        let short = pack(&r, 0).expect("positions to save");
        assert_eq!(short.sequences, 2);
        assert_eq!(short.tokens, [5, 6, 7, 8, 3, 4, 4, 7, 0, 0, 0, 0]);
        assert_eq!(short.positions, [0, 1, 2, 3, 3, 4, 0, 1, 2, 3, 4, 5]);
        let (documents, continued) = short.documents.clone().unwrap();
        assert_eq!(documents, [0, 0, 0, 1, 2, 2, 0, 1, 2, 2, 2, 2]);
        assert_eq!(continued, [0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2]);
        assert_eq!(
            short.padding.as_deref(),
            Some(
                &[
                    false, false, false, false, false, false, false, false, true, true, true, true
                ][..]
            )
        );
        // Completion position 0 is predicted at the prompt's last position, position c at the
        // completion's c - 1; positions the loss does not count read the prompt's (row 3 reads
        // anything: none of its positions counts).
        assert_eq!(short.window, [2, 3, 2, 2, 4, 5, 2, 2, 2, 0, 0, 0, 6, 7, 6]);
        // Long packs (the CPU's fused attention skips hidden tiles): one sequence.
        let long = pack(&r, LONG_PACK).expect("positions to save");
        assert_eq!(long.sequences, 1);
        assert_eq!(long.tokens, [5, 6, 7, 8, 3, 4, 4, 7]);
        let (documents, continued) = long.documents.clone().unwrap();
        assert_eq!(documents, [0, 0, 0, 1, 2, 2, 4, 5]);
        assert_eq!(continued, [0, 0, 0, 0, 0, 0, 4, 4]);
        assert_eq!(long.padding, None);
        assert_eq!(long.window, short.window);
    }

    #[test]
    fn rollouts_with_no_counted_token_run_as_collated() {
        let (p, c) = (vec![1u32, 2], vec![3u32, 4]);
        let none = collate_rollouts(
            &[RolloutRow {
                prompt: &p,
                completion: &c,
                counts: false,
            }],
            0,
        );
        assert_eq!(pack(&none, LONG_PACK), None);
    }
}
