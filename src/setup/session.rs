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
use crate::distributed::World;
use crate::models::CausalLm;
use crate::modules::fake_quant::QuantScheme;
use crate::training::checkpointing::{RunCheckpointer, SaveContent};
use crate::training::trainer::{
    LossStep, OptimizerSnapshot, SaveHook, SaveKind, TrainState, TrainSummary,
};
use crate::training::{TrainError, Trainer};

/// A run's training data: this rank's share of every batch comes from `loader`.
pub struct TrainData {
    pub tokenizer: crate::tokenizer::Tokenizer,
    pub dataset: Dataset,
    pub loader: DataLoader,
}

/// The end of a run that trained: the push is the only step after training that can fail
/// on its own.
#[derive(Debug, thiserror::Error)]
pub enum FinishError {
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error("push_to_hub: {0}")]
    Push(#[from] crate::hub::HubError),
}

/// The trainer core and the run's checkpoint client, ready to train.
pub struct Session<B: AutodiffBackend> {
    pub trainer: Trainer<B>,
    /// Rank 0's checkpoint client; `None` on the other ranks.
    pub saver: Option<RunCheckpointer>,
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
    let (trainer, log_dir) = settings::trainer(cfg, &mut run, model, device)?;
    let saver = if run.world.is_main() {
        Some(settings::checkpointer(
            cfg,
            recipe,
            content,
            run.fingerprint,
            storage_dtype,
        )?)
    } else {
        None
    };
    Ok(Session {
        trainer,
        saver,
        log_dir,
    })
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

    /// QAT: the final checkpoint also holds the int4 export.
    pub fn with_quantized_export(mut self, scheme: QuantScheme) -> Self {
        if let Some(saver) = &mut self.saver {
            saver.quantized_export = Some(scheme);
        }
        self
    }

    /// Prints on rank 0 only.
    pub fn announce(&self, line: impl FnOnce() -> String) {
        if self.world().is_main() {
            eprintln!("{}", line());
        }
    }

    /// Trains, waits for the last checkpoint to be durable, reports, and pushes it to the Hub
    /// when `push_to_hub` is set.
    pub fn fit(
        self,
        data: &TrainData,
        loss: &mut dyn LossStep<B>,
        push: Option<&PushToHub>,
    ) -> Result<TrainSummary, FinishError> {
        let Session {
            trainer, mut saver, ..
        } = self;
        let hook: &mut dyn SaveHook<B> = match saver.as_mut() {
            Some(s) => s,
            None => &mut NoSave,
        };
        let (summary, _model) = trainer.fit(&data.dataset, &data.loader, loss, hook)?;
        let Some(mut saver) = saver else {
            return Ok(summary);
        };
        saver.finish()?;
        report(&summary, saver.last_published.as_ref());
        push_if_configured(push, saver.last_published.as_ref())?;
        Ok(summary)
    }
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
