//! Full GRPO (torchtune's dev recipe `grpo_full_finetune_distributed.py`, here on one device
//! too): every weight of the policy trains on rewards of its own sampled completions, with a KL
//! penalty against a frozen reference model loaded from `ref_checkpointer`. Each checkpoint is a
//! complete Hugging Face model directory.

use burn::tensor::backend::AutodiffBackend;

use tune::config::schema::{GrpoKeys, TrainConfig};
use tune::models::Trainable;
use tune::setup::{grpo, model, session};
use tune::training::checkpointing::SaveContent;
use tune::training::grpo::{GrpoReference, GrpoSteps};

use super::RunContext;
use tune::distributed::WorkerError;
use tune::setup::run::RunStart;

pub fn run<B: AutodiffBackend>(
    cfg: &TrainConfig,
    keys: &GrpoKeys,
    ctx: &RunContext<B>,
    run: RunStart,
) -> Result<(), WorkerError> {
    // Policy: from the checkpointer, or from the checkpoint being resumed.
    let loaded = model::load_or_resume::<B>(&cfg.checkpointer, &run, &ctx.device)?;
    let policy = loaded.model.set_trainable(Trainable::All);

    // Reference: frozen, off the autodiff graph; not loaded when the KL term is off.
    let reference = match &keys.ref_checkpointer {
        Some(ref_cfg) if cfg.loss.grpo_kl_weight() != 0.0 => {
            let key = "ref_checkpointer";
            let frozen =
                model::frozen_reference::<B::InnerBackend>(ref_cfg, key, &run, &ctx.device)?;
            Some(GrpoReference::Frozen(Box::new(frozen)))
        }
        _ => None,
    };

    // Prompts, rewards and the rollout settings.
    let data = grpo::prompt_data(cfg, &ctx.base_dir)?;
    let rewards = grpo::rewards(keys)?;
    let settings = grpo::settings(cfg, keys, &data.tokenizer);

    let seed = run.seed;
    let session = session::session(
        cfg,
        run,
        policy,
        SaveContent::FullModel,
        loaded.storage_dtype,
        ctx.recipe_name,
        &ctx.device,
    )?;
    let mut steps = GrpoSteps::new(
        settings,
        &data.prompts,
        &data.loader,
        &data.tokenizer,
        rewards,
        reference,
    );
    session.announce(|| {
        format!(
            "Full GRPO of {} ({} parameters): {} prompts, {} completions each of up to {} tokens, {}; seed {seed}; metrics in {}",
            cfg.checkpointer.checkpoint_dir.display(),
            session.trainer.model.args.num_params(),
            data.prompts.len(),
            keys.grpo_samples,
            keys.max_generated_tokens,
            steps.describe_rewards(),
            session.log_dir,
        )
    });

    session.run(&mut steps, cfg.push_to_hub.as_ref())?;
    Ok(())
}
