//! Typed errors of the data pipeline. Row errors name the file, the row (0-based, in the order
//! of the file) and the column, and say what to change.
use crate::tokenizer::TokenizerError;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error(
        "dataset source `{repo}` looks like a Hugging Face Hub dataset, which this build cannot download; download it and point `source: json` + `data_files:` (or `source:`) at the local .json/.jsonl/.csv/.parquet/.txt file"
    )]
    HubDatasetNotAvailable { repo: String },
    #[error("dataset config: {message}")]
    Spec { message: String },
    #[error("cannot read dataset file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {location}is not valid {format}: {message}")]
    Parse {
        path: PathBuf,
        /// e.g. "line 3 " for JSON Lines and CSV; empty otherwise.
        location: String,
        format: &'static str,
        message: String,
    },
    #[error(
        "{path}: row {row} is not a JSON object (found {found}); every row needs named columns"
    )]
    RowNotObject {
        path: PathBuf,
        row: usize,
        found: String,
    },
    #[error(
        "{path}: row {row} has no column `{column}` (its columns: {available}); add it, or map an existing column with `column_map: {{{key}: <your column>}}`"
    )]
    MissingColumn {
        path: PathBuf,
        row: usize,
        column: String,
        /// The column name torchtune expects (the key of column_map).
        key: String,
        available: String,
    },
    #[error(
        "{path}: row {row}, column `{column}`: expected {expected}, found {found}; fix the row"
    )]
    WrongType {
        path: PathBuf,
        row: usize,
        column: String,
        expected: &'static str,
        found: String,
    },
    #[error("{path}: row {row}, column `{column}` is empty; give it text or drop the row")]
    EmptyValue {
        path: PathBuf,
        row: usize,
        column: String,
    },
    #[error("{path}: row {row}, column `{column}`, message {index}: {problem}")]
    BadMessage {
        path: PathBuf,
        row: usize,
        column: String,
        index: usize,
        problem: String,
    },
    #[error("{path}: row {row}: {source}")]
    Tokenize {
        path: PathBuf,
        row: usize,
        #[source]
        source: TokenizeError,
    },
    #[error(
        "sample {index} has {len} tokens, more than max_seq_len {max_seq_len}, and cannot be packed; raise max_seq_len or set `split_across_pack: true`"
    )]
    SampleTooLong {
        index: usize,
        len: usize,
        max_seq_len: usize,
    },
    #[error("dataset {path} has no rows")]
    Empty { path: PathBuf },
    #[error("{path}: row {row}: {source}")]
    RowImages {
        path: PathBuf,
        row: usize,
        #[source]
        source: Box<super::images::ImagesError>,
    },
    #[error("a batch's images: {0}")]
    BatchImages(Box<super::images::ImagesError>),
}

impl From<super::images::ImagesError> for DataError {
    fn from(e: super::images::ImagesError) -> Self {
        Self::BatchImages(Box::new(e))
    }
}

/// Errors turning messages into tokens (wrapped in [`DataError::Tokenize`] with the row).
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(
        "could not find message {index} ({role}) in the text the chat template rendered, so its tokens cannot be masked; set `train_on_input: true` or use a template that writes message contents verbatim"
    )]
    MessageNotInTemplate { index: usize, role: String },
    #[error(
        "the row's `{column}` is for a chat template, which this tokenizer does not format with (a torchtune tokenizer component, or no chat_template); use tune.tokenizers.HFTokenizer with the checkpoint's template, or drop the column"
    )]
    TemplateInputWithoutTemplate { column: &'static str },
    #[error("max_seq_len must be at least 2 (got {0})")]
    MaxSeqLen(usize),
    #[error(
        "the tokenizer component's format writes the special token {0:?}, which the tokenizer.json does not have; point `tokenizer.path` at this model family's tokenizer"
    )]
    MissingSpecialToken(String),
    #[error("{0}")]
    Template(String),
}

pub type Result<T, E = DataError> = std::result::Result<T, E>;
