//! Repo metadata: `GET {endpoint}/api/{type}s/{repo}/revision/{rev}`.

use serde::Deserialize;

use crate::hub::error::HubError;
use crate::hub::http::{ErrorContext, HubClient, read_json};
use crate::hub::repo::{RepoType, encode_path};

/// The part of the repo info the downloader needs.
#[derive(Debug, Clone, Deserialize)]
pub struct RepoInfo {
    /// The commit the revision resolves to.
    pub sha: String,
    #[serde(default)]
    pub siblings: Vec<Sibling>,
    #[serde(default)]
    pub gated: serde_json::Value,
    #[serde(default)]
    pub private: Option<bool>,
}

/// One file of the repo.
#[derive(Debug, Clone, Deserialize)]
pub struct Sibling {
    pub rfilename: String,
    #[serde(default)]
    pub size: Option<u64>,
}

/// Lists the files of `repo_id` at `revision` and the commit it resolves to.
pub fn repo_info(
    client: &HubClient,
    repo_id: &str,
    repo_type: RepoType,
    revision: &str,
) -> Result<RepoInfo, HubError> {
    let url = format!(
        "{}/api/{}s/{}/revision/{}",
        client.endpoint(),
        repo_type.as_str(),
        repo_id,
        encode_path(revision, false)
    );
    let ctx = ErrorContext {
        repo: repo_id.to_string(),
        revision: Some(revision.to_string()),
        ..ErrorContext::default()
    };
    let response = client
        .request("GET", &url)
        .call()
        .map_err(|e| client.error(e, "GET", &url, &ctx))?;
    read_json(response, &url)
}

/// True when the repo exists and the token can see it.
pub fn repo_exists(
    client: &HubClient,
    repo_id: &str,
    repo_type: RepoType,
) -> Result<bool, HubError> {
    let url = format!(
        "{}/api/{}s/{}",
        client.endpoint(),
        repo_type.as_str(),
        repo_id
    );
    match client.request("GET", &url).call() {
        Ok(_) => Ok(true),
        Err(ureq::Error::Status(401 | 404, _)) => Ok(false),
        Err(e) => Err(client.error(
            e,
            "GET",
            &url,
            &ErrorContext {
                repo: repo_id.to_string(),
                ..ErrorContext::default()
            },
        )),
    }
}
