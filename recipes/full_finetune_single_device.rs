//! Full fine-tuning (torchtune's `full_finetune_single_device.py`, and with several workers
//! `full_finetune_distributed.py`): every weight trains; each checkpoint is a complete Hugging
//! Face model directory.

use burn::tensor::backend::AutodiffBackend;

use crate::config::schema::{SftKeys, TrainConfig};
use crate::models::{BaseWeights, Trainable};
use crate::setup::{data, model, run as settings, session};
use crate::training::checkpointing::SaveContent;
use crate::training::sft::SftLoss;

use super::RunContext;
use crate::config::recipes::{DataKind, Layout, OwnKeysSpec, RecipeSpec, Trains};
use crate::distributed::WorkerError;
use crate::setup::run::RunStart;
use crate::setup::trainer::Plan;

pub static RECIPE: RecipeSpec = RecipeSpec {
    name: "full_finetune",
    aliases: &["full_finetune_single_device"],
    distributed: Some("full_finetune_distributed"),
    description: "Full fine-tuning of every weight (SFT)",
    trains: Trains::Full,
    data: DataKind::Responses,
    layout: Layout::Training,
    own: OwnKeysSpec::of::<SftKeys>(),
};

pub fn run<B: AutodiffBackend>(
    cfg: &TrainConfig,
    keys: &SftKeys,
    ctx: &RunContext<B>,
    run: RunStart,
) -> Result<(), WorkerError> {
    // Model: from the checkpointer, or from the checkpoint being resumed.
    let checkpoint = model::policy(&cfg.checkpointer, &run)?;
    let loaded = model::load::<B>(&checkpoint, BaseWeights::Float, run.load_rows(), &ctx.device)?;
    let policy = loaded.model.set_trainable(Trainable::All);

    let data = data::train_data(cfg, &checkpoint.args, &run, &ctx.base_dir)?;
    let seed = run.seed;
    let session = session::session(
        cfg,
        run,
        policy,
        Plan::new(SaveContent::FullModel, loaded.storage_dtype),
        ctx.recipe_name,
        &ctx.device,
    )?;
    session.announce(|| {
        format!(
            "Full fine-tuning {} ({} parameters) on {} samples; seed {seed}; metrics in {}",
            cfg.checkpointer.checkpoint_dir.display(),
            session.trainer.model.args.num_params(),
            data.dataset.len(),
            session.log_dir,
        )
    });

    let mut loss = SftLoss {
        activation_checkpointing: settings::checkpointing(cfg),
        output_chunks: keys.loss.output_chunks(),
        fake_quant_after: None,
        ..SftLoss::default()
    };
    session.fit(&data, &mut loss, cfg.push_to_hub.as_ref())?;
    Ok(())
}
