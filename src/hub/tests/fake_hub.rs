//! A fake Hub for the test server: repo listing, resolve (HEAD/GET with
//! Range, LFS files redirected to a "CDN" path), and the push endpoints.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use sha2::{Digest, Sha256};

use super::support::{Request, Response, TestServer};

pub const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
pub const GOOD_TOKEN: &str = "hf_good";

#[derive(Default, Clone)]
pub struct FakeRepo {
    pub files: Vec<(String, Vec<u8>)>,
    pub gated: bool,
    /// When set, requests need `Bearer <token>`.
    pub token: Option<String>,
    /// The next LFS download sends only this many bytes, then closes (an interrupted
    /// transfer); later ones are whole.
    pub cut_lfs_after: Option<usize>,
    /// LFS downloads send the right length with one byte flipped.
    pub corrupt_lfs: bool,
}

#[derive(Default)]
pub struct State {
    /// Keyed by "models/org/name" or "datasets/org/name".
    pub repos: HashMap<String, FakeRepo>,
    pub created: Vec<serde_json::Value>,
    pub preupload: Vec<serde_json::Value>,
    pub lfs_store: HashMap<String, Vec<u8>>,
    pub parts: HashMap<(String, usize), Vec<u8>>,
    /// Files as committed: path → bytes.
    pub committed: HashMap<String, Vec<u8>>,
    pub commit_lines: Vec<serde_json::Value>,
    pub commit_targets: Vec<String>,
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

pub fn is_lfs(path: &str) -> bool {
    path.ends_with(".safetensors") || path.ends_with(".bin")
}

/// Starts a server with the given repos; returns it and the shared state.
pub fn start(repos: Vec<(&str, FakeRepo)>) -> (TestServer, Arc<Mutex<State>>) {
    let state = Arc::new(Mutex::new(State {
        repos: repos.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        ..State::default()
    }));
    let shared = state.clone();
    let server = TestServer::start(move |req| {
        let mut state = shared.lock().expect("state lock");
        handle(&mut state, req)
    });
    (server, state)
}

fn not_found(message: &str) -> Response {
    let response = Response::json(404, serde_json::json!({"error": message}));
    // The Hub names what is missing in X-Error-Code.
    if message == "Repository not found" {
        response.header("X-Error-Code", "RepoNotFound")
    } else {
        response
    }
}

/// Splits "/api/models/org/name/revision/main" style paths.
fn split_repo<'a>(rest: &'a str, marker: &str) -> Option<(&'a str, &'a str)> {
    let idx = rest.find(marker)?;
    Some((&rest[..idx], &rest[idx + marker.len()..]))
}

fn decode(s: &str) -> String {
    s.replace("%2F", "/").replace("%20", " ")
}

fn access(repo: &FakeRepo, req: &Request) -> Option<Response> {
    if let Some(token) = &repo.token {
        let expected = format!("Bearer {token}");
        if req.header("authorization") != Some(expected.as_str()) {
            return Some(Response::json(
                401,
                serde_json::json!({"error": "Invalid credentials in Authorization header"}),
            ));
        }
    }
    if repo.gated {
        return Some(
            Response::json(
                403,
                serde_json::json!({"error": "Access to model is restricted"}),
            )
            .header("X-Error-Code", "GatedRepo")
            .header(
                "X-Error-Message",
                "Access to model is restricted and you are not in the authorized list",
            ),
        );
    }
    None
}

/// The repo `repo_key` at `rev`, or the response the Hub gives when it is missing, refused or
/// at an unknown revision.
fn readable<'a>(
    state: &'a State,
    repo_key: &str,
    rev: &str,
    req: &Request,
) -> Result<&'a FakeRepo, Response> {
    let Some(repo) = state.repos.get(repo_key) else {
        return Err(not_found("Repository not found"));
    };
    if let Some(denied) = access(repo, req) {
        return Err(denied);
    }
    let rev = decode(rev);
    if rev != "main" && rev != COMMIT {
        return Err(
            Response::json(404, serde_json::json!({"error": "Invalid rev id"}))
                .header("X-Error-Code", "RevisionNotFound"),
        );
    }
    Ok(repo)
}

fn handle(state: &mut State, req: &Request) -> Response {
    let path = req.path().to_string();
    let base = req.base_url();
    // Repo info, and the tree listing hf-hub 1.0 lists a snapshot's files with (one page).
    for endpoint in ["/revision/", "/tree/"] {
        if let Some(rest) = path.strip_prefix("/api/")
            && let Some((repo_key, rev)) = split_repo(rest, endpoint)
            && req.method == "GET"
        {
            let repo = match readable(state, repo_key, rev, req) {
                Ok(repo) => repo,
                Err(refused) => return refused,
            };
            if endpoint == "/tree/" {
                let entries: Vec<_> = repo
                    .files
                    .iter()
                    .map(|(p, b)| {
                        serde_json::json!({"type": "file", "path": p, "size": b.len(), "oid": sha256_hex(b)})
                    })
                    .collect();
                return Response::json(200, serde_json::Value::Array(entries));
            }
            let siblings: Vec<_> = repo
                .files
                .iter()
                .map(|(p, _)| serde_json::json!({"rfilename": p}))
                .collect();
            return Response::json(
                200,
                serde_json::json!({"sha": COMMIT, "siblings": siblings}),
            );
        }
    }
    // LFS "CDN" with Range support.
    if let Some(oid) = path.strip_prefix("/cdn/") {
        let found = state.repos.values_mut().find_map(|r| {
            let bytes = r
                .files
                .iter()
                .find(|(_, b)| sha256_hex(b) == oid)?
                .1
                .clone();
            Some((r, bytes))
        });
        let Some((repo, mut bytes)) = found else {
            return not_found("no such object");
        };
        if let Some(cut) = repo.cut_lfs_after.take() {
            let total = bytes.len();
            bytes.truncate(cut);
            return Response::bytes(200, bytes).header("Content-Length", &total.to_string());
        }
        if repo.corrupt_lfs {
            bytes[0] ^= 0xff;
        }
        return ranged(req, bytes);
    }
    // Resolve (HEAD / GET).
    if (req.method == "HEAD" || req.method == "GET")
        && let Some((repo_path, rest)) = split_repo(&path, "/resolve/")
    {
        let key = match repo_path.strip_prefix("/datasets/") {
            Some(id) => format!("datasets/{id}"),
            None => format!("models/{}", &repo_path[1..]),
        };
        let Some(repo) = state.repos.get(&key) else {
            return not_found("Repository not found");
        };
        if let Some(denied) = access(repo, req) {
            return denied;
        }
        let Some((rev, file)) = rest.split_once('/') else {
            return not_found("bad path");
        };
        if decode(rev) != COMMIT && decode(rev) != "main" {
            return not_found("Invalid rev id").header("X-Error-Code", "RevisionNotFound");
        }
        let file = decode(file);
        let Some((_, bytes)) = repo.files.iter().find(|(p, _)| *p == file) else {
            return not_found("Entry not found").header("X-Error-Code", "EntryNotFound");
        };
        if is_lfs(&file) {
            let oid = sha256_hex(bytes);
            return Response::bytes(302, Vec::new())
                .header("Location", &format!("{base}/cdn/{oid}"))
                .header("X-Repo-Commit", COMMIT)
                .header("X-Linked-Etag", &format!("\"{oid}\""))
                .header("X-Linked-Size", &bytes.len().to_string());
        }
        let etag = format!("git{}", &sha256_hex(bytes)[..37]);
        return ranged(req, bytes.clone())
            .header("X-Repo-Commit", COMMIT)
            .header("ETag", &format!("\"{etag}\""));
    }
    // Push endpoints.
    if path == "/api/repos/create" && req.method == "POST" {
        let body: serde_json::Value = serde_json::from_slice(&req.body).unwrap_or_default();
        state.created.push(body.clone());
        let id = match body.get("organization").and_then(|o| o.as_str()) {
            Some(org) => format!("{org}/{}", body["name"].as_str().unwrap_or("")),
            None => body["name"].as_str().unwrap_or("").to_string(),
        };
        let key = format!("models/{id}");
        if state.repos.contains_key(&key) {
            return Response::json(
                409,
                serde_json::json!({"error": "You already created this model repo"}),
            );
        }
        state.repos.insert(key, FakeRepo::default());
        return Response::json(200, serde_json::json!({"url": format!("{base}/{id}")}));
    }
    if let Some(rest) = path.strip_prefix("/api/models/")
        && let Some((_, _rev)) = split_repo(rest, "/preupload/")
    {
        let body: serde_json::Value = serde_json::from_slice(&req.body).unwrap_or_default();
        state.preupload.push(body.clone());
        let files: Vec<_> = body["files"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|f| {
                let p = f["path"].as_str().unwrap_or("");
                let mode = if is_lfs(p) { "lfs" } else { "regular" };
                serde_json::json!({"path": p, "uploadMode": mode, "shouldIgnore": false})
            })
            .collect();
        return Response::json(200, serde_json::json!({"files": files}));
    }
    if path.ends_with(".git/info/lfs/objects/batch") {
        let body: serde_json::Value = serde_json::from_slice(&req.body).unwrap_or_default();
        let objects: Vec<_> = body["objects"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|o| {
                let oid = o["oid"].as_str().unwrap_or("").to_string();
                let size = o["size"].as_u64().unwrap_or(0);
                let upload = if size > 1500 {
                    let mut header = serde_json::json!({"chunk_size": "1000"});
                    for n in 1..=size.div_ceil(1000) {
                        header[format!("{n:05}")] =
                            serde_json::Value::String(format!("{base}/lfs-part/{oid}/{n}"));
                    }
                    serde_json::json!({"href": format!("{base}/lfs-complete/{oid}"), "header": header})
                } else {
                    serde_json::json!({"href": format!("{base}/lfs-upload/{oid}")})
                };
                serde_json::json!({"oid": oid, "size": size, "actions": {
                    "upload": upload,
                    "verify": {"href": format!("{base}/lfs-verify/{oid}")},
                }})
            })
            .collect();
        return Response::json(
            200,
            serde_json::json!({"transfer": "basic", "objects": objects}),
        );
    }
    if let Some(oid) = path.strip_prefix("/lfs-upload/") {
        state.lfs_store.insert(oid.to_string(), req.body.clone());
        return Response::bytes(200, Vec::new());
    }
    if let Some(rest) = path.strip_prefix("/lfs-part/") {
        let (oid, n) = rest.split_once('/').unwrap_or((rest, "0"));
        let n: usize = n.parse().unwrap_or(0);
        state.parts.insert((oid.to_string(), n), req.body.clone());
        return Response::bytes(200, Vec::new()).header("ETag", &format!("\"etag-{n}\""));
    }
    if let Some(oid) = path.strip_prefix("/lfs-complete/") {
        let body: serde_json::Value = serde_json::from_slice(&req.body).unwrap_or_default();
        let mut bytes = Vec::new();
        for part in body["parts"].as_array().cloned().unwrap_or_default() {
            let n = part["partNumber"].as_u64().unwrap_or(0) as usize;
            assert_eq!(part["etag"], format!("\"etag-{n}\""));
            bytes.extend(
                state
                    .parts
                    .get(&(oid.to_string(), n))
                    .cloned()
                    .unwrap_or_default(),
            );
        }
        state.lfs_store.insert(oid.to_string(), bytes);
        return Response::json(200, serde_json::json!({}));
    }
    if let Some(oid) = path.strip_prefix("/lfs-verify/") {
        return match state.lfs_store.get(oid) {
            Some(bytes) if sha256_hex(bytes) == oid => Response::json(200, serde_json::json!({})),
            _ => Response::json(404, serde_json::json!({"error": "object not uploaded"})),
        };
    }
    if let Some(rest) = path.strip_prefix("/api/models/")
        && let Some((repo_id, rev)) = split_repo(rest, "/commit/")
    {
        state.commit_targets.push(req.target.clone());
        let text = String::from_utf8_lossy(&req.body).to_string();
        for line in text.lines() {
            let line: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
            state.commit_lines.push(line.clone());
            let value = &line["value"];
            let path = value["path"].as_str().unwrap_or("").to_string();
            match line["key"].as_str() {
                Some("file") => {
                    let bytes = BASE64
                        .decode(value["content"].as_str().unwrap_or(""))
                        .unwrap_or_default();
                    state.committed.insert(path, bytes);
                }
                Some("lfsFile") => {
                    let oid = value["oid"].as_str().unwrap_or("");
                    match state.lfs_store.get(oid) {
                        Some(bytes) => {
                            state.committed.insert(path, bytes.clone());
                        }
                        None => {
                            return Response::json(
                                422,
                                serde_json::json!({"error": format!("LFS object {oid} missing")}),
                            );
                        }
                    }
                }
                _ => {}
            }
        }
        let mut answer = serde_json::json!({
            "commitUrl": format!("{base}/{repo_id}/commit/{COMMIT}"),
            "commitOid": COMMIT,
        });
        if req.query().contains("create_pr=1") {
            answer["pullRequestUrl"] =
                serde_json::Value::String(format!("{base}/{repo_id}/discussions/1"));
        }
        let _ = rev;
        return Response::json(200, answer);
    }
    not_found("no route")
}

/// Serves bytes, honouring `Range: bytes=N-`.
fn ranged(req: &Request, bytes: Vec<u8>) -> Response {
    let total = bytes.len();
    if let Some(range) = req.header("range")
        && let Some(start) = range
            .strip_prefix("bytes=")
            .and_then(|r| r.split('-').next())
            .and_then(|s| s.parse::<usize>().ok())
        && start < total
    {
        return Response::bytes(206, bytes[start..].to_vec()).header(
            "Content-Range",
            &format!("bytes {start}-{}/{total}", total - 1),
        );
    }
    Response::bytes(200, bytes)
}
