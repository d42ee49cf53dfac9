//! `Weights`: all tensors of a Hugging Face checkpoint directory (one file, or shards listed by
//! `model.safetensors.index.json`), read in parallel, handed out by name with shape checks.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use super::error::CheckpointError;
use super::host::HostTensor;
use super::safetensors_io::{INDEX_FILE, SINGLE_FILE, SafetensorsFile, StorageDtype};

/// One tensor read from a shard: name, value, file, on-disk dtype.
type ShardTensor = (String, HostTensor, PathBuf, StorageDtype);

pub struct Weights {
    pub dir: PathBuf,
    tensors: HashMap<String, (HostTensor, PathBuf)>,
    taken: BTreeSet<String>,
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

impl Weights {
    pub fn open(dir: &Path, explicit_files: Option<&[String]>) -> Result<Self, CheckpointError> {
        let files = checkpoint_files(dir, explicit_files)?;
        // One thread per shard: conversion to f32 dominates load time for bf16 checkpoints.
        let results: Vec<Result<Vec<ShardTensor>, CheckpointError>> = std::thread::scope(|s| {
            let handles: Vec<_> = files
                .iter()
                .map(|path| {
                    s.spawn(move || {
                        let file = SafetensorsFile::open(path)?;
                        let mut out = Vec::new();
                        for name in file.names() {
                            let dtype = file
                                .dtype(&name)
                                .map(StorageDtype::from_safetensors)
                                .unwrap_or(StorageDtype::F32);
                            out.push((name.clone(), file.read(&name)?, path.clone(), dtype));
                        }
                        Ok(out)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(CheckpointError::Invalid {
                            path: dir.to_path_buf(),
                            message: "reader thread panicked".into(),
                        })
                    })
                })
                .collect()
        });
        let mut tensors = HashMap::new();
        let mut dtype_counts: HashMap<StorageDtype, usize> = HashMap::new();
        for result in results {
            for (name, tensor, path, dtype) in result? {
                *dtype_counts.entry(dtype).or_default() += 1;
                tensors.insert(name, (tensor, path));
            }
        }
        let storage_dtype = dtype_counts
            .into_iter()
            .max_by_key(|(_, n)| *n)
            .map(|(d, _)| d)
            .unwrap_or(StorageDtype::F32);
        Ok(Self {
            dir: dir.to_path_buf(),
            tensors,
            taken: BTreeSet::new(),
            storage_dtype,
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    /// Takes tensor `name`, checking it has `expected` shape.
    pub fn take(&mut self, name: &str, expected: &[usize]) -> Result<HostTensor, CheckpointError> {
        let (tensor, file) =
            self.tensors
                .remove(name)
                .ok_or_else(|| CheckpointError::MissingTensor {
                    name: name.to_string(),
                    dir: self.dir.clone(),
                    expected: expected.to_vec(),
                })?;
        if tensor.shape != expected {
            return Err(CheckpointError::ShapeMismatch {
                name: name.to_string(),
                file,
                expected: expected.to_vec(),
                found: tensor.shape,
            });
        }
        self.taken.insert(name.to_string());
        Ok(tensor)
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
