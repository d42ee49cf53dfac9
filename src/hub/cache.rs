//! The standard Hugging Face cache layout, shared with Python tools:
//! `{cache}/models--org--name/{blobs/<etag>, snapshots/<commit>/<file>, refs/<revision>}`.

use std::path::{Component, Path, PathBuf};

use crate::hub::error::HubError;
use crate::hub::repo::{RepoType, is_commit_hash};

/// One repo's folder in the cache.
#[derive(Debug, Clone)]
pub struct RepoCache {
    root: PathBuf,
}

/// Rejects repo file names that would escape the snapshot folder.
pub fn check_relative(file: &str) -> Result<(), String> {
    let path = Path::new(file);
    if file.is_empty() || !path.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(format!("unsafe file path {file:?} in the repo listing"));
    }
    Ok(())
}

impl RepoCache {
    pub fn new(cache_dir: &Path, repo_id: &str, repo_type: RepoType) -> Self {
        // hf-hub names the folder exactly as huggingface_hub does.
        let folder = hf_hub::Repo::new(repo_id.to_string(), repo_type.to_hf_hub()).folder_name();
        RepoCache {
            root: cache_dir.join(folder),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.root
    }

    pub fn blob_path(&self, etag: &str) -> PathBuf {
        self.root.join("blobs").join(etag)
    }

    /// Where a download in progress lives (`huggingface_hub` resumes the same file).
    pub fn incomplete_path(&self, etag: &str) -> PathBuf {
        self.root.join("blobs").join(format!("{etag}.incomplete"))
    }

    pub fn snapshot_dir(&self, commit: &str) -> PathBuf {
        self.root.join("snapshots").join(commit)
    }

    pub fn pointer_path(&self, commit: &str, file: &str) -> PathBuf {
        let mut path = self.snapshot_dir(commit);
        for part in file.split('/') {
            path.push(part);
        }
        path
    }

    fn ref_path(&self, revision: &str) -> PathBuf {
        let mut path = self.root.join("refs");
        for part in revision.split('/') {
            path.push(part);
        }
        path
    }

    /// The commit a branch/tag points to in the cache (a commit id resolves to itself).
    pub fn resolve_commit(&self, revision: &str) -> Option<String> {
        if is_commit_hash(revision) && self.snapshot_dir(revision).is_dir() {
            return Some(revision.to_string());
        }
        std::fs::read_to_string(self.ref_path(revision))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    }

    /// Records `refs/<revision>` = `commit` (not for revisions that are commit ids).
    pub fn write_ref(&self, revision: &str, commit: &str) -> Result<(), HubError> {
        if revision == commit {
            return Ok(());
        }
        let path = self.ref_path(revision);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(HubError::io("create", parent))?;
        }
        std::fs::write(&path, commit).map_err(HubError::io("write", path))
    }

    /// Points `snapshots/<commit>/<file>` at `blobs/<etag>` with a relative
    /// symlink (a copy where symlinks are unavailable).
    pub fn link_pointer(&self, commit: &str, file: &str, etag: &str) -> Result<PathBuf, HubError> {
        let pointer = self.pointer_path(commit, file);
        let blob = self.blob_path(etag);
        if let Some(parent) = pointer.parent() {
            std::fs::create_dir_all(parent).map_err(HubError::io("create", parent))?;
        }
        if pointer.symlink_metadata().is_ok() {
            std::fs::remove_file(&pointer).map_err(HubError::io("replace", &pointer))?;
        }
        let depth = file.split('/').count();
        let mut target = PathBuf::new();
        for _ in 0..=depth {
            target.push("..");
        }
        target.push("blobs");
        target.push(etag);
        if symlink(&target, &pointer).is_err() {
            std::fs::copy(&blob, &pointer).map_err(HubError::io("copy into", &pointer))?;
        }
        Ok(pointer)
    }

    /// Files of a cached snapshot, as repo-relative `/`-separated paths, sorted.
    pub fn snapshot_files(&self, commit: &str) -> Result<Vec<String>, HubError> {
        let dir = self.snapshot_dir(commit);
        let mut files = Vec::new();
        walk(&dir, "", &mut files)?;
        files.sort();
        Ok(files)
    }
}

fn walk(dir: &Path, prefix: &str, out: &mut Vec<String>) -> Result<(), HubError> {
    let entries = std::fs::read_dir(dir).map_err(HubError::io("list", dir))?;
    for entry in entries {
        let entry = entry.map_err(HubError::io("list", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let rel = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        let path = entry.path();
        // `metadata` follows the snapshot symlinks to their blobs.
        match std::fs::metadata(&path) {
            Ok(meta) if meta.is_dir() => walk(&path, &rel, out)?,
            Ok(_) => out.push(rel),
            Err(_) => {} // dangling pointer: the blob was removed, treat as absent
        }
    }
    Ok(())
}

#[cfg(unix)]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, link)
}

#[cfg(windows)]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    std::os::windows::fs::symlink_file(target, link)
}

#[cfg(not(any(unix, windows)))]
fn symlink(_target: &Path, _link: &Path) -> std::io::Result<()> {
    Err(std::io::Error::other("symlinks unsupported"))
}
