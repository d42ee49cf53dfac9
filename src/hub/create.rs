//! `POST {endpoint}/api/repos/create`, accepting an existing repo.

use crate::hub::api::repo_exists;
use crate::hub::error::HubError;
use crate::hub::http::{ErrorContext, HubClient};
use crate::hub::repo::RepoType;

/// Creates the repo; `Ok(false)` when it already existed (409, or a 403 on a
/// namespace the token cannot create in while the repo is visible), as
/// `create_repo(exist_ok=True)` does. `private` only applies to a new repo.
pub fn create_repo(
    client: &HubClient,
    repo_id: &str,
    repo_type: RepoType,
    private: bool,
) -> Result<bool, HubError> {
    let url = format!("{}/api/repos/create", client.endpoint());
    let (organization, name) = match repo_id.split_once('/') {
        Some((org, name)) => (Some(org), name),
        None => (None, repo_id),
    };
    let mut body = serde_json::json!({
        "name": name,
        "private": private,
        "type": repo_type.as_str(),
    });
    if let Some(org) = organization {
        body["organization"] = serde_json::Value::String(org.to_string());
    }
    let ctx = ErrorContext {
        repo: repo_id.to_string(),
        write: true,
        ..ErrorContext::default()
    };
    match client.request("POST", &url).send_json(body) {
        Ok(_) => Ok(true),
        Err(ureq::Error::Status(409, _)) => Ok(false),
        Err(ureq::Error::Status(403, response)) => {
            if repo_exists(client, repo_id, repo_type)? {
                Ok(false)
            } else {
                Err(client.error(ureq::Error::Status(403, response), "POST", &url, &ctx))
            }
        }
        Err(e) => Err(client.error(e, "POST", &url, &ctx)),
    }
}
