//! Padding-free batches: a right-padded batch re-laid as packs of its rows, so the model
//! computes no position the loss cannot see.
//!
//! Why: torchtune (and `collate_sft`, which follows it) pads every row to the batch's longest,
//! and the model then runs every padded position through every layer. On instruction data the
//! rows' lengths vary widely (a batch of 4 alpaca rows is often a third padding or more), and
//! on the CPU a step's time is the matmuls' rows. Packing the rows' real tokens into fewer,
//! block-causal rows gives the same loss and gradients with less work and less memory.
//!
//! Why the results are the same (up to float summation order): with a causal mask, position
//! `t` of a row depends only on positions `0..=t` of that row, and the shifted loss reads the
//! logits at `t` only where the label at `t + 1` is not [`IGNORE_INDEX`]. So a row is needed
//! up to its last counted label's position `j` (the logits at `j - 1` predict it; `j` itself
//! is kept too, so the labels can be copied unshifted, one wasted position per row). In a pack
//! each row is its own document (block-causal mask, its own positions), and the label that
//! the previous document's last position would predict, a row's label 0, is never a target in
//! the padded batch either, so it is set to [`IGNORE_INDEX`].

use super::collate::Batch;
use super::sample::IGNORE_INDEX;

/// How long a pack may grow when attention skips the tiles a mask hides: one row of documents
/// then costs what they would cost as rows of their own, and fewer, longer packs leave less
/// tail. Bounded because the block-causal mask is `pack_len^2` floats (16 MiB here).
pub const LONG_PACK: usize = 2048;

/// The packs must drop at least 1/16 of the padded batch's positions (hold at most 15/16 of
/// them). Below that the saving is smaller than what re-laying costs on a small model: the
/// block-causal mask (`pack_len^2` floats, built on the host each step) and attention rows
/// that straddle documents. Measured on the tiny model's LoRA recipe, whose rows lose one
/// position each (508 of 512): 20% slower per step packed.
const MIN_SAVING: (usize, usize) = (15, 16);

/// Packs `batch`'s rows (first-fit, longest first) into rows of at most `max_pack_len` (and
/// at least its `seq_len`) positions, or `None` when that would drop less than
/// [`MIN_SAVING`] of the padded positions, when the batch is packed already, or when no row
/// has a counted label.
/// The packs are as long as the longest one; their tails are one more document with ignored
/// labels.
///
/// With `max_pack_len <= seq_len` the packs never hold a longer row than the padded batch, so
/// attention that computes every score of a row (burn's composed attention) does no more work
/// than it would have; [`LONG_PACK`] is for attention that skips hidden tiles.
pub fn unpad(batch: &Batch, max_pack_len: usize) -> Option<Batch> {
    unpad_keeping(batch, max_pack_len, Keep::CountedLabels)
}

/// What of each row its pack must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Through its last counted label: all the shifted loss reads ([`unpad`]).
    CountedLabels,
    /// Every real (not padding) token, labelled or not: the load-balancing loss of a
    /// mixture-of-experts model counts each one's routing, as transformers'
    /// `attention_mask` does.
    RealTokens,
}

/// [`unpad`], each row keeping what `keep` says.
pub fn unpad_keeping(batch: &Batch, max_pack_len: usize, keep: Keep) -> Option<Batch> {
    // A batch with images keeps its rows: their M-RoPE positions are laid out per row.
    if batch.document_ids.is_some() || batch.seq_len == 0 || batch.images.is_some() {
        return None;
    }
    let capacity = max_pack_len.max(batch.seq_len);
    let needed: Vec<usize> = (0..batch.batch_size)
        .map(|i| match keep {
            Keep::CountedLabels => needed_len(batch.row_labels(i)),
            Keep::RealTokens => real_len(batch, i),
        })
        .collect();
    let mut order: Vec<usize> = (0..batch.batch_size).filter(|&i| needed[i] > 0).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(needed[i]));
    // First-fit decreasing: each row into the first pack with room for it.
    let mut packs: Vec<(usize, Vec<usize>)> = Vec::new();
    for i in order {
        match packs
            .iter_mut()
            .find(|(used, _)| used + needed[i] <= capacity)
        {
            Some((used, rows)) => {
                *used += needed[i];
                rows.push(i);
            }
            None => packs.push((needed[i], vec![i])),
        }
    }
    let pack_len = packs.iter().map(|(used, _)| *used).max()?;
    if packs.len() * pack_len * MIN_SAVING.1 > batch.batch_size * batch.seq_len * MIN_SAVING.0 {
        return None;
    }

    let cells = packs.len() * pack_len;
    let mut out = Batch {
        tokens: Vec::with_capacity(cells),
        labels: Vec::with_capacity(cells),
        position_ids: Vec::with_capacity(cells),
        document_ids: None,
        padding: None,
        batch_size: packs.len(),
        seq_len: pack_len,
        num_trained_tokens: batch.num_trained_tokens,
        images: None,
    };
    let mut documents = Vec::with_capacity(cells);
    let mut padding = Vec::with_capacity(cells);
    for (used, rows) in &packs {
        for (doc, &i) in rows.iter().enumerate() {
            let n = needed[i];
            let at = i * batch.seq_len;
            out.tokens.extend_from_slice(&batch.tokens[at..at + n]);
            out.labels.push(IGNORE_INDEX);
            out.labels.extend_from_slice(&batch.labels[at + 1..at + n]);
            out.position_ids
                .extend_from_slice(&batch.position_ids[at..at + n]);
            documents.extend(std::iter::repeat_n(doc as u32, n));
            padding.extend(std::iter::repeat_n(false, n));
        }
        let tail = pack_len - used;
        let last_position = out.position_ids.last().copied().unwrap_or(0);
        out.tokens.extend(std::iter::repeat_n(0, tail));
        out.labels.extend(std::iter::repeat_n(IGNORE_INDEX, tail));
        out.position_ids
            .extend((1..=tail as u32).map(|k| last_position + k));
        documents.extend(std::iter::repeat_n(rows.len() as u32, tail));
        padding.extend(std::iter::repeat_n(true, tail));
    }
    out.document_ids = Some(documents);
    out.padding = padding.contains(&true).then_some(padding);
    Some(out)
}

/// Row `i`'s tokens before its right padding.
fn real_len(batch: &Batch, i: usize) -> usize {
    let seq = batch.seq_len;
    batch.padding.as_ref().map_or(seq, |padding| {
        padding[i * seq..(i + 1) * seq]
            .iter()
            .take_while(|&&p| !p)
            .count()
    })
}

/// The positions a row needs: through its last counted label at `j >= 1` (`j + 1`), or 0 when
/// the shifted loss counts none of its labels.
fn needed_len(labels: &[i64]) -> usize {
    labels
        .iter()
        .rposition(|&l| l != IGNORE_INDEX)
        .filter(|&j| j >= 1)
        .map_or(0, |j| j + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{SftSample, collate_sft};

    fn sample(tokens: &[u32], labels: &[i64]) -> SftSample {
        SftSample {
            tokens: tokens.to_vec(),
            labels: labels.to_vec(),
            images: Vec::new(),
        }
    }

    /// What the shifted loss counts, as the model sees it: for each label at `t + 1` that is
    /// not ignored (the loss does not look at documents), the tokens and positions of
    /// `0..=t` that the block-causal mask shows position `t`.
    type Target = (Vec<(u32, u32)>, i64);
    fn targets(b: &Batch) -> Vec<Target> {
        let mut out = Vec::new();
        for r in 0..b.batch_size {
            let at = r * b.seq_len;
            let doc = |t: usize| b.document_ids.as_ref().map_or(0, |d| d[at + t]);
            for t in 0..b.seq_len.saturating_sub(1) {
                let label = b.labels[at + t + 1];
                if label == IGNORE_INDEX {
                    continue;
                }
                let seen = (0..=t)
                    .filter(|&s| doc(s) == doc(t))
                    .map(|s| (b.tokens[at + s], b.position_ids[at + s]))
                    .collect();
                out.push((seen, label));
            }
        }
        out.sort();
        out
    }

    #[test]
    fn packs_keep_every_counted_target_and_nothing_else() {
        let rows = [
            sample(&[1, 2, 3, 4, 5, 6, 7, 8], &[-100, -100, 3, 4, 5, 6, 7, 8]),
            sample(&[9, 10, 11], &[-100, 10, 11]),
            // Trailing ignored labels need no positions either.
            sample(&[12, 13, 14, 15, 16], &[12, 13, 14, -100, -100]),
            // No counted label after position 0: dropped.
            sample(&[17, 18], &[17, -100]),
        ];
        let padded = collate_sft(&rows.iter().collect::<Vec<_>>(), 0);
        let packed = unpad(&padded, 0).expect("padding to drop");
        // Needed 8, 3 and 3: packs [8] and [3 + 3], both 8 long (the second with a 2-token tail).
        assert_eq!((packed.batch_size, packed.seq_len), (2, 8));
        assert_eq!(packed.num_trained_tokens, padded.num_trained_tokens);
        assert_eq!(targets(&packed), targets(&padded));
        assert_eq!(
            packed.row_tokens(1),
            &[9, 10, 11, 12, 13, 14, 0, 0],
            "rows of equal need stay in batch order"
        );
        assert_eq!(
            packed.row_labels(1),
            &[-100, 10, 11, -100, 13, 14, -100, -100]
        );
        assert_eq!(packed.position_ids[8..], [0, 1, 2, 0, 1, 2, 3, 4]);
        let docs = packed.document_ids.as_ref().unwrap();
        assert_eq!(docs[..8], [0; 8]);
        assert_eq!(docs[8..], [0, 0, 0, 1, 1, 1, 2, 2]);
        // The padded batch flags each row's padding; the packs flag their tail only.
        let flags = padded.padding.as_ref().expect("rows of different lengths");
        assert_eq!(
            flags[8..16],
            [false, false, false, true, true, true, true, true]
        );
        let tail = packed.padding.as_ref().expect("a tail");
        assert_eq!(tail.iter().filter(|&&p| p).count(), 2);
        assert!(tail[14] && tail[15]);

        // Allowed longer packs (attention that skips hidden tiles): one row, no tail.
        let long = unpad(&padded, LONG_PACK).expect("padding to drop");
        assert_eq!((long.batch_size, long.seq_len), (1, 14));
        assert_eq!(targets(&long), targets(&padded));
        assert_eq!(long.padding, None, "no tail");
    }

    #[test]
    fn nothing_to_drop_or_already_packed_keeps_the_batch() {
        let full = [
            sample(&[1, 2, 3], &[1, 2, 3]),
            sample(&[4, 5, 6], &[4, 5, 6]),
        ];
        let padded = collate_sft(&full.iter().collect::<Vec<_>>(), 0);
        assert_eq!(unpad(&padded, 0), None);
        assert_eq!(unpad(&padded, LONG_PACK), None);
        // One position of 32 to drop: not worth a pack.
        let almost = [
            sample(&(0..16).collect::<Vec<_>>(), &[1; 16]),
            sample(
                &(0..16).collect::<Vec<_>>(),
                &[&[1; 15][..], &[-100]].concat(),
            ),
        ];
        let padded = collate_sft(&almost.iter().collect::<Vec<_>>(), 0);
        assert_eq!(unpad(&padded, LONG_PACK), None);
        let none = [sample(&[1, 2, 3], &[-100; 3])];
        assert_eq!(
            unpad(&collate_sft(&none.iter().collect::<Vec<_>>(), 0), LONG_PACK),
            None
        );
        let mut packed = collate_sft(
            &[sample(&[1, 2, 3], &[1, 2, 3]), sample(&[4], &[4])]
                .iter()
                .collect::<Vec<_>>(),
            0,
        );
        packed.document_ids = Some(vec![0; 6]);
        assert_eq!(unpad(&packed, LONG_PACK), None);
    }

    #[test]
    fn packs_for_the_load_balancing_loss_keep_every_real_token() {
        let rows = [
            sample(&[1, 2, 3, 4, 5, 6, 7, 8], &[-100, -100, 3, 4, 5, 6, 7, 8]),
            // Trailing ignored labels: real tokens all the same.
            sample(&[12, 13, 14, 15, 16], &[12, 13, 14, -100, -100]),
            // No counted label at all: every token is routed.
            sample(&[17, 18], &[-100, -100]),
        ];
        let padded = collate_sft(&rows.iter().collect::<Vec<_>>(), 0);
        let packed = unpad_keeping(&padded, 0, Keep::RealTokens).expect("padding to drop");
        // Needed 8, 5 and 2: packs [8] and [5 + 2], both 8 long (the second with a 1-token tail).
        assert_eq!((packed.batch_size, packed.seq_len), (2, 8));
        assert_eq!(targets(&packed), targets(&padded));
        assert_eq!(packed.row_tokens(1), &[12, 13, 14, 15, 16, 17, 18, 0]);
        let real = |b: &Batch| {
            let flags = b.padding.clone().unwrap_or_default();
            let mut kept: Vec<u32> = (0..b.tokens.len())
                .filter(|&t| !flags.get(t).copied().unwrap_or(false))
                .map(|t| b.tokens[t])
                .collect();
            kept.sort();
            kept
        };
        assert_eq!(real(&packed), real(&padded), "every real token, once");
        // Counted labels only: the trailing and unlabelled tokens go.
        assert!(real(&unpad(&padded, 0).unwrap()).len() < real(&padded).len());
    }
}
