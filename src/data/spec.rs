//! What the data layer is asked to build: one dataset, every choice resolved (setup builds it
//! once from the config's `dataset` entry, with torchtune's defaults applied).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A string or a list of strings (`data_files`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DataFiles {
    One(String),
    Many(Vec<String>),
}

impl DataFiles {
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            DataFiles::One(s) => vec![s.clone()],
            DataFiles::Many(v) => v.clone(),
        }
    }
}

/// How chat rows store their messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConversationStyle {
    /// `[{"from": "system"|"human"|"gpt", "value": ...}]`
    #[default]
    Sharegpt,
    /// `[{"role": ..., "content": str | [{"type": "text", "text": ...}]}]`
    Openai,
}

/// Where torchtune's `ShareGPTToMessages` places a row's image unless told otherwise (what
/// `chat_dataset` uses).
pub const DEFAULT_IMAGE_TAG: &str = "<image>";

/// One dataset to build.
#[derive(Debug, Clone, PartialEq)]
pub struct DatasetSpec {
    /// What the rows mean.
    pub kind: DatasetKind,
    /// `json` / `csv` / `parquet` / `text` (+ `data_files`), a local file path, or a Hub repo id.
    pub source: Option<String>,
    pub data_files: Vec<String>,
    /// `train` or a slice of it: `train[:100]`, `train[10:20]`, `train[:10%]`.
    pub split: String,
    /// torchtune column name -> column name in the file.
    pub column_map: BTreeMap<String, String>,
    /// Whether the prompt's tokens are trained too.
    pub train_on_input: bool,
    /// Several samples per row of `tokenizer.max_seq_len` (torchtune's `packed`).
    pub packed: bool,
    /// Packing: a sample that does not fit continues in the next pack.
    pub split_across_pack: bool,
    pub new_system_prompt: Option<String>,
    /// Chat datasets: the column holding the conversation (`None`: `conversations` for
    /// sharegpt, `messages` for openai).
    pub conversation_column: Option<String>,
    pub conversation_style: ConversationStyle,
    /// Text completion: the column holding the text (`None`: `text`).
    pub column: Option<String>,
    /// Text completion: append EOS.
    pub add_eos: bool,
    /// gsm8k: keep row `i` when `start <= i % total <= end` (`start-end/total`, torchtune's).
    pub partition: Option<String>,
    /// Prompt datasets: format the prompt as a user turn in the tokenizer's chat format (else
    /// plain text after BOS).
    pub apply_chat_template: bool,
    /// Where relative image paths start (else the working directory, as torchtune's
    /// `image_dir`).
    pub image_dir: Option<std::path::PathBuf>,
    /// ShareGPT rows with images: the tag in the first user message's text that each of the
    /// row's images replaces, in order (`None`: the images go before its text). torchtune's
    /// `chat_dataset` places them at `<image>`, its `multimodal_chat_dataset` at its `image_tag`
    /// (default none).
    pub image_tag: Option<String>,
    /// A vision-language model's processor and vision config, for rows with images; `None`:
    /// the model reads no images (a row with one is refused).
    pub images: Option<super::images::ImagePlan>,
}

impl DatasetSpec {
    /// A dataset of `kind` with torchtune's defaults (the train split, no packing).
    pub fn new(kind: DatasetKind) -> Self {
        Self {
            kind,
            source: None,
            data_files: Vec::new(),
            split: "train".into(),
            column_map: BTreeMap::new(),
            train_on_input: kind.default_train_on_input(),
            packed: false,
            split_across_pack: kind.default_split_across_pack(),
            new_system_prompt: None,
            conversation_column: None,
            conversation_style: ConversationStyle::default(),
            column: None,
            add_eos: true,
            partition: None,
            apply_chat_template: true,
            image_dir: None,
            image_tag: (kind == DatasetKind::Chat).then(|| DEFAULT_IMAGE_TAG.to_string()),
            images: None,
        }
    }
}

/// What a dataset's rows mean: the builder a config's `_component_` names resolves to one
/// (`config::components`).
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
    /// `multimodal_chat_dataset`: ShareGPT conversations whose `image` column goes into the
    /// first user message, at its `image_tag`s or before its text; prompts of rows with images
    /// are never trained (torchtune's `ShareGPTToMessages`).
    MultimodalChat,
    /// `text_completion_dataset`: one text column, everything trained.
    TextCompletion,
    /// `preference_dataset` / `hh_rlhf_helpful_dataset`: `chosen` and `rejected` message lists.
    Preference,
    /// `stack_exchange_paired_dataset`: `question` / `response_j` (chosen) / `response_k` (rejected).
    StackExchangePaired,
    /// `gsm8k_dataset` (torchtune's `dev.grpo.gsm8k`): prompts in torchtune's R1 preamble, the
    /// answer after `#### ` for the rewards (`data::PromptDataset`).
    Gsm8k,
    /// `gsm8k_sft` (torchtune's `dev.grpo.gsm8k`, its `dev/3B_sft_for_grpo` config): the R1
    /// preamble with the question (not trained), then `<think>cot</think> <answer>answer</answer>`
    /// and EOS (trained): the SFT stage before GRPO.
    Gsm8kSft,
    /// `prompt_dataset`: a prompt column for generation, the other columns for the rewards.
    Prompt,
}

impl DatasetKind {
    /// torchtune's default for `train_on_input`.
    pub fn default_train_on_input(self) -> bool {
        matches!(self, DatasetKind::Alpaca)
    }

    /// torchtune's default for `split_across_pack`: text completion splits, the others not.
    pub fn default_split_across_pack(self) -> bool {
        self == DatasetKind::TextCompletion
    }

    /// Prompts to generate from (the RL recipes), not responses to train on.
    pub fn is_prompt(self) -> bool {
        matches!(self, DatasetKind::Gsm8k | DatasetKind::Prompt)
    }

    pub fn is_preference(self) -> bool {
        matches!(
            self,
            DatasetKind::Preference | DatasetKind::StackExchangePaired
        )
    }
}
