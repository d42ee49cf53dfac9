//! The epilogue every training recipe shares: train through the trainer core, wait for the
//! last checkpoint to be durable, report, and push it when the config asks. Rank 0 writes the
//! checkpoints (the other ranks their own files where the parallelism says so), reports and
//! pushes; the other ranks train alongside it.

use burn::tensor::backend::AutodiffBackend;

use super::SetupError;
use super::finish::{FinishError, ResumePoint, push_if_configured, report, resume_command};
use super::run::RunStart;
use super::trainer::{Built, Plan, build};
use crate::config::schema::{PushToHub, TrainConfig};
use crate::data::{DataLoader, Dataset};
use crate::distributed::World;
use crate::models::CausalLm;
use crate::training::checkpointing::RunCheckpointer;
use crate::training::parallel::RankWriter;
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

/// The trainer core and the run's checkpoint writers, ready to train.
pub struct Session<B: AutodiffBackend> {
    pub trainer: Trainer<B>,
    /// Rank 0's checkpoint client; `None` on the other ranks.
    saver: Option<RunCheckpointer>,
    /// The other ranks' writer of their own files of each checkpoint, when they write any.
    rank_writer: Option<RankWriter>,
    /// Where the metrics go, for the recipe's start-up line.
    pub log_dir: String,
}

/// The session for `model`: its trainer (restoring the optimizer and position of a resumed
/// run) and, on rank 0, the checkpoint client that saves what `plan` says.
pub fn session<B: AutodiffBackend>(
    cfg: &TrainConfig,
    run: RunStart,
    model: CausalLm<B>,
    plan: Plan,
    recipe: &str,
    device: &B::Device,
) -> Result<Session<B>, SetupError> {
    let Built {
        trainer,
        saver,
        rank_writer,
        log_dir,
    } = build(cfg, run, model, plan, recipe, device)?;
    Ok(Session {
        trainer,
        saver,
        rank_writer,
        log_dir,
    })
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
        self.trainer.world()
    }

    /// Prints on rank 0 only.
    pub fn announce(&self, line: impl FnOnce() -> String) {
        if self.world().is_main() {
            crate::say!("{}", line());
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
