//! A reward for completions of a target length, the usual companion of a correctness reward
//! that would otherwise let completions grow to `max_generated_tokens`.

use super::{Completion, Result, RewardError, RewardFunction, Scores};

pub const LENGTH: &str = "tune.rewards.length";

/// `max(0, 1 - |n - target| / target)` for a completion of `n` generated tokens: 1 at the
/// target, falling linearly to 0 at no tokens and at twice the target, 0 beyond. The length is
/// counted in tokens (not characters) so that it means the same whatever the completion's
/// language, and so that `target` compares directly with `max_generated_tokens`. No successes.
#[derive(Debug, Clone)]
pub struct LengthTarget {
    target: usize,
}

impl LengthTarget {
    /// `target` must be at least 1 token.
    pub fn new(target: usize) -> Result<Self> {
        if target == 0 {
            return Err(RewardError::Settings {
                reward: LENGTH.into(),
                message: "`target` is 0 tokens; give the completion length to reward (at least 1)"
                    .into(),
            });
        }
        Ok(Self { target })
    }

    pub fn reward(&self, tokens: usize) -> f64 {
        let t = self.target as f64;
        (1.0 - (tokens as f64 - t).abs() / t).max(0.0)
    }
}

impl RewardFunction for LengthTarget {
    fn name(&self) -> &str {
        "length"
    }

    fn score(&mut self, batch: &[Completion<'_>]) -> Result<Scores> {
        Ok(Scores {
            rewards: batch
                .iter()
                .map(|c| Some(self.reward(c.completion_tokens)))
                .collect(),
            successes: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reward_peaks_at_the_target_and_falls_linearly_to_zero_at_twice_it() {
        let r = LengthTarget::new(10).expect("target");
        assert_eq!(r.reward(10), 1.0);
        assert_eq!(r.reward(5), 0.5);
        assert_eq!(r.reward(15), 0.5);
        assert_eq!(r.reward(0), 0.0);
        assert_eq!(r.reward(20), 0.0);
        assert_eq!(r.reward(500), 0.0);
    }

    #[test]
    fn a_zero_target_is_refused() {
        assert!(matches!(
            LengthTarget::new(0),
            Err(RewardError::Settings { .. })
        ));
    }
}
