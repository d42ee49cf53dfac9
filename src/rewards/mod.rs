//! Reward functions of the GRPO recipes: each scores a batch of completions, and a weighted sum
//! of them (TRL's `reward_weights`) is the reward the advantages are computed from.
//!
//! A function sees, per completion, the prompt text, the completion decoded with special tokens
//! removed, its length in tokens and the dataset row's other columns (a gsm8k row's `answer`),
//! and returns one `Option<f64>` per completion: `None` when it gives no reward for that one (a
//! code-execution reward asked about prose, say). A function may also define `successes`, as
//! torchtune's gsm8k rewards do (1 for a correct, well-formatted answer); they are logged, not
//! trained on.
//!
//! Built in:
//! - [`gsm8k::ShapedCorrectness`]: torchtune's `batch_shaped_correctness_reward` (the reward of its
//!   `dev/grpo_full_finetune_distributed` recipe);
//! - [`gsm8k::ThinkingAnswerFormatting`]: torchtune's `ThinkingAnswerFormattingReward` (R1's
//!   `<think>`/`<answer>` format, soft and strict);
//! - [`gsm8k::ThinkPresence`]: torchtune's `at_least_one_space_between_think_tags`;
//! - [`length::LengthTarget`]: closeness to a target completion length;
//! - [`command::CommandReward`]: any program, one JSON line in and one number out per completion.
//!
//! torchtune's `FormattedMathCorrectnessReward` and `math_response_correct` compare answers with
//! the `math_verify` package (LaTeX parsing and sympy equivalence), which is not reproduced: the
//! component table refuses them by name, pointing at the command reward, which can run
//! `math_verify` itself. Config names resolve in `config::components` (`RewardKind`).

pub mod command;
pub mod gsm8k;
pub mod length;
mod tags;

use serde_json::{Map, Value};

pub use command::{CommandError, CommandReward};
pub use gsm8k::{ShapedCorrectness, ThinkPresence, ThinkingAnswerFormatting};
pub use length::LengthTarget;

/// One completion as a reward function sees it.
#[derive(Debug, Clone, Copy)]
pub struct Completion<'a> {
    /// The prompt as the dataset gives it (before the chat format).
    pub prompt: &'a str,
    /// The generated text, decoded with special tokens removed.
    pub completion: &'a str,
    /// How many tokens were generated (EOS included when it ended the completion).
    pub completion_tokens: usize,
    /// The dataset row's other columns (never `prompt` or `completion`).
    pub columns: &'a Map<String, Value>,
}

/// What one function gives a batch: one reward per completion (`None`: no reward from this
/// function for it) and, for functions that define them, one success per completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Scores {
    pub rewards: Vec<Option<f64>>,
    pub successes: Option<Vec<f64>>,
}

/// Why a batch could not be scored. Every failure stops the run: a reward that silently became
/// 0 would train the policy toward whatever the broken function happened to reward.
#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    #[error(
        "reward `{reward}` needs the dataset column `{column}` (a string), which row {row} of the batch lacks: use a dataset that has it (gsm8k_dataset's `answer`), or map it with the dataset's `column_map`"
    )]
    MissingColumn {
        reward: String,
        column: String,
        row: usize,
    },
    #[error(transparent)]
    Command(#[from] Box<CommandError>),
    #[error("reward `{reward}` returned {got} rewards for {expected} completions")]
    WrongCount {
        reward: String,
        got: usize,
        expected: usize,
    },
    #[error("reward `{reward}`: {message}")]
    Settings { reward: String, message: String },
}

pub type Result<T> = std::result::Result<T, RewardError>;

/// A reward function. `score` takes `&mut self` because a command reward owns its process.
pub trait RewardFunction: Send {
    /// The name its metrics are logged under (`rewards/<name>`).
    fn name(&self) -> &str;

    /// One reward (and success, where defined) per completion of `batch`, in order.
    fn score(&mut self, batch: &[Completion<'_>]) -> Result<Scores>;
}

/// A reward function with its weight in the sum.
pub struct Weighted {
    pub function: Box<dyn RewardFunction>,
    pub weight: f64,
}

/// The rewards of one batch: each function's scores and their weighted sum.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchRewards {
    /// Per completion: the sum over functions of `weight * reward`, skipping the functions that
    /// gave it none; `None` when no function gave it a reward.
    pub total: Vec<Option<f64>>,
    /// Each function's name and scores, in the order the functions were listed.
    pub per_function: Vec<(String, Scores)>,
    /// Per completion, the sum of the successes of the functions that define them (torchtune's
    /// `successes.sum(-1)`); `None` when no function defines them.
    pub successes: Option<Vec<f64>>,
}

impl BatchRewards {
    /// The completions no function rewarded: TRL 1.16 warns about them (printing the row), leaves
    /// them out of their group's mean and standard deviation and gives them advantage 0.
    pub fn unscorable(&self) -> Vec<usize> {
        self.total
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.is_none().then_some(i))
            .collect()
    }
}

/// Scores `batch` with every function and sums the rewards as TRL's `GRPOTrainer` does
/// (`(rewards_per_func * reward_weights).nansum(dim=1)`, `None` standing for its NaN): a function
/// that gives a completion no reward adds nothing to it. A completion that no function rewarded
/// gets `None` rather than nansum's 0, as TRL 1.16 then marks it (`rewards[unscorable_mask] =
/// nan`), so it is neither a spurious 0 in its group's baseline nor trained toward.
pub fn score_batch(functions: &mut [Weighted], batch: &[Completion<'_>]) -> Result<BatchRewards> {
    let n = batch.len();
    let mut total = vec![None; n];
    let mut successes: Option<Vec<f64>> = None;
    let mut per_function = Vec::with_capacity(functions.len());
    for Weighted { function, weight } in functions.iter_mut() {
        let scores = function.score(batch)?;
        let counts = [
            Some(scores.rewards.len()),
            scores.successes.as_ref().map(Vec::len),
        ];
        if let Some(got) = counts.into_iter().flatten().find(|&got| got != n) {
            return Err(RewardError::WrongCount {
                reward: function.name().to_string(),
                got,
                expected: n,
            });
        }
        for (sum, r) in total.iter_mut().zip(&scores.rewards) {
            if let Some(r) = r {
                *sum = Some(sum.unwrap_or(0.0) + *weight * r);
            }
        }
        if let Some(s) = &scores.successes {
            let acc = successes.get_or_insert_with(|| vec![0.0; n]);
            acc.iter_mut().zip(s).for_each(|(a, s)| *a += s);
        }
        per_function.push((function.name().to_string(), scores));
    }
    Ok(BatchRewards {
        total,
        per_function,
        successes,
    })
}

/// The string column `column` of completion `row`, or the error naming what is missing.
pub(crate) fn text_column<'a>(
    reward: &str,
    c: &Completion<'a>,
    column: &str,
    row: usize,
) -> Result<&'a str> {
    c.columns
        .get(column)
        .and_then(Value::as_str)
        .ok_or_else(|| RewardError::MissingColumn {
            reward: reward.to_string(),
            column: column.to_string(),
            row,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gives fixed rewards and successes, whatever the batch.
    struct Fixed {
        rewards: Vec<Option<f64>>,
        successes: Option<Vec<f64>>,
    }

    impl RewardFunction for Fixed {
        fn name(&self) -> &str {
            "fixed"
        }
        fn score(&mut self, _: &[Completion<'_>]) -> Result<Scores> {
            Ok(Scores {
                rewards: self.rewards.clone(),
                successes: self.successes.clone(),
            })
        }
    }

    fn weighted(rewards: Vec<Option<f64>>, successes: Option<Vec<f64>>, weight: f64) -> Weighted {
        Weighted {
            function: Box::new(Fixed { rewards, successes }),
            weight,
        }
    }

    fn batch(columns: &Map<String, Value>, n: usize) -> Vec<Completion<'_>> {
        (0..n)
            .map(|_| Completion {
                prompt: "p",
                completion: "c",
                completion_tokens: 1,
                columns,
            })
            .collect()
    }

    #[test]
    fn the_sum_weights_each_function_and_skips_the_ones_that_give_no_reward() {
        let cols = Map::new();
        let mut fs = vec![
            weighted(vec![Some(1.0), None, Some(2.0), None], None, 0.5),
            weighted(vec![Some(10.0), Some(3.0), None, None], None, 2.0),
        ];
        let out = score_batch(&mut fs, &batch(&cols, 4)).expect("scores");
        assert_eq!(out.total, vec![Some(20.5), Some(6.0), Some(1.0), None]);
        assert_eq!(out.unscorable(), vec![3]);
        assert_eq!(out.per_function.len(), 2);
        assert_eq!(out.successes, None);
    }

    #[test]
    fn successes_add_up_over_the_functions_that_define_them() {
        let cols = Map::new();
        let mut fs = vec![
            weighted(vec![Some(1.0); 2], Some(vec![1.0, 0.0]), 1.0),
            weighted(vec![Some(1.0); 2], None, 1.0),
            weighted(vec![Some(1.0); 2], Some(vec![1.0, 1.0]), 1.0),
        ];
        let out = score_batch(&mut fs, &batch(&cols, 2)).expect("scores");
        assert_eq!(out.successes, Some(vec![2.0, 1.0]));
    }

    #[test]
    fn a_function_returning_the_wrong_number_of_rewards_is_an_error() {
        let cols = Map::new();
        let mut fs = vec![weighted(vec![Some(1.0)], None, 1.0)];
        let err = score_batch(&mut fs, &batch(&cols, 2)).expect_err("count");
        assert!(matches!(
            err,
            RewardError::WrongCount {
                got: 1,
                expected: 2,
                ..
            }
        ));
    }
}
