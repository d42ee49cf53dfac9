//! Additive attention masks built on the host: causal, with an offset for cached keys, and
//! block-diagonal for packed sequences so packed samples never attend to each other.

use burn::tensor::backend::Backend;

pub use crate::kernels::AttentionMask;

/// Large and finite, so a fully masked row cannot turn into NaN through `-inf - -inf`.
const MASKED: f32 = -1.0e30;

/// What, besides causality, keeps a row's positions from seeing each other.
#[derive(Debug, Clone, Copy, Default)]
pub struct Separations<'a> {
    /// Packed samples: the document of each position (`[batch * k_len]`).
    pub document_ids: Option<&'a [u32]>,
    /// With `document_ids`, per position, the document it continues (`[batch * k_len]`): it
    /// sees that document's positions besides its own document's, the way each of a group's
    /// completions, packed after their one prompt, sees the prompt. A position of a document
    /// that continues none names its own.
    pub continued_documents: Option<&'a [u32]>,
    /// Per row, its leading padding positions: a real position never sees them, a padding
    /// position sees only padding (so no softmax row is empty).
    pub left_padding: Option<&'a [usize]>,
}

impl Separations<'_> {
    fn per_row(&self) -> bool {
        self.document_ids.is_some() || self.left_padding.is_some()
    }

    /// Whether positions `j` and `i` of row `b` (`k_len` positions a row) are kept apart.
    fn apart(&self, b: usize, k_len: usize, j: usize, i: usize) -> bool {
        let other_doc = self.document_ids.is_some_and(|d| {
            let (key, query) = (d[b * k_len + j], d[b * k_len + i]);
            let continued = self
                .continued_documents
                .is_some_and(|c| c[b * k_len + i] == key);
            key != query && !continued
        });
        let across_padding = self
            .left_padding
            .is_some_and(|pad| (j < pad[b]) != (i < pad[b]));
        other_doc || across_padding
    }
}

/// Query `i` (absolute position `offset + i`) may see key `j` when `j <= offset + i` and, with
/// document ids, both belong to the same document.
pub fn causal<B: Backend>(
    batch: usize,
    q_len: usize,
    offset: usize,
    document_ids: Option<&[u32]>,
    device: &B::Device,
) -> AttentionMask<B> {
    let separations = Separations {
        document_ids,
        ..Separations::default()
    };
    causal_window(batch, q_len, offset, separations, None, device)
}

/// Bidirectional attention within each span of `lengths` consecutive positions and none
/// across (a vision tower's images, each attending to its own patches only).
pub fn within_spans<B: Backend>(lengths: &[usize], device: &B::Device) -> AttentionMask<B> {
    let n: usize = lengths.iter().sum();
    let mut mask = vec![MASKED; n * n];
    let mut start = 0;
    for &len in lengths {
        for i in start..start + len {
            mask[i * n + start..i * n + start + len].fill(0.0);
        }
        start += len;
    }
    AttentionMask::new(mask, [1, n, n], device)
}

/// As [`causal`], with any [`Separations`], and with a `window` query `i` sees only the last
/// `window` positions up to its own (`offset + i - window < j`), as transformers'
/// sliding-window layers do.
pub fn causal_window<B: Backend>(
    batch: usize,
    q_len: usize,
    offset: usize,
    separations: Separations<'_>,
    window: Option<usize>,
    device: &B::Device,
) -> AttentionMask<B> {
    let k_len = offset + q_len;
    let rows = if separations.per_row() { batch } else { 1 };
    let mut mask = vec![0.0f32; rows * q_len * k_len];
    for b in 0..rows {
        for i in 0..q_len {
            for j in 0..k_len {
                let future = j > offset + i;
                let too_old = window.is_some_and(|w| j + w <= offset + i);
                if future || too_old || separations.apart(b, k_len, j, offset + i) {
                    mask[(b * q_len + i) * k_len + j] = MASKED;
                }
            }
        }
    }
    AttentionMask::new(mask, [rows, q_len, k_len], device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    /// Which keys each query sees, row by row: `seen[b][i]` lists the keys of query `i`.
    fn seen(mask: &AttentionMask<Flex>) -> Vec<Vec<Vec<usize>>> {
        let [rows, q_len, k_len] = mask.dims;
        (0..rows)
            .map(|b| {
                (0..q_len)
                    .map(|i| {
                        (0..k_len)
                            .filter(|&j| mask.host[(b * q_len + i) * k_len + j] == 0.0)
                            .collect()
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn left_padding_is_unseen_by_real_positions_and_sees_only_itself() {
        let device = Default::default();
        let pads = [2usize, 0];
        let separations = Separations {
            left_padding: Some(&pads),
            ..Separations::default()
        };
        // A prefill of two rows, the first left-padded by two positions.
        let prefill = causal_window::<Flex>(2, 4, 0, separations, None, &device);
        assert_eq!(
            seen(&prefill),
            vec![
                vec![vec![0], vec![0, 1], vec![2], vec![2, 3]],
                vec![vec![0], vec![0, 1], vec![0, 1, 2], vec![0, 1, 2, 3]],
            ]
        );
        // A decoding step after them: one query per row over five keys.
        let step = causal_window::<Flex>(2, 1, 4, separations, None, &device);
        assert_eq!(
            seen(&step),
            vec![vec![vec![2, 3, 4]], vec![vec![0, 1, 2, 3, 4]]]
        );
        // A sliding window counts positions, padding or not.
        let window = causal_window::<Flex>(2, 1, 4, separations, Some(2), &device);
        assert_eq!(seen(&window), vec![vec![vec![3, 4]], vec![vec![3, 4]]]);
    }

    #[test]
    fn a_completion_sees_its_prompt_and_itself_but_no_other_completion() {
        let device = Default::default();
        // One pack: a prompt (document 0, positions 0-1), then two completions that continue
        // it (documents 1 and 2), then another prompt with no completion (document 3).
        let documents = [0, 0, 1, 1, 2, 3];
        let continued = [0, 0, 0, 0, 0, 3];
        let separations = Separations {
            document_ids: Some(&documents),
            continued_documents: Some(&continued),
            left_padding: None,
        };
        let mask = causal_window::<Flex>(1, 6, 0, separations, None, &device);
        assert_eq!(
            seen(&mask),
            vec![vec![
                vec![0],
                vec![0, 1],
                vec![0, 1, 2],
                vec![0, 1, 2, 3],
                vec![0, 1, 4],
                vec![5],
            ]]
        );
    }
}
