//! Full DPO (torchtune's `full_dpo_single_device.py`, and with several workers
//! `full_dpo_distributed.py`): every weight of the policy trains against a frozen reference
//! model loaded from `ref_checkpointer`. Each checkpoint is a complete Hugging Face model
//! directory.

use burn::tensor::backend::AutodiffBackend;

use crate::config::keys::{keys, required};
use crate::config::schema::{CheckpointerConfig, DpoLoss as DpoLossConfig, TrainConfig};
use crate::models::{BaseWeights, Trainable};
use crate::setup::{data, loss, model, session};
use crate::training::checkpointing::SaveContent;
use crate::training::dpo::{DpoLoss, DpoReference};

use super::RunContext;
use crate::config::recipes::{DataKind, Layout, OwnKeysSpec, RecipeSpec, Trains};
use crate::distributed::WorkerError;
use crate::setup::run::RunStart;
use crate::setup::trainer::Plan;

pub static RECIPE: RecipeSpec = RecipeSpec {
    name: "full_dpo",
    aliases: &["full_dpo_single_device"],
    distributed: Some("full_dpo_distributed"),
    description: "DPO preference alignment of every weight against a frozen reference",
    trains: Trains::Full,
    data: DataKind::Pairs,
    layout: Layout::Training,
    own: OwnKeysSpec::of::<FullDpoKeys>(),
};

keys! {
    /// Full DPO's own keys.
    pub struct FullDpoKeys {}
    /// DPO's loss.
    loss: DpoLossConfig = required().fingerprint(),
    /// The frozen reference model (usually the checkpoint being trained).
    ref_checkpointer: CheckpointerConfig = required(),
}

pub fn run<B: AutodiffBackend>(
    cfg: &TrainConfig,
    dpo_keys: &FullDpoKeys,
    ctx: &RunContext<B>,
    run: RunStart,
) -> Result<(), WorkerError> {
    // Policy: from the checkpointer, or from the checkpoint being resumed.
    let checkpoint = model::policy(&cfg.checkpointer, &run)?;
    let loaded = model::load::<B>(&checkpoint, BaseWeights::Float, run.load_rows(), &ctx.device)?;
    let policy = loaded.model.set_trainable(Trainable::All);

    // Reference: frozen, on the backend without autodiff, so it never joins the graph.
    let ref_cfg = &dpo_keys.ref_checkpointer;
    let reference =
        model::frozen::<B::InnerBackend>(&model::open(ref_cfg, "ref_checkpointer")?, &run, &ctx.device)?;

    // Data: chosen / rejected pairs.
    let data = data::train_data(cfg, &checkpoint.args, &run, &ctx.base_dir)?;

    // Loss: DPO against the frozen reference.
    let mut dpo = DpoLoss::new(
        loss::dpo(&dpo_keys.loss),
        DpoReference::Frozen(Box::new(reference)),
    );
    dpo.activation_checkpointing = crate::setup::run::checkpointing(cfg);

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
            "Full DPO of {} ({} parameters) against {}; beta {}; {} pairs; seed {seed}; metrics in {}",
            cfg.checkpointer.checkpoint_dir.display(),
            session.trainer.model.args.num_params(),
            ref_cfg.checkpoint_dir.display(),
            dpo.settings.beta,
            data.dataset.len(),
            session.log_dir,
        )
    });

    session.fit(&data, &mut dpo, cfg.push_to_hub.as_ref())?;
    Ok(())
}
