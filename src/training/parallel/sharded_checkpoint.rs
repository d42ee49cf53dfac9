//! Checkpoints of fully sharded runs (FSDP, with an output directory every rank sees), written
//! by every rank in PyTorch's distributed-checkpoint layout: no rank gathers the model or the
//! optimizer state. The files are those of torch's
//! `HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=...)`
//! (`checkpoint::dcp`), so torch reads them and tune resumes from them on any world size.
//!
//! # Protocol
//! One checkpoint `name` of a run on `W` ranks; `S` is the staging directory
//! `<output_dir>/.tmp-shards.<name>-<run>` (`run`: a number rank 0 draws once per run and
//! every rank receives, so a crashed run's leftovers are never taken for this run's; the
//! checkpoint client's clean-up removes it as a partial checkpoint).
//! 1. Every rank `r`, on a thread of its own (rank 0: inside the checkpoint client's writer),
//!    writes its [`RankShare`]:
//!    - `S/sharded/shard-<r+1>-model-<k>-of-<n>.safetensors`: its rows of every sharded
//!      weight, rank 0 also every whole one, file `k` of `n` as the one-rank save would split
//!      the model ([`file_of_each`]);
//!    - `S/optimizer_sharded/shard-<r+1>-model-00001-of-00001.safetensors`: its moments, flat
//!      as the optimizer keeps them, at their element offsets in the whole moment (rows of a
//!      sharded parameter; a whole parameter's moments on the rank that owns them);
//!
//!    Each file is written to a temporary name, fsynced and renamed, then the mark
//!    `S/.rank-<r>.written`.
//! 2. Epoch-end and final checkpoints (the Hugging Face model transformers and peft load) are
//!    consolidated on every rank: rank `r` waits for every rank's `written` mark, writes the
//!    consolidated files `model-<k>-of-<n>.safetensors` with `k % W == r` into `S` (torch's
//!    `consolidate_safetensors_files_on_every_rank`), and marks `S/.rank-<r>.consolidated`.
//! 3. Rank 0's writer, in the client's temporary directory `D`, waits for every mark, writes
//!    `model.safetensors.index.json`, moves everything from `S` into `D` and removes `S`. A
//!    consolidated checkpoint drops the model's shard files (the consolidated ones hold the
//!    same bytes). The client then records every file with its checksum and publishes `D`.
//!
//! A rank that dies before its mark means rank 0's writer times out and the checkpoint is never
//! published, so resume never picks it; a rank never reads another rank's files before their
//! mark says they are durable.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::tensor::backend::{AutodiffBackend, Backend};

use super::optimizer_shards::checkpoint_name;
use crate::checkpoint::dcp::{
    DcpCheckpoint, Piece, SHARDED_DIR, consolidate_rank_files, write_index, write_shard,
};
use crate::checkpoint::safetensors_io::file_of_each;
use crate::checkpoint::{CheckpointError, HostTensor, StorageDtype};
use crate::checkpoint_client::WriteError;
use crate::models::CausalLm;
use crate::training::error::{CheckpointingError, TrainError};
use crate::training::save_hook::{OptimizerSnapshot, SaveHook, SaveKind, TrainState};

/// The folder of a checkpoint holding every rank's optimizer moments, in the layout of the
/// model's shard files (one file per rank).
pub const OPTIMIZER_SHARDED_DIR: &str = "optimizer_sharded";

/// Where the ranks of run `run` leave their shares of checkpoint `name` until rank 0 moves
/// them into the checkpoint.
pub fn staging_dir(output_dir: &Path, name: &str, run: u64) -> PathBuf {
    output_dir.join(format!(".tmp-shards.{name}-{run}"))
}

/// One rank's part of a sharded checkpoint, copied to host memory.
#[derive(Debug, Clone)]
pub struct RankShare {
    pub rank: usize,
    pub world: usize,
    /// The model's pieces by the file (from 1) they belong to, of `files`.
    model: BTreeMap<usize, Vec<Piece>>,
    files: usize,
    optimizer: Vec<Piece>,
}

impl RankShare {
    /// This rank's share of `model` (stored as `dtype`, split into files of at most
    /// `max_shard_bytes` as the one-rank save splits them: its rows of every sharded
    /// parameter, and on rank 0 every whole one) and of the optimizer state it holds
    /// (`optimizer`: `exp_avg.<param>`, ... as `Optimizer::state_dict` names them; stored in
    /// f32). Every moment must be held by one rank only, as FSDP's rows and ZeRO-1's split of
    /// the rest hold them: the reader refuses overlapping pieces.
    pub fn new<B: Backend>(
        model: &CausalLm<B>,
        optimizer: &[(String, HostTensor)],
        world: usize,
        dtype: StorageDtype,
        max_shard_bytes: usize,
    ) -> Result<Self, CheckpointError> {
        let shards = model.shards.as_deref();
        let rank = shards.map_or(0, |s| s.rank());
        let whole_here = rank == 0;
        let params: Vec<_> = model
            .named_params()
            .into_iter()
            .filter(|p| !p.is_adapter())
            .collect();
        let full_shapes: Vec<Vec<usize>> = params
            .iter()
            .map(|p| match shards.and_then(|s| s.full_shape(&p.id)) {
                Some(full) => full.to_vec(),
                None => p.value.shape.clone(),
            })
            .collect();
        let bytes = dtype.bytes_per_element();
        let file_of = file_of_each(
            full_shapes
                .iter()
                .map(|s| s.iter().product::<usize>() * bytes),
            max_shard_bytes,
        );
        let files = file_of.last().map_or(1, |last| last + 1);
        let mut by_file: BTreeMap<usize, Vec<Piece>> = BTreeMap::new();
        for ((p, full), file) in params.iter().zip(full_shapes).zip(file_of) {
            let sharded = shards.is_some_and(|s| s.is_sharded(&p.id));
            // By its checkpoint name (a sparse layer's block as the family names it).
            let name = model.args.hf_name(&p.name);
            let piece = if sharded {
                let rows = shards.map_or(0..0, |s| s.rows(full[0], rank));
                let mut offsets = vec![0; full.len()];
                offsets[0] = rows.start;
                Piece::from_host(&name, &p.value, dtype, full, offsets)
            } else if whole_here {
                let offsets = vec![0; full.len()];
                Piece::from_host(&name, &p.value, dtype, full, offsets)
            } else {
                continue;
            };
            by_file.entry(file + 1).or_default().push(piece);
        }

        // Each moment's place in the whole (flat) moment of its parameter.
        let places: HashMap<String, (usize, usize)> = model
            .trainable_params()
            .into_iter()
            .map(|p| {
                let place = match shards.and_then(|s| Some((s.elements(&p.id, rank)?, s))) {
                    Some((range, s)) => {
                        let full = s.full_shape(&p.id).map_or(0, |f| f.iter().product());
                        (range.start, full)
                    }
                    None => (0, p.numel),
                };
                (p.name, place)
            })
            .collect();
        let mut moments = Vec::with_capacity(optimizer.len());
        for (key, t) in optimizer {
            let param = key.split_once('.').map_or(key.as_str(), |(_, p)| p);
            let Some(&(offset, full)) = places.get(param) else {
                return Err(CheckpointError::Invalid {
                    path: PathBuf::from(OPTIMIZER_SHARDED_DIR),
                    message: format!("optimizer state {key} names no parameter that trains"),
                });
            };
            let flat = HostTensor::new(vec![t.numel()], t.data.clone());
            moments.push(Piece::from_host(
                key,
                &flat,
                StorageDtype::F32,
                vec![full],
                vec![offset],
            ));
        }
        Ok(Self {
            rank,
            world,
            model: by_file,
            files,
            optimizer: moments,
        })
    }
}

fn mark(staging: &Path, rank: usize, what: &str) -> PathBuf {
    staging.join(format!(".rank-{rank}.{what}"))
}

fn sync_dir(dir: &Path) -> Result<(), WriteError> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| WriteError::io(dir, e))
}

fn checkpoint_err(e: CheckpointError) -> WriteError {
    WriteError::Other(Box::new(e))
}

/// Waits until every rank's mark `what` is in `staging`.
fn wait_for_marks(
    staging: &Path,
    world: usize,
    what: &str,
    timeout: Duration,
) -> Result<(), WriteError> {
    let deadline = Instant::now() + timeout;
    for rank in 0..world {
        while !mark(staging, rank, what).is_file() {
            if Instant::now() >= deadline {
                return Err(WriteError::msg(format!(
                    "rank {rank} did not write its share of the sharded checkpoint ({what}) into {} within {} s; the checkpoint is not published",
                    staging.display(),
                    timeout.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    Ok(())
}

/// Step 1 (and 2 with `consolidate`) of the protocol for one rank: writes `share` into
/// `staging`, marks it written; then, consolidating, waits for every rank's share and writes
/// this rank's consolidated files.
pub fn write_share(
    staging: &Path,
    share: &RankShare,
    consolidate: bool,
    timeout: Duration,
) -> Result<(), WriteError> {
    let (rank, world) = (share.rank, share.world);
    let model_dir = staging.join(SHARDED_DIR);
    let optimizer_dir = staging.join(OPTIMIZER_SHARDED_DIR);
    for dir in [&model_dir, &optimizer_dir] {
        fs::create_dir_all(dir).map_err(|e| WriteError::io(dir, e))?;
    }
    for (&file, pieces) in &share.model {
        write_shard(&model_dir, rank, world, file, share.files, pieces).map_err(checkpoint_err)?;
    }
    if !share.optimizer.is_empty() {
        write_shard(&optimizer_dir, rank, world, 1, 1, &share.optimizer).map_err(checkpoint_err)?;
    }
    for dir in [&model_dir, &optimizer_dir] {
        sync_dir(dir)?;
    }
    let written = mark(staging, rank, "written");
    fs::write(&written, b"").map_err(|e| WriteError::io(&written, e))?;
    if !consolidate {
        return Ok(());
    }
    wait_for_marks(staging, world, "written", timeout)?;
    {
        let checkpoint = DcpCheckpoint::open(&model_dir).map_err(checkpoint_err)?;
        consolidate_rank_files(&checkpoint, staging, rank, world).map_err(checkpoint_err)?;
    }
    sync_dir(staging)?;
    let done = mark(staging, rank, "consolidated");
    fs::write(&done, b"").map_err(|e| WriteError::io(&done, e))
}

/// Step 3, rank 0's writer after its own [`write_share`]: waits for every rank, then moves the
/// checkpoint's files from `staging` into `into` (the client's temporary directory) and
/// removes `staging`.
pub fn collect_into(
    into: &Path,
    staging: &Path,
    world: usize,
    consolidate: bool,
    timeout: Duration,
) -> Result<(), WriteError> {
    wait_for_marks(staging, world, "written", timeout)?;
    let model_dir = staging.join(SHARDED_DIR);
    if consolidate {
        wait_for_marks(staging, world, "consolidated", timeout)?;
        let checkpoint = DcpCheckpoint::open(&model_dir).map_err(checkpoint_err)?;
        write_index(&checkpoint, into).map_err(checkpoint_err)?;
    }
    let entries = fs::read_dir(staging).map_err(|e| WriteError::io(staging, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| WriteError::io(staging, e))?;
        let name = entry.file_name();
        let name_text = name.to_string_lossy();
        if name_text.starts_with(".rank-") || (consolidate && name_text == SHARDED_DIR) {
            continue;
        }
        let to = into.join(&name);
        fs::rename(entry.path(), &to).map_err(|e| WriteError::io(&to, e))?;
    }
    let _ = fs::remove_dir_all(staging);
    Ok(())
}

/// Whether a save of `kind` consolidates: the epoch-end and final checkpoints hold the Hugging
/// Face model; the periodic ones only the shards (torch's `enable_consolidation`).
pub fn consolidates(kind: SaveKind) -> bool {
    matches!(kind, SaveKind::EpochEnd | SaveKind::Final)
}

/// The save hook of a rank other than 0 in a run whose ranks write their own shards: the
/// share is copied to the host when the trainer asks and written on a thread (at most one in
/// flight; a failure is reported at the next save or at the end).
pub struct RankShareWriter {
    output_dir: PathBuf,
    run: u64,
    world: usize,
    dtype: StorageDtype,
    max_shard_bytes: usize,
    in_flight: Option<JoinHandle<Result<(), WriteError>>>,
    rank: usize,
}

impl RankShareWriter {
    pub fn new(
        output_dir: PathBuf,
        run: u64,
        rank: usize,
        world: usize,
        dtype: StorageDtype,
        max_shard_bytes: usize,
    ) -> Self {
        Self {
            output_dir,
            run,
            world,
            dtype,
            max_shard_bytes,
            in_flight: None,
            rank,
        }
    }

    /// Waits for the save in flight, if any.
    pub fn finish(&mut self) -> Result<(), TrainError> {
        let shard_error = |source| CheckpointingError::Shard {
            rank: self.rank,
            source,
        };
        match self.in_flight.take().map(JoinHandle::join) {
            None | Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(source))) => Err(shard_error(source).into()),
            Some(Err(_)) => Err(shard_error(WriteError::msg("its writer thread panicked")).into()),
        }
    }
}

/// How long a rank waits for the others' shares of one checkpoint.
pub const SHARE_TIMEOUT: Duration = super::optimizer_shards::SHARD_TIMEOUT;

impl<B: AutodiffBackend> SaveHook<B> for RankShareWriter {
    fn save(
        &mut self,
        kind: SaveKind,
        model: &mut CausalLm<B>,
        optimizer: &OptimizerSnapshot,
        state: &TrainState,
    ) -> Result<(), TrainError> {
        self.finish()?;
        let share = RankShare::new(
            model,
            &optimizer.state,
            self.world,
            self.dtype,
            self.max_shard_bytes,
        )
        .map_err(CheckpointingError::from)?;
        let staging = staging_dir(&self.output_dir, &checkpoint_name(kind, state), self.run);
        let consolidate = consolidates(kind);
        self.in_flight = Some(std::thread::spawn(move || {
            write_share(&staging, &share, consolidate, SHARE_TIMEOUT)
        }));
        if kind.blocks() {
            self.finish()?;
        }
        Ok(())
    }
}

/// The whole optimizer state of a checkpoint's [`OPTIMIZER_SHARDED_DIR`], every moment
/// assembled from the ranks' pieces (flat).
pub fn read_optimizer_state(dir: &Path) -> Result<Vec<(String, HostTensor)>, CheckpointError> {
    let checkpoint = DcpCheckpoint::open(&dir.join(OPTIMIZER_SHARDED_DIR))?;
    let names: Vec<String> = checkpoint.names().cloned().collect();
    names
        .into_iter()
        .map(|name| {
            let t = checkpoint.read(&name)?;
            checkpoint.release(&name);
            Ok((name, t))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::dcp::row_range;
    use crate::checkpoint::safetensors_io::{INDEX_FILE, SafetensorsFile};

    const WORLD: usize = 2;

    /// The whole model of the tests: `a` (5x3, sharded by rows, file 1 of 2) and `b` (4, whole,
    /// file 2), and AdamW's first moment of `a`.
    fn a() -> HostTensor {
        HostTensor::new(vec![5, 3], (0..15).map(|x| x as f32).collect())
    }

    fn b() -> HostTensor {
        HostTensor::new(vec![4], vec![-1.0, -2.0, -3.0, -4.0])
    }

    fn exp_avg_a() -> HostTensor {
        HostTensor::new(vec![15], (0..15).map(|x| x as f32 / 10.0).collect())
    }

    /// Rank `rank`'s share, as `RankShare::new` makes it of an FSDP model.
    fn share(rank: usize) -> RankShare {
        let mut model = BTreeMap::new();
        let rows = Piece::rows_of("a", &a(), StorageDtype::F32, rank, WORLD);
        model.insert(1, rows.into_iter().collect::<Vec<_>>());
        if rank == 0 {
            let b = Piece::from_host("b", &b(), StorageDtype::F32, vec![4], vec![0]);
            model.insert(2, vec![b]);
        }
        let rows = row_range(5, rank, WORLD);
        let elements = rows.start * 3..rows.end * 3;
        let moment = HostTensor::new(
            vec![elements.len()],
            exp_avg_a().data[elements.clone()].to_vec(),
        );
        let optimizer = vec![Piece::from_host(
            "exp_avg.a",
            &moment,
            StorageDtype::F32,
            vec![15],
            vec![elements.start],
        )];
        RankShare {
            rank,
            world: WORLD,
            model,
            files: 2,
            optimizer,
        }
    }

    /// Every rank writes its share on a thread of its own, rank 0 then collects into `into`.
    fn save(staging: &Path, into: &Path, consolidate: bool) -> Result<(), WriteError> {
        let timeout = Duration::from_secs(30);
        std::thread::scope(|scope| {
            let other = scope.spawn(|| write_share(staging, &share(1), consolidate, timeout));
            write_share(staging, &share(0), consolidate, timeout)?;
            collect_into(into, staging, WORLD, consolidate, timeout)?;
            other.join().expect("rank 1's writer")
        })
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn an_epoch_checkpoint_holds_the_whole_model_as_one_rank_saves_it() {
        let root = tempfile::tempdir().expect("tempdir");
        let (staging, into) = (root.path().join("staging"), root.path().join("into"));
        fs::create_dir(&into).expect("mkdir");
        save(&staging, &into, true).expect("save");

        assert_eq!(
            names(&into),
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                INDEX_FILE,
                OPTIMIZER_SHARDED_DIR,
            ]
        );
        assert!(!staging.exists(), "the staging directory is left behind");
        let first =
            SafetensorsFile::open(&into.join("model-00001-of-00002.safetensors")).expect("file 1");
        assert_eq!(first.read("a").expect("a"), a());
        let second =
            SafetensorsFile::open(&into.join("model-00002-of-00002.safetensors")).expect("file 2");
        assert_eq!(second.read("b").expect("b"), b());
        let index: serde_json::Value =
            serde_json::from_slice(&fs::read(into.join(INDEX_FILE)).expect("index")).expect("json");
        assert_eq!(index["weight_map"]["a"], "model-00001-of-00002.safetensors");
        assert_eq!(index["weight_map"]["b"], "model-00002-of-00002.safetensors");
        assert_eq!(index["metadata"]["total_size"], (15 + 4) * 4);
        assert_eq!(
            read_optimizer_state(&into).expect("optimizer"),
            vec![("exp_avg.a".to_string(), exp_avg_a())]
        );
    }

    #[test]
    fn a_periodic_checkpoint_keeps_every_ranks_shards() {
        let root = tempfile::tempdir().expect("tempdir");
        let (staging, into) = (root.path().join("staging"), root.path().join("into"));
        fs::create_dir(&into).expect("mkdir");
        save(&staging, &into, false).expect("save");

        assert_eq!(names(&into), [OPTIMIZER_SHARDED_DIR, SHARDED_DIR]);
        assert_eq!(
            names(&into.join(SHARDED_DIR)),
            [
                "shard-00001-model-00001-of-00002.safetensors",
                "shard-00001-model-00002-of-00002.safetensors",
                "shard-00002-model-00001-of-00002.safetensors",
            ]
        );
        let sharded = DcpCheckpoint::open(&into.join(SHARDED_DIR)).expect("open");
        assert_eq!(sharded.read("a").expect("a"), a());
        assert_eq!(sharded.read("b").expect("b"), b());
        assert_eq!(
            read_optimizer_state(&into).expect("optimizer"),
            vec![("exp_avg.a".to_string(), exp_avg_a())]
        );
    }

    #[test]
    fn a_crashed_runs_staging_is_cleaned_as_a_partial_checkpoint() {
        let root = tempfile::tempdir().expect("tempdir");
        let staging = staging_dir(root.path(), "step_2", 77);
        write_share(&staging, &share(1), false, Duration::from_secs(1)).expect("rank 1 writes");
        let cleaned = crate::checkpoint_client::clean_partial(root.path()).expect("clean");
        assert_eq!(cleaned.len(), 1);
        assert!(
            !staging.exists(),
            "the staging directory survived the clean-up"
        );
    }

    #[test]
    fn a_rank_that_never_writes_means_no_checkpoint() {
        let root = tempfile::tempdir().expect("tempdir");
        let (staging, into) = (root.path().join("staging"), root.path().join("into"));
        fs::create_dir(&into).expect("mkdir");
        let timeout = Duration::from_millis(200);
        write_share(&staging, &share(0), false, timeout).expect("rank 0 writes");
        let err = collect_into(&into, &staging, WORLD, false, timeout).expect_err("rank 1 is gone");
        assert!(err.to_string().contains("rank 1"), "{err}");
        assert!(
            names(&into).is_empty(),
            "files were moved in: {:?}",
            names(&into)
        );
        // Consolidating, rank 0 does not read shards before every rank marked them written.
        let err = write_share(&staging, &share(0), true, timeout).expect_err("rank 1 is gone");
        assert!(err.to_string().contains("rank 1"), "{err}");
        assert!(!staging.join("model-00001-of-00002.safetensors").exists());
    }
}
