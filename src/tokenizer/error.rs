//! Typed errors of the tokenizer module.
use std::path::PathBuf;

/// Everything that can go wrong while loading a tokenizer or using it.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(
        "no tokenizer.json in {dir}: point `tokenizer.path` at a Hugging Face checkpoint folder that contains tokenizer.json, or at the tokenizer.json file itself"
    )]
    NotFound { dir: PathBuf },
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cannot load tokenizer {path}: {message} (is it a Hugging Face `tokenizers` tokenizer.json?)"
    )]
    Load { path: PathBuf, message: String },
    #[error("{path} is not valid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: key `{key}` has an unexpected value ({found}); expected {expected}")]
    BadConfigValue {
        path: PathBuf,
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error(
        "{path}: `{key}` is {token:?}, which is not in the tokenizer's vocabulary; fix the token string or remove the key"
    )]
    UnknownSpecialToken {
        path: PathBuf,
        key: String,
        token: String,
    },
    #[error(
        "{path}: `chat_template` is a list of named templates without one called \"default\" (found: {names}); rename one to \"default\""
    )]
    NoDefaultTemplate { path: PathBuf, names: String },
    #[error("the chat template from {origin} does not compile: {message}")]
    TemplateSyntax { origin: String, message: String },
    #[error(
        "this tokenizer has no chat template (no `chat_template` in tokenizer_config.json and no chat_template.jinja beside it)"
    )]
    NoChatTemplate,
    #[error("rendering the chat template from {origin} failed: {message}")]
    TemplateRender { origin: String, message: String },
    #[error("{0}")]
    PromptTemplate(String),
    #[error(
        "{component} needs the special token {token:?}, which {path} does not have: point `tokenizer.path` at this model family's tokenizer.json, or use `_component_: torchtune.modules.transforms.tokenizers.HuggingFaceModelTokenizer` to format with the checkpoint's chat template"
    )]
    MissingFormatToken {
        component: &'static str,
        token: String,
        path: PathBuf,
    },
    #[error("encoding failed: {0}")]
    Encode(String),
    #[error("decoding failed: {0}")]
    Decode(String),
}

pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;
