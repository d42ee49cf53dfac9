//! Hugging Face tokenizers (`tokenizer.json`) with the checkpoint's special tokens and chat template.
mod error;
mod format;
mod message;
mod special;
mod template;

pub use error::{Result, TokenizerError};
pub use format::{MessageFormat, ModelFormat, PromptTemplate, Truncation};
pub use message::{ContentPart, Message, Role};
pub use special::SpecialToken;
pub use template::{ChatTemplate, TemplateInputs, TemplateVars};

use special::CheckpointConfigs;

/// Config files named explicitly instead of found beside tokenizer.json.
#[derive(Debug, Clone, Default)]
pub struct ConfigFiles {
    pub tokenizer_config: Option<PathBuf>,
    pub generation_config: Option<PathBuf>,
}

/// A token's byte range `[start, end)` in the encoded text.
pub type Offsets = (usize, usize);
use std::path::{Path, PathBuf};

/// A tokenizer loaded from a `tokenizer.json` plus the checkpoint's config files.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    bos: Option<SpecialToken>,
    eos: Option<SpecialToken>,
    pad: Option<SpecialToken>,
    unk: Option<SpecialToken>,
    stop_ids: Vec<u32>,
    template: Option<ChatTemplate>,
    format: ModelFormat,
    /// See [`Tokenizer::with_render_time`].
    render_time: Option<i64>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("pad", &self.pad)
            .field("stop_ids", &self.stop_ids)
            .field("template", &self.template)
            .field("format", &self.format)
            .finish()
    }
}

impl Tokenizer {
    /// Loads `path`: a `tokenizer.json` file, or a checkpoint folder containing one. The
    /// special tokens and the chat template come from the JSON files beside it.
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let (file, dir) = if path.is_dir() {
            let file = path.join("tokenizer.json");
            if !file.is_file() {
                return Err(TokenizerError::NotFound {
                    dir: path.to_path_buf(),
                });
            }
            (file, path.to_path_buf())
        } else if path.is_file() {
            let dir = path
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| PathBuf::from("."));
            (path.to_path_buf(), dir)
        } else {
            return Err(TokenizerError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or folder"),
            });
        };
        Self::load(file, &dir, &ConfigFiles::default())
    }

    /// As [`Tokenizer::from_path`] with the tokenizer_config.json and generation_config.json
    /// given explicitly (torchtune's `HuggingFaceModelTokenizer` arguments) instead of found
    /// beside tokenizer.json.
    pub fn from_files(tokenizer_json: &Path, configs: &ConfigFiles) -> Result<Self> {
        let dir = tokenizer_json
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        Self::load(tokenizer_json.to_path_buf(), &dir, configs)
    }

    fn load(file: PathBuf, dir: &Path, configs: &ConfigFiles) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(&file).map_err(|e| TokenizerError::Load {
            path: file.clone(),
            message: e.to_string(),
        })?;
        let mut cfgs = CheckpointConfigs::read(dir)?;
        if let Some(path) = &configs.tokenizer_config {
            cfgs.tokenizer_config = Some(special::JsonFile::read(path)?);
        }
        if let Some(path) = &configs.generation_config {
            cfgs.generation_config = Some(special::JsonFile::read(path)?);
        }
        let bos = cfgs.resolve("bos", &inner)?;
        let eos = cfgs.resolve("eos", &inner)?;
        let pad = cfgs.resolve("pad", &inner)?;
        let unk = cfgs.resolve("unk", &inner)?;
        let stop_ids = cfgs.stop_ids(eos.as_ref().map(|t| t.id))?;
        let template = ChatTemplate::discover(dir, cfgs.tokenizer_config.as_ref())?;
        Ok(Tokenizer {
            inner,
            path: file,
            bos,
            eos,
            pad,
            unk,
            stop_ids,
            template,
            format: ModelFormat::default(),
            render_time: None,
        })
    }

    /// The tokenizer.json this was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        Ok(self.encode_with_offsets(text, add_special_tokens)?.0)
    }

    /// Token ids and each token's byte range in `text`.
    pub fn encode_with_offsets(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<(Vec<u32>, Vec<Offsets>)> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos.as_ref().map(|t| t.id)
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos.as_ref().map(|t| t.id)
    }

    /// EOS followed by the other `eos_token_id`s of generation_config.json: generation stops at any.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// The pad id, or EOS when the checkpoint defines no pad token (as torchtune does).
    pub fn pad_id(&self) -> Option<u32> {
        self.pad.as_ref().map(|t| t.id).or_else(|| self.eos_id())
    }

    pub fn bos_token(&self) -> Option<&SpecialToken> {
        self.bos.as_ref()
    }

    pub fn eos_token(&self) -> Option<&SpecialToken> {
        self.eos.as_ref()
    }

    /// Number of tokens including added tokens (may be below the model's embedding rows).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The added tokens tokenizer.json marks special (`<|end|>`, `<|im_end|>`, ...): what a chat
    /// template writes between turns.
    pub fn special_token_strings(&self) -> Vec<String> {
        let mut tokens: Vec<String> = self
            .inner
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special)
            .map(|t| t.content)
            .collect();
        tokens.sort();
        tokens
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// Replaces the chat template (`None` removes it, which selects the plain prompt format).
    pub fn set_chat_template(&mut self, source: Option<&str>) -> Result<()> {
        self.template = match source {
            Some(s) => Some(ChatTemplate::new(
                s.to_string(),
                "the configured chat_template".into(),
            )?),
            None => None,
        };
        Ok(())
    }

    /// Whether the vocabulary encodes whitespace itself (SentencePiece's check: some of
    /// space, newline, tab, CR, VT encodes to tokens).
    pub fn encodes_whitespace(&self) -> bool {
        [" ", "\n", "\t", "\r", "\u{b}"]
            .iter()
            .any(|c| self.encode(c, false).is_ok_and(|ids| !ids.is_empty()))
    }

    /// The message format of the configured tokenizer component.
    pub fn format(&self) -> &ModelFormat {
        &self.format
    }

    /// Selects the tokenizer component's format, after checking that the vocabulary has the
    /// special tokens it writes.
    pub fn set_format(&mut self, format: ModelFormat) -> Result<()> {
        let needed: &[&str] = match format.format {
            MessageFormat::ChatTemplate | MessageFormat::SentencePiece => &[],
            MessageFormat::Llama3 => &[
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
            ],
            MessageFormat::Qwen2 | MessageFormat::Qwen2_5 => &["<|im_start|>", "<|im_end|>"],
            MessageFormat::Phi3 => &[
                "<|user|>",
                "<|assistant|>",
                "<|system|>",
                "<|end|>",
                "<|endoftext|>",
            ],
            MessageFormat::Phi4 => &["<|im_start|>", "<|im_sep|>", "<|im_end|>", "<|endoftext|>"],
        };
        let missing = |token: &str| TokenizerError::MissingFormatToken {
            component: format.format.name(),
            token: token.to_string(),
            path: self.path.clone(),
        };
        if let Some(t) = needed.iter().find(|t| self.token_to_id(t).is_none()) {
            return Err(missing(t));
        }
        if matches!(
            format.format,
            MessageFormat::SentencePiece | MessageFormat::Phi3
        ) {
            if self.bos.is_none() {
                return Err(missing("bos_token"));
            }
            if format.format == MessageFormat::SentencePiece && self.eos.is_none() {
                return Err(missing("eos_token"));
            }
        }
        self.format = format;
        Ok(())
    }

    /// The BOS the format writes (None: the format writes none).
    pub fn format_bos_id(&self) -> Option<u32> {
        match self.format.format {
            MessageFormat::Llama3 => self.token_to_id("<|begin_of_text|>"),
            MessageFormat::Qwen2 | MessageFormat::Qwen2_5 => None,
            MessageFormat::Phi4 => self.token_to_id("<|endoftext|>"),
            MessageFormat::ChatTemplate | MessageFormat::SentencePiece | MessageFormat::Phi3 => {
                self.bos_id()
            }
        }
    }

    /// The EOS the format writes: torchtune's components fix it (Llama 3's `<|end_of_text|>`,
    /// Qwen's `<|im_end|>`, Phi-3's `<|endoftext|>`); otherwise the checkpoint's.
    pub fn format_eos_id(&self) -> Option<u32> {
        match self.format.format {
            MessageFormat::Llama3 => self.token_to_id("<|end_of_text|>"),
            MessageFormat::Qwen2 | MessageFormat::Qwen2_5 | MessageFormat::Phi4 => {
                self.token_to_id("<|im_end|>")
            }
            MessageFormat::Phi3 => self.token_to_id("<|endoftext|>"),
            MessageFormat::ChatTemplate | MessageFormat::SentencePiece => self.eos_id(),
        }
    }

    /// Renders `messages` with the chat template (text, not ids: `data`'s tokenization encodes
    /// it without special tokens, after the tokenizer's BOS where the template wrote none).
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.apply_chat_template_with(messages, add_generation_prompt, &TemplateInputs::default())
    }

    /// [`Self::apply_chat_template`] with a conversation's tools and keyword arguments.
    pub fn apply_chat_template_with(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        inputs: &TemplateInputs,
    ) -> Result<String> {
        let template = self
            .template
            .as_ref()
            .ok_or(TokenizerError::NoChatTemplate)?;
        template.render(
            messages,
            add_generation_prompt,
            &self.template_vars(),
            inputs,
        )
    }

    fn template_vars(&self) -> TemplateVars {
        let content = |t: &Option<SpecialToken>| t.as_ref().map(|t| t.content.clone());
        TemplateVars {
            bos_token: content(&self.bos),
            eos_token: content(&self.eos),
            pad_token: content(&self.pad),
            unk_token: content(&self.unk),
            render_time: self.render_time,
        }
    }

    /// Renders chat templates as at `unix_secs`: what their `strftime_now` writes (gpt-oss's
    /// "Current date:"), in place of the clock.
    pub fn with_render_time(mut self, unix_secs: i64) -> Self {
        self.render_time = Some(unix_secs);
        self
    }
}
