//! Dataset loading, row -> message transforms, tokenization with loss masks, packing, batching.
mod collate;
mod dataset;
mod error;
mod formats;
mod gsm8k;
pub mod images;
mod loader;
mod packing;
mod prompts;
mod sample;
mod source;
mod spec;
mod tokenize;
mod transform;
mod unpad;

pub use collate::{Batch, PreferenceSample, collate_packed, collate_preference, collate_sft};
pub use dataset::{Dataset, Samples};
pub use error::{DataError, Result, TokenizeError};
pub use gsm8k::{GSM8K_PROMPT_AFTER, GSM8K_PROMPT_BEFORE};
pub use loader::{DataLoader, EpochBatches, LoaderConfig};
pub use packing::{PackedSample, pack};
pub use prompts::{Partition, PromptDataset, PromptSample, prompt_tokens};
pub use sample::{IGNORE_INDEX, SftSample};
pub use source::{FileFormat, Row, load_rows, read_file, resolve_files};
pub use spec::{ConversationStyle, DataFiles, DatasetKind, DatasetSpec};
pub use tokenize::{
    tokenize_conversation, tokenize_messages, tokenize_prompt, tokenize_prompt_response,
    tokenize_text, truncate,
};
pub use transform::{
    ALPACA_PROMPT_INPUT, ALPACA_PROMPT_NO_INPUT, LabeledMessage, RowContent, RowTransform,
};
pub use unpad::{Keep, LONG_PACK, unpad, unpad_keeping};
