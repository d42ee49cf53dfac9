//! Batching: right-pad rows to the longest in the batch.
use super::packing::PackedSample;
use super::sample::{IGNORE_INDEX, SftSample};

/// A chosen / rejected pair, each tokenized like an SFT sample (prompt masked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreferenceSample {
    pub chosen: SftSample,
    pub rejected: SftSample,
}

/// A batch of `batch_size` rows of `seq_len` tokens, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub tokens: Vec<u32>,
    /// Unshifted: the loss compares logits at t with labels at t + 1.
    pub labels: Vec<i64>,
    /// Position of each token in its document (0.. per row, or per packed document).
    pub position_ids: Vec<u32>,
    /// Packed batches only: which document each token belongs to (block-causal mask).
    pub document_ids: Option<Vec<u32>>,
    /// Per token, whether it is padding (a row's right padding, a pack's filler), the positions
    /// transformers' `attention_mask` hides; `None` when no token is.
    pub padding: Option<Vec<bool>>,
    pub batch_size: usize,
    pub seq_len: usize,
    /// Tokens the shifted loss counts: labels at positions 1.. of each row that are not -100
    /// (torchtune's `num_tokens` after shifting labels).
    pub num_trained_tokens: usize,
    /// The rows' images, processed, and their M-RoPE positions (a vision-language model's
    /// batch); `None` for text.
    pub images: Option<crate::models::multimodal::ImageInput>,
}

impl Batch {
    /// Row `i` of the tokens.
    pub fn row_tokens(&self, i: usize) -> &[u32] {
        &self.tokens[i * self.seq_len..(i + 1) * self.seq_len]
    }
    /// Row `i` of the labels.
    pub fn row_labels(&self, i: usize) -> &[i64] {
        &self.labels[i * self.seq_len..(i + 1) * self.seq_len]
    }

    /// Rows `rows` (in that order) of a batch of rows, not packs, as a batch of their own;
    /// its trained-token count is left at 0 for the caller's loss to count.
    pub fn select_rows(&self, rows: &[usize]) -> Batch {
        let seq = self.seq_len;
        fn pick<T: Copy>(values: &[T], rows: &[usize], seq: usize) -> Vec<T> {
            rows.iter()
                .flat_map(|&r| values[r * seq..(r + 1) * seq].iter().copied())
                .collect()
        }
        Batch {
            tokens: pick(&self.tokens, rows, seq),
            labels: pick(&self.labels, rows, seq),
            position_ids: pick(&self.position_ids, rows, seq),
            document_ids: None,
            padding: self.padding.as_ref().map(|p| pick(p, rows, seq)),
            batch_size: rows.len(),
            seq_len: seq,
            num_trained_tokens: 0,
            images: None,
        }
    }
}

fn count_trained(labels: &[i64], seq_len: usize) -> usize {
    if seq_len == 0 {
        return 0;
    }
    labels
        .chunks(seq_len)
        .map(|row| row[1..].iter().filter(|&&l| l != IGNORE_INDEX).count())
        .sum()
}

/// Right-pads SFT samples to the longest (tokens with `pad_id`, labels with -100); positions
/// run 0..seq_len in every row.
pub fn collate_sft(samples: &[&SftSample], pad_id: u32) -> Batch {
    let seq_len = samples.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
    let mut tokens = Vec::with_capacity(samples.len() * seq_len);
    let mut labels = Vec::with_capacity(samples.len() * seq_len);
    let mut padding = Vec::with_capacity(samples.len() * seq_len);
    for s in samples {
        let n_pad = seq_len - s.tokens.len();
        tokens.extend_from_slice(&s.tokens);
        tokens.extend(std::iter::repeat_n(pad_id, n_pad));
        labels.extend_from_slice(&s.labels);
        labels.extend(std::iter::repeat_n(IGNORE_INDEX, n_pad));
        padding.extend(std::iter::repeat_n(false, s.tokens.len()));
        padding.extend(std::iter::repeat_n(true, n_pad));
    }
    let position_ids = (0..samples.len()).flat_map(|_| 0..seq_len as u32).collect();
    Batch {
        num_trained_tokens: count_trained(&labels, seq_len),
        tokens,
        labels,
        position_ids,
        document_ids: None,
        padding: padding.contains(&true).then_some(padding),
        batch_size: samples.len(),
        seq_len,
        images: None,
    }
}

/// Stacks packs (all `max_seq_len` long already; shorter ones are padded as extra documents).
pub fn collate_packed(samples: &[&PackedSample], pad_id: u32) -> Batch {
    let seq_len = samples.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
    let mut b = Batch {
        tokens: Vec::with_capacity(samples.len() * seq_len),
        labels: Vec::with_capacity(samples.len() * seq_len),
        position_ids: Vec::with_capacity(samples.len() * seq_len),
        document_ids: None,
        padding: None,
        batch_size: samples.len(),
        seq_len,
        num_trained_tokens: 0,
        images: None,
    };
    let mut docs = Vec::with_capacity(samples.len() * seq_len);
    let mut padding = Vec::with_capacity(samples.len() * seq_len);
    for s in samples {
        let n_pad = seq_len - s.tokens.len();
        padding.extend(std::iter::repeat_n(false, s.tokens.len()));
        padding.extend(std::iter::repeat_n(true, n_pad));
        b.tokens.extend_from_slice(&s.tokens);
        b.tokens.extend(std::iter::repeat_n(pad_id, n_pad));
        b.labels.extend_from_slice(&s.labels);
        b.labels.extend(std::iter::repeat_n(IGNORE_INDEX, n_pad));
        let last_pos = s.position_ids.last().copied().unwrap_or(0);
        b.position_ids.extend_from_slice(&s.position_ids);
        b.position_ids
            .extend((1..=n_pad as u32).map(|k| last_pos + k));
        let pad_doc = s.document_ids.last().map_or(0, |d| d + 1);
        docs.extend_from_slice(&s.document_ids);
        docs.extend(std::iter::repeat_n(pad_doc, n_pad));
    }
    b.num_trained_tokens = count_trained(&b.labels, seq_len);
    b.document_ids = Some(docs);
    b.padding = padding.contains(&true).then_some(padding);
    b
}

/// Chosen rows first, then rejected rows (2b rows), all padded to one length
/// (torchtune's `padded_collate_dpo`).
pub fn collate_preference(samples: &[&PreferenceSample], pad_id: u32) -> Batch {
    let rows: Vec<&SftSample> = samples
        .iter()
        .map(|p| &p.chosen)
        .chain(samples.iter().map(|p| &p.rejected))
        .collect();
    collate_sft(&rows, pad_id)
}
