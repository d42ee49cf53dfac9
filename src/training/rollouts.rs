//! Rollouts: the completions an RL step trains on (GRPO's groups, PPO's responses), each
//! after its prompt, collated into right-padded rows with what the losses read per completion
//! token. How a pass lays them out (each prompt once) is `rollout_pack`'s.

use crate::data::{Batch, IGNORE_INDEX};

/// One rank's rollouts of a batch of prompts (torchtune's `GRPOTrajectory`): the sequences the
/// policy trains on and what the loss needs besides the policy's own log-probabilities. Per-token
/// values are `[rows, width]`, row-major, position `c` of a row being its `c`-th completion token.
#[derive(Debug, Clone)]
pub struct Rollouts {
    /// Prompt then completion (cut after its stop token), right-padded; the labels are the
    /// completion's tokens.
    pub batch: Batch,
    /// Per row, the prompt's length.
    pub prompt_lens: Vec<usize>,
    /// The longest completion.
    pub width: usize,
    /// 1 on the completion tokens the loss counts.
    pub mask: Vec<bool>,
    /// The old policy's log-probabilities (with `ppo_epochs` > 1; else the policy's own,
    /// detached).
    pub old_log_probs: Option<Vec<f32>>,
    /// The reference's log-probabilities (when the KL coefficient is not 0).
    pub ref_log_probs: Option<Vec<f32>>,
    /// Per row.
    pub advantages: Vec<f32>,
    /// The ranks the batch is split over, and the completion tokens the loss counts on all
    /// of them (TRL's `num_processes` and `num_items_in_batch`, dapo's normaliser).
    pub ranks: usize,
    pub world_counted_tokens: f64,
}

impl Rollouts {
    /// Rollouts before any scoring pass: no old or reference log-probabilities, no
    /// advantages, one rank, counting the tokens `mask` counts.
    pub(crate) fn unscored(
        batch: Batch,
        prompt_lens: Vec<usize>,
        width: usize,
        mask: Vec<bool>,
    ) -> Rollouts {
        let counted = mask.iter().filter(|&&m| m).count();
        Rollouts {
            batch,
            prompt_lens,
            width,
            mask,
            old_log_probs: None,
            ref_log_probs: None,
            advantages: Vec::new(),
            ranks: 1,
            world_counted_tokens: counted as f64,
        }
    }

    pub(crate) fn rows(&self) -> usize {
        self.batch.batch_size
    }

    /// Per row and completion position, the index in the row's flattened next-token
    /// predictions (`[seq]`) that predicts it: `prompt_len - 1 + c`, clamped into the row.
    pub(crate) fn window_indices(&self) -> Vec<i32> {
        let seq = self.batch.seq_len;
        self.prompt_lens
            .iter()
            .flat_map(|&p| (0..self.width).map(move |c| (p - 1 + c).min(seq - 1) as i32))
            .collect()
    }

    /// [`Self::window_indices`] as indices into the flattened `[rows * seq]` positions.
    pub(crate) fn window_rows(&self) -> Vec<usize> {
        let (seq, width) = (self.batch.seq_len, self.width.max(1));
        self.window_indices()
            .iter()
            .enumerate()
            .map(|(i, &p)| i / width * seq + p as usize)
            .collect()
    }

    /// Rows `start..end`, with the same width (per-token values line up with the whole).
    pub(crate) fn rows_range(&self, start: usize, end: usize) -> Rollouts {
        let w = self.width;
        let batch = self.batch.select_rows(&(start..end).collect::<Vec<_>>());
        Rollouts {
            batch,
            prompt_lens: self.prompt_lens[start..end].to_vec(),
            width: w,
            mask: self.mask[start * w..end * w].to_vec(),
            old_log_probs: None,
            ref_log_probs: None,
            advantages: self
                .advantages
                .get(start..end)
                .map(<[f32]>::to_vec)
                .unwrap_or_default(),
            ranks: self.ranks,
            world_counted_tokens: self.world_counted_tokens,
        }
    }
}

/// One completion to train on, before collation.
pub struct RolloutRow<'a> {
    pub prompt: &'a [u32],
    pub completion: &'a [u32],
    /// Whether its tokens count in the loss.
    pub counts: bool,
}

/// Right-pads prompt + completion rows into one batch, the labels being the completion's
/// tokens (so next-token targets pick exactly them), and the loss mask per completion position.
pub fn collate_rollouts(rows: &[RolloutRow<'_>], pad_id: u32) -> Rollouts {
    let seq = rows
        .iter()
        .map(|r| r.prompt.len() + r.completion.len())
        .max()
        .unwrap_or(1);
    let width = rows.iter().map(|r| r.completion.len()).max().unwrap_or(0);
    let mut tokens = Vec::with_capacity(rows.len() * seq);
    let mut labels = Vec::with_capacity(rows.len() * seq);
    let mut position_ids = Vec::with_capacity(rows.len() * seq);
    let mut mask = Vec::with_capacity(rows.len() * width);
    let mut padding = Vec::with_capacity(rows.len() * seq);
    let mut trained = 0;
    for r in rows {
        let len = r.prompt.len() + r.completion.len();
        // TRL's `attention_mask`: the prompt, and the completion unless it does not count
        // (`mask_truncated_completions` zeroes a truncated one's); the load-balancing loss
        // leaves the rest out.
        padding.extend(std::iter::repeat_n(false, r.prompt.len()));
        padding.extend(std::iter::repeat_n(!r.counts, r.completion.len()));
        padding.extend(std::iter::repeat_n(true, seq - len));
        tokens.extend_from_slice(r.prompt);
        tokens.extend_from_slice(r.completion);
        tokens.extend(std::iter::repeat_n(pad_id, seq - len));
        labels.extend(std::iter::repeat_n(IGNORE_INDEX, r.prompt.len()));
        labels.extend(r.completion.iter().map(|&t| i64::from(t)));
        labels.extend(std::iter::repeat_n(IGNORE_INDEX, seq - len));
        position_ids.extend(0..seq as u32);
        mask.extend((0..width).map(|c| r.counts && c < r.completion.len()));
        trained += r.completion.len();
    }
    Rollouts::unscored(
        Batch {
            tokens,
            labels,
            position_ids,
            document_ids: None,
            batch_size: rows.len(),
            seq_len: seq,
            num_trained_tokens: trained,
            padding: padding.contains(&true).then_some(padding),
            images: None,
        },
        rows.iter().map(|r| r.prompt.len()).collect(),
        width,
        mask,
    )
}
