//! LoRA fine-tuning (torchtune's `lora_finetune_single_device.py`, and with several workers
//! `lora_finetune_distributed.py`).
//!
//! The base model stays frozen; low-rank adapters on the chosen projections train. Output:
//! a PEFT adapter (`adapter_model.safetensors` + `adapter_config.json`) per checkpoint, plus
//! the merged model in Hugging Face format unless `save_adapter_weights_only: true`.

use burn::tensor::backend::AutodiffBackend;

use crate::config::schema::{SftKeys, TrainConfig};
use crate::setup::{data, model, run as settings, session};
use crate::training::sft::SftLoss;

use super::RunContext;
use crate::config::recipes::{DataKind, Layout, OwnKeysSpec, RecipeSpec, Trains};
use crate::distributed::WorkerError;
use crate::setup::run::RunStart;
use crate::setup::trainer::Plan;

pub static RECIPE: RecipeSpec = RecipeSpec {
    name: "lora_finetune",
    aliases: &["lora_finetune_single_device"],
    distributed: Some("lora_finetune_distributed"),
    description: "LoRA fine-tuning: frozen base, trainable low-rank adapters (SFT)",
    trains: Trains::Lora,
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
    // Model: the base from the checkpointer, frozen, with LoRA adapters attached (a resumed
    // run's adapter weights restored).
    let checkpoint = model::open(&cfg.checkpointer, "checkpointer")?;
    let loaded =
        model::load_base::<B>(&checkpoint, &cfg.model, run.load_rows(), &ctx.device)?;
    let mut policy = loaded.model;
    let (plan, content) = model::lora(&mut policy, cfg, &run)?;
    let policy = policy.set_trainable(plan.trainable());

    let data = data::train_data(cfg, &checkpoint.args, &run, &ctx.base_dir)?;
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
            "LoRA fine-tuning {} ({}) on {} samples; seed {seed}; metrics in {}",
            cfg.checkpointer.checkpoint_dir.display(),
            plan.describe(),
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
