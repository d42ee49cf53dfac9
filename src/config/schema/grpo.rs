//! The GRPO recipes' own keys: the rollouts (completions per prompt, sampling, lengths), the
//! optimisation passes over them, the reference model and the reward functions. Names and
//! defaults are torchtune's (`dev/grpo_full_finetune_distributed`, its `dev/*grpo*` configs);
//! `top_p`, `scale_rewards` and `mask_truncated_completions` are TRL's `GRPOConfig`'s.

use serde::Serialize;

use super::CheckpointerConfig;
use crate::config::components::RewardKind;
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{
    Checker, default, join, keys, off, optional, refuse_unread_settings, required,
};
use crate::config::recipes::Recipe;
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
    /// One reward function of `reward_functions`: its component and that component's
    /// settings. A setting another component reads is refused by name.
    pub struct RewardConfig {
        section: "reward_functions",
        component: RewardKind,
        rule: reward_rules,
    }
    /// Its share of the reward the advantages come from (TRL's `reward_weights`).
    weight: f64 = default(|| 1.0).range(|v| v.is_finite(), "a finite number"),
    /// The name its rewards are logged under (`rewards/<name>`; default: the function's).
    name: Option<String> = optional(),
    /// `tune.rewards.command`: the program and its arguments, started once per run.
    command: Option<Vec<String>> = optional(),
    /// `tune.rewards.command`: seconds one batch may take, from its first line written to its
    /// last answer read (default 60).
    timeout: Option<f64> = optional().range(|v| v > 0.0, "a positive number of seconds"),
    /// `tune.rewards.length`: the completion length, in tokens, that earns the full reward.
    target: Option<usize> = optional().range(|v| v >= 1.0, "at least 1 token"),
    /// `tune.rewards.gsm8k_shaped_correctness`: the dataset column with the reference answer
    /// (default `answer`, as gsm8k_dataset names it).
    answer_column: Option<String> = optional(),
    /// `ThinkingAnswerFormattingReward`: the reasoning tag (`think`).
    think_tag: Option<String> = optional(),
    /// `ThinkingAnswerFormattingReward`: the answer tag (`answer`).
    answer_tag: Option<String> = optional(),
    /// `ThinkingAnswerFormattingReward`: the reward of a well-formatted completion.
    positive_reward: Option<f64> = optional(),
    /// `ThinkingAnswerFormattingReward`: the reward otherwise (default 0).
    negative_reward: Option<f64> = optional(),
}

impl RewardConfig {
    /// The settings each component reads (besides `weight` and `name`), and which it needs.
    fn settings(kind: RewardKind) -> (&'static [&'static str], &'static [&'static str]) {
        match kind {
            RewardKind::Command => (&["command", "timeout"], &["command"]),
            RewardKind::Length => (&["target"], &["target"]),
            RewardKind::Gsm8kShapedCorrectness => (&["answer_column"], &[]),
            RewardKind::ThinkingAnswerFormatting => (
                &[
                    "think_tag",
                    "answer_tag",
                    "positive_reward",
                    "negative_reward",
                ],
                &["think_tag", "answer_tag", "positive_reward"],
            ),
            RewardKind::ThinkPresence => (&[], &[]),
        }
    }

    /// The settings this entry sets (weight and name aside).
    fn set(&self) -> Vec<&'static str> {
        let set = [
            ("command", self.command.is_some()),
            ("timeout", self.timeout.is_some()),
            ("target", self.target.is_some()),
            ("answer_column", self.answer_column.is_some()),
            ("think_tag", self.think_tag.is_some()),
            ("answer_tag", self.answer_tag.is_some()),
            ("positive_reward", self.positive_reward.is_some()),
            ("negative_reward", self.negative_reward.is_some()),
        ];
        set.into_iter()
            .filter_map(|(k, on)| on.then_some(k))
            .collect()
    }
}

/// Each component's settings: the ones it needs are required, the ones it does not read are
/// refused (a `target` on a command reward would otherwise be silently ignored).
fn reward_rules(r: &RewardConfig, path: &str, cx: &mut Checker) {
    let (reads, needs) = RewardConfig::settings(r.component);
    let name = crate::config::components::Component::Reward(r.component).canonical_name();
    refuse_unread_settings(cx, path, &name, (&r.set(), reads), |_| None);
    for key in needs.iter().filter(|k| !r.set().contains(k)) {
        let example = match *key {
            "command" => "e.g. `command: [python3, reward.py]`",
            "target" => "e.g. `target: 64` (tokens)",
            "think_tag" => "torchtune's configs write `think_tag: think`",
            "answer_tag" => "torchtune's configs write `answer_tag: answer`",
            _ => "torchtune's configs write `positive_reward: 1.0`",
        };
        cx.problem(
            Problem::new(
                ProblemKind::MissingKey,
                join(path, key),
                format!("`{name}` needs `{key}`"),
            )
            .with_fix(example),
        );
    }
    if r.command.as_ref().is_some_and(Vec::is_empty) {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                join(path, "command"),
                "is empty: it needs the program to run",
            )
            .with_fix("e.g. `command: [python3, reward.py]`"),
        );
    }
}

keys! {
    /// The GRPO recipes' own keys.
    pub struct GrpoKeys {
        rule: grpo_rules,
    }
    /// Completions sampled per prompt (the group whose rewards normalise each other).
    grpo_samples: usize = required().range(|v| v >= 1.0, "at least 1").fingerprint(),
    /// Prompts scored by the old and reference policies in one forward pass (default
    /// `batch_size`); each prompt's completions are sampled together, one group at a time.
    forward_batch_size: Option<usize> = optional().range(|v| v >= 1.0, "at least 1"),
    /// The longest completion, in tokens.
    max_generated_tokens: usize = required().range(|v| v >= 1.0, "at least 1").fingerprint(),
    /// Sampling temperature; the log-probabilities are of the tempered distribution, as
    /// torchtune computes them.
    temperature: f64 = default(|| 1.0)
        .range(|v| v.is_finite() && v > 0.0, "a positive number: GRPO samples (at 0 every completion of a group would be the same, every advantage 0)")
        .fingerprint(),
    /// Sample among the k most likely tokens only (null: all).
    top_k: Option<usize> = optional().fingerprint(),
    /// Nucleus sampling (TRL's `top_p`; null: all).
    top_p: Option<f64> = optional()
        .range(|v| v > 0.0 && v <= 1.0, "in (0, 1]")
        .fingerprint(),
    /// Optimizer steps on each batch of rollouts (PPO's epochs; TRL's `num_iterations`).
    ppo_epochs: usize = default(|| 1).range(|v| v >= 1.0, "at least 1").fingerprint(),
    /// Stop after this many batches of prompts over all epochs (null: run every epoch).
    num_steps: Option<usize> = optional().range(|v| v >= 1.0, "at least 1, or null"),
    /// Save a checkpoint every this many epochs (and after the last one).
    save_every_n_epochs: usize = default(|| 1).range(|v| v >= 1.0, "at least 1"),
    /// Tokens that end a completion besides the tokenizer's end-of-sequence tokens.
    stop_token_ids: Option<Vec<u32>> = optional().fingerprint(),
    /// The frozen reference model of the KL penalty (full GRPO; LoRA's reference is the base
    /// with its adapters disabled).
    ref_checkpointer: Option<CheckpointerConfig> = optional(),
    /// The rewards, summed with their weights (default: torchtune's recipe's, gsm8k's shaped
    /// correctness).
    reward_functions: Option<Vec<RewardConfig>> = optional().fingerprint(),
    /// What centred rewards are divided by: each group's standard deviation (torchtune's),
    /// the batch's, or nothing (TRL's `scale_rewards`).
    scale_rewards: ScaleRewards = default(|| ScaleRewards::Group).fingerprint(),
    /// Completions cut off by `max_generated_tokens` add nothing to the loss (TRL's).
    mask_truncated_completions: bool = off().fingerprint(),
}

/// Keys whose meaning depends on the recipe.
fn grpo_rules(k: &GrpoKeys, _: &str, cx: &mut Checker) {
    match (cx.recipe, &k.ref_checkpointer) {
        (Some(Recipe::GrpoFull), None) => cx.problem(
            Problem::new(
                ProblemKind::MissingKey,
                "ref_checkpointer",
                "full GRPO needs the frozen reference model of its KL penalty",
            )
            .with_fix("usually the checkpoint being trained: copy the `checkpointer` section (torchtune's configs do)"),
        ),
        (Some(Recipe::GrpoLora), Some(_)) => cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "ref_checkpointer",
                "LoRA GRPO's reference is the base model with its adapters disabled; a second model would not be read",
            )
            .with_fix("remove `ref_checkpointer`"),
        ),
        _ => {}
    }
}
