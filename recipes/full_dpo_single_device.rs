//! Full DPO on one device (torchtune's `full_dpo_single_device.py`): every weight of the
//! policy trains against a frozen reference model loaded from `ref_checkpointer`. Each
//! checkpoint is a complete Hugging Face model directory.

use anyhow::Context;
use burn::tensor::backend::AutodiffBackend;

use tune::checkpoint::hf::load_model;
use tune::config::schema::TrainConfig;
use tune::models::Trainable;
use tune::setup::{data, loss, model, run as settings};
use tune::training::checkpointing::{SaveContent, find_resume};
use tune::training::dpo::{DpoLoss, DpoReference};

use super::RunContext;

pub fn run<B: AutodiffBackend>(cfg: &TrainConfig, ctx: &RunContext<B>) -> anyhow::Result<()> {
    let seed = settings::seed(cfg);
    let output_dir = settings::checkpoint_dir(cfg);
    let fingerprint = settings::fingerprint(cfg, seed);

    // Policy: from the checkpointer, or from the checkpoint being resumed (it holds every weight).
    let resume = if cfg.resume_from_checkpoint {
        find_resume(&output_dir, &fingerprint)?
    } else {
        None
    };
    let loaded = match &resume {
        Some(r) => {
            eprintln!(
                "Resuming from {} at step {}",
                r.dir.display(),
                r.state.global_step
            );
            load_model::<B>(&r.dir, None, &ctx.device)?
        }
        None => model::load::<B>(&cfg.checkpointer, "checkpointer", &ctx.device)?,
    };
    let storage_dtype = loaded.storage_dtype;
    let policy = loaded.model.set_trainable(Trainable::All);

    // Reference: frozen, on the backend without autodiff, so it never joins the graph.
    let ref_cfg = cfg
        .ref_checkpointer
        .as_ref()
        .context("full DPO needs `ref_checkpointer`: the frozen reference model (usually the same checkpoint as `checkpointer`)")?;
    let reference = model::load::<B::InnerBackend>(ref_cfg, "ref_checkpointer", &ctx.device)?.model;

    // Data: chosen / rejected pairs.
    let tokenizer = data::tokenizer(&cfg.tokenizer)?;
    let dataset = data::dataset(
        &cfg.dataset,
        &tokenizer,
        cfg.tokenizer.max_seq_len,
        &ctx.base_dir,
    )?;
    super::require_preference_data(&dataset)?;
    let loader = data::loader(&dataset, cfg.batch_size, cfg.shuffle, seed)?;

    // Loss: DPO against the frozen reference.
    let mut dpo = DpoLoss::new(
        loss::dpo(&cfg.loss)?,
        DpoReference::Frozen(Box::new(reference)),
    );
    dpo.activation_checkpointing = cfg.enable_activation_checkpointing;

    // Optimizer, schedule, metrics, checkpoints.
    let (trainer, log_dir) = settings::trainer(cfg, seed, policy, resume, &ctx.device)?;
    let mut saver = settings::checkpointer(
        cfg,
        ctx.recipe.torchtune_name(),
        SaveContent::FullModel,
        fingerprint,
        storage_dtype,
    )?;
    eprintln!(
        "Full DPO of {} ({} parameters) against {}; beta {}; {} pairs; seed {seed}; metrics in {log_dir}",
        cfg.checkpointer.checkpoint_dir.display(),
        trainer.model.args.num_params(),
        ref_cfg.checkpoint_dir.display(),
        dpo.settings.beta,
        dataset.len(),
    );

    // Train.
    let (summary, _policy) = trainer.fit(&dataset, &loader, &mut dpo, &mut saver)?;
    saver.finish()?;
    super::report(&summary, saver.last_published.as_ref());
    Ok(())
}
