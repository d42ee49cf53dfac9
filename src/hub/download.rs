//! `hf download`: resolve a revision, list and filter the repo files, fetch
//! each into the standard cache, optionally copy them into an output folder.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::hub::api::repo_info;
use crate::hub::cache::{RepoCache, check_relative};
use crate::hub::env::HubEnv;
use crate::hub::error::HubError;
use crate::hub::fetch::{FileTarget, fetch_file};
use crate::hub::http::HubClient;
use crate::hub::patterns::{is_literal, is_selected};
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
    /// Connect/read timeout; default 30 s.
    pub timeout: Option<Duration>,
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
    let cache = RepoCache::new(&cache_dir, &opts.repo_id, opts.repo_type);
    let mut report = if opts.offline.unwrap_or(env.offline) {
        from_cache(&opts, &cache, &cache_dir, &revision)?
    } else {
        let endpoint = env.resolve_endpoint(opts.endpoint.as_deref());
        let token = env.resolve_token(opts.token.as_deref());
        let timeout = opts.timeout.unwrap_or(Duration::from_secs(30));
        let client = HubClient::new(&endpoint, token, timeout)?;
        let progress = opts.progress && !env.disable_progress;
        match online(&opts, &client, &cache, &revision, progress) {
            // Like huggingface_hub: no network but a cached snapshot → use it.
            Err(HubError::Unreachable { endpoint, cause }) => {
                match from_cache(&opts, &cache, &cache_dir, &revision) {
                    Ok(report) => report,
                    Err(_) => return Err(HubError::Unreachable { endpoint, cause }),
                }
            }
            other => other?,
        }
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

fn online(
    opts: &DownloadOptions,
    client: &HubClient,
    cache: &RepoCache,
    revision: &str,
    progress: bool,
) -> Result<DownloadReport, HubError> {
    let info = repo_info(client, &opts.repo_id, opts.repo_type, revision)?;
    let listed: Vec<String> = info.siblings.iter().map(|s| s.rfilename.clone()).collect();
    for pattern in opts.allow_patterns.iter().filter(|p| is_literal(p)) {
        if !listed.iter().any(|f| f == pattern) {
            return Err(HubError::EntryNotFound {
                repo: opts.repo_id.clone(),
                revision: revision.to_string(),
                path: pattern.clone(),
            });
        }
    }
    let mut files: Vec<String> = listed
        .into_iter()
        .filter(|f| is_selected(f, &opts.allow_patterns, &opts.ignore_patterns))
        .collect();
    files.sort();
    let mut downloaded_bytes = 0;
    let mut cached_files = 0;
    for file in &files {
        check_relative(file).map_err(|detail| HubError::InvalidResponse {
            url: client.endpoint().to_string(),
            detail,
        })?;
        let target = FileTarget {
            repo_id: &opts.repo_id,
            repo_type: opts.repo_type,
            commit: &info.sha,
            file,
        };
        let fetched = fetch_file(client, cache, &target, progress)?;
        downloaded_bytes += fetched.downloaded;
        if fetched.downloaded == 0 && fetched.resumed_from == 0 {
            cached_files += 1;
        }
    }
    cache.write_ref(revision, &info.sha)?;
    let snapshot_dir = cache.snapshot_dir(&info.sha);
    if files.is_empty() {
        std::fs::create_dir_all(&snapshot_dir).map_err(HubError::io("create", &snapshot_dir))?;
    }
    Ok(DownloadReport {
        repo_id: opts.repo_id.clone(),
        commit: info.sha,
        root: snapshot_dir.clone(),
        snapshot_dir,
        files,
        downloaded_bytes,
        cached_files,
        offline: false,
    })
}

fn from_cache(
    opts: &DownloadOptions,
    cache: &RepoCache,
    cache_dir: &Path,
    revision: &str,
) -> Result<DownloadReport, HubError> {
    let not_cached = |what: String| HubError::NotCached {
        repo: opts.repo_id.clone(),
        revision: revision.to_string(),
        what,
        cache: cache_dir.to_path_buf(),
    };
    let commit = cache
        .resolve_commit(revision)
        .filter(|c| cache.snapshot_dir(c).is_dir())
        .ok_or_else(|| not_cached("the snapshot".to_string()))?;
    let cached = cache.snapshot_files(&commit)?;
    for pattern in opts.allow_patterns.iter().filter(|p| is_literal(p)) {
        if !cached.iter().any(|f| f == pattern) {
            return Err(not_cached(pattern.clone()));
        }
    }
    let files: Vec<String> = cached
        .into_iter()
        .filter(|f| is_selected(f, &opts.allow_patterns, &opts.ignore_patterns))
        .collect();
    if files.is_empty() && !opts.allow_patterns.is_empty() {
        return Err(not_cached(format!(
            "any file matching {:?}",
            opts.allow_patterns
        )));
    }
    let snapshot_dir = cache.snapshot_dir(&commit);
    Ok(DownloadReport {
        repo_id: opts.repo_id.clone(),
        cached_files: files.len(),
        commit,
        root: snapshot_dir.clone(),
        snapshot_dir,
        files,
        downloaded_bytes: 0,
        offline: true,
    })
}

/// Places the snapshot files in `out`: hard links to the blobs, else copies.
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
