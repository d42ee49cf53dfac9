//! Full GRPO (torchtune's dev recipe `grpo_full_finetune_distributed.py`, here on one device
//! too): every weight of the policy trains on rewards of its own sampled completions, with a KL
//! penalty against a frozen reference model loaded from `ref_checkpointer`. Each checkpoint is a
//! complete Hugging Face model directory.

use burn::tensor::backend::AutodiffBackend;

use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::Checker;
use crate::config::schema::{GrpoKeys, TrainConfig, grpo_train_rules};
use crate::models::{BaseWeights, Trainable};
use crate::setup::{grpo, model, session};
use crate::training::checkpointing::SaveContent;
use crate::training::grpo::{GrpoReference, GrpoSteps};

use super::RunContext;
use crate::config::recipes::{DataKind, Layout, OwnKeysSpec, RecipeSpec, Trains, read_checked};
use crate::distributed::WorkerError;
use crate::setup::run::RunStart;
use crate::setup::trainer::Plan;

pub static RECIPE: RecipeSpec = RecipeSpec {
    name: "grpo_full_finetune",
    // torchtune's GRPO recipe is a dev recipe, run as `dev/grpo_full_finetune_distributed`.
    aliases: &[
        "grpo_full_finetune_single_device",
        "dev/grpo_full_finetune_distributed",
    ],
    distributed: Some("grpo_full_finetune_distributed"),
    description: "GRPO: reinforcement learning from rewards on sampled completions, every weight",
    trains: Trains::Full,
    data: DataKind::Prompts,
    layout: Layout::Training,
    own: OwnKeysSpec {
        keys: GrpoKeys::KEYS,
        read: |root, train, cx| read_checked(root, train, cx, rules),
    },
};

/// Full GRPO's KL penalty needs its frozen reference.
fn rules(cfg: &TrainConfig, keys: &GrpoKeys, cx: &mut Checker) {
    grpo_train_rules(cfg, cx);
    if keys.ref_checkpointer.is_none() {
        cx.problem(
            Problem::new(
                ProblemKind::MissingKey,
                "ref_checkpointer",
                "full GRPO needs the frozen reference model of its KL penalty",
            )
            .with_fix("usually the checkpoint being trained: copy the `checkpointer` section (torchtune's configs do)"),
        );
    }
}

pub fn run<B: AutodiffBackend>(
    cfg: &TrainConfig,
    keys: &GrpoKeys,
    ctx: &RunContext<B>,
    run: RunStart,
) -> Result<(), WorkerError> {
    // Policy: from the checkpointer, or from the checkpoint being resumed.
    let checkpoint = model::policy(&cfg.checkpointer, &run)?;
    let loaded = model::load::<B>(&checkpoint, BaseWeights::Float, run.load_rows(), &ctx.device)?;
    let policy = loaded.model.set_trainable(Trainable::All);

    // Reference: frozen, off the autodiff graph; not loaded when the KL term is off.
    let reference = match &keys.ref_checkpointer {
        Some(ref_cfg) if keys.loss.kl_weight() != 0.0 => {
            let key = "ref_checkpointer";
            let frozen =
                model::frozen::<B::InnerBackend>(&model::open(ref_cfg, key)?, &run, &ctx.device)?;
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
        Plan::new(SaveContent::FullModel, loaded.storage_dtype),
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
            keys.rollout.max_generated_tokens,
            steps.describe_rewards(),
            session.log_dir,
        )
    });

    session.run(&mut steps, cfg.push_to_hub.as_ref())?;
    Ok(())
}
