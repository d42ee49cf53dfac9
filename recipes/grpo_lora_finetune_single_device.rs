//! LoRA GRPO: the base model stays frozen and the adapters train on rewards of the policy's
//! own sampled completions. The KL penalty's reference is the same model with its adapters
//! disabled, so no second copy of the weights is held. Output: a PEFT adapter per checkpoint,
//! plus the merged model in Hugging Face format unless `save_adapter_weights_only: true`.

use burn::tensor::backend::AutodiffBackend;

use tune::config::schema::{GrpoKeys, TrainConfig};
use tune::setup::{grpo, model, session};
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
    // Model: the base from the checkpointer, frozen, with LoRA adapters attached. With the
    // adapters switched off it is also the reference model.
    let loaded =
        model::load_base::<B>(&cfg.model, &cfg.checkpointer, run.load_rows(), &ctx.device)?;
    let mut policy = loaded.model;
    let (plan, content) = model::lora(&mut policy, cfg, &run)?;
    let policy = policy.set_trainable(plan.trainable());

    // Prompts, rewards and the rollout settings.
    let data = grpo::prompt_data(cfg, &ctx.base_dir)?;
    let rewards = grpo::rewards(keys)?;
    let settings = grpo::settings(cfg, keys, &data.tokenizer);

    let seed = run.seed;
    let session = session::session(
        cfg,
        run,
        policy,
        content,
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
        Some(GrpoReference::AdaptersDisabled),
    );
    session.announce(|| {
        format!(
            "LoRA GRPO of {} ({}): {} prompts, {} completions each of up to {} tokens, {}; seed {seed}; metrics in {}",
            cfg.checkpointer.checkpoint_dir.display(),
            plan.describe(),
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
