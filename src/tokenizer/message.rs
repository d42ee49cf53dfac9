//! Chat messages as chat templates see them.
use serde::{Deserialize, Serialize};
use std::fmt;

/// The author of a chat message.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Role {
    System,
    User,
    Assistant,
    /// `tool` / `ipython` results.
    Tool,
    /// Any other role string, passed to the template unchanged.
    Other(String),
}

impl Role {
    /// Parses a role string (`system`, `user`, `assistant`, `tool`; `ipython` maps to [`Role::Tool`]).
    pub fn parse(s: &str) -> Role {
        match s {
            "system" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            other => Role::Other(other.to_string()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
            Role::Other(s) => s,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Role {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Role {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(Role::parse(&s))
    }
}

/// One chat message: `{"role": ..., "content": ...}` in the template, with every other key
/// the dataset's message has (`extra`). A message with images reaches the template as
/// transformers passes it, its `content` a list of `{"type": "text", "text": ...}` and
/// `{"type": "image"}` parts (`parts`); `content` then holds its text parts joined.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Message {
    pub role: Role,
    /// Empty for a tool call without text.
    #[serde(default, deserialize_with = "text_or_null")]
    pub content: String,
    /// The content's parts in order when it has images; empty for text content.
    #[serde(skip)]
    pub parts: Vec<ContentPart>,
    /// The message's other keys, passed to a chat template unchanged, as transformers'
    /// `apply_chat_template` passes each message: gpt-oss's template renders an assistant's
    /// `thinking` as its analysis channel (the OpenAI cookbook's fine-tuning data has it), and
    /// without it the reasoning would silently go untrained. torchtune's formats (its tokenizer
    /// components) read the role and content only, as torchtune's own do.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// One part of a message's content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContentPart {
    Text(String),
    /// The row's next image (the data layer holds the images themselves, in order).
    Image,
}

impl Serialize for ContentPart {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(if matches!(self, Self::Text(_)) { 2 } else { 1 }))?;
        match self {
            Self::Text(text) => {
                map.serialize_entry("type", "text")?;
                map.serialize_entry("text", text)?;
            }
            Self::Image => map.serialize_entry("type", "image")?,
        }
        map.end()
    }
}

impl Serialize for Message {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(2 + self.extra.len()))?;
        map.serialize_entry("role", &self.role)?;
        if self.parts.is_empty() {
            map.serialize_entry("content", &self.content)?;
        } else {
            map.serialize_entry("content", &self.parts)?;
        }
        for (key, value) in &self.extra {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

/// A message's `content`: its text, or `null` read as none (a tool call's).
fn text_or_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
            parts: Vec::new(),
            extra: serde_json::Map::new(),
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }
}
