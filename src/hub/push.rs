//! `push`: validate a checkpoint folder, create the repo if needed, and upload
//! every file plus a model card in one commit.

use std::path::{Path, PathBuf};

use hf_hub::repository::{AddSource, CommitOperation};
use hf_hub::{HFError, RepoTypeModel};

use crate::hub::client::{Context, connect, error, split};
use crate::hub::env::HubEnv;
use crate::hub::error::HubError;
use crate::hub::model_card::{ModelCardInfo, render};
use crate::hub::patterns::is_selected;
use crate::hub::progress::TransferBar;
use crate::hub::repo::validate_repo_id;
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
}

/// What a push did.
#[derive(Debug, Clone)]
pub struct PushReport {
    pub repo_id: String,
    pub repo_url: String,
    pub kind: CheckpointKind,
    pub created_repo: bool,
    pub files: Vec<PushedFile>,
    pub readme: ReadmeSource,
    pub commit_url: Option<String>,
    pub commit_oid: Option<String>,
    pub pull_request_url: Option<String>,
}

/// Files of a tune checkpoint that only resuming the run needs (fnmatch patterns): the
/// optimizer state (one file, one shard per rank, or every rank's share of an FSDP run's
/// moments), the checkpoint manifest, and torchtune's recipe state.
pub const TRAINING_STATE: &[&str] = &[
    "optimizer.safetensors",
    "optimizer-*-of-*.safetensors",
    "optimizer_sharded/",
    "tune_checkpoint.json",
    "recipe_state.pt",
];

/// What a push would upload, without a token or the network: the folder is checked as for a
/// push and its files listed (README.md as it would be published).
pub fn plan(opts: &PushOptions) -> Result<Vec<PushedFile>, HubError> {
    validate_repo_id(&opts.repo_id)?;
    validate_push_dir(&opts.dir)?;
    let (files, _) = collect_files(opts)?;
    Ok(files.iter().map(Upload::listed).collect())
}

/// Pushes with settings from the process environment.
pub fn push(opts: PushOptions) -> Result<PushReport, HubError> {
    push_with_env(opts, &HubEnv::from_process())
}

/// Pushes with explicit environment settings (options still win): creates the repo when it
/// does not exist, then uploads every file in one commit (hf-hub chooses Xet or inline
/// transfers per file, as the Hub asks).
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
    let client = connect(&endpoint, Some(token), &env.cache_dir)?;
    let revision = opts.revision.clone().unwrap_or_else(|| "main".to_string());
    let cx = Context {
        repo: &opts.repo_id,
        revision: &revision,
        endpoint: &endpoint,
        local: &opts.dir,
        local_action: "read from",
    };
    let created_repo = match client
        .create_repository()
        .repo_id(&opts.repo_id)
        .repo_type(RepoTypeModel)
        .private(opts.private)
        .send()
    {
        Ok(_) => true,
        // An existing repo keeps its visibility; the commit goes on top of it.
        Err(HFError::Conflict { .. }) => false,
        Err(e) => return Err(error(e, &cx)),
    };

    let summary = opts.commit_message.clone().unwrap_or_else(|| match kind {
        CheckpointKind::PeftAdapter => "Upload LoRA adapter with tune".to_string(),
        CheckpointKind::Full { .. } => "Upload model with tune".to_string(),
    });
    let operations = files
        .iter()
        .map(|f| CommitOperation::Add {
            path_in_repo: f.path_in_repo.clone(),
            source: match &f.source {
                Source::File(path) => AddSource::File(path.clone()),
                Source::Bytes(bytes) => AddSource::Bytes(bytes.clone().into()),
            },
        })
        .collect();
    let (owner, name) = split(&opts.repo_id);
    let bar = TransferBar::new(opts.progress && !env.disable_progress, &opts.repo_id);
    let info = client
        .model(owner, name)
        .create_commit()
        .operations(operations)
        .commit_message(summary)
        .revision(revision.clone())
        .create_pr(opts.create_pr)
        .progress(bar.handler())
        .send()
        .map_err(|e| error(e, &cx))?;
    bar.finish();
    Ok(PushReport {
        repo_url: format!("{endpoint}/{}", opts.repo_id),
        repo_id: opts.repo_id.clone(),
        kind,
        created_repo,
        files: files.iter().map(Upload::listed).collect(),
        readme,
        commit_url: info.commit_url,
        commit_oid: info.commit_oid,
        pull_request_url: info.pr_url,
    })
}

/// A file to upload: its repo path, size and where its bytes are.
struct Upload {
    path_in_repo: String,
    size: u64,
    source: Source,
}

enum Source {
    File(PathBuf),
    Bytes(Vec<u8>),
}

impl Upload {
    fn file(rel: &str, path: &Path) -> Result<Self, HubError> {
        let size = std::fs::metadata(path)
            .map_err(HubError::io("read", path))?
            .len();
        Ok(Self {
            path_in_repo: rel.to_string(),
            size,
            source: Source::File(path.to_path_buf()),
        })
    }

    /// What the report and the dry run list of it.
    fn listed(&self) -> PushedFile {
        PushedFile {
            path: self.path_in_repo.clone(),
            size: self.size,
        }
    }

    fn bytes(rel: &str, bytes: Vec<u8>) -> Self {
        Self {
            path_in_repo: rel.to_string(),
            size: bytes.len() as u64,
            source: Source::Bytes(bytes),
        }
    }
}

/// The files to upload, sorted by repo path, README.md included.
fn collect_files(opts: &PushOptions) -> Result<(Vec<Upload>, ReadmeSource), HubError> {
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
        files.push(Upload::file(rel, path)?);
    }
    match readme {
        ReadmeSource::Supplied => {
            let card = opts.model_card.clone().unwrap_or_default();
            files.push(Upload::bytes("README.md", card.into_bytes()));
        }
        ReadmeSource::Generated => {
            let card = render(ModelCardInfo::from_dir(&opts.dir, &opts.repo_id)?);
            files.push(Upload::bytes("README.md", card.into_bytes()));
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
