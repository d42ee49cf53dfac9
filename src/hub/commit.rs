//! The commit API: `preupload` (regular vs LFS per file) and the NDJSON
//! `commit` call, in the wire format of `huggingface_hub/_commit_api.py`.

use std::collections::HashMap;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::Deserialize;

use crate::hub::error::HubError;
use crate::hub::http::{ErrorContext, HubClient, read_json};
use crate::hub::repo::{RepoType, encode_path};
use crate::hub::upload_info::UploadFile;

/// How the Hub wants a file: inline in the commit, or through LFS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadMode {
    Regular,
    Lfs,
}

/// Preupload verdict for one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preupload {
    pub mode: UploadMode,
    /// Matched the repo's `.gitignore`: left out of the commit.
    pub should_ignore: bool,
}

#[derive(Debug, Deserialize)]
struct PreuploadResponse {
    files: Vec<PreuploadFile>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PreuploadFile {
    path: String,
    upload_mode: String,
    #[serde(default)]
    should_ignore: bool,
}

/// Where a commit is pushed.
#[derive(Debug, Clone)]
pub struct CommitTarget<'a> {
    pub repo_id: &'a str,
    pub repo_type: RepoType,
    pub revision: &'a str,
    pub create_pr: bool,
}

impl CommitTarget<'_> {
    fn url(&self, client: &HubClient, action: &str) -> String {
        let mut url = format!(
            "{}/api/{}s/{}/{action}/{}",
            client.endpoint(),
            self.repo_type.as_str(),
            self.repo_id,
            encode_path(self.revision, false)
        );
        if self.create_pr {
            url.push_str("?create_pr=1");
        }
        url
    }

    fn ctx(&self) -> ErrorContext {
        ErrorContext {
            repo: self.repo_id.to_string(),
            revision: Some(self.revision.to_string()),
            path: None,
            write: true,
        }
    }
}

/// Asks the Hub how each file must be uploaded (256 files per request).
pub fn preupload(
    client: &HubClient,
    target: &CommitTarget<'_>,
    files: &[UploadFile],
) -> Result<HashMap<String, Preupload>, HubError> {
    let url = target.url(client, "preupload");
    let mut modes = HashMap::new();
    for chunk in files.chunks(256) {
        let payload = serde_json::json!({
            "files": chunk.iter().map(|f| serde_json::json!({
                "path": f.path_in_repo,
                "sample": BASE64.encode(&f.sample),
                "size": f.size,
            })).collect::<Vec<_>>(),
        });
        let response = client
            .request("POST", &url)
            .send_json(payload)
            .map_err(|e| client.error(e, "POST", &url, &target.ctx()))?;
        let parsed: PreuploadResponse = read_json(response, &url)?;
        for file in parsed.files {
            let mode = match file.upload_mode.as_str() {
                "lfs" => UploadMode::Lfs,
                "regular" => UploadMode::Regular,
                other => {
                    return Err(HubError::InvalidResponse {
                        url,
                        detail: format!("unknown uploadMode {other:?} for {}", file.path),
                    });
                }
            };
            modes.insert(
                file.path,
                Preupload {
                    mode,
                    should_ignore: file.should_ignore,
                },
            );
        }
    }
    for file in files {
        if !modes.contains_key(&file.path_in_repo) {
            return Err(HubError::InvalidResponse {
                url,
                detail: format!(
                    "the preupload answer does not mention {}",
                    file.path_in_repo
                ),
            });
        }
    }
    Ok(modes)
}

/// The NDJSON body: a header line, then one `file` (inline base64) or
/// `lfsFile` (sha256 oid + size) line per file.
pub fn commit_payload(
    summary: &str,
    description: &str,
    files: &[(&UploadFile, UploadMode)],
) -> Result<Vec<u8>, HubError> {
    let mut body = Vec::new();
    let mut push = |value: serde_json::Value| {
        body.extend_from_slice(value.to_string().as_bytes());
        body.push(b'\n');
    };
    push(serde_json::json!({
        "key": "header",
        "value": {"summary": summary, "description": description},
    }));
    for (file, mode) in files {
        push(match mode {
            UploadMode::Regular => serde_json::json!({
                "key": "file",
                "value": {
                    "content": BASE64.encode(file.read_all()?),
                    "path": file.path_in_repo,
                    "encoding": "base64",
                },
            }),
            UploadMode::Lfs => serde_json::json!({
                "key": "lfsFile",
                "value": {
                    "path": file.path_in_repo,
                    "algo": "sha256",
                    "oid": file.sha256,
                    "size": file.size,
                },
            }),
        });
    }
    Ok(body)
}

/// What the Hub answers to a commit.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CommitInfo {
    #[serde(default)]
    pub commit_url: Option<String>,
    #[serde(default)]
    pub commit_oid: Option<String>,
    #[serde(default)]
    pub pull_request_url: Option<String>,
}

/// Posts the commit.
pub fn create_commit(
    client: &HubClient,
    target: &CommitTarget<'_>,
    body: Vec<u8>,
) -> Result<CommitInfo, HubError> {
    let url = target.url(client, "commit");
    let response = client
        .request("POST", &url)
        .set("Content-Type", "application/x-ndjson")
        .send_bytes(&body)
        .map_err(|e| client.error(e, "POST", &url, &target.ctx()))?;
    read_json(response, &url)
}
