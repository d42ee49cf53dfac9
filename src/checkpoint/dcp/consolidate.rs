//! Consolidating DCP shard files into an ordinary Hugging Face checkpoint, as torch's
//! `consolidate_safetensors_files` does: on every rank its share of the files, the index last.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use super::*;
use crate::checkpoint::error::CheckpointError;
use crate::checkpoint::safetensors_io::INDEX_FILE;

/// Consolidates the DCP shard files of `sharded_dir` into `out_dir` as torch's
/// `consolidate_safetensors_files_on_every_rank` does: rank `rank` of `world` writes the planned
/// files whose index `k % world == rank`, and rank 0 then writes `model.safetensors.index.json`.
/// In a job of several processes, rank 0 should call this after the others have finished (or
/// call [`consolidate_rank_files`] on every rank, a barrier, then [`write_index`] on rank 0), so
/// the index never names a file that is not there yet. Returns the names written.
pub fn consolidate(
    sharded_dir: &Path,
    out_dir: &Path,
    rank: usize,
    world: usize,
) -> Result<Vec<String>, CheckpointError> {
    let checkpoint = DcpCheckpoint::open(sharded_dir)?;
    let mut written = consolidate_rank_files(&checkpoint, out_dir, rank, world)?;
    if rank == 0 {
        written.push(write_index(&checkpoint, out_dir)?);
    }
    Ok(written)
}

/// Writes rank `rank`'s share of the consolidated files (those with `k % world == rank`) into
/// `out_dir`, each to a temporary name, fsynced, then renamed: a file is complete or absent.
pub fn consolidate_rank_files(
    checkpoint: &DcpCheckpoint,
    out_dir: &Path,
    rank: usize,
    world: usize,
) -> Result<Vec<String>, CheckpointError> {
    if rank >= world {
        return Err(CheckpointError::Invalid {
            path: out_dir.to_path_buf(),
            message: format!("rank {rank} is not below the world size {world}"),
        });
    }
    let mut written = Vec::new();
    for planned in checkpoint.plan() {
        if planned.index % world != rank {
            continue;
        }
        let path = out_dir.join(&planned.name);
        let tmp = temp_name(&path);
        let result = write_consolidated_file(checkpoint, &planned, &tmp);
        if let Err(e) = result {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        publish(&tmp, &path)?;
        written.push(planned.name);
    }
    Ok(written)
}

/// Streams one consolidated file: the header (`{"format": "pt"}` metadata, tensors by name,
/// data offsets in that order), then each full tensor assembled from its pieces in turn.
fn write_consolidated_file(
    checkpoint: &DcpCheckpoint,
    planned: &PlannedFile,
    path: &Path,
) -> Result<(), CheckpointError> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0usize;
    for name in &planned.tensors {
        let entry = checkpoint.entry(name)?;
        let len = volume(&entry.shape).unwrap_or(0) * (entry.dtype.bitsize() / 8);
        header.insert(
            name.clone(),
            serde_json::json!({
                "dtype": entry.dtype,
                "shape": entry.shape,
                "data_offsets": [offset, offset + len],
            }),
        );
        offset += len;
    }
    let mut json = serde_json::Value::Object(header).to_string().into_bytes();
    // safetensors pads the header with spaces to a multiple of 8 bytes.
    json.resize(json.len().div_ceil(8) * 8, b' ');
    let file = File::create(path).map_err(CheckpointError::io(path))?;
    let mut w = BufWriter::new(file);
    let io = CheckpointError::io(path);
    let result = (|| {
        w.write_all(&(json.len() as u64).to_le_bytes())?;
        w.write_all(&json)?;
        Ok::<_, std::io::Error>(())
    })();
    result.map_err(io)?;
    for name in &planned.tensors {
        let bytes = checkpoint.read_bytes(name)?;
        w.write_all(&bytes).map_err(CheckpointError::io(path))?;
        checkpoint.release(name);
    }
    w.flush().map_err(CheckpointError::io(path))
}

/// Writes `model.safetensors.index.json` (`metadata.total_size`, `weight_map`) for the planned
/// files into `out_dir` (temporary name, fsync, rename). Returns its name.
pub fn write_index(checkpoint: &DcpCheckpoint, out_dir: &Path) -> Result<String, CheckpointError> {
    let mut weight_map = BTreeMap::new();
    for planned in checkpoint.plan() {
        for name in planned.tensors {
            weight_map.insert(name, planned.name.clone());
        }
    }
    let index = serde_json::json!({
        "metadata": { "total_size": checkpoint.total_size() },
        "weight_map": weight_map,
    });
    let path = out_dir.join(INDEX_FILE);
    let tmp = temp_name(&path);
    let text = serde_json::to_string_pretty(&index).unwrap_or_default();
    std::fs::write(&tmp, text + "\n").map_err(CheckpointError::io(&tmp))?;
    publish(&tmp, &path)?;
    Ok(INDEX_FILE.to_string())
}

/// Consolidates `dir/sharded/` into `dir` (what `tune checkpoints consolidate DIR` does), all or
/// nothing: refuses a `dir` that already holds a consolidated checkpoint
/// (`model.safetensors.index.json`, `model.safetensors` or a planned file name), writes every
/// file into a hidden staging folder `dir/.tune-consolidate-<pid>/`, then renames the tensor
/// files into `dir` and the index last. An error removes what it had renamed and the staging
/// folder; a crash can leave only the staging folder and, before the index, tensor files that
/// no index names (transformers and tune load nothing from those). Returns the names written.
pub fn consolidate_dir(dir: &Path) -> Result<Vec<String>, CheckpointError> {
    let sharded = dir.join(SHARDED_DIR);
    if !is_dcp_dir(&sharded) {
        return Err(CheckpointError::NoWeights {
            dir: sharded,
            hint: "; no DCP shard files (shard-00001-model-00001-of-00001.safetensors ...) to consolidate either".into(),
        });
    }
    let checkpoint = DcpCheckpoint::open(&sharded)?;
    let plan = checkpoint.plan();
    let mut names: Vec<String> = plan.iter().map(|p| p.name.clone()).collect();
    names.push(INDEX_FILE.to_string());
    let existing = names
        .iter()
        .map(String::as_str)
        .chain([crate::checkpoint::safetensors_io::SINGLE_FILE])
        .find(|n| dir.join(n).symlink_metadata().is_ok());
    if let Some(existing) = existing {
        return Err(CheckpointError::Invalid {
            path: dir.join(existing),
            message: "already exists: the directory holds a consolidated checkpoint; remove its model*.safetensors and model.safetensors.index.json to consolidate again".into(),
        });
    }
    let staging = dir.join(format!(".tune-consolidate-{}", std::process::id()));
    std::fs::create_dir(&staging).map_err(CheckpointError::io(&staging))?;
    let staged = consolidate_rank_files(&checkpoint, &staging, 0, 1)
        .and_then(|_| write_index(&checkpoint, &staging))
        .and_then(|_| publish_all(&staging, dir, &names));
    let _ = std::fs::remove_dir_all(&staging);
    staged.map(|()| names)
}

/// Renames `names` from `staging` into `dir` in order (the index last), fsyncing `dir`; on an
/// error, removes the ones already renamed.
fn publish_all(staging: &Path, dir: &Path, names: &[String]) -> Result<(), CheckpointError> {
    for (i, name) in names.iter().enumerate() {
        if let Err(e) = std::fs::rename(staging.join(name), dir.join(name)) {
            for done in &names[..i] {
                let _ = std::fs::remove_file(dir.join(done));
            }
            return Err(CheckpointError::Io {
                path: dir.join(name),
                source: e,
            });
        }
    }
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(CheckpointError::io(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_all_rolls_back_on_error() {
        let root = tempfile::tempdir().expect("tempdir");
        let staging = root.path().join("staging");
        std::fs::create_dir(&staging).expect("mkdir");
        std::fs::write(staging.join("a"), "a").expect("write");
        // "b" is missing from staging: its rename fails after "a" was published.
        let names = vec!["a".to_string(), "b".to_string()];
        let err = publish_all(&staging, root.path(), &names).expect_err("b is missing");
        assert!(err.to_string().contains('b'), "{err}");
        assert!(!root.path().join("a").exists(), "a was not rolled back");
    }
}
