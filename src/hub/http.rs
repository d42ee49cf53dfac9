//! The HTTP client (ureq 2, as hf-hub uses) and the mapping of Hub HTTP
//! failures onto [`HubError`].

use std::io::Read;
use std::time::Duration;

use crate::hub::error::HubError;

/// What a failing request was about, to pick the most precise error.
#[derive(Debug, Clone, Default)]
pub struct ErrorContext {
    pub repo: String,
    pub revision: Option<String>,
    /// A file path: a 404 means the file is missing, not the repo.
    pub path: Option<String>,
    /// A write (push): 403 means "no write access" rather than "gated".
    pub write: bool,
}

/// An authenticated client bound to one endpoint.
#[derive(Clone)]
pub struct HubClient {
    /// Follows redirects (file bytes may come from a CDN).
    agent: ureq::Agent,
    /// Does not follow redirects (to read `X-Repo-Commit`/`X-Linked-Etag` on the 302).
    no_redirect: ureq::Agent,
    endpoint: String,
    token: Option<String>,
}

impl std::fmt::Debug for HubClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubClient")
            .field("endpoint", &self.endpoint)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

fn is_loopback(endpoint: &str) -> bool {
    let rest = endpoint
        .split_once("://")
        .map(|(_, rest)| rest)
        .unwrap_or(endpoint);
    let host = rest.split(['/', '?']).next().unwrap_or("");
    let host = host.rsplit_once('@').map(|(_, h)| h).unwrap_or(host);
    host.starts_with("127.") || host.starts_with("localhost") || host.starts_with("[::1]")
}

impl HubClient {
    /// A client for `endpoint`; `timeout` bounds connecting and each read.
    pub fn new(endpoint: &str, token: Option<String>, timeout: Duration) -> Result<Self, HubError> {
        let endpoint = endpoint.trim_end_matches('/').to_string();
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
            return Err(HubError::InvalidEndpoint {
                endpoint,
                cause: "it must start with http:// or https://".into(),
            });
        }
        let build = |redirects: u32| {
            ureq::AgentBuilder::new()
                .timeout_connect(timeout)
                .timeout_read(timeout)
                .timeout_write(timeout)
                .redirects(redirects)
                .user_agent(concat!("tune/", env!("CARGO_PKG_VERSION"), "; hf_hub/rust"))
                // Proxies from the environment, but never for a local endpoint.
                .try_proxy_from_env(!is_loopback(&endpoint))
                .build()
        };
        Ok(HubClient {
            agent: build(5),
            no_redirect: build(0),
            endpoint,
            token,
        })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// A request to an endpoint URL, with the token attached.
    pub fn request(&self, method: &str, url: &str) -> ureq::Request {
        self.with_auth(self.agent.request(method, url))
    }

    /// Same, without following redirects.
    pub fn request_no_redirect(&self, method: &str, url: &str) -> ureq::Request {
        self.with_auth(self.no_redirect.request(method, url))
    }

    /// A request to a third-party URL (LFS storage): no token.
    pub fn request_anonymous(&self, method: &str, url: &str) -> ureq::Request {
        self.agent.request(method, url)
    }

    fn with_auth(&self, request: ureq::Request) -> ureq::Request {
        match &self.token {
            Some(token) => request.set("Authorization", &format!("Bearer {token}")),
            None => request,
        }
    }

    /// Turns a ureq failure into the most specific [`HubError`].
    pub fn error(&self, err: ureq::Error, method: &str, url: &str, ctx: &ErrorContext) -> HubError {
        map_error(err, &self.endpoint, method, url, ctx)
    }
}

/// Reads a JSON response body.
pub fn read_json<T: serde::de::DeserializeOwned>(
    response: ureq::Response,
    url: &str,
) -> Result<T, HubError> {
    let mut body = Vec::new();
    response
        .into_reader()
        .take(256 * 1024 * 1024)
        .read_to_end(&mut body)
        .map_err(|e| HubError::InvalidResponse {
            url: url.to_string(),
            detail: format!("cannot read the body: {e}"),
        })?;
    serde_json::from_slice(&body).map_err(|e| HubError::InvalidResponse {
        url: url.to_string(),
        detail: format!("invalid JSON: {e}"),
    })
}

/// The message of an error response: `X-Error-Message`, else the JSON
/// `error` field, else the start of the body.
fn error_message(response: ureq::Response) -> (Option<String>, String) {
    let code = response.header("X-Error-Code").map(str::to_string);
    let header_message = response.header("X-Error-Message").map(str::to_string);
    let mut body = String::new();
    let _ = response.into_reader().take(4096).read_to_string(&mut body);
    let message = header_message.unwrap_or_else(|| {
        serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
            .unwrap_or_else(|| body.trim().chars().take(300).collect())
    });
    (code, message)
}

/// The mapping used by [`HubClient::error`].
pub fn map_error(
    err: ureq::Error,
    endpoint: &str,
    method: &str,
    url: &str,
    ctx: &ErrorContext,
) -> HubError {
    match err {
        ureq::Error::Status(status, response) => {
            let (code, message) = error_message(response);
            let repo = ctx.repo.clone();
            let revision = ctx.revision.clone().unwrap_or_else(|| "main".into());
            match (code.as_deref(), status) {
                (Some("GatedRepo"), _) => HubError::Gated {
                    repo,
                    endpoint: endpoint.to_string(),
                },
                (Some("RepoNotFound"), _) => HubError::RepoNotFound { repo },
                (Some("RevisionNotFound"), _) => HubError::RevisionNotFound { repo, revision },
                (Some("EntryNotFound"), _) => HubError::EntryNotFound {
                    repo,
                    revision,
                    path: ctx.path.clone().unwrap_or_default(),
                },
                (_, 401) => HubError::AuthFailed,
                (_, 403) if ctx.write && !message.to_lowercase().contains("gated") => {
                    HubError::Forbidden {
                        repo,
                        detail: message,
                    }
                }
                (_, 403) => HubError::Gated {
                    repo,
                    endpoint: endpoint.to_string(),
                },
                (_, 404) => match &ctx.path {
                    Some(path) => HubError::EntryNotFound {
                        repo,
                        revision,
                        path: path.clone(),
                    },
                    None if message.to_lowercase().contains("revision") => {
                        HubError::RevisionNotFound { repo, revision }
                    }
                    None => HubError::RepoNotFound { repo },
                },
                _ => HubError::Http {
                    method: method.to_string(),
                    url: url.to_string(),
                    status,
                    message,
                },
            }
        }
        ureq::Error::Transport(transport) => match transport.kind() {
            ureq::ErrorKind::InvalidUrl | ureq::ErrorKind::UnknownScheme => {
                HubError::InvalidEndpoint {
                    endpoint: endpoint.to_string(),
                    cause: transport.to_string(),
                }
            }
            _ => {
                let mut cause = transport.kind().to_string();
                if let Some(message) = transport.message() {
                    cause = format!("{cause}: {message}");
                }
                if let Some(source) = std::error::Error::source(&transport) {
                    cause = format!("{cause}: {source}");
                }
                HubError::Unreachable {
                    endpoint: endpoint.to_string(),
                    cause,
                }
            }
        },
    }
}
