//! LoRA DPO (torchtune's `lora_dpo_single_device.py`, and with several workers
//! `lora_dpo_distributed.py`).
//!
//! Direct Preference Optimization with LoRA: the base model stays frozen and the adapters
//! train so that the policy prefers each pair's chosen response over its rejected one, relative
//! to the reference. The reference is the same model with its adapters disabled, so no second
//! copy of the weights is held. Output: a PEFT adapter per checkpoint, plus the merged model
//! in Hugging Face format unless `save_adapter_weights_only: true`.

use burn::tensor::backend::AutodiffBackend;

use crate::config::keys::{Checker, keys, required};
use crate::config::recipes::read_checked;
use crate::config::schema::{DpoLoss as DpoLossConfig, TrainConfig, refuse_router_training};
use crate::setup::{data, loss, model, session};
use crate::training::dpo::{DpoLoss, DpoReference};

use super::RunContext;
use crate::config::recipes::{DataKind, Layout, OwnKeysSpec, RecipeSpec, Trains};
use crate::distributed::WorkerError;
use crate::setup::run::RunStart;
use crate::setup::trainer::Plan;

pub static RECIPE: RecipeSpec = RecipeSpec {
    name: "lora_dpo",
    aliases: &["lora_dpo_single_device"],
    distributed: Some("lora_dpo_distributed"),
    description: "DPO preference alignment with LoRA (reference = adapters disabled)",
    trains: Trains::Lora,
    data: DataKind::Pairs,
    layout: Layout::Training,
    own: OwnKeysSpec {
        keys: LoraDpoKeys::KEYS,
        read: |root, train, cx| read_checked(root, train, cx, rules),
    },
};

keys! {
    /// LoRA DPO's own key: its loss.
    pub struct LoraDpoKeys {}
    /// DPO's loss.
    loss: DpoLossConfig = required().fingerprint(),
}

fn rules(cfg: &TrainConfig, _: &LoraDpoKeys, cx: &mut Checker) {
    refuse_router_training(cfg, RECIPE.name, cx);
}

pub fn run<B: AutodiffBackend>(
    cfg: &TrainConfig,
    keys: &LoraDpoKeys,
    ctx: &RunContext<B>,
    run: RunStart,
) -> Result<(), WorkerError> {
    // Model: the base from the checkpointer, frozen, with LoRA adapters attached. With the
    // adapters switched off it is also the reference model.
    let checkpoint = model::open(&cfg.checkpointer, "checkpointer")?;
    let loaded =
        model::load_base::<B>(&checkpoint, &cfg.model, run.load_rows(), &ctx.device)?;
    let mut policy = loaded.model;
    let (plan, content) = model::lora(&mut policy, cfg, &run)?;
    let policy = policy.set_trainable(plan.trainable());

    // Data: chosen / rejected pairs.
    let data = data::train_data(cfg, &checkpoint.args, &run, &ctx.base_dir)?;

    // Loss: DPO against the adapter-free model.
    let mut dpo = DpoLoss::new(loss::dpo(&keys.loss), DpoReference::AdaptersDisabled);
    dpo.activation_checkpointing = crate::setup::run::checkpointing(cfg);

    let seed = run.seed;
    let session = session::session(
        cfg,
        run,
        policy,
        Plan::new(content, loaded.storage_dtype),
        ctx.recipe_name,
        &ctx.device,
    )?;
    session.announce(|| {
        format!(
            "LoRA DPO of {} ({}; beta {}) on {} pairs; seed {seed}; metrics in {}",
            cfg.checkpointer.checkpoint_dir.display(),
            plan.describe(),
            dpo.settings.beta,
            data.dataset.len(),
            session.log_dir,
        )
    });

    session.fit(&data, &mut dpo, cfg.push_to_hub.as_ref())?;
    Ok(())
}
