//! What the PPO recipe builds from its config besides the policy: the rollout and loss
//! settings, the value model's trainer and where its checkpoints go.

use std::path::PathBuf;

use burn::tensor::backend::AutodiffBackend;

use super::{SetupError, optim};
use crate::config::schema::{PpoKeys, TrainConfig};
use crate::distributed::World;
use crate::generation::{GroupSampling, SamplingParams};
use crate::models::CausalLm;
use crate::tokenizer::Tokenizer;
use crate::training::checkpointing::Resume;
use crate::training::metrics::MetricLoggers;
use crate::training::optimizer::Optimizer;
use crate::training::parallel::Parallelism;
use crate::training::ppo::PpoSettings;
use crate::training::ppo_maths::TrajectorySettings;
use crate::training::save_hook::TrainState;
use crate::training::trainer::Trainer;

/// The steps of the run: `num_steps` samples in batches of `batch_size` (torchtune's
/// `num_steps // batch_size`; validation refuses fewer samples than one batch).
pub fn total_steps(cfg: &TrainConfig, keys: &PpoKeys) -> usize {
    (keys.num_steps / cfg.batch_size.max(1)).max(1)
}

/// The tokens that end a response: `stop_token_ids` when set (only those, as torchtune's
/// recipe takes them), else the tokenizer's stop tokens. torchtune warns when the
/// end-of-sequence token is not among them; so does tune.
pub fn stop_ids(keys: &PpoKeys, tokenizer: &Tokenizer) -> Vec<u32> {
    match &keys.stop_token_ids {
        Some(ids) => {
            if let Some(eos) = tokenizer.stop_ids().first()
                && !ids.contains(eos)
            {
                crate::say_warn!(
                    "stop_token_ids {ids:?} leave out the tokenizer's end-of-sequence token {eos}: a response that ends with it runs on to max_generated_tokens (as in torchtune)"
                );
            }
            ids.clone()
        }
        None => tokenizer.stop_ids().to_vec(),
    }
}

/// The rollout, trajectory and loss settings.
pub fn settings(cfg: &TrainConfig, keys: &PpoKeys, tokenizer: &Tokenizer) -> PpoSettings {
    PpoSettings {
        forward_batch_size: keys.forward_batch_size,
        ppo_epochs: keys.ppo_epochs,
        ppo_batch_size: keys.ppo_batch_size,
        gradient_accumulation_steps: cfg.gradient_accumulation_steps,
        total_steps: total_steps(cfg, keys),
        sampling: GroupSampling {
            max_new_tokens: keys.rollout.max_generated_tokens,
            sampling: SamplingParams {
                temperature: keys.rollout.temperature,
                top_k: keys.rollout.sampling.top_k,
                top_p: keys.rollout.sampling.top_p,
            },
            stop_ids: stop_ids(keys, tokenizer),
        },
        trajectory: TrajectorySettings {
            pad_id: tokenizer.pad_id().unwrap_or(0),
            max_generated_tokens: keys.rollout.max_generated_tokens,
            min_response_length: keys.min_response_length,
            penalise_no_eos: keys.penalise_no_eos,
            reward_penalty: keys.reward_penalty as f32,
            kl_coeff: keys.kl_coeff as f32,
            gamma: keys.gamma,
            lmbda: keys.lmbda,
            whiten_rewards: keys.whiten_rewards,
        },
        loss: super::loss::ppo(&keys.loss),
        activation_checkpointing: super::run::checkpointing(cfg),
    }
}

/// Where the value model's checkpoints go: `value_checkpointer.output_dir`, else
/// `<output_dir>/value`.
pub fn value_checkpoint_dir(cfg: &TrainConfig, keys: &PpoKeys) -> PathBuf {
    keys.value_checkpointer
        .output_dir
        .clone()
        .unwrap_or_else(|| cfg.output_dir.join("value"))
}

/// The value model's trainer core: the policy's settings and a second optimizer of the same
/// kind, logging nothing of its own (the policy's step logs both models' metrics); resumed,
/// its optimizer and position are the checkpoint's.
pub fn value_trainer<B: AutodiffBackend>(
    cfg: &TrainConfig,
    seed: u64,
    model: CausalLm<B>,
    world: World,
    resume: Option<Resume>,
) -> Trainer<B> {
    let mut optimizer = Optimizer::new(optim::optimizer(&cfg.optimizer));
    let mut state = TrainState::default();
    if let Some(r) = resume {
        optimizer.load_state_dict(r.optimizer_step, r.optimizer_state, &model.device());
        state = r.state;
    }
    // PPO runs on one device: the value model's optimizer is whole, beside the policy's.
    let settings = optim::optimizer(&cfg.optimizer);
    let (model, parallel) = Parallelism::new(model, world, None, false, &settings);
    Trainer::new(
        super::run::trainer_settings(cfg, seed, false),
        model,
        optimizer,
        state,
        MetricLoggers { sinks: Vec::new() },
        parallel,
    )
}

/// The value model a resumed run continues: its checkpoint of the same name as the policy's
/// the run resumes from (`None` for a fresh run).
pub fn value_resume(
    value_dir: &std::path::Path,
    run: &super::run::RunStart,
) -> Result<Option<Resume>, crate::training::TrainError> {
    let Some(policy) = &run.resume else {
        return Ok(None);
    };
    let name = policy
        .dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    crate::training::checkpointing::resume_companion(value_dir, &name, &run.fingerprint).map(Some)
}

/// Both checkpoint directories must differ: each holds `epoch_N` checkpoints of its own model.
pub fn check_dirs(cfg: &TrainConfig, keys: &PpoKeys) -> Result<(), SetupError> {
    let value = value_checkpoint_dir(cfg, keys);
    let policy = cfg.checkpoint_dir();
    let same = match (std::fs::canonicalize(&value), std::fs::canonicalize(policy)) {
        (Ok(a), Ok(b)) => a == b,
        _ => value == policy,
    };
    if same {
        return Err(SetupError::SameCheckpointDir {
            dir: value,
            first: cfg.checkpoint_dir_key(),
            second: "value_checkpointer.output_dir",
        });
    }
    Ok(())
}

/// The value model's checkpoints: at each of the run's saves, the value trainer's model and
/// optimizer into the value checkpoint directory, under the policy checkpoint's name (both
/// `epoch_N/` or `step_N/`), each a Hugging Face `*ForSequenceClassification` directory.
pub struct ValueCheckpoints<B: AutodiffBackend> {
    pub value: std::rc::Rc<std::cell::RefCell<Option<Trainer<B>>>>,
    pub saver: crate::training::checkpointing::RunCheckpointer,
}

impl<B: AutodiffBackend> crate::training::save_hook::SaveHook<B> for ValueCheckpoints<B> {
    fn save(
        &mut self,
        kind: crate::training::save_hook::SaveKind,
        _policy: &mut CausalLm<B>,
        _policy_optimizer: &crate::training::save_hook::OptimizerSnapshot,
        state: &TrainState,
    ) -> Result<(), crate::training::TrainError> {
        let mut slot = self.value.borrow_mut();
        let Some(trainer) = slot.as_mut() else {
            // A step that failed took the value trainer with it; the run is ending.
            return Err(crate::training::TrainError::Rollout(Box::new(
                crate::training::error::RolloutError::Invariant(
                    "the value model was lost in a failed step; it is not saved",
                ),
            )));
        };
        let optimizer = trainer.optimizer_snapshot()?;
        self.saver.save(kind, &mut trainer.model, &optimizer, state)
    }
}

impl<B: AutodiffBackend> super::session::Companion<B> for ValueCheckpoints<B> {
    fn hook(&mut self) -> &mut dyn crate::training::save_hook::SaveHook<B> {
        self
    }

    fn finish(&mut self) -> Result<(), crate::training::TrainError> {
        self.saver.finish()
    }
}
