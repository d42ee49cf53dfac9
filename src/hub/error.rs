//! Every way a Hub operation can fail, each with what happened and what to do.

use std::path::PathBuf;

/// Errors of the Hub integration.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "authentication failed: the token is invalid or expired; set HF_TOKEN or pass --hf-token"
    )]
    AuthFailed,

    #[error(
        "repo {repo} is gated: accept its license at {endpoint}/{repo} and use a token with access"
    )]
    Gated { repo: String, endpoint: String },

    #[error("repo {repo} not found (or private: pass a token)")]
    RepoNotFound { repo: String },

    #[error("revision {revision} not found in repo {repo}: check the branch, tag or commit name")]
    RevisionNotFound { repo: String, revision: String },

    #[error("file {path} not found in repo {repo} at revision {revision}")]
    EntryNotFound {
        repo: String,
        revision: String,
        path: String,
    },

    #[error(
        "the token cannot write to {repo} ({detail}); use a token with write access to that namespace (https://huggingface.co/settings/tokens)"
    )]
    Forbidden { repo: String, detail: String },

    #[error(
        "pushing to {repo} needs a token with write access: set HF_TOKEN, run `hf auth login`, or pass --hf-token"
    )]
    MissingToken { repo: String },

    #[error(
        "cannot push to {repo}: HF_HUB_OFFLINE is set, and a push needs the network; unset HF_HUB_OFFLINE (or `tune push --dry-run` lists what would be uploaded)"
    )]
    OfflinePush { repo: String },

    #[error(
        "cannot reach {endpoint}: {cause}; check your network or set HF_HUB_OFFLINE=1 to use cached files"
    )]
    Unreachable { endpoint: String, cause: String },

    #[error(
        "the Hub endpoint {endpoint:?} is not a valid http(s) URL ({cause}); fix HF_ENDPOINT or --hf-endpoint"
    )]
    InvalidEndpoint { endpoint: String, cause: String },

    #[error("{url} failed with HTTP {status}: {message}")]
    Http {
        url: String,
        status: u16,
        message: String,
    },

    #[error("unexpected response from {url}: {detail}")]
    InvalidResponse { url: String, detail: String },

    #[error("invalid repo id {repo_id:?}: {reason} (expected \"name\" or \"namespace/name\")")]
    InvalidRepoId { repo_id: String, reason: String },

    #[error(
        "HF_HUB_OFFLINE=1 but {what} of {repo}@{revision} is not in the cache {cache}; run once without HF_HUB_OFFLINE to download it"
    )]
    NotCached {
        repo: String,
        revision: String,
        what: String,
        cache: PathBuf,
    },

    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "downloaded {} is corrupted (expected {expected}, got {actual}); it was deleted, run the download again",
        path.display()
    )]
    Corrupted {
        path: PathBuf,
        expected: String,
        actual: String,
    },

    #[error("{} cannot be pushed: {reason}", dir.display())]
    InvalidPushDir { dir: PathBuf, reason: String },

    #[error(
        "no data files in dataset {repo} match {patterns:?}; pass data_files naming the files to use"
    )]
    NoDataFiles { repo: String, patterns: Vec<String> },
}

impl HubError {
    /// Wraps an I/O error with the action and the path it concerned.
    pub fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| HubError::Io {
            action,
            path,
            source,
        }
    }
}
