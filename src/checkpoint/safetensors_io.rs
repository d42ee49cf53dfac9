//! Reading and writing safetensors files: memory-mapped reads (converted from F32/BF16/F16 to
//! f32), and sharded writes named and indexed as transformers names them.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, Metadata, TensorInfo, TensorView};

use super::error::CheckpointError;
use super::host::HostTensor;

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";

/// One memory-mapped safetensors file and its parsed header.
pub struct SafetensorsFile {
    pub path: PathBuf,
    mmap: Mmap,
    header_len: usize,
    meta: Metadata,
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        let file = File::open(path).map_err(CheckpointError::io(path))?;
        // SAFETY: the file is opened read-only and tune never writes to a checkpoint it reads;
        // a concurrent external writer would be a user error the OS cannot prevent anyway.
        let mmap = unsafe { Mmap::map(&file) }.map_err(CheckpointError::io(path))?;
        check_data_offsets(&mmap).map_err(|message| CheckpointError::BadSafetensors {
            path: path.to_path_buf(),
            message,
        })?;
        let (header_len, meta) =
            SafeTensors::read_metadata(&mmap).map_err(|e| CheckpointError::BadSafetensors {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        // read_metadata checks offsets against the header, not the file: catch truncation here.
        let needed = 8 + header_len + meta.data_len();
        if mmap.len() < needed {
            return Err(CheckpointError::BadSafetensors {
                path: path.to_path_buf(),
                message: format!(
                    "file is {} bytes but its header describes {needed}",
                    mmap.len()
                ),
            });
        }
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            header_len,
            meta,
        })
    }

    pub fn names(&self) -> Vec<String> {
        self.meta.tensors().into_keys().collect()
    }

    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.meta.info(name).map(|i| i.shape.clone())
    }

    pub fn read(&self, name: &str) -> Result<HostTensor, CheckpointError> {
        let info = self.info(name)?;
        let (start, end) = info.data_offsets;
        self.decoded(name, info, start..end, info.shape.clone())
    }

    /// Rows `rows` (of dim 0) of tensor `name`, decoded from the mapped file: only those rows'
    /// bytes are read (a tensor is row-major, so they are one contiguous range).
    pub fn read_rows(&self, name: &str, rows: Range<usize>) -> Result<HostTensor, CheckpointError> {
        let info = self.info(name)?;
        let mut shape = info.shape.clone();
        let row_bytes = shape.iter().skip(1).product::<usize>() * info.dtype.bitsize() / 8;
        let (start, end) = info.data_offsets;
        let (from, to) = (start + rows.start * row_bytes, start + rows.end * row_bytes);
        if shape.is_empty() || rows.start > rows.end || to > end {
            return Err(CheckpointError::BadSafetensors {
                path: self.path.clone(),
                message: format!("{name} has no rows {rows:?} (shape {shape:?})"),
            });
        }
        shape[0] = rows.len();
        self.decoded(name, info, from..to, shape)
    }

    /// The stored bytes of a `U8` tensor (MXFP4's codes and scales), as they are; any other
    /// dtype is an error naming the tensor.
    pub fn read_u8(&self, name: &str) -> Result<Vec<u8>, CheckpointError> {
        let info = self.info(name)?;
        if info.dtype != Dtype::U8 {
            return Err(CheckpointError::UnsupportedDtype {
                name: name.to_string(),
                file: self.path.clone(),
                dtype: format!("{:?} (MXFP4 blocks and scales are U8)", info.dtype),
            });
        }
        let (start, end) = info.data_offsets;
        let offset = 8 + self.header_len;
        Ok(self.mmap[offset + start..offset + end].to_vec())
    }

    fn info(&self, name: &str) -> Result<&TensorInfo, CheckpointError> {
        self.meta
            .info(name)
            .ok_or_else(|| CheckpointError::MissingTensor {
                name: name.to_string(),
                dir: self.path.clone(),
                expected: vec![],
            })
    }

    /// The values of `name` (`info`) at byte range `bytes` of the data section, as `shape`.
    fn decoded(
        &self,
        name: &str,
        info: &TensorInfo,
        bytes: Range<usize>,
        shape: Vec<usize>,
    ) -> Result<HostTensor, CheckpointError> {
        let offset = 8 + self.header_len;
        let raw = &self.mmap[offset + bytes.start..offset + bytes.end];
        let data = decode(raw, info.dtype).ok_or_else(|| CheckpointError::UnsupportedDtype {
            name: name.to_string(),
            file: self.path.clone(),
            dtype: format!("{:?}", info.dtype),
        })?;
        Ok(HostTensor::new(shape, data))
    }

    /// Drops tensor `name`'s pages from this process's memory once it has been read: the
    /// mapping stays valid (pages come back from the file if touched again), but a load no
    /// longer counts the whole checkpoint file as resident by the time the last tensor is read.
    /// Best effort: an unknown name or an OS refusal leaves the pages where they are.
    pub fn release(&self, name: &str) {
        #[cfg(unix)]
        if let Some(info) = self.meta.info(name) {
            let (start, end) = info.data_offsets;
            // SAFETY: a read-only shared file mapping; no borrow of it is alive while `self`
            // is only borrowed here, and touched pages are re-read from the file afterwards.
            let _ = unsafe {
                self.mmap.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    8 + self.header_len + start,
                    end - start,
                )
            };
        }
        #[cfg(not(unix))]
        let _ = name;
    }

    /// Reads an integer tensor (token ids, labels) as i64.
    pub fn read_i64(&self, name: &str) -> Result<Vec<i64>, CheckpointError> {
        let info = self
            .meta
            .info(name)
            .ok_or_else(|| CheckpointError::MissingTensor {
                name: name.to_string(),
                dir: self.path.clone(),
                expected: vec![],
            })?;
        let (start, end) = info.data_offsets;
        let bytes = &self.mmap[8 + self.header_len + start..8 + self.header_len + end];
        match info.dtype {
            Dtype::I64 => Ok(bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect()),
            Dtype::I32 => Ok(bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
                .collect()),
            other => Err(CheckpointError::UnsupportedDtype {
                name: name.to_string(),
                file: self.path.clone(),
                dtype: format!("{other:?} (expected an integer tensor)"),
            }),
        }
    }

    /// The stored bytes of a tensor, undecoded (packed int4 weights), with dtype and shape.
    pub fn raw(&self, name: &str) -> Result<(Dtype, Vec<usize>, &[u8]), CheckpointError> {
        let info = self
            .meta
            .info(name)
            .ok_or_else(|| CheckpointError::MissingTensor {
                name: name.to_string(),
                dir: self.path.clone(),
                expected: vec![],
            })?;
        let (start, end) = info.data_offsets;
        Ok((
            info.dtype,
            info.shape.clone(),
            &self.mmap[8 + self.header_len + start..8 + self.header_len + end],
        ))
    }

    pub fn dtype(&self, name: &str) -> Option<Dtype> {
        self.meta.info(name).map(|i| i.dtype)
    }

    /// The header's `__metadata__` string map (`{"format": "pt"}`, DCP's sharding info), if any.
    pub fn user_metadata(&self) -> Option<&HashMap<String, String>> {
        self.meta.metadata().as_ref()
    }
}

/// The largest header safetensors reads (its `MAX_HEADER_SIZE`); larger ones it refuses itself.
const MAX_HEADER_BYTES: usize = 100_000_000;

/// Refuses a header whose tensor data ends past the end of the file. safetensors 0.6's
/// `read_metadata` adds that end to the header length unchecked, which overflows (a panic with
/// overflow checks on) for offsets near `u64::MAX`; every other defect is left to it to report.
fn check_data_offsets(bytes: &[u8]) -> Result<(), String> {
    let Some(len) = bytes.get(..8).and_then(|b| <[u8; 8]>::try_from(b).ok()) else {
        return Ok(());
    };
    let Some(header) = usize::try_from(u64::from_le_bytes(len))
        .ok()
        .filter(|&n| n <= MAX_HEADER_BYTES)
        .and_then(|n| bytes.get(8..8 + n))
    else {
        return Ok(());
    };
    let Ok(serde_json::Value::Object(entries)) = serde_json::from_slice(header) else {
        return Ok(());
    };
    let data_len = (bytes.len() - 8 - header.len()) as u64;
    for (name, info) in entries.iter().filter(|(name, _)| *name != "__metadata__") {
        let end = info
            .get("data_offsets")
            .and_then(|o| o.get(1))
            .and_then(serde_json::Value::as_u64);
        if let Some(end) = end.filter(|&end| end > data_len) {
            return Err(format!(
                "tensor `{name}` has data_offsets ending at byte {end}, but the file holds {data_len} bytes of tensor data"
            ));
        }
    }
    Ok(())
}

/// Little-endian bytes of `dtype` as f32, decoded in parallel (a load decodes every weight,
/// tensor by tensor).
fn decode(bytes: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
    use rayon::prelude::*;
    let width = match dtype {
        Dtype::F32 => 4,
        Dtype::BF16 | Dtype::F16 => 2,
        _ => return None,
    };
    let one = move |c: &[u8]| match dtype {
        Dtype::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        Dtype::BF16 => half::bf16::from_le_bytes([c[0], c[1]]).to_f32(),
        _ => half::f16::from_le_bytes([c[0], c[1]]).to_f32(),
    };
    let mut out = vec![0.0f32; bytes.len() / width];
    const CHUNK: usize = 1 << 16;
    out.par_chunks_mut(CHUNK)
        .zip(bytes.par_chunks(CHUNK * width))
        .for_each(|(dst, src)| {
            for (v, c) in dst.iter_mut().zip(src.chunks_exact(width)) {
                *v = one(c);
            }
        });
    Some(out)
}

/// The storage dtype for saved weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StorageDtype {
    F32,
    BF16,
    F16,
}

impl StorageDtype {
    pub fn from_safetensors(dtype: Dtype) -> Self {
        match dtype {
            Dtype::BF16 => Self::BF16,
            Dtype::F16 => Self::F16,
            _ => Self::F32,
        }
    }

    /// The `torch_dtype`/`dtype` string transformers writes into config.json.
    pub fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::BF16 => "bfloat16",
            Self::F16 => "float16",
        }
    }

    pub fn safetensors(self) -> Dtype {
        match self {
            Self::F32 => Dtype::F32,
            Self::BF16 => Dtype::BF16,
            Self::F16 => Dtype::F16,
        }
    }

    pub fn encode(self, data: &[f32]) -> Vec<u8> {
        match self {
            Self::F32 => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Self::BF16 => data
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            Self::F16 => data
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
        }
    }

    pub fn bytes_per_element(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::BF16 | Self::F16 => 2,
        }
    }
}

/// Writes one safetensors file with `{"format": "pt"}` metadata, which transformers requires.
pub fn write_file(
    path: &Path,
    tensors: &[(String, HostTensor)],
    dtype: StorageDtype,
) -> Result<(), CheckpointError> {
    let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.shape.clone(), dtype.encode(&t.data)))
        .collect();
    write_encoded(path, &encoded, dtype.safetensors())
}

/// Writes already-encoded tensors (e.g. packed int4) with their own dtype.
pub fn write_encoded(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<u8>)],
    dtype: Dtype,
) -> Result<(), CheckpointError> {
    write_stored(
        path,
        tensors
            .iter()
            .map(|(name, shape, bytes)| (name, dtype, shape, bytes.as_slice())),
    )
}

/// Writes tensors that each carry their own dtype (a quantized export mixes U8 and floats).
pub fn write_mixed(
    path: &Path,
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
) -> Result<(), CheckpointError> {
    write_stored(
        path,
        tensors
            .iter()
            .map(|(name, dtype, shape, bytes)| (name, *dtype, shape, bytes.as_slice())),
    )
}

/// The one writer of a safetensors file: each tensor's stored bytes with its dtype and shape,
/// and the `{"format": "pt"}` metadata transformers requires.
fn write_stored<'a>(
    path: &Path,
    tensors: impl Iterator<Item = (&'a String, Dtype, &'a Vec<usize>, &'a [u8])>,
) -> Result<(), CheckpointError> {
    let mut views = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let view =
            TensorView::new(dtype, shape.clone(), bytes).map_err(|e| CheckpointError::Invalid {
                path: path.to_path_buf(),
                message: format!("{name}: {e}"),
            })?;
        views.push((name.clone(), view));
    }
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize_to_file(views, Some(meta), path).map_err(|e| CheckpointError::Invalid {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// The file (from 0) each tensor of a state dict goes to, given each one's size in bytes, as
/// transformers' `save_pretrained` splits them: in order, a new file whenever the next tensor
/// would take the current one over `max_shard_bytes` (a tensor larger than that gets a file of
/// its own). Sharded saves use it too, so every rank puts a tensor in the same file.
pub fn file_of_each(sizes: impl IntoIterator<Item = usize>, max_shard_bytes: usize) -> Vec<usize> {
    let (mut file, mut current, mut in_file, mut out) = (0usize, 0usize, 0usize, Vec::new());
    for size in sizes {
        if current + size > max_shard_bytes && in_file > 0 {
            file += 1;
            current = 0;
            in_file = 0;
        }
        current += size;
        in_file += 1;
        out.push(file);
    }
    out
}

/// Saves a state dict the way transformers' `save_pretrained` does: one `model.safetensors`
/// when it fits in `max_shard_bytes`, otherwise `model-0000i-of-0000n.safetensors` shards plus
/// `model.safetensors.index.json`. Returns the written file names.
pub fn save_sharded(
    dir: &Path,
    tensors: &[(String, HostTensor)],
    dtype: StorageDtype,
    max_shard_bytes: usize,
) -> Result<Vec<String>, CheckpointError> {
    save_sharded_with(dir, tensors, dtype, &[], max_shard_bytes)
}

/// A tensor copied as stored: name, dtype, shape and its bytes.
pub type StoredTensor<'a> = (String, Dtype, Vec<usize>, &'a [u8]);

/// [`save_sharded`] with `copied` tensors after `tensors`, written byte for byte in their own
/// dtypes (a multimodal checkpoint's vision tower beside the language model tune trained).
pub fn save_sharded_with(
    dir: &Path,
    tensors: &[(String, HostTensor)],
    dtype: StorageDtype,
    copied: &[StoredTensor],
    max_shard_bytes: usize,
) -> Result<Vec<String>, CheckpointError> {
    let bytes = dtype.bytes_per_element();
    let sizes = tensors
        .iter()
        .map(|(_, t)| t.numel() * bytes)
        .chain(copied.iter().map(|(_, _, _, b)| b.len()));
    let files = file_of_each(sizes, max_shard_bytes);
    let n = files.last().map_or(1, |last| last + 1);
    let file_name = |i: usize| {
        if n == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
        }
    };
    let mut weight_map = BTreeMap::new();
    let mut total = 0usize;
    let mut names = Vec::with_capacity(n + 1);
    for i in 0..n {
        let file = file_name(i);
        let in_file = |k: usize| files[k] == i;
        let encoded: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .enumerate()
            .filter(|(k, _)| in_file(*k))
            .map(|(_, (name, t))| {
                (
                    name.clone(),
                    dtype.safetensors(),
                    t.shape.clone(),
                    dtype.encode(&t.data),
                )
            })
            .collect();
        let raw = copied
            .iter()
            .enumerate()
            .filter(|(k, _)| in_file(tensors.len() + k))
            .map(|(_, (n, d, s, b))| (n, *d, s, *b));
        let entries = encoded
            .iter()
            .map(|(n, d, s, b)| (n, *d, s, b.as_slice()))
            .chain(raw);
        for (name, _, _, bytes) in entries.clone() {
            weight_map.insert(name.clone(), file.clone());
            total += bytes.len();
        }
        write_stored(&dir.join(&file), entries)?;
        names.push(file);
    }
    if n == 1 {
        return Ok(names);
    }
    let index =
        serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    let path = dir.join(INDEX_FILE);
    let text = serde_json::to_string_pretty(&index).unwrap_or_default();
    std::fs::write(&path, text + "\n").map_err(CheckpointError::io(&path))?;
    names.push(INDEX_FILE.to_string());
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_rows_reads_those_rows_in_every_dtype_and_refuses_others() {
        let dir = tempfile::tempdir().expect("tempdir");
        let whole = HostTensor::new(vec![5, 3], (0..15).map(|x| x as f32).collect());
        for dtype in [StorageDtype::F32, StorageDtype::BF16] {
            let path = dir.path().join("w.safetensors");
            write_file(&path, &[("w".to_string(), whole.clone())], dtype).expect("write");
            let file = SafetensorsFile::open(&path).expect("open");
            for rows in [0..3, 3..5, 5..5] {
                assert_eq!(
                    file.read_rows("w", rows.clone()).expect("rows"),
                    whole.rows(rows.start, rows.len()),
                    "{dtype:?} {rows:?}"
                );
            }
            let err = file.read_rows("w", 4..6).expect_err("past the end");
            assert!(err.to_string().contains("no rows 4..6"), "{err}");
        }
    }
}
