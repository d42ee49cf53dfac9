//! The trainer core every recipe shares: epochs, gradient accumulation, clipping, optimizer
//! and schedule stepping, metrics, progress, the NaN guard, checkpoint triggers and resume.
//! A recipe supplies only its loss step and what to save.
//!
//! Data parallelism lives here too: with a [`World`] of W workers each trains on its share of
//! every global batch, and one step is the single-device step on the whole batch: gradients
//! and the trained-token count are summed over the world before the loss normalisation,
//! clipping (on the global norm), the NaN guard and the optimizer step, which every worker
//! applies alike. A world of one skips every collective call.

use std::time::Instant;

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor};

use super::loss;
use super::metrics::{MetricLoggers, Metrics, peak_memory_bytes};
use super::optimizer::Optimizer;
use super::progress::EpochProgress;
use super::schedule::Schedule;
use super::sharded_optimizer;
use super::step::{self, GradAccumulator};
use super::validation::Validation;
use crate::data::{Batch, DataLoader, Dataset};
use crate::distributed::{DistributedError, World, sync};
use crate::models::CausalLm;

/// Loop settings, from the recipe config.
#[derive(Debug, Clone)]
pub struct TrainerSettings {
    pub epochs: usize,
    pub max_steps_per_epoch: Option<usize>,
    pub gradient_accumulation_steps: usize,
    pub clip_grad_norm: Option<f64>,
    pub log_every_n_steps: usize,
    pub save_every_n_steps: Option<usize>,
    pub lr: f64,
    pub schedule: Schedule,
    pub seed: u64,
    /// ZeRO-1 with several workers: each rank keeps and updates the optimizer state of its
    /// share of the parameters only (full-weight training; LoRA's state is small).
    pub shard_optimizer: bool,
    /// On a stop signal, save a checkpoint at the step boundary before returning.
    pub save_on_preempt: bool,
}

/// Where training stands; saved in every checkpoint so a resumed run continues exactly.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainState {
    pub epoch: usize,
    /// Optimizer steps completed in `epoch`.
    pub step_in_epoch: usize,
    pub global_step: usize,
    pub steps_per_epoch: usize,
    pub total_steps: usize,
    pub tokens_seen: u64,
}

/// What a recipe's loss step returns for one micro-batch.
pub struct StepOutput<B: AutodiffBackend> {
    /// The mean loss over this micro-batch's `weight` units (tokens for SFT, pairs for DPO).
    pub loss: Tensor<B, 1>,
    pub weight: usize,
    /// Tokens for throughput: SFT and KD count labels that are not ignored (torchtune's
    /// `num_tokens`), DPO every position of its padded rows (as torchtune's DPO recipe).
    pub tokens: usize,
    /// Extra per-micro-batch metrics (`[1]` tensors), averaged over the step by weight. They
    /// stay on the device: the trainer reads them with the loss, once per step, so a GPU is
    /// not made to wait for the host between micro-batches.
    pub metrics: Vec<(&'static str, Tensor<B::InnerBackend, 1>)>,
    /// Gradients the step already computed (activation checkpointing runs its own backward
    /// passes, for `loss * weight`); `None` lets the trainer back-propagate `loss * weight`.
    pub grads: Option<Vec<B::Gradients>>,
}

impl<B: AutodiffBackend> StepOutput<B> {
    /// The gradients of `loss * weight`: the ones the step computed itself, or one backward
    /// pass here.
    pub fn take_gradients(&mut self) -> Vec<B::Gradients> {
        match self.grads.take() {
            Some(parts) => parts,
            None => vec![(self.loss.clone() * self.weight as f64).backward()],
        }
    }

    /// The value of metric `name` (a read from the device; for tests and inspection).
    pub fn metric(&self, name: &str) -> Option<f64> {
        let (_, value) = self.metrics.iter().find(|(k, _)| *k == name)?;
        Some(value.clone().into_scalar().elem())
    }
}

#[derive(Debug, Clone, Copy)]
pub struct StepInfo {
    pub epoch: usize,
    pub global_step: usize,
    /// The seed the backend's RNG was reset to for this step.
    pub seed: u64,
}

/// What a loss step returns for one validation batch.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalOutput {
    /// The mean loss over the batch's `weight` units, as [`StepOutput::loss`].
    pub loss: f64,
    pub weight: usize,
    /// The recipe's own metrics, averaged over the validation set by weight.
    pub metrics: Vec<(&'static str, f64)>,
}

pub trait LossStep<B: AutodiffBackend> {
    fn step(
        &mut self,
        model: &CausalLm<B>,
        batch: &Batch,
        info: StepInfo,
    ) -> Result<StepOutput<B>, TrainError>;

    /// The same loss on a validation batch, on the model without autodiff and with dropout off
    /// (torchtune's `model.eval()` under `torch.no_grad()`).
    fn evaluate(
        &mut self,
        model: &CausalLm<B::InnerBackend>,
        batch: &Batch,
        info: StepInfo,
    ) -> Result<EvalOutput, TrainError>;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveKind {
    /// Every `save_every_n_steps`: in the background.
    Periodic,
    /// End of an epoch that is not the last: in the background.
    EpochEnd,
    /// End of training: synchronous.
    Final,
    /// A stop signal with `save_on_preempt`: a `step_N` checkpoint, synchronous.
    Preempt,
}

impl SaveKind {
    /// Whether training waits for the checkpoint to be published (the process exits after).
    pub fn blocks(self) -> bool {
        matches!(self, Self::Final | Self::Preempt)
    }
}

/// The optimizer as a checkpoint holds it: its step count and every parameter's moments
/// (gathered from all ranks when the state is sharded).
pub struct OptimizerSnapshot {
    pub step: u64,
    pub state: Vec<(String, crate::checkpoint::HostTensor)>,
}

/// The recipe's side of checkpointing: what to save (adapter or full model, optimizer, state).
pub trait SaveHook<B: AutodiffBackend> {
    fn save(
        &mut self,
        kind: SaveKind,
        model: &mut CausalLm<B>,
        optimizer: &OptimizerSnapshot,
        state: &TrainState,
    ) -> Result<(), TrainError>;
}

/// What the divergence guard caught.
#[derive(Debug, Clone, PartialEq)]
pub enum Divergence {
    NonFiniteLoss(f64),
    /// The step's loss is more than [`EXPLODING_LOSS_FACTOR`] times the run's first (or 1).
    ExplodingLoss {
        loss: f64,
        first: f64,
    },
    /// The norm of the step's mean gradient: non-finite, or over [`MAX_GRAD_NORM`].
    Gradients(f64),
    /// A trained weight about to be saved: non-finite, or over [`MAX_WEIGHT`] in magnitude.
    Weight {
        name: String,
        value: f32,
    },
}

/// A step whose loss exceeds this many times the run's first loss (or 1, if larger) has
/// diverged: a cross-entropy starts near ln(vocabulary) and falls.
pub const EXPLODING_LOSS_FACTOR: f64 = 100.0;
/// The largest norm of a step's mean gradient that is still training (norms of a healthy
/// fine-tune are well under 100; clipping bounds the update, not the gradient).
pub const MAX_GRAD_NORM: f64 = 1e6;
/// The largest magnitude of a saved trained weight (trained weights stay well under 100).
pub const MAX_WEIGHT: f32 = 1e6;

impl std::fmt::Display for Divergence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NonFiniteLoss(v) => write!(f, "the loss became {v}"),
            Self::ExplodingLoss { loss, first } => write!(
                f,
                "the loss became {loss:.4e}, over {EXPLODING_LOSS_FACTOR} times the first step's ({first:.4})"
            ),
            Self::Gradients(norm) if norm.is_finite() => write!(
                f,
                "the gradient norm became {norm:.3e} (over {MAX_GRAD_NORM:e})"
            ),
            Self::Gradients(norm) => write!(f, "the gradient norm became {norm}"),
            Self::Weight { name, value } => write!(f, "the weight {name} holds {value:e}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(
        "training diverged at step {step} (epoch {epoch}): {cause}; training stopped before saving anything from it. Lower optimizer.lr, set clip_grad_norm, or check the data"
    )]
    Diverged {
        cause: Divergence,
        step: usize,
        epoch: usize,
    },
    #[error("stopped by {signal} at the end of step {step}")]
    Interrupted {
        signal: crate::interrupt::Signal,
        step: usize,
    },
    #[error(
        "the dataset yields {batches} batches of {batch_size}, fewer than gradient_accumulation_steps ({accum}): lower batch_size or gradient_accumulation_steps, or add data"
    )]
    TooLittleData {
        batches: usize,
        batch_size: usize,
        accum: usize,
    },
    /// Boxed, as `Checkpoint`: data errors carry a path and the row's details.
    #[error("data: {0}")]
    Data(Box<crate::data::DataError>),
    #[error(
        "the batch at step {step} holds token id {id}, but the model's vocabulary has {vocab_size} entries: the tokenizer does not match the model (check tokenizer.path against checkpointer.checkpoint_dir)"
    )]
    TokenOutOfVocabulary {
        id: i64,
        vocab_size: usize,
        step: usize,
    },
    #[error(transparent)]
    Metrics(#[from] super::metrics::MetricsError),
    /// Boxed: the checkpoint client's errors carry paths and sources.
    #[error(transparent)]
    Checkpoint(Box<super::checkpointing::CheckpointingError>),
    #[error(transparent)]
    Distributed(#[from] DistributedError),
    #[error("{0}")]
    Other(String),
}

impl crate::distributed::Ends for TrainError {
    fn ending(&self) -> crate::distributed::Ending {
        match self {
            Self::Interrupted { signal, .. } => crate::distributed::Ending::Stopped(*signal),
            Self::Distributed(e) => e.ending(),
            _ => crate::distributed::Ending::Failed,
        }
    }
}

impl From<crate::data::DataError> for TrainError {
    fn from(e: crate::data::DataError) -> Self {
        Self::Data(Box::new(e))
    }
}

impl From<super::checkpointing::CheckpointingError> for TrainError {
    fn from(e: super::checkpointing::CheckpointingError) -> Self {
        Self::Checkpoint(Box::new(e))
    }
}

/// Every token and label must index the model's vocabulary: an id past it would index outside
/// the embedding and the logits.
pub(crate) fn check_vocabulary(
    batch: &Batch,
    vocab_size: usize,
    step: usize,
) -> Result<(), TrainError> {
    let tokens = batch.tokens.iter().map(|&t| t as i64);
    let labels = batch
        .labels
        .iter()
        .copied()
        .filter(|&l| l != loss::IGNORE_INDEX);
    match tokens
        .chain(labels)
        .find(|&id| id < 0 || id >= vocab_size as i64)
    {
        Some(id) => Err(TrainError::TokenOutOfVocabulary {
            id,
            vocab_size,
            step: step + 1,
        }),
        None => Ok(()),
    }
}

/// A step's loss and metrics summed over its micro-batches, each weighted by its size, as
/// device tensors: read once per step.
struct StepSums<B: Backend> {
    loss: Option<Tensor<B, 1>>,
    metrics: Vec<(&'static str, Tensor<B, 1>)>,
}

impl<B: Backend> Default for StepSums<B> {
    fn default() -> Self {
        Self {
            loss: None,
            metrics: Vec::new(),
        }
    }
}

impl<B: Backend> StepSums<B> {
    fn add(&mut self, loss: Tensor<B, 1>, metrics: Vec<(&'static str, Tensor<B, 1>)>, weight: f64) {
        let weighted = |t: Tensor<B, 1>| crate::precision::to_f32(t) * weight;
        self.loss = Some(match self.loss.take() {
            Some(sum) => sum + weighted(loss),
            None => weighted(loss),
        });
        for (k, v) in metrics {
            match self.metrics.iter_mut().find(|(name, _)| *name == k) {
                Some(entry) => entry.1 = entry.1.clone() + weighted(v),
                None => self.metrics.push((k, weighted(v))),
            }
        }
    }

    /// The loss sum, the metric sums (by name, in first-seen order) and `extra`'s value (0
    /// without it), in one read from the device.
    fn read(self, extra: Option<Tensor<B, 1>>) -> (f64, Vec<(&'static str, f64)>, f64) {
        let names: Vec<&'static str> = self.metrics.iter().map(|(k, _)| *k).collect();
        let has_extra = extra.is_some();
        let parts: Vec<Tensor<B, 1>> = self
            .loss
            .into_iter()
            .chain(self.metrics.into_iter().map(|(_, v)| v))
            .chain(extra.map(crate::precision::to_f32))
            .collect();
        if parts.is_empty() {
            return (0.0, Vec::new(), 0.0);
        }
        let values: Vec<f64> = Tensor::cat(parts, 0).into_data().iter::<f64>().collect();
        let extra = if has_extra {
            values[values.len() - 1]
        } else {
            0.0
        };
        let metrics = names.into_iter().zip(values[1..].iter().copied()).collect();
        (values[0], metrics, extra)
    }
}

/// Adds a micro-batch's metrics, weighted, into the running sums (by name, in first-seen order).
pub(crate) fn add_weighted(
    sums: &mut Vec<(&'static str, f64)>,
    metrics: Vec<(&'static str, f64)>,
    weight: f64,
) {
    for (k, v) in metrics {
        match sums.iter_mut().find(|(name, _)| *name == k) {
            Some(entry) => entry.1 += v * weight,
            None => sums.push((k, v * weight)),
        }
    }
}

/// The outcome of `fit`, for the final report.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub state: TrainState,
    pub losses: Vec<f64>,
    pub last_metrics: Metrics,
}

pub struct Trainer<B: AutodiffBackend> {
    pub settings: TrainerSettings,
    pub model: CausalLm<B>,
    pub optimizer: Optimizer<B::InnerBackend>,
    pub state: TrainState,
    pub loggers: MetricLoggers,
    pub show_progress: bool,
    /// This worker's place among the data-parallel workers (a world of one on one device).
    pub world: World,
    /// With a sharded optimizer: every rank hands its own share to its save hook (which writes
    /// it as a file of the checkpoint) instead of gathering the whole state for rank 0.
    pub save_optimizer_shards: bool,
}

impl<B: AutodiffBackend> Trainer<B> {
    /// The optimizer for a checkpoint: with a sharded state, this rank's share (when every rank
    /// writes its own) or the whole state gathered from every rank; otherwise the state on rank
    /// 0, the one that writes, and nothing elsewhere.
    fn snapshot(
        &self,
        shard: Option<&sharded_optimizer::OptimizerShard>,
    ) -> Result<OptimizerSnapshot, TrainError> {
        let state = match shard {
            Some(_) if self.save_optimizer_shards => self.optimizer.state_dict(),
            Some(_) => sharded_optimizer::gather_optimizer_state(
                &self.world,
                &self.model,
                &self.optimizer,
            )?,
            None if self.world.is_main() => self.optimizer.state_dict(),
            None => Vec::new(),
        };
        Ok(OptimizerSnapshot {
            step: self.optimizer.step,
            state,
        })
    }

    /// Scores the validation set after the current step, logs `val_loss` (and the recipe's
    /// `val_*` metrics) at this step and prints it.
    fn validate(
        &mut self,
        validation: &Validation,
        loss_step: &mut dyn LossStep<B>,
        info: StepInfo,
        progress: &EpochProgress,
    ) -> Result<(), TrainError> {
        let metrics = validation.run(&self.model, loss_step, &self.world, info)?;
        if self.world.is_main() {
            let line = metrics
                .iter()
                .map(|(k, v)| format!("{k} {v:.4}"))
                .collect::<Vec<_>>()
                .join(", ");
            let step = self.state.global_step;
            progress.suspend(|| eprintln!("Validation at step {step}: {line}"));
        }
        let mut line: Metrics = vec![
            ("step".into(), self.state.global_step as f64),
            ("epoch".into(), info.epoch as f64),
        ];
        line.extend(metrics);
        self.loggers.log(self.state.global_step, &line)?;
        Ok(())
    }

    /// Runs training from `self.state` (zero for a fresh run, a checkpoint's for a resume).
    pub fn fit(
        mut self,
        data: &Dataset,
        loader: &DataLoader,
        loss_step: &mut dyn LossStep<B>,
        saver: &mut dyn SaveHook<B>,
        validation: Option<&Validation>,
    ) -> Result<(TrainSummary, CausalLm<B>), TrainError> {
        let s = self.settings.clone();
        super::memory::enter_training_steady_state();
        let accum = s.gradient_accumulation_steps.max(1);
        let world = self.world.clone();
        let batches_per_epoch = loader.num_batches_per_rank(world.size);
        let mut steps_per_epoch = batches_per_epoch / accum;
        if let Some(max) = s.max_steps_per_epoch {
            steps_per_epoch = steps_per_epoch.min(max);
        }
        if steps_per_epoch == 0 {
            return Err(TrainError::TooLittleData {
                batches: batches_per_epoch,
                batch_size: loader.config().batch_size,
                accum,
            });
        }
        self.state.steps_per_epoch = steps_per_epoch;
        self.state.total_steps = steps_per_epoch * s.epochs;
        let device = self.model.device();
        let mut losses = Vec::new();
        let mut first_loss: Option<f64> = None;
        let mut last_metrics = Metrics::new();
        let mut accumulator = GradAccumulator::<B>::default();
        let mut validated_at: Option<usize> = None;
        let shard = (s.shard_optimizer && world.is_distributed())
            .then(|| sharded_optimizer::OptimizerShard::new(&self.model, &world));
        if let Some(shard) = &shard {
            // A resumed run restores the whole state; each rank keeps its share.
            self.optimizer.retain(|name| shard.owns(name));
        }

        while self.state.epoch < s.epochs {
            let epoch = self.state.epoch;
            let batches = loader.rank_batches(epoch as u64, world.rank, world.size);
            let mut progress = EpochProgress::new(
                epoch,
                steps_per_epoch,
                self.state.step_in_epoch,
                self.show_progress,
            );
            let mut window_tokens = 0usize;
            let mut window_start = Instant::now();
            while self.state.step_in_epoch < steps_per_epoch {
                // Reseeding per step makes dropout reproducible and resumable; each rank draws
                // its own masks (seed + rank, as torchtune seeds its ranks).
                let step_seed = s
                    .seed
                    .wrapping_add(self.state.global_step as u64)
                    .wrapping_add(world.rank as u64);
                let info = StepInfo {
                    epoch,
                    global_step: self.state.global_step,
                    seed: step_seed,
                };
                B::seed(&device, step_seed);
                let mut weight_total = 0usize;
                let mut step_tokens = 0usize;
                // The step's weighted loss and metric sums stay on the device until the step's
                // one read below: a read per micro-batch would make a GPU wait for the host.
                let mut sums = StepSums::<B::InnerBackend>::default();
                for micro in 0..accum {
                    let indices = &batches[self.state.step_in_epoch * accum + micro];
                    let batch = data.collate(indices)?;
                    check_vocabulary(&batch, self.model.args.vocab_size, self.state.global_step)?;
                    let mut out = loss_step.step(&self.model, &batch, info)?;
                    // Weighting each micro-batch by its size makes the accumulated gradient the
                    // mean over all tokens of the step, as torchtune normalises it.
                    for grads in out.take_gradients() {
                        accumulator.add(&self.model, grads);
                    }
                    sums.add(out.loss.inner(), out.metrics, out.weight as f64);
                    weight_total += out.weight;
                    step_tokens += out.tokens;
                }
                let mut grads = accumulator.take();
                // On one device the gradient norm joins the same read.
                let squared_norm =
                    (!world.is_distributed()).then(|| step::squared_grad_norm(&self.model, &grads));
                let (mut loss_sum, mut extra, mut squared_norm) = sums.read(squared_norm.flatten());
                let non_finite = (!loss_sum.is_finite()).then_some(loss_sum);
                if let (Some(value), false) = (non_finite, world.is_distributed()) {
                    return Err(TrainError::Diverged {
                        cause: Divergence::NonFiniteLoss(value),
                        step: self.state.global_step + 1,
                        epoch,
                    });
                }
                // A stop signal is acted on at the end of this step; every rank agrees on it
                // through the step's collective call.
                let mut stop = crate::interrupt::requested();
                if world.is_distributed() {
                    // One step over the global batch: sum what the ranks hold.
                    let mut local = vec![
                        weight_total as f64,
                        loss_sum,
                        step_tokens as f64,
                        f64::from(u8::from(non_finite.is_some())),
                        f64::from(u8::from(stop.is_some())),
                    ];
                    local.extend(extra.iter().map(|(_, v)| *v));
                    let global = sync::all_reduce_scalars::<B::InnerBackend>(
                        &world,
                        &local,
                        &self.model.device(),
                        "the step's token count and loss",
                    )?;
                    if global[3] > 0.0 {
                        return Err(TrainError::Diverged {
                            cause: Divergence::NonFiniteLoss(non_finite.unwrap_or(f64::NAN)),
                            step: self.state.global_step + 1,
                            epoch,
                        });
                    }
                    weight_total = global[0].round() as usize;
                    loss_sum = global[1];
                    step_tokens = global[2].round() as usize;
                    // A signal on any node stops every rank after this step.
                    if global[4] > 0.0 {
                        stop.get_or_insert(crate::interrupt::Signal::Terminate);
                    }
                    for (entry, v) in extra.iter_mut().zip(&global[5..]) {
                        entry.1 = *v;
                    }
                    grads = sync::all_reduce_grads(&world, &self.model, grads)?;
                    squared_norm = step::squared_grad_norm(&self.model, &grads)
                        .map_or(0.0, |t| t.into_scalar().elem());
                }
                // The divergence guard, before the update: every rank sees the same global
                // loss and gradients, so every rank stops at the same step.
                let loss = loss_sum / weight_total.max(1) as f64;
                let first = *first_loss.get_or_insert(loss);
                let mut scale = 1.0 / weight_total.max(1) as f64;
                // `torch.nn.utils.clip_grad_norm_`'s norm of the mean gradient.
                let norm = squared_norm.sqrt() * scale;
                let diverged = if loss > EXPLODING_LOSS_FACTOR * first.max(1.0) {
                    Some(Divergence::ExplodingLoss { loss, first })
                } else if !norm.is_finite() || norm > MAX_GRAD_NORM {
                    Some(Divergence::Gradients(norm))
                } else {
                    None
                };
                if let Some(cause) = diverged {
                    return Err(TrainError::Diverged {
                        cause,
                        step: self.state.global_step + 1,
                        epoch,
                    });
                }
                window_tokens += step_tokens;
                self.state.tokens_seen += step_tokens as u64;
                let grad_norm = s.clip_grad_norm.map(|max| {
                    scale *= (max / (norm + 1e-6)).min(1.0);
                    norm
                });
                let lr = s.lr
                    * s.schedule
                        .factor(self.state.global_step, self.state.total_steps);
                self.model = step::apply(
                    self.model,
                    grads,
                    &mut self.optimizer,
                    (lr, scale),
                    shard.as_ref(),
                );
                if let Some(shard) = &shard {
                    self.model = sharded_optimizer::gather_params(&world, self.model, shard)?;
                }
                self.state.global_step += 1;
                self.state.step_in_epoch += 1;
                losses.push(loss);
                progress.advance(
                    loss,
                    lr,
                    window_tokens as f64 / window_start.elapsed().as_secs_f64().max(1e-9),
                );

                if self
                    .state
                    .global_step
                    .is_multiple_of(s.log_every_n_steps.max(1))
                {
                    let elapsed = window_start.elapsed().as_secs_f64().max(1e-9);
                    let mut m: Metrics = vec![
                        ("step".into(), self.state.global_step as f64),
                        ("epoch".into(), epoch as f64),
                        ("loss".into(), loss),
                        ("lr".into(), lr),
                        ("tokens_per_second".into(), window_tokens as f64 / elapsed),
                    ];
                    if let Some(norm) = grad_norm {
                        m.push(("grad_norm".into(), norm));
                    }
                    for (k, v) in &extra {
                        m.push(((*k).into(), v / weight_total.max(1) as f64));
                    }
                    m.push(("peak_memory_bytes".into(), peak_memory_bytes() as f64));
                    // This rank's optimizer state: a 1/W share with a sharded optimizer.
                    m.push((
                        "optimizer_state_bytes".into(),
                        self.optimizer.state_bytes() as f64,
                    ));
                    self.loggers.log(self.state.global_step, &m)?;
                    last_metrics = m;
                    window_tokens = 0;
                    window_start = Instant::now();
                }
                if let Some(v) = validation.filter(|v| v.due(self.state.global_step)) {
                    let info = StepInfo {
                        global_step: self.state.global_step,
                        ..info
                    };
                    self.validate(v, loss_step, info, &progress)?;
                    validated_at = Some(self.state.global_step);
                }
                // The epoch-end save follows the last step of an epoch: no periodic one then.
                let epoch_done = self.state.step_in_epoch == steps_per_epoch;
                let periodic = !epoch_done
                    && s.save_every_n_steps
                        .is_some_and(|n| n > 0 && self.state.global_step.is_multiple_of(n));
                if periodic {
                    let optimizer = self.snapshot(shard.as_ref())?;
                    progress.suspend(|| {
                        saver.save(SaveKind::Periodic, &mut self.model, &optimizer, &self.state)
                    })?;
                }
                if let Some(signal) = stop {
                    progress.finish();
                    if s.save_on_preempt && !periodic {
                        let optimizer = self.snapshot(shard.as_ref())?;
                        saver.save(SaveKind::Preempt, &mut self.model, &optimizer, &self.state)?;
                    }
                    self.loggers.flush()?;
                    return Err(TrainError::Interrupted {
                        signal,
                        step: self.state.global_step,
                    });
                }
            }
            // Every epoch ends with a validation score, unless its last step just had one.
            if let Some(v) = validation
                && validated_at != Some(self.state.global_step)
            {
                let info = StepInfo {
                    epoch,
                    global_step: self.state.global_step,
                    seed: s.seed,
                };
                self.validate(v, loss_step, info, &progress)?;
                validated_at = Some(self.state.global_step);
            }
            progress.finish();
            self.state.epoch += 1;
            self.state.step_in_epoch = 0;
            let kind = if self.state.epoch == s.epochs {
                SaveKind::Final
            } else {
                SaveKind::EpochEnd
            };
            let optimizer = self.snapshot(shard.as_ref())?;
            saver.save(kind, &mut self.model, &optimizer, &self.state)?;
        }
        self.loggers.flush()?;
        Ok((
            TrainSummary {
                state: self.state,
                losses,
                last_metrics,
            },
            self.model,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(tokens: Vec<u32>, labels: Vec<i64>) -> Batch {
        let n = tokens.len();
        Batch {
            tokens,
            labels,
            position_ids: (0..n as u32).collect(),
            document_ids: None,
            batch_size: 1,
            seq_len: n,
            num_trained_tokens: n - 1,
        }
    }

    #[test]
    fn ids_past_the_vocabulary_are_an_error_naming_id_and_size() {
        assert!(check_vocabulary(&batch(vec![1, 2, 3], vec![-100, 2, 3]), 4, 0).is_ok());
        let err = check_vocabulary(&batch(vec![1, 7, 3], vec![-100, 2, 3]), 4, 2).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("token id 7") && msg.contains("4 entries") && msg.contains("step 3"));
        let err = check_vocabulary(&batch(vec![1, 2, 3], vec![-100, 9, 3]), 4, 0).unwrap_err();
        assert!(err.to_string().contains("token id 9"));
        assert!(check_vocabulary(&batch(vec![1, 2, 3], vec![-1, 2, 3]), 4, 0).is_err());
    }
}
