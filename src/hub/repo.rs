//! Repo ids, repo types and URL pieces shared by download and push.

use crate::hub::error::HubError;

/// The kind of Hub repo.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RepoType {
    #[default]
    Model,
    Dataset,
}

impl RepoType {
    /// `model` / `dataset`, as the API spells it (`/api/{type}s/...`).
    pub fn as_str(self) -> &'static str {
        match self {
            RepoType::Model => "model",
            RepoType::Dataset => "dataset",
        }
    }

    /// Prefix of the repo in file URLs (`{endpoint}/{prefix}{repo}/resolve/...`).
    pub fn url_prefix(self) -> &'static str {
        match self {
            RepoType::Model => "",
            RepoType::Dataset => "datasets/",
        }
    }
}

/// Checks a repo id the way `huggingface_hub.utils.validate_repo_id` does.
pub fn validate_repo_id(repo_id: &str) -> Result<(), HubError> {
    let fail = |reason: &str| {
        Err(HubError::InvalidRepoId {
            repo_id: repo_id.to_string(),
            reason: reason.to_string(),
        })
    };
    let parts: Vec<&str> = repo_id.split('/').collect();
    if parts.len() > 2 {
        return fail("more than one '/'");
    }
    for part in &parts {
        if part.is_empty() {
            return fail("empty namespace or name");
        }
        if !part
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return fail("only letters, digits, '-', '_' and '.' are allowed");
        }
        if part.starts_with(['-', '.']) || part.ends_with(['-', '.']) {
            return fail("parts cannot start or end with '-' or '.'");
        }
    }
    if repo_id.contains("--") || repo_id.contains("..") {
        return fail("'--' and '..' are forbidden");
    }
    if parts.last().is_some_and(|name| name.len() > 96) {
        return fail("the name is longer than 96 characters");
    }
    if repo_id.ends_with(".git") {
        return fail("it cannot end with .git");
    }
    Ok(())
}

/// Percent-encodes a URL path piece; `/` is kept when `keep_slash` (file paths)
/// and encoded otherwise (revisions such as `refs/pr/1`), like Python's `quote`.
pub fn encode_path(value: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        let keep = byte.is_ascii_alphanumeric()
            || matches!(byte, b'-' | b'_' | b'.' | b'~')
            || (keep_slash && byte == b'/');
        if keep {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// True for a full 40-hex-digit commit id.
pub fn is_commit_hash(revision: &str) -> bool {
    revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit())
}
