//! PPO's step (torchtune's `ppo_full_finetune_single_device`): for each batch of prompts, one
//! response per prompt sampled from the policy, scored by a frozen reward model (its score at
//! the response's last token, penalised as `ppo_maths` says), per-token log-probabilities of
//! the policy and of a frozen reference (the KL penalty), per-token values of a trained value
//! model, rewards and generalised advantages (`ppo_maths::trajectory`); then `ppo_epochs`
//! passes over the batch in shuffled mini-batches of `ppo_batch_size`, each one optimizer step
//! of the policy and of the value model through torchtune's `PPOLoss`.
//!
//! Two models train, as in torchtune with one AdamW over both: here each has its own trainer
//! core ([`Trainer`]) and optimizer. `PPOLoss` is `policy_loss + value_coeff * value_loss`, and
//! the policy's parameters reach only the first term, the value model's only the second, so the
//! gradients are the same; AdamW's update of a parameter reads only that parameter's gradient
//! and moments, and torchtune's recipe neither clips nor scales the gradient globally, so the
//! two optimizers step exactly as the one does. The logged `loss` is the sum of the two.
//!
//! Where tune differs from torchtune, and why:
//! - a response's sampling stops at its first stop token (torchtune samples `max_generated_tokens`
//!   and then overwrites everything after the first stop token with padding): nothing after
//!   that token is attended to by a value the loss counts, so the trajectory is the same;
//! - sequences are right-padded per row (prompt, response, padding) instead of left-padded
//!   prompts with a padding mask: a causal model gives the same outputs either way, except that
//!   torchtune also masks a response token equal to the padding id (a sampled `pad_id` is
//!   attended to here, as any other token);
//! - each response is sampled from its own seeded stream (the run's seed, the step, the prompt's
//!   index in the dataset), not from one generator over the batch, so a response does not
//!   depend on the others in its batch.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, Int, Tensor, TensorData};
use rand::SeedableRng;
use rand::seq::SliceRandom;

use super::activation_checkpointing::{self, Checkpointing};
use super::epoch_steps::EpochSteps;
use super::error::{RolloutError, TrainError};
use super::grpo::combine;
use super::grpo::{check_prompts, completion_seed, score_completions, window_log_probs};
use super::load_balancing;
use super::loss_step::{EvalOutput, LossStep, StepInfo, StepOutput};
use super::ppo_maths::{
    Grid, Scored, Trajectory, TrajectorySettings, trajectory, trajectory_metrics,
};
use super::rollout_pack::RolloutInput;
use super::rollouts::{RolloutRow, Rollouts, collate_rollouts};
use super::sft::token_batch;
use super::step_done::StepDone;
use super::trainer::Trainer;
use crate::checkpoint::HostTensor;
use crate::data::{DataLoader, PromptDataset, PromptSample};
use crate::generation::{GroupPrompt, GroupSampling, sample_groups};
use crate::models::CausalLm;

/// The policy's and the value model's forward pass while training (GRPO's policy's); scoring
/// a batch without gradients is GRPO's scoring pass (torchtune's `torch.no_grad()` in eval).
use super::grpo::{POLICY_MODE as TRAIN_MODE, SCORING_MODE};

/// torchtune's `PPOLoss` settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PpoLossSettings {
    /// The policy ratio's clip range `[1 - epsilon, 1 + epsilon]`.
    pub epsilon: f64,
    /// New values are clipped to `old +- value_clip_range`.
    pub value_clip_range: f64,
    /// The value loss's weight.
    pub value_coeff: f64,
}

/// A mask as fp32 0/1 values, whatever the device's default float dtype: the losses compute in
/// fp32 (the log-probabilities and values are), and bf16 training must not mix the two.
fn fp32<B: Backend>(mask: Tensor<B, 2, Bool>) -> Tensor<B, 2> {
    crate::precision::to_f32(mask.float())
}

/// `rlhf.masked_mean` over the whole tensor; `None`: the plain mean.
fn masked_mean<B: Backend>(x: Tensor<B, 2>, mask: Option<Tensor<B, 2, Bool>>) -> Tensor<B, 1> {
    match mask {
        Some(mask) => {
            let m = fp32(mask);
            (x * m.clone()).sum() / (m.sum() + 1e-8)
        }
        None => x.mean(),
    }
}

/// The policy half of `PPOLoss`: the clipped surrogate's masked mean, and the two statistics
/// torchtune logs of it, `ratios` (their plain mean, padding included, where it is 1) and
/// `clipfrac` (the masked share of tokens where the clipped loss is the larger).
pub fn policy_loss<B: Backend>(
    old_log_probs: Tensor<B, 2>,
    log_probs: Tensor<B, 2>,
    advantages: Tensor<B, 2>,
    mask: Option<Tensor<B, 2, Bool>>,
    epsilon: f64,
) -> (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>) {
    let ratios = (log_probs - old_log_probs).exp();
    let clipped = ratios.clone().clamp(1.0 - epsilon, 1.0 + epsilon);
    let losing = advantages.neg();
    let loss_clipped = losing.clone() * clipped;
    let loss_unclipped = losing * ratios.clone();
    let clipfrac = masked_mean(
        fp32(loss_clipped.clone().greater(loss_unclipped.clone())),
        mask.clone(),
    );
    let loss = masked_mean(loss_clipped.max_pair(loss_unclipped), mask);
    (loss, ratios.mean(), clipfrac)
}

/// The value half of `PPOLoss` (before its coefficient): half the masked mean of the larger of
/// the new values' and the clipped new values' squared errors against the returns.
pub fn value_loss<B: Backend>(
    old_values: Tensor<B, 2>,
    values: Tensor<B, 2>,
    returns: Tensor<B, 2>,
    mask: Option<Tensor<B, 2, Bool>>,
    clip_range: f64,
) -> Tensor<B, 1> {
    let clipped = values
        .clone()
        .max_pair(old_values.clone() - clip_range)
        .min_pair(old_values + clip_range);
    let unclipped_error = (values - returns.clone()).powi_scalar(2);
    let clipped_error = (clipped - returns).powi_scalar(2);
    masked_mean(unclipped_error.max_pair(clipped_error), mask) * 0.5
}

/// One micro-batch of trajectories to train on: the sequences and everything `PPOLoss` reads
/// besides the models' new outputs, `[rows, width]` row-major.
#[derive(Debug, Clone)]
pub struct PpoMicroBatch {
    /// Prompt then response, right-padded; `mask` is true on the response tokens before each
    /// row's padding (the policy loss's).
    pub rollouts: Rollouts,
    pub old_log_probs: Vec<f32>,
    pub advantages: Vec<f32>,
    pub old_values: Vec<f32>,
    pub returns: Vec<f32>,
    /// True where a value counts in the value loss (the response, and the score's position).
    pub value_mask: Vec<bool>,
}

impl PpoMicroBatch {
    fn grid<B: Backend>(&self, values: &[f32], device: &B::Device) -> Tensor<B, 2> {
        let (rows, width) = (self.rollouts.batch.batch_size, self.rollouts.width);
        crate::precision::f32_tensor(values.to_vec(), [rows, width], device)
    }

    fn mask<B: Backend>(&self, values: &[bool], device: &B::Device) -> Tensor<B, 2, Bool> {
        let (rows, width) = (self.rollouts.batch.batch_size, self.rollouts.width);
        Tensor::from_data(TensorData::new(values.to_vec(), [rows, width]), device)
    }
}

fn missing_batch() -> TrainError {
    TrainError::Rollout(Box::new(RolloutError::Invariant(
        "a PPO update ran without its trajectories",
    )))
}

/// The config refuses `dataset_val` for PPO: no validation pass reaches these loss steps.
fn no_validation() -> TrainError {
    TrainError::Rollout(Box::new(RolloutError::Invariant(
        "PPO has no validation loss",
    )))
}

/// The policy's loss step: its log-probabilities of the micro-batch's responses through the
/// policy half of `PPOLoss`. Gradient contract: the trainer's, with `weight` 1 per micro-batch,
/// so the step's gradient is the mean of the micro-batches' (torchtune divides each
/// micro-batch's loss by `gradient_accumulation_steps`).
pub struct PolicyLoss {
    pub epsilon: f64,
    pub temperature: f64,
    pub activation_checkpointing: Checkpointing,
    /// The next update's micro-batches, in the order the trainer runs them.
    pub queue: VecDeque<Arc<PpoMicroBatch>>,
}

impl<B: AutodiffBackend> LossStep<B> for PolicyLoss {
    /// `_batch` is the micro-batch's rows as collated; the pass runs them laid out by
    /// [`RolloutInput`].
    fn step(
        &mut self,
        model: &CausalLm<B>,
        _batch: &crate::data::Batch,
        info: StepInfo,
    ) -> Result<StepOutput<B>, TrainError> {
        let mb = self.queue.pop_front().ok_or_else(missing_batch)?;
        let device = model.device();
        let old = mb.grid::<B>(&mb.old_log_probs, &device);
        let advantages = mb.grid::<B>(&mb.advantages, &device);
        let mask = mb.mask::<B>(&mb.rollouts.mask, &device);
        let (epsilon, temperature) = (self.epsilon, self.temperature);
        let mut stats = None;
        // The policy's load-balancing loss, added as TRL's GRPO adds it.
        let input = RolloutInput::of(model, &mb.rollouts, TRAIN_MODE);
        let pass = activation_checkpointing::loss_and_grads_at(
            model,
            input.token_batch(),
            TRAIN_MODE,
            (self.activation_checkpointing, info.seed),
            1.0,
            load_balancing::aux_loss_coef(model),
            (input.logit_rows(), |logits| {
                let pi = window_log_probs(logits, &mb.rollouts, temperature);
                let approx_kl = (pi.clone().detach() - old.clone()).powi_scalar(2).mean() * 0.5;
                let (loss, ratios, clipfrac) = policy_loss(
                    old.clone(),
                    pi,
                    advantages.clone(),
                    Some(mask.clone()),
                    epsilon,
                );
                stats = Some((
                    loss.clone().detach(),
                    ratios.detach(),
                    clipfrac.detach(),
                    approx_kl,
                ));
                loss
            }),
        );
        let (policy, ratios, clipfrac, approx_kl) =
            stats.expect("loss_and_grads calls the loss closure once");
        let mut metrics = vec![
            ("policy_loss", policy.inner()),
            ("ratios", ratios.inner()),
            ("clipfrac", clipfrac.inner()),
            ("approx_policy_kl", approx_kl.inner()),
        ];
        metrics.extend(pass.aux_metric());
        Ok(StepOutput {
            loss: pass.loss,
            weight: 1,
            tokens: mb.rollouts.mask.iter().filter(|&&m| m).count(),
            metrics,
            grads: pass.grads,
        })
    }

    fn evaluate(
        &mut self,
        _: &CausalLm<B::InnerBackend>,
        _: &crate::data::Batch,
        _: StepInfo,
    ) -> Result<EvalOutput, TrainError> {
        Err(no_validation())
    }
}

/// The value model's per-token values `[rows, width]` from its outputs `[rows, seq, 1]`: the
/// output at the token before each response position (torchtune's
/// `truncate_sequence_for_logprobs`), 0 where `value_mask` is false.
pub fn response_values<B: Backend>(
    outputs: Tensor<B, 3>,
    rollouts: &Rollouts,
    value_mask: Tensor<B, 2, Bool>,
) -> Tensor<B, 2> {
    let [rows, seq, _] = outputs.dims();
    let device = outputs.device();
    let all = crate::precision::to_f32(outputs).reshape([rows, seq]);
    let index = Tensor::<B, 2, Int>::from_data(
        TensorData::new(rollouts.window_indices(), [rows, rollouts.width]),
        &device,
    );
    all.gather(1, index).mask_fill(value_mask.bool_not(), 0.0)
}

/// The value model's loss step: `value_coeff` times the value half of `PPOLoss`, with the same
/// gradient contract as [`PolicyLoss`].
pub struct ValueLoss {
    pub value_clip_range: f64,
    pub value_coeff: f64,
    pub activation_checkpointing: Checkpointing,
    pub queue: VecDeque<Arc<PpoMicroBatch>>,
}

impl<B: AutodiffBackend> LossStep<B> for ValueLoss {
    fn step(
        &mut self,
        model: &CausalLm<B>,
        batch: &crate::data::Batch,
        info: StepInfo,
    ) -> Result<StepOutput<B>, TrainError> {
        let mb = self.queue.pop_front().ok_or_else(missing_batch)?;
        let device = model.device();
        let old = mb.grid::<B>(&mb.old_values, &device);
        let returns = mb.grid::<B>(&mb.returns, &device);
        let mask = mb.mask::<B>(&mb.value_mask, &device);
        let (clip, coeff) = (self.value_clip_range, self.value_coeff);
        let mut value = None;
        // No load-balancing term: transformers' `*ForSequenceClassification`, the value model's
        // class, returns no auxiliary loss.
        let pass = activation_checkpointing::loss_and_grads(
            model,
            token_batch(batch),
            TRAIN_MODE,
            (self.activation_checkpointing, info.seed),
            1.0,
            None,
            |outputs| {
                let values = response_values(outputs, &mb.rollouts, mask.clone());
                let loss = value_loss(
                    old.clone(),
                    values,
                    returns.clone(),
                    Some(mask.clone()),
                    clip,
                );
                value = Some(loss.clone().detach());
                loss * coeff
            },
        );
        let value = value.expect("loss_and_grads calls the loss closure once");
        Ok(StepOutput {
            loss: pass.loss,
            weight: 1,
            tokens: 0,
            metrics: vec![("value_loss", value.inner())],
            grads: pass.grads,
        })
    }

    fn evaluate(
        &mut self,
        _: &CausalLm<B::InnerBackend>,
        _: &crate::data::Batch,
        _: StepInfo,
    ) -> Result<EvalOutput, TrainError> {
        Err(no_validation())
    }
}

/// PPO's settings, resolved from the config.
#[derive(Debug, Clone, PartialEq)]
pub struct PpoSettings {
    /// Trajectories generated and scored per forward pass.
    pub forward_batch_size: usize,
    pub ppo_epochs: usize,
    pub ppo_batch_size: usize,
    /// Micro-batches per optimizer step (`ppo_batch_size` of them divides into these).
    pub gradient_accumulation_steps: usize,
    /// Steps of the run (`num_steps // batch_size`).
    pub total_steps: usize,
    pub sampling: GroupSampling,
    pub trajectory: TrajectorySettings,
    pub loss: PpoLossSettings,
    pub activation_checkpointing: Checkpointing,
}

impl PpoSettings {
    /// Optimizer updates per step: `ppo_epochs` passes of `batch_size / ppo_batch_size`.
    fn updates_per_step(&self, batch_size: usize) -> usize {
        self.ppo_epochs * (batch_size / self.ppo_batch_size.max(1)).max(1)
    }
}

/// The steps of a PPO run: one batch of prompts each, its trajectories, then the PPO passes.
pub struct PpoSteps<'a, B: AutodiffBackend> {
    pub settings: PpoSettings,
    pub prompts: &'a PromptDataset,
    pub loader: &'a DataLoader,
    /// The frozen reference and reward models, off the autodiff graph.
    pub reference: CausalLm<B::InnerBackend>,
    pub reward: CausalLm<B::InnerBackend>,
    /// The value model's trainer, shared with the save hook that checkpoints it; taken out
    /// while it steps.
    pub value: std::rc::Rc<std::cell::RefCell<Option<Trainer<B>>>>,
    policy_loss: PolicyLoss,
    value_loss: ValueLoss,
    batch_size: usize,
    epoch: crate::data::EpochBatches,
}

impl<'a, B: AutodiffBackend> PpoSteps<'a, B> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        settings: PpoSettings,
        batch_size: usize,
        prompts: &'a PromptDataset,
        loader: &'a DataLoader,
        reference: CausalLm<B::InnerBackend>,
        reward: CausalLm<B::InnerBackend>,
        value: std::rc::Rc<std::cell::RefCell<Option<Trainer<B>>>>,
    ) -> Self {
        let policy_loss = PolicyLoss {
            epsilon: settings.loss.epsilon,
            temperature: settings.sampling.sampling.temperature,
            activation_checkpointing: settings.activation_checkpointing,
            queue: VecDeque::new(),
        };
        let value_loss = ValueLoss {
            value_clip_range: settings.loss.value_clip_range,
            value_coeff: settings.loss.value_coeff,
            activation_checkpointing: settings.activation_checkpointing,
            queue: VecDeque::new(),
        };
        Self {
            settings,
            prompts,
            loader,
            reference,
            reward,
            value,
            policy_loss,
            value_loss,
            batch_size,
            epoch: Default::default(),
        }
    }

    fn prompts_of(&mut self, epoch: usize, index: usize) -> Vec<usize> {
        // PPO runs on one device.
        self.epoch.batch(self.loader, epoch, index, 0, 1).to_vec()
    }

    /// Samples one response per prompt, scores it with the four models and post-processes it
    /// into the trajectory; also returns the sequences and the rollout time.
    fn trajectories(
        &self,
        policy: &CausalLm<B::InnerBackend>,
        value: &CausalLm<B::InnerBackend>,
        prompts: &[usize],
        step_seed: u64,
    ) -> Result<(Rollouts, Trajectory, f64), TrainError> {
        let s = &self.settings;
        let samples: Vec<&PromptSample> = prompts
            .iter()
            .filter_map(|&i| self.prompts.get(i))
            .collect();
        let started = Instant::now();
        // torchtune's `generate_trajectory_batched`: `forward_batch_size` prompts decode together.
        let seeds: Vec<[u64; 1]> = prompts
            .iter()
            .map(|&row| [completion_seed(step_seed, row, 0)])
            .collect();
        check_prompts(&samples, prompts, policy.args.vocab_size)?;
        let mut responses = Vec::with_capacity(samples.len());
        let chunk = s.forward_batch_size.max(1);
        for (i, (chunk_samples, chunk_seeds)) in
            samples.chunks(chunk).zip(seeds.chunks(chunk)).enumerate()
        {
            let batch: Vec<GroupPrompt<'_>> = chunk_samples
                .iter()
                .zip(chunk_seeds)
                .map(|(sample, seeds)| GroupPrompt {
                    tokens: &sample.tokens,
                    seeds,
                })
                .collect();
            let groups =
                sample_groups(policy, &batch, &s.sampling, &mut |d| d).map_err(|source| {
                    let row = prompts[i * chunk];
                    TrainError::Rollout(Box::new(RolloutError::Generate { row, source }))
                })?;
            responses.extend(
                groups
                    .into_iter()
                    .map(|g| g.completions.into_iter().next().unwrap_or_default()),
            );
        }
        let prompt_tokens: Vec<&[u32]> = samples.iter().map(|p| p.tokens.as_slice()).collect();
        let models = PpoModels {
            policy,
            reference: &self.reference,
            value,
            reward: &self.reward,
        };
        let (rollouts, t) = score_responses(&models, &prompt_tokens, responses, s)?;
        Ok((rollouts, t, started.elapsed().as_secs_f64()))
    }
}

/// The four models a batch of responses is scored with, off the autodiff graph.
pub struct PpoModels<'a, B: Backend> {
    pub policy: &'a CausalLm<B>,
    pub reference: &'a CausalLm<B>,
    pub value: &'a CausalLm<B>,
    pub reward: &'a CausalLm<B>,
}

/// Scores each prompt's response (its tokens up to and including its first stop token; padded
/// here to `max_generated_tokens`) with the four models, `forward_batch_size` rows at a time,
/// and post-processes them into the trajectory (`ppo_maths::trajectory`): the sequences the
/// updates train on and what `PPOLoss` reads of them.
pub fn score_responses<B: Backend>(
    models: &PpoModels<'_, B>,
    prompts: &[&[u32]],
    mut responses: Vec<Vec<u32>>,
    s: &PpoSettings,
) -> Result<(Rollouts, Trajectory), TrainError> {
    let width = s.trajectory.max_generated_tokens;
    let pad = s.trajectory.pad_id;
    for response in &mut responses {
        response.resize(width, pad);
    }
    let rows: Vec<RolloutRow<'_>> = prompts
        .iter()
        .zip(&responses)
        .map(|(prompt, response)| RolloutRow {
            prompt,
            completion: response,
            counts: true,
        })
        .collect();
    let rollouts = collate_rollouts(&rows, pad);
    // Every model scores the same sequences, `forward_batch_size` rows at a time.
    let n = rollouts.batch.batch_size;
    let (mut log_probs, mut ref_log_probs, mut values, mut scores) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let temperature = s.sampling.sampling.temperature;
    let device = models.policy.device();
    let mut start = 0;
    while start < n {
        let end = (start + s.forward_batch_size).min(n);
        let part = rollouts.rows_range(start, end);
        let input = token_batch(&part.batch);
        let all_tokens = Tensor::<B, 2, Bool>::from_data(
            TensorData::new(vec![true; part.mask.len()], [end - start, width]),
            &device,
        );
        let lp = score_completions(models.policy, &part, SCORING_MODE, temperature);
        log_probs.extend(HostTensor::from_tensor(&lp).data);
        let rlp = score_completions(models.reference, &part, SCORING_MODE, temperature);
        ref_log_probs.extend(HostTensor::from_tensor(&rlp).data);
        let v = response_values(models.value.forward(input, SCORING_MODE), &part, all_tokens);
        values.extend(HostTensor::from_tensor(&v).data);
        // The reward model's score at each response's last token: its output there reads
        // only the tokens up to it, the same whatever follows.
        let out = models.reward.forward(input, SCORING_MODE);
        let out = HostTensor::from_tensor(&crate::precision::to_f32(out));
        let seq = part.batch.seq_len;
        for (r, response) in responses[start..end].iter().enumerate() {
            let last = last_index(response, &s.sampling.stop_ids);
            let at = (part.prompt_lens[r] + last).min(seq - 1);
            scores.push(out.data[r * seq + at]);
        }
        start = end;
    }
    let tokens: Vec<u32> = responses.concat();
    let scored = Scored {
        responses: Grid::new(n, width, tokens),
        scores,
        log_probs: Grid::new(n, width, log_probs),
        ref_log_probs: Grid::new(n, width, ref_log_probs),
        values: Grid::new(n, width, values),
    };
    let t = trajectory(scored, &s.sampling.stop_ids, &s.trajectory);
    Ok((rollouts, t))
}

/// The index of a response's last token before padding: its first stop token, else its last.
fn last_index(response: &[u32], stop_ids: &[u32]) -> usize {
    response
        .iter()
        .position(|t| stop_ids.contains(t))
        .unwrap_or(response.len().saturating_sub(1))
}

/// Rows `rows` of the batch's trajectories, as one micro-batch.
pub fn micro_batch(rollouts: &Rollouts, t: &Trajectory, rows: &[usize]) -> PpoMicroBatch {
    let width = rollouts.width;
    let pick = |values: &[f32]| -> Vec<f32> {
        rows.iter()
            .flat_map(|&r| values[r * width..(r + 1) * width].iter().copied())
            .collect()
    };
    let batch = rollouts.batch.select_rows(rows);
    let mask: Vec<bool> = rows
        .iter()
        .flat_map(|&r| t.response_padding.row(r).iter().map(|p| !p))
        .collect();
    let value_mask: Vec<bool> = rows
        .iter()
        .flat_map(|&r| t.value_padding.row(r).iter().map(|p| !p))
        .collect();
    PpoMicroBatch {
        rollouts: Rollouts::unscored(
            batch,
            rows.iter().map(|&r| rollouts.prompt_lens[r]).collect(),
            width,
            mask,
        ),
        old_log_probs: pick(&t.log_probs.values),
        advantages: pick(&t.advantages.values),
        old_values: pick(&t.values.values),
        returns: pick(&t.returns.values),
        value_mask,
    }
}

impl<B: AutodiffBackend> EpochSteps<B> for PpoSteps<'_, B> {
    fn steps_per_epoch(&self, trainer: &Trainer<B>) -> Result<usize, TrainError> {
        trainer.steps_per_epoch(self.loader)
    }

    fn step(
        &mut self,
        trainer: Trainer<B>,
        epoch: usize,
        index: usize,
    ) -> Result<(Trainer<B>, StepDone), TrainError> {
        let prompts = self.prompts_of(epoch, index);
        let step_seed = super::grpo::step_seed(trainer.settings.seed, epoch, index);
        let value = self.value.borrow_mut().take().ok_or_else(|| {
            TrainError::Rollout(Box::new(RolloutError::Invariant(
                "the value model's trainer was lost in an earlier step",
            )))
        })?;
        let (trainer, value, done) = self.step_both(trainer, value, &prompts, step_seed)?;
        *self.value.borrow_mut() = Some(value);
        Ok((trainer, done))
    }

    fn updates_per_step(&self) -> usize {
        self.settings.updates_per_step(self.batch_size)
    }

    fn max_steps(&self) -> Option<usize> {
        Some(self.settings.total_steps)
    }

    fn schedule_steps(&self, _steps_per_epoch: usize) -> Option<usize> {
        // torchtune's `lr_steps`: the run's steps times the updates of each.
        Some(self.settings.total_steps * self.updates_per_step())
    }
}

impl<B: AutodiffBackend> PpoSteps<'_, B> {
    /// One step: the trajectories, then every PPO update of both models.
    fn step_both(
        &mut self,
        trainer: Trainer<B>,
        mut value: Trainer<B>,
        prompts: &[usize],
        step_seed: u64,
    ) -> Result<(Trainer<B>, Trainer<B>, StepDone), TrainError> {
        let (rollouts, t, rollout_seconds) = self.trajectories(
            &trainer.model.valid(),
            &value.model.valid(),
            prompts,
            step_seed,
        )?;
        let rows = rollouts.batch.batch_size;
        let prompt_tokens: usize = rollouts.prompt_lens.iter().sum();
        let s = self.settings.clone();
        let per_micro = (s.ppo_batch_size / s.gradient_accumulation_steps.max(1)).max(1);
        let mut rng = rand::rngs::StdRng::seed_from_u64(crate::distributed::sync::hash64(
            format!("ppo-minibatches:{step_seed}").as_bytes(),
        ));
        let started = Instant::now();
        let mut trainer = trainer;
        let mut updates = Vec::new();
        let mut value_updates = Vec::new();
        for _ in 0..s.ppo_epochs {
            let mut order: Vec<usize> = (0..rows).collect();
            order.shuffle(&mut rng);
            for minibatch in order.chunks(s.ppo_batch_size) {
                let micro: Vec<Arc<PpoMicroBatch>> = minibatch
                    .chunks(per_micro)
                    .map(|rows| Arc::new(micro_batch(&rollouts, &t, rows)))
                    .collect();
                let batches: Vec<crate::data::Batch> =
                    micro.iter().map(|m| m.rollouts.batch.clone()).collect();
                // The value model steps at the policy's place in the schedule.
                value.state.global_step = trainer.state.global_step;
                value.state.total_steps = trainer.state.total_steps;
                value.state.epoch = trainer.state.epoch;
                self.policy_loss.queue = micro.iter().cloned().collect();
                let done;
                (trainer, done) = trainer.train_step(&batches, &mut self.policy_loss)?;
                updates.push(done);
                self.value_loss.queue = micro.into_iter().collect();
                let done;
                (value, done) = value.train_step(&batches, &mut self.value_loss)?;
                value_updates.push(done);
            }
        }
        let ppo_seconds = started.elapsed().as_secs_f64().max(1e-9);
        let mut done = combine(updates);
        let value_done = combine(value_updates);
        done.loss += value_done.loss;
        done.metrics.extend(value_done.metrics);
        done.metrics.extend(trajectory_metrics(&t));
        // torchtune's throughput figures count the prompts' tokens.
        let tokens = prompt_tokens as f64;
        done.metrics.push((
            "tokens_per_second_per_gpu_trajectory".into(),
            tokens / rollout_seconds.max(1e-9),
        ));
        done.metrics
            .push(("tokens_per_second_per_gpu_ppo".into(), tokens / ppo_seconds));
        Ok((trainer, value, done))
    }
}

#[cfg(test)]
mod tests {
    //! `PPOLoss` against `tests/fixtures/ppo.json` (torchtune 0.6.1's class, its gradients by
    //! torch autograd).
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use serde_json::Value;

    type AB = Autodiff<Flex>;

    fn floats(v: &Value) -> Vec<f32> {
        v.as_array()
            .expect("a list")
            .iter()
            .map(|x| x.as_f64().expect("a number") as f32)
            .collect()
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

    #[test]
    fn ppo_loss_values_statistics_and_gradients_are_torchtunes() {
        let f: Value =
            serde_json::from_str(include_str!("../../tests/fixtures/ppo.json")).expect("ppo.json");
        let cases = f["ppo_loss"].as_array().expect("cases");
        assert!(cases.len() >= 3);
        let device = Default::default();
        for case in cases {
            let name = case["name"].as_str().unwrap_or("?");
            let (b, w) = (
                case["batch"].as_u64().expect("batch") as usize,
                case["width"].as_u64().expect("width") as usize,
            );
            let grid = |k: &str| {
                Tensor::<AB, 2>::from_data(TensorData::new(floats(&case[k]), [b, w]), &device)
            };
            let mask = |k: &str| match &case[k] {
                Value::Null => None,
                m => {
                    let values: Vec<bool> = m
                        .as_array()
                        .expect("a list")
                        .iter()
                        .map(|x| x.as_bool().expect("a bool"))
                        .collect();
                    Some(Tensor::<AB, 2, Bool>::from_data(
                        TensorData::new(values, [b, w]),
                        &device,
                    ))
                }
            };
            let f64_of = |k: &str| case[k].as_f64().expect("a number");
            let pi = grid("pi_logprobs").require_grad();
            let values = grid("phi_values").require_grad();
            let (policy, ratios, clipfrac) = policy_loss(
                grid("pi_old_logprobs"),
                pi.clone(),
                grid("advantages"),
                mask("padding_masks"),
                f64_of("epsilon"),
            );
            let value = value_loss(
                grid("phi_old_values"),
                values.clone(),
                grid("returns"),
                mask("value_padding_masks"),
                f64_of("value_clip_range"),
            );
            let loss = policy.clone() + value.clone() * f64_of("value_coeff");
            let scalar = |t: &Tensor<AB, 1>| t.clone().into_scalar();
            let checks = [
                ("loss", scalar(&loss), "expected_loss"),
                ("policy_loss", scalar(&policy), "expected_policy_loss"),
                ("value_loss", scalar(&value), "expected_value_loss"),
                ("ratios", scalar(&ratios), "expected_ratios"),
                ("clipfrac", scalar(&clipfrac), "expected_clipfrac"),
            ];
            for (what, got, key) in checks {
                close(
                    &format!("{name} {what}"),
                    &[got],
                    &[f64_of(key) as f32],
                    1e-6,
                );
            }
            let grads = loss.backward();
            let grad_of = |t: &Tensor<AB, 2>| -> Vec<f32> {
                t.grad(&grads)
                    .expect("a gradient")
                    .into_data()
                    .to_vec()
                    .expect("f32")
            };
            close(
                &format!("{name} d/dpi"),
                &grad_of(&pi),
                &floats(&case["expected_grad_pi_logprobs"]),
                1e-6,
            );
            close(
                &format!("{name} d/dvalues"),
                &grad_of(&values),
                &floats(&case["expected_grad_phi_values"]),
                1e-6,
            );
        }
    }
}
