//! What the GRPO recipes build from their config besides the model: the prompts and their
//! loader, the reward functions, and the rollout settings.

use std::path::Path;
use std::time::Duration;

use super::SetupError;
use super::data::{TORCHTUNE_SAMPLER_SEED, sample_loader, spec, tokenizer};
use crate::config::schema::{GrpoKeys, RewardConfig, RewardSettings, TrainConfig};
use crate::data::{DataLoader, PromptDataset};
use crate::generation::{GroupSampling, SamplingParams};
use crate::rewards::{
    CommandReward, LengthTarget, RewardError, RewardFunction, ShapedCorrectness, ThinkPresence,
    ThinkingAnswerFormatting, Weighted,
};
use crate::tokenizer::Tokenizer;
use crate::training::grpo::GrpoSettings;

/// A GRPO run's prompts: the tokenizer, the prompt dataset and this rank's loader.
pub struct PromptData {
    pub tokenizer: Tokenizer,
    pub prompts: PromptDataset,
    pub loader: DataLoader,
}

/// The prompt datasets of `dataset` (a list is concatenated) and their loader, in torchtune's
/// sampler order.
pub fn prompt_data(cfg: &TrainConfig, base_dir: &Path) -> Result<PromptData, SetupError> {
    let tokenizer = tokenizer(&cfg.tokenizer)?;
    let mut parts = Vec::with_capacity(cfg.dataset.len());
    for entry in cfg.dataset.iter() {
        let mut spec = spec(entry);
        super::data::fetch_if_hub(&mut spec)?;
        parts.push(PromptDataset::build(
            &spec,
            &tokenizer,
            cfg.tokenizer.max_seq_len,
            base_dir,
        )?);
    }
    let prompts = PromptDataset::concat(parts);
    let loader = sample_loader(
        prompts.len(),
        cfg.batch_size,
        cfg.shuffle,
        TORCHTUNE_SAMPLER_SEED,
    )?;
    Ok(PromptData {
        tokenizer,
        prompts,
        loader,
    })
}

/// Why a reward function could not be set up: `index` is its place in `reward_functions`.
#[derive(Debug, thiserror::Error)]
#[error("reward_functions.{index}: {source}")]
pub struct RewardSetupError {
    pub index: usize,
    pub source: RewardError,
}

/// The reward functions of `reward_functions` (command rewards start here, so a wrong path
/// fails before the first rollout); without the key, torchtune's recipe's reward: gsm8k's
/// shaped correctness.
pub fn rewards(keys: &GrpoKeys) -> Result<Vec<Weighted>, SetupError> {
    let Some(entries) = &keys.reward_functions else {
        return Ok(vec![Weighted {
            function: Box::new(ShapedCorrectness::default()),
            weight: 1.0,
        }]);
    };
    entries
        .iter()
        .enumerate()
        .map(|(index, entry)| {
            reward(entry)
                .map(|function| Weighted {
                    function,
                    weight: entry.common().weight,
                })
                .map_err(|source| SetupError::Reward(Box::new(RewardSetupError { index, source })))
        })
        .collect()
}

/// One reward function from its entry.
fn reward(entry: &RewardConfig) -> Result<Box<dyn RewardFunction>, RewardError> {
    let function: Box<dyn RewardFunction> = match &entry.settings {
        RewardSettings::Gsm8kShapedCorrectness(k) => Box::new(ShapedCorrectness {
            answer_column: k.answer_column.clone(),
        }),
        RewardSettings::ThinkingAnswerFormatting(k) => Box::new(ThinkingAnswerFormatting::new(
            &k.think_tag,
            &k.answer_tag,
            k.positive_reward,
            k.negative_reward,
        )?),
        RewardSettings::ThinkPresence(_) => Box::new(ThinkPresence),
        RewardSettings::Length(k) => Box::new(LengthTarget::new(k.target)?),
        RewardSettings::Command(k) => {
            let timeout = Duration::from_secs_f64(k.timeout);
            let command = CommandReward::start(k.command.clone(), timeout)
                .map_err(|e| RewardError::Command(Box::new(e)))?;
            Box::new(command)
        }
    };
    Ok(match &entry.common().name {
        Some(name) => Box::new(Renamed {
            name: name.clone(),
            inner: function,
        }),
        None => function,
    })
}

/// A reward function logged under the name the config gave it.
struct Renamed {
    name: String,
    inner: Box<dyn RewardFunction>,
}

impl RewardFunction for Renamed {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(
        &mut self,
        batch: &[crate::rewards::Completion<'_>],
    ) -> crate::rewards::Result<crate::rewards::Scores> {
        self.inner.score(batch)
    }
}

/// The rollout settings: sampling (`temperature`, `top_k`, `top_p`), lengths, stop tokens
/// (the tokenizer's and `stop_token_ids`), passes and the loss.
pub fn settings(cfg: &TrainConfig, keys: &GrpoKeys, tokenizer: &Tokenizer) -> GrpoSettings {
    let mut stop_ids = tokenizer.stop_ids().to_vec();
    for &id in keys.stop_token_ids.iter().flatten() {
        if !stop_ids.contains(&id) {
            stop_ids.push(id);
        }
    }
    GrpoSettings {
        samples: keys.grpo_samples,
        prompts_per_pass: keys.forward_batch_size.unwrap_or(cfg.batch_size),
        sampling: GroupSampling {
            max_new_tokens: keys.rollout.max_generated_tokens,
            sampling: SamplingParams {
                temperature: keys.rollout.temperature,
                top_k: keys.rollout.sampling.top_k,
                top_p: keys.rollout.sampling.top_p,
            },
            stop_ids,
        },
        ppo_epochs: keys.ppo_epochs,
        num_steps: keys.num_steps,
        save_every_n_epochs: keys.save_every_n_epochs,
        loss: super::loss::grpo(&keys.loss, keys.rollout.max_generated_tokens),
        scale_rewards: keys.scale_rewards,
        mask_truncated_completions: keys.mask_truncated_completions,
        activation_checkpointing: super::run::checkpointing(cfg),
        pad_id: tokenizer.pad_id().unwrap_or(0),
    }
}
