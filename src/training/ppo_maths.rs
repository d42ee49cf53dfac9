//! PPO's arithmetic on a batch of trajectories, as torchtune 0.6.1's `rlhf` functions and its
//! `ppo_full_finetune_single_device` recipe compute it (`tests/fixtures/ppo.json` holds their
//! values, `tests/fixtures/make_ppo_fixtures.py` made them): where each response ends, the
//! reward model's score and its penalties, the per-token rewards with the KL penalty, and
//! generalised advantage estimation. Every per-token value is `[rows, width]`, row-major,
//! position `c` of a row being its `c`-th response token; all in f32, as torchtune's tensors.
//!
//! The one place tune goes beyond torchtune: `whiten_rewards`. torchtune's recipe reads the key
//! and never uses it; tune does what the key says, as TRL's PPO trainer does before the
//! advantages (`trl/experimental/ppo/ppo_trainer.py` at v1.9.0, lines 782-784):
//! `masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)` then the padding set to 0.
//! TRL's `shift_mean=False` keeps the mean, which is torchtune's `whiten(.., shift_mean=True)`
//! (the two libraries read the flag the opposite ways round).

use crate::training::metrics::MetricName;
/// A grid of per-token values, `[rows, width]` row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Grid<T> {
    pub rows: usize,
    pub width: usize,
    pub values: Vec<T>,
}

impl<T: Copy> Grid<T> {
    pub fn new(rows: usize, width: usize, values: Vec<T>) -> Self {
        assert_eq!(values.len(), rows * width, "a [{rows}, {width}] grid");
        Self {
            rows,
            width,
            values,
        }
    }

    pub fn filled(rows: usize, width: usize, value: T) -> Self {
        Self::new(rows, width, vec![value; rows * width])
    }

    pub fn row(&self, r: usize) -> &[T] {
        &self.values[r * self.width..(r + 1) * self.width]
    }

    pub fn at(&self, r: usize, c: usize) -> T {
        self.values[r * self.width + c]
    }

    pub fn set(&mut self, r: usize, c: usize, value: T) {
        self.values[r * self.width + c] = value;
    }
}

/// `rlhf.truncate_sequence_at_first_stop_token`: every token after a row's first stop token
/// becomes `pad_id`, and the mask is true there (the stop token itself stays).
pub fn truncate_at_first_stop(
    responses: &mut Grid<u32>,
    stop_ids: &[u32],
    pad_id: u32,
) -> Grid<bool> {
    let mut padding = Grid::filled(responses.rows, responses.width, false);
    for r in 0..responses.rows {
        let mut stopped = false;
        for c in 0..responses.width {
            if stopped {
                padding.set(r, c, true);
                responses.set(r, c, pad_id);
            } else if stop_ids.contains(&responses.at(r, c)) {
                stopped = true;
            }
        }
    }
    padding
}

/// `training.get_unmasked_sequence_lengths(padding)`: the index of each row's last token that is
/// not padding (its length minus one; 0 for a row whose first token is its stop token).
pub fn last_token_indices(padding: &Grid<bool>) -> Vec<usize> {
    (0..padding.rows)
        .map(|r| {
            let kept = padding.row(r).iter().filter(|&&p| !p).count();
            kept.saturating_sub(1)
        })
        .collect()
}

/// `rlhf.get_reward_penalty_mask`: rows whose score is replaced by the penalty, those without a
/// stop token (`penalise_no_eos`) and those shorter than `min_response_length` (compared with
/// the last index, as torchtune compares it).
pub fn penalised_rows(
    padding: &Grid<bool>,
    last_indices: &[usize],
    penalise_no_eos: bool,
    min_response_length: Option<usize>,
) -> Vec<bool> {
    (0..padding.rows)
        .map(|r| {
            let no_stop = penalise_no_eos && !padding.row(r).iter().any(|&p| p);
            let short = min_response_length.is_some_and(|min| last_indices[r] < min);
            no_stop || short
        })
        .collect()
}

/// The recipe's `value_seq_idxs`: where each row's score lands and whose value stays, one past
/// its last token (the position after the stop token) unless the row is empty or that would
/// be the last position; and the value padding mask, the response padding with that position
/// opened.
pub fn value_positions(
    padding: &Grid<bool>,
    last_indices: &[usize],
    max_generated_tokens: usize,
) -> (Vec<usize>, Grid<bool>) {
    let positions: Vec<usize> = last_indices
        .iter()
        .map(|&n| {
            if n > 0 && n + 1 < max_generated_tokens {
                n + 1
            } else {
                n
            }
        })
        .collect();
    let mut value_padding = padding.clone();
    for (r, &c) in positions.iter().enumerate() {
        value_padding.set(r, c, false);
    }
    (positions, value_padding)
}

/// The rewards of a batch: `rlhf.get_rewards_ppo`.
#[derive(Debug, Clone, PartialEq)]
pub struct PpoRewards {
    /// The KL penalty per token plus each row's score at its value position.
    pub total: Grid<f32>,
    /// `logprobs - ref_logprobs`.
    pub kl: Grid<f32>,
    /// `-kl_coeff * kl`.
    pub kl_rewards: Grid<f32>,
}

pub fn ppo_rewards(
    scores: &[f32],
    log_probs: &Grid<f32>,
    ref_log_probs: &Grid<f32>,
    kl_coeff: f32,
    score_positions: &[usize],
) -> PpoRewards {
    let kl: Vec<f32> = log_probs
        .values
        .iter()
        .zip(&ref_log_probs.values)
        .map(|(p, q)| p - q)
        .collect();
    let kl_rewards: Vec<f32> = kl.iter().map(|k| -kl_coeff * k).collect();
    let (rows, width) = (log_probs.rows, log_probs.width);
    let mut total = Grid::new(rows, width, kl_rewards.clone());
    for (r, (&score, &c)) in scores.iter().zip(score_positions).enumerate() {
        total.set(r, c, total.at(r, c) + score);
    }
    PpoRewards {
        total,
        kl: Grid::new(rows, width, kl),
        kl_rewards: Grid::new(rows, width, kl_rewards),
    }
}

/// `rlhf.masked_mean` over the whole grid (`mask` true where a value counts; `None`: all).
fn masked_mean(x: &[f32], mask: Option<&[bool]>) -> f32 {
    match mask {
        Some(mask) => {
            let sum: f32 = x
                .iter()
                .zip(mask)
                .map(|(v, &m)| if m { *v } else { 0.0 })
                .sum();
            let count = mask.iter().filter(|&&m| m).count() as f32;
            sum / (count + 1e-8)
        }
        None => x.iter().sum::<f32>() / x.len() as f32,
    }
}

/// `rlhf.whiten`: `(x - mean) / sqrt(var + 1e-8)` over the values `mask` keeps (unbiased
/// variance), the mean added back with `shift_mean`.
pub fn whiten(x: &[f32], mask: Option<&[bool]>, shift_mean: bool) -> Vec<f32> {
    let mean = masked_mean(x, mask);
    let centred: Vec<f32> = x.iter().map(|v| v - mean).collect();
    let var = match mask {
        Some(mask) => {
            let squares: Vec<f32> = centred.iter().map(|c| c * c).collect();
            let var = masked_mean(&squares, Some(mask));
            let count = mask.iter().filter(|&&m| m).count() as f32 + 1e-8;
            var * (count / (count - 1.0))
        }
        // torch's `x.var()`: unbiased.
        None => {
            let n = x.len() as f32;
            centred.iter().map(|c| c * c).sum::<f32>() / (n - 1.0)
        }
    };
    let scale = 1.0 / (var + 1e-8).sqrt();
    centred
        .iter()
        .map(|c| {
            let w = c * scale;
            if shift_mean { w + mean } else { w }
        })
        .collect()
}

/// `rlhf.estimate_advantages`: generalised advantage estimation backwards over each row, the
/// returns (advantages plus values), then the advantages whitened over the tokens `mask` keeps
/// and 0 elsewhere.
pub fn estimate_advantages(
    values: &Grid<f32>,
    rewards: &Grid<f32>,
    gamma: f64,
    lmbda: f64,
    mask: Option<&Grid<bool>>,
) -> (Grid<f32>, Grid<f32>) {
    let (rows, width) = (values.rows, values.width);
    // Python multiplies the two floats in f64 before torch rounds the scalar to f32.
    let (gamma_lmbda, gamma) = ((gamma * lmbda) as f32, gamma as f32);
    let mut advantages = Grid::filled(rows, width, 0.0f32);
    for r in 0..rows {
        let mut last = 0.0f32;
        for t in (0..width).rev() {
            let next = if t + 1 < width {
                values.at(r, t + 1)
            } else {
                0.0
            };
            let delta = rewards.at(r, t) + gamma * next - values.at(r, t);
            last = delta + gamma_lmbda * last;
            advantages.set(r, t, last);
        }
    }
    let returns: Vec<f32> = advantages
        .values
        .iter()
        .zip(&values.values)
        .map(|(a, v)| a + v)
        .collect();
    let keep = mask.map(|m| m.values.as_slice());
    let mut whitened = whiten(&advantages.values, keep, true);
    if let Some(keep) = keep {
        for (a, &k) in whitened.iter_mut().zip(keep) {
            if !k {
                *a = 0.0;
            }
        }
    }
    (
        Grid::new(rows, width, whitened),
        Grid::new(rows, width, returns),
    )
}

/// The settings of a batch's post-processing (the recipe's keys).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrajectorySettings {
    pub pad_id: u32,
    pub max_generated_tokens: usize,
    pub min_response_length: Option<usize>,
    pub penalise_no_eos: bool,
    pub reward_penalty: f32,
    pub kl_coeff: f32,
    pub gamma: f64,
    pub lmbda: f64,
    pub whiten_rewards: bool,
}

/// What the models scored on a batch of responses, before any masking.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    /// Each response's tokens, untruncated.
    pub responses: Grid<u32>,
    /// The reward model's score at each row's last token (of the truncated response).
    pub scores: Vec<f32>,
    /// The policy's and the reference's log-probabilities of each response token, and the
    /// value model's value at each.
    pub log_probs: Grid<f32>,
    pub ref_log_probs: Grid<f32>,
    pub values: Grid<f32>,
}

/// A batch after the recipe's post-processing: what the PPO updates train on.
#[derive(Debug, Clone, PartialEq)]
pub struct Trajectory {
    /// True after each row's first stop token.
    pub response_padding: Grid<bool>,
    pub responses: Grid<u32>,
    pub last_indices: Vec<usize>,
    /// Scores with the penalty in place.
    pub scores: Vec<f32>,
    /// 1.0 in the padding.
    pub log_probs: Grid<f32>,
    pub ref_log_probs: Grid<f32>,
    pub value_positions: Vec<usize>,
    pub value_padding: Grid<bool>,
    /// 0.0 in the value padding.
    pub values: Grid<f32>,
    pub rewards: PpoRewards,
    /// The rewards the advantages come from: `rewards.total`, whitened with `whiten_rewards`.
    pub gae_rewards: Grid<f32>,
    pub advantages: Grid<f32>,
    pub returns: Grid<f32>,
}

/// The recipe's lines from the responses to the advantages (`generate_trajectory` after the
/// models ran, then `train` up to the PPO epochs), on host values. The stop tokens are only
/// where each response ends: tokens after them are never attended to by what counts.
pub fn trajectory(scored: Scored, stop_ids: &[u32], s: &TrajectorySettings) -> Trajectory {
    let Scored {
        mut responses,
        mut scores,
        mut log_probs,
        mut ref_log_probs,
        mut values,
    } = scored;
    let response_padding = truncate_at_first_stop(&mut responses, stop_ids, s.pad_id);
    let last_indices = last_token_indices(&response_padding);
    let penalised = penalised_rows(
        &response_padding,
        &last_indices,
        s.penalise_no_eos,
        s.min_response_length,
    );
    for (score, &p) in scores.iter_mut().zip(&penalised) {
        if p {
            *score = s.reward_penalty;
        }
    }
    for (i, &pad) in response_padding.values.iter().enumerate() {
        if pad {
            log_probs.values[i] = 1.0;
            ref_log_probs.values[i] = 1.0;
        }
    }
    let (value_positions, value_padding) =
        value_positions(&response_padding, &last_indices, s.max_generated_tokens);
    for (v, &pad) in values.values.iter_mut().zip(&value_padding.values) {
        if pad {
            *v = 0.0;
        }
    }
    let rewards = ppo_rewards(
        &scores,
        &log_probs,
        &ref_log_probs,
        s.kl_coeff,
        &value_positions,
    );
    let gae_rewards = if s.whiten_rewards {
        let open: Vec<bool> = value_padding.values.iter().map(|p| !p).collect();
        let mut whitened = whiten(&rewards.total.values, Some(&open), true);
        for (w, &keep) in whitened.iter_mut().zip(&open) {
            if !keep {
                *w = 0.0;
            }
        }
        Grid::new(value_padding.rows, value_padding.width, whitened)
    } else {
        rewards.total.clone()
    };
    let response_mask = Grid::new(
        response_padding.rows,
        response_padding.width,
        response_padding.values.iter().map(|p| !p).collect(),
    );
    let (advantages, returns) = estimate_advantages(
        &values,
        &gae_rewards,
        s.gamma,
        s.lmbda,
        Some(&response_mask),
    );
    Trajectory {
        response_padding,
        responses,
        last_indices,
        scores,
        log_probs,
        ref_log_probs,
        value_positions,
        value_padding,
        values,
        rewards,
        gae_rewards,
        advantages,
        returns,
    }
}

/// The recipe's logged statistics of a trajectory (`log_metrics`).
pub fn trajectory_metrics(t: &Trajectory) -> Vec<(MetricName, f64)> {
    let rows = t.scores.len().max(1) as f64;
    let row_sum_mean = |g: &Grid<f32>| {
        (0..g.rows)
            .map(|r| g.row(r).iter().map(|&v| v as f64).sum::<f64>())
            .sum::<f64>()
            / rows
    };
    let scores = t.scores.iter().map(|&s| s as f64).sum::<f64>() / rows;
    let kl_reward = row_sum_mean(&t.rewards.kl_rewards);
    let stopped = (0..t.response_padding.rows)
        .filter(|&r| t.response_padding.row(r).iter().any(|&p| p))
        .count();
    let lengths = t.last_indices.iter().map(|&n| n as f64).sum::<f64>() / rows;
    vec![
        ("scores".into(), scores),
        ("num_stop_tokens".into(), stopped as f64),
        ("rlhf_reward".into(), scores + kl_reward),
        ("kl".into(), row_sum_mean(&t.rewards.kl)),
        ("kl_reward".into(), kl_reward),
        ("response_lengths".into(), lengths),
    ]
}

#[cfg(test)]
mod tests {
    //! Every function against `tests/fixtures/ppo.json` (torchtune 0.6.1's `rlhf` functions and
    //! recipe lines, f32).
    use super::*;
    use serde_json::Value;

    fn fixture() -> Value {
        serde_json::from_str(include_str!("../../tests/fixtures/ppo.json")).expect("ppo.json")
    }

    fn floats(v: &Value) -> Vec<f32> {
        v.as_array()
            .expect("a list")
            .iter()
            .map(|x| x.as_f64().expect("a number") as f32)
            .collect()
    }

    fn ints(v: &Value) -> Vec<usize> {
        v.as_array()
            .expect("a list")
            .iter()
            .map(|x| x.as_u64().expect("an int") as usize)
            .collect()
    }

    fn bools(v: &Value) -> Vec<bool> {
        v.as_array()
            .expect("a list")
            .iter()
            .map(|x| x.as_bool().expect("a bool"))
            .collect()
    }

    fn shape(case: &Value) -> (usize, usize) {
        let n = |k: &str| case[k].as_u64().expect("a size") as usize;
        (n("batch"), n("width"))
    }

    fn close(name: &str, got: &[f32], want: &[f32], tol: f32) {
        assert_eq!(got.len(), want.len(), "{name}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= tol * (1.0 + w.abs()),
                "{name}[{i}]: {g} against torchtune's {w}"
            );
        }
    }

    fn cases<'a>(f: &'a Value, section: &str) -> &'a Vec<Value> {
        let cases = f[section].as_array().expect("cases");
        assert!(!cases.is_empty(), "{section} has cases");
        cases
    }

    #[test]
    fn responses_end_after_their_first_stop_token_as_torchtunes() {
        let f = fixture();
        for case in cases(&f, "truncate") {
            let (b, w) = shape(case);
            let tokens = ints(&case["responses"]).iter().map(|&t| t as u32).collect();
            let mut responses = Grid::new(b, w, tokens);
            let stops: Vec<u32> = ints(&case["stop_tokens"])
                .iter()
                .map(|&t| t as u32)
                .collect();
            let pad = case["pad_id"].as_u64().expect("pad") as u32;
            let padding = truncate_at_first_stop(&mut responses, &stops, pad);
            assert_eq!(
                padding.values,
                bools(&case["expected_padding_mask"]),
                "{}",
                case["name"]
            );
            let want: Vec<u32> = ints(&case["expected_responses"])
                .iter()
                .map(|&t| t as u32)
                .collect();
            assert_eq!(responses.values, want, "{}", case["name"]);
            assert_eq!(
                last_token_indices(&padding),
                ints(&case["expected_seq_lens"])
            );
        }
    }

    #[test]
    fn penalties_and_value_positions_are_torchtunes() {
        let f = fixture();
        for case in cases(&f, "penalty") {
            let (b, w) = shape(case);
            let padding = Grid::new(b, w, bools(&case["padding_mask"]));
            let min = case["min_response_length"].as_u64().map(|m| m as usize);
            let got = penalised_rows(
                &padding,
                &ints(&case["seq_lens"]),
                case["penalise_no_eos"].as_bool().expect("flag"),
                min,
            );
            assert_eq!(got, bools(&case["expected"]), "{}", case["name"]);
        }
        for case in cases(&f, "value_seq_idxs") {
            let (b, w) = shape(case);
            let padding = Grid::new(b, w, bools(&case["padding_mask"]));
            let max = case["max_generated_tokens"].as_u64().expect("max") as usize;
            let (positions, value_padding) =
                value_positions(&padding, &ints(&case["seq_lens"]), max);
            assert_eq!(positions, ints(&case["expected_idxs"]), "{}", case["name"]);
            assert_eq!(
                value_padding.values,
                bools(&case["expected_value_padding_mask"])
            );
        }
    }

    #[test]
    fn rewards_whitening_and_advantages_are_torchtunes() {
        let f = fixture();
        for case in cases(&f, "rewards") {
            let (b, w) = shape(case);
            let positions = match &case["valid_score_idxs"] {
                Value::Null => vec![w - 1; b],
                idx => ints(idx),
            };
            let out = ppo_rewards(
                &floats(&case["scores"]),
                &Grid::new(b, w, floats(&case["logprobs"])),
                &Grid::new(b, w, floats(&case["ref_logprobs"])),
                case["kl_coeff"].as_f64().expect("kl") as f32,
                &positions,
            );
            close(
                "total",
                &out.total.values,
                &floats(&case["expected_total_rewards"]),
                1e-6,
            );
            close("kl", &out.kl.values, &floats(&case["expected_kl"]), 1e-6);
            close(
                "kl_rewards",
                &out.kl_rewards.values,
                &floats(&case["expected_kl_rewards"]),
                1e-6,
            );
        }
        for case in cases(&f, "whiten") {
            let mask = match &case["mask"] {
                Value::Null => None,
                m => Some(bools(m)),
            };
            let got = whiten(
                &floats(&case["x"]),
                mask.as_deref(),
                case["shift_mean"].as_bool().expect("flag"),
            );
            close("whiten", &got, &floats(&case["expected"]), 1e-5);
        }
        for case in cases(&f, "advantages") {
            let (b, w) = shape(case);
            let mask = match &case["masks"] {
                Value::Null => None,
                m => Some(Grid::new(b, w, bools(m))),
            };
            let (adv, ret) = estimate_advantages(
                &Grid::new(b, w, floats(&case["values"])),
                &Grid::new(b, w, floats(&case["rewards"])),
                case["gamma"].as_f64().expect("gamma"),
                case["lmbda"].as_f64().expect("lmbda"),
                mask.as_ref(),
            );
            close(
                "advantages",
                &adv.values,
                &floats(&case["expected_advantages"]),
                1e-5,
            );
            close(
                "returns",
                &ret.values,
                &floats(&case["expected_returns"]),
                1e-5,
            );
        }
    }

    #[test]
    fn a_batchs_trajectory_is_torchtunes_from_responses_to_advantages() {
        let f = fixture();
        for case in cases(&f, "trajectory") {
            let name = case["name"].as_str().unwrap_or("?");
            let (b, w) = shape(case);
            let grid = |k: &str| Grid::new(b, w, floats(&case[k]));
            let tokens = ints(&case["responses"]).iter().map(|&t| t as u32).collect();
            let scored = Scored {
                responses: Grid::new(b, w, tokens),
                scores: floats(&case["scores"]),
                log_probs: grid("logprobs"),
                ref_log_probs: grid("ref_logprobs"),
                values: grid("values"),
            };
            let settings = TrajectorySettings {
                pad_id: case["pad_id"].as_u64().expect("pad") as u32,
                max_generated_tokens: case["max_generated_tokens"].as_u64().expect("max") as usize,
                min_response_length: case["min_response_length"].as_u64().map(|m| m as usize),
                penalise_no_eos: case["penalise_no_eos"].as_bool().expect("flag"),
                reward_penalty: case["reward_penalty"].as_f64().expect("penalty") as f32,
                kl_coeff: case["kl_coeff"].as_f64().expect("kl") as f32,
                gamma: case["gamma"].as_f64().expect("gamma"),
                lmbda: case["lmbda"].as_f64().expect("lmbda"),
                whiten_rewards: case["whiten_rewards"].as_bool().expect("flag"),
            };
            let stops: Vec<u32> = ints(&case["stop_tokens"])
                .iter()
                .map(|&t| t as u32)
                .collect();
            let t = trajectory(scored, &stops, &settings);
            assert_eq!(
                t.response_padding.values,
                bools(&case["expected_response_padding_mask"]),
                "{name}"
            );
            assert_eq!(t.last_indices, ints(&case["expected_seq_lens"]), "{name}");
            close("scores", &t.scores, &floats(&case["expected_scores"]), 0.0);
            close(
                "logprobs",
                &t.log_probs.values,
                &floats(&case["expected_logprobs"]),
                0.0,
            );
            close(
                "ref_logprobs",
                &t.ref_log_probs.values,
                &floats(&case["expected_ref_logprobs"]),
                0.0,
            );
            assert_eq!(
                t.value_positions,
                ints(&case["expected_value_seq_idxs"]),
                "{name}"
            );
            assert_eq!(
                t.value_padding.values,
                bools(&case["expected_value_padding_mask"]),
                "{name}"
            );
            close(
                "values",
                &t.values.values,
                &floats(&case["expected_values"]),
                0.0,
            );
            close(
                "total",
                &t.rewards.total.values,
                &floats(&case["expected_total_rewards"]),
                1e-6,
            );
            if !case["expected_whitened_rewards"].is_null() {
                close(
                    "whitened",
                    &t.gae_rewards.values,
                    &floats(&case["expected_whitened_rewards"]),
                    1e-5,
                );
            }
            close(
                "advantages",
                &t.advantages.values,
                &floats(&case["expected_advantages"]),
                1e-5,
            );
            close(
                "returns",
                &t.returns.values,
                &floats(&case["expected_returns"]),
                1e-5,
            );
            let stats = &case["expected_stats"];
            for (key, value) in trajectory_metrics(&t) {
                let want = stats[key.as_ref()].as_f64().unwrap_or(f64::NAN);
                assert!(
                    (value - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{name} {key}: {value} against {want}"
                );
            }
        }
    }
}
