//! The GRPO family's losses on per-token log-probabilities, value-exact against their references:
//! torchtune's `GRPOLoss`, `GRPOCompletionLoss` and `GRPOSimpleLoss`, and TRL's
//! `GRPOTrainer._compute_loss` (`loss_type` grpo, bnpo, dr_grpo, dapo; token- or sequence-level
//! importance sampling, the latter being GSPO), plus the group-normalised advantages both feed them
//! and TRL's `mask_truncated_completions`.
//!
//! No model, no generation: the inputs are the per-token log-probabilities a recipe computes (policy,
//! old policy, frozen reference), `[batch, seq]` with `batch` = prompts x completions per prompt,
//! the per-completion advantages `[batch]` and a `[batch, seq]` mask of the completion tokens that
//! count. The losses are burn tensor ops, so on an autodiff backend they backpropagate into the
//! policy's log-probabilities exactly as torch autograd does through the references (the fixture
//! `tests/fixtures/grpo_losses.json` holds torch's gradients).
//!
//! References (see `tests/fixtures/make_grpo_loss_fixtures.py`, which calls or transcribes each):
//! - torchtune 0.6.1: its wheel ships the GRPO recipe but not `torchtune/dev/grpo/loss.py`, which
//!   landed on main (cf0142bd2, Feb 2025) after the 0.6.1 release branch was cut; the classes here are
//!   that file's, unchanged on main since but for type hints.
//! - TRL 1.16.0's `GRPOTrainer._compute_loss` and `_generate_and_score_completions`.

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Tensor, TensorData};

/// What a GRPO loss refuses, before computing anything.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrpoLossError {
    #[error("{what} has shape {got:?}, but the policy log-probabilities need {expected:?}")]
    Shape {
        what: &'static str,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error(
        "the KL coefficient (beta) is {beta}, but no reference log-probabilities were given; set beta to 0 to train without a reference model"
    )]
    MissingReference { beta: f64 },
    #[error("{rewards} rewards do not split into groups of {group_size} completions")]
    Groups { rewards: usize, group_size: usize },
    #[error(
        "completion {row} has no tokens, so whether it was truncated is undefined (TRL reads its last token)"
    )]
    EmptyCompletion { row: usize },
    #[error("{0}")]
    Setting(String),
}

// ---------------------------------------------------------------------------------------------
// torchtune

/// torchtune's three GRPO loss classes (`torchtune.dev.grpo.loss.*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TorchtuneGrpoLoss {
    /// `GRPOLoss`: PPO-style clipped surrogate per token, `ratio = exp(pi - pi_old)` per token,
    /// masked means over every token of the batch.
    Token,
    /// `GRPOCompletionLoss`: the clipped surrogate on whole-completion log-probabilities. Its
    /// `masked_sum` has no `dim`, so each of the three log-probability tensors becomes one number
    /// summed over every unmasked token of the batch: one ratio for the whole batch, applied to
    /// each row's advantage, and one KL value.
    Completion,
    /// `GRPOSimpleLoss` (the one torchtune's GRPO configs use, after TRL's single-update GRPO):
    /// `exp(pi - detach(pi)) * advantage`, value the advantage, gradient the advantage; the old
    /// policy's log-probabilities are unused, and the ratio and clip fraction it reports are the
    /// constants 1 and 0.
    Simple,
}

impl TorchtuneGrpoLoss {
    /// The class for a config's `loss._component_`.
    pub fn from_component(component: &str) -> Option<Self> {
        match component.rsplit('.').next() {
            Some("GRPOLoss") => Some(Self::Token),
            Some("GRPOCompletionLoss") => Some(Self::Completion),
            Some("GRPOSimpleLoss") => Some(Self::Simple),
            _ => None,
        }
    }

    pub fn class_name(self) -> &'static str {
        match self {
            Self::Token => "GRPOLoss",
            Self::Completion => "GRPOCompletionLoss",
            Self::Simple => "GRPOSimpleLoss",
        }
    }
}

/// A torchtune GRPO loss with its two parameters (both classes default to 0.1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TorchtuneGrpoSettings {
    pub loss: TorchtuneGrpoLoss,
    /// The ratio is clipped to `[1 - epsilon, 1 + epsilon]` (unused by `GRPOSimpleLoss`).
    pub epsilon: f64,
    /// Weight of the k3 KL estimate against the reference (torchtune's "beta").
    pub kl_coeff: f64,
}

/// The GRPO recipes' policy loss, as `loss._component_` names it: one of torchtune's classes
/// or TRL's `GRPOTrainer` loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GrpoObjective {
    Torchtune(TorchtuneGrpoSettings),
    Trl(TrlGrpoSettings),
}

impl GrpoObjective {
    /// The KL term's weight (`kl_coeff`, TRL's `beta`); at 0 no reference model is run.
    pub fn kl_weight(&self) -> f64 {
        match self {
            Self::Torchtune(s) => s.kl_coeff,
            Self::Trl(s) => s.beta,
        }
    }
}

/// What torchtune's GRPO losses return, in their order: `(loss, policy_loss, kl_loss, ratios,
/// clipfrac)`. Each is `[1]`; everything but `loss` is detached, as in torchtune.
pub struct TorchtuneGrpoOutput<B: Backend> {
    /// `-(policy_loss - kl_coeff * kl_loss)`, to minimise.
    pub loss: Tensor<B, 1>,
    /// The clipped surrogate objective (to maximise), before the KL term.
    pub policy_loss: Tensor<B, 1>,
    /// The k3 estimate `exp(ref - pi) - (ref - pi) - 1`, averaged as the class averages it.
    pub kl_loss: Tensor<B, 1>,
    /// `GRPOLoss`: the mean of `exp(pi - pi_old)` over EVERY position, padding included (torchtune
    /// takes `ratios.mean()` unmasked; its recipe writes 1.0 into padded log-probabilities, so padding
    /// counts as ratio 1). `GRPOCompletionLoss`: the batch-wide ratio. `GRPOSimpleLoss`: 1.
    pub ratios: Tensor<B, 1>,
    /// Fraction of (unmasked) terms where the clipped surrogate is the smaller; 0 for `GRPOSimpleLoss`.
    pub clipfrac: Tensor<B, 1>,
}

/// torchtune's GRPO loss `settings.loss` (`torchtune/dev/grpo/loss.py`), on `[batch, seq]`
/// log-probabilities of the old policy, the policy and the reference, `[batch]` advantages and a
/// `[batch, seq]` mask, true on the completion tokens that count (torchtune's `padding_masks`,
/// which its recipe passes as `~response_padding_masks`).
pub fn torchtune_grpo_loss<B: Backend>(
    settings: TorchtuneGrpoSettings,
    pi_old_logprobs: Tensor<B, 2>,
    pi_logprobs: Tensor<B, 2>,
    ref_logprobs: Tensor<B, 2>,
    advantages: Tensor<B, 1>,
    padding_masks: Tensor<B, 2, Bool>,
) -> Result<TorchtuneGrpoOutput<B>, GrpoLossError> {
    let [batch, seq] = pi_logprobs.dims();
    check_shape("pi_old_logprobs", &pi_old_logprobs.dims(), &[batch, seq])?;
    check_shape("ref_logprobs", &ref_logprobs.dims(), &[batch, seq])?;
    check_shape("advantages", &advantages.dims(), &[batch])?;
    check_shape("padding_masks", &padding_masks.dims(), &[batch, seq])?;
    let mask = fp32(padding_masks);
    let TorchtuneGrpoSettings {
        loss,
        epsilon,
        kl_coeff,
    } = settings;
    Ok(match loss {
        TorchtuneGrpoLoss::Token => {
            let ratios = (pi_logprobs.clone() - pi_old_logprobs).exp();
            let clipped_ratios = ratios.clone().clamp(1.0 - epsilon, 1.0 + epsilon);
            let advantages = advantages.unsqueeze_dim::<2>(1).expand([batch, seq]);
            let clipped = advantages.clone() * clipped_ratios;
            let unclipped = advantages * ratios.clone();
            let clipfrac = masked_mean(fp32(clipped.clone().lower(unclipped.clone())), &mask);
            // torch.minimum(clipped, unclipped)
            let policy_loss = masked_mean(clipped.min_pair(unclipped), &mask);
            let kl_loss = masked_mean(k3(ref_logprobs, pi_logprobs), &mask);
            TorchtuneGrpoOutput {
                loss: (policy_loss.clone() - kl_loss.clone() * kl_coeff).neg(),
                policy_loss: policy_loss.detach(),
                kl_loss: kl_loss.detach(),
                ratios: ratios.mean().detach(),
                clipfrac: clipfrac.detach(),
            }
        }
        TorchtuneGrpoLoss::Completion => {
            // masked_sum(x, padding_masks) with dim=None: one sum over the whole batch, so
            // ratio = exp(sum(pi) - sum(pi_old)) and the KL's log-ratio is sum(ref) - sum(pi).
            // Summing the per-token differences instead is the same value and gradient without
            // subtracting two sums of ~-2 x tokens, where float32 keeps only ~1e-5 of the
            // difference (torch's own float32 result is that far from its float64 one).
            let log_ratio = ((pi_logprobs.clone() - pi_old_logprobs) * mask.clone()).sum();
            let ref_log_ratio = ((ref_logprobs - pi_logprobs) * mask.clone()).sum();
            let ratios = log_ratio.exp();
            let clipped_ratios = ratios.clone().clamp(1.0 - epsilon, 1.0 + epsilon);
            let clipped = advantages.clone() * clipped_ratios.expand([batch]);
            let unclipped = advantages * ratios.clone().expand([batch]);
            let clipfrac = fp32(clipped.clone().lower(unclipped.clone())).mean();
            let policy_loss = clipped.min_pair(unclipped).mean();
            // masked_mean(kl [1], padding_masks [batch, seq]) broadcasts the one value.
            let kl = (ref_log_ratio.clone().exp() - ref_log_ratio - 1.0)
                .unsqueeze_dim::<2>(1)
                .expand([batch, seq]);
            let kl_loss = masked_mean(kl, &mask);
            TorchtuneGrpoOutput {
                loss: (policy_loss.clone() - kl_loss.clone() * kl_coeff).neg(),
                policy_loss: policy_loss.detach(),
                kl_loss: kl_loss.detach(),
                ratios: ratios.detach(),
                clipfrac: clipfrac.detach(),
            }
        }
        TorchtuneGrpoLoss::Simple => {
            let device = pi_logprobs.device();
            let per_token_kl = k3(ref_logprobs.detach(), pi_logprobs.clone());
            let advantages = advantages.unsqueeze_dim::<2>(1).expand([batch, seq]);
            let per_token_policy_loss =
                (pi_logprobs.clone() - pi_logprobs.detach()).exp() * advantages;
            let per_token_loss =
                (per_token_policy_loss.clone() - per_token_kl.clone() * kl_coeff).neg();
            let loss = masked_mean_rows(per_token_loss, &mask).mean();
            let policy_loss = masked_mean_rows(per_token_policy_loss, &mask)
                .mean()
                .detach();
            let kl_loss = masked_mean_rows(per_token_kl, &mask).mean().detach();
            TorchtuneGrpoOutput {
                loss,
                policy_loss,
                kl_loss,
                ratios: crate::precision::f32_tensor(vec![1.0], [1], &device),
                clipfrac: crate::precision::f32_tensor(vec![0.0], [1], &device),
            }
        }
    })
}

/// A mask as fp32 0/1 values, whatever the device's default float dtype: the losses compute in
/// fp32 (the log-probabilities are), and bf16 training must not mix the two.
fn fp32<B: Backend, const D: usize>(mask: Tensor<B, D, Bool>) -> Tensor<B, D> {
    crate::precision::to_f32(mask.float())
}

/// The k3 estimator of KL(pi || ref) per token, `exp(ref - pi) - (ref - pi) - 1` (Schulman's),
/// which torchtune and TRL both use.
fn k3<B: Backend, const D: usize>(reference: Tensor<B, D>, pi: Tensor<B, D>) -> Tensor<B, D> {
    let diff = reference - pi;
    diff.clone().exp() - diff - 1.0
}

/// torchtune's `rlhf.masked_mean(x, mask)` (dim None): `(x * mask).sum() / (mask.sum() + 1e-8)`.
fn masked_mean<B: Backend>(x: Tensor<B, 2>, mask: &Tensor<B, 2>) -> Tensor<B, 1> {
    (x * mask.clone()).sum() / (mask.clone().sum() + 1e-8)
}

/// torchtune's `rlhf.masked_mean(x, mask, dim=1)`: `[batch]`.
fn masked_mean_rows<B: Backend>(x: Tensor<B, 2>, mask: &Tensor<B, 2>) -> Tensor<B, 1> {
    let rows = (x * mask.clone()).sum_dim(1) / (mask.clone().sum_dim(1) + 1e-8);
    rows.squeeze_dim::<1>(1)
}

// ---------------------------------------------------------------------------------------------
// TRL

/// TRL's `GRPOConfig.loss_type`, the four clipped-surrogate forms (they differ only in how the
/// per-token losses are averaged).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrlLossType {
    /// Each completion's token mean, then the mean over completions (length-biased).
    Grpo,
    /// The token mean over the micro-batch.
    Bnpo,
    /// The token sum over `batch * max_completion_length` (Dr. GRPO: a constant normaliser).
    DrGrpo,
    /// The token sum over the active tokens of the whole generation batch, across accumulation steps
    /// and processes (`num_items_in_batch`). TRL's default.
    Dapo,
}

impl TrlLossType {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "grpo" => Some(Self::Grpo),
            "bnpo" => Some(Self::Bnpo),
            "dr_grpo" => Some(Self::DrGrpo),
            "dapo" => Some(Self::Dapo),
            _ => None,
        }
    }
}

/// TRL's `importance_sampling_level`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImportanceSamplingLevel {
    /// One ratio per token, `exp(logp - old_logp)`.
    Token,
    /// GSPO: one ratio per completion, `exp` of the mean per-token log-ratio over its unmasked tokens.
    Sequence,
}

/// The `GRPOConfig` fields `_compute_loss` reads (TRL 1.16's defaults in `Default`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrlGrpoSettings {
    pub loss_type: TrlLossType,
    pub importance_sampling_level: ImportanceSamplingLevel,
    /// `epsilon`: the ratio's lower clip is `1 - epsilon_low`.
    pub epsilon_low: f64,
    /// `epsilon_high` (TRL: `epsilon` when unset): the upper clip is `1 + epsilon_high` (DAPO's
    /// clip-higher when larger than `epsilon_low`).
    pub epsilon_high: f64,
    /// KL coefficient; 0 (TRL's default) skips the KL term and needs no reference.
    pub beta: f64,
    /// `use_bias_correction_kl` (TRL 1.16 default true): the k3 KL is multiplied by the (not
    /// detached) importance ratio, DeepSeek-V3.2's unbiased reverse-KL gradient.
    pub use_bias_correction_kl: bool,
    /// dr_grpo's normaliser (`max_completion_length`, TRL's default 512).
    pub max_completion_length: usize,
}

/// Where this micro-batch sits in TRL's generation batch, for the normalisers (training mode).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrlAccumulation {
    /// grpo, bnpo and dr_grpo divide the loss by it; dapo multiplies its normaliser by it.
    pub gradient_accumulation_steps: usize,
    /// `steps_per_generation` (TRL: `gradient_accumulation_steps` when unset); dapo divides its
    /// normaliser by it.
    pub steps_per_generation: usize,
    /// Processes (ranks); dapo divides `num_items_in_batch` by it.
    pub num_processes: usize,
    /// Active completion tokens of the whole generation batch on every process (after
    /// `mask_truncated_completions`): dapo's normaliser.
    pub num_items_in_batch: f64,
}

impl TrlAccumulation {
    /// One process, one micro-batch per generation batch, no accumulation: `num_items_in_batch` is
    /// this micro-batch's active token count.
    pub fn single(num_items_in_batch: f64) -> Self {
        Self {
            gradient_accumulation_steps: 1,
            steps_per_generation: 1,
            num_processes: 1,
            num_items_in_batch,
        }
    }
}

/// The log-probabilities and advantages `_compute_loss` reads from its inputs.
pub struct TrlGrpoInputs<B: Backend> {
    /// The policy's per-token log-probabilities, `[batch, seq]` (the tensor that carries the gradient).
    pub per_token_logps: Tensor<B, 2>,
    /// The old policy's; `None` on-policy (TRL then uses `per_token_logps.detach()`: ratio 1 with the
    /// ratio's gradient).
    pub old_per_token_logps: Option<Tensor<B, 2>>,
    /// The reference model's; needed when `beta != 0`.
    pub ref_per_token_logps: Option<Tensor<B, 2>>,
    /// `[batch]`.
    pub advantages: Tensor<B, 1>,
    /// `[batch, seq]`, true on the completion tokens that count.
    pub completion_mask: Tensor<B, 2, Bool>,
}

/// What TRL logs from `_compute_loss` (its `_metrics` keys in [`TrlGrpoMetrics::entries`]). TRL
/// calls `.item()` on each, so these are host values; NaN where TRL logs NaN.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrlGrpoMetrics {
    /// `kl`: the (bias-corrected when enabled) per-token KL's mean over active tokens; `None` when
    /// beta is 0 (TRL logs nothing then).
    pub kl: Option<f32>,
    /// `clip_ratio/low_mean`: active tokens (sequences, at sequence level) with ratio below
    /// `1 - epsilon_low` and a negative advantage.
    pub clip_ratio_low_mean: f32,
    /// `clip_ratio/high_mean`: ratio above `1 + epsilon_high` with a positive advantage.
    pub clip_ratio_high_mean: f32,
    /// `clip_ratio/region_mean`: either.
    pub clip_ratio_region_mean: f32,
    /// `clip_ratio/low_min`: the smallest per-completion low-clip fraction (completions with no
    /// active token are skipped; NaN if none has one).
    pub clip_ratio_low_min: f32,
    /// `clip_ratio/high_max`: the largest per-completion high-clip fraction.
    pub clip_ratio_high_max: f32,
}

impl TrlGrpoMetrics {
    /// `(TRL's metric name, value)`, as TRL logs them.
    pub fn entries(&self) -> Vec<(&'static str, f32)> {
        let mut out = Vec::with_capacity(6);
        if let Some(kl) = self.kl {
            out.push(("kl", kl));
        }
        out.extend([
            ("clip_ratio/low_mean", self.clip_ratio_low_mean),
            ("clip_ratio/high_mean", self.clip_ratio_high_mean),
            ("clip_ratio/region_mean", self.clip_ratio_region_mean),
            ("clip_ratio/low_min", self.clip_ratio_low_min),
            ("clip_ratio/high_max", self.clip_ratio_high_max),
        ]);
        out
    }
}

/// TRL's loss and logged metrics.
pub struct TrlGrpoOutput<B: Backend> {
    /// `[1]`, already divided for gradient accumulation as TRL divides it.
    pub loss: Tensor<B, 1>,
    pub metrics: TrlGrpoMetrics,
}

/// TRL 1.16's `GRPOTrainer._compute_loss` from the log-probabilities on (no entropy mask, no
/// off-policy mask, no vLLM importance correction, no `delta`, no entropy bonus: their defaults),
/// in training mode.
pub fn trl_grpo_loss<B: Backend>(
    settings: TrlGrpoSettings,
    accumulation: TrlAccumulation,
    inputs: TrlGrpoInputs<B>,
) -> Result<TrlGrpoOutput<B>, GrpoLossError> {
    let TrlGrpoInputs {
        per_token_logps,
        old_per_token_logps,
        ref_per_token_logps,
        advantages,
        completion_mask,
    } = inputs;
    let [batch, seq] = per_token_logps.dims();
    if let Some(old) = &old_per_token_logps {
        check_shape("old_per_token_logps", &old.dims(), &[batch, seq])?;
    }
    if let Some(reference) = &ref_per_token_logps {
        check_shape("ref_per_token_logps", &reference.dims(), &[batch, seq])?;
    }
    check_shape("advantages", &advantages.dims(), &[batch])?;
    check_shape("completion_mask", &completion_mask.dims(), &[batch, seq])?;
    let reference = match (settings.beta != 0.0, ref_per_token_logps) {
        (true, None) => {
            return Err(GrpoLossError::MissingReference {
                beta: settings.beta,
            });
        }
        (true, Some(reference)) => Some(reference),
        (false, _) => None,
    };
    if accumulation.gradient_accumulation_steps == 0
        || accumulation.steps_per_generation == 0
        || accumulation.num_processes == 0
    {
        return Err(GrpoLossError::Setting(format!(
            "gradient_accumulation_steps, steps_per_generation and num_processes must be at least 1 (got {accumulation:?})"
        )));
    }
    if settings.loss_type == TrlLossType::DrGrpo && settings.max_completion_length == 0 {
        return Err(GrpoLossError::Setting(
            "dr_grpo divides by max_completion_length, which is 0".into(),
        ));
    }

    let mask = fp32(completion_mask);
    let old = old_per_token_logps.unwrap_or_else(|| per_token_logps.clone().detach());
    let log_ratio = per_token_logps.clone() - old;
    // [batch, seq] per token, [batch, 1] per sequence.
    let log_importance_weights = match settings.importance_sampling_level {
        ImportanceSamplingLevel::Token => log_ratio,
        ImportanceSamplingLevel::Sequence => {
            (log_ratio * mask.clone()).sum_dim(1) / mask.clone().sum_dim(1).clamp_min(1.0)
        }
    };
    let coef_1 = log_importance_weights.exp();
    let width = coef_1.dims()[1];
    let advantages = advantages.unsqueeze_dim::<2>(1);
    let advantages_w = advantages.clone().expand([batch, width]);

    let per_token_kl = reference.map(|reference| {
        let kl = k3(reference, per_token_logps.clone());
        if settings.use_bias_correction_kl {
            kl * coef_1.clone().expand([batch, seq])
        } else {
            kl
        }
    });

    let coef_2 = coef_1
        .clone()
        .clamp(1.0 - settings.epsilon_low, 1.0 + settings.epsilon_high);
    let loss1 = coef_1.clone() * advantages_w.clone();
    let loss2 = coef_2 * advantages_w.clone();
    let mut per_token_loss = loss1.min_pair(loss2).neg().expand([batch, seq]);
    if let Some(kl) = &per_token_kl {
        per_token_loss = per_token_loss + kl.clone() * settings.beta;
    }

    let masked = per_token_loss * mask.clone();
    let accum = accumulation.gradient_accumulation_steps as f64;
    let loss = match settings.loss_type {
        TrlLossType::Grpo => {
            let rows = masked.sum_dim(1) / mask.clone().sum_dim(1).clamp_min(1.0);
            rows.mean() / accum
        }
        TrlLossType::Bnpo => masked.sum() / mask.clone().sum().clamp_min(1.0) / accum,
        TrlLossType::DrGrpo => {
            masked.sum() / (batch * settings.max_completion_length) as f64 / accum
        }
        TrlLossType::Dapo => {
            // normalizer = num_items_in_batch.clamp(min=1) / num_processes
            //              * gradient_accumulation_steps / steps_per_generation (in f32, as torch)
            let normalizer = (accumulation.num_items_in_batch as f32).max(1.0)
                / accumulation.num_processes as f32
                * accumulation.gradient_accumulation_steps as f32
                / accumulation.steps_per_generation as f32;
            masked.sum() / normalizer as f64
        }
    };

    let metrics = trl_metrics(
        settings,
        &mask,
        coef_1.detach(),
        advantages_w.detach(),
        per_token_kl.map(Tensor::detach),
    );
    Ok(TrlGrpoOutput { loss, metrics })
}

/// The metrics block at the end of `_compute_loss` (`global_masked_mean`, `masked_seq_mean`,
/// `nanmin`, `nanmax`, one process).
fn trl_metrics<B: Backend>(
    settings: TrlGrpoSettings,
    mask: &Tensor<B, 2>,
    coef_1: Tensor<B, 2>,
    advantages: Tensor<B, 2>,
    per_token_kl: Option<Tensor<B, 2>>,
) -> TrlGrpoMetrics {
    let sequence_level = coef_1.dims()[1] == 1;
    let global_masked_mean = |x: Tensor<B, 2>| -> f32 {
        if sequence_level {
            let rows = x.dims()[0] as f32;
            scalar(x.sum()) / rows.max(1.0)
        } else {
            scalar((x * mask.clone()).sum()) / scalar(mask.clone().sum()).max(1.0)
        }
    };
    // Per completion; NaN for a completion with no active token (0 / 0), as in TRL.
    let masked_seq_mean = |x: Tensor<B, 2>| -> Vec<f32> {
        if sequence_level {
            host(x)
        } else {
            let sums = host((x * mask.clone()).sum_dim(1));
            let counts = host(mask.clone().sum_dim(1));
            sums.iter().zip(&counts).map(|(s, c)| s / c).collect()
        }
    };
    let low = coef_1
        .clone()
        .lower_elem(1.0 - settings.epsilon_low)
        .bool_and(advantages.clone().lower_elem(0.0));
    let high = coef_1
        .greater_elem(1.0 + settings.epsilon_high)
        .bool_and(advantages.greater_elem(0.0));
    let region = low.clone().bool_or(high.clone());
    let (low, high, region) = (fp32(low), fp32(high), fp32(region));
    TrlGrpoMetrics {
        kl: per_token_kl.map(|kl| {
            // The KL is per token even at sequence level.
            scalar((kl * mask.clone()).sum()) / scalar(mask.clone().sum()).max(1.0)
        }),
        clip_ratio_low_mean: global_masked_mean(low.clone()),
        clip_ratio_high_mean: global_masked_mean(high.clone()),
        clip_ratio_region_mean: global_masked_mean(region),
        clip_ratio_low_min: nan_fold(&masked_seq_mean(low), f32::min),
        clip_ratio_high_max: nan_fold(&masked_seq_mean(high), f32::max),
    }
}

/// TRL's `nanmin`/`nanmax`: NaN only when every value is.
fn nan_fold(values: &[f32], pick: fn(f32, f32) -> f32) -> f32 {
    values
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .reduce(pick)
        .unwrap_or(f32::NAN)
}

fn scalar<B: Backend>(x: Tensor<B, 1>) -> f32 {
    host(x.reshape([1, 1])).first().copied().unwrap_or(f32::NAN)
}

fn host<B: Backend>(x: Tensor<B, 2>) -> Vec<f32> {
    x.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap_or_default()
}

fn check_shape(what: &'static str, got: &[usize], expected: &[usize]) -> Result<(), GrpoLossError> {
    if got == expected {
        Ok(())
    } else {
        Err(GrpoLossError::Shape {
            what,
            got: got.to_vec(),
            expected: expected.to_vec(),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Advantages and truncation

/// TRL's `scale_rewards`: what the centred rewards are divided by (plus 1e-4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleRewards {
    /// Each group's standard deviation (TRL's default; torchtune's recipe).
    Group,
    /// The whole batch's standard deviation (the centring stays per group).
    Batch,
    /// Not scaled (Dr. GRPO).
    None,
}

impl ScaleRewards {
    /// TRL accepts `group`/`true`, `batch`, `none`/`false`.
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "group" | "true" | "True" => Some(Self::Group),
            "batch" => Some(Self::Batch),
            "none" | "false" | "False" => Some(Self::None),
            _ => None,
        }
    }
}

/// Advantages of a generation batch and TRL's `frac_reward_zero_std`.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupAdvantages {
    /// One per completion, in the rewards' order.
    pub advantages: Vec<f32>,
    /// Fraction of completions whose scaling std is 0 (per group for `Group` and `None`, the batch's
    /// for `Batch`), TRL's `frac_reward_zero_std`.
    pub frac_reward_zero_std: f32,
}

/// Group-normalised advantages, `(r - mean_group) / (std + 1e-4)` with the unbiased (Bessel)
/// standard deviation: torchtune's GRPO recipe (`rewards.std(1)` over each prompt's completions) is
/// `ScaleRewards::Group`; TRL 1.16's `_generate_and_score_completions` (`sum_then_normalize`) is all
/// three. `rewards` is grouped consecutively, `group_size` completions per prompt. A NaN reward is
/// TRL's unscorable completion (every reward function returned None): left out of its group's mean
/// and std, its advantage is 0; so is every advantage whose std is undefined (TRL's `nan_to_num`).
/// A group of one has std 0 (TRL's `num_generations == 1` branch), so advantage 0.
pub fn group_advantages(
    rewards: &[f32],
    group_size: usize,
    scale: ScaleRewards,
) -> Result<GroupAdvantages, GrpoLossError> {
    if group_size == 0 || rewards.is_empty() || !rewards.len().is_multiple_of(group_size) {
        return Err(GrpoLossError::Groups {
            rewards: rewards.len(),
            group_size,
        });
    }
    let rewards: Vec<f64> = rewards.iter().map(|&r| f64::from(r)).collect();
    let std_per_reward: Vec<f64> = match scale {
        ScaleRewards::Group | ScaleRewards::None => rewards
            .chunks(group_size)
            .flat_map(|g| {
                let std = if group_size > 1 { nanstd(g) } else { 0.0 };
                std::iter::repeat_n(std, group_size)
            })
            .collect(),
        ScaleRewards::Batch => {
            let std = if rewards.len() > 1 {
                nanstd(&rewards)
            } else {
                0.0
            };
            vec![std; rewards.len()]
        }
    };
    let advantages = rewards
        .chunks(group_size)
        .enumerate()
        .flat_map(|(g, group)| {
            let mean = nanmean(group);
            let stds = &std_per_reward[g * group_size..(g + 1) * group_size];
            group.iter().zip(stds).map(move |(r, std)| {
                let centred = r - mean;
                let a = match scale {
                    ScaleRewards::None => centred,
                    _ => centred / (std + 1e-4),
                };
                if a.is_nan() { 0.0 } else { a as f32 }
            })
        })
        .collect();
    // torch.isclose(std, 0): |std| <= 1e-8 (NaN is not close).
    let zero_std = std_per_reward.iter().filter(|s| s.abs() <= 1e-8).count();
    Ok(GroupAdvantages {
        advantages,
        frac_reward_zero_std: zero_std as f32 / rewards.len() as f32,
    })
}

fn nanmean(values: &[f64]) -> f64 {
    let (sum, n) = values
        .iter()
        .filter(|v| !v.is_nan())
        .fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    sum / n as f64
}

/// TRL's `nanstd`: Bessel-corrected over the non-NaN values, NaN with fewer than two.
fn nanstd(values: &[f64]) -> f64 {
    let mean = nanmean(values);
    let valid: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    let n = valid.len();
    if n < 2 {
        return f64::NAN;
    }
    let variance = valid.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
    (variance * n as f64 / (n - 1) as f64).sqrt()
}

/// TRL's `mask_truncated_completions` test: a completion is truncated when its last token is neither
/// an EOS id nor the pad id (it ran into the length limit).
pub fn truncated_completions<T: AsRef<[u32]>>(
    completions: &[T],
    eos_token_ids: &[u32],
    pad_token_id: u32,
) -> Result<Vec<bool>, GrpoLossError> {
    completions
        .iter()
        .enumerate()
        .map(|(row, ids)| match ids.as_ref().last() {
            Some(last) => Ok(!eos_token_ids.contains(last) && *last != pad_token_id),
            None => Err(GrpoLossError::EmptyCompletion { row }),
        })
        .collect()
}

/// TRL's `mask_truncated_completions`: the completion mask with the truncated rows cleared, so they
/// leave the loss (and dapo's `num_items_in_batch`).
pub fn mask_truncated_completions<B: Backend>(
    completion_mask: Tensor<B, 2, Bool>,
    truncated: &[bool],
) -> Result<Tensor<B, 2, Bool>, GrpoLossError> {
    let [batch, seq] = completion_mask.dims();
    check_shape("truncated", &[truncated.len()], &[batch])?;
    let keep: Vec<bool> = truncated.iter().map(|t| !t).collect();
    let keep =
        Tensor::<B, 1, Bool>::from_data(TensorData::new(keep, [batch]), &completion_mask.device());
    Ok(completion_mask.bool_and(keep.unsqueeze_dim::<2>(1).expand([batch, seq])))
}

#[cfg(test)]
mod tests {
    //! Every value against `tests/fixtures/grpo_losses.json` (torchtune / TRL / torch autograd, f32):
    //! within 1e-5 relative, with an absolute floor of 1e-7 for values at or near zero (a masked
    //! gradient, torchtune's policy loss of mean-zero advantages), of the float32 result or of the
    //! same reference code run in float64. Each test also runs a wrong setting and requires it to
    //! miss the fixture, so the test can fail.
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use serde_json::Value;
    use std::sync::OnceLock;

    type AB = Autodiff<Flex>;

    fn fixture() -> &'static Value {
        static FIXTURE: OnceLock<Value> = OnceLock::new();
        FIXTURE.get_or_init(|| {
            serde_json::from_str(include_str!("../../tests/fixtures/grpo_losses.json"))
                .expect("tests/fixtures/grpo_losses.json parses")
        })
    }

    fn case(section: &str, name: &str) -> &'static Value {
        fixture()[section]
            .as_array()
            .and_then(|cases| cases.iter().find(|c| c["name"] == name))
            .unwrap_or_else(|| panic!("no {section} case {name} in the fixture"))
    }

    fn floats(v: &Value) -> Vec<f32> {
        v.as_array()
            .expect("an array")
            .iter()
            .map(|x| x.as_f64().map_or(f32::NAN, |x| x as f32))
            .collect()
    }

    fn bools(v: &Value) -> Vec<bool> {
        v.as_array()
            .expect("an array")
            .iter()
            .map(|x| x.as_bool().expect("a bool"))
            .collect()
    }

    fn num(v: &Value) -> f64 {
        v.as_f64().expect("a number")
    }

    fn dims(c: &Value) -> [usize; 2] {
        [num(&c["batch"]) as usize, num(&c["seq"]) as usize]
    }

    fn t2(values: Vec<f32>, shape: [usize; 2]) -> Tensor<AB, 2> {
        Tensor::from_data(TensorData::new(values, shape), &Default::default())
    }

    fn t1(values: Vec<f32>) -> Tensor<AB, 1> {
        let n = values.len();
        Tensor::from_data(TensorData::new(values, [n]), &Default::default())
    }

    fn mask(values: Vec<bool>, shape: [usize; 2]) -> Tensor<AB, 2, Bool> {
        Tensor::from_data(TensorData::new(values, shape), &Default::default())
    }

    fn close(got: f32, want: f32) -> bool {
        (got.is_nan() && want.is_nan()) || (got - want).abs() <= 1e-5 * want.abs() + 1e-7
    }

    fn compare(what: &str, got: &[f32], want: &[f32]) -> Result<(), String> {
        compare_either(what, got, want, want)
    }

    /// Each value within tolerance of the reference's float32 result or of the same reference code
    /// run in float64 (`expected.f64`): they differ beyond 1e-5 only where float32 itself loses
    /// digits (GRPOCompletionLoss's difference of two batch sums).
    fn compare_either(what: &str, got: &[f32], want: &[f32], want64: &[f32]) -> Result<(), String> {
        if got.len() != want.len() || got.len() != want64.len() {
            return Err(format!(
                "{what}: {} values, expected {}",
                got.len(),
                want.len()
            ));
        }
        let bad: Vec<String> = got
            .iter()
            .zip(want.iter().zip(want64))
            .enumerate()
            .filter(|(_, (g, (w, w64)))| !close(**g, **w) && !close(**g, **w64))
            .map(|(i, (g, (w, w64)))| format!("[{i}] {g} vs {w} (f64 {w64})"))
            .collect();
        if bad.is_empty() {
            Ok(())
        } else {
            Err(format!("{what}: {}", bad.join(", ")))
        }
    }

    fn value<const D: usize>(t: Tensor<AB, D>) -> Vec<f32> {
        t.into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("f32 data")
    }

    fn errors(results: Vec<Result<(), String>>) -> Result<(), String> {
        let errs: Vec<String> = results.into_iter().filter_map(Result::err).collect();
        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs.join("; "))
        }
    }

    // ---------------------------------------------------------------- torchtune

    fn torchtune_settings(c: &Value) -> TorchtuneGrpoSettings {
        TorchtuneGrpoSettings {
            loss: TorchtuneGrpoLoss::from_component(c["class"].as_str().expect("class"))
                .expect("a known class"),
            epsilon: num(&c["epsilon"]),
            kl_coeff: num(&c["kl_coeff"]),
        }
    }

    /// Runs a torchtune case with `settings` (and `pi_old` replaced when given); Err lists every
    /// value that misses the fixture.
    fn run_torchtune(
        c: &Value,
        settings: TorchtuneGrpoSettings,
        pi_old: Option<Vec<f32>>,
    ) -> Result<(), String> {
        let shape = dims(c);
        let pi = t2(floats(&c["pi_logprobs"]), shape).require_grad();
        let out = torchtune_grpo_loss(
            settings,
            t2(
                pi_old.unwrap_or_else(|| floats(&c["pi_old_logprobs"])),
                shape,
            ),
            pi.clone(),
            t2(floats(&c["ref_logprobs"]), shape),
            t1(floats(&c["advantages"])),
            mask(bools(&c["padding_masks"]), shape),
        )
        .map_err(|e| e.to_string())?;
        let e = &c["expected"];
        let scalars = [
            ("policy_loss", value(out.policy_loss)),
            ("kl_loss", value(out.kl_loss)),
            ("ratios", value(out.ratios)),
            ("clipfrac", value(out.clipfrac)),
        ];
        let one = |k: &str| (vec![num(&e[k]) as f32], vec![num(&e["f64"][k]) as f32]);
        let mut results: Vec<Result<(), String>> = scalars
            .into_iter()
            .map(|(k, v)| {
                let (w, w64) = one(k);
                compare_either(k, &v, &w, &w64)
            })
            .collect();
        let (w, w64) = one("loss");
        results.push(compare_either("loss", &value(out.loss.clone()), &w, &w64));
        let grads = out.loss.backward();
        let grad = pi.grad(&grads).map(|g| {
            g.into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("f32 data")
        });
        results.push(compare_either(
            "grad_pi_logprobs",
            &grad.unwrap_or_default(),
            &floats(&e["grad_pi_logprobs"]),
            &floats(&e["f64"]["grad_pi_logprobs"]),
        ));
        errors(results)
    }

    #[test]
    fn grpo_loss_matches_torchtune_values_and_gradient() {
        for name in ["GRPOLoss_eps0.1_kl0.1", "GRPOLoss_eps0.2_kl0.04"] {
            let c = case("torchtune", name);
            let s = torchtune_settings(c);
            assert_eq!(s.loss, TorchtuneGrpoLoss::Token);
            run_torchtune(c, s, None).unwrap_or_else(|e| panic!("{name}: {e}"));
            let wrong_eps = TorchtuneGrpoSettings {
                epsilon: s.epsilon + 0.1,
                ..s
            };
            assert!(
                run_torchtune(c, wrong_eps, None).is_err(),
                "{name}: epsilon unchecked"
            );
            let wrong_kl = TorchtuneGrpoSettings {
                kl_coeff: s.kl_coeff * 2.0,
                ..s
            };
            assert!(
                run_torchtune(c, wrong_kl, None).is_err(),
                "{name}: kl_coeff unchecked"
            );
        }
    }

    #[test]
    fn grpo_loss_ratio_stat_counts_padding_positions() {
        // torchtune logs ratios.mean() over every position; padding (1.0 in all three inputs, as its
        // recipe writes) counts as ratio 1. A masked mean would differ.
        let c = case("torchtune", "GRPOLoss_eps0.1_kl0.1");
        run_torchtune(c, torchtune_settings(c), None).expect("matches the fixture");
        let (pi, old, m) = (
            floats(&c["pi_logprobs"]),
            floats(&c["pi_old_logprobs"]),
            bools(&c["padding_masks"]),
        );
        let ratios: Vec<f32> = pi.iter().zip(&old).map(|(p, o)| (p - o).exp()).collect();
        let all = ratios.iter().sum::<f32>() / ratios.len() as f32;
        let active: Vec<f32> = ratios
            .iter()
            .zip(&m)
            .filter(|(_, m)| **m)
            .map(|(r, _)| *r)
            .collect();
        let masked = active.iter().sum::<f32>() / active.len() as f32;
        let want = num(&c["expected"]["ratios"]) as f32;
        assert!((all - want).abs() < 1e-5, "unmasked mean {all} vs {want}");
        assert!(
            (masked - want).abs() > 1e-3,
            "the fixture cannot tell masked from unmasked"
        );
    }

    #[test]
    fn completion_loss_uses_one_batch_wide_ratio() {
        for name in [
            "GRPOCompletionLoss_eps0.1_kl0.1",
            "GRPOCompletionLoss_eps0.2_kl0.04",
        ] {
            let c = case("torchtune", name);
            let s = torchtune_settings(c);
            assert_eq!(s.loss, TorchtuneGrpoLoss::Completion);
            run_torchtune(c, s, None).unwrap_or_else(|e| panic!("{name}: {e}"));
            // Per-token ratios (GRPOLoss) on the same inputs miss it.
            let per_token = TorchtuneGrpoSettings {
                loss: TorchtuneGrpoLoss::Token,
                ..s
            };
            assert!(
                run_torchtune(c, per_token, None).is_err(),
                "{name}: class unchecked"
            );
        }
    }

    #[test]
    fn completion_loss_clips_the_batch_ratio_at_epsilon() {
        // Batch ratio 0.196: clipped at 0.9 with epsilon 0.1; a wider epsilon changes the loss.
        let c = case("torchtune", "GRPOCompletionLoss_eps0.1_kl0.1");
        assert!(num(&c["expected"]["clipfrac"]) > 0.0);
        let s = torchtune_settings(c);
        run_torchtune(c, s, None).expect("matches the fixture");
        let wide = TorchtuneGrpoSettings { epsilon: 0.9, ..s };
        assert!(run_torchtune(c, wide, None).is_err());
    }

    #[test]
    fn simple_loss_ignores_the_old_policy_and_reports_constant_ratio_and_clipfrac() {
        for name in [
            "GRPOSimpleLoss_eps0.1_kl0.1",
            "GRPOSimpleLoss_eps0.2_kl0.04",
        ] {
            let c = case("torchtune", name);
            let s = torchtune_settings(c);
            assert_eq!(s.loss, TorchtuneGrpoLoss::Simple);
            run_torchtune(c, s, None).unwrap_or_else(|e| panic!("{name}: {e}"));
            let garbage_old = vec![-7.0; floats(&c["pi_old_logprobs"]).len()];
            run_torchtune(c, s, Some(garbage_old)).unwrap_or_else(|e| panic!("{name}: {e}"));
            let wrong_kl = TorchtuneGrpoSettings {
                kl_coeff: s.kl_coeff + 0.05,
                ..s
            };
            assert!(
                run_torchtune(c, wrong_kl, None).is_err(),
                "{name}: kl_coeff unchecked"
            );
            let clipped = TorchtuneGrpoSettings {
                loss: TorchtuneGrpoLoss::Token,
                ..s
            };
            assert!(
                run_torchtune(c, clipped, None).is_err(),
                "{name}: class unchecked"
            );
        }
    }

    #[test]
    fn torchtune_components_name_their_classes() {
        for (component, loss) in [
            ("torchtune.dev.grpo.loss.GRPOLoss", TorchtuneGrpoLoss::Token),
            (
                "torchtune.dev.grpo.loss.GRPOCompletionLoss",
                TorchtuneGrpoLoss::Completion,
            ),
            (
                "torchtune.dev.grpo.loss.GRPOSimpleLoss",
                TorchtuneGrpoLoss::Simple,
            ),
        ] {
            assert_eq!(TorchtuneGrpoLoss::from_component(component), Some(loss));
            assert!(component.ends_with(loss.class_name()));
        }
        assert_eq!(
            TorchtuneGrpoLoss::from_component("torchtune.rlhf.loss.PPOLoss"),
            None
        );
    }

    // ---------------------------------------------------------------- TRL

    fn trl_settings(c: &Value) -> (TrlGrpoSettings, TrlAccumulation) {
        let s = &c["settings"];
        let epsilon = num(&s["epsilon"]);
        let settings = TrlGrpoSettings {
            loss_type: TrlLossType::parse(s["loss_type"].as_str().expect("loss_type"))
                .expect("a known loss_type"),
            importance_sampling_level: match s["importance_sampling_level"].as_str() {
                Some("sequence") => ImportanceSamplingLevel::Sequence,
                _ => ImportanceSamplingLevel::Token,
            },
            epsilon_low: epsilon,
            epsilon_high: s["epsilon_high"].as_f64().unwrap_or(epsilon),
            beta: num(&s["beta"]),
            use_bias_correction_kl: s["use_bias_correction_kl"].as_bool().expect("a bool"),
            max_completion_length: num(&s["max_completion_length"]) as usize,
        };
        let accumulation = TrlAccumulation {
            gradient_accumulation_steps: num(&s["gradient_accumulation_steps"]) as usize,
            steps_per_generation: num(&s["steps_per_generation"]) as usize,
            num_processes: 1,
            num_items_in_batch: num(&c["num_items_in_batch"]),
        };
        (settings, accumulation)
    }

    /// What to change in a TRL case's inputs.
    #[derive(Default)]
    struct TrlInputsChange {
        old: Option<Option<Vec<f32>>>,
        no_reference: bool,
        completion_mask: Option<Vec<bool>>,
    }

    fn run_trl(
        c: &Value,
        settings: TrlGrpoSettings,
        accumulation: TrlAccumulation,
        change: TrlInputsChange,
    ) -> Result<(), String> {
        let shape = dims(c);
        let pi = t2(floats(&c["per_token_logps"]), shape).require_grad();
        let old = change.old.unwrap_or_else(|| {
            c["old_per_token_logps"]
                .as_array()
                .map(|_| floats(&c["old_per_token_logps"]))
        });
        let out = trl_grpo_loss(
            settings,
            accumulation,
            TrlGrpoInputs {
                per_token_logps: pi.clone(),
                old_per_token_logps: old.map(|o| t2(o, shape)),
                ref_per_token_logps: (!change.no_reference)
                    .then(|| t2(floats(&c["ref_per_token_logps"]), shape)),
                advantages: t1(floats(&c["advantages"])),
                completion_mask: mask(
                    change
                        .completion_mask
                        .unwrap_or_else(|| bools(&c["completion_mask"])),
                    shape,
                ),
            },
        )
        .map_err(|e| e.to_string())?;
        let e = &c["expected"];
        let expected_metrics = e["metrics"].as_object().expect("metrics");
        let entries = out.metrics.entries();
        let mut results = vec![compare_either(
            "loss",
            &value(out.loss.clone()),
            &[num(&e["loss"]) as f32],
            &[num(&e["f64"]["loss"]) as f32],
        )];
        let got_keys: Vec<&str> = entries.iter().map(|(k, _)| *k).collect();
        let want_keys: Vec<&str> = expected_metrics.keys().map(String::as_str).collect();
        let mut sorted = (got_keys.clone(), want_keys.clone());
        sorted.0.sort_unstable();
        sorted.1.sort_unstable();
        if sorted.0 != sorted.1 {
            results.push(Err(format!("metrics {got_keys:?}, expected {want_keys:?}")));
        }
        let metric = |m: &Value, k: &str| {
            m.get(k)
                .map_or(f32::NAN, |w| w.as_f64().map_or(f32::NAN, |w| w as f32))
        };
        for (k, v) in entries {
            let (w, w64) = (metric(&e["metrics"], k), metric(&e["f64"]["metrics"], k));
            results.push(compare_either(k, &[v], &[w], &[w64]));
        }
        let grads = out.loss.backward();
        let grad = pi.grad(&grads).map(|g| {
            g.into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("f32 data")
        });
        results.push(compare_either(
            "grad_per_token_logps",
            &grad.unwrap_or_default(),
            &floats(&e["grad_per_token_logps"]),
            &floats(&e["f64"]["grad_per_token_logps"]),
        ));
        errors(results)
    }

    fn trl_matches(name: &str) -> (&'static Value, TrlGrpoSettings, TrlAccumulation) {
        let c = case("trl", name);
        let (s, a) = trl_settings(c);
        run_trl(c, s, a, TrlInputsChange::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
        (c, s, a)
    }

    #[test]
    fn trl_grpo_averages_each_completion_over_its_own_length() {
        for name in ["grpo_token_beta0.04", "grpo_token_beta0"] {
            let (c, s, a) = trl_matches(name);
            let bnpo = TrlGrpoSettings {
                loss_type: TrlLossType::Bnpo,
                ..s
            };
            assert!(
                run_trl(c, bnpo, a, TrlInputsChange::default()).is_err(),
                "{name}"
            );
        }
    }

    #[test]
    fn trl_kl_is_the_k3_estimate_times_the_ratio_by_default() {
        for name in [
            "grpo_token_beta0.04",
            "grpo_token_beta0.04_no_bias_correction",
        ] {
            let (c, s, a) = trl_matches(name);
            let flipped = TrlGrpoSettings {
                use_bias_correction_kl: !s.use_bias_correction_kl,
                ..s
            };
            assert!(
                run_trl(c, flipped, a, TrlInputsChange::default()).is_err(),
                "{name}"
            );
            let other_beta = TrlGrpoSettings { beta: 0.08, ..s };
            assert!(
                run_trl(c, other_beta, a, TrlInputsChange::default()).is_err(),
                "{name}"
            );
        }
    }

    #[test]
    fn trl_without_beta_needs_no_reference_and_logs_no_kl() {
        let (c, s, a) = trl_matches("grpo_token_beta0");
        let change = TrlInputsChange {
            no_reference: true,
            ..Default::default()
        };
        run_trl(c, s, a, change).expect("beta 0 runs without a reference");
    }

    #[test]
    fn beta_without_reference_is_refused() {
        let c = case("trl", "grpo_token_beta0.04");
        let (s, a) = trl_settings(c);
        let change = TrlInputsChange {
            no_reference: true,
            ..Default::default()
        };
        let err = run_trl(c, s, a, change).expect_err("refused");
        assert!(err.contains("no reference log-probabilities"), "{err}");
    }

    #[test]
    fn trl_without_old_logprobs_is_on_policy() {
        let (c, s, a) = trl_matches("grpo_on_policy");
        assert!(c["old_per_token_logps"].is_null());
        let stale = TrlInputsChange {
            old: Some(Some(floats(&c["ref_per_token_logps"]))),
            ..Default::default()
        };
        assert!(run_trl(c, s, a, stale).is_err());
    }

    #[test]
    fn trl_bnpo_averages_over_the_batch_tokens() {
        let (c, s, a) = trl_matches("bnpo_beta0.04");
        let grpo = TrlGrpoSettings {
            loss_type: TrlLossType::Grpo,
            ..s
        };
        assert!(run_trl(c, grpo, a, TrlInputsChange::default()).is_err());
    }

    #[test]
    fn trl_dr_grpo_divides_by_batch_times_max_completion_length() {
        let (c, s, a) = trl_matches("dr_grpo_max_len_12");
        let shorter = TrlGrpoSettings {
            max_completion_length: 9,
            ..s
        };
        assert!(run_trl(c, shorter, a, TrlInputsChange::default()).is_err());
    }

    #[test]
    fn dapo_clips_high_ratios_at_epsilon_high() {
        let (c, s, a) = trl_matches("dapo_eps_high_0.28");
        assert!(s.epsilon_high > s.epsilon_low);
        let symmetric = TrlGrpoSettings {
            epsilon_high: s.epsilon_low,
            ..s
        };
        assert!(run_trl(c, symmetric, a, TrlInputsChange::default()).is_err());
    }

    #[test]
    fn dapo_divides_by_the_generation_batch_tokens() {
        let (c, s, a) = trl_matches("dapo_accumulated");
        let local = TrlAccumulation {
            num_items_in_batch: a.num_items_in_batch / 2.0,
            ..a
        };
        assert!(run_trl(c, s, local, TrlInputsChange::default()).is_err());
        let one_step = TrlAccumulation {
            steps_per_generation: 1,
            ..a
        };
        assert!(run_trl(c, s, one_step, TrlInputsChange::default()).is_err());
    }

    #[test]
    fn trl_grpo_divides_by_gradient_accumulation_steps() {
        let (c, s, a) = trl_matches("grpo_accumulated");
        let no_accumulation = TrlAccumulation {
            gradient_accumulation_steps: 1,
            ..a
        };
        assert!(run_trl(c, s, no_accumulation, TrlInputsChange::default()).is_err());
    }

    #[test]
    fn gspo_clips_one_ratio_per_sequence() {
        for name in ["gspo_sequence_beta0.04", "gspo_sequence_eps0.05"] {
            let (c, s, a) = trl_matches(name);
            let per_token = TrlGrpoSettings {
                importance_sampling_level: ImportanceSamplingLevel::Token,
                ..s
            };
            assert!(
                run_trl(c, per_token, a, TrlInputsChange::default()).is_err(),
                "{name}"
            );
        }
    }

    #[test]
    fn truncated_completions_leave_the_loss() {
        let t = &fixture()["trl_mask_truncated_completions"];
        let completions: Vec<Vec<u32>> = t["completion_ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|row| floats(row).iter().map(|&x| x as u32).collect())
            .collect();
        let eos: Vec<u32> = floats(&t["eos_token_ids"])
            .iter()
            .map(|&x| x as u32)
            .collect();
        let pad = num(&t["pad_token_id"]) as u32;
        let truncated = truncated_completions(&completions, &eos, pad).expect("non-empty");
        assert_eq!(truncated, bools(&t["expected_is_truncated"]));
        let full = bools(&t["completion_mask"]);
        let rows = completions.len();
        let shape = [rows, full.len() / rows];
        let masked = mask_truncated_completions(mask(full.clone(), shape), &truncated)
            .expect("one flag per row");
        let masked: Vec<bool> = masked.into_data().into_vec::<bool>().expect("bool data");
        assert_eq!(masked, bools(&t["expected_completion_mask"]));

        for name in ["grpo_mask_truncated", "dapo_mask_truncated"] {
            let (c, s, a) = trl_matches(name);
            assert_eq!(bools(&c["completion_mask"]), masked);
            let unmasked = TrlInputsChange {
                completion_mask: Some(full.clone()),
                ..Default::default()
            };
            assert!(run_trl(c, s, a, unmasked).is_err(), "{name}");
        }
        assert_eq!(
            truncated_completions(&[vec![1u32], vec![]], &eos, pad),
            Err(GrpoLossError::EmptyCompletion { row: 1 })
        );
    }

    #[test]
    fn every_trl_case_matches() {
        let cases = fixture()["trl"].as_array().expect("trl cases");
        assert!(cases.len() >= 10);
        for c in cases {
            let name = c["name"].as_str().expect("name");
            trl_matches(name);
        }
    }

    #[test]
    fn shapes_are_checked() {
        let shape = [2, 3];
        let err = torchtune_grpo_loss(
            TorchtuneGrpoSettings {
                loss: TorchtuneGrpoLoss::Simple,
                epsilon: 0.1,
                kl_coeff: 0.1,
            },
            t2(vec![0.0; 6], shape),
            t2(vec![0.0; 6], shape),
            t2(vec![0.0; 4], [2, 2]),
            t1(vec![0.0; 2]),
            mask(vec![true; 6], shape),
        )
        .err();
        assert!(
            matches!(
                err,
                Some(GrpoLossError::Shape {
                    what: "ref_logprobs",
                    ..
                })
            ),
            "{err:?}"
        );
        let err = trl_grpo_loss(
            trl_settings(case("trl", "grpo_token_beta0")).0,
            TrlAccumulation::single(6.0),
            TrlGrpoInputs {
                per_token_logps: t2(vec![0.0; 6], shape),
                old_per_token_logps: None,
                ref_per_token_logps: None,
                advantages: t1(vec![0.0; 3]),
                completion_mask: mask(vec![true; 6], shape),
            },
        )
        .err();
        assert!(
            matches!(
                err,
                Some(GrpoLossError::Shape {
                    what: "advantages",
                    ..
                })
            ),
            "{err:?}"
        );
    }

    // ---------------------------------------------------------------- advantages

    fn rewards(c: &Value) -> Vec<f32> {
        floats(&c["rewards"])
    }

    fn advantages_of(c: &Value, scale: ScaleRewards) -> GroupAdvantages {
        group_advantages(&rewards(c), num(&c["group_size"]) as usize, scale).expect("groups")
    }

    #[test]
    fn advantages_match_torchtune_recipe() {
        let mut checked = 0;
        for c in fixture()["advantages"].as_array().expect("cases") {
            if c.get("torchtune").is_none() {
                continue;
            }
            let got = advantages_of(c, ScaleRewards::Group).advantages;
            compare("torchtune advantages", &got, &floats(&c["torchtune"])).expect("group scale");
            let unscaled = advantages_of(c, ScaleRewards::None).advantages;
            assert!(compare("", &unscaled, &floats(&c["torchtune"])).is_err());
            checked += 1;
        }
        assert!(checked >= 2);
    }

    #[test]
    fn trl_scale_rewards_group_batch_none() {
        for c in fixture()["advantages"].as_array().expect("cases") {
            for (key, scale) in [
                ("trl_group", ScaleRewards::Group),
                ("trl_batch", ScaleRewards::Batch),
                ("trl_none", ScaleRewards::None),
            ] {
                let got = advantages_of(c, scale);
                let want = &c[key];
                let what = format!("{} {key}", c["name"]);
                compare(&what, &got.advantages, &floats(&want["advantages"]))
                    .unwrap_or_else(|e| panic!("{e}"));
                compare(
                    &what,
                    &[got.frac_reward_zero_std],
                    &[num(&want["frac_reward_zero_std"]) as f32],
                )
                .unwrap_or_else(|e| panic!("{e}"));
            }
        }
        let c = case("advantages", "random_groups_of_4");
        let swapped = advantages_of(c, ScaleRewards::Batch).advantages;
        assert!(compare("", &swapped, &floats(&c["trl_group"]["advantages"])).is_err());
        for (name, scale) in [
            ("group", ScaleRewards::Group),
            ("batch", ScaleRewards::Batch),
            ("none", ScaleRewards::None),
        ] {
            assert_eq!(ScaleRewards::parse(name), Some(scale));
        }
    }

    #[test]
    fn equal_reward_groups_get_zero_advantage_and_count_as_zero_std() {
        let c = case("advantages", "random_groups_of_4");
        let got = advantages_of(c, ScaleRewards::Group);
        assert_eq!(&got.advantages[4..8], &[0.0; 4]);
        assert!((got.frac_reward_zero_std - 1.0 / 3.0).abs() < 1e-7);
    }

    #[test]
    fn unscorable_completions_get_zero_advantage() {
        let c = case("advantages", "unscorable_completion");
        assert!(rewards(c)[1].is_nan());
        for scale in [ScaleRewards::Group, ScaleRewards::Batch, ScaleRewards::None] {
            assert_eq!(advantages_of(c, scale).advantages[1], 0.0);
        }
        let single = case("advantages", "single_generation");
        assert_eq!(
            advantages_of(single, ScaleRewards::Group).advantages,
            vec![0.0; 3]
        );
    }

    #[test]
    fn rewards_must_split_into_groups() {
        assert_eq!(
            group_advantages(&[1.0, 2.0, 3.0], 2, ScaleRewards::Group),
            Err(GrpoLossError::Groups {
                rewards: 3,
                group_size: 2
            })
        );
        assert!(group_advantages(&[1.0], 0, ScaleRewards::Group).is_err());
    }
}
