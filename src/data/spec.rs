//! The `dataset:` section of a recipe config, as torchtune spells it.
use serde::Deserialize;
use std::collections::BTreeMap;

/// A string or a list of strings (`data_files`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

/// How chat rows store their messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConversationStyle {
    /// `[{"from": "system"|"human"|"gpt", "value": ...}]`
    Sharegpt,
    /// `[{"role": ..., "content": str | [{"type": "text", "text": ...}]}]`
    Openai,
}

/// The dataset section. Unknown keys (extra `load_dataset` arguments) are kept in `extra`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct DatasetSpec {
    /// e.g. `torchtune.datasets.alpaca_dataset`; map it with [`DatasetKind::from_component`].
    #[serde(rename = "_component_")]
    pub component: Option<String>,
    /// `json` / `csv` / `text` (+ `data_files`), a local file path, or a Hub repo id.
    pub source: Option<String>,
    pub data_files: Option<OneOrMany>,
    /// `train` (default) or a slice of it: `train[:100]`, `train[10:20]`, `train[:10%]`.
    pub split: Option<String>,
    /// torchtune column name -> column name in the file.
    pub column_map: Option<BTreeMap<String, String>>,
    pub train_on_input: Option<bool>,
    pub packed: Option<bool>,
    /// Packing: split samples across packs (torchtune's default: true for text completion).
    pub split_across_pack: Option<bool>,
    pub new_system_prompt: Option<String>,
    /// Chat datasets: the column holding the conversation (default `conversations` for
    /// sharegpt, `messages` for openai).
    pub conversation_column: Option<String>,
    pub conversation_style: Option<ConversationStyle>,
    /// Text completion: the column holding the text (default `text`).
    pub column: Option<String>,
    /// Text completion: append EOS (default true).
    pub add_eos: Option<bool>,
    /// Accepted and ignored (a Python callable in torchtune).
    pub filter_fn: Option<serde_json::Value>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// What a dataset's rows mean; the caller picks it from `_component_`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatasetKind {
    /// `alpaca_dataset`: instruction / input / output through the Alpaca prompt
    /// (torchtune `AlpacaToMessages`); train_on_input defaults to true.
    Alpaca,
    /// `instruct_dataset`: `input` -> user, `output` -> assistant (torchtune
    /// `InputOutputToMessages`); train_on_input defaults to false.
    Instruct,
    /// `chat_dataset`: sharegpt or openai conversations; train_on_input defaults to false.
    Chat,
    /// `text_completion_dataset`: one text column, everything trained.
    TextCompletion,
    /// `preference_dataset` / `hh_rlhf_helpful_dataset`: `chosen` and `rejected` message lists.
    Preference,
    /// `stack_exchange_paired_dataset`: `question` / `response_j` (chosen) / `response_k` (rejected).
    StackExchangePaired,
}

impl DatasetKind {
    /// Maps a torchtune `_component_` (full path or last segment) to a kind.
    pub fn from_component(component: &str) -> Option<DatasetKind> {
        let name = component.rsplit('.').next().unwrap_or(component);
        Some(match name {
            "alpaca_dataset" | "alpaca_cleaned_dataset" => DatasetKind::Alpaca,
            "instruct_dataset" => DatasetKind::Instruct,
            "chat_dataset" | "slimorca_dataset" => DatasetKind::Chat,
            "text_completion_dataset" | "cnn_dailymail_articles_dataset" => {
                DatasetKind::TextCompletion
            }
            "preference_dataset" | "hh_rlhf_helpful_dataset" => DatasetKind::Preference,
            "stack_exchange_paired_dataset" => DatasetKind::StackExchangePaired,
            _ => return None,
        })
    }

    /// torchtune's default for `train_on_input`.
    pub fn default_train_on_input(self) -> bool {
        matches!(self, DatasetKind::Alpaca)
    }

    pub fn is_preference(self) -> bool {
        matches!(
            self,
            DatasetKind::Preference | DatasetKind::StackExchangePaired
        )
    }
}
