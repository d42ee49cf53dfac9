//! Git LFS uploads as `huggingface_hub/lfs.py` does them: the batch endpoint
//! says where to PUT each object (one part, or S3-style multipart), then the
//! optional verify action confirms it.

use std::collections::BTreeMap;
use std::io::Read;

use serde::Deserialize;

use crate::hub::error::HubError;
use crate::hub::http::{ErrorContext, HubClient, read_json};
use crate::hub::progress::bytes_bar;
use crate::hub::repo::RepoType;
use crate::hub::upload_info::UploadFile;

const LFS_JSON: &str = "application/vnd.git-lfs+json";

#[derive(Debug, Deserialize)]
struct BatchResponse {
    #[serde(default)]
    objects: Vec<BatchObject>,
}

#[derive(Debug, Deserialize)]
struct BatchObject {
    oid: String,
    #[serde(default)]
    actions: Option<Actions>,
    #[serde(default)]
    error: Option<BatchError>,
}

#[derive(Debug, Deserialize)]
struct BatchError {
    #[serde(default)]
    code: Option<i64>,
    #[serde(default)]
    message: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Actions {
    upload: Option<Action>,
    verify: Option<Action>,
}

#[derive(Debug, Deserialize)]
struct Action {
    href: String,
    #[serde(default)]
    header: BTreeMap<String, serde_json::Value>,
}

fn header_str(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// Uploads the LFS files of a commit; returns how many were actually sent
/// (objects the Hub already has are skipped).
pub fn upload_lfs_files(
    client: &HubClient,
    repo_id: &str,
    repo_type: RepoType,
    revision: &str,
    files: &[&UploadFile],
    progress: bool,
) -> Result<usize, HubError> {
    let mut sent = 0;
    for chunk in files.chunks(256) {
        let objects = batch(client, repo_id, repo_type, revision, chunk)?;
        for file in chunk {
            let object = objects
                .iter()
                .find(|o| o.oid == file.sha256)
                .ok_or_else(|| HubError::Lfs {
                    path: file.path_in_repo.clone(),
                    detail: "the LFS batch response does not mention this file".into(),
                })?;
            if let Some(error) = &object.error {
                return Err(HubError::Lfs {
                    path: file.path_in_repo.clone(),
                    detail: format!(
                        "the Hub refused it (code {}): {}",
                        error.code.unwrap_or_default(),
                        error.message.as_deref().unwrap_or("no message")
                    ),
                });
            }
            let Some(actions) = &object.actions else {
                continue; // already stored upstream
            };
            if let Some(upload) = &actions.upload {
                upload_object(client, file, upload, progress)?;
                sent += 1;
            }
            if let Some(verify) = &actions.verify {
                verify_object(client, file, verify)?;
            }
        }
    }
    Ok(sent)
}

fn batch(
    client: &HubClient,
    repo_id: &str,
    repo_type: RepoType,
    revision: &str,
    files: &[&UploadFile],
) -> Result<Vec<BatchObject>, HubError> {
    let url = format!(
        "{}/{}{}.git/info/lfs/objects/batch",
        client.endpoint(),
        repo_type.url_prefix(),
        repo_id
    );
    let payload = serde_json::json!({
        "operation": "upload",
        "transfers": ["basic", "multipart"],
        "objects": files.iter().map(|f| serde_json::json!({"oid": f.sha256, "size": f.size})).collect::<Vec<_>>(),
        "hash_algo": "sha256",
        "ref": {"name": revision},
    });
    let ctx = ErrorContext {
        repo: repo_id.to_string(),
        revision: Some(revision.to_string()),
        write: true,
        ..ErrorContext::default()
    };
    let response = client
        .request("POST", &url)
        .set("Accept", LFS_JSON)
        .set("Content-Type", LFS_JSON)
        .send_string(&payload.to_string())
        .map_err(|e| client.error(e, "POST", &url, &ctx))?;
    let parsed: BatchResponse = read_json(response, &url)?;
    Ok(parsed.objects)
}

fn lfs_error(file: &UploadFile, what: &str, err: ureq::Error) -> HubError {
    let detail = match err {
        ureq::Error::Status(status, response) => {
            let mut body = String::new();
            let _ = response.into_reader().take(2048).read_to_string(&mut body);
            format!("{what} returned HTTP {status}: {}", body.trim())
        }
        ureq::Error::Transport(t) => format!("{what} failed: {t}"),
    };
    HubError::Lfs {
        path: file.path_in_repo.clone(),
        detail,
    }
}

fn upload_object(
    client: &HubClient,
    file: &UploadFile,
    action: &Action,
    progress: bool,
) -> Result<(), HubError> {
    let bar = bytes_bar(progress, Some(file.size), &file.path_in_repo);
    let result = match action.header.get("chunk_size").and_then(header_str) {
        None => {
            // Single part: the href is pre-signed, the token is not sent.
            let reader = Counting {
                inner: file.reader_at(0, file.size)?,
                bar: &bar,
            };
            client
                .request_anonymous("PUT", &action.href)
                .set("Content-Length", &file.size.to_string())
                .send(reader)
                .map(|_| ())
                .map_err(|e| lfs_error(file, "the upload", e))
        }
        Some(chunk_size) => multipart(client, file, action, &chunk_size, &bar),
    };
    bar.finish_and_clear();
    result
}

fn multipart(
    client: &HubClient,
    file: &UploadFile,
    action: &Action,
    chunk_size: &str,
    bar: &indicatif::ProgressBar,
) -> Result<(), HubError> {
    let chunk_size: u64 = chunk_size
        .trim()
        .parse()
        .ok()
        .filter(|&c| c > 0)
        .ok_or_else(|| HubError::Lfs {
            path: file.path_in_repo.clone(),
            detail: format!("invalid chunk_size {chunk_size:?} in the LFS batch response"),
        })?;
    let mut parts: Vec<(u64, String)> = action
        .header
        .iter()
        .filter(|(key, _)| !key.is_empty() && key.bytes().all(|b| b.is_ascii_digit()))
        .filter_map(|(key, url)| Some((key.parse().ok()?, header_str(url)?)))
        .collect();
    parts.sort();
    let expected = file.size.div_ceil(chunk_size);
    if parts.len() as u64 != expected {
        return Err(HubError::Lfs {
            path: file.path_in_repo.clone(),
            detail: format!(
                "the Hub gave {} part URLs for {expected} chunks of {chunk_size} bytes",
                parts.len()
            ),
        });
    }
    let mut etags = Vec::with_capacity(parts.len());
    for (index, (_, url)) in parts.iter().enumerate() {
        let offset = index as u64 * chunk_size;
        let len = chunk_size.min(file.size - offset);
        let reader = Counting {
            inner: file.reader_at(offset, len)?,
            bar,
        };
        let response = client
            .request_anonymous("PUT", url)
            .set("Content-Length", &len.to_string())
            .send(reader)
            .map_err(|e| lfs_error(file, &format!("part {}", index + 1), e))?;
        let etag = response.header("ETag").unwrap_or_default().to_string();
        etags.push(serde_json::json!({"partNumber": index + 1, "etag": etag}));
    }
    let completion = serde_json::json!({"oid": file.sha256, "parts": etags});
    client
        .request_anonymous("POST", &action.href)
        .set("Accept", LFS_JSON)
        .set("Content-Type", LFS_JSON)
        .send_string(&completion.to_string())
        .map(|_| ())
        .map_err(|e| lfs_error(file, "completing the multipart upload", e))
}

fn verify_object(client: &HubClient, file: &UploadFile, action: &Action) -> Result<(), HubError> {
    let mut request = client.request("POST", &action.href);
    for (key, value) in &action.header {
        if let Some(value) = header_str(value) {
            request = request.set(key, &value);
        }
    }
    request
        .send_json(serde_json::json!({"oid": file.sha256, "size": file.size}))
        .map(|_| ())
        .map_err(|e| lfs_error(file, "the verification", e))
}

struct Counting<'a> {
    inner: Box<dyn Read + Send>,
    bar: &'a indicatif::ProgressBar,
}

impl Read for Counting<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.bar.inc(n as u64);
        Ok(n)
    }
}
