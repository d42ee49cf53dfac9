//! `Weights`: all tensors of a Hugging Face checkpoint directory (one file, or shards listed by
//! `model.safetensors.index.json`, or, when neither is there, PyTorch DCP per-rank shard files in
//! `sharded/` or in the directory itself), memory-mapped and decoded one tensor at a time as the model
//! takes them by name, with shape checks: a load never holds the whole checkpoint in f32.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use super::dcp::{DcpCheckpoint, SHARDED_DIR, is_dcp_dir};
use super::error::CheckpointError;
use super::host::HostTensor;
use super::safetensors_io::{INDEX_FILE, SINGLE_FILE, SafetensorsFile, StorageDtype};

pub struct Weights {
    pub dir: PathBuf,
    files: Vec<SafetensorsFile>,
    /// The DCP shard files, when the directory holds those instead (then `files` is empty).
    dcp: Option<DcpCheckpoint>,
    /// Tensor name -> index into `files` (0 for DCP), for the tensors not yet taken.
    tensors: HashMap<String, usize>,
    taken: BTreeSet<String>,
    /// The checkpoint's name of each tensor [`Weights::rename`] gave another name.
    stored: HashMap<String, String>,
    /// The dtype most tensors were stored in, so saves can keep it.
    pub storage_dtype: StorageDtype,
}

/// The safetensors files of a checkpoint directory, in order.
pub fn checkpoint_files(
    dir: &Path,
    explicit: Option<&[String]>,
) -> Result<Vec<PathBuf>, CheckpointError> {
    if !dir.is_dir() {
        return Err(CheckpointError::NoWeights {
            dir: dir.to_path_buf(),
            hint: "; the directory does not exist (check checkpointer.checkpoint_dir)".into(),
        });
    }
    if let Some(files) = explicit.filter(|f| !f.is_empty()) {
        return files
            .iter()
            .map(|f| {
                let p = dir.join(f);
                if p.is_file() {
                    Ok(p)
                } else {
                    Err(CheckpointError::MissingShard {
                        index: dir.to_path_buf(),
                        shard: f.clone(),
                    })
                }
            })
            .collect();
    }
    let index = dir.join(INDEX_FILE);
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(CheckpointError::io(&index))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| CheckpointError::BadIndex {
                path: index.clone(),
                message: e.to_string(),
            })?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| CheckpointError::BadIndex {
                path: index.clone(),
                message: "no \"weight_map\" object".into(),
            })?;
        let mut shards = BTreeSet::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| CheckpointError::BadIndex {
                path: index.clone(),
                message: format!("weight_map[\"{name}\"] is not a file name"),
            })?;
            shards.insert(file.to_string());
        }
        return shards
            .into_iter()
            .map(|s| {
                let p = dir.join(&s);
                if p.is_file() {
                    Ok(p)
                } else {
                    Err(CheckpointError::MissingShard {
                        index: index.clone(),
                        shard: s,
                    })
                }
            })
            .collect();
    }
    let single = dir.join(SINGLE_FILE);
    if single.is_file() {
        return Ok(vec![single]);
    }
    let hint = if dir.join("pytorch_model.bin").exists() || dir.join("consolidated.00.pth").exists()
    {
        "; found PyTorch .bin/.pth weights: tune reads safetensors only (convert with transformers' save_pretrained(safe_serialization=True))"
    } else {
        ""
    };
    Err(CheckpointError::NoWeights {
        dir: dir.to_path_buf(),
        hint: hint.into(),
    })
}

/// The directory of DCP shard files to load `dir` from: `dir/sharded/` or `dir` itself, when
/// `dir` has neither `model.safetensors.index.json` nor `model.safetensors` (a consolidated
/// checkpoint wins over the shards it was made from).
pub fn dcp_source(dir: &Path) -> Option<PathBuf> {
    if dir.join(INDEX_FILE).is_file() || dir.join(SINGLE_FILE).is_file() {
        return None;
    }
    let sharded = dir.join(SHARDED_DIR);
    if is_dcp_dir(&sharded) {
        Some(sharded)
    } else if is_dcp_dir(dir) {
        Some(dir.to_path_buf())
    } else {
        None
    }
}

impl Weights {
    pub fn open(dir: &Path, explicit_files: Option<&[String]>) -> Result<Self, CheckpointError> {
        if explicit_files.is_none_or(<[String]>::is_empty)
            && let Some(sharded) = dcp_source(dir)
        {
            return Self::open_dcp(dir, &sharded);
        }
        let paths = checkpoint_files(dir, explicit_files)?;
        let mut files = Vec::with_capacity(paths.len());
        let mut tensors = HashMap::new();
        let mut dtype_counts: HashMap<StorageDtype, usize> = HashMap::new();
        for path in &paths {
            let file = SafetensorsFile::open(path)?;
            for name in file.names() {
                // MXFP4's bytes say nothing of the float weights' dtype.
                if file.dtype(&name) != Some(safetensors::Dtype::U8) {
                    *dtype_counts.entry(stored_dtype(&file, &name)).or_default() += 1;
                }
                tensors.insert(name, files.len());
            }
            files.push(file);
        }
        let storage_dtype = most_common(dtype_counts);
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            dcp: None,
            tensors,
            taken: BTreeSet::new(),
            stored: HashMap::new(),
            storage_dtype,
        })
    }

    fn open_dcp(dir: &Path, sharded: &Path) -> Result<Self, CheckpointError> {
        let dcp = DcpCheckpoint::open(sharded)?;
        let mut dtype_counts: HashMap<StorageDtype, usize> = HashMap::new();
        let mut tensors = HashMap::new();
        for name in dcp.names() {
            let dtype = dcp
                .dtype(name)
                .map(StorageDtype::from_safetensors)
                .unwrap_or(StorageDtype::F32);
            *dtype_counts.entry(dtype).or_default() += 1;
            tensors.insert(name.clone(), 0);
        }
        let storage_dtype = most_common(dtype_counts);
        Ok(Self {
            dir: dir.to_path_buf(),
            files: vec![],
            dcp: Some(dcp),
            tensors,
            taken: BTreeSet::new(),
            stored: HashMap::new(),
            storage_dtype,
        })
    }

    /// Reads each tensor under the name `rename` gives it, and sets aside the tensors it gives
    /// none (a multimodal checkpoint's vision tower, when its language model is read as a text
    /// model): those are no longer looked up, nor reported by [`Self::finish`].
    pub fn rename(&mut self, rename: impl Fn(&str) -> Option<String>) {
        let mut tensors = HashMap::with_capacity(self.tensors.len());
        for (name, index) in std::mem::take(&mut self.tensors) {
            if let Some(new) = rename(&name) {
                if new != name {
                    self.stored.insert(new.clone(), name);
                }
                tensors.insert(new, index);
            }
        }
        self.tensors = tensors;
    }

    /// The checkpoint's own name for tensor `name`.
    fn stored_name<'a>(&'a self, name: &'a str) -> &'a str {
        self.stored.get(name).map_or(name, String::as_str)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    /// The dtype tensor `name` is stored in (before it is taken).
    pub fn dtype(&self, name: &str) -> Option<StorageDtype> {
        if let Some(dcp) = &self.dcp {
            self.tensors.get(name)?;
            return dcp
                .dtype(self.stored_name(name))
                .map(StorageDtype::from_safetensors);
        }
        let file = &self.files[*self.tensors.get(name)?];
        Some(stored_dtype(file, self.stored_name(name)))
    }

    /// Takes tensor `name`, checking it has `expected` shape.
    pub fn take(&mut self, name: &str, expected: &[usize]) -> Result<HostTensor, CheckpointError> {
        self.take_part(name, expected, None, true)
    }

    /// Takes rows `rows` (of dim 0) of tensor `name`, checking the whole tensor has `expected`
    /// shape: only those rows are read and decoded (FSDP's per-rank load).
    pub fn take_rows(
        &mut self,
        name: &str,
        expected: &[usize],
        rows: std::ops::Range<usize>,
    ) -> Result<HostTensor, CheckpointError> {
        self.take_part(name, expected, Some(rows), true)
    }

    /// Reads rows `rows` of tensor `name` as [`Self::take_rows`] does, leaving it to be read
    /// again: a weight read a few rows at a time (an NF4 base's per-rank quantization), then
    /// marked taken with [`Self::done`].
    pub fn read_rows(
        &mut self,
        name: &str,
        expected: &[usize],
        rows: std::ops::Range<usize>,
    ) -> Result<HostTensor, CheckpointError> {
        self.take_part(name, expected, Some(rows), false)
    }

    /// Marks tensor `name`, read with [`Self::read_rows`], as taken (its pages released).
    pub fn done(&mut self, name: &str) {
        if let Some(index) = self.tensors.remove(name) {
            let stored = self.stored_name(name);
            match &self.dcp {
                Some(dcp) => dcp.release(stored),
                None => self.files[index].release(stored),
            }
            self.taken.insert(name.to_string());
        }
    }

    /// Where tensor `name` is (its index in `files`, 0 for DCP), after checking it is there
    /// with `expected` shape.
    fn locate(&self, name: &str, expected: &[usize]) -> Result<usize, CheckpointError> {
        let index =
            self.tensors
                .get(name)
                .copied()
                .ok_or_else(|| CheckpointError::MissingTensor {
                    name: name.to_string(),
                    dir: self.dir.clone(),
                    expected: expected.to_vec(),
                })?;
        // A sharded (DCP) checkpoint's pieces, or one safetensors file.
        let stored = self.stored_name(name);
        let (path, found) = match &self.dcp {
            Some(dcp) => (&dcp.dir, dcp.shape(stored).unwrap_or_default().to_vec()),
            None => (
                &self.files[index].path,
                self.files[index].shape(stored).unwrap_or_default(),
            ),
        };
        if found != expected {
            return Err(CheckpointError::ShapeMismatch {
                name: stored.to_string(),
                file: path.clone(),
                expected: expected.to_vec(),
                found,
            });
        }
        Ok(index)
    }

    fn take_part(
        &mut self,
        name: &str,
        expected: &[usize],
        rows: Option<std::ops::Range<usize>>,
        consume: bool,
    ) -> Result<HostTensor, CheckpointError> {
        let index = self.locate(name, expected)?;
        let stored = self.stored_name(name);
        let tensor = match (&self.dcp, rows) {
            (Some(dcp), Some(rows)) => dcp.read_rows(stored, rows)?,
            (Some(dcp), None) => dcp.read(stored)?,
            (None, Some(rows)) => self.files[index].read_rows(stored, rows)?,
            (None, None) => self.files[index].read(stored)?,
        };
        if consume {
            self.done(name);
        }
        Ok(tensor)
    }

    /// Takes the `U8` tensor `name` (MXFP4's codes or scales) as its bytes, checking it has
    /// `expected` shape.
    pub fn take_u8(&mut self, name: &str, expected: &[usize]) -> Result<Vec<u8>, CheckpointError> {
        let index = self.locate(name, expected)?;
        let stored = self.stored_name(name);
        let bytes = match &self.dcp {
            Some(dcp) => {
                return Err(CheckpointError::UnsupportedDtype {
                    name: stored.to_string(),
                    file: dcp.dir.clone(),
                    dtype: "U8 in DCP shards (tune reads MXFP4 from safetensors files)".into(),
                });
            }
            None => self.files[index].read_u8(stored)?,
        };
        self.done(name);
        Ok(bytes)
    }

    /// Errors if tensors remain that nothing took (ignoring names in `ignorable`).
    pub fn finish(self, ignorable: impl Fn(&str) -> bool) -> Result<(), CheckpointError> {
        let mut left: Vec<&String> = self.tensors.keys().filter(|n| !ignorable(n)).collect();
        if left.is_empty() {
            return Ok(());
        }
        left.sort();
        let shown: Vec<&str> = left.iter().take(5).map(|s| s.as_str()).collect();
        let more = if left.len() > 5 {
            format!(" and {} more", left.len() - 5)
        } else {
            String::new()
        };
        Err(CheckpointError::UnexpectedTensors {
            dir: self.dir,
            names: format!("{}{more}", shown.join(", ")),
        })
    }
}

fn stored_dtype(file: &SafetensorsFile, name: &str) -> StorageDtype {
    file.dtype(name)
        .map(StorageDtype::from_safetensors)
        .unwrap_or(StorageDtype::F32)
}

/// The dtype most tensors are stored in (fp32 on a tie, or with no tensors).
fn most_common(counts: HashMap<StorageDtype, usize>) -> StorageDtype {
    counts
        .into_iter()
        .max_by_key(|(d, n)| (*n, *d == StorageDtype::F32))
        .map(|(d, _)| d)
        .unwrap_or(StorageDtype::F32)
}
