//! Resolves BOS / EOS / PAD / stop ids from the JSON files of a Hugging Face checkpoint.
//!
//! Order, first hit wins: `tokenizer_config.json` (a string or an AddedToken object
//! `{"content": ...}`), `special_tokens_map.json`, `generation_config.json` (`*_token_id`),
//! `config.json` (`*_token_id`).
use super::error::{Result, TokenizerError};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A special token: its string form and its id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialToken {
    pub content: String,
    pub id: u32,
}

/// A JSON file of the checkpoint that was found and parsed.
pub(crate) struct JsonFile {
    pub path: PathBuf,
    pub value: Value,
}

impl JsonFile {
    /// Reads a file that must exist.
    pub fn read(path: &Path) -> Result<JsonFile> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let value = serde_json::from_str(&text).map_err(|source| TokenizerError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(JsonFile {
            path: path.to_path_buf(),
            value,
        })
    }

    /// Reads `dir/name` if it exists.
    pub fn read_optional(dir: &Path, name: &str) -> Result<Option<JsonFile>> {
        let path = dir.join(name);
        if !path.is_file() {
            return Ok(None);
        }
        Self::read(&path).map(Some)
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.value.get(key).filter(|v| !v.is_null())
    }

    /// A token string under `key`: a plain string or `{"content": "..."}`.
    pub fn token_string(&self, key: &str) -> Result<Option<String>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Object(o)) => match o.get("content") {
                Some(Value::String(s)) => Ok(Some(s.clone())),
                _ => Err(self.bad(key, "a string or an object with a string `content`")),
            },
            Some(_) => Err(self.bad(key, "a string or an object with a string `content`")),
        }
    }

    /// Token ids under `key`: an integer or a list of integers.
    pub fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        let as_id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| as_id(v).ok_or_else(|| self.bad(key, "an integer or a list of integers")))
                .collect(),
            Some(v) => as_id(v)
                .map(|id| vec![id])
                .ok_or_else(|| self.bad(key, "an integer or a list of integers")),
        }
    }

    fn bad(&self, key: &str, expected: &'static str) -> TokenizerError {
        let mut found = self
            .value
            .get(key)
            .map(|v| v.to_string())
            .unwrap_or_default();
        if found.len() > 80 {
            found.truncate(80);
            found.push_str("...");
        }
        TokenizerError::BadConfigValue {
            path: self.path.clone(),
            key: key.to_string(),
            expected,
            found,
        }
    }
}

/// The config files of a checkpoint folder that carry special-token information.
pub(crate) struct CheckpointConfigs {
    pub tokenizer_config: Option<JsonFile>,
    pub special_tokens_map: Option<JsonFile>,
    pub generation_config: Option<JsonFile>,
    pub config: Option<JsonFile>,
}

impl CheckpointConfigs {
    pub fn read(dir: &Path) -> Result<Self> {
        Ok(CheckpointConfigs {
            tokenizer_config: JsonFile::read_optional(dir, "tokenizer_config.json")?,
            special_tokens_map: JsonFile::read_optional(dir, "special_tokens_map.json")?,
            generation_config: JsonFile::read_optional(dir, "generation_config.json")?,
            config: JsonFile::read_optional(dir, "config.json")?,
        })
    }

    /// Resolves one special token (`name` is `bos`, `eos`, `pad` or `unk`).
    pub fn resolve(&self, name: &str, tok: &tokenizers::Tokenizer) -> Result<Option<SpecialToken>> {
        let key = format!("{name}_token");
        for file in [&self.tokenizer_config, &self.special_tokens_map]
            .into_iter()
            .flatten()
        {
            if let Some(content) = file.token_string(&key)? {
                let id = tok.token_to_id(&content).ok_or_else(|| {
                    TokenizerError::UnknownSpecialToken {
                        path: file.path.clone(),
                        key: key.clone(),
                        token: content.clone(),
                    }
                })?;
                return Ok(Some(SpecialToken { content, id }));
            }
        }
        let id_key = format!("{name}_token_id");
        for file in [&self.generation_config, &self.config]
            .into_iter()
            .flatten()
        {
            if let Some(&id) = file.token_ids(&id_key)?.first() {
                let content = tok.id_to_token(id).unwrap_or_default();
                return Ok(Some(SpecialToken { content, id }));
            }
        }
        Ok(None)
    }

    /// EOS first, then every `eos_token_id` of generation_config.json (or of config.json
    /// when generation_config.json has none), without duplicates.
    pub fn stop_ids(&self, eos: Option<u32>) -> Result<Vec<u32>> {
        let mut ids: Vec<u32> = eos.into_iter().collect();
        let mut extra = Vec::new();
        if let Some(g) = &self.generation_config {
            extra = g.token_ids("eos_token_id")?;
        }
        if extra.is_empty()
            && let Some(c) = &self.config
        {
            extra = c.token_ids("eos_token_id")?;
        }
        for id in extra {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        Ok(ids)
    }
}
