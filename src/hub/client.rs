//! The Hub client: hf-hub 1.0's blocking client, configured from tune's environment
//! ([`HubEnv`](crate::hub::HubEnv): token, endpoint, cache), and its errors turned into
//! [`HubError`]s that say what to do.
//!
//! The blocking client runs its own tokio runtime, so tune's callers (the CLI, a recipe's
//! epilogue) stay synchronous; none of them runs inside an async runtime.

use std::path::Path;

use hf_hub::{HFClientBuilder, HFClientSync, HFError};

use crate::hub::error::HubError;

/// How often a transient failure (connection refused, 5xx, timeout) is retried. hf-hub's
/// default is 5 with exponential backoff; 3 keeps an unreachable Hub's error under a second.
const RETRIES: usize = 3;

/// What an operation talks to, for its error messages.
pub struct Context<'a> {
    pub repo: &'a str,
    pub revision: &'a str,
    pub endpoint: &'a str,
    /// Where files are written (a download) or read from (a push), for I/O errors.
    pub local: &'a Path,
    /// "write into" or "read from".
    pub local_action: &'static str,
}

/// A client for `endpoint` with `token` (none: anonymous), caching under `cache_dir`.
pub fn connect(
    endpoint: &str,
    token: Option<String>,
    cache_dir: &Path,
) -> Result<HFClientSync, HubError> {
    if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
        return Err(HubError::InvalidEndpoint {
            endpoint: endpoint.to_string(),
            cause: "the scheme must be http or https".into(),
        });
    }
    let mut builder = HFClientBuilder::new()
        .endpoint(endpoint)
        .cache_dir(cache_dir)
        .retry_max_attempts(RETRIES)
        .user_agent(format!("tune/{}", env!("CARGO_PKG_VERSION")));
    if let Some(token) = token {
        builder = builder.token(token);
    }
    builder.build_sync().map_err(|e| match e {
        HFError::Url(cause) => HubError::InvalidEndpoint {
            endpoint: endpoint.to_string(),
            cause: cause.to_string(),
        },
        other => HubError::InvalidEndpoint {
            endpoint: endpoint.to_string(),
            cause: other.to_string(),
        },
    })
}

/// `org/name` -> ("org", "name"); a bare name has no owner.
pub fn split(repo_id: &str) -> (&str, &str) {
    hf_hub::split_id(repo_id)
}

/// The Hub's `X-Error-Code` of a failed request (`RepoNotFound`, `GatedRepo`, ...), which
/// says more than the status: hf-hub maps a 404 by the endpoint it called, so a missing repo
/// asked for a revision reads as a missing revision.
fn error_code(e: &HFError) -> Option<&str> {
    match e {
        HFError::Http { context }
        | HFError::AuthRequired { context }
        | HFError::Forbidden { context }
        | HFError::Conflict { context }
        | HFError::RateLimited { context, .. } => context.error_code.as_deref(),
        HFError::RepoNotFound { context, .. }
        | HFError::RevisionNotFound { context, .. }
        | HFError::EntryNotFound { context, .. } => {
            context.as_ref().and_then(|c| c.error_code.as_deref())
        }
        _ => None,
    }
}

/// What went wrong, in the terms the user can act on.
pub fn error(e: HFError, cx: &Context<'_>) -> HubError {
    match error_code(&e) {
        Some("GatedRepo") => {
            return HubError::Gated {
                repo: cx.repo.to_string(),
                endpoint: cx.endpoint.to_string(),
            };
        }
        Some("RepoNotFound") => {
            return HubError::RepoNotFound {
                repo: cx.repo.to_string(),
            };
        }
        Some("RevisionNotFound") => {
            return HubError::RevisionNotFound {
                repo: cx.repo.to_string(),
                revision: cx.revision.to_string(),
            };
        }
        _ => {}
    }
    match e {
        HFError::AuthRequired { .. } => HubError::AuthFailed,
        HFError::Forbidden { context } => HubError::Forbidden {
            repo: cx.repo.to_string(),
            detail: context
                .server_message
                .clone()
                .unwrap_or_else(|| format!("HTTP {}", context.status)),
        },
        HFError::RepoNotFound { .. } => HubError::RepoNotFound {
            repo: cx.repo.to_string(),
        },
        HFError::RevisionNotFound { .. } => HubError::RevisionNotFound {
            repo: cx.repo.to_string(),
            revision: cx.revision.to_string(),
        },
        HFError::EntryNotFound { path, .. } => HubError::EntryNotFound {
            repo: cx.repo.to_string(),
            revision: cx.revision.to_string(),
            path,
        },
        HFError::Request { source, .. } if source.is_connect() || source.is_timeout() => {
            HubError::Unreachable {
                endpoint: cx.endpoint.to_string(),
                cause: root_cause(&source),
            }
        }
        HFError::Http { context }
        | HFError::Conflict { context }
        | HFError::RateLimited { context, .. } => HubError::Http {
            url: context.url.clone(),
            status: context.status.as_u16(),
            message: context
                .server_message
                .clone()
                .unwrap_or_else(|| context.body.chars().take(200).collect()),
        },
        HFError::Io(source) => HubError::Io {
            action: cx.local_action,
            path: cx.local.to_path_buf(),
            source,
        },
        other => HubError::InvalidResponse {
            url: cx.endpoint.to_string(),
            detail: other.to_string(),
        },
    }
}

/// The innermost cause of a transport error ("Connection refused (os error 111)").
fn root_cause(e: &dyn std::error::Error) -> String {
    let mut cause = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        cause = s.to_string();
        source = s.source();
    }
    cause
}
