//! A tokenized example and the label that keeps a token out of the loss.

/// Label of tokens excluded from the loss (PyTorch's cross-entropy ignore index).
pub const IGNORE_INDEX: i64 = -100;

/// One tokenized example. `labels[t]` is `tokens[t]` or [`IGNORE_INDEX`]; not shifted.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SftSample {
    pub tokens: Vec<u32>,
    pub labels: Vec<i64>,
    /// The images whose placeholders the tokens hold, in order (a vision-language model's
    /// sample; see `data::images`).
    pub images: Vec<SampleImage>,
}

/// One image of a sample: where it is and how many tokens it takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleImage {
    pub source: crate::vision::ImageSource,
    pub tokens: usize,
}

impl SftSample {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
    /// Number of labels that are not [`IGNORE_INDEX`].
    pub fn num_trained(&self) -> usize {
        self.labels.iter().filter(|&&l| l != IGNORE_INDEX).count()
    }
    pub(super) fn push(&mut self, token: u32, trained: bool) {
        self.tokens.push(token);
        self.labels.push(if trained {
            i64::from(token)
        } else {
            IGNORE_INDEX
        });
    }
}
