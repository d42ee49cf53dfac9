//! Rows -> messages, one transform per dataset kind (torchtune's `*ToMessages` transforms).
use super::error::{DataError, Result};
use super::source::{Row, kind_name};
use super::spec::{ConversationStyle, DatasetKind, DatasetSpec};
use crate::tokenizer::{ContentPart, Message, Role, TemplateInputs};
use crate::vision::ImageSource;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// A message and whether its tokens are excluded from the loss.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabeledMessage {
    pub message: Message,
    pub masked: bool,
    /// The images of its `{"type": "image"}` parts, in order.
    pub images: Vec<ImageSource>,
}

impl LabeledMessage {
    pub fn new(role: Role, content: impl Into<String>, masked: bool) -> Self {
        LabeledMessage {
            message: Message::new(role, content),
            masked,
            images: Vec::new(),
        }
    }
}

/// What one row becomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowContent {
    /// A conversation, and what its row gives the chat template besides (`tools`,
    /// `chat_template_kwargs`; chat rows only).
    Messages(Vec<LabeledMessage>, TemplateInputs),
    Text(String),
    /// A prompt (not trained) and its response (trained, then EOS), each encoded as text on its
    /// own: gsm8k_sft.
    PromptResponse {
        prompt: String,
        response: String,
    },
    Pair {
        chosen: Vec<LabeledMessage>,
        rejected: Vec<LabeledMessage>,
    },
}

pub const ALPACA_PROMPT_INPUT: &str = "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n";
pub const ALPACA_PROMPT_NO_INPUT: &str = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n";

/// Turns rows of one dataset into [`RowContent`].
#[derive(Debug, Clone)]
pub struct RowTransform {
    kind: DatasetKind,
    column_map: BTreeMap<String, String>,
    train_on_input: bool,
    new_system_prompt: Option<String>,
    conversation_column: Option<String>,
    style: ConversationStyle,
    text_column: Option<String>,
    /// Where relative image paths start (`image_dir`; else the working directory, as
    /// torchtune's and TRL's `load_image` read them).
    image_dir: Option<std::path::PathBuf>,
    /// ShareGPT rows: where the first user message's images go (`None`: before its text).
    image_tag: Option<String>,
}

/// Column access for one row, carrying what error messages need.
struct Cols<'a> {
    row: &'a Row,
    obj: &'a Map<String, Value>,
    map: &'a BTreeMap<String, String>,
}

impl<'a> Cols<'a> {
    fn name(&self, key: &str) -> String {
        self.map
            .get(key)
            .cloned()
            .unwrap_or_else(|| key.to_string())
    }

    fn value(&self, key: &str) -> Result<(&'a Value, String)> {
        let column = self.name(key);
        match self.obj.get(&column) {
            Some(v) => Ok((v, column)),
            None => Err(DataError::MissingColumn {
                path: (*self.row.file).clone(),
                row: self.row.index,
                column,
                key: key.to_string(),
                available: self.obj.keys().cloned().collect::<Vec<_>>().join(", "),
            }),
        }
    }

    fn string(&self, key: &str) -> Result<&'a str> {
        let (v, column) = self.value(key)?;
        v.as_str()
            .ok_or_else(|| self.wrong_type(column, "a string", v))
    }

    fn non_empty(&self, key: &str) -> Result<&'a str> {
        let s = self.string(key)?;
        if s.trim().is_empty() {
            return Err(DataError::EmptyValue {
                path: (*self.row.file).clone(),
                row: self.row.index,
                column: self.name(key),
            });
        }
        Ok(s)
    }

    fn wrong_type(&self, column: String, expected: &'static str, v: &Value) -> DataError {
        wrong_type(self.row, column, expected, v)
    }

    fn bad_message(&self, column: &str, index: usize, problem: String) -> DataError {
        DataError::BadMessage {
            path: (*self.row.file).clone(),
            row: self.row.index,
            column: column.to_string(),
            index,
            problem,
        }
    }
}

impl RowTransform {
    pub fn new(spec: &DatasetSpec) -> Self {
        RowTransform {
            kind: spec.kind,
            column_map: spec.column_map.clone(),
            train_on_input: spec.train_on_input,
            new_system_prompt: spec.new_system_prompt.clone(),
            conversation_column: spec.conversation_column.clone(),
            style: spec.conversation_style,
            text_column: spec.column.clone(),
            image_dir: spec.image_dir.clone(),
            image_tag: spec.image_tag.clone(),
        }
    }

    pub fn train_on_input(&self) -> bool {
        self.train_on_input
    }

    pub fn apply(&self, row: &Row) -> Result<RowContent> {
        let obj = row
            .value
            .as_object()
            .ok_or_else(|| DataError::RowNotObject {
                path: (*row.file).clone(),
                row: row.index,
                found: kind_name(&row.value).to_string(),
            })?;
        let cols = Cols {
            row,
            obj,
            map: &self.column_map,
        };
        match self.kind {
            DatasetKind::Alpaca => self.alpaca(&cols),
            DatasetKind::Instruct => {
                let input = cols.string("input")?;
                let output = cols.non_empty("output")?;
                Ok(RowContent::Messages(
                    self.with_system(vec![
                        LabeledMessage::new(Role::User, input, !self.train_on_input),
                        LabeledMessage::new(Role::Assistant, output, false),
                    ]),
                    TemplateInputs::default(),
                ))
            }
            DatasetKind::Chat | DatasetKind::MultimodalChat => self.chat(&cols),
            DatasetKind::TextCompletion => {
                let key = self.text_column.as_deref().unwrap_or("text");
                Ok(RowContent::Text(cols.non_empty(key)?.to_string()))
            }
            DatasetKind::Preference => {
                let chosen = self.message_list(&cols, "chosen", ConversationStyle::Openai)?;
                let rejected = self.message_list(&cols, "rejected", ConversationStyle::Openai)?;
                Ok(RowContent::Pair {
                    chosen: self.with_system(chosen),
                    rejected: self.with_system(rejected),
                })
            }
            DatasetKind::StackExchangePaired => {
                let key = |k: &str, default: &str| {
                    self.column_map
                        .get(k)
                        .cloned()
                        .unwrap_or_else(|| default.into())
                };
                let map: BTreeMap<String, String> = [
                    ("prompt".to_string(), key("prompt", "question")),
                    ("chosen".to_string(), key("chosen", "response_j")),
                    ("rejected".to_string(), key("rejected", "response_k")),
                ]
                .into();
                let c = Cols { map: &map, ..cols };
                let prompt = c.string("prompt")?;
                let pair = |answer: &str| {
                    self.with_system(vec![
                        LabeledMessage::new(Role::User, prompt, !self.train_on_input),
                        LabeledMessage::new(Role::Assistant, answer, false),
                    ])
                };
                Ok(RowContent::Pair {
                    chosen: pair(c.non_empty("chosen")?),
                    rejected: pair(c.non_empty("rejected")?),
                })
            }
            DatasetKind::Gsm8kSft => {
                let (question, cot, answer) =
                    super::gsm8k::gsm8k_parts(cols.row, cols.obj, &self.column_map)?;
                Ok(RowContent::PromptResponse {
                    prompt: format!("{}{question} Assistant: ", super::gsm8k::GSM8K_PROMPT_BEFORE),
                    response: format!("<think>{cot}</think> <answer>{answer}</answer>"),
                })
            }
            DatasetKind::Gsm8k | DatasetKind::Prompt => Err(DataError::Spec {
                message: "prompt datasets have no responses to train on; their rows are read by data::PromptDataset".into(),
            }),
        }
    }

    /// torchtune `AlpacaToMessages` (which ignores new_system_prompt).
    fn alpaca(&self, cols: &Cols<'_>) -> Result<RowContent> {
        let instruction = cols.string("instruction")?;
        let input = match cols.obj.get(&cols.name("input")) {
            None | Some(Value::Null) => "",
            Some(Value::String(s)) => s.as_str(),
            Some(v) => return Err(cols.wrong_type(cols.name("input"), "a string", v)),
        };
        let output = cols.non_empty("output")?;
        let prompt = if input.is_empty() {
            ALPACA_PROMPT_NO_INPUT.replace("{instruction}", instruction)
        } else {
            ALPACA_PROMPT_INPUT
                .replace("{instruction}", instruction)
                .replacen("{input}", input, 1)
        };
        Ok(RowContent::Messages(
            vec![
                LabeledMessage::new(Role::User, prompt, !self.train_on_input),
                LabeledMessage::new(Role::Assistant, output, false),
            ],
            TemplateInputs::default(),
        ))
    }

    fn chat(&self, cols: &Cols<'_>) -> Result<RowContent> {
        let default = match self.style {
            ConversationStyle::Sharegpt => "conversations",
            ConversationStyle::Openai => "messages",
        };
        let (mut column_images, columns) = self.column_images(cols)?;
        let sharegpt_images = match self.style {
            ConversationStyle::Sharegpt => self.sharegpt_images(cols)?,
            ConversationStyle::Openai => Vec::new(),
        };
        let mut messages = match &self.conversation_column {
            Some(col) => {
                let mut map = cols.map.clone();
                map.insert(default.to_string(), col.clone());
                let c = Cols { map: &map, ..*cols };
                self.message_list_with(&c, default, self.style, &mut column_images)?
            }
            None => self.message_list_with(cols, default, self.style, &mut column_images)?,
        };
        if !column_images.is_empty() {
            let taken = messages.iter().map(|m| m.images.len()).sum::<usize>();
            return Err(row_images(
                cols.row,
                super::images::ImagesError::Unused {
                    column: columns,
                    images: taken + column_images.len(),
                    parts: taken,
                },
            ));
        }
        if !sharegpt_images.is_empty() {
            self.place_sharegpt_images(&mut messages, sharegpt_images)
                .map_err(|e| row_images(cols.row, e))?;
        }
        Ok(RowContent::Messages(
            self.with_system(messages),
            match self.style {
                ConversationStyle::Openai => template_inputs(cols.row, cols.obj)?,
                ConversationStyle::Sharegpt => TemplateInputs::default(),
            },
        ))
    }

    /// A ShareGPT row's images: its `image` column (one image, or a list), as torchtune's
    /// `ShareGPTToMessages` reads it; a null or empty cell is a text-only row. An `images`
    /// column, which torchtune would skip, is refused.
    fn sharegpt_images(&self, cols: &Cols<'_>) -> Result<Vec<ImageSource>> {
        let column = cols.name("image");
        let others = cols.name("images");
        if others != column && cols.obj.get(&others).is_some_and(|v| !v.is_null()) {
            let refused = super::images::ImagesError::ShareGptImages { column: others };
            return Err(row_images(cols.row, refused));
        }
        self.cell_images(cols, &column)
    }

    /// The images of a row's `column` cell (one, or a list; none when absent or null), each
    /// error naming the file, row, column and image.
    fn cell_images(&self, cols: &Cols<'_>, column: &str) -> Result<Vec<ImageSource>> {
        let values = match cols.obj.get(column) {
            None | Some(Value::Null) => return Ok(Vec::new()),
            Some(Value::Array(list)) => list.iter().collect::<Vec<_>>(),
            Some(one) => vec![one],
        };
        values
            .into_iter()
            .enumerate()
            .map(|(i, value)| {
                let at = format!("column `{column}`, image {i}");
                let name = format!("{}: row {}, {at}", cols.row.file.display(), cols.row.index);
                super::images::image_source(value, &self.image_base(), &name).map_err(|problem| {
                    row_images(cols.row, super::images::ImagesError::Source { at, problem })
                })
            })
            .collect()
    }

    /// torchtune's placement of a ShareGPT row's images: all in the first user message, each
    /// replacing one `image_tag` of its text (`format_content_with_images`: as many tags as
    /// images, empty text between them dropped) or, with no tag, before the text; the row's
    /// prompts are then masked whatever `train_on_input` says, so that is refused.
    fn place_sharegpt_images(
        &self,
        messages: &mut [LabeledMessage],
        images: Vec<ImageSource>,
    ) -> std::result::Result<(), super::images::ImagesError> {
        use super::images::ImagesError;
        if self.train_on_input {
            return Err(ImagesError::TrainOnInput);
        }
        let first = messages
            .iter_mut()
            .find(|m| m.message.role == Role::User)
            .ok_or(ImagesError::NoUserMessage)?;
        let text = std::mem::take(&mut first.message.content);
        let mut parts = Vec::new();
        match &self.image_tag {
            None => {
                parts.extend(images.iter().map(|_| ContentPart::Image));
                parts.push(ContentPart::Text(text.clone()));
                first.message.content = text;
            }
            Some(tag) => {
                let tags = text.matches(tag.as_str()).count();
                if tags != images.len() {
                    return Err(ImagesError::Tags {
                        tag: tag.clone(),
                        tags,
                        images: images.len(),
                    });
                }
                let pieces: Vec<&str> = text.split(tag.as_str()).collect();
                for (i, piece) in pieces.iter().enumerate() {
                    if !piece.is_empty() {
                        parts.push(ContentPart::Text(piece.to_string()));
                    }
                    if i + 1 < pieces.len() {
                        parts.push(ContentPart::Image);
                    }
                }
                first.message.content = pieces.concat();
            }
        }
        first.message.parts = parts;
        first.images = images;
        Ok(())
    }

    /// Prepends `new_system_prompt` (existing system messages were dropped while parsing).
    fn with_system(&self, mut messages: Vec<LabeledMessage>) -> Vec<LabeledMessage> {
        if let Some(sys) = &self.new_system_prompt {
            messages.insert(0, LabeledMessage::new(Role::System, sys.clone(), true));
        }
        messages
    }

    /// Parses a list of messages in `style` from column `key`, with torchtune's masking.
    fn message_list(
        &self,
        cols: &Cols<'_>,
        key: &str,
        style: ConversationStyle,
    ) -> Result<Vec<LabeledMessage>> {
        let mut none = std::collections::VecDeque::new();
        self.message_list_with(cols, key, style, &mut none)
    }

    /// An OpenAI-style row's `images` column (or `image`, one), as sources in order: what
    /// image parts without their own path take, one each; and the columns' names. (A ShareGPT
    /// row's images are [`Self::sharegpt_images`].)
    fn column_images(
        &self,
        cols: &Cols<'_>,
    ) -> Result<(std::collections::VecDeque<ImageSource>, String)> {
        let mut out = std::collections::VecDeque::new();
        let mut columns = Vec::new();
        if self.style == ConversationStyle::Sharegpt {
            return Ok((out, String::new()));
        }
        for key in ["images", "image"] {
            let column = cols.name(key);
            if cols.obj.get(&column).is_none_or(Value::is_null) {
                continue;
            }
            out.extend(self.cell_images(cols, &column)?);
            columns.push(format!("`{column}`"));
        }
        Ok((out, columns.join(" and ")))
    }

    /// Where relative image paths start.
    fn image_base(&self) -> std::path::PathBuf {
        self.image_dir.clone().unwrap_or_default()
    }

    /// [`Self::message_list`], image parts without a path taking `column_images` in order.
    fn message_list_with(
        &self,
        cols: &Cols<'_>,
        key: &str,
        style: ConversationStyle,
        column_images: &mut std::collections::VecDeque<ImageSource>,
    ) -> Result<Vec<LabeledMessage>> {
        let (value, column) = cols.value(key)?;
        let expected = match style {
            ConversationStyle::Sharegpt => "a list of {\"from\": ..., \"value\": ...} messages",
            ConversationStyle::Openai => "a list of {\"role\": ..., \"content\": ...} messages",
        };
        let list = value
            .as_array()
            .ok_or_else(|| cols.wrong_type(column.clone(), expected, value))?;
        if list.is_empty() {
            return Err(cols.bad_message(&column, 0, "the conversation is empty".into()));
        }
        let mut out = Vec::with_capacity(list.len());
        for (i, item) in list.iter().enumerate() {
            let bad = |problem: String| cols.bad_message(&column, i, problem);
            let obj = item
                .as_object()
                .ok_or_else(|| bad(format!("expected an object, found {}", kind_name(item))))?;
            let (role_key, content_key) = match style {
                ConversationStyle::Sharegpt => ("from", "value"),
                ConversationStyle::Openai => ("role", "content"),
            };
            let role_str = obj
                .get(role_key)
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("needs a string `{role_key}`")))?;
            let role = match (style, role_str) {
                (ConversationStyle::Sharegpt, "system") => Role::System,
                (ConversationStyle::Sharegpt, "human" | "user") => Role::User,
                (ConversationStyle::Sharegpt, "gpt" | "assistant") => Role::Assistant,
                (ConversationStyle::Sharegpt, other) => {
                    return Err(bad(format!(
                        "unknown `from` value {other:?}; ShareGPT uses \"system\", \"human\" or \"gpt\" (or set `conversation_style: openai`)"
                    )));
                }
                (ConversationStyle::Openai, r) => Role::parse(r),
            };
            // A tool call (OpenAI's layout) may come without text.
            let calls_tools = style == ConversationStyle::Openai
                && obj
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .is_some_and(|calls| !calls.is_empty());
            let mut parts_in_order = Vec::new();
            let mut images = Vec::new();
            let content = match obj.get(content_key) {
                Some(Value::String(s)) => s.clone(),
                None | Some(Value::Null) if calls_tools => String::new(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for (p, part) in parts.iter().enumerate() {
                        match (part.get("type").and_then(Value::as_str), part.get("text")) {
                            (Some("text"), Some(Value::String(t))) => {
                                text.push_str(t);
                                parts_in_order.push(ContentPart::Text(t.clone()));
                            }
                            (Some("image" | "image_url"), _) => {
                                let what = format!(
                                    "{}: row {}, message {i}, part {p}",
                                    cols.row.file.display(),
                                    cols.row.index
                                );
                                let own = ["path", "image", "url"]
                                    .iter()
                                    .find_map(|k| part.get(*k).filter(|v| !v.is_null()))
                                    .or_else(|| part.get("image_url").and_then(|u| u.get("url")));
                                let source = match own {
                                    Some(v) => super::images::image_source(
                                        v,
                                        &self.image_base(),
                                        &what,
                                    )
                                    .map_err(|problem| bad(format!("part {p}: {problem}")))?,
                                    None => column_images.pop_front().ok_or_else(|| {
                                        bad(format!("part {p} is an image without a `path`, and the row's `images` column has no image left for it"))
                                    })?,
                                };
                                images.push(source);
                                parts_in_order.push(ContentPart::Image);
                            }
                            (ty, _) => {
                                return Err(bad(format!(
                                    "content part {p} of type {ty:?} is not supported; parts are {{\"type\": \"text\", \"text\": ...}} or {{\"type\": \"image\", \"path\": ...}}"
                                )));
                            }
                        }
                    }
                    text
                }
                _ => return Err(bad(format!("needs a string `{content_key}`"))),
            };
            if role == Role::System && self.new_system_prompt.is_some() {
                continue;
            }
            if role == Role::Assistant && content.trim().is_empty() && !calls_tools {
                return Err(bad(
                    "the assistant message is empty; give it text or drop the row".into(),
                ));
            }
            let masked = role != Role::Assistant && !self.train_on_input;
            let mut message = LabeledMessage::new(role, content, masked);
            if !images.is_empty() {
                message.message.parts = parts_in_order;
                message.images = images;
            }
            if style == ConversationStyle::Openai {
                // Every other key (gpt-oss's `thinking`, Qwen3's `reasoning_content`, ...) reaches the chat
                // template as transformers passes it.
                message.message.extra = obj
                    .iter()
                    .filter(|(k, _)| *k != role_key && *k != content_key)
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
            }
            out.push(message);
        }
        if !self.train_on_input && out.iter().all(|m| m.masked) {
            return Err(cols.bad_message(
                &column,
                list.len().saturating_sub(1),
                "the conversation has no assistant message, so nothing would be trained; add one or drop the row".into(),
            ));
        }
        Ok(out)
    }
}

/// What is wrong with `row`'s images, naming its file and row.
fn row_images(row: &Row, source: super::images::ImagesError) -> DataError {
    DataError::RowImages {
        path: (*row.file).clone(),
        row: row.index,
        source: Box::new(source),
    }
}

/// A row's `tools` (a list) and `chat_template_kwargs` (an object) columns, which TRL passes to
/// `apply_chat_template` with an OpenAI-style chat row (SFT) or prompt (GRPO).
pub(super) fn template_inputs(row: &Row, obj: &Map<String, Value>) -> Result<TemplateInputs> {
    let wrong = |column: &str, expected, v: &Value| wrong_type(row, column.into(), expected, v);
    let mut inputs = TemplateInputs::default();
    match obj.get("tools") {
        None | Some(Value::Null) => {}
        Some(tools @ Value::Array(_)) => inputs.tools = Some(tools.clone()),
        Some(other) => return Err(wrong("tools", "a list of tool definitions", other)),
    }
    match obj.get("chat_template_kwargs") {
        None | Some(Value::Null) => {}
        Some(Value::Object(kwargs)) => inputs.kwargs = kwargs.clone(),
        Some(other) => {
            return Err(wrong(
                "chat_template_kwargs",
                "an object of the chat template's keyword arguments",
                other,
            ));
        }
    }
    Ok(inputs)
}

/// Column `column` of `row` holds `v`, not what `expected` says.
fn wrong_type(row: &Row, column: String, expected: &'static str, v: &Value) -> DataError {
    DataError::WrongType {
        path: (*row.file).clone(),
        row: row.index,
        column,
        expected,
        found: kind_name(v).to_string(),
    }
}
