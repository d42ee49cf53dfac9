//! Optimizer state written by every rank (ZeRO-1 runs whose ranks share the output
//! directory): rank `r` of `W` writes `optimizer-<r+1>-of-<W>.safetensors` with the moments of
//! the parameters it owns. Ranks other than 0 write theirs, in the background, into a staging
//! directory (`.tmp-shards.<checkpoint>-0`, which the checkpoint client's clean-up treats as a
//! partial checkpoint) and mark each as durable with a `.done` file once it is fsynced. Rank
//! 0's checkpoint writer writes its own shard, waits for every other rank's mark, and moves
//! their files into the checkpoint before `tune_checkpoint.json` records every file with its
//! size and SHA-256 and the directory is published. A rank that dies before its mark means the
//! checkpoint is never published, so resume never picks it.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::tensor::backend::AutodiffBackend;

use crate::checkpoint::safetensors_io::{SafetensorsFile, write_file};
use crate::checkpoint::{CheckpointError, HostTensor, StorageDtype};
use crate::checkpoint_client::WriteError;
use crate::models::CausalLm;
use crate::training::error::{CheckpointingError, TrainError};
use crate::training::save_hook::{OptimizerSnapshot, SaveHook, SaveKind, TrainState};

/// How long rank 0 waits for the other ranks' shards of one checkpoint.
pub const SHARD_TIMEOUT: Duration = Duration::from_secs(600);

/// `optimizer-00002-of-00004.safetensors` for rank 1 of 4 (1-based, as Hugging Face names
/// model shards).
pub fn shard_file_name(rank: usize, world: usize) -> String {
    format!("optimizer-{:05}-of-{world:05}.safetensors", rank + 1)
}

/// Where ranks other than 0 leave their shards of checkpoint `name`.
pub fn staging_dir(output_dir: &Path, name: &str) -> PathBuf {
    output_dir.join(format!(".tmp-shards.{name}-0"))
}

/// The checkpoint a save of `kind` at `state` is published as.
pub fn checkpoint_name(kind: SaveKind, state: &TrainState) -> String {
    match kind {
        SaveKind::Periodic | SaveKind::Preempt => format!("step_{}", state.global_step),
        SaveKind::EpochEnd | SaveKind::Final => {
            format!("epoch_{}", state.epoch.saturating_sub(1))
        }
    }
}

fn done_mark(file: &Path) -> PathBuf {
    let mut name = file.as_os_str().to_owned();
    name.push(".done");
    PathBuf::from(name)
}

fn sync(path: &Path) -> std::io::Result<()> {
    File::open(path)?.sync_all()
}

/// Writes `tensors` as `file` and fsyncs it and its directory, then marks it done. The mark is
/// the last thing this rank touches: rank 0 may move the file and remove the directory as soon
/// as it appears (and fsyncs everything it publishes).
pub fn write_durable(file: &Path, tensors: &[(String, HostTensor)]) -> Result<(), WriteError> {
    let dir = file.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(|e| WriteError::io(dir, e))?;
    write_file(file, tensors, StorageDtype::F32).map_err(|e| WriteError::Other(Box::new(e)))?;
    sync(file)
        .and_then(|()| sync(dir))
        .map_err(|e| WriteError::io(file, e))?;
    let mark = done_mark(file);
    fs::write(&mark, b"").map_err(|e| WriteError::io(&mark, e))
}

/// Rank 0's checkpoint writer: its own shard into `into`, then every other rank's, moved in
/// from the staging directory once marked durable.
pub fn assemble(
    into: &Path,
    output_dir: &Path,
    name: &str,
    world: usize,
    own: &[(String, HostTensor)],
    timeout: Duration,
) -> Result<(), WriteError> {
    write_file(
        &into.join(shard_file_name(0, world)),
        own,
        StorageDtype::F32,
    )
    .map_err(|e| WriteError::Other(Box::new(e)))?;
    let staging = staging_dir(output_dir, name);
    let deadline = Instant::now() + timeout;
    for rank in 1..world {
        let file = staging.join(shard_file_name(rank, world));
        while !done_mark(&file).is_file() {
            if Instant::now() >= deadline {
                return Err(WriteError::msg(format!(
                    "rank {rank} did not write its optimizer shard {} within {} s; the checkpoint is not published",
                    file.display(),
                    timeout.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        fs::rename(&file, into.join(shard_file_name(rank, world)))
            .map_err(|e| WriteError::io(&file, e))?;
    }
    let _ = fs::remove_dir_all(&staging);
    Ok(())
}

/// The whole optimizer state of a checkpoint: `optimizer.safetensors`, or the `shards`
/// per-rank files merged.
pub fn read_state(
    dir: &Path,
    single_file: &str,
    shards: usize,
) -> Result<Vec<(String, HostTensor)>, CheckpointError> {
    let files: Vec<PathBuf> = if shards > 1 {
        (0..shards)
            .map(|r| dir.join(shard_file_name(r, shards)))
            .collect()
    } else {
        vec![dir.join(single_file)]
    };
    let mut state = Vec::new();
    for path in files {
        let file = SafetensorsFile::open(&path)?;
        for name in file.names() {
            let t = file.read(&name)?;
            state.push((name, t));
        }
    }
    Ok(state)
}

/// The save hook of a rank other than 0 in a run that writes per-rank optimizer shards: the
/// snapshot is taken when the trainer asks, the file written in the background (at most one in
/// flight; a failure is reported at the next save or at the end).
pub struct ShardWriter {
    pub output_dir: PathBuf,
    pub rank: usize,
    pub world: usize,
    in_flight: Option<JoinHandle<Result<(), WriteError>>>,
}

impl ShardWriter {
    pub fn new(output_dir: PathBuf, rank: usize, world: usize) -> Self {
        Self {
            output_dir,
            rank,
            world,
            in_flight: None,
        }
    }

    /// Waits for the save in flight, if any.
    pub fn finish(&mut self) -> Result<(), TrainError> {
        match self.in_flight.take().map(JoinHandle::join) {
            None | Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(source))) => Err(CheckpointingError::Shard {
                rank: self.rank,
                source,
            }
            .into()),
            Some(Err(_)) => Err(CheckpointingError::Shard {
                rank: self.rank,
                source: WriteError::msg("its writer thread panicked"),
            }
            .into()),
        }
    }
}

impl<B: AutodiffBackend> SaveHook<B> for ShardWriter {
    fn save(
        &mut self,
        kind: SaveKind,
        _: &mut CausalLm<B>,
        optimizer: &OptimizerSnapshot,
        state: &TrainState,
    ) -> Result<(), TrainError> {
        self.finish()?;
        let name = checkpoint_name(kind, state);
        let file =
            staging_dir(&self.output_dir, &name).join(shard_file_name(self.rank, self.world));
        let tensors = optimizer.state.clone();
        self.in_flight = Some(std::thread::spawn(move || write_durable(&file, &tensors)));
        if kind.blocks() {
            self.finish()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("tune-shards-{tag}-"))
            .tempdir()
            .unwrap()
    }

    fn state(v: f32) -> Vec<(String, HostTensor)> {
        vec![("exp_avg.w".into(), HostTensor::new(vec![2], vec![v, v]))]
    }

    #[test]
    fn rank_zero_gathers_every_marked_shard_and_they_read_back_as_one_state() {
        let dir = scratch("gather");
        let out = dir.path();
        let into = out.join("ckpt");
        fs::create_dir_all(&into).unwrap();
        for rank in 1..3 {
            let file = staging_dir(out, "step_2").join(shard_file_name(rank, 3));
            write_durable(&file, &state(rank as f32)).unwrap();
        }
        assemble(&into, out, "step_2", 3, &state(0.0), Duration::from_secs(5)).unwrap();
        assert!(!staging_dir(out, "step_2").exists(), "staging removed");
        let all = read_state(&into, "optimizer.safetensors", 3).unwrap();
        let values: Vec<f32> = all.iter().map(|(_, t)| t.data[0]).collect();
        assert_eq!(values, [0.0, 1.0, 2.0]);
    }

    #[test]
    fn a_missing_or_unmarked_shard_fails_the_save_naming_the_rank() {
        let dir = scratch("missing");
        let out = dir.path();
        let into = out.join("ckpt");
        fs::create_dir_all(&into).unwrap();
        // Rank 1's file is there but was never marked durable (it died while writing).
        let file = staging_dir(out, "step_4").join(shard_file_name(1, 2));
        fs::create_dir_all(file.parent().unwrap()).unwrap();
        fs::write(&file, b"partial").unwrap();
        let err = assemble(
            &into,
            out,
            "step_4",
            2,
            &state(0.0),
            Duration::from_millis(50),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("rank 1 did not write its optimizer shard"),
            "{err}"
        );
        // The staging directory is a partial checkpoint to the client's clean-up.
        let cleaned = crate::checkpoint_client::clean_partial(out).unwrap();
        assert!(cleaned.iter().any(|c| c.path == staging_dir(out, "step_4")));
    }
}
