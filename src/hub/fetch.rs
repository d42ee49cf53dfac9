//! Downloads one repo file into the cache: HEAD for the etag, then a GET that
//! resumes `blobs/<etag>.incomplete` with a `Range` request.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::path::PathBuf;

use sha2::{Digest, Sha256};

use crate::hub::cache::RepoCache;
use crate::hub::error::HubError;
use crate::hub::http::{ErrorContext, HubClient};
use crate::hub::progress::bytes_bar;
use crate::hub::repo::{RepoType, encode_path};

/// What is being fetched.
#[derive(Debug, Clone)]
pub struct FileTarget<'a> {
    pub repo_id: &'a str,
    pub repo_type: RepoType,
    /// Resolved commit id (files are always fetched at a commit).
    pub commit: &'a str,
    pub file: &'a str,
}

/// Outcome of one file fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchedFile {
    /// `snapshots/<commit>/<file>` in the cache.
    pub path: PathBuf,
    /// Bytes transferred by this call (0 when served from cache).
    pub downloaded: u64,
    /// Bytes of an earlier partial download that were kept.
    pub resumed_from: u64,
}

struct Metadata {
    etag: String,
    size: Option<u64>,
}

fn header_url(base: &str, location: &str) -> Option<String> {
    // Only relative redirects (renamed repos) are followed for metadata, like
    // huggingface_hub: an absolute one is the CDN, whose headers say nothing.
    if !location.starts_with('/') {
        return None;
    }
    let scheme_end = base.find("://")? + 3;
    let host_end = base[scheme_end..]
        .find('/')
        .map_or(base.len(), |i| scheme_end + i);
    Some(format!("{}{}", &base[..host_end], location))
}

fn metadata(client: &HubClient, url: &str, ctx: &ErrorContext) -> Result<Metadata, HubError> {
    let mut current = url.to_string();
    for _ in 0..5 {
        let response = client
            .request_no_redirect("HEAD", &current)
            .set("Accept-Encoding", "identity")
            .call()
            .map_err(|e| client.error(e, "HEAD", &current, ctx))?;
        if (300..400).contains(&response.status())
            && response.header("X-Linked-Etag").is_none()
            && let Some(next) = response
                .header("Location")
                .and_then(|l| header_url(&current, l))
        {
            current = next;
            continue;
        }
        let etag = response
            .header("X-Linked-Etag")
            .or_else(|| response.header("ETag"))
            .map(|e| {
                e.trim()
                    .trim_start_matches("W/")
                    .trim_matches('"')
                    .to_string()
            })
            .filter(|e| !e.is_empty() && !e.contains(['/', '\\']))
            .ok_or_else(|| HubError::InvalidResponse {
                url: current.clone(),
                detail: "no ETag header: the endpoint does not look like a Hugging Face Hub".into(),
            })?;
        let size = response
            .header("X-Linked-Size")
            .or_else(|| response.header("Content-Length"))
            .and_then(|s| s.trim().parse().ok());
        return Ok(Metadata { etag, size });
    }
    Err(HubError::InvalidResponse {
        url: url.to_string(),
        detail: "too many redirects".into(),
    })
}

fn is_sha256(etag: &str) -> bool {
    etag.len() == 64 && etag.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Fetches one file at a commit into the cache, reusing what is there.
pub fn fetch_file(
    client: &HubClient,
    cache: &RepoCache,
    target: &FileTarget<'_>,
    progress: bool,
) -> Result<FetchedFile, HubError> {
    let pointer = cache.pointer_path(target.commit, target.file);
    if pointer.is_file() {
        return Ok(FetchedFile {
            path: pointer,
            downloaded: 0,
            resumed_from: 0,
        });
    }
    let url = format!(
        "{}/{}{}/resolve/{}/{}",
        client.endpoint(),
        target.repo_type.url_prefix(),
        target.repo_id,
        encode_path(target.commit, false),
        encode_path(target.file, true)
    );
    let ctx = ErrorContext {
        repo: target.repo_id.to_string(),
        revision: Some(target.commit.to_string()),
        path: Some(target.file.to_string()),
        write: false,
    };
    let meta = metadata(client, &url, &ctx)?;
    let blob = cache.blob_path(&meta.etag);
    if blob.is_file() {
        let path = cache.link_pointer(target.commit, target.file, &meta.etag)?;
        return Ok(FetchedFile {
            path,
            downloaded: 0,
            resumed_from: 0,
        });
    }
    let blobs_dir = cache.dir().join("blobs");
    std::fs::create_dir_all(&blobs_dir).map_err(HubError::io("create", &blobs_dir))?;
    let incomplete = cache.incomplete_path(&meta.etag);
    let (downloaded, resumed_from) = download_to_incomplete(
        client,
        &url,
        &ctx,
        &incomplete,
        &meta,
        target.file,
        progress,
    )?;
    std::fs::rename(&incomplete, &blob).map_err(HubError::io("move into the cache", &blob))?;
    let path = cache.link_pointer(target.commit, target.file, &meta.etag)?;
    Ok(FetchedFile {
        path,
        downloaded,
        resumed_from,
    })
}

fn download_to_incomplete(
    client: &HubClient,
    url: &str,
    ctx: &ErrorContext,
    incomplete: &std::path::Path,
    meta: &Metadata,
    label: &str,
    progress: bool,
) -> Result<(u64, u64), HubError> {
    let mut start = std::fs::metadata(incomplete).map(|m| m.len()).unwrap_or(0);
    if meta.size.is_some_and(|size| start > size) {
        start = 0; // longer than the file: not a prefix of it, start over
    }
    let verify = is_sha256(&meta.etag);
    let mut hasher = Sha256::new();
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(incomplete)
        .map_err(HubError::io("open", incomplete))?;
    file.set_len(start)
        .map_err(HubError::io("truncate", incomplete))?;
    if verify && start > 0 {
        std::io::copy(&mut (&mut file).take(start), &mut HashWriter(&mut hasher))
            .map_err(HubError::io("read", incomplete))?;
    }
    let mut downloaded = 0;
    let complete = meta.size.is_some_and(|size| start == size);
    if !complete {
        let mut request = client
            .request("GET", url)
            .set("Accept-Encoding", "identity");
        if start > 0 {
            request = request.set("Range", &format!("bytes={start}-"));
        }
        let response = request
            .call()
            .map_err(|e| client.error(e, "GET", url, ctx))?;
        if start > 0 && response.status() != 206 {
            // The server ignored the range: take the whole body from the start.
            start = 0;
            hasher = Sha256::new();
            file.set_len(0)
                .map_err(HubError::io("truncate", incomplete))?;
        }
        use std::io::Seek;
        file.seek(std::io::SeekFrom::Start(start))
            .map_err(HubError::io("seek", incomplete))?;
        let bar = bytes_bar(progress, meta.size, label);
        bar.set_position(start);
        let mut reader = response.into_reader();
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            let n = reader.read(&mut buf).map_err(|e| HubError::Unreachable {
                endpoint: client.endpoint().to_string(),
                cause: format!("download of {label} interrupted: {e}; rerun to resume"),
            })?;
            if n == 0 {
                break;
            }
            file.write_all(&buf[..n])
                .map_err(HubError::io("write", incomplete))?;
            if verify {
                hasher.update(&buf[..n]);
            }
            downloaded += n as u64;
            bar.inc(n as u64);
        }
        bar.finish_and_clear();
    }
    file.flush().map_err(HubError::io("write", incomplete))?;
    drop(file);
    let total = start + downloaded;
    if let Some(size) = meta.size
        && total != size
    {
        return Err(HubError::Unreachable {
            endpoint: client.endpoint().to_string(),
            cause: format!(
                "download of {label} stopped at {total} of {size} bytes; rerun to resume"
            ),
        });
    }
    if verify {
        let actual = format!("{:x}", hasher.finalize());
        if actual != meta.etag {
            let _ = std::fs::remove_file(incomplete);
            return Err(HubError::Corrupted {
                path: incomplete.to_path_buf(),
                expected: format!("sha256 {}", meta.etag),
                actual: format!("sha256 {actual}"),
            });
        }
    }
    Ok((downloaded, start))
}

struct HashWriter<'a>(&'a mut Sha256);

impl Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
