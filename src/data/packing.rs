//! Greedy sample packing, as torchtune's `PackedDataset`.
use super::error::{DataError, Result};
use super::sample::{IGNORE_INDEX, SftSample};

/// `max_seq_len` tokens made of several samples. `position_ids` restart at 0 for each sample;
/// `document_ids` number the samples 0, 1, 2, ... (the tail padding is one more document, as in
/// torchtune's `seq_lens`), so the model can build a block-causal mask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedSample {
    pub tokens: Vec<u32>,
    pub labels: Vec<i64>,
    pub position_ids: Vec<u32>,
    pub document_ids: Vec<u32>,
}

impl PackedSample {
    /// Lengths of the documents (padding included as the last one when present).
    pub fn seq_lens(&self) -> Vec<usize> {
        let mut lens: Vec<usize> = Vec::new();
        let mut prev = None;
        for &d in &self.document_ids {
            if Some(d) == prev {
                if let Some(last) = lens.last_mut() {
                    *last += 1;
                }
            } else {
                lens.push(1);
                prev = Some(d);
            }
        }
        lens
    }
}

#[derive(Default)]
struct Buffer {
    tokens: Vec<u32>,
    labels: Vec<i64>,
    pos: Vec<u32>,
    seq_lens: Vec<usize>,
}

/// Packs samples in order into `max_seq_len`-long packs, padding each with `pad_id` / -100.
///
/// A sample that does not fit in the current pack starts the next one; with `split_across_pack`
/// it is instead cut at the pack boundary and continues in the next pack (its positions continue
/// modulo `max_seq_len`, as torchtune). Without it, a sample longer than `max_seq_len` is an error
/// (samples from this crate are already truncated, so this does not happen in practice).
pub fn pack(
    samples: &[SftSample],
    max_seq_len: usize,
    pad_id: u32,
    split_across_pack: bool,
) -> Result<Vec<PackedSample>> {
    let mut packs = Vec::new();
    let mut cur = Buffer::default();
    let mut previous_boundary = 0;
    for (index, s) in samples.iter().enumerate() {
        let len = s.tokens.len();
        if len > max_seq_len && !split_across_pack {
            return Err(DataError::SampleTooLong {
                index,
                len,
                max_seq_len,
            });
        }
        cur.tokens.extend_from_slice(&s.tokens);
        cur.labels.extend_from_slice(&s.labels);
        cur.pos.extend((0..len).map(|x| (x % max_seq_len) as u32));
        cur.seq_lens.push(len);
        while cur.tokens.len() > max_seq_len {
            cur = split_and_add(
                cur,
                &mut packs,
                max_seq_len,
                pad_id,
                split_across_pack,
                previous_boundary,
            );
        }
        previous_boundary = cur.tokens.len();
    }
    if !cur.tokens.is_empty() {
        packs.push(pad_pack(cur, max_seq_len, pad_id));
    }
    Ok(packs)
}

fn split_and_add(
    cur: Buffer,
    packs: &mut Vec<PackedSample>,
    max_seq_len: usize,
    pad_id: u32,
    split: bool,
    previous_boundary: usize,
) -> Buffer {
    let n_prev = cur.seq_lens.len().saturating_sub(1);
    let prev_sum: usize = cur.seq_lens[..n_prev].iter().sum();
    let last_len = cur.seq_lens.last().copied().unwrap_or(0);
    let (boundary, mut seq_lens) = if split {
        let leftover = max_seq_len.saturating_sub(prev_sum);
        let mut lens = cur.seq_lens[..n_prev].to_vec();
        if leftover > 0 {
            lens.push(leftover);
        }
        (max_seq_len, lens)
    } else {
        (previous_boundary, cur.seq_lens[..n_prev].to_vec())
    };
    let boundary = boundary.min(cur.tokens.len());
    let next_len = if split {
        cur.tokens.len() - boundary
    } else {
        last_len
    };
    let pack = Buffer {
        tokens: cur.tokens[..boundary].to_vec(),
        labels: cur.labels[..boundary].to_vec(),
        pos: cur.pos[..boundary].to_vec(),
        seq_lens: std::mem::take(&mut seq_lens),
    };
    packs.push(pad_pack(pack, max_seq_len, pad_id));
    Buffer {
        tokens: cur.tokens[boundary..].to_vec(),
        labels: cur.labels[boundary..].to_vec(),
        pos: cur.pos[boundary..].to_vec(),
        seq_lens: vec![next_len],
    }
}

fn pad_pack(mut b: Buffer, max_seq_len: usize, pad_id: u32) -> PackedSample {
    let n_pad = max_seq_len.saturating_sub(b.tokens.len());
    let last_pos = b.pos.last().copied().unwrap_or(0);
    let max_pos = max_seq_len.saturating_sub(1) as u32;
    b.tokens.extend(std::iter::repeat_n(pad_id, n_pad));
    b.labels.extend(std::iter::repeat_n(IGNORE_INDEX, n_pad));
    b.pos
        .extend((1..=n_pad as u32).map(|k| (last_pos + k).min(max_pos)));
    if n_pad > 0 {
        b.seq_lens.push(n_pad);
    }
    let document_ids = b
        .seq_lens
        .iter()
        .enumerate()
        .flat_map(|(doc, &len)| std::iter::repeat_n(doc as u32, len))
        .collect();
    PackedSample {
        tokens: b.tokens,
        labels: b.labels,
        position_ids: b.pos,
        document_ids,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(n: usize, base: u32) -> SftSample {
        let tokens: Vec<u32> = (0..n as u32).map(|i| base + i).collect();
        let labels = tokens.iter().map(|&t| i64::from(t)).collect();
        SftSample {
            tokens,
            labels,
            images: Vec::new(),
        }
    }

    #[test]
    fn packs_like_torchtune() {
        // max 6: [3, 2] fit (pad 1), [4] bumps to next pack with [1] -> [4, 1] (pad 1)
        let packs = pack(&[s(3, 10), s(2, 20), s(4, 30), s(1, 40)], 6, 0, false).expect("pack");
        assert_eq!(packs.len(), 2);
        assert_eq!(packs[0].tokens, vec![10, 11, 12, 20, 21, 0]);
        assert_eq!(packs[0].labels, vec![10, 11, 12, 20, 21, -100]);
        assert_eq!(packs[0].position_ids, vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(packs[0].document_ids, vec![0, 0, 0, 1, 1, 2]);
        assert_eq!(packs[1].tokens, vec![30, 31, 32, 33, 40, 0]);
        assert_eq!(packs[1].position_ids, vec![0, 1, 2, 3, 0, 1]);
        assert_eq!(packs[1].document_ids, vec![0, 0, 0, 0, 1, 2]);
        assert_eq!(packs[1].seq_lens(), vec![4, 1, 1]);
        // padding positions are clamped to max_seq_len - 1
        let p = pack(&[s(5, 1)], 8, 7, false).expect("pack");
        assert_eq!(p[0].position_ids, vec![0, 1, 2, 3, 4, 5, 6, 7]);
        let p = pack(&[s(2, 1), s(5, 1)], 6, 7, false).expect("pack");
        assert_eq!(p[1].position_ids, vec![0, 1, 2, 3, 4, 5]);
        assert!(matches!(
            pack(&[s(7, 0)], 6, 0, false),
            Err(DataError::SampleTooLong {
                index: 0,
                len: 7,
                ..
            })
        ));
    }

    #[test]
    fn splits_across_packs() {
        let packs = pack(&[s(4, 10), s(5, 20)], 6, 0, true).expect("pack");
        assert_eq!(packs.len(), 2);
        assert_eq!(packs[0].tokens, vec![10, 11, 12, 13, 20, 21]);
        assert_eq!(packs[0].document_ids, vec![0, 0, 0, 0, 1, 1]);
        assert_eq!(packs[1].tokens, vec![22, 23, 24, 0, 0, 0]);
        assert_eq!(packs[1].position_ids, vec![2, 3, 4, 5, 5, 5]);
        assert_eq!(packs[1].document_ids, vec![0, 0, 0, 1, 1, 1]);
    }
}
