//! LoRA GRPO: the base model stays frozen and the adapters train on rewards of the policy's
//! own sampled completions. The KL penalty's reference is the same model with its adapters
//! disabled, so no second copy of the weights is held. Output: a PEFT adapter per checkpoint,
//! plus the merged model in Hugging Face format unless `save_adapter_weights_only: true`.

use burn::tensor::backend::AutodiffBackend;

use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::Checker;
use crate::config::schema::{GrpoKeys, TrainConfig, grpo_train_rules, refuse_router_training};
use crate::setup::{grpo, model, session};
use crate::training::grpo::{GrpoReference, GrpoSteps};

use super::RunContext;
use crate::config::recipes::{DataKind, Layout, OwnKeysSpec, RecipeSpec, Trains, read_checked};
use crate::distributed::WorkerError;
use crate::setup::run::RunStart;
use crate::setup::trainer::Plan;

pub static RECIPE: RecipeSpec = RecipeSpec {
    name: "grpo_lora_finetune",
    aliases: &["grpo_lora_finetune_single_device"],
    distributed: Some("grpo_lora_finetune_distributed"),
    description: "GRPO with LoRA (reference = adapters disabled)",
    trains: Trains::Lora,
    data: DataKind::Prompts,
    layout: Layout::Training,
    own: OwnKeysSpec {
        keys: GrpoKeys::KEYS,
        read: |root, train, cx| read_checked(root, train, cx, rules),
    },
};

/// LoRA GRPO's reference is its own base: a second model would not be read.
fn rules(cfg: &TrainConfig, keys: &GrpoKeys, cx: &mut Checker) {
    grpo_train_rules(cfg, cx);
    refuse_router_training(cfg, RECIPE.name, cx);
    if keys.ref_checkpointer.is_some() {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "ref_checkpointer",
                "LoRA GRPO's reference is the base model with its adapters disabled; a second model would not be read",
            )
            .with_fix("remove `ref_checkpointer`"),
        );
    }
}

pub fn run<B: AutodiffBackend>(
    cfg: &TrainConfig,
    keys: &GrpoKeys,
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

    // Prompts, rewards and the rollout settings.
    let data = grpo::prompt_data(cfg, &ctx.base_dir)?;
    let rewards = grpo::rewards(keys)?;
    let settings = grpo::settings(cfg, keys, &data.tokenizer);

    let seed = run.seed;
    let session = session::session(
        cfg,
        run,
        policy,
        Plan::new(content, loaded.storage_dtype),
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
            keys.rollout.max_generated_tokens,
            steps.describe_rewards(),
            session.log_dir,
        )
    });

    session.run(&mut steps, cfg.push_to_hub.as_ref())?;
    Ok(())
}
