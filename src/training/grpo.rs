//! GRPO's step (torchtune's `dev/grpo_full_finetune_distributed`, TRL's `GRPOTrainer`): for each
//! batch of prompts, sample `grpo_samples` completions per prompt with the policy, every
//! prompt's completions decoding together as torchtune's and TRL's `generate` do
//! ([`crate::generation::sample_groups`]), score them with the reward functions, normalise the
//! rewards within each prompt's group into advantages, score the completions' tokens with the
//! frozen reference (for the KL penalty) and, with several optimisation passes, with the policy
//! as it was (the old policy); then `ppo_epochs` optimizer updates of the trainer core on those
//! rollouts, each one forward and backward pass of the policy through the GRPO loss.
//!
//! The rollouts are this rank's: each rank samples from its share of the prompts and trains on
//! its own completions, and the trainer core sums the gradients over the ranks as for any loss.
//! A completion's sampling seed is a function of the run's seed, the step and the prompt's index
//! in the dataset, never of the rank, so W workers sample what one device samples from the same
//! global batch, and a resumed run samples what the uninterrupted run did.
//!
//! Where tune differs from torchtune, and why:
//! - each prompt is computed once, its completions packed after it and attending to it
//!   ([`super::rollout_pack`]), where torchtune and TRL run a left-padded row of prompt and
//!   completion per completion: a causal model gives the same log-probabilities either way;
//! - with one update per batch (`ppo_epochs: 1`) the old policy's log-probabilities are the
//!   policy's own, detached, as TRL does (`old_per_token_logps = per_token_logps.detach()`):
//!   they are the same weights, so torchtune's extra forward pass computes the same numbers;
//! - the schedule runs over every update (`ppo_epochs` per batch); torchtune's counts batches
//!   but steps once per update, so its schedule ends early when `ppo_epochs` > 1.

use crate::training::metrics::MetricName;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, Tensor, TensorData};

use super::activation_checkpointing::{self, Checkpointing};
use super::error::{RolloutError, TrainError};
use super::grpo_loss::{
    GrpoLossError, GrpoObjective, ImportanceSamplingLevel, ScaleRewards, TorchtuneGrpoSettings,
    TrlAccumulation, TrlGrpoInputs, TrlGrpoSettings, group_advantages, torchtune_grpo_loss,
    trl_grpo_loss,
};
use super::load_balancing;
use super::loss::{next_token_targets, target_log_probs};
use super::loss_step::{EvalOutput, LossStep, StepInfo, StepOutput};
use super::rollout_pack::RolloutInput;
use super::rollouts::{RolloutRow, Rollouts, collate_rollouts};

use super::epoch_steps::EpochSteps;
use super::step_done::StepDone;
use super::trainer::Trainer;
use crate::checkpoint::HostTensor;
use crate::data::{Batch, DataLoader, PromptDataset, PromptSample};
use crate::distributed::{World, sync};
use crate::generation::{GroupPrompt, GroupSampling, check_prompt, sample_groups};
use crate::models::CausalLm;
use crate::modules::ForwardMode;
use crate::rewards::{Completion, Weighted, score_batch};
use crate::tokenizer::Tokenizer;

/// The policy's forward pass while training (dropout on, adapters on).
pub(crate) const POLICY_MODE: ForwardMode = ForwardMode {
    adapters: true,
    fake_quant: true,
    train: true,
};

/// Scoring without gradients: the old policy (adapters on) and, with `adapters: false`, the
/// LoRA reference.
pub(crate) const SCORING_MODE: ForwardMode = ForwardMode {
    adapters: true,
    fake_quant: true,
    train: false,
};

/// GRPO's settings, resolved from the config.
#[derive(Debug, Clone, PartialEq)]
pub struct GrpoSettings {
    /// Completions per prompt (`grpo_samples`).
    pub samples: usize,
    /// Prompts decoded together, and scored by the old and reference policies in one forward
    /// pass (`forward_batch_size`, as torchtune's).
    pub prompts_per_pass: usize,
    /// Lengths, sampling and stop tokens of the completions.
    pub sampling: GroupSampling,
    /// Optimizer updates per batch of rollouts.
    pub ppo_epochs: usize,
    /// Stop after this many batches (`num_steps`).
    pub num_steps: Option<usize>,
    pub save_every_n_epochs: usize,
    pub loss: GrpoObjective,
    pub scale_rewards: ScaleRewards,
    /// Completions that hit `max_generated_tokens` leave the loss (TRL's).
    pub mask_truncated_completions: bool,
    /// Recompute each policy layer in the backward pass.
    pub activation_checkpointing: Checkpointing,
    /// The token after a row's end (any: it is never attended to nor trained on).
    pub pad_id: u32,
}

/// Where the KL penalty's reference log-probabilities come from.
pub enum GrpoReference<B: AutodiffBackend> {
    /// LoRA: the policy with its adapters disabled.
    AdaptersDisabled,
    /// Full GRPO: a frozen model, off the autodiff graph.
    Frozen(Box<CausalLm<B::InnerBackend>>),
}

/// Per-token log-probabilities `[rows, width]` of each row's completion under `logits`
/// computed only at the completion's positions (`[rows, width, vocab]`,
/// [`Rollouts::window_rows`]; [`OutputHead::logits_at`]): `log_softmax(logits /
/// temperature)` (torchtune's `batched_logits_to_logprobs`) at each completion token, in fp32,
/// with 1.0 where `mask` is false (torchtune writes 1.0 into the padding of every
/// log-probability tensor, so padding counts as ratio 1). The values torchtune picks out of
/// the full logits (`logits[:, context_length - 1 : -1]`), without projecting the prompts'
/// positions onto the vocabulary.
pub fn window_log_probs<B: Backend>(
    logits: Tensor<B, 3>,
    rollouts: &Rollouts,
    temperature: f64,
) -> Tensor<B, 2> {
    let [rows, width, vocab] = logits.dims();
    let device = logits.device();
    let logits = crate::precision::to_f32(logits) / temperature;
    let (all_targets, _) = next_token_targets(&rollouts.batch.labels, rows);
    let targets: Vec<i32> = rollouts
        .window_rows()
        .into_iter()
        .map(|i| all_targets[i])
        .collect();
    let picked =
        target_log_probs(logits.reshape([rows * width, vocab]), &targets).reshape([rows, width]);
    let mask = bool_grid::<B>(&rollouts.mask, rows, width, &device);
    picked.mask_fill(mask.bool_not(), 1.0)
}

/// `model`'s log-probabilities of `rollouts`' completions (`[rows, width]`, as
/// [`window_log_probs`]), projecting only the completion's positions onto the vocabulary and
/// computing each prompt once ([`RolloutInput::of`]): the scoring passes of GRPO (the old
/// policy, the reference) and PPO (the policy, the reference).
pub fn score_completions<B: Backend>(
    model: &CausalLm<B>,
    rollouts: &Rollouts,
    mode: ForwardMode,
    temperature: f64,
) -> Tensor<B, 2> {
    let input = RolloutInput::of(model, rollouts, mode);
    score_input(model, rollouts, &input, mode, temperature)
}

/// [`score_completions`] through `input`, the rollouts laid out for the pass.
pub fn score_input<B: Backend>(
    model: &CausalLm<B>,
    rollouts: &Rollouts,
    input: &RolloutInput,
    mode: ForwardMode,
    temperature: f64,
) -> Tensor<B, 2> {
    let hidden = model.hidden(input.token_batch(), mode, None);
    let logits = model.head().logits_at(hidden, input.logit_rows(), mode);
    window_log_probs(logits, rollouts, temperature)
}

fn bool_grid<B: Backend>(
    values: &[bool],
    rows: usize,
    width: usize,
    device: &B::Device,
) -> Tensor<B, 2, Bool> {
    Tensor::from_data(TensorData::new(values.to_vec(), [rows, width]), device)
}

fn float_grid<B: Backend>(
    values: &[f32],
    rows: usize,
    width: usize,
    device: &B::Device,
) -> Tensor<B, 2> {
    crate::precision::f32_tensor(values.to_vec(), [rows, width], device)
}

/// The GRPO loss step: the policy's log-probabilities of the current rollouts through
/// torchtune's or TRL's GRPO loss. Its gradient contract is the trainer's: it returns this
/// rank's loss with `weight` = rows, whose gradient the trainer takes (or that activation
/// checkpointing computed for `loss * weight`). Every rank has as many rows, so the world's
/// gradient is the mean of the ranks' losses' gradients, as DDP makes TRL's (its dapo
/// normaliser already counts every rank's tokens).
pub struct GrpoLoss {
    pub loss: GrpoObjective,
    pub temperature: f64,
    pub activation_checkpointing: Checkpointing,
    /// The rollouts the next updates train on ([`GrpoSteps`] sets them each step).
    pub rollouts: Option<Rollouts>,
    /// Each prompt computed once for all its completions ([`RolloutInput::of`]); `false` runs
    /// the rows as collated, the definition the tests hold the shared form to.
    pub share_prompts: bool,
}

impl<B: AutodiffBackend> LossStep<B> for GrpoLoss {
    /// `_batch` is the rollouts' rows as collated; the pass runs [`Self::rollouts`] laid out
    /// by [`RolloutInput`].
    fn step(
        &mut self,
        model: &CausalLm<B>,
        _batch: &Batch,
        info: StepInfo,
    ) -> Result<StepOutput<B>, TrainError> {
        let Some(r) = self.rollouts.as_ref() else {
            return Err(TrainError::Rollout(Box::new(RolloutError::Loss(
                GrpoLossError::Setting("a GRPO update ran without rollouts".into()),
            ))));
        };
        let (rows, width) = (r.rows(), r.width);
        let device = model.device();
        let mask = bool_grid::<B>(&r.mask, rows, width, &device);
        let advantages =
            crate::precision::f32_tensor::<B, 1>(r.advantages.clone(), [rows], &device);
        let objective = self.loss;
        let temperature = self.temperature;
        let mut scored = None;
        // TRL's GRPO adds the policy's load-balancing loss of each micro-batch's forward
        // (`loss + router_aux_loss_coef * aux_loss`), over its real tokens.
        let input = if self.share_prompts {
            RolloutInput::of(model, r, POLICY_MODE)
        } else {
            RolloutInput::rows(r)
        };
        let pass = activation_checkpointing::loss_and_grads_at(
            model,
            input.token_batch(),
            POLICY_MODE,
            (self.activation_checkpointing, info.seed),
            rows as f64,
            load_balancing::aux_loss_coef(model),
            (input.logit_rows(), |logits| {
                let pi = window_log_probs(logits, r, temperature);
                let detached = pi.clone().detach();
                let old = r
                    .old_log_probs
                    .as_ref()
                    .map(|old| float_grid(old, rows, width, &device));
                let reference = r
                    .ref_log_probs
                    .as_ref()
                    .map(|reference| float_grid(reference, rows, width, &device));
                let approx_kl = (detached.clone() - old.clone().unwrap_or(detached.clone()))
                    .powi_scalar(2)
                    .mean()
                    * 0.5;
                let out = match objective {
                    GrpoObjective::Torchtune(settings) => torchtune_loss(
                        settings,
                        pi,
                        old,
                        reference,
                        advantages.clone(),
                        mask.clone(),
                    ),
                    GrpoObjective::Trl(settings) => {
                        trl_loss(settings, r, pi, old, reference, &advantages, &mask)
                    }
                };
                let loss = match &out {
                    Ok((loss, _)) => loss.clone(),
                    Err(_) => Tensor::zeros([1], &device),
                };
                scored = Some((out, approx_kl));
                loss
            }),
        );
        let (out, approx_kl) = scored.expect("loss_and_grads calls the loss closure once");
        let (_, mut metrics) =
            out.map_err(|e| TrainError::Rollout(Box::new(RolloutError::Loss(e))))?;
        metrics.push(("approx_policy_kl", approx_kl.inner()));
        metrics.extend(pass.aux_metric());
        Ok(StepOutput {
            loss: pass.loss,
            weight: rows,
            tokens: r.mask.iter().filter(|&&m| m).count(),
            metrics,
            grads: pass.grads,
        })
    }

    /// GRPO has no validation loss (the config refuses `dataset_val`).
    fn evaluate(
        &mut self,
        _model: &CausalLm<B::InnerBackend>,
        _batch: &Batch,
        _info: StepInfo,
    ) -> Result<EvalOutput, TrainError> {
        Err(TrainError::Rollout(Box::new(RolloutError::Loss(
            GrpoLossError::Setting("GRPO has no validation loss".into()),
        ))))
    }
}

/// A loss and its metrics (`[1]` tensors off the autodiff graph).
type ScoredLoss<B> = (
    Tensor<B, 1>,
    Vec<(
        &'static str,
        Tensor<<B as AutodiffBackend>::InnerBackend, 1>,
    )>,
);

/// torchtune's GRPO losses. The padding of every log-probability tensor is 1.0, as
/// torchtune's; without old log-probabilities (one PPO epoch) or a reference (no KL term), the
/// policy's own stand in, detached: ratio 1, KL 0.
fn torchtune_loss<B: AutodiffBackend>(
    settings: TorchtuneGrpoSettings,
    pi: Tensor<B, 2>,
    old: Option<Tensor<B, 2>>,
    reference: Option<Tensor<B, 2>>,
    advantages: Tensor<B, 1>,
    mask: Tensor<B, 2, Bool>,
) -> Result<ScoredLoss<B>, GrpoLossError> {
    let detached = pi.clone().detach();
    let with_reference = reference.is_some();
    let out = torchtune_grpo_loss(
        settings,
        old.unwrap_or_else(|| detached.clone()),
        pi,
        reference.unwrap_or(detached),
        advantages,
        mask,
    )?;
    let mut metrics = vec![
        ("policy_loss", out.policy_loss.inner()),
        ("ratios", out.ratios.inner()),
        ("clipfrac", out.clipfrac.inner()),
    ];
    if with_reference {
        metrics.push(("kl_loss", out.kl_loss.inner()));
    }
    Ok((out.loss, metrics))
}

/// TRL's `GRPOTrainer` loss over this rank's rows: one optimizer step per batch of rollouts
/// (TRL's `steps_per_generation` and `gradient_accumulation_steps` 1), its normalisers over
/// the world's ranks, and TRL's metrics under TRL's names (means over the world's tokens or completions, as TRL's).
fn trl_loss<B: AutodiffBackend>(
    settings: TrlGrpoSettings,
    rollouts: &Rollouts,
    pi: Tensor<B, 2>,
    old: Option<Tensor<B, 2>>,
    reference: Option<Tensor<B, 2>>,
    advantages: &Tensor<B, 1>,
    mask: &Tensor<B, 2, Bool>,
) -> Result<ScoredLoss<B>, GrpoLossError> {
    let device = pi.device();
    let accumulation = TrlAccumulation {
        num_processes: rollouts.ranks,
        ..TrlAccumulation::single(rollouts.world_counted_tokens)
    };
    let out = trl_grpo_loss(
        settings,
        accumulation,
        TrlGrpoInputs {
            per_token_logps: pi,
            old_per_token_logps: old,
            ref_per_token_logps: reference,
            advantages: advantages.clone(),
            completion_mask: mask.clone(),
        },
    )?;
    let m = out.metrics;
    // TRL's token means are over the world's tokens. The trainer averages a metric over the
    // ranks (their rows are equal), so a rank's token mean is weighted by its share of them.
    let counted = rollouts.mask.iter().filter(|&&m| m).count() as f64;
    let token_share =
        (counted * rollouts.ranks as f64 / rollouts.world_counted_tokens.max(1.0)) as f32;
    let clip_share = match settings.importance_sampling_level {
        ImportanceSamplingLevel::Token => token_share,
        // One ratio per completion: means over completions, equal on every rank.
        ImportanceSamplingLevel::Sequence => 1.0,
    };
    let value = |v: f32, share: f32| {
        crate::precision::f32_tensor::<B::InnerBackend, 1>(vec![v * share], [1], &device)
    };
    let mut metrics = vec![
        (
            "clip_ratio/low_mean",
            value(m.clip_ratio_low_mean, clip_share),
        ),
        (
            "clip_ratio/high_mean",
            value(m.clip_ratio_high_mean, clip_share),
        ),
        (
            "clip_ratio/region_mean",
            value(m.clip_ratio_region_mean, clip_share),
        ),
    ];
    if let Some(kl) = m.kl {
        metrics.push(("kl", value(kl, token_share)));
    }
    Ok((out.loss, metrics))
}

/// The steps of a GRPO run: one batch of prompts each, rolled out, then `ppo_epochs` updates.
pub struct GrpoSteps<'a, B: AutodiffBackend> {
    pub settings: GrpoSettings,
    pub prompts: &'a PromptDataset,
    pub loader: &'a DataLoader,
    pub tokenizer: &'a Tokenizer,
    pub rewards: Vec<Weighted>,
    /// `None` when the KL coefficient is 0 (no reference pass).
    pub reference: Option<GrpoReference<B>>,
    pub loss: GrpoLoss,
    /// `rewards/<name>` per reward function, in their order.
    pub reward_metrics: Vec<MetricName>,
    /// This rank's batches of the epoch being run.
    epoch: crate::data::EpochBatches,
}

impl<'a, B: AutodiffBackend> GrpoSteps<'a, B> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        settings: GrpoSettings,
        prompts: &'a PromptDataset,
        loader: &'a DataLoader,
        tokenizer: &'a Tokenizer,
        rewards: Vec<Weighted>,
        reference: Option<GrpoReference<B>>,
    ) -> Self {
        let reward_metrics = rewards
            .iter()
            .map(|w| MetricName::from(format!("rewards/{}", w.function.name())))
            .collect();
        let loss = GrpoLoss {
            loss: settings.loss,
            temperature: settings.sampling.sampling.temperature,
            activation_checkpointing: settings.activation_checkpointing,
            rollouts: None,
            share_prompts: true,
        };
        Self {
            settings,
            prompts,
            loader,
            tokenizer,
            rewards,
            reference,
            loss,
            reward_metrics,
            epoch: Default::default(),
        }
    }

    fn temperature(&self) -> f64 {
        self.loss.temperature
    }

    /// The reward functions and their weights, for the recipe's start-up line.
    pub fn describe_rewards(&self) -> String {
        let parts: Vec<String> = self
            .rewards
            .iter()
            .map(|w| format!("{} x{}", w.function.name(), w.weight))
            .collect();
        format!("rewards {}", parts.join(" + "))
    }

    /// This rank's prompts (dataset indices) of step `index` of `epoch`.
    fn prompts_of(&mut self, world: &World, epoch: usize, index: usize) -> Vec<usize> {
        self.epoch
            .batch(self.loader, epoch, index, world.rank, world.size)
            .to_vec()
    }

    /// Samples, scores and prepares the rollouts of `prompts` (dataset indices): the rollouts
    /// and the step's rollout metrics (this rank's sums, reduced over the world by the caller).
    fn roll_out(
        &mut self,
        trainer: &Trainer<B>,
        prompts: &[usize],
        step_seed: u64,
    ) -> Result<(Rollouts, RolloutStats), TrainError> {
        let policy = trainer.model.valid();
        let world = trainer.world();
        let device = trainer.model.device();
        let g = self.settings.samples;
        let samples: Vec<&PromptSample> = prompts
            .iter()
            .filter_map(|&i| self.prompts.get(i))
            .collect();
        // 1. Sample every prompt's group. With FSDP, every forward pass is collective: every
        // rank decodes until all of them have stopped.
        let started = Instant::now();
        let seeds: Vec<Vec<u64>> = prompts
            .iter()
            .map(|&row| (0..g).map(|k| completion_seed(step_seed, row, k)).collect())
            .collect();
        let batch: Vec<GroupPrompt<'_>> = samples
            .iter()
            .zip(&seeds)
            .map(|(sample, seeds)| GroupPrompt {
                tokens: &sample.tokens,
                seeds,
            })
            .collect();
        let mut agree_error = None;
        let mut agree = |done: bool| {
            if policy.shards.is_none() || !world.is_distributed() {
                return done;
            }
            let votes = sync::all_reduce_scalars::<B::InnerBackend>(
                world,
                &[f64::from(u8::from(!done))],
                &device,
                "the end of a rollout",
            );
            match votes {
                Ok(v) => v[0] < 0.5,
                Err(e) => {
                    agree_error.get_or_insert(e);
                    true
                }
            }
        };
        // torchtune's `generate_trajectory_batched`: `forward_batch_size` prompts (each with its
        // group) decode together, which bounds the KV cache.
        check_prompts(&samples, prompts, policy.args.vocab_size)?;
        let chunk = self.settings.prompts_per_pass.max(1);
        let mut groups = Vec::with_capacity(batch.len());
        for (i, part) in batch.chunks(chunk).enumerate() {
            let sampled = sample_groups(&policy, part, &self.settings.sampling, &mut agree)
                .map_err(|source| {
                    let row = prompts[i * chunk];
                    rollout_error(RolloutError::Generate { row, source })
                })?;
            groups.extend(sampled);
        }
        if let Some(e) = agree_error {
            return Err(e.into());
        }
        let generation_seconds = started.elapsed().as_secs_f64();
        let generated: usize = groups.iter().map(|gr| gr.tokens()).sum();

        // 2. Rewards, on the decoded completions.
        let mut texts = Vec::with_capacity(samples.len() * g);
        for (group, &row) in groups.iter().zip(prompts) {
            for completion in &group.completions {
                let text = self.tokenizer.decode(completion, true).map_err(|e| {
                    rollout_error(RolloutError::Decode {
                        row,
                        message: e.to_string(),
                    })
                })?;
                texts.push(text);
            }
        }
        let completions: Vec<Completion<'_>> = samples
            .iter()
            .enumerate()
            .flat_map(|(p, sample)| {
                let texts = &texts;
                let groups = &groups;
                (0..g).map(move |k| Completion {
                    prompt: &sample.prompt,
                    completion: &texts[p * g + k],
                    completion_tokens: groups[p].completions[k].len(),
                    columns: &sample.columns,
                })
            })
            .collect();
        let step = trainer.state.global_step + 1;
        let scored = score_batch(&mut self.rewards, &completions)
            .map_err(|source| rollout_error(RolloutError::Reward { step, source }))?;
        let totals: Vec<f32> = scored
            .total
            .iter()
            .map(|r| r.map_or(f32::NAN, |r| r as f32))
            .collect();

        // 3. Advantages: within each group, or over the world's whole batch.
        let advantages = if self.settings.scale_rewards == ScaleRewards::Batch
            && world.is_distributed()
        {
            let all = world.all_gather(
                crate::precision::f32_tensor::<B::InnerBackend, 1>(
                    totals.clone(),
                    [totals.len()],
                    &device,
                ),
                "the batch's rewards",
            )?;
            let all = HostTensor::from_tensor(&all).data;
            let mut mine = group_advantages(&all, g, ScaleRewards::Batch).map_err(loss_error)?;
            // This rank's completions: its place in the rank-ordered gather.
            let start = world.rank * totals.len();
            mine.advantages = mine.advantages[start..start + totals.len()].to_vec();
            mine
        } else {
            group_advantages(&totals, g, self.settings.scale_rewards).map_err(loss_error)?
        };

        // 4. The sequences to train on.
        let mut rows = Vec::with_capacity(samples.len() * g);
        for (sample, group) in samples.iter().zip(&groups) {
            for (k, completion) in group.completions.iter().enumerate() {
                rows.push(RolloutRow {
                    prompt: &sample.tokens,
                    completion,
                    counts: !self.settings.mask_truncated_completions || group.stopped[k],
                });
            }
        }
        let mut rollouts = collate_rollouts(&rows, self.settings.pad_id);
        rollouts.advantages = advantages.advantages;
        if world.is_distributed() && matches!(self.settings.loss, GrpoObjective::Trl(_)) {
            rollouts.ranks = world.size;
            rollouts.world_counted_tokens = sync::all_reduce_scalars::<B::InnerBackend>(
                world,
                &[rollouts.world_counted_tokens],
                &device,
                "the batch's counted completion tokens",
            )?[0];
        }

        // 5. The old policy's and the reference's log-probabilities, a few prompts at a time.
        let rows_per_pass = self.settings.prompts_per_pass.max(1) * g;
        if self.settings.ppo_epochs > 1 {
            rollouts.old_log_probs = Some(score(
                &policy,
                &rollouts,
                rows_per_pass,
                SCORING_MODE,
                self.temperature(),
            )?);
        }
        if self.settings.loss.kl_weight() != 0.0 {
            let reference = match &self.reference {
                Some(GrpoReference::Frozen(frozen)) => score(
                    frozen,
                    &rollouts,
                    rows_per_pass,
                    SCORING_MODE,
                    self.temperature(),
                )?,
                Some(GrpoReference::AdaptersDisabled) | None => score(
                    &policy,
                    &rollouts,
                    rows_per_pass,
                    ForwardMode {
                        adapters: false,
                        ..SCORING_MODE
                    },
                    self.temperature(),
                )?,
            };
            rollouts.ref_log_probs = Some(reference);
        }

        let stats = RolloutStats::of(
            &scored,
            &totals,
            &groups,
            advantages.frac_reward_zero_std,
            generated,
            generation_seconds,
        );
        Ok((rollouts, stats))
    }
}

/// Every prompt of a batch is one the model can take; else the error names the first that is
/// not by its dataset row (`rows`, in the order of `samples`).
pub(crate) fn check_prompts(
    samples: &[&PromptSample],
    rows: &[usize],
    vocab: usize,
) -> Result<(), TrainError> {
    for (sample, &row) in samples.iter().zip(rows) {
        check_prompt(&sample.tokens, vocab)
            .map_err(|source| rollout_error(RolloutError::Generate { row, source }))?;
    }
    Ok(())
}

fn rollout_error(e: RolloutError) -> TrainError {
    TrainError::Rollout(Box::new(e))
}

fn loss_error(e: GrpoLossError) -> TrainError {
    rollout_error(RolloutError::Loss(e))
}

/// The seed of step `index` of `epoch` of a run seeded `seed`: the streams a step samples from
/// (the same on every rank, and for a resumed run).
pub(crate) fn step_seed(seed: u64, epoch: usize, index: usize) -> u64 {
    seed.wrapping_add((epoch as u64) << 32)
        .wrapping_add(index as u64)
}

/// The sampling seed of completion `k` of dataset row `row` at the step seeded `step_seed`.
pub(crate) fn completion_seed(step_seed: u64, row: usize, k: usize) -> u64 {
    let key = format!("{step_seed}:{row}:{k}");
    crate::distributed::sync::hash64(key.as_bytes())
}

/// `model`'s completion log-probabilities of every row of `rollouts`, `rows_per_pass` rows at a
/// time, on the host (`[rows * width]`).
fn score<B: Backend>(
    model: &CausalLm<B>,
    rollouts: &Rollouts,
    rows_per_pass: usize,
    mode: ForwardMode,
    temperature: f64,
) -> Result<Vec<f32>, TrainError> {
    let rows = rollouts.rows();
    let mut out = Vec::with_capacity(rows * rollouts.width);
    let mut start = 0;
    while start < rows {
        let end = (start + rows_per_pass).min(rows);
        let part = rollouts.rows_range(start, end);
        let lp = score_completions(model, &part, mode, temperature);
        super::parallel::fsdp::check(model)?;
        out.extend(HostTensor::from_tensor(&lp).data);
        start = end;
    }
    Ok(out)
}

/// A step's rollout figures on this rank, as sums and counts (so the world's means add up).
#[derive(Debug, Clone, PartialEq)]
struct RolloutStats {
    /// Completions, and those some function rewarded.
    completions: f64,
    rewarded: f64,
    reward_sum: f64,
    reward_squares: f64,
    /// Per function: (sum, count) of its rewards.
    per_function: Vec<(f64, f64)>,
    /// Sum of successes, when a function defines them.
    successes: Option<f64>,
    frac_reward_zero_std: f64,
    completion_tokens: f64,
    stopped: f64,
    generated: f64,
    generation_seconds: f64,
}

impl RolloutStats {
    fn of(
        scored: &crate::rewards::BatchRewards,
        totals: &[f32],
        groups: &[crate::generation::SampledGroup],
        frac_reward_zero_std: f32,
        generated: usize,
        generation_seconds: f64,
    ) -> Self {
        let valid: Vec<f64> = totals
            .iter()
            .filter(|r| !r.is_nan())
            .map(|&r| f64::from(r))
            .collect();
        Self {
            completions: totals.len() as f64,
            rewarded: valid.len() as f64,
            reward_sum: valid.iter().sum(),
            reward_squares: valid.iter().map(|r| r * r).sum(),
            per_function: scored
                .per_function
                .iter()
                .map(|(_, s)| {
                    let given: Vec<f64> = s.rewards.iter().flatten().copied().collect();
                    (given.iter().sum(), given.len() as f64)
                })
                .collect(),
            successes: scored.successes.as_ref().map(|s| s.iter().sum()),
            frac_reward_zero_std: f64::from(frac_reward_zero_std),
            completion_tokens: groups.iter().map(|g| g.tokens() as f64).sum(),
            stopped: groups
                .iter()
                .flat_map(|g| &g.stopped)
                .filter(|&&s| s)
                .count() as f64,
            generated: generated as f64,
            generation_seconds,
        }
    }

    /// Flattened for one all-reduce.
    fn to_vec(&self) -> Vec<f64> {
        let mut v = vec![
            self.completions,
            self.rewarded,
            self.reward_sum,
            self.reward_squares,
            self.successes.unwrap_or(0.0),
            self.frac_reward_zero_std,
            self.completion_tokens,
            self.stopped,
            self.generated,
            self.generation_seconds,
        ];
        for (sum, count) in &self.per_function {
            v.extend([*sum, *count]);
        }
        v
    }

    /// The metrics from the world's sums `v` (as [`Self::to_vec`] lays them out) over `ranks`.
    fn metrics(
        v: &[f64],
        ranks: usize,
        has_successes: bool,
        names: &[MetricName],
    ) -> Vec<(MetricName, f64)> {
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        let (completions, rewarded, sum, squares) = (v[0], v[1], v[2], v[3]);
        let mean = ratio(sum, rewarded);
        // Bessel-corrected, as torch's `std`.
        let std = if rewarded > 1.0 {
            ((squares - rewarded * mean * mean) / (rewarded - 1.0))
                .max(0.0)
                .sqrt()
        } else {
            f64::NAN
        };
        let mut m: Vec<(MetricName, f64)> =
            vec![("rewards".into(), mean), ("rewards_std".into(), std)];
        for (i, name) in names.iter().enumerate() {
            m.push((name.clone(), ratio(v[10 + 2 * i], v[11 + 2 * i])));
        }
        if has_successes {
            m.push(("successes".into(), ratio(v[4], completions)));
        }
        m.extend([
            ("frac_reward_zero_std".into(), v[5] / ranks as f64),
            ("response_lengths".into(), ratio(v[6], completions)),
            ("num_stop_tokens".into(), v[7]),
            // Each rank samples at the same time: the world's tokens over one rank's seconds.
            (
                "rollout_tokens_per_second".into(),
                ratio(v[8], v[9] / ranks as f64),
            ),
        ]);
        m
    }
}

impl<B: AutodiffBackend> EpochSteps<B> for GrpoSteps<'_, B> {
    /// This rank's batches of prompts (`gradient_accumulation_steps` is 1 for GRPO), at most
    /// `max_steps_per_epoch`, as for a dataset's batches.
    fn steps_per_epoch(&self, trainer: &Trainer<B>) -> Result<usize, TrainError> {
        trainer.steps_per_epoch(self.loader)
    }

    fn step(
        &mut self,
        trainer: Trainer<B>,
        epoch: usize,
        index: usize,
    ) -> Result<(Trainer<B>, StepDone), TrainError> {
        let world = trainer.world().clone();
        let prompts = self.prompts_of(&world, epoch, index);
        // Seeded by the run and the step, never the rank (see the module's doc).
        let step_seed = step_seed(trainer.settings.seed, epoch, index);
        let (rollouts, stats) = self.roll_out(&trainer, &prompts, step_seed)?;
        let has_successes = stats.successes.is_some();
        let sums = sync::all_reduce_scalars::<B::InnerBackend>(
            &world,
            &stats.to_vec(),
            &trainer.model.device(),
            "the rollout metrics",
        )?;
        let rollout_metrics =
            RolloutStats::metrics(&sums, world.size, has_successes, &self.reward_metrics);
        let batch = rollouts.batch.clone();
        self.loss.rollouts = Some(rollouts);
        let mut trainer = trainer;
        let mut updates: Vec<StepDone> = Vec::with_capacity(self.settings.ppo_epochs);
        for _ in 0..self.settings.ppo_epochs {
            let done;
            (trainer, done) = trainer.train_step(std::slice::from_ref(&batch), &mut self.loss)?;
            updates.push(done);
        }
        self.loss.rollouts = None;
        let mut done = combine(updates);
        done.metrics.extend(rollout_metrics);
        Ok((trainer, done))
    }

    fn updates_per_step(&self) -> usize {
        self.settings.ppo_epochs
    }

    fn max_steps(&self) -> Option<usize> {
        self.settings.num_steps
    }

    fn save_every_n_epochs(&self) -> usize {
        self.settings.save_every_n_epochs
    }
}

/// One step's updates as one [`StepDone`]: losses and metrics averaged over the updates (as
/// torchtune logs its GRPO stats), the last update's rate and gradient norm, tokens summed, a
/// stop signal from any (acted on after the whole step, so a checkpoint never splits one).
pub(crate) fn combine(updates: Vec<StepDone>) -> StepDone {
    let n = updates.len().max(1) as f64;
    let mut metrics: Vec<(MetricName, f64)> = Vec::new();
    for u in &updates {
        for (k, v) in &u.metrics {
            match metrics.iter_mut().find(|(name, _)| name == k) {
                Some(entry) => entry.1 += v / n,
                None => metrics.push((k.clone(), v / n)),
            }
        }
    }
    let loss = updates.iter().map(|u| u.loss).sum::<f64>() / n;
    let tokens = updates.iter().map(|u| u.tokens).sum();
    let stop = updates.iter().find_map(|u| u.stop);
    // The step's peaks are the largest of its updates'.
    let offloaded_activation_bytes = updates
        .iter()
        .map(|u| u.offloaded_activation_bytes)
        .max()
        .unwrap_or(0);
    let device_memory = updates
        .iter()
        .filter_map(|u| u.device_memory)
        .reduce(crate::device::DeviceMemory::max);
    let mut last = updates.into_iter().last().unwrap_or_else(|| StepDone {
        loss: f64::NAN,
        lr: 0.0,
        grad_norm: None,
        tokens: 0,
        metrics: Vec::new(),
        stop: None,
        times: None,
        gradient_bytes: Default::default(),
        offloaded_activation_bytes: 0,
        device_memory: None,
    });
    last.loss = loss;
    last.tokens = tokens;
    last.offloaded_activation_bytes = offloaded_activation_bytes;
    last.device_memory = device_memory;
    last.metrics = metrics;
    last.stop = stop;
    last
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Int;

    /// A prompt the model cannot take stops the rollout naming its dataset row and why.
    #[test]
    fn a_prompt_outside_the_vocabulary_is_named_by_its_dataset_row() {
        let sample = |tokens: Vec<u32>| PromptSample {
            tokens,
            prompt: String::new(),
            columns: Default::default(),
        };
        let (good, bad, empty) = (sample(vec![1, 2]), sample(vec![3, 99]), sample(vec![]));
        assert!(check_prompts(&[&good, &good], &[4, 7], 10).is_ok());
        let e = check_prompts(&[&good, &bad, &empty], &[4, 7, 9], 10).unwrap_err();
        let message = e.to_string();
        assert!(
            message.contains("dataset row 7") && message.contains("token id 99"),
            "{message}"
        );
        let e = check_prompts(&[&good, &empty], &[4, 9], 10).unwrap_err();
        assert!(e.to_string().contains("dataset row 9"), "{e}");
    }

    /// The definition [`window_log_probs`] is held to: each row's completion log-probabilities
    /// picked out of the full logits `[rows, seq, vocab]`, as torchtune picks them.
    fn completion_log_probs<B: Backend>(
        logits: Tensor<B, 3>,
        rollouts: &Rollouts,
        temperature: f64,
    ) -> Tensor<B, 2> {
        let [rows, seq, vocab] = logits.dims();
        let device = logits.device();
        let logits = crate::precision::to_f32(logits) / temperature;
        let (targets, _) = next_token_targets(&rollouts.batch.labels, rows);
        let all =
            target_log_probs(logits.reshape([rows * seq, vocab]), &targets).reshape([rows, seq]);
        let width = rollouts.width;
        let index = Tensor::<B, 2, Int>::from_data(
            TensorData::new(rollouts.window_indices(), [rows, width]),
            &device,
        );
        let picked = all.gather(1, index);
        let mask = bool_grid::<B>(&rollouts.mask, rows, width, &device);
        picked.mask_fill(mask.bool_not(), 1.0)
    }

    /// Log-probabilities of logits computed only at each row's completion positions (the
    /// update's and the scoring passes') equal those picked out of the full logits.
    #[test]
    fn completion_window_logits_give_the_full_logits_log_probs() {
        use burn::backend::Flex;
        let r = two_rollouts(true);
        let (n, seq, vocab, width) = (2, r.batch.seq_len, 11, r.width);
        let values: Vec<f32> = (0..n * seq * vocab)
            .map(|i| ((i * 37 % 101) as f32 / 10.0) - 5.0)
            .collect();
        let device = Default::default();
        let full = Tensor::<Flex, 3>::from_data(TensorData::new(values, [n, seq, vocab]), &device);
        let want = completion_log_probs(full.clone(), &r, 0.7);
        let index = crate::models::decoder::row_index(&r.window_rows(), &device);
        let window = full
            .reshape([n * seq, vocab])
            .select(0, index)
            .reshape([n, width, vocab]);
        let got = window_log_probs(window, &r, 0.7);
        assert_eq!(got.to_data(), want.to_data());
        // Some counted positions are real log-probabilities, not the padding's 1.0.
        let got = got.into_data().to_vec::<f32>().unwrap();
        assert!(got.iter().filter(|&&v| v < 0.0).count() >= 4, "{got:?}");
    }

    /// Rows [5 6 7 | 8 9] and [5 | 3 4 2], the second counting in the loss or not.
    fn two_rollouts(second_counts: bool) -> Rollouts {
        let (p1, c1) = (vec![5u32, 6, 7], vec![8u32, 9]);
        let (p2, c2) = (vec![5u32], vec![3u32, 4, 2]);
        let rows = [
            RolloutRow {
                prompt: &p1,
                completion: &c1,
                counts: true,
            },
            RolloutRow {
                prompt: &p2,
                completion: &c2,
                counts: second_counts,
            },
        ];
        collate_rollouts(&rows, 0)
    }

    #[test]
    fn rollout_rows_are_right_padded_with_the_completion_as_labels() {
        let r = two_rollouts(false);
        assert_eq!(r.batch.seq_len, 5);
        assert_eq!(r.width, 3);
        assert_eq!(r.batch.tokens, vec![5, 6, 7, 8, 9, 5, 3, 4, 2, 0]);
        assert_eq!(
            r.batch.labels,
            vec![-100, -100, -100, 8, 9, -100, 3, 4, 2, -100]
        );
        // Row 0 counts its two tokens; row 1 (a truncated completion) counts none.
        assert_eq!(r.mask, vec![true, true, false, false, false, false]);
        // Position c of a row is predicted at prompt_len - 1 + c.
        assert_eq!(r.window_indices(), vec![2, 3, 4, 0, 1, 2]);
        assert_eq!(r.window_rows(), vec![2, 3, 4, 5, 6, 7]);
        assert_eq!(r.rows_range(1, 2).batch.tokens, vec![5, 3, 4, 2, 0]);
        // TRL's attention_mask, which the load-balancing loss keeps to: the right padding, and
        // the truncated completion of a row that does not count, are out.
        let padding = [
            false, false, false, false, false, false, true, true, true, true,
        ];
        assert_eq!(r.batch.padding.as_deref(), Some(&padding[..]));
        assert_eq!(
            r.rows_range(1, 2).batch.padding.as_deref(),
            Some(&padding[5..])
        );
    }

    #[test]
    fn the_world_metrics_are_means_over_every_rank_completion() {
        // Two ranks' sums: rewards 1, 3 (rank 0) and 5, 7 (rank 1).
        let names = [MetricName::from("rewards/a")];
        let rank = |a: f64, b: f64| {
            let mut v = vec![
                2.0,
                2.0,
                a + b,
                a * a + b * b,
                1.0,
                0.5,
                10.0,
                1.0,
                10.0,
                2.0,
            ];
            v.extend([a + b, 2.0]);
            v
        };
        let (r0, r1) = (rank(1.0, 3.0), rank(5.0, 7.0));
        let sums: Vec<f64> = r0.iter().zip(&r1).map(|(a, b)| a + b).collect();
        let m: std::collections::HashMap<_, _> = RolloutStats::metrics(&sums, 2, true, &names)
            .into_iter()
            .collect();
        assert_eq!(m["rewards"], 4.0);
        // std of [1, 3, 5, 7], Bessel-corrected.
        assert!((m["rewards_std"] - (20.0f64 / 3.0).sqrt()).abs() < 1e-12);
        assert_eq!(m["rewards/a"], 4.0);
        assert_eq!(m["successes"], 0.5);
        assert_eq!(m["frac_reward_zero_std"], 0.5);
        assert_eq!(m["response_lengths"], 5.0);
        assert_eq!(m["num_stop_tokens"], 2.0);
        assert_eq!(m["rollout_tokens_per_second"], 10.0);
    }
}
