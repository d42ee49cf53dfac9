//! torchtune's rewards for R1-style reasoning on gsm8k: the completion thinks inside
//! `<think>...</think>` and answers inside `<answer>...</answer>`. Each gives the numbers
//! torchtune main gives for the same strings (tests/fixtures/grpo_rewards.json, made by
//! torchtune's own functions).
//!
//! torchtune's gsm8k prompt ends with `Assistant: <think>`, so the completion starts inside the
//! think block: these rewards put `<think>` back in front of it before looking for tags, as
//! torchtune does.

use regex::Regex;

use super::tags::{first_tag, py_strip};
use super::{Completion, Result, RewardError, RewardFunction, Scores, text_column};

pub const SHAPED_CORRECTNESS: &str = "tune.rewards.gsm8k_shaped_correctness";
pub const THINKING_ANSWER_FORMATTING: &str = "tune.rewards.thinking_answer_formatting";
pub const THINK_PRESENCE: &str = "tune.rewards.think_presence";

/// torchtune's `shaped_correctness_reward` (`torchtune/dev/grpo/rewards.py`), which its
/// `batch_shaped_correctness_reward` applies to every completion: the answer is the stripped
/// text of the first `<answer>...</answer>` (after removing gsm8k's `<<`/`>>` calculator
/// brackets). 100 and success 1 when it equals the row's answer; otherwise 10 (torchtune's two
/// format terms, which always count since its tag lists always hold one string) plus 10 when it
/// contains the answer (`$72` for `72`), plus 20 when it equals it (which then is 100 anyway).
pub struct ShapedCorrectness {
    /// The dataset column with the reference answer (gsm8k_dataset's `answer`).
    pub answer_column: String,
}

impl Default for ShapedCorrectness {
    fn default() -> Self {
        Self {
            answer_column: "answer".into(),
        }
    }
}

/// torchtune's `shaped_correctness_reward(answer, completion)`: (reward, success).
pub fn shaped_correctness_reward(answer: &str, completion: &str) -> (f64, f64) {
    let text = format!("<think>{}", completion.replace("<<", "").replace(">>", ""));
    let attempt = first_tag(&text, "answer").map(py_strip).unwrap_or("");
    // torchtune's `len(tags["answer"]) == 1` and `len(tags["think"]) == 1` are always true.
    let mut reward = 5.0 + 5.0;
    if attempt == answer {
        reward += 20.0;
    }
    if attempt.contains(answer) {
        reward += 10.0;
    }
    if attempt == answer {
        return (100.0, 1.0);
    }
    (reward, 0.0)
}

impl RewardFunction for ShapedCorrectness {
    fn name(&self) -> &str {
        "gsm8k_shaped_correctness"
    }

    fn score(&mut self, batch: &[Completion<'_>]) -> Result<Scores> {
        let mut rewards = Vec::with_capacity(batch.len());
        let mut successes = Vec::with_capacity(batch.len());
        for (i, c) in batch.iter().enumerate() {
            let answer = text_column(self.name(), c, &self.answer_column, i)?;
            let (r, s) = shaped_correctness_reward(answer, c.completion);
            rewards.push(Some(r));
            successes.push(s);
        }
        Ok(Scores {
            rewards,
            successes: Some(successes),
        })
    }
}

/// torchtune's `ThinkingAnswerFormattingReward` (`torchtune/dev/rl/rewards.py`, after open-r1):
/// the sum of a soft and a strict format reward, each `positive_reward` or `negative_reward`.
/// Soft: exactly one `<think>...</think>` and one `<answer>...</answer>`, think first. Strict:
/// the completion is `<think>\n...\n</think>\n<answer>\n...\n</answer>\n` followed by nothing or
/// a newline (Python's `re.match` with `MULTILINE`, whose `$` matches before any newline).
/// Success: the sum is at least `positive_reward`. The completion is taken as it is (no
/// `<think>` put in front). Tags are matched literally (torchtune pastes them into its regular
/// expression unescaped; the two agree for tags of letters, digits and `_`).
pub struct ThinkingAnswerFormatting {
    positive_reward: f64,
    negative_reward: f64,
    think: Regex,
    answer: Regex,
    strict: Regex,
}

impl ThinkingAnswerFormatting {
    pub fn new(
        think_tag: &str,
        answer_tag: &str,
        positive_reward: f64,
        negative_reward: f64,
    ) -> Result<Self> {
        let (t, a) = (regex::escape(think_tag), regex::escape(answer_tag));
        let build = |pattern: String| {
            Regex::new(&pattern).map_err(|e| RewardError::Settings {
                reward: THINKING_ANSWER_FORMATTING.into(),
                message: format!("the tags do not make a regular expression: {e}"),
            })
        };
        Ok(Self {
            positive_reward,
            negative_reward,
            think: build(format!("(?s)<{t}>.*?</{t}>"))?,
            answer: build(format!("(?s)<{a}>.*?</{a}>"))?,
            strict: build(format!(r"(?ms)\A<{t}>\n.*?\n</{t}>\n<{a}>\n.*?\n</{a}>\n$"))?,
        })
    }

    /// (soft, strict) for one completion.
    pub fn parts(&self, completion: &str) -> (f64, f64) {
        let pick = |ok: bool| {
            if ok {
                self.positive_reward
            } else {
                self.negative_reward
            }
        };
        let strict = pick(self.strict.is_match(completion));
        let thinks: Vec<_> = self.think.find_iter(completion).collect();
        let answers: Vec<_> = self.answer.find_iter(completion).collect();
        // torchtune compares `completion.find(match)` of the two: for a pattern's only match,
        // the first occurrence of its text is where it matched.
        let soft = pick(match (thinks.as_slice(), answers.as_slice()) {
            ([t], [a]) => t.start() < a.start(),
            _ => false,
        });
        (soft, strict)
    }
}

impl RewardFunction for ThinkingAnswerFormatting {
    fn name(&self) -> &str {
        "formatting"
    }

    fn score(&mut self, batch: &[Completion<'_>]) -> Result<Scores> {
        let (rewards, successes) = batch
            .iter()
            .map(|c| {
                let (soft, strict) = self.parts(c.completion);
                let total = soft + strict;
                let success = if total >= self.positive_reward {
                    1.0
                } else {
                    0.0
                };
                (Some(total), success)
            })
            .unzip();
        Ok(Scores {
            rewards,
            successes: Some(successes),
        })
    }
}

/// torchtune's `at_least_one_space_between_think_tags` (`torchtune/dev/rl/rewards.py`, the first
/// of its `batched_rewards`): 1 (and success 1) when the stripped text of the first
/// `<think>...</think>` of `"<think>" + completion` is not empty, else 0.
#[derive(Debug, Default)]
pub struct ThinkPresence;

/// torchtune's `at_least_one_space_between_think_tags` on `extract_tags("<think>" + completion)`.
pub fn think_presence_reward(completion: &str) -> f64 {
    let text = format!("<think>{completion}");
    let cot = first_tag(&text, "think").map(py_strip).unwrap_or("");
    if cot.is_empty() { 0.0 } else { 1.0 }
}

impl RewardFunction for ThinkPresence {
    fn name(&self) -> &str {
        "think_presence"
    }

    fn score(&mut self, batch: &[Completion<'_>]) -> Result<Scores> {
        let rewards: Vec<f64> = batch
            .iter()
            .map(|c| think_presence_reward(c.completion))
            .collect();
        Ok(Scores {
            rewards: rewards.iter().map(|&r| Some(r)).collect(),
            successes: Some(rewards),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Map, Value, json};

    fn fixture() -> Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/grpo_rewards.json"
        );
        let text = std::fs::read_to_string(path).expect("fixture");
        serde_json::from_str(&text).expect("fixture json")
    }

    fn s(v: &Value) -> &str {
        v.as_str().expect("string")
    }

    fn f(v: &Value) -> f64 {
        v.as_f64().expect("number")
    }

    #[test]
    fn shaped_correctness_gives_torchtunes_rewards_and_successes() {
        let fx = fixture();
        let cases = fx["shaped_correctness"].as_array().expect("cases");
        assert!(cases.len() >= 20);
        for case in cases {
            let (answer, completion) = (s(&case["answer"]), s(&case["completion"]));
            assert_eq!(
                shaped_correctness_reward(answer, completion),
                (f(&case["reward"]), f(&case["success"])),
                "{completion:?} (answer {answer:?})"
            );
        }
    }

    #[test]
    fn think_presence_gives_torchtunes_rewards() {
        let fx = fixture();
        for case in fx["shaped_correctness"].as_array().expect("cases") {
            let completion = s(&case["completion"]);
            assert_eq!(
                think_presence_reward(completion),
                f(&case["think_reward"]),
                "{completion:?}"
            );
        }
    }

    #[test]
    fn formatting_gives_torchtunes_soft_strict_totals_and_successes() {
        let fx = fixture();
        for case in fx["thinking_answer_formatting"].as_array().expect("cases") {
            let set = &case["settings"];
            let mut reward = ThinkingAnswerFormatting::new(
                s(&set["think_tag"]),
                s(&set["answer_tag"]),
                f(&set["positive_reward"]),
                f(&set["negative_reward"]),
            )
            .expect("reward");
            let completions: Vec<&str> = case["completions"]
                .as_array()
                .expect("completions")
                .iter()
                .map(s)
                .collect();
            let cols = Map::new();
            let batch: Vec<Completion<'_>> = completions
                .iter()
                .map(|c| Completion {
                    prompt: "",
                    completion: c,
                    completion_tokens: 0,
                    columns: &cols,
                })
                .collect();
            let out = reward.score(&batch).expect("scores");
            let col =
                |k: &str| -> Vec<f64> { case[k].as_array().expect("list").iter().map(f).collect() };
            let (soft, strict): (Vec<f64>, Vec<f64>) =
                completions.iter().map(|c| reward.parts(c)).unzip();
            assert_eq!(soft, col("soft"), "{set}");
            assert_eq!(strict, col("strict"), "{set}");
            let total: Vec<f64> = out.rewards.iter().map(|r| r.expect("reward")).collect();
            assert_eq!(total, col("total"), "{set}");
            assert_eq!(out.successes, Some(col("successes")), "{set}");
        }
    }

    #[test]
    fn shaped_correctness_reads_the_answer_column_and_names_it_when_missing() {
        let with = json!({"answer": "72"});
        let with = with.as_object().expect("object");
        let without = Map::new();
        let c = |columns| Completion {
            prompt: "",
            completion: "x</think> <answer>72</answer>",
            completion_tokens: 0,
            columns,
        };
        let mut r = ShapedCorrectness::default();
        let out = r.score(&[c(with)]).expect("scores");
        assert_eq!(out.rewards, vec![Some(100.0)]);
        assert_eq!(out.successes, Some(vec![1.0]));
        let err = r.score(&[c(with), c(&without)]).expect_err("no answer");
        assert!(
            matches!(&err, RewardError::MissingColumn { column, row: 1, .. } if column == "answer"),
            "{err}"
        );
    }
}
