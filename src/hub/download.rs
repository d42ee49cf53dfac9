//! `hf download`: hf-hub 1.0's `snapshot_download` into the standard HF cache (resolving the
//! revision, filtering with allow/ignore patterns, resuming partial files, Xet or plain
//! transfers), then, with `--output-dir`, hard links to the files there and a record of where
//! they came from ([`provenance`](crate::hub::provenance)).

use std::path::{Path, PathBuf};

use hf_hub::{HFError, HFRepositorySync, RepoType as HfRepoType};

use crate::hub::client::{Context, connect, error, split};
use crate::hub::env::HubEnv;
use crate::hub::error::HubError;
use crate::hub::patterns::{is_literal, is_selected, normalize};
use crate::hub::progress::TransferBar;
use crate::hub::repo::{RepoType, validate_repo_id};

/// What to download. `None` fields fall back to the environment
/// (`HF_TOKEN`/token file, `HF_ENDPOINT`, `HF_HUB_CACHE`/`HF_HOME`, `HF_HUB_OFFLINE`).
#[derive(Debug, Clone, Default)]
pub struct DownloadOptions {
    pub repo_id: String,
    pub repo_type: RepoType,
    /// Branch, tag or commit; default `main`.
    pub revision: Option<String>,
    /// Also place the files here (hard links to the cache blobs, else copies).
    pub output_dir: Option<PathBuf>,
    /// Only files matching one of these globs (all files when empty).
    pub allow_patterns: Vec<String>,
    /// Skip files matching any of these globs (e.g. `*.pth`, `original/*`).
    pub ignore_patterns: Vec<String>,
    pub token: Option<String>,
    pub endpoint: Option<String>,
    pub cache_dir: Option<PathBuf>,
    /// Serve from the cache only; `None` reads `HF_HUB_OFFLINE`.
    pub offline: Option<bool>,
    /// Show progress bars (also off with `HF_HUB_DISABLE_PROGRESS_BARS`).
    pub progress: bool,
}

impl DownloadOptions {
    pub fn new(repo_id: impl Into<String>) -> Self {
        DownloadOptions {
            repo_id: repo_id.into(),
            ..Self::default()
        }
    }
}

/// What a download did.
#[derive(Debug, Clone)]
pub struct DownloadReport {
    pub repo_id: String,
    /// The commit the revision resolved to.
    pub commit: String,
    /// `snapshots/<commit>` in the cache.
    pub snapshot_dir: PathBuf,
    /// Where the files are: in `output_dir` when given, else the snapshot.
    pub root: PathBuf,
    /// Repo-relative paths of the selected files, sorted.
    pub files: Vec<String>,
    /// Bytes transferred over the network.
    pub downloaded_bytes: u64,
    /// Files that were already in the cache.
    pub cached_files: usize,
    /// True when served from the cache without contacting the Hub.
    pub offline: bool,
}

impl DownloadReport {
    /// Absolute paths of the files, under [`DownloadReport::root`].
    pub fn paths(&self) -> Vec<PathBuf> {
        self.files
            .iter()
            .map(|f| join_repo_path(&self.root, f))
            .collect()
    }
}

fn join_repo_path(root: &Path, file: &str) -> PathBuf {
    let mut path = root.to_path_buf();
    for part in file.split('/') {
        path.push(part);
    }
    path
}

/// Downloads with settings from the process environment.
pub fn download(opts: DownloadOptions) -> Result<DownloadReport, HubError> {
    download_with_env(opts, &HubEnv::from_process())
}

/// Downloads with explicit environment settings (options still win).
pub fn download_with_env(opts: DownloadOptions, env: &HubEnv) -> Result<DownloadReport, HubError> {
    validate_repo_id(&opts.repo_id)?;
    let revision = opts.revision.clone().unwrap_or_else(|| "main".to_string());
    let cache_dir = opts
        .cache_dir
        .clone()
        .unwrap_or_else(|| env.cache_dir.clone());
    let endpoint = env.resolve_endpoint(opts.endpoint.as_deref());
    let client = connect(
        &endpoint,
        env.resolve_token(opts.token.as_deref()),
        &cache_dir,
    )?;
    let cx = Context {
        repo: &opts.repo_id,
        revision: &revision,
        endpoint: &endpoint,
        local: &cache_dir,
        local_action: "write into",
    };
    let (owner, name) = split(&opts.repo_id);
    let bar = TransferBar::new(opts.progress && !env.disable_progress, &opts.repo_id);
    let fetch = |local_files_only: bool| match opts.repo_type {
        RepoType::Model => snapshot(
            &client.model(owner, name),
            &opts,
            &revision,
            local_files_only,
            &bar,
        ),
        RepoType::Dataset => snapshot(
            &client.dataset(owner, name),
            &opts,
            &revision,
            local_files_only,
            &bar,
        ),
    };
    let not_cached = |what: String| HubError::NotCached {
        repo: opts.repo_id.clone(),
        revision: revision.clone(),
        what,
        cache: cache_dir.clone(),
    };
    let offline = opts.offline.unwrap_or(env.offline);
    let (snapshot_dir, offline) = if offline {
        (
            fetch(true).map_err(|e| cached_only(e, &cx, &not_cached))?,
            true,
        )
    } else {
        let fetched = fetch(false).map_err(|e| error(e, &cx));
        if fetched.is_err() {
            remove_partial_blobs(&cache_dir, &repo_folder(&opts));
        }
        match fetched {
            Ok(dir) => (dir, false),
            // Like huggingface_hub: no network but a cached snapshot: use it.
            Err(HubError::Unreachable { endpoint, cause }) => match fetch(true) {
                Ok(dir) => (dir, true),
                Err(_) => return Err(HubError::Unreachable { endpoint, cause }),
            },
            Err(e) => return Err(e),
        }
    };
    bar.finish();
    verify_fetched(&snapshot_dir, &bar.fetched_files())?;
    let files = selected_files(&snapshot_dir, &opts)?;
    for pattern in opts.allow_patterns.iter().filter(|p| is_literal(p)) {
        if !files.iter().any(|f| f == pattern) {
            return Err(if offline {
                not_cached(pattern.clone())
            } else {
                HubError::EntryNotFound {
                    repo: opts.repo_id.clone(),
                    revision: revision.clone(),
                    path: pattern.clone(),
                }
            });
        }
    }
    if offline && files.is_empty() && !opts.allow_patterns.is_empty() {
        return Err(not_cached(format!(
            "any file matching {:?}",
            opts.allow_patterns
        )));
    }
    let commit = snapshot_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let (downloaded_bytes, fetched) = bar.fetched();
    let mut report = DownloadReport {
        repo_id: opts.repo_id.clone(),
        commit,
        root: snapshot_dir.clone(),
        snapshot_dir,
        cached_files: files.len().saturating_sub(fetched),
        files,
        downloaded_bytes,
        offline,
    };
    if let Some(out) = &opts.output_dir {
        export(&report, out)?;
        crate::hub::provenance::record(
            out,
            &crate::hub::provenance::Source {
                repo_id: opts.repo_id.clone(),
                revision: revision.clone(),
                commit: report.commit.clone(),
            },
        )?;
        report.root = out.clone();
    }
    Ok(report)
}

fn snapshot<T: HfRepoType>(
    repo: &HFRepositorySync<T>,
    opts: &DownloadOptions,
    revision: &str,
    local_files_only: bool,
    bar: &TransferBar,
) -> Result<PathBuf, HFError> {
    let patterns = |p: &[String]| (!p.is_empty()).then(|| p.iter().map(|p| normalize(p)).collect());
    repo.snapshot_download()
        .revision(revision)
        .maybe_allow_patterns(patterns(&opts.allow_patterns))
        .maybe_ignore_patterns(patterns(&opts.ignore_patterns))
        .local_files_only(local_files_only)
        .progress(bar.handler())
        .send()
}

/// `models--org--name`: the repo's folder in the HF cache.
fn repo_folder(opts: &DownloadOptions) -> String {
    let kind = match opts.repo_type {
        RepoType::Model => "models",
        RepoType::Dataset => "datasets",
    };
    format!("{kind}--{}", opts.repo_id.replace('/', "--"))
}

/// Checks every blob this download wrote whose name is a SHA-256 (the Hub's ETag of an LFS
/// file) against its bytes: hf-hub's plain-HTTP path does not, and a corrupted blob would be
/// served from the cache forever after. A bad one is deleted with its snapshot entry.
fn verify_fetched(snapshot_dir: &Path, fetched: &[String]) -> Result<(), HubError> {
    use sha2::{Digest, Sha256};
    for file in fetched {
        let pointer = join_repo_path(snapshot_dir, file);
        let Ok(blob) = std::fs::canonicalize(&pointer) else {
            continue;
        };
        let Some(expected) = blob
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .filter(|n| n.len() == 64 && n.bytes().all(|b| b.is_ascii_hexdigit()))
        else {
            continue;
        };
        let mut hasher = Sha256::new();
        let mut reader = std::fs::File::open(&blob).map_err(HubError::io("read", &blob))?;
        std::io::copy(&mut reader, &mut hasher).map_err(HubError::io("read", &blob))?;
        let actual = format!("{:x}", hasher.finalize());
        if actual != expected {
            let _ = std::fs::remove_file(&blob);
            let _ = std::fs::remove_file(&pointer);
            return Err(HubError::Corrupted {
                path: blob,
                expected,
                actual,
            });
        }
    }
    Ok(())
}

/// After a failed download: removes the `.incomplete` blobs nobody is writing (hf-hub holds a
/// lock per blob while it downloads), so no partial file stays in the cache. hf-hub restarts
/// a plain-HTTP file from the beginning anyway; Xet transfers resume by chunk.
fn remove_partial_blobs(cache_dir: &Path, repo_folder: &str) {
    let blobs = cache_dir.join(repo_folder).join("blobs");
    let Ok(entries) = std::fs::read_dir(&blobs) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(etag) = name.strip_suffix(".incomplete") else {
            continue;
        };
        let lock = cache_dir
            .join(".locks")
            .join(repo_folder)
            .join(format!("{etag}.lock"));
        let free = match std::fs::File::open(&lock) {
            Ok(file) => file.try_lock().is_ok(),
            Err(_) => true,
        };
        if free {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// An offline lookup's failure: not in the cache, or another error.
fn cached_only(e: HFError, cx: &Context<'_>, not_cached: &dyn Fn(String) -> HubError) -> HubError {
    match e {
        HFError::LocalEntryNotFound { .. } => not_cached("the snapshot".to_string()),
        other => error(other, cx),
    }
}

/// The snapshot's files the patterns select (a snapshot may also hold files an earlier
/// download with other patterns fetched), as sorted repo paths.
fn selected_files(snapshot_dir: &Path, opts: &DownloadOptions) -> Result<Vec<String>, HubError> {
    let mut files = Vec::new();
    let mut pending = vec![(snapshot_dir.to_path_buf(), String::new())];
    while let Some((dir, prefix)) = pending.pop() {
        let entries = std::fs::read_dir(&dir).map_err(HubError::io("list", &dir))?;
        for entry in entries {
            let entry = entry.map_err(HubError::io("list", &dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let rel = if prefix.is_empty() {
                name
            } else {
                format!("{prefix}/{name}")
            };
            let path = entry.path();
            // Snapshot entries are symlinks to blobs: follow them.
            if path.is_dir() {
                pending.push((path, rel));
            } else if path.is_file()
                && is_selected(&rel, &opts.allow_patterns, &opts.ignore_patterns)
            {
                files.push(rel);
            }
        }
    }
    files.sort();
    Ok(files)
}

fn export(report: &DownloadReport, out: &Path) -> Result<(), HubError> {
    for file in &report.files {
        let source = join_repo_path(&report.snapshot_dir, file);
        let blob = std::fs::canonicalize(&source).map_err(HubError::io("resolve", &source))?;
        let dest = join_repo_path(out, file);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(HubError::io("create", parent))?;
        }
        if dest.symlink_metadata().is_ok() {
            std::fs::remove_file(&dest).map_err(HubError::io("replace", &dest))?;
        }
        if std::fs::hard_link(&blob, &dest).is_err() {
            std::fs::copy(&blob, &dest).map_err(HubError::io("copy into", &dest))?;
        }
    }
    Ok(())
}
