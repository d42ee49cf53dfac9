//! Reads the `huggingface_hub` environment variables into plain settings.
//!
//! Resolution is a pure function of a lookup closure so it can be tested
//! without mutating the process environment.

use std::path::PathBuf;

/// The default Hub endpoint.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Hub settings taken from the environment, before per-call options override them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubEnv {
    /// `HF_ENDPOINT`, default <https://huggingface.co>, without a trailing `/`.
    pub endpoint: String,
    /// `HF_TOKEN` (or the legacy `HUGGING_FACE_HUB_TOKEN`).
    pub token: Option<String>,
    /// `HF_TOKEN_PATH`, default `$HF_HOME/token` (written by `hf auth login`).
    pub token_path: PathBuf,
    /// `HF_HUB_CACHE` (or legacy `HUGGINGFACE_HUB_CACHE`), default `$HF_HOME/hub`.
    pub cache_dir: PathBuf,
    /// `HF_HUB_OFFLINE` is truthy (1/true/yes/on).
    pub offline: bool,
    /// `HF_HUB_DISABLE_PROGRESS_BARS` is truthy.
    pub disable_progress: bool,
}

fn truthy(value: Option<String>) -> bool {
    value.is_some_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

fn non_empty(value: Option<String>) -> Option<String> {
    value
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

impl HubEnv {
    /// Resolves settings from a variable lookup (`HF_HOME` defaults to
    /// `$XDG_CACHE_HOME/huggingface`, else `$HOME/.cache/huggingface`).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Self {
        let var = |name: &str| non_empty(lookup(name));
        let hf_home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            let cache_home = var("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| {
                var("HOME")
                    .or_else(|| var("USERPROFILE"))
                    .map(PathBuf::from)
                    .unwrap_or_default()
                    .join(".cache")
            });
            cache_home.join("huggingface")
        });
        let endpoint = var("HF_ENDPOINT")
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
            .trim_end_matches('/')
            .to_string();
        HubEnv {
            endpoint,
            token: var("HF_TOKEN").or_else(|| var("HUGGING_FACE_HUB_TOKEN")),
            token_path: var("HF_TOKEN_PATH")
                .map(PathBuf::from)
                .unwrap_or_else(|| hf_home.join("token")),
            cache_dir: var("HF_HUB_CACHE")
                .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
                .map(PathBuf::from)
                .unwrap_or_else(|| hf_home.join("hub")),
            offline: truthy(lookup("HF_HUB_OFFLINE")),
            disable_progress: truthy(lookup("HF_HUB_DISABLE_PROGRESS_BARS")),
        }
    }

    /// Settings from the process environment.
    pub fn from_process() -> Self {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Settings with no variable set, rooted at `hf_home` (for tests and embedding).
    pub fn isolated(hf_home: impl Into<PathBuf>) -> Self {
        let hf_home = hf_home.into();
        Self::from_lookup(|name| {
            (name == "HF_HOME").then(|| hf_home.to_string_lossy().into_owned())
        })
    }

    /// The token to send: the explicit one, else `HF_TOKEN`, else the token file.
    pub fn resolve_token(&self, explicit: Option<&str>) -> Option<String> {
        if let Some(token) = explicit.map(str::trim).filter(|t| !t.is_empty()) {
            return Some(token.to_string());
        }
        if let Some(token) = &self.token {
            return Some(token.clone());
        }
        std::fs::read_to_string(&self.token_path)
            .ok()
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
    }

    /// The endpoint to use: the explicit one, else `HF_ENDPOINT`.
    pub fn resolve_endpoint(&self, explicit: Option<&str>) -> String {
        explicit
            .map(|e| e.trim().trim_end_matches('/').to_string())
            .filter(|e| !e.is_empty())
            .unwrap_or_else(|| self.endpoint.clone())
    }
}
