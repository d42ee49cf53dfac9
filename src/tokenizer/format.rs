//! How a conversation becomes tokens: the format a torchtune tokenizer component defines, or the
//! checkpoint's Hugging Face chat template.
//!
//! torchtune's model tokenizers (`llama3_tokenizer`, `qwen2_5_tokenizer`, `mistral_tokenizer`, ...)
//! each write their own headers, end-of-turn tokens, BOS/EOS and masks, whatever chat template
//! the checkpoint ships. tune reads the vocabulary from the model's `tokenizer.json` and takes the
//! format from the component the config names, so one config trains on the same tokens in both.
//! The formats themselves are implemented in `data::formats`.
use super::error::{Result, TokenizerError};
use super::message::Role;

/// The message format of a tokenizer component.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MessageFormat {
    /// The checkpoint's chat template (the plain format when it has none): torchtune's
    /// `HuggingFaceModelTokenizer`, and the default for families torchtune has no component for.
    #[default]
    ChatTemplate,
    /// `Llama3Tokenizer`: BOS; per message `<|start_header_id|>role<|end_header_id|>\n\n`, each
    /// content piece stripped, `<|eot_id|>`; a final `<|end_of_text|>`.
    Llama3,
    /// `Qwen2Tokenizer`: ChatML without BOS; the last assistant message ends with EOS
    /// (`<|im_end|>`) instead of `<|im_end|>\n`.
    Qwen2,
    /// `Qwen2_5Tokenizer` (and main's `Qwen3Tokenizer`): as Qwen2, except which message counts
    /// as last is decided after the prompt template (the two differ only when a template drops
    /// messages, as Llama2ChatTemplate drops system messages).
    Qwen2_5,
    /// `tokenize_messages_no_special_tokens` (Llama2Tokenizer, MistralTokenizer, GemmaTokenizer):
    /// BOS at the start of each turn, each message encoded on its own (SentencePiece's leading
    /// space trimmed inside a turn), EOS after each assistant message.
    SentencePiece,
    /// `Phi3MiniTokenizer` as torchtune's datasets call it: `<s>` once, per message
    /// `<|user|>`/`<|assistant|>`/`<|system|>` + `\n`, content, `<|end|>\n`; no EOS.
    Phi3,
    /// `Phi4Tokenizer`: per message `<|im_start|>role<|im_sep|>`, each content piece with its
    /// trailing spaces stripped, `<|im_end|>` after every message but the assistant's (which
    /// torchtune's training path leaves open); no BOS or EOS.
    Phi4,
}

impl MessageFormat {
    /// Whether this is one of torchtune's own formats (not the chat template).
    pub fn is_torchtune(self) -> bool {
        self != MessageFormat::ChatTemplate
    }

    /// The name torchtune gives the class, for messages.
    pub fn name(self) -> &'static str {
        match self {
            MessageFormat::ChatTemplate => "the checkpoint's chat template",
            MessageFormat::Llama3 => "Llama3Tokenizer",
            MessageFormat::Qwen2 => "Qwen2Tokenizer",
            MessageFormat::Qwen2_5 => "Qwen2_5Tokenizer",
            MessageFormat::SentencePiece => "tokenize_messages_no_special_tokens",
            MessageFormat::Phi3 => "Phi3MiniTokenizer",
            MessageFormat::Phi4 => "Phi4Tokenizer",
        }
    }
}

/// What wraps each message before it is tokenized (torchtune's prompt templates). The wrapping
/// text is tokenized as its own content piece, as torchtune does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptTemplate {
    /// `{role: [prefix, suffix]}`: torchtune's `PromptTemplate`, and the built-in
    /// `GrammarErrorCorrectionTemplate`, `SummarizeTemplate`, `QuestionAnswerTemplate`.
    Tags(Vec<(Role, String, String)>),
    /// `ChatMLTemplate`: `<|im_start|>role\n` ... `<|im_end|>\n` as text.
    ChatMl,
    /// `Llama2ChatTemplate`: `[INST] ` ... ` [/INST] ` around user messages, the system message
    /// folded into the next user message inside `<<SYS>>\n` ... `\n<</SYS>>\n\n`.
    Llama2Chat,
    /// `MistralChatTemplate`: `[INST] ` ... ` [/INST] ` around user messages; system messages
    /// are an error.
    MistralChat,
}

/// A built-in template's torchtune path and how to make it.
type BuiltIn = (&'static str, fn() -> PromptTemplate);

/// The built-in prompt templates by their torchtune path.
const BUILT_IN: &[BuiltIn] = &[
    ("torchtune.data.GrammarErrorCorrectionTemplate", || {
        tags(&[(
            Role::User,
            "Correct this to standard English: ",
            "\n---\nCorrected: ",
        )])
    }),
    ("torchtune.data.SummarizeTemplate", || {
        tags(&[(
            Role::User,
            "Summarize this dialogue:\n",
            "\n---\nSummary:\n",
        )])
    }),
    ("torchtune.data.QuestionAnswerTemplate", || {
        tags(&[(Role::User, "Question: ", "\n\nAnswer: ")])
    }),
    ("torchtune.data.ChatMLTemplate", || PromptTemplate::ChatMl),
    ("torchtune.models.llama2.Llama2ChatTemplate", || {
        PromptTemplate::Llama2Chat
    }),
    ("torchtune.models.mistral.MistralChatTemplate", || {
        PromptTemplate::MistralChat
    }),
];

fn tags(t: &[(Role, &str, &str)]) -> PromptTemplate {
    PromptTemplate::Tags(
        t.iter()
            .map(|(r, p, s)| (r.clone(), p.to_string(), s.to_string()))
            .collect(),
    )
}

impl PromptTemplate {
    /// The names `prompt_template` accepts as a string.
    pub fn built_in_names() -> impl Iterator<Item = &'static str> {
        BUILT_IN.iter().map(|(n, _)| *n)
    }

    /// Parses `tokenizer.prompt_template`: a built-in template's torchtune path (the
    /// `torchtune.` prefix may be `tune.`, or left out together with the module), or a mapping
    /// `{role: [prefix, suffix]}`.
    pub fn from_value(value: &serde_json::Value) -> Result<PromptTemplate> {
        let bad = |why: String| TokenizerError::PromptTemplate(why);
        match value {
            serde_json::Value::String(s) => {
                let short = s.rsplit('.').next().unwrap_or(s);
                BUILT_IN
                    .iter()
                    .find(|(name, _)| {
                        *name == s
                            || name.strip_prefix("torchtune.")
                                == s.strip_prefix("tune.").or(Some(s.as_str()))
                            || name.rsplit('.').next() == Some(short) && !s.contains('.')
                    })
                    .map(|(_, make)| make())
                    .ok_or_else(|| {
                        bad(format!(
                            "`{s}` is not a prompt template tune knows; use one of {} or a mapping {{role: [prefix, suffix]}}",
                            PromptTemplate::built_in_names().collect::<Vec<_>>().join(", ")
                        ))
                    })
            }
            serde_json::Value::Object(map) => {
                let mut out = Vec::new();
                for (role, v) in map {
                    let role = match role.as_str() {
                        "system" | "user" | "assistant" => Role::parse(role),
                        "ipython" | "tool" => Role::Tool,
                        other => {
                            return Err(bad(format!(
                                "role `{other}` is not one of system, user, assistant, ipython"
                            )));
                        }
                    };
                    let pair = v
                        .as_array()
                        .filter(|a| a.len() == 2 && a.iter().all(|x| x.is_string()))
                        .ok_or_else(|| {
                            bad(format!(
                                "`{role}` must map to [prefix, suffix], two strings; got {v}"
                            ))
                        })?;
                    let s = |i: usize| pair[i].as_str().unwrap_or_default().to_string();
                    out.push((role, s(0), s(1)));
                }
                Ok(PromptTemplate::Tags(out))
            }
            other => Err(bad(format!(
                "expected a template name or a mapping {{role: [prefix, suffix]}}, got {other}"
            ))),
        }
    }
}

/// Which end of a too-long conversation is kept (torchtune main's `truncation_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Truncation {
    /// The first `max_seq_len` tokens (torchtune 0.6.1's only behaviour).
    #[default]
    Right,
    /// The last `max_seq_len` tokens.
    Left,
}

/// A tokenizer component's format, its prompt template and its truncation side.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ModelFormat {
    pub format: MessageFormat,
    pub prompt_template: Option<PromptTemplate>,
    pub truncation: Truncation,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn built_in_templates_are_found_by_path_and_short_name() {
        for s in [
            "torchtune.models.llama2.Llama2ChatTemplate",
            "tune.models.llama2.Llama2ChatTemplate",
            "Llama2ChatTemplate",
        ] {
            assert_eq!(
                PromptTemplate::from_value(&json!(s)).unwrap(),
                PromptTemplate::Llama2Chat,
                "{s}"
            );
        }
        assert!(matches!(
            PromptTemplate::from_value(&json!("torchtune.data.QuestionAnswerTemplate")).unwrap(),
            PromptTemplate::Tags(t) if t[0].1 == "Question: "
        ));
    }

    #[test]
    fn unknown_templates_and_bad_mappings_are_errors_naming_the_problem() {
        let e = PromptTemplate::from_value(&json!("my.module.MyTemplate")).unwrap_err();
        assert!(e.to_string().contains("my.module.MyTemplate"), "{e}");
        let e = PromptTemplate::from_value(&json!({"user": ["only one"]})).unwrap_err();
        assert!(e.to_string().contains("[prefix, suffix]"), "{e}");
        let e = PromptTemplate::from_value(&json!({"narrator": ["a", "b"]})).unwrap_err();
        assert!(e.to_string().contains("narrator"), "{e}");
        let ok = PromptTemplate::from_value(&json!({"user": ["[U] ", " [/U]"]})).unwrap();
        assert_eq!(
            ok,
            PromptTemplate::Tags(vec![(Role::User, "[U] ".into(), " [/U]".into())])
        );
    }
}
