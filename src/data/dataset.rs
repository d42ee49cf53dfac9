//! Builds a tokenized (and optionally packed) dataset from a [`DatasetSpec`].
use super::collate::{Batch, PreferenceSample, collate_packed, collate_preference, collate_sft};
use super::error::{DataError, Result};
use super::images::{ImagePlan, ImagesError, batch_images};
use super::packing::{PackedSample, pack};
use super::prompts::Partition;
use super::sample::SftSample;
use super::source::{Row, load_rows};
use super::spec::{DatasetKind, DatasetSpec};
use super::tokenize::{
    tokenize_conversation, tokenize_messages, tokenize_prompt_response, tokenize_text,
};
use super::transform::LabeledMessage;
use super::transform::{RowContent, RowTransform};
use crate::tokenizer::Tokenizer;
use std::path::Path;

/// The tokenized samples of a dataset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Samples {
    Sft(Vec<SftSample>),
    Packed(Vec<PackedSample>),
    Preference(Vec<PreferenceSample>),
}

/// A tokenized dataset held in memory.
#[derive(Debug, Clone)]
pub struct Dataset {
    samples: Samples,
    pad_id: u32,
    /// How a batch's images become pixels, when any sample has images.
    images: Option<ImagePlan>,
}

impl Dataset {
    /// Loads the files `spec` names (relative paths from `base_dir`), converts every row with
    /// its kind's transform, tokenizes it with `tokenizer` and packs when `spec.packed`.
    pub fn build(
        spec: &DatasetSpec,
        tokenizer: &Tokenizer,
        max_seq_len: Option<usize>,
        base_dir: &Path,
    ) -> Result<Self> {
        let rows = load_rows(spec, base_dir)?;
        Self::from_rows(&rows, spec, tokenizer, max_seq_len)
    }

    /// As [`Dataset::build`], from rows already loaded.
    pub fn from_rows(
        rows: &[Row],
        spec: &DatasetSpec,
        tokenizer: &Tokenizer,
        max_seq_len: Option<usize>,
    ) -> Result<Self> {
        let (kind, packed) = (spec.kind, spec.packed);
        if kind.is_prompt() {
            return Err(DataError::Spec {
                message: "gsm8k_dataset and prompt_dataset hold prompts to generate from, which only the GRPO recipes read (data::PromptDataset); train on an instruct, chat or text dataset".into(),
            });
        }
        if packed && kind.is_preference() {
            return Err(DataError::Spec {
                message:
                    "`packed: true` is not supported for preference datasets; set `packed: false`"
                        .into(),
            });
        }
        let pack_len = match (packed, max_seq_len) {
            (true, None) => {
                return Err(DataError::Spec {
                    message: "`packed: true` needs `tokenizer.max_seq_len` (the pack length)"
                        .into(),
                });
            }
            (true, Some(n)) => Some(n),
            (false, _) => None,
        };
        let transform = RowTransform::new(spec);
        let add_eos = spec.add_eos;
        let tok_err = |row: &Row| {
            let path = (*row.file).clone();
            let index = row.index;
            move |source| DataError::Tokenize {
                path,
                row: index,
                source,
            }
        };
        let mut sft = Vec::new();
        let mut pairs = Vec::new();
        // gsm8k_sft's `partition`: row `i` of the split, kept as torchtune's filter keeps it.
        let partition = match (&spec.partition, kind) {
            (Some(p), DatasetKind::Gsm8kSft) => {
                Some(Partition::parse(p).map_err(|message| DataError::Spec { message })?)
            }
            _ => None,
        };
        for (i, row) in rows.iter().enumerate() {
            if partition.is_some_and(|p| !p.keeps(i)) {
                continue;
            }
            match transform.apply(row)? {
                RowContent::PromptResponse { prompt, response } => sft.push(
                    tokenize_prompt_response(tokenizer, &prompt, &response, max_seq_len)
                        .map_err(tok_err(row))?,
                ),
                RowContent::Messages(m, inputs) if has_images(&m) => {
                    let image_err = |source| DataError::RowImages {
                        path: (*row.file).clone(),
                        row: row.index,
                        source: Box::new(source),
                    };
                    let plan = spec
                        .images
                        .as_ref()
                        .ok_or_else(|| image_err(ImagesError::NoVisionModel))?;
                    // Rendered whole (an image is never cut), then expanded and measured.
                    let sample = tokenize_conversation(tokenizer, &m, &inputs, None)
                        .map_err(tok_err(row))?;
                    let images = m
                        .iter()
                        .flat_map(|m| m.images.iter().cloned())
                        .map(|source| plan.sample_image(source))
                        .collect::<std::result::Result<Vec<_>, _>>()
                        .map_err(image_err)?;
                    sft.push(
                        plan.expand(sample, &images, max_seq_len)
                            .map_err(image_err)?,
                    );
                }
                RowContent::Messages(m, inputs) => sft.push(
                    tokenize_conversation(tokenizer, &m, &inputs, max_seq_len)
                        .map_err(tok_err(row))?,
                ),
                RowContent::Text(t) => sft.push(
                    tokenize_text(tokenizer, &t, add_eos, max_seq_len).map_err(tok_err(row))?,
                ),
                RowContent::Pair { chosen, rejected }
                    if has_images(&chosen) || has_images(&rejected) =>
                {
                    return Err(DataError::Spec {
                        message: format!(
                            "{}: row {}: preference rows with images are not supported yet (their images would be dropped); train DPO on text rows",
                            row.file.display(),
                            row.index
                        ),
                    });
                }
                RowContent::Pair { chosen, rejected } => pairs.push(PreferenceSample {
                    chosen: tokenize_messages(tokenizer, &chosen, max_seq_len)
                        .map_err(tok_err(row))?,
                    rejected: tokenize_messages(tokenizer, &rejected, max_seq_len)
                        .map_err(tok_err(row))?,
                }),
            }
        }
        let pad_id = tokenizer.pad_id().unwrap_or(0);
        let with_images = sft.iter().any(|s| !s.images.is_empty());
        if with_images && packed {
            return Err(DataError::Spec {
                message: "`packed: true` with images is not supported (a pack's M-RoPE positions would mix documents); set `packed: false`".into(),
            });
        }
        let samples = if kind.is_preference() {
            Samples::Preference(pairs)
        } else if let Some(n) = pack_len {
            let split = spec.split_across_pack;
            // torchtune's PackedDataset pads packs with id 0 whatever the tokenizer (its
            // `padding_idx` default); the padding is its own document and never trained.
            Samples::Packed(pack(&sft, n, 0, split)?)
        } else {
            Samples::Sft(sft)
        };
        Ok(Dataset {
            samples,
            pad_id,
            images: spec.images.clone().filter(|_| with_images),
        })
    }

    /// Joins datasets listed together in a config (torchtune's `ConcatDataset`); they must all
    /// be of one kind (all SFT, all packed, or all preference).
    pub fn concat(parts: Vec<Dataset>) -> Result<Self> {
        let mut iter = parts.into_iter();
        let Some(mut first) = iter.next() else {
            return Err(DataError::Spec {
                message: "`dataset` is an empty list: give at least one dataset".into(),
            });
        };
        for next in iter {
            first.images = first.images.or(next.images);
            match (&mut first.samples, next.samples) {
                (Samples::Sft(a), Samples::Sft(b)) => a.extend(b),
                (Samples::Packed(a), Samples::Packed(b)) => a.extend(b),
                (Samples::Preference(a), Samples::Preference(b)) => a.extend(b),
                _ => {
                    return Err(DataError::Spec {
                        message: "a `dataset` list mixes kinds (packed/unpacked or SFT/preference): make every entry the same kind".into(),
                    });
                }
            }
        }
        Ok(first)
    }

    pub fn samples(&self) -> &Samples {
        &self.samples
    }

    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    pub fn len(&self) -> usize {
        match &self.samples {
            Samples::Sft(v) => v.len(),
            Samples::Packed(v) => v.len(),
            Samples::Preference(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Collates the samples at `indices` (from [`super::DataLoader::batches_for_epoch`]).
    pub fn collate(&self, indices: &[usize]) -> Result<Batch> {
        fn pick<'a, T>(v: &'a [T], idx: &[usize]) -> Result<Vec<&'a T>> {
            idx.iter()
                .map(|&i| {
                    v.get(i).ok_or_else(|| DataError::Spec {
                        message: format!(
                            "sample index {i} is out of range (dataset has {} samples)",
                            v.len()
                        ),
                    })
                })
                .collect()
        }
        Ok(match &self.samples {
            Samples::Sft(v) => {
                let rows = pick(v, indices)?;
                let mut batch = collate_sft(&rows, self.pad_id);
                if let Some(plan) = &self.images
                    && rows.iter().any(|s| !s.images.is_empty())
                {
                    let real: Vec<usize> = rows.iter().map(|s| s.len()).collect();
                    let images: Vec<_> = rows.iter().flat_map(|s| s.images.iter()).collect();
                    batch.images = Some(batch_images(
                        plan,
                        &batch.tokens,
                        batch.batch_size,
                        &real,
                        &images,
                    )?);
                }
                batch
            }
            Samples::Packed(v) => collate_packed(&pick(v, indices)?, self.pad_id),
            Samples::Preference(v) => collate_preference(&pick(v, indices)?, self.pad_id),
        })
    }
}

/// Whether any message of a conversation has images.
fn has_images(messages: &[LabeledMessage]) -> bool {
    messages.iter().any(|m| !m.images.is_empty())
}
