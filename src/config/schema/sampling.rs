//! The key groups of the recipes that sample tokens: [`Sampling`] (generation, GRPO and PPO)
//! and [`Rollout`] (GRPO's and PPO's completions of their prompts; their stop tokens differ:
//! GRPO's add to the tokenizer's, PPO's replace them, as each reference does). Declared once, read from
//! the top level of each recipe that has them.

use crate::config::keys::{default, group, keys, optional, required};

keys! {
    /// Which tokens sampling draws from.
    pub struct Sampling {
        group: "sampling",
    }
    /// Sample among the k most likely tokens only (null or 0: all, as transformers and TRL
    /// read 0).
    top_k: Option<usize> = optional().fingerprint(),
    /// Nucleus sampling: among the most likely tokens whose probabilities sum to `top_p`
    /// (null: all).
    top_p: Option<f64> = optional()
        .range(|v| v > 0.0 && v <= 1.0, "greater than 0 and at most 1, or null")
        .fingerprint(),
}

keys! {
    /// How a reinforcement-learning recipe samples the completions it trains on.
    pub struct Rollout {
        group: "rollout",
    }
    /// The longest completion, in tokens.
    max_generated_tokens: usize = required().range(|v| v >= 1.0, "at least 1").fingerprint(),
    /// Sampling temperature; the log-probabilities are of the tempered distribution, as
    /// torchtune computes them.
    temperature: f64 = default(|| 1.0)
        .range(
            |v| v.is_finite() && v > 0.0,
            "a positive number: the recipe samples (at 0 every completion of a prompt would be the same, and every advantage 0)",
        )
        .fingerprint(),
    /// Which tokens it samples among.
    #[serde(flatten)]
    sampling: Sampling = group(),
}
