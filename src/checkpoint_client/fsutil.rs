//! Small filesystem helpers: fsync of files and directories, hashing, walking.

use sha2::{Digest, Sha256};
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

/// fsyncs a directory so that entries created/renamed in it are durable.
/// (`File::open` on a directory + `sync_all` is an fsync of the directory on Linux.)
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Size and lower-case hex sha256 of a file's contents.
pub(crate) fn hash_file(path: &Path) -> io::Result<(u64, String)> {
    let mut file = File::open(path)?;
    hash_reader(&mut file)
}

/// fsyncs a file, then returns its size and sha256.
pub(crate) fn sync_and_hash_file(path: &Path) -> io::Result<(u64, String)> {
    let mut file = File::open(path)?;
    file.sync_all()?;
    hash_reader(&mut file)
}

fn hash_reader(reader: &mut impl Read) -> io::Result<(u64, String)> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((size, to_hex(&hasher.finalize())))
}

fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 0xf) as usize] as char);
    }
    s
}

/// An entry found while walking a directory tree.
#[derive(Debug)]
pub(crate) enum WalkEntry {
    /// A regular file: absolute path and `/`-separated relative path
    /// (`None` if the relative path is not UTF-8).
    File {
        path: PathBuf,
        relative: Option<String>,
    },
    /// A sub-directory (already descended into).
    Dir { path: PathBuf },
    /// Anything else (symlink, socket, ...).
    Other { path: PathBuf },
}

/// Lists everything under `root` recursively (not following symlinks), sorted
/// by path so the metadata is deterministic. Directories come before their contents.
pub(crate) fn walk(root: &Path) -> io::Result<Vec<WalkEntry>> {
    let mut out = Vec::new();
    walk_into(root, root, &mut out)?;
    Ok(out)
}

fn walk_into(root: &Path, dir: &Path, out: &mut Vec<WalkEntry>) -> io::Result<()> {
    let mut entries = fs::read_dir(dir)?.collect::<io::Result<Vec<_>>>()?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let ty = entry.file_type()?;
        if ty.is_dir() {
            out.push(WalkEntry::Dir { path: path.clone() });
            walk_into(root, &path, out)?;
        } else if ty.is_file() {
            let relative = relative_slash_path(root, &path);
            out.push(WalkEntry::File { path, relative });
        } else {
            out.push(WalkEntry::Other { path });
        }
    }
    Ok(())
}

fn relative_slash_path(root: &Path, path: &Path) -> Option<String> {
    let rel = path.strip_prefix(root).ok()?;
    let parts = rel
        .components()
        .map(|c| c.as_os_str().to_str())
        .collect::<Option<Vec<_>>>()?;
    Some(parts.join("/"))
}

/// Total size of the regular files under `dir`; unreadable parts count as 0
/// (used only for display).
pub(crate) fn dir_size_best_effort(dir: &Path) -> u64 {
    let Ok(entries) = walk(dir) else { return 0 };
    entries
        .iter()
        .filter_map(|e| match e {
            WalkEntry::File { path, .. } => fs::metadata(path).ok().map(|m| m.len()),
            _ => None,
        })
        .sum()
}

/// Resolves a `/`-separated relative path from the metadata safely: no absolute
/// paths, no `..`, no empty components.
pub(crate) fn resolve_relative(root: &Path, relative: &str) -> Option<PathBuf> {
    if relative.is_empty() || relative.starts_with('/') {
        return None;
    }
    let mut out = root.to_path_buf();
    for part in relative.split('/') {
        if part.is_empty() || part == "." || part == ".." {
            return None;
        }
        out.push(part);
    }
    Some(out)
}
