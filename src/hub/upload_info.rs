//! Size, sha256 and 512-byte sample of a file to upload (what the preupload,
//! LFS and commit endpoints need).

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::hub::error::HubError;

/// Where the bytes of an upload come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UploadSource {
    File(PathBuf),
    Bytes(Vec<u8>),
}

/// One file of a commit.
#[derive(Debug, Clone)]
pub struct UploadFile {
    /// Path in the repo, `/`-separated.
    pub path_in_repo: String,
    pub source: UploadSource,
    pub size: u64,
    /// Lowercase hex sha256 (the LFS oid).
    pub sha256: String,
    /// The first 512 bytes, for the preupload endpoint.
    pub sample: Vec<u8>,
}

impl UploadFile {
    pub fn from_bytes(path_in_repo: &str, bytes: Vec<u8>) -> Self {
        UploadFile {
            path_in_repo: path_in_repo.to_string(),
            size: bytes.len() as u64,
            sha256: format!("{:x}", Sha256::digest(&bytes)),
            sample: bytes[..bytes.len().min(512)].to_vec(),
            source: UploadSource::Bytes(bytes),
        }
    }

    /// Hashes the file in one streaming pass.
    pub fn from_file(path_in_repo: &str, path: &Path) -> Result<Self, HubError> {
        let mut file = File::open(path).map_err(HubError::io("open", path))?;
        let mut hasher = Sha256::new();
        let mut sample = Vec::with_capacity(512);
        let mut size = 0u64;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = file.read(&mut buf).map_err(HubError::io("read", path))?;
            if n == 0 {
                break;
            }
            if sample.len() < 512 {
                let take = (512 - sample.len()).min(n);
                sample.extend_from_slice(&buf[..take]);
            }
            hasher.update(&buf[..n]);
            size += n as u64;
        }
        Ok(UploadFile {
            path_in_repo: path_in_repo.to_string(),
            source: UploadSource::File(path.to_path_buf()),
            size,
            sha256: format!("{:x}", hasher.finalize()),
            sample,
        })
    }

    /// The whole content (regular files are small and go inline in the commit).
    pub fn read_all(&self) -> Result<Vec<u8>, HubError> {
        match &self.source {
            UploadSource::Bytes(bytes) => Ok(bytes.clone()),
            UploadSource::File(path) => std::fs::read(path).map_err(HubError::io("read", path)),
        }
    }

    /// A reader over `len` bytes from `offset`.
    pub fn reader_at(&self, offset: u64, len: u64) -> Result<Box<dyn Read + Send>, HubError> {
        match &self.source {
            UploadSource::Bytes(bytes) => {
                let start = (offset as usize).min(bytes.len());
                let end = (start + len as usize).min(bytes.len());
                Ok(Box::new(std::io::Cursor::new(bytes[start..end].to_vec())))
            }
            UploadSource::File(path) => {
                use std::io::Seek;
                let mut file = File::open(path).map_err(HubError::io("open", path))?;
                file.seek(std::io::SeekFrom::Start(offset))
                    .map_err(HubError::io("seek", path))?;
                Ok(Box::new(file.take(len)))
            }
        }
    }
}
