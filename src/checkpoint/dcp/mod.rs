//! PyTorch distributed-checkpoint (DCP) sharded safetensors, as torch's
//! `HuggingFaceStorageWriter(save_distributed=True)` writes them, and their consolidation into an
//! ordinary Hugging Face checkpoint, as torch's `consolidate_safetensors_files` does.
//!
//! # Layout (torch 2.15, `torch/distributed/checkpoint/_hf_utils.py` and `filesystem.py`)
//!
//! - Every rank writes its own files, named `shard-{r:05}-model-{k:05}-of-{n:05}.safetensors`:
//!   `r` is the rank numbered from 1 (torch's `prepare_global_plan` enumerates the plans with
//!   `start=1`), `k` of `n` is the output file the tensor belongs to (torch's
//!   `fqn_to_index_mapping`, numbered from 1; 1 of 1 without one). With
//!   `enable_consolidation=True` torch writes them under `<path>/sharded/` ([`SHARDED_DIR`]).
//! - Each tensor in a shard file is that rank's piece of it, in the tensor's own dtype.
//! - The header's `__metadata__` holds `"DCP_SHARDING_INFO"`: a JSON string mapping every tensor
//!   of the file to `{"saved_offsets": [..]}`, the piece's offset in the full tensor along every
//!   dim; `"DCP_VERSION": "1.0"` and `"format": "pt"`.
//! - The full shape is stored nowhere: it is, per dim, the largest `offset + size` of the
//!   pieces (torch's reader and consolidation compute it the same way). A piece may be empty: a
//!   tensor of 1 row sharded on 2 ranks gives rank 2 a `[0, cols]` piece at offset `[1, 0]`.
//! - Consolidation writes `model-{k:05}-of-{n:05}.safetensors` (even for 1 of 1) with the full
//!   tensors and `model.safetensors.index.json` (`metadata.total_size`: the tensor bytes,
//!   `weight_map`: tensor name -> file). On `world` ranks, rank `r` writes the files whose
//!   `k % world == r` (torch's `consolidate_safetensors_files_on_every_rank`); rank 0 the index.
//!
//! # Invariants [`DcpCheckpoint::open`] checks
//!
//! - The ranks in the file names are 1..=R with none missing. A missing *last* rank cannot be
//!   told from the names, nor from torch's metadata (the inferred full shape just shrinks); tune's
//!   writer also records each tensor's full shape ([`FULL_SHAPES_KEY`], which torch ignores), and
//!   where it is recorded the inferred shape must equal it.
//! - Every tensor's pieces have one dtype, one number of dims, one output file `k` (of one
//!   `n`), and tile the full shape exactly: the pieces' volumes add up to the full volume and no
//!   two pieces overlap (so there is no gap either). Torch checks none of this and would
//!   consolidate zeros into a gap.
//!
//! tune's FSDP shards rows evenly ([`row_range`]: `ceil(rows / world)` rows per rank, the last
//! ranks shorter or empty, as `torch.chunk` and DTensor's `Shard(0)` split them); the reader
//! takes pieces at any offsets in any dims, as torch allows.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;

use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};

use super::error::CheckpointError;
use super::host::HostTensor;
use super::safetensors_io::{SafetensorsFile, StorageDtype};

mod consolidate;
pub use consolidate::{consolidate, consolidate_dir, consolidate_rank_files, write_index};

/// The folder under a checkpoint directory that torch writes the shard files into when it
/// consolidates (`SHARDED_DIR_NAME`).
pub const SHARDED_DIR: &str = "sharded";
/// `__metadata__` key of the per-tensor offsets (`DCP_SHARDING_INFO_KEY`).
pub const SHARDING_INFO_KEY: &str = "DCP_SHARDING_INFO";
/// `__metadata__` key of the format version (`DCP_VERSION_KEY`), written as `str(1.0)`.
pub const VERSION_KEY: &str = "DCP_VERSION";
pub const VERSION: &str = "1.0";
/// The key of a piece's offsets inside `DCP_SHARDING_INFO` (`SAVED_OFFSETS_KEY`).
pub const SAVED_OFFSETS_KEY: &str = "saved_offsets";
/// tune's own `__metadata__` key (torch ignores it): JSON name -> full shape of every tensor of
/// the file. Torch stores no full shape, so a lost shard file of the *last* rank would go
/// unnoticed (the inferred shape just shrinks); for files tune wrote the reader compares.
pub const FULL_SHAPES_KEY: &str = "TUNE_FULL_SHAPES";

/// `shard-{rank + 1:05}-model-{file:05}-of-{files:05}.safetensors`: `rank` from 0 as tune counts
/// ranks, `file` from 1 as torch counts files.
pub fn shard_file_name(rank: usize, file: usize, files: usize) -> String {
    format!(
        "shard-{:05}-model-{file:05}-of-{files:05}.safetensors",
        rank + 1
    )
}

/// `model-{file:05}-of-{files:05}.safetensors`, the consolidated file names (`file` from 1).
pub fn consolidated_file_name(file: usize, files: usize) -> String {
    format!("model-{file:05}-of-{files:05}.safetensors")
}

/// Parses a shard file name into (rank from 1, file from 1, files).
fn parse_shard_file_name(name: &str) -> Option<(usize, usize, usize)> {
    let rest = name.strip_prefix("shard-")?.strip_suffix(".safetensors")?;
    let (rank, rest) = rest.split_once("-model-")?;
    let (file, files) = rest.split_once("-of-")?;
    let num = |s: &str| {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse::<usize>().ok())
            .flatten()
    };
    Some((num(rank)?, num(file)?, num(files)?))
}

/// Rank `rank`'s rows of a tensor of `rows` rows split over `world` ranks: `ceil(rows / world)`
/// each, the last ones shorter or empty (then starting at `rows`), as DTensor's `Shard(0)` does.
pub fn row_range(rows: usize, rank: usize, world: usize) -> Range<usize> {
    let per = rows.div_ceil(world.max(1));
    let start = (rank * per).min(rows);
    start..(start + per).min(rows)
}

/// One rank's piece of a tensor, to write: its little-endian bytes in `dtype`, the piece's
/// shape, the full tensor's shape and the piece's offsets in it.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub full_shape: Vec<usize>,
    pub offsets: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl Piece {
    /// A piece from raw little-endian bytes.
    pub fn raw(
        name: impl Into<String>,
        dtype: Dtype,
        shape: Vec<usize>,
        full_shape: Vec<usize>,
        offsets: Vec<usize>,
        bytes: Vec<u8>,
    ) -> Self {
        Self {
            name: name.into(),
            dtype,
            shape,
            full_shape,
            offsets,
            bytes,
        }
    }

    /// A piece from a host tensor (the piece itself), stored as `dtype`.
    pub fn from_host(
        name: impl Into<String>,
        piece: &HostTensor,
        dtype: StorageDtype,
        full_shape: Vec<usize>,
        offsets: Vec<usize>,
    ) -> Self {
        Self::raw(
            name,
            dtype.safetensors(),
            piece.shape.clone(),
            full_shape,
            offsets,
            dtype.encode(&piece.data),
        )
    }

    /// Rank `rank`'s dim-0 slice ([`row_range`]) of the full tensor `full`, stored as `dtype`.
    /// A 0-dim tensor is not split: rank 0 holds it, the others get nothing (`None`).
    pub fn rows_of(
        name: impl Into<String>,
        full: &HostTensor,
        dtype: StorageDtype,
        rank: usize,
        world: usize,
    ) -> Option<Self> {
        if full.shape.is_empty() {
            return (rank == 0).then(|| Self::from_host(name, full, dtype, vec![], vec![]));
        }
        let rows = row_range(full.shape[0], rank, world);
        let mut offsets = vec![0; full.shape.len()];
        offsets[0] = rows.start;
        Some(Self::from_host(
            name,
            &full.rows(rows.start, rows.len()),
            dtype,
            full.shape.clone(),
            offsets,
        ))
    }
}

/// Writes rank `rank`'s (of `world`, from 0) shard file `file` of `files` (from 1) into `dir`,
/// named and tagged as torch's `HuggingFaceStorageWriter(save_distributed=True)` does, and
/// returns its path. Written to a temporary name, fsynced and renamed: the file is complete or
/// absent. Every piece must lie inside its full shape and hold `product(shape)` elements.
pub fn write_shard(
    dir: &Path,
    rank: usize,
    world: usize,
    file: usize,
    files: usize,
    pieces: &[Piece],
) -> Result<PathBuf, CheckpointError> {
    let path = dir.join(shard_file_name(rank, file, files));
    let invalid = |message: String| CheckpointError::Invalid {
        path: path.clone(),
        message,
    };
    if rank >= world {
        return Err(invalid(format!(
            "rank {rank} is not below the world size {world}"
        )));
    }
    if file == 0 || file > files {
        return Err(invalid(format!(
            "file index {file} is not in 1..={files} (torch numbers files from 1)"
        )));
    }
    let mut info = serde_json::Map::new();
    let mut full_shapes = serde_json::Map::new();
    let mut views = Vec::with_capacity(pieces.len());
    for p in pieces {
        if p.shape.len() != p.full_shape.len() || p.offsets.len() != p.full_shape.len() {
            return Err(invalid(format!(
                "{}: piece shape {:?}, offsets {:?} and full shape {:?} differ in rank",
                p.name, p.shape, p.offsets, p.full_shape
            )));
        }
        let outside = p
            .shape
            .iter()
            .zip(&p.offsets)
            .zip(&p.full_shape)
            .any(|((&s, &o), &f)| o.checked_add(s).is_none_or(|end| end > f));
        if outside {
            return Err(invalid(format!(
                "{}: piece {:?} at offsets {:?} does not fit in the full shape {:?}",
                p.name, p.shape, p.offsets, p.full_shape
            )));
        }
        if info.contains_key(&p.name) {
            return Err(invalid(format!(
                "{}: two pieces of one tensor in one file",
                p.name
            )));
        }
        info.insert(
            p.name.clone(),
            serde_json::json!({ SAVED_OFFSETS_KEY: p.offsets }),
        );
        full_shapes.insert(p.name.clone(), serde_json::json!(p.full_shape));
        let view = TensorView::new(p.dtype, p.shape.clone(), &p.bytes)
            .map_err(|e| invalid(format!("{}: {e}", p.name)))?;
        views.push((p.name.clone(), view));
    }
    let meta: HashMap<String, String> = [
        (
            SHARDING_INFO_KEY.to_string(),
            serde_json::Value::Object(info).to_string(),
        ),
        (VERSION_KEY.to_string(), VERSION.to_string()),
        (
            FULL_SHAPES_KEY.to_string(),
            serde_json::Value::Object(full_shapes).to_string(),
        ),
        ("format".to_string(), "pt".to_string()),
    ]
    .into();
    let tmp = temp_name(&path);
    safetensors::serialize_to_file(views, Some(meta), &tmp).map_err(|e| {
        CheckpointError::Invalid {
            path: tmp.clone(),
            message: e.to_string(),
        }
    })?;
    publish(&tmp, &path)?;
    Ok(path)
}

/// `.<name>.tmp-<pid>` beside `path`: never matched by `*.safetensors` or `shard-*` globs.
fn temp_name(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// fsyncs `tmp` and renames it to `path`.
fn publish(tmp: &Path, path: &Path) -> Result<(), CheckpointError> {
    File::open(tmp)
        .and_then(|f| f.sync_all())
        .map_err(CheckpointError::io(tmp))?;
    std::fs::rename(tmp, path).map_err(CheckpointError::io(path))
}

/// Where one piece of a tensor is.
#[derive(Debug, Clone)]
struct PieceRef {
    /// Index into `DcpCheckpoint::files`.
    file: usize,
    shape: Vec<usize>,
    offsets: Vec<usize>,
}

#[derive(Debug, Clone)]
struct TensorEntry {
    dtype: Dtype,
    shape: Vec<usize>,
    /// The consolidated file it goes to, from 1.
    file_index: usize,
    pieces: Vec<PieceRef>,
    /// The full shape tune's writer recorded ([`FULL_SHAPES_KEY`]), if any file had one.
    recorded: Option<Vec<usize>>,
}

/// One shard file and what its name says.
struct ShardFile {
    file: SafetensorsFile,
    rank: usize,
}

/// A directory of DCP shard files from any number of ranks, memory-mapped: full tensors (or dim-0
/// row ranges of them) are assembled from the pieces on request. See the module doc for the
/// layout and what `open` checks.
pub struct DcpCheckpoint {
    pub dir: PathBuf,
    files: Vec<ShardFile>,
    tensors: BTreeMap<String, TensorEntry>,
    /// `n` of the file names: how many consolidated files the save asked for.
    num_files: usize,
}

/// Whether `dir` holds DCP shard files (`shard-*-model-*-of-*.safetensors`).
pub fn is_dcp_dir(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| parse_shard_file_name(n).is_some())
        })
    })
}

impl DcpCheckpoint {
    /// Opens every `shard-*-model-*-of-*.safetensors` file of `dir` and checks that the pieces
    /// tile every tensor (module doc, "Invariants").
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let entries = std::fs::read_dir(dir).map_err(CheckpointError::io(dir))?;
        let mut named = Vec::new();
        for entry in entries {
            let entry = entry.map_err(CheckpointError::io(dir))?;
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if let Some(parsed) = parse_shard_file_name(&name) {
                named.push((name, parsed));
            }
        }
        if named.is_empty() {
            return Err(CheckpointError::NoWeights {
                dir: dir.to_path_buf(),
                hint: "; nor DCP shard files (shard-00001-model-00001-of-00001.safetensors ...)"
                    .into(),
            });
        }
        named.sort();
        // Ranks 1..=R, none missing.
        let ranks: BTreeSet<usize> = named.iter().map(|(_, (r, _, _))| *r).collect();
        let highest = ranks.last().copied().unwrap_or(0);
        if let Some(missing) = (1..=highest).find(|r| !ranks.contains(r)) {
            return Err(CheckpointError::DcpMissingRank {
                dir: dir.to_path_buf(),
                missing,
                highest,
            });
        }
        let num_files = named[0].1.2;
        let mut files = Vec::with_capacity(named.len());
        let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
        for (name, (rank, k, n)) in named {
            let path = dir.join(&name);
            let invalid = |message: String| CheckpointError::Invalid {
                path: path.clone(),
                message,
            };
            if n != num_files || k == 0 || k > n {
                return Err(invalid(format!(
                    "file {k} of {n} does not fit the other shard files' {num_files} files: the directory mixes saves; keep one save's shard files only"
                )));
            }
            let file = SafetensorsFile::open(&path)?;
            let info = sharding_info(&file)?;
            let recorded_shapes: HashMap<String, Vec<usize>> = file
                .user_metadata()
                .and_then(|m| m.get(FULL_SHAPES_KEY))
                .and_then(|text| serde_json::from_str(text).ok())
                .unwrap_or_default();
            for tensor in file.names() {
                let offsets = info.get(&tensor).cloned().ok_or_else(|| {
                    invalid(format!(
                        "tensor {tensor} has no entry in {SHARDING_INFO_KEY}"
                    ))
                })?;
                let dtype = file.dtype(&tensor).unwrap_or(Dtype::F32);
                if dtype.bitsize() % 8 != 0 {
                    return Err(CheckpointError::UnsupportedDtype {
                        name: tensor.clone(),
                        file: path.clone(),
                        dtype: format!("{dtype:?} (DCP pieces of sub-byte dtypes)"),
                    });
                }
                let shape = file.shape(&tensor).unwrap_or_default();
                if offsets.len() != shape.len() {
                    return Err(invalid(format!(
                        "tensor {tensor} has shape {shape:?} but saved_offsets {offsets:?}"
                    )));
                }
                let piece_err = |message: String| CheckpointError::DcpPieces {
                    name: tensor.clone(),
                    dir: dir.to_path_buf(),
                    message: format!("{message} (in {name})"),
                };
                let mut end = Vec::with_capacity(shape.len());
                for (&o, &s) in offsets.iter().zip(&shape) {
                    end.push(
                        o.checked_add(s)
                            .ok_or_else(|| piece_err(format!("offset {o} overflows")))?,
                    );
                }
                let piece = PieceRef {
                    file: files.len(),
                    shape: shape.clone(),
                    offsets,
                };
                match tensors.get_mut(&tensor) {
                    None => {
                        tensors.insert(
                            tensor.clone(),
                            TensorEntry {
                                dtype,
                                shape: end,
                                file_index: k,
                                pieces: vec![piece],
                                recorded: recorded_shapes.get(&tensor).cloned(),
                            },
                        );
                    }
                    Some(entry) => {
                        if entry.dtype != dtype {
                            return Err(piece_err(format!(
                                "a piece is {dtype:?}, another {:?}",
                                entry.dtype
                            )));
                        }
                        if entry.shape.len() != end.len() {
                            return Err(piece_err(format!(
                                "a piece has {} dims, another {}",
                                end.len(),
                                entry.shape.len()
                            )));
                        }
                        if entry.file_index != k {
                            return Err(piece_err(format!(
                                "a piece is in output file {k}, another in file {}",
                                entry.file_index
                            )));
                        }
                        if let Some(rec) = recorded_shapes.get(&tensor) {
                            if entry.recorded.as_ref().is_some_and(|r| r != rec) {
                                return Err(piece_err(format!(
                                    "{FULL_SHAPES_KEY} says {rec:?} here and {:?} elsewhere",
                                    entry.recorded
                                )));
                            }
                            entry.recorded = Some(rec.clone());
                        }
                        for (full, e) in entry.shape.iter_mut().zip(end) {
                            *full = (*full).max(e);
                        }
                        entry.pieces.push(piece);
                    }
                }
            }
            files.push(ShardFile { file, rank });
        }
        let checkpoint = Self {
            dir: dir.to_path_buf(),
            files,
            tensors,
            num_files,
        };
        for (name, entry) in &checkpoint.tensors {
            checkpoint.check_cover(name, entry)?;
        }
        Ok(checkpoint)
    }

    /// The pieces tile the full shape: no overlap, and volumes that add up (so no gap).
    fn check_cover(&self, name: &str, entry: &TensorEntry) -> Result<(), CheckpointError> {
        let err = |message: String| CheckpointError::DcpPieces {
            name: name.to_string(),
            dir: self.dir.clone(),
            message,
        };
        let file_name = |p: &PieceRef| {
            self.files[p.file]
                .file
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        if let Some(recorded) = entry.recorded.as_ref().filter(|r| **r != entry.shape) {
            return Err(err(format!(
                "the pieces reach only {:?} of the full shape {recorded:?} the save recorded ({FULL_SHAPES_KEY}): the shard files of the last rank(s) are missing",
                entry.shape
            )));
        }
        let full = volume(&entry.shape)
            .ok_or_else(|| err(format!("full shape {:?} overflows", entry.shape)))?;
        let mut sum = 0usize;
        let mut nonempty: Vec<&PieceRef> = Vec::new();
        for p in &entry.pieces {
            let v = volume(&p.shape).unwrap_or(usize::MAX);
            sum = sum.saturating_add(v);
            if v > 0 {
                nonempty.push(p);
            }
        }
        // Sorted by offsets, an overlap is usually between neighbours; check all pairs anyway
        // (pieces are one per rank, and ranks are few).
        nonempty.sort_by(|a, b| a.offsets.cmp(&b.offsets));
        for (i, a) in nonempty.iter().enumerate() {
            for b in &nonempty[i + 1..] {
                let overlap = (0..a.shape.len()).all(|d| {
                    a.offsets[d] < b.offsets[d] + b.shape[d]
                        && b.offsets[d] < a.offsets[d] + a.shape[d]
                });
                if overlap {
                    return Err(err(format!(
                        "the piece {:?} at offsets {:?} in {} overlaps the piece {:?} at offsets {:?} in {}",
                        a.shape,
                        a.offsets,
                        file_name(a),
                        b.shape,
                        b.offsets,
                        file_name(b)
                    )));
                }
            }
        }
        if sum != full {
            let held: Vec<String> = entry
                .pieces
                .iter()
                .map(|p| format!("{:?} at {:?} in {}", p.shape, p.offsets, file_name(p)))
                .collect();
            return Err(err(format!(
                "the pieces hold {sum} of the {full} elements of its shape {:?}, leaving a gap (pieces: {})",
                entry.shape,
                held.join(", ")
            )));
        }
        Ok(())
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The full tensor's shape.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|e| e.shape.as_slice())
    }

    pub fn dtype(&self, name: &str) -> Option<Dtype> {
        self.tensors.get(name).map(|e| e.dtype)
    }

    /// The consolidated file (from 1) the save put tensor `name` in.
    pub fn file_index(&self, name: &str) -> Option<usize> {
        self.tensors.get(name).map(|e| e.file_index)
    }

    /// How many consolidated files the save asked for (`n` of the file names).
    pub fn num_files(&self) -> usize {
        self.num_files
    }

    /// How many ranks wrote the shard files.
    pub fn world_size(&self) -> usize {
        self.files.iter().map(|f| f.rank).max().unwrap_or(0)
    }

    fn entry(&self, name: &str) -> Result<&TensorEntry, CheckpointError> {
        self.tensors
            .get(name)
            .ok_or_else(|| CheckpointError::MissingTensor {
                name: name.to_string(),
                dir: self.dir.clone(),
                expected: vec![],
            })
    }

    /// The full tensor's little-endian bytes in its stored dtype.
    pub fn read_bytes(&self, name: &str) -> Result<Vec<u8>, CheckpointError> {
        let rows = self.entry(name)?.shape.first().copied().unwrap_or(1);
        self.read_rows_bytes(name, 0..rows)
    }

    /// Rows `rows` (along dim 0) of the full tensor, as little-endian bytes in its stored dtype,
    /// reading only the pieces that hold them. A 0-dim tensor has the one row `0..1`.
    pub fn read_rows_bytes(
        &self,
        name: &str,
        rows: Range<usize>,
    ) -> Result<Vec<u8>, CheckpointError> {
        let entry = self.entry(name)?;
        let scalar = entry.shape.is_empty();
        let full: Vec<usize> = if scalar { vec![1] } else { entry.shape.clone() };
        if rows.start > rows.end || rows.end > full[0] {
            return Err(CheckpointError::Invalid {
                path: self.dir.clone(),
                message: format!(
                    "rows {rows:?} of tensor {name} are outside its {} rows",
                    full[0]
                ),
            });
        }
        let elem = entry.dtype.bitsize() / 8;
        let row_elems: usize = full[1..].iter().product();
        let mut out = vec![0u8; rows.len() * row_elems * elem];
        let mut dst_shape = full.clone();
        dst_shape[0] = rows.len();
        let mut dst_offsets = vec![0; full.len()];
        dst_offsets[0] = rows.start;
        for p in &entry.pieces {
            let (shape, offsets) = if scalar {
                (vec![1], vec![0])
            } else {
                (p.shape.clone(), p.offsets.clone())
            };
            let lo = offsets[0].max(rows.start);
            let hi = (offsets[0] + shape[0]).min(rows.end);
            if lo >= hi || shape.contains(&0) {
                continue;
            }
            let file = &self.files[p.file].file;
            let (_, _, bytes) = file.raw(name)?;
            let mut box_lo = offsets.clone();
            let mut box_hi: Vec<usize> = offsets.iter().zip(&shape).map(|(o, s)| o + s).collect();
            box_lo[0] = lo;
            box_hi[0] = hi;
            copy_box(
                bytes,
                &shape,
                &offsets,
                &mut out,
                &dst_shape,
                &dst_offsets,
                &box_lo,
                &box_hi,
                elem,
            );
        }
        Ok(out)
    }

    /// The full tensor decoded to f32 (F32, BF16 and F16 tensors).
    pub fn read(&self, name: &str) -> Result<HostTensor, CheckpointError> {
        let rows = self.entry(name)?.shape.first().copied().unwrap_or(1);
        let mut t = self.read_rows(name, 0..rows)?;
        if let Some(shape) = self.shape(name) {
            t.shape = shape.to_vec();
        }
        Ok(t)
    }

    /// Rows `rows` of the full tensor decoded to f32: a rank's dim-0 shard when loading onto a
    /// different world size than the save's.
    pub fn read_rows(&self, name: &str, rows: Range<usize>) -> Result<HostTensor, CheckpointError> {
        let entry = self.entry(name)?;
        let bytes = self.read_rows_bytes(name, rows.clone())?;
        let data =
            decode(&bytes, entry.dtype).ok_or_else(|| CheckpointError::UnsupportedDtype {
                name: name.to_string(),
                file: self.dir.clone(),
                dtype: format!("{:?}", entry.dtype),
            })?;
        let mut shape = entry.shape.clone();
        if let Some(first) = shape.first_mut() {
            *first = rows.len();
        }
        Ok(HostTensor::new(shape, data))
    }

    /// Drops the pages of tensor `name`'s pieces from memory (see [`SafetensorsFile::release`]).
    pub fn release(&self, name: &str) {
        if let Some(entry) = self.tensors.get(name) {
            for p in &entry.pieces {
                self.files[p.file].file.release(name);
            }
        }
    }

    /// The consolidated files, deterministic for every rank: file `k` of `n` holds the tensors
    /// the save put in file `k` (the shard files' names), by name. Files that no tensor uses
    /// are left out, as torch leaves them out.
    pub fn plan(&self) -> Vec<PlannedFile> {
        let mut by_file: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for (name, entry) in &self.tensors {
            by_file
                .entry(entry.file_index)
                .or_default()
                .push(name.clone());
        }
        by_file
            .into_iter()
            .map(|(index, tensors)| PlannedFile {
                index,
                name: consolidated_file_name(index, self.num_files),
                tensors,
            })
            .collect()
    }

    /// The bytes of all tensors (the index's `metadata.total_size`).
    pub fn total_size(&self) -> usize {
        self.tensors
            .values()
            .map(|e| volume(&e.shape).unwrap_or(0) * (e.dtype.bitsize() / 8))
            .sum()
    }
}

/// One consolidated output file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedFile {
    /// From 1.
    pub index: usize,
    pub name: String,
    pub tensors: Vec<String>,
}

/// The tensor name -> offsets map of a shard file's `DCP_SHARDING_INFO`.
fn sharding_info(file: &SafetensorsFile) -> Result<HashMap<String, Vec<usize>>, CheckpointError> {
    let invalid = |message: String| CheckpointError::Invalid {
        path: file.path.clone(),
        message,
    };
    let text = file
        .user_metadata()
        .and_then(|m| m.get(SHARDING_INFO_KEY))
        .ok_or_else(|| {
            invalid(format!(
                "no {SHARDING_INFO_KEY} in its __metadata__: not a file written by torch.distributed.checkpoint's HuggingFaceStorageWriter(save_distributed=True); take it out of the sharded directory"
            ))
        })?;
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| invalid(format!("{SHARDING_INFO_KEY} is not JSON ({e})")))?;
    let map = value
        .as_object()
        .ok_or_else(|| invalid(format!("{SHARDING_INFO_KEY} is not a JSON object")))?;
    let mut out = HashMap::with_capacity(map.len());
    for (name, entry) in map {
        let offsets = entry
            .get(SAVED_OFFSETS_KEY)
            .and_then(|o| o.as_array())
            .and_then(|a| {
                a.iter()
                    .map(|v| v.as_u64().and_then(|v| usize::try_from(v).ok()))
                    .collect::<Option<Vec<usize>>>()
            })
            .ok_or_else(|| {
                invalid(format!(
                    "{SHARDING_INFO_KEY}[\"{name}\"] has no \"{SAVED_OFFSETS_KEY}\" list of non-negative integers"
                ))
            })?;
        out.insert(name.clone(), offsets);
    }
    Ok(out)
}

fn volume(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Copies the box `[lo, hi)` (in full-tensor coordinates) from `src` (a tensor of `src_shape`
/// at `src_off`) to `dst` (of `dst_shape` at `dst_off`), both row-major, `elem` bytes an element.
/// The box lies inside both. Runs along the last dim are copied whole, and trailing dims that
/// both tensors and the box span entirely are merged into one run.
#[allow(clippy::too_many_arguments)]
fn copy_box(
    src: &[u8],
    src_shape: &[usize],
    src_off: &[usize],
    dst: &mut [u8],
    dst_shape: &[usize],
    dst_off: &[usize],
    lo: &[usize],
    hi: &[usize],
    elem: usize,
) {
    let nd = src_shape.len();
    let strides = |shape: &[usize]| {
        let mut s = vec![1usize; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            s[d] = s[d + 1] * shape[d + 1];
        }
        s
    };
    let (ss, ds) = (strides(src_shape), strides(dst_shape));
    // Merge trailing dims spanned entirely by the box in both tensors.
    let mut inner = nd - 1;
    while inner > 0 {
        let d = inner;
        let full_src = lo[d] == src_off[d] && hi[d] == src_off[d] + src_shape[d];
        let full_dst = lo[d] == dst_off[d] && hi[d] == dst_off[d] + dst_shape[d];
        if full_src && full_dst {
            inner -= 1;
        } else {
            break;
        }
    }
    // A run: dim `inner` from lo to hi, times the (whole) dims after it.
    let run = (hi[inner] - lo[inner]) * ss[inner] * elem;
    let mut idx: Vec<usize> = lo[..inner].to_vec();
    loop {
        let mut s = (lo[inner] - src_off[inner]) * ss[inner];
        let mut t = (lo[inner] - dst_off[inner]) * ds[inner];
        for d in 0..inner {
            s += (idx[d] - src_off[d]) * ss[d];
            t += (idx[d] - dst_off[d]) * ds[d];
        }
        dst[t * elem..t * elem + run].copy_from_slice(&src[s * elem..s * elem + run]);
        // Next index over dims 0..inner.
        let mut d = inner;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < hi[d] {
                break;
            }
            idx[d] = lo[d];
        }
    }
}

fn decode(bytes: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
    match dtype {
        Dtype::F32 => Some(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        Dtype::BF16 => Some(
            bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        ),
        Dtype::F16 => Some(
            bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        ),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_as_torch_gen_file_name() {
        assert_eq!(
            shard_file_name(0, 1, 2),
            "shard-00001-model-00001-of-00002.safetensors"
        );
        assert_eq!(
            consolidated_file_name(3, 12),
            "model-00003-of-00012.safetensors"
        );
        assert_eq!(
            parse_shard_file_name("shard-00002-model-00001-of-00002.safetensors"),
            Some((2, 1, 2))
        );
        assert_eq!(
            parse_shard_file_name("model-00001-of-00002.safetensors"),
            None
        );
        assert_eq!(
            parse_shard_file_name("shard--model-1-of-2.safetensors"),
            None
        );
    }

    #[test]
    fn rows_split_as_dtensor_shard0() {
        let split = |rows, world| -> Vec<Range<usize>> {
            (0..world).map(|r| row_range(rows, r, world)).collect()
        };
        assert_eq!(split(7, 2), vec![0..4, 4..7]);
        assert_eq!(split(1, 2), vec![0..1, 1..1]);
        assert_eq!(split(4, 3), vec![0..2, 2..4, 4..4]);
        assert_eq!(split(5, 4), vec![0..2, 2..4, 4..5, 5..5]);
    }

    #[test]
    fn copy_box_columns_and_rows() {
        // Full 3x4 of u8 elements 0..12; a piece holding columns 1..3 of all rows.
        let full: Vec<u8> = (0..12).collect();
        let piece: Vec<u8> = vec![1, 2, 5, 6, 9, 10];
        let mut out = vec![0u8; 12];
        copy_box(
            &piece,
            &[3, 2],
            &[0, 1],
            &mut out,
            &[3, 4],
            &[0, 0],
            &[0, 1],
            &[3, 3],
            1,
        );
        assert_eq!(out, vec![0, 1, 2, 0, 0, 5, 6, 0, 0, 9, 10, 0]);
        // Rows 1..3 of the full tensor into a 2-row destination.
        let mut rows = vec![0u8; 8];
        copy_box(
            &full,
            &[3, 4],
            &[0, 0],
            &mut rows,
            &[2, 4],
            &[1, 0],
            &[1, 0],
            &[3, 4],
            1,
        );
        assert_eq!(rows, (4..12).collect::<Vec<u8>>());
    }
}
