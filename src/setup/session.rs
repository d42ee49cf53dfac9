//! The epilogue every training recipe shares: train through the trainer core, wait for the
//! last checkpoint to be durable, report, and push it when the config asks. Rank 0 writes the
//! checkpoints, reports and pushes; the other ranks train alongside it.

use burn::tensor::backend::AutodiffBackend;

use super::SetupError;
use super::run::{self as settings, RunStart};
use crate::checkpoint::StorageDtype;
use crate::checkpoint_client::PublishedCheckpoint;
use crate::config::schema::{PushToHub, TrainConfig};
use crate::data::{DataLoader, Dataset};
use crate::distributed::{Ending, Ends, World};
use crate::models::CausalLm;
use crate::modules::fake_quant::QuantScheme;
use crate::training::checkpointing::{RunCheckpointer, SaveContent, ShardedRun};
use crate::training::offload::Offload;
use crate::training::optimizer_shards::ShardWriter;
use crate::training::sharded_checkpoint::RankShareWriter;
use crate::training::trainer::TrainSummary;
use crate::training::validation::Validation;
use crate::training::{Batches, EpochSteps, TrainError, Trainer};
use crate::training::{LossStep, OptimizerSnapshot, SaveHook, SaveKind, TrainState};

/// A run's training data: this rank's share of every batch comes from `loader`.
pub struct TrainData {
    pub tokenizer: crate::tokenizer::Tokenizer,
    pub dataset: Dataset,
    pub loader: DataLoader,
    /// `dataset_val`: scored every `run_val_every_n_steps` and at each epoch end.
    pub validation: Option<Validation>,
}

/// The end of a run that trained: the push is the only step after training that can fail
/// on its own.
#[derive(Debug, thiserror::Error)]
pub enum FinishError {
    #[error(transparent)]
    Train(#[from] TrainError),
    /// Training stopped after saving at least one checkpoint: where to continue from, and the
    /// command that does.
    #[error("{source}\n{resume}")]
    Stopped {
        source: TrainError,
        resume: Box<ResumePoint>,
    },
    /// A signal stopped a run that had saved nothing yet.
    #[error(
        "{source}; no checkpoint was saved yet (with save_on_preempt: True a signal saves one first)"
    )]
    StoppedUnsaved { source: TrainError },
    #[error("push_to_hub: {0}")]
    Push(#[from] crate::hub::HubError),
}

impl Ends for FinishError {
    fn ending(&self) -> Ending {
        match self {
            Self::Train(source)
            | Self::Stopped { source, .. }
            | Self::StoppedUnsaved { source } => source.ending(),
            Self::Push(_) => Ending::Failed,
        }
    }
}

/// Where a stopped run can continue from: its last complete checkpoint and the command.
#[derive(Debug)]
pub struct ResumePoint {
    pub last: std::path::PathBuf,
    pub command: String,
}

impl std::fmt::Display for ResumePoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "The last complete checkpoint is {}. Continue from it with:\n  {}",
            self.last.display(),
            self.command
        )
    }
}

/// The trainer core and the run's checkpoint client, ready to train.
pub struct Session<B: AutodiffBackend> {
    pub trainer: Trainer<B>,
    /// Rank 0's checkpoint client; `None` on the other ranks.
    pub saver: Option<RunCheckpointer>,
    /// The other ranks' writer of their own files of each checkpoint, when they write any.
    rank_writer: Option<RankWriter>,
    /// Where the metrics go, for the recipe's start-up line.
    pub log_dir: String,
}

/// Builds the trainer for `model` (restoring the optimizer and position of a resumed run) and,
/// on rank 0, the checkpoint client that saves `content`.
pub fn session<B: AutodiffBackend>(
    cfg: &TrainConfig,
    mut run: RunStart,
    model: CausalLm<B>,
    content: SaveContent,
    storage_dtype: StorageDtype,
    recipe: &str,
    device: &B::Device,
) -> Result<Session<B>, SetupError> {
    let (mut trainer, log_dir) = settings::trainer(cfg, &mut run, model, device)?;
    let world = run.world.clone();
    let fsdp = run.fsdp.is_some();
    if let Some(sharding) = run.fsdp {
        trainer.model = crate::training::fsdp::shard_model(trainer.model, &world, sharding);
        trainer.offload = sharding
            .cpu_offload
            .then(|| Offload::new(trainer.optimizer.settings.clone()));
    }
    // Ranks write their own files of a checkpoint when they all see the output directory
    // (threads of one process always do; nodes do on a shared file system); otherwise rank 0
    // gathers what it writes through the collectives.
    let shared_run = if world.is_distributed() && (fsdp || trainer.settings.shard_optimizer) {
        shared_dir_run::<B::InnerBackend>(&world, &run.checkpoint_dir, device)?
    } else {
        None
    };
    // FSDP: every rank writes its rows of the model and its optimizer state
    // (`sharded_checkpoint`). Not for LoRA (an adapter is saved whole, and its merged model
    // needs whole base weights), nor for families whose checkpoints fuse projections that
    // shard apart (Phi-3's `qkv_proj`: a rank's rows of q, k and v are not one block of it;
    // gpt-oss's fused experts):
    // their ranks gather for rank 0.
    // Nor for a multimodal checkpoint's language model: rank 0 copies the vision tower through
    // beside the gathered weights (`model_io::hf::save_hf_dir`).
    let sharded_saves = fsdp
        && matches!(content, SaveContent::FullModel)
        && !trainer.model.args.fused_on_disk()
        && trainer.model.args.tower.is_none();
    let sharded = shared_run.filter(|_| sharded_saves).map(|id| ShardedRun {
        id,
        world: world.size,
    });
    // ZeRO-1 ranks write their own optimizer shards; an FSDP run that gathers its checkpoints
    // (LoRA, QAT, fused projections, or no shared directory) has rank 0 write the whole state
    // gathered from every rank's rows.
    let per_rank_files = trainer.settings.shard_optimizer && !fsdp && shared_run.is_some();
    trainer.save_optimizer_shards = per_rank_files;
    trainer.sharded_saves = sharded.is_some();
    let max_shard_bytes = crate::model_io::hf::DEFAULT_MAX_SHARD_BYTES;
    let saver = if world.is_main() {
        let mut saver =
            settings::checkpointer(cfg, recipe, content, run.fingerprint, storage_dtype)?;
        saver.world_size = world.size;
        saver.optimizer_shards = per_rank_files.then_some(world.size);
        saver.sharded = sharded;
        Some(saver)
    } else {
        None
    };
    let rank_writer = match sharded {
        _ if world.is_main() => None,
        Some(run_id) => Some(RankWriter::Share(RankShareWriter::new(
            run.checkpoint_dir.clone(),
            run_id.id,
            world.rank,
            world.size,
            storage_dtype,
            max_shard_bytes,
        ))),
        None if per_rank_files => Some(RankWriter::Optimizer(ShardWriter::new(
            run.checkpoint_dir.clone(),
            world.rank,
            world.size,
        ))),
        None => None,
    };
    Ok(Session {
        trainer,
        saver,
        rank_writer,
        log_dir,
    })
}

/// When every rank sees the file rank 0 writes into `dir` (named after a random nonce that
/// travels through the collective), the nonce: every rank then names the run's staging
/// directories with it. The probe is named like a partial checkpoint, so the checkpoint
/// client's clean-up removes one a crash leaves behind.
fn shared_dir_run<B: burn::tensor::backend::Backend>(
    world: &World,
    dir: &std::path::Path,
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

/// What a rank other than 0 writes of each checkpoint.
enum RankWriter {
    /// ZeRO-1: its optimizer shard.
    Optimizer(ShardWriter),
    /// FSDP: its rows of the model and its optimizer state.
    Share(RankShareWriter),
}

impl RankWriter {
    fn hook<B: AutodiffBackend>(&mut self) -> &mut dyn SaveHook<B> {
        match self {
            Self::Optimizer(w) => w,
            Self::Share(w) => w,
        }
    }

    fn finish(&mut self) -> Result<(), TrainError> {
        match self {
            Self::Optimizer(w) => w.finish(),
            Self::Share(w) => w.finish(),
        }
    }
}

/// A second model a run checkpoints beside its own (PPO's value model).
pub trait Companion<B: AutodiffBackend> {
    /// Saves it at each of the run's saves (the run's model and optimizer passed to the hook
    /// are not its own: it saves what it holds).
    fn hook(&mut self) -> &mut dyn SaveHook<B>;
    /// Waits for its last save to be durable.
    fn finish(&mut self) -> Result<(), TrainError>;
}

/// Two save hooks, `first` then `then`, at every save.
struct Both<'a, B: AutodiffBackend> {
    first: &'a mut dyn SaveHook<B>,
    then: &'a mut dyn SaveHook<B>,
}

impl<B: AutodiffBackend> SaveHook<B> for Both<'_, B> {
    fn save(
        &mut self,
        kind: SaveKind,
        model: &mut CausalLm<B>,
        optimizer: &OptimizerSnapshot,
        state: &TrainState,
    ) -> Result<(), TrainError> {
        self.first.save(kind, model, optimizer, state)?;
        self.then.save(kind, model, optimizer, state)
    }
}

/// The save hook of ranks that do not write.
struct NoSave;

impl<B: AutodiffBackend> SaveHook<B> for NoSave {
    fn save(
        &mut self,
        _: SaveKind,
        _: &mut CausalLm<B>,
        _: &OptimizerSnapshot,
        _: &TrainState,
    ) -> Result<(), TrainError> {
        Ok(())
    }
}

impl<B: AutodiffBackend> Session<B> {
    pub fn world(&self) -> &World {
        &self.trainer.world
    }

    /// QAT: the final checkpoint also holds the int4 export. Quantizing needs every weight
    /// whole, so an FSDP run's ranks gather the model for rank 0 instead of writing shares.
    pub fn with_quantized_export(mut self, scheme: QuantScheme) -> Result<Self, SetupError> {
        crate::setup::model::refuse_quantized_export(&self.trainer.model.args)?;
        if let Some(saver) = &mut self.saver {
            saver.quantized_export = Some(scheme);
            saver.sharded = None;
        }
        self.trainer.sharded_saves = false;
        if matches!(self.rank_writer, Some(RankWriter::Share(_))) {
            self.rank_writer = None;
        }
        Ok(self)
    }

    /// Prints on rank 0 only.
    pub fn announce(&self, line: impl FnOnce() -> String) {
        if self.world().is_main() {
            eprintln!("{}", line());
        }
    }

    /// Trains on `data`'s batches, waits for the last checkpoint to be durable, reports, and
    /// pushes it to the Hub when `push_to_hub` is set.
    pub fn fit(
        self,
        data: &TrainData,
        loss: &mut dyn LossStep<B>,
        push: Option<&PushToHub>,
    ) -> Result<TrainSummary, FinishError> {
        let mut batches = Batches::new(&data.dataset, &data.loader, loss, data.validation.as_ref());
        self.run(&mut batches, push)
    }

    /// [`Self::fit`] over any steps (GRPO's rollouts).
    pub fn run(
        self,
        steps: &mut dyn EpochSteps<B>,
        push: Option<&PushToHub>,
    ) -> Result<TrainSummary, FinishError> {
        self.run_with(steps, push, None)
    }

    /// [`Self::run`], saving `companion` at every save too, before the run's own checkpoint
    /// (PPO's value model, which has its own checkpoint client and directory), and waiting
    /// for its last save as for the run's.
    pub fn run_with(
        self,
        steps: &mut dyn EpochSteps<B>,
        push: Option<&PushToHub>,
        mut companion: Option<&mut dyn Companion<B>>,
    ) -> Result<TrainSummary, FinishError> {
        let Session {
            trainer,
            mut saver,
            mut rank_writer,
            ..
        } = self;
        let own: &mut dyn SaveHook<B> = match (saver.as_mut(), rank_writer.as_mut()) {
            (Some(s), _) => s,
            (None, Some(w)) => w.hook(),
            (None, None) => &mut NoSave,
        };
        let fitted = match companion.as_deref_mut() {
            Some(first) => trainer.run(
                steps,
                &mut Both {
                    first: first.hook(),
                    then: own,
                },
            ),
            None => trainer.run(steps, own),
        };
        if let Some(c) = companion {
            c.finish()?;
        }
        if let Some(writer) = rank_writer.as_mut() {
            writer.finish()?;
        }
        let Some(mut saver) = saver else {
            return Ok(fitted?.0);
        };
        // A save in flight when training stopped still completes: it holds healthy weights.
        let finished = saver.finish();
        let (summary, _model) = match fitted {
            Ok(fitted) => fitted,
            Err(source) => {
                if let Err(e) = finished {
                    eprintln!("checkpoint: {e}");
                }
                return Err(match saver.last_complete_dir() {
                    Some(last) => FinishError::Stopped {
                        source,
                        resume: Box::new(ResumePoint {
                            last,
                            command: resume_command(std::env::args()),
                        }),
                    },
                    None if matches!(source, TrainError::Interrupted { .. }) => {
                        FinishError::StoppedUnsaved { source }
                    }
                    None => FinishError::Train(source),
                });
            }
        };
        finished?;
        report(&summary, saver.last_published.as_ref());
        push_if_configured(push, saver.last_published.as_ref())?;
        Ok(summary)
    }
}

/// This process's command line with `resume_from_checkpoint=True` in place of any value it
/// had, quoted for a POSIX shell.
fn resume_command(args: impl Iterator<Item = String>) -> String {
    let quote = |arg: &str| {
        let plain = !arg.is_empty()
            && arg
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-./=:,+@%~".contains(c));
        if plain {
            arg.to_string()
        } else {
            format!("'{}'", arg.replace('\'', r"'\''"))
        }
    };
    let mut words: Vec<String> = args
        .filter(|a| !a.starts_with("resume_from_checkpoint="))
        .map(|a| quote(&a))
        .collect();
    words.push("resume_from_checkpoint=True".into());
    words.join(" ")
}

/// The closing lines of a training run.
pub fn report(summary: &TrainSummary, last: Option<&PublishedCheckpoint>) {
    let first = summary.losses.first().copied().unwrap_or(f64::NAN);
    let last_loss = summary.losses.last().copied().unwrap_or(f64::NAN);
    eprintln!(
        "Trained {} steps ({} tokens): loss {first:.4} -> {last_loss:.4}",
        summary.state.global_step, summary.state.tokens_seen
    );
    if let Some(p) = last {
        eprintln!("Saved {}", p.dir.display());
    }
}

/// `push_to_hub: {repo_id, private}`: uploads the final checkpoint when the run finishes.
fn push_if_configured(
    push: Option<&PushToHub>,
    last: Option<&PublishedCheckpoint>,
) -> Result<(), crate::hub::HubError> {
    let (Some(push), Some(last)) = (push, last) else {
        return Ok(());
    };
    let report = crate::hub::push(crate::hub::PushOptions {
        dir: last.dir.clone(),
        repo_id: push.repo_id.clone(),
        private: push.private,
        commit_message: Some(format!("Upload {} trained with tune", last.name)),
        progress: true,
        ..Default::default()
    })?;
    eprintln!("Pushed {} to {}", last.dir.display(), report.repo_url);
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_resume_command_replaces_the_flag_and_quotes_what_the_shell_would_split() {
        let args = [
            "tune",
            "run",
            "lora_finetune_single_device",
            "--config",
            "my config.yaml",
            "resume_from_checkpoint=False",
            "dataset.source=it's",
        ];
        assert_eq!(
            super::resume_command(args.iter().map(|a| a.to_string())),
            r"tune run lora_finetune_single_device --config 'my config.yaml' 'dataset.source=it'\''s' resume_from_checkpoint=True"
        );
    }
}
