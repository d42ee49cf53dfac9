//! What every training recipe derives the same way from its config before its own choices:
//! the seed, the output directory, the resume fingerprint and the checkpoint to resume
//! ([`start`]), the trainer loop settings, the checkpoint layout.

use std::path::PathBuf;

use burn::tensor::backend::Backend;

use crate::config::schema::{Device, RecipeConfig, TrainConfig};
use crate::distributed::World;
use crate::training::TrainerSettings;
use crate::training::activation_checkpointing::Checkpointing;
use crate::training::checkpointing::{Resume, RunFingerprint, find_resume};
use crate::training::parallel::fsdp::Sharding;

use super::{SetupError, optim};

/// The run's seed: the config's, or one drawn from the clock (torchtune draws a random one),
/// reported so the run can be repeated.
pub fn seed(cfg: &TrainConfig) -> u64 {
    cfg.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64 % 1_000_000)
    })
}

/// `enable_activation_checkpointing` and `enable_activation_offloading` as one setting.
/// Offloading moves each layer's kept input to host memory; on device cpu that is where it
/// already lives, so there it changes nothing (validation says so, and refuses offloading
/// without checkpointing, as torchtune does).
pub fn checkpointing(cfg: &TrainConfig) -> Checkpointing {
    let on_host = Device::or_default(cfg.device) == Device::Cpu;
    match (
        cfg.enable_activation_checkpointing,
        cfg.enable_activation_offloading,
    ) {
        (false, _) => Checkpointing::Off,
        (true, true) if !on_host => Checkpointing::LayersOffloaded,
        (true, _) => Checkpointing::Layers,
    }
}

/// The loop's settings as the config gives them (`show_progress`: this rank shows the bar).
pub fn trainer_settings(cfg: &TrainConfig, seed: u64, show_progress: bool) -> TrainerSettings {
    TrainerSettings {
        epochs: cfg.epochs,
        max_steps_per_epoch: cfg.max_steps_per_epoch,
        gradient_accumulation_steps: cfg.gradient_accumulation_steps,
        clip_grad_norm: cfg.clip_grad_norm,
        log_every_n_steps: cfg.log_every_n_steps,
        save_every_n_steps: cfg.save_every_n_steps,
        lr: cfg.optimizer.lr(),
        schedule: optim::schedule(cfg.lr_scheduler.as_ref()),
        seed,
        save_on_preempt: cfg.save_on_preempt,
        log_memory: cfg.log_peak_memory_stats,
        show_progress,
        time_phases: false,
    }
}

/// The prologue every training recipe shares.
pub struct RunStart {
    pub seed: u64,
    /// Where checkpoints go (`TrainConfig::checkpoint_dir`).
    pub checkpoint_dir: PathBuf,
    pub fingerprint: RunFingerprint,
    /// The latest complete checkpoint, when `resume_from_checkpoint` is set and one exists.
    pub resume: Option<Resume>,
    pub world: World,
    /// FSDP: how every weight shards over the ranks ([`fully_sharded`]); `None`: replicated.
    pub fsdp: Option<Sharding>,
}

impl RunStart {
    /// FSDP's per-rank load: this rank's rows of every weight, when the model shards.
    pub fn load_rows(&self) -> Option<crate::models::build::RowsOf> {
        (self.fsdp.is_some() && self.world.is_distributed()).then_some(
            crate::models::build::RowsOf {
                rank: self.world.rank,
                world: self.world.size,
            },
        )
    }

    /// Prints on rank 0 only: one line per run, not one per worker.
    pub fn announce(&self, line: impl FnOnce() -> String) {
        if self.world.is_main() {
            crate::say!("{}", line());
        }
    }
}

/// Seed, output directory, fingerprint and, with `resume_from_checkpoint`, the checkpoint to
/// resume from, checked against this run's fingerprint.
///
/// With several workers this is also the rendezvous check: every rank must run the same tune
/// version and the same run (its fingerprint: model, data, batching, optimizer, seed; paths
/// such as `output_dir` may differ between machines). A seed left to chance is drawn once, by
/// rank 0, for all: the ranks share one data order. Rank 0 tidies partial checkpoints away
/// before any rank looks for the one to resume.
pub fn start<B: Backend>(
    config: &RecipeConfig,
    world: World,
    device: &B::Device,
) -> Result<RunStart, SetupError> {
    use crate::distributed::sync::{all_reduce_scalars, check_same, from_rank_zero, hash64};
    let cfg = config.as_train().ok_or(SetupError::NotTraining {
        recipe: config.recipe.name,
    })?;
    let fsdp = fully_sharded(cfg, &world)?;
    check_same::<B>(
        &world,
        device,
        "tune version",
        hash64(env!("CARGO_PKG_VERSION").as_bytes()),
    )?;
    let mut seed = seed(cfg);
    if cfg.seed.is_none() {
        seed = from_rank_zero::<B>(&world, seed, device, "the seed")?;
    }
    let checkpoint_dir = cfg.checkpoint_dir().to_path_buf();
    let fingerprint = fingerprint(config, seed, world.size);
    crate::say_debug!(
        "fingerprint {} over {} keys (seed {seed})",
        fingerprint.hash(),
        fingerprint.entries.len()
    );
    check_same::<B>(
        &world,
        device,
        "config (model, data, batching, optimizer or seed)",
        hash64(fingerprint.hash().as_bytes()),
    )?;
    let resume = if cfg.resume_from_checkpoint {
        let tidied = if world.is_main() {
            find_resume(&checkpoint_dir, &fingerprint, true)?
        } else {
            None
        };
        all_reduce_scalars::<B>(&world, &[1.0], device, "the resume barrier")?;
        let resume = match tidied {
            Some(r) => Some(r),
            None if world.is_main() => None,
            None => find_resume(&checkpoint_dir, &fingerprint, false)?,
        };
        // Every rank must continue from the same point: a node that cannot see the output
        // directory's checkpoints would start over while the others resume.
        let at = resume
            .as_ref()
            .map_or(u64::MAX, |r| r.state.global_step as u64);
        check_same::<B>(
            &world,
            device,
            "checkpoint to resume from (resuming on several nodes needs an output_dir they all see)",
            at,
        )?;
        resume
    } else {
        if world.is_main() {
            claim_checkpoint_dir(&checkpoint_dir, &fingerprint, cfg.overwrite_output_dir)?;
        }
        None
    };
    let run = RunStart {
        seed,
        checkpoint_dir,
        fingerprint,
        resume,
        world,
        fsdp,
    };
    match &run.resume {
        Some(r) => run.announce(|| {
            format!(
                "Resuming from {} at step {}",
                r.dir.display(),
                r.state.global_step
            )
        }),
        None if cfg.resume_from_checkpoint => run.announce(|| {
            format!(
                "resume_from_checkpoint: no complete checkpoint in {}; training starts from the beginning",
                run.checkpoint_dir.display()
            )
        }),
        None => {}
    }
    Ok(run)
}

/// A fresh run (no `resume_from_checkpoint`) into a checkpoint directory that holds another
/// run's checkpoints is refused, unless `overwrite_output_dir` asks to delete them first. A
/// rerun of the same run (same fingerprint) replaces its checkpoints as it saves, as torchtune
/// does.
fn claim_checkpoint_dir(
    dir: &std::path::Path,
    fingerprint: &RunFingerprint,
    overwrite: bool,
) -> Result<(), SetupError> {
    use crate::training::checkpointing::{other_run, remove_checkpoints};
    let Some((checkpoint, changed)) = other_run(dir, fingerprint)? else {
        return Ok(());
    };
    if !overwrite {
        return Err(SetupError::OtherRun {
            dir: dir.to_path_buf(),
            checkpoint,
            changed,
        });
    }
    let removed = remove_checkpoints(dir)?;
    crate::say!(
        "overwrite_output_dir: deleted the other run's checkpoints in {}: {}",
        dir.display(),
        removed.join(", ")
    );
    Ok(())
}

/// What a resumed run must share with its checkpoint: the keys declared part of the
/// fingerprint (`config::schema`: the model, its adapters, the data, the optimizer, the loss, a
/// teacher or reference, ...), with the two values only the run knows: the seed it drew, and
/// the global batch (`batch_size` times the world size, so a run may resume on another number
/// of workers with the same global batch). Step limits and logging may change.
pub fn fingerprint(config: &RecipeConfig, seed: u64, world_size: usize) -> RunFingerprint {
    let mut keys = config.fingerprint_entries();
    let batch_size = config.as_train().map_or(0, |cfg| cfg.batch_size);
    keys.entries.insert("seed".into(), seed.into());
    keys.entries
        .insert("batch_size".into(), (batch_size * world_size.max(1)).into());
    RunFingerprint {
        entries: keys.entries,
        resume_may_change: keys.resume_may_change,
        defaults: keys.defaults,
    }
}

/// The locks that keep one run per directory it writes, held until dropped (and released by
/// the operating system when the process ends, even when killed).
#[derive(Debug)]
pub struct RunLocks {
    _files: Vec<std::fs::File>,
}

/// The lock file in a locked directory.
pub const LOCK_FILE: &str = ".tune.lock";

/// Takes the advisory lock of every directory the run writes: where its checkpoints go
/// (`checkpointer.output_dir`, else `output_dir`) and `output_dir` (its config and metrics)
/// when that is another directory. Two runs writing one checkpoint directory would mix their
/// checkpoints, whatever their `output_dir`s; two sharing one `output_dir` would mix their
/// config and metrics.
pub fn lock_run_dirs(cfg: &TrainConfig) -> Result<RunLocks, SetupError> {
    let checkpoints = cfg.checkpoint_dir();
    let mut files = vec![lock_dir(checkpoints, cfg.checkpoint_dir_key())?];
    if !same_dir(checkpoints, &cfg.output_dir) {
        files.push(lock_dir(&cfg.output_dir, "output_dir")?);
    }
    Ok(RunLocks { _files: files })
}

/// A second checkpoint directory of the run (PPO's value model's), claimed as the first is:
/// locked for the run; a fresh run refuses it when it holds another run's checkpoints (unless
/// `overwrite_output_dir`), a resumed run tidies away the partial checkpoints a crash left.
pub fn claim_companion_dir(
    dir: &std::path::Path,
    key: &'static str,
    run: &RunStart,
    overwrite: bool,
) -> Result<RunLocks, SetupError> {
    let lock = lock_dir(dir, key)?;
    if run.resume.is_some() {
        let cleaned = crate::checkpoint_client::clean_partial(dir).map_err(|e| {
            crate::training::TrainError::from(crate::training::error::CheckpointingError::from(e))
        })?;
        for c in cleaned {
            crate::say!(
                "removed the partial checkpoint {} left by an interrupted run",
                c.path.display()
            );
        }
    } else {
        claim_checkpoint_dir(dir, &run.fingerprint, overwrite)?;
    }
    Ok(RunLocks { _files: vec![lock] })
}

/// Whether two existing directories are one (after `lock_dir` created them).
fn same_dir(a: &std::path::Path, b: &std::path::Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// Takes `dir`'s advisory lock (creating the directory), or fails naming the config `key`
/// that chose it and the process that holds it.
fn lock_dir(dir: &std::path::Path, key: &'static str) -> Result<std::fs::File, SetupError> {
    use std::io::{Read, Seek, Write};
    let io = |what, path: &std::path::Path, source| SetupError::Io {
        what,
        path: path.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(|e| io(key, dir, e))?;
    let path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| io("the run's lock", &path, e))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            return Err(SetupError::Locked {
                key,
                dir: dir.to_path_buf(),
                holder: holder.trim().to_string(),
            });
        }
        Err(std::fs::TryLockError::Error(source)) => {
            return Err(io("the run's lock", &path, source));
        }
    }
    // Who holds it, for the message a second run prints.
    let _ = file.set_len(0);
    let _ = file.rewind();
    let _ = write!(file, "pid {}", std::process::id());
    let _ = file.flush();
    Ok(file)
}

/// How the weights shard over the ranks (FSDP), if they do: on several ranks unless
/// `data_parallel_shard_dim` is 1, as torchtune's `-1` default shards over all of them. With
/// `fsdp_cpu_offload` on a GPU they shard on one rank too, as torchtune's FSDP does on one
/// GPU: the rows, gradients and optimizer state then live in host memory (on the CPU, where
/// they live already, the key changes nothing: the config check says so).
fn fully_sharded(cfg: &TrainConfig, world: &World) -> Result<Option<Sharding>, SetupError> {
    use crate::config::schema::Device;
    let cpu_offload = cfg.fsdp_cpu_offload && Device::or_default(cfg.device) != Device::Cpu;
    let sharding = Sharding {
        reshard_after_forward: cfg.fsdp_reshard_after_forward,
        cpu_offload,
    };
    if !world.is_distributed() {
        return Ok(cpu_offload.then_some(sharding));
    }
    let fsdp = match cfg.data_parallel_shard_dim {
        Some(1.0) => false,
        None => true,
        Some(d) if d == -1.0 || d == world.size as f64 => true,
        Some(d) => {
            return Err(SetupError::ShardDim {
                dim: d as i64,
                world: world.size,
            });
        }
    };
    Ok(fsdp.then_some(sharding))
}
