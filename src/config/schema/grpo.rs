//! The GRPO recipes' own keys: the rollouts (completions per prompt, sampling, lengths), the
//! optimisation passes over them, the reference model and the reward functions. Names and
//! defaults are torchtune's (`dev/grpo_full_finetune_distributed`, its `dev/*grpo*` configs);
//! `top_p`, `scale_rewards` and `mask_truncated_completions` are TRL's `GRPOConfig`'s. Each
//! reward function owns its settings ([`RewardConfig`]).

use serde::Serialize;

use super::{CheckpointerConfig, GrpoLoss, Rollout};
use crate::config::components::RewardKind;
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{Checker, choice, default, group, keys, off, optional, required};
use crate::config::values::choices;
use crate::training::grpo_loss::ScaleRewards;

choices!(ScaleRewards {
    "group" => ScaleRewards::Group,
    "batch" => ScaleRewards::Batch,
    "none" => ScaleRewards::None,
});

impl Serialize for ScaleRewards {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(match self {
            Self::Group => "group",
            Self::Batch => "batch",
            Self::None => "none",
        })
    }
}

keys! {
    /// What every reward function of `reward_functions` has.
    pub struct RewardCommon {
        group: "reward",
    }
    /// Its share of the reward the advantages come from (TRL's `reward_weights`).
    weight: f64 = default(|| 1.0).range(|v| v.is_finite(), "a finite number"),
    /// The name its rewards are logged under (`rewards/<name>`; null: the function's).
    name: Option<String> = optional(),
}

keys! {
    /// `tune.rewards.command`: any program, one JSON line in, one number out per completion.
    pub struct CommandRewardKeys {}
    /// Its weight and name.
    #[serde(flatten)]
    common: RewardCommon = group(),
    /// The program and its arguments, started once per run (e.g. `[python3, reward.py]`).
    command: Vec<String> = required().rule(a_program),
    /// Seconds one batch may take, from its first line written to its last answer read.
    timeout: f64 = default(|| crate::rewards::command::DEFAULT_TIMEOUT.as_secs_f64())
        .range(|v| v > 0.0, "a positive number of seconds"),
}

#[allow(clippy::ptr_arg)]
fn a_program(command: &Vec<String>, path: &str, cx: &mut Checker) {
    if command.is_empty() {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                path,
                "is empty: it needs the program to run",
            )
            .with_fix("e.g. `command: [python3, reward.py]`"),
        );
    }
}

keys! {
    /// `tune.rewards.length`: closeness to a target completion length.
    pub struct LengthRewardKeys {}
    /// Its weight and name.
    #[serde(flatten)]
    common: RewardCommon = group(),
    /// The completion length, in tokens, that earns the full reward (e.g. 64).
    target: usize = required().range(|v| v >= 1.0, "at least 1 token"),
}

keys! {
    /// `tune.rewards.gsm8k_shaped_correctness`: torchtune's gsm8k shaped correctness.
    pub struct Gsm8kRewardKeys {}
    /// Its weight and name.
    #[serde(flatten)]
    common: RewardCommon = group(),
    /// The dataset column with the reference answer (gsm8k_dataset names it `answer`).
    answer_column: String = default(|| "answer".to_string()),
}

keys! {
    /// torchtune's `ThinkingAnswerFormattingReward` (its configs write `think_tag: think`,
    /// `answer_tag: answer`, `positive_reward: 1.0`).
    pub struct FormattingRewardKeys {}
    /// Its weight and name.
    #[serde(flatten)]
    common: RewardCommon = group(),
    /// The reasoning tag.
    think_tag: String = required(),
    /// The answer tag.
    answer_tag: String = required(),
    /// The reward of a well-formatted completion.
    positive_reward: f64 = required(),
    /// The reward otherwise.
    negative_reward: f64 = default(|| 0.0),
}

keys! {
    /// A reward function with no settings of its own.
    pub struct PlainRewardKeys {}
    /// Its weight and name.
    #[serde(flatten)]
    common: RewardCommon = group(),
}

choice! {
    /// One reward function of `reward_functions`: its component and that component's settings.
    pub struct RewardConfig {
        section: "reward_functions",
        component: RewardKind,
        settings: RewardSettings,
    }
    "tune.rewards.command": RewardKind::Command => Command(CommandRewardKeys),
    "tune.rewards.length": RewardKind::Length => Length(LengthRewardKeys),
    "tune.rewards.gsm8k_shaped_correctness":
        RewardKind::Gsm8kShapedCorrectness => Gsm8kShapedCorrectness(Gsm8kRewardKeys),
    "torchtune's ThinkingAnswerFormattingReward":
        RewardKind::ThinkingAnswerFormatting => ThinkingAnswerFormatting(FormattingRewardKeys),
    "torchtune's at_least_one_space_between_think_tags":
        RewardKind::ThinkPresence => ThinkPresence(PlainRewardKeys),
}

impl RewardConfig {
    /// Its weight and name.
    pub fn common(&self) -> &RewardCommon {
        match &self.settings {
            RewardSettings::Command(k) => &k.common,
            RewardSettings::Length(k) => &k.common,
            RewardSettings::Gsm8kShapedCorrectness(k) => &k.common,
            RewardSettings::ThinkingAnswerFormatting(k) => &k.common,
            RewardSettings::ThinkPresence(k) => &k.common,
        }
    }
}

keys! {
    /// The GRPO recipes' own keys.
    pub struct GrpoKeys {}
    /// The policy loss.
    loss: GrpoLoss = required().fingerprint(),
    /// Completions sampled per prompt (the group whose rewards normalise each other).
    grpo_samples: usize = required().range(|v| v >= 1.0, "at least 1").fingerprint(),
    /// Prompts scored by the old and reference policies in one forward pass (null:
    /// `batch_size`); each prompt's completions are sampled together, one group at a time.
    forward_batch_size: Option<usize> = optional().range(|v| v >= 1.0, "at least 1"),
    /// The completions' length, temperature and sampling.
    #[serde(flatten)]
    rollout: Rollout = group(),
    /// Tokens that end a completion besides the tokenizer's end-of-sequence tokens.
    stop_token_ids: Option<Vec<u32>> = optional().fingerprint(),
    /// Optimizer steps on each batch of rollouts (PPO's epochs; TRL's `num_iterations`).
    ppo_epochs: usize = default(|| 1).range(|v| v >= 1.0, "at least 1").fingerprint(),
    /// Stop after this many batches of prompts over all epochs (null: run every epoch).
    num_steps: Option<usize> = optional().range(|v| v >= 1.0, "at least 1, or null"),
    /// Save a checkpoint every this many epochs (and after the last one).
    save_every_n_epochs: usize = default(|| 1).range(|v| v >= 1.0, "at least 1"),
    /// The frozen reference model of the KL penalty (full GRPO; LoRA's reference is the base
    /// with its adapters disabled).
    ref_checkpointer: Option<CheckpointerConfig> = optional(),
    /// The rewards, summed with their weights (null: torchtune's recipe's, gsm8k's shaped
    /// correctness).
    reward_functions: Option<Vec<RewardConfig>> = optional().fingerprint(),
    /// What centred rewards are divided by: each group's standard deviation (torchtune's),
    /// the batch's, or nothing (TRL's `scale_rewards`).
    scale_rewards: ScaleRewards = default(|| ScaleRewards::Group).fingerprint(),
    /// Completions cut off by `max_generated_tokens` add nothing to the loss (TRL's).
    mask_truncated_completions: bool = off().fingerprint(),
}
