//! `push`: validate a checkpoint folder, create the repo if needed, and upload
//! every file plus a model card in one commit.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::hub::commit::{CommitTarget, UploadMode, commit_payload, create_commit, preupload};
use crate::hub::create::create_repo;
use crate::hub::env::HubEnv;
use crate::hub::error::HubError;
use crate::hub::http::HubClient;
use crate::hub::lfs::upload_lfs_files;
use crate::hub::model_card::{ModelCardInfo, render};
use crate::hub::patterns::is_selected;
use crate::hub::repo::{RepoType, validate_repo_id};
use crate::hub::upload_info::UploadFile;
use crate::hub::validate::{CheckpointKind, validate_push_dir};

/// What to push. `None` fields fall back to the environment.
#[derive(Debug, Clone, Default)]
pub struct PushOptions {
    pub dir: PathBuf,
    pub repo_id: String,
    /// Visibility of a newly created repo (an existing repo keeps its own).
    pub private: bool,
    /// Branch to commit to; default `main`.
    pub revision: Option<String>,
    pub commit_message: Option<String>,
    /// Open a pull request instead of committing to the branch.
    pub create_pr: bool,
    pub token: Option<String>,
    pub endpoint: Option<String>,
    /// The README.md to publish, replacing one in `dir`. Without it, an
    /// existing README.md is kept, else a card is generated from `dir`.
    pub model_card: Option<String>,
    /// Files of `dir` not to upload (globs, e.g. `*.pt`). Dot-files are never uploaded.
    pub ignore_patterns: Vec<String>,
    /// Also upload what only resuming needs ([`TRAINING_STATE`]): optimizer state and the
    /// checkpoint manifest. Off by default: a Hub user loads the model, not the run.
    pub include_training_state: bool,
    pub progress: bool,
    /// Connect/read timeout; default 60 s.
    pub timeout: Option<Duration>,
}

/// Where the published README.md came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadmeSource {
    /// `PushOptions::model_card`.
    Supplied,
    /// The README.md already in the folder.
    Kept,
    /// Rendered from the folder's configs.
    Generated,
}

/// One uploaded file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushedFile {
    pub path: String,
    pub size: u64,
    pub lfs: bool,
}

/// What a push did.
#[derive(Debug, Clone)]
pub struct PushReport {
    pub repo_id: String,
    pub repo_url: String,
    pub kind: CheckpointKind,
    pub created_repo: bool,
    pub files: Vec<PushedFile>,
    /// LFS objects sent (the others were already on the Hub).
    pub lfs_uploaded: usize,
    pub readme: ReadmeSource,
    pub commit_url: Option<String>,
    pub commit_oid: Option<String>,
    pub pull_request_url: Option<String>,
}

/// Files of a tune checkpoint that only resuming the run needs (fnmatch patterns): the
/// optimizer state (one file, or one shard per rank), the checkpoint manifest, and
/// torchtune's recipe state.
pub const TRAINING_STATE: &[&str] = &[
    "optimizer.safetensors",
    "optimizer-*-of-*.safetensors",
    "tune_checkpoint.json",
    "recipe_state.pt",
];

/// What a push would upload, without a token or the network: the folder is checked as for a
/// push and its files listed (README.md as it would be published).
pub fn plan(opts: &PushOptions) -> Result<Vec<PushedFile>, HubError> {
    validate_repo_id(&opts.repo_id)?;
    validate_push_dir(&opts.dir)?;
    let (files, _) = collect_files(opts)?;
    Ok(files
        .iter()
        .map(|f| PushedFile {
            path: f.path_in_repo.clone(),
            size: f.size,
            lfs: false,
        })
        .collect())
}

/// Pushes with settings from the process environment.
pub fn push(opts: PushOptions) -> Result<PushReport, HubError> {
    push_with_env(opts, &HubEnv::from_process())
}

/// Pushes with explicit environment settings (options still win).
pub fn push_with_env(opts: PushOptions, env: &HubEnv) -> Result<PushReport, HubError> {
    // Everything local is checked before the first request.
    validate_repo_id(&opts.repo_id)?;
    let kind = validate_push_dir(&opts.dir)?;
    if env.offline {
        return Err(HubError::OfflinePush {
            repo: opts.repo_id.clone(),
        });
    }
    let token = env
        .resolve_token(opts.token.as_deref())
        .ok_or_else(|| HubError::MissingToken {
            repo: opts.repo_id.clone(),
        })?;
    let (files, readme) = collect_files(&opts)?;

    let endpoint = env.resolve_endpoint(opts.endpoint.as_deref());
    let client = HubClient::new(
        &endpoint,
        Some(token),
        opts.timeout.unwrap_or(Duration::from_secs(60)),
    )?;
    let progress = opts.progress && !env.disable_progress;
    let created_repo = create_repo(&client, &opts.repo_id, RepoType::Model, opts.private)?;

    let revision = opts.revision.clone().unwrap_or_else(|| "main".to_string());
    let target = CommitTarget {
        repo_id: &opts.repo_id,
        repo_type: RepoType::Model,
        revision: &revision,
        create_pr: opts.create_pr,
    };
    let modes = preupload(&client, &target, &files)?;
    let mut included: Vec<(&UploadFile, UploadMode)> = Vec::new();
    for file in &files {
        if let Some(verdict) = modes.get(&file.path_in_repo)
            && !verdict.should_ignore
        {
            included.push((file, verdict.mode));
        }
    }
    let lfs: Vec<&UploadFile> = included
        .iter()
        .filter(|(_, mode)| *mode == UploadMode::Lfs)
        .map(|(file, _)| *file)
        .collect();
    let lfs_uploaded = upload_lfs_files(
        &client,
        &opts.repo_id,
        RepoType::Model,
        &revision,
        &lfs,
        progress,
    )?;

    let summary = opts.commit_message.clone().unwrap_or_else(|| match kind {
        CheckpointKind::PeftAdapter => "Upload LoRA adapter with tune".to_string(),
        CheckpointKind::Full { .. } => "Upload model with tune".to_string(),
    });
    let body = commit_payload(&summary, "", &included)?;
    let info = create_commit(&client, &target, body)?;
    Ok(PushReport {
        repo_url: format!("{endpoint}/{}", opts.repo_id),
        repo_id: opts.repo_id.clone(),
        kind,
        created_repo,
        files: included
            .iter()
            .map(|(file, mode)| PushedFile {
                path: file.path_in_repo.clone(),
                size: file.size,
                lfs: *mode == UploadMode::Lfs,
            })
            .collect(),
        lfs_uploaded,
        readme,
        commit_url: info.commit_url,
        commit_oid: info.commit_oid,
        pull_request_url: info.pull_request_url,
    })
}

/// The files to upload, sorted by repo path, README.md included.
fn collect_files(opts: &PushOptions) -> Result<(Vec<UploadFile>, ReadmeSource), HubError> {
    let mut paths = Vec::new();
    walk(&opts.dir, "", &mut paths)?;
    let mut ignore = opts.ignore_patterns.clone();
    if !opts.include_training_state {
        ignore.extend(TRAINING_STATE.iter().map(|p| p.to_string()));
    }
    paths.retain(|(rel, _)| is_selected(rel, &[], &ignore));
    let has_readme = paths.iter().any(|(rel, _)| rel == "README.md");
    let readme = match (&opts.model_card, has_readme) {
        (Some(_), _) => ReadmeSource::Supplied,
        (None, true) => ReadmeSource::Kept,
        (None, false) => ReadmeSource::Generated,
    };
    let mut files = Vec::with_capacity(paths.len() + 1);
    for (rel, path) in &paths {
        if rel == "README.md" && readme != ReadmeSource::Kept {
            continue;
        }
        files.push(UploadFile::from_file(rel, path)?);
    }
    match readme {
        ReadmeSource::Supplied => {
            let card = opts.model_card.clone().unwrap_or_default();
            files.push(UploadFile::from_bytes("README.md", card.into_bytes()));
        }
        ReadmeSource::Generated => {
            let card = render(ModelCardInfo::from_dir(&opts.dir, &opts.repo_id)?);
            files.push(UploadFile::from_bytes("README.md", card.into_bytes()));
        }
        ReadmeSource::Kept => {}
    }
    files.sort_by(|a, b| a.path_in_repo.cmp(&b.path_in_repo));
    Ok((files, readme))
}

fn walk(dir: &Path, prefix: &str, out: &mut Vec<(String, PathBuf)>) -> Result<(), HubError> {
    let entries = std::fs::read_dir(dir).map_err(HubError::io("list", dir))?;
    for entry in entries {
        let entry = entry.map_err(HubError::io("list", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue; // .git, .cache, editor files
        }
        let rel = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        let path = entry.path();
        let meta = std::fs::metadata(&path).map_err(HubError::io("read", &path))?;
        if meta.is_dir() {
            walk(&path, &rel, out)?;
        } else if meta.is_file() {
            out.push((rel, path));
        }
    }
    Ok(())
}
