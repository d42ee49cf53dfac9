//! A run's trainer core and checkpoint client, built complete: how the workers divide the
//! work (FSDP, ZeRO-1, offload, and who writes which file of a checkpoint) decided once from
//! the config and the world ([`Parallelism`]); the optimizer and position of a resumed run; the
//! metric loggers (rank 0's; the other ranks log nothing).

use std::path::Path;

use burn::tensor::backend::{AutodiffBackend, Backend};

use super::run::{RunStart, trainer_settings};
use super::{SetupError, logging, optim};
use crate::checkpoint::StorageDtype;
use crate::config::schema::TrainConfig;
use crate::distributed::World;
use crate::model_io::hf::DEFAULT_MAX_SHARD_BYTES;
use crate::models::CausalLm;
use crate::modules::fake_quant::QuantScheme;
use crate::training::checkpointing::{
    CheckpointerOptions, RunCheckpointer, RunFingerprint, SaveContent, SaveLayout,
};
use crate::training::metrics::{MetricLoggers, MetricsFile};
use crate::training::optimizer::Optimizer;
use crate::training::parallel::{Parallelism, RankWriter, SaveConditions, Saves};
use crate::training::{TrainState, Trainer};

/// What a recipe's checkpoints hold, and its own say over the loop.
pub struct Plan {
    pub content: SaveContent,
    /// The checkpoint's dtype, which saves keep.
    pub storage_dtype: StorageDtype,
    /// QAT: the final checkpoint also holds the int4 export (quantizing needs every weight
    /// whole, so FSDP's ranks gather the model for rank 0 rather than each writing its rows).
    pub quantized_export: Option<QuantScheme>,
    /// The epochs, where the recipe counts them itself (PPO: as many passes over the prompts
    /// as `num_steps` needs); else the config's.
    pub epochs: Option<usize>,
}

impl Plan {
    pub fn new(content: SaveContent, storage_dtype: StorageDtype) -> Self {
        Self {
            content,
            storage_dtype,
            quantized_export: None,
            epochs: None,
        }
    }
}

/// The trainer core and the writers of the run's checkpoints, one parallelism behind all.
pub struct Built<B: AutodiffBackend> {
    pub trainer: Trainer<B>,
    /// Rank 0's checkpoint client; `None` on the other ranks.
    pub saver: Option<RunCheckpointer>,
    /// The other ranks' writer of their own files of each checkpoint, when they write any.
    pub rank_writer: Option<RankWriter>,
    /// Where the metrics go, for the recipe's start-up line.
    pub log_dir: String,
}

/// Builds the trainer for `model` as the config asks, and the checkpoint client that saves
/// what `plan` says.
pub fn build<B: AutodiffBackend>(
    cfg: &TrainConfig,
    mut run: RunStart,
    model: CausalLm<B>,
    plan: Plan,
    recipe: &str,
    device: &B::Device,
) -> Result<Built<B>, SetupError> {
    if plan.quantized_export.is_some() {
        super::model::refuse_quantized_export(&model.args)?;
    }
    let world = run.world.clone();
    let optimizer_settings = optim::optimizer(&cfg.optimizer);
    // Full-weight training shards AdamW's moments over the ranks (ZeRO-1); LoRA's are small.
    let zero1 = !cfg.model.is_lora();
    let (model, parallel) =
        Parallelism::new(model, world.clone(), run.fsdp, zero1, &optimizer_settings);
    // Ranks write their own files of a checkpoint when they all see the output directory
    // (threads of one process always do; nodes do on a shared file system); otherwise rank 0
    // gathers what it writes through the collectives.
    let shared_dir =
        if world.is_distributed() && (run.fsdp.is_some() || parallel.shards_optimizer()) {
            shared_dir_run::<B::InnerBackend>(&world, &run.checkpoint_dir, device)?
        } else {
            None
        };
    let saves = Saves::decide(SaveConditions {
        fsdp: run.fsdp.is_some(),
        zero1: parallel.shards_optimizer(),
        shared_dir,
        rows_are_the_checkpoint: matches!(plan.content, SaveContent::FullModel)
            && !model.args.fused_on_disk()
            && model.args.tower.is_none()
            && plan.quantized_export.is_none(),
    });
    crate::say_debug!(
        "parallelism: {} worker(s), FSDP {}, ZeRO-1 {}, CPU offload {}; checkpoints: {saves:?}",
        world.size,
        run.fsdp.is_some(),
        parallel.shards_optimizer(),
        parallel.offload().is_some()
    );
    let parallel = parallel.with_saves(saves);
    let saver = if world.is_main() {
        let layout = SaveLayout {
            quantized_export: plan.quantized_export,
            ..saves.layout(&world)
        };
        let options = checkpointer_options(cfg, recipe, run.fingerprint.clone(), &plan, layout);
        Some(RunCheckpointer::new(options)?)
    } else {
        None
    };
    let rank_writer = saves.rank_writer(
        &world,
        run.checkpoint_dir.clone(),
        plan.storage_dtype,
        DEFAULT_MAX_SHARD_BYTES,
    );
    let mut optimizer = Optimizer::new(optimizer_settings);
    let mut state = TrainState::default();
    let metrics_file = match &run.resume {
        Some(r) => MetricsFile::ResumeAfter(r.state.global_step),
        None => MetricsFile::New,
    };
    if let Some(r) = run.resume.take() {
        optimizer.load_state_dict(r.optimizer_step, r.optimizer_state, device);
        state = r.state;
    }
    let (loggers, log_dir) = if world.is_main() {
        logging::loggers(cfg.metric_logger.as_ref(), &cfg.output_dir, metrics_file)?
    } else {
        (MetricLoggers { sinks: Vec::new() }, String::new())
    };
    let mut settings = trainer_settings(cfg, run.seed, world.is_main());
    if let Some(epochs) = plan.epochs {
        settings.epochs = epochs;
    }
    let trainer = Trainer::new(settings, model, optimizer, state, loggers, parallel);
    Ok(Built {
        trainer,
        saver,
        rank_writer,
        log_dir,
    })
}

fn checkpointer_options(
    cfg: &TrainConfig,
    recipe: &str,
    fingerprint: RunFingerprint,
    plan: &Plan,
    layout: SaveLayout,
) -> CheckpointerOptions {
    CheckpointerOptions {
        output_dir: cfg.checkpoint_dir().to_path_buf(),
        keep_last_n: cfg.keep_last_n_checkpoints,
        recipe: recipe.to_string(),
        content: plan.content.clone(),
        fingerprint,
        source_dir: cfg.checkpointer.checkpoint_dir.clone(),
        storage_dtype: plan.storage_dtype,
        max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        layout,
    }
}

/// The checkpoint client of a second model the run saves (PPO's value model): into `dir`,
/// with the tokenizer files of `source_dir`. Each of its saves is published before the run's
/// own is requested, and it keeps one checkpoint more than `keep_last_n_checkpoints`: a run
/// stopped between the two saves of a step resumes from the step before, whose companion is
/// still there.
pub fn companion_checkpointer(
    cfg: &TrainConfig,
    dir: &Path,
    source_dir: &Path,
    recipe: &str,
    fingerprint: RunFingerprint,
    storage_dtype: StorageDtype,
) -> Result<RunCheckpointer, crate::training::TrainError> {
    RunCheckpointer::new(CheckpointerOptions {
        output_dir: dir.to_path_buf(),
        keep_last_n: cfg.keep_last_n_checkpoints.map(|n| n + 1),
        recipe: recipe.to_string(),
        content: SaveContent::FullModel,
        fingerprint,
        source_dir: source_dir.to_path_buf(),
        storage_dtype,
        max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        layout: SaveLayout {
            always_block: true,
            ..SaveLayout::default()
        },
    })
}

/// When every rank sees the file rank 0 writes into `dir` (named after a random nonce that
/// travels through the collective), the nonce: every rank then names the run's staging
/// directories with it. The probe is named like a partial checkpoint, so the checkpoint
/// client's clean-up removes one a crash leaves behind.
fn shared_dir_run<B: Backend>(
    world: &World,
    dir: &Path,
    device: &B::Device,
) -> Result<Option<u64>, SetupError> {
    use crate::distributed::sync::{all_reduce_scalars, from_rank_zero, hash64};
    let io = |source| SetupError::Io {
        what: "output_dir",
        path: dir.to_path_buf(),
        source,
    };
    let probe_name = |nonce: u64| format!(".tmp-fscheck.{nonce:016x}-0");
    let mut nonce = 0;
    let mut probe = None;
    if world.is_main() {
        let seed = format!(
            "{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)
        );
        nonce = hash64(seed.as_bytes());
        std::fs::create_dir_all(dir).map_err(io)?;
        let path = dir.join(probe_name(nonce));
        std::fs::write(&path, b"").map_err(io)?;
        probe = Some(path);
    }
    let nonce = from_rank_zero::<B>(world, nonce, device, "the output directory check")?;
    let name = probe_name(nonce);
    let sees = f64::from(u8::from(dir.join(name).is_file()));
    let seen = all_reduce_scalars::<B>(world, &[sees], device, "the output directory check")?;
    if let Some(path) = probe {
        let _ = std::fs::remove_file(path);
    }
    Ok((seen[0].round() as usize == world.size).then_some(nonce))
}
