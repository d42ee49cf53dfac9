//! PPO (torchtune's `ppo_full_finetune_single_device.py`): a policy and a value model train on
//! the scores a frozen reward model gives the policy's own responses, with a per-token KL
//! penalty against a frozen reference. Four checkpoints load: the policy (`checkpointer`), the
//! reference (`ref_policy_checkpointer`), the value model (`value_checkpointer`, usually the
//! reward model) and the reward model (`reward_checkpointer`). Each save writes the policy to
//! the checkpointer's output directory and the value model to `value_checkpointer.output_dir`,
//! both complete Hugging Face directories.

use std::cell::RefCell;
use std::rc::Rc;

use burn::tensor::backend::AutodiffBackend;

use crate::config::keys::Checker;
use crate::config::schema::{PpoKeys, TrainConfig, ppo as ppo_keys};
use crate::model_io::source::ModelSource;
use crate::models::{BaseWeights, Trainable};
use crate::setup::{grpo, model, ppo, session};
use crate::training::checkpointing::SaveContent;
use crate::training::ppo::PpoSteps;
use crate::training::epoch_steps::steps_per_epoch;

use super::RunContext;
use crate::config::recipes::{DataKind, Layout, OwnKeysSpec, RecipeSpec, Trains, read_checked};
use crate::distributed::WorkerError;
use crate::setup::run::RunStart;
use crate::setup::trainer::Plan;

pub static RECIPE: RecipeSpec = RecipeSpec {
    name: "ppo_full_finetune",
    aliases: &["ppo_full_finetune_single_device"],
    // torchtune has PPO on one device only.
    distributed: None,
    description: "PPO (RLHF): the policy trains on a reward model's scores, with a value model and a KL penalty against a frozen reference",
    trains: Trains::Full,
    data: DataKind::PromptsOrText,
    layout: Layout::Policy,
    own: OwnKeysSpec {
        keys: PpoKeys::KEYS,
        read: |root, train, cx| read_checked(root, train, cx, rules),
    },
};

fn rules(cfg: &TrainConfig, keys: &PpoKeys, cx: &mut Checker) {
    ppo_keys::ppo_rules(cfg, keys, cx);
}

pub fn run<B: AutodiffBackend>(
    cfg: &TrainConfig,
    keys: &PpoKeys,
    ctx: &RunContext<B>,
    run: RunStart,
) -> Result<(), WorkerError> {
    // The value model's checkpoints have a directory of their own, claimed as the run's is.
    ppo::check_dirs(cfg, keys)?;
    let value_dir = ppo::value_checkpoint_dir(cfg, keys);
    let _value_lock = crate::setup::run::claim_companion_dir(
        &value_dir,
        "value_checkpointer.output_dir",
        &run,
        cfg.overwrite_output_dir,
    )?;
    // Resumed: both models from their checkpoints of the same step.
    let value_resume = ppo::value_resume(&value_dir, &run)?;

    // The models: policy and value train; reference and reward are frozen, off the graph.
    let checkpoint = model::policy(&cfg.checkpointer, &run)?;
    let loaded = model::load::<B>(&checkpoint, BaseWeights::Float, run.load_rows(), &ctx.device)?;
    model::check_architecture("policy_model", &cfg.model, &loaded.model.args)?;
    let policy = loaded.model.set_trainable(Trainable::All);
    let reference = model::open(&keys.ref_policy_checkpointer, "ref_policy_checkpointer")?;
    let reference =
        model::load::<B::InnerBackend>(&reference, BaseWeights::Float, None, &ctx.device)?.model;
    model::check_architecture("policy_model", &cfg.model, &reference.args)?;
    let value = match &value_resume {
        Some(r) => model::Checkpoint {
            key: "resume_from_checkpoint",
            source: ModelSource::open(&r.dir, None).map_err(|source| {
                crate::setup::SetupError::Model {
                    key: "resume_from_checkpoint",
                    source,
                }
            })?,
        },
        None => model::open(&keys.value_checkpointer, "value_checkpointer")?,
    };
    let value = model::load::<B>(&value, BaseWeights::Float, None, &ctx.device)?;
    let scorer = &keys.reward_and_value_model;
    model::check_architecture("reward_and_value_model", scorer, &value.model.args)?;
    let value_storage = value.storage_dtype;
    let value_model = value.model.set_trainable(Trainable::All);
    let reward = model::open(&keys.reward_checkpointer, "reward_checkpointer")?;
    let reward =
        model::load::<B::InnerBackend>(&reward, BaseWeights::Float, None, &ctx.device)?.model;
    model::check_architecture("reward_and_value_model", scorer, &reward.args)?;

    // Prompts and the rollout, trajectory and loss settings.
    let data = grpo::prompt_data(cfg, &ctx.base_dir)?;
    let settings = ppo::settings(cfg, keys, &data.tokenizer);

    let seed = run.seed;
    let value_saver = crate::setup::trainer::companion_checkpointer(
        cfg,
        &value_dir,
        &keys.value_checkpointer.checkpoint_dir,
        ctx.recipe_name,
        run.fingerprint.clone(),
        value_storage,
    )?;
    let value_trainer = ppo::value_trainer(cfg, seed, value_model, run.world.clone(), value_resume);
    // torchtune's epochs: as many passes over the prompts as `num_steps` needs.
    let loop_settings = crate::setup::run::trainer_settings(cfg, seed, false);
    let steps_per_epoch = steps_per_epoch(&loop_settings, &data.loader, run.world.size)?;
    let epochs = settings.total_steps.div_ceil(steps_per_epoch.max(1));
    let session = session::session(
        cfg,
        run,
        policy,
        Plan {
            epochs: Some(epochs),
            ..Plan::new(SaveContent::FullModel, loaded.storage_dtype)
        },
        ctx.recipe_name,
        &ctx.device,
    )?;
    let value = Rc::new(RefCell::new(Some(value_trainer)));
    let mut value_checkpoints = ppo::ValueCheckpoints {
        value: value.clone(),
        saver: value_saver,
    };
    let mut steps = PpoSteps::new(
        settings,
        cfg.batch_size,
        &data.prompts,
        &data.loader,
        reference,
        reward,
        value,
    );
    session.announce(|| {
        format!(
            "PPO of {} ({} parameters) with value model {} and reward model {}: {} steps of {} prompts, responses of up to {} tokens; seed {seed}; metrics in {}",
            cfg.checkpointer.checkpoint_dir.display(),
            session.trainer.model.args.num_params(),
            keys.value_checkpointer.checkpoint_dir.display(),
            keys.reward_checkpointer.checkpoint_dir.display(),
            steps.settings.total_steps,
            cfg.batch_size,
            keys.rollout.max_generated_tokens,
            session.log_dir,
        )
    });

    // `push_to_hub` uploads the policy's final checkpoint, the model PPO trains for; the value
    // model stays in its own directory.
    session.run_with(
        &mut steps,
        cfg.push_to_hub.as_ref(),
        Some(&mut value_checkpoints),
    )?;
    Ok(())
}
