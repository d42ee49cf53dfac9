//! The trainer core every recipe shares: epochs, gradient accumulation, clipping, optimizer
//! and schedule stepping, metrics, progress, the divergence guard, checkpoint triggers and
//! resume. A recipe supplies only its loss step and what to save.
//!
//! One optimizer step ([`Trainer::train_step`], which `tune bench` times too) is:
//! [`run_step`](Trainer::run_step) (every micro-batch's loss and gradients, summed, and with
//! several workers summed over the world), [`guard`](Trainer::guard) (the divergence guard and
//! the gradient's scale), and [`update`](Trainer::update) (clipping, the schedule's rate, the
//! optimizer). [`run`](Trainer::run) runs steps, then the metrics line, validation and the
//! periodic save after each.
//!
//! What the world's size changes (summing over the workers, sharded weights and optimizer
//! state, who writes a checkpoint) is the [`Parallelism`]'s, given whole at construction: the
//! trainer runs the single-device step on the whole global batch whatever it is.

use std::time::{Duration, Instant};

use burn::tensor::backend::AutodiffBackend;

use super::epoch_steps::{Batches, EpochSteps, steps_per_epoch};
use super::error::{Divergence, EXPLODING_LOSS_FACTOR, MAX_GRAD_NORM, TrainError};
use super::loss_step::{LossStep, StepInfo, check_vocabulary};
use super::metrics::{MetricLoggers, Metrics};
use super::optimizer::Optimizer;
use super::parallel::Parallelism;
use super::progress::EpochProgress;
use super::save_hook::{SaveHook, SaveKind, TrainState};
use super::schedule::Schedule;
use super::step::GradAccumulator;
use super::step_done::{StepDone, StepTimes};
use super::step_log::LogWindow;
use super::step_totals::{DeviceSums, StepTotals};
use super::validation::Validation;
use crate::data::{Batch, DataLoader, Dataset};
use crate::distributed::World;
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
    /// On a stop signal, save a checkpoint at the step boundary before returning.
    pub save_on_preempt: bool,
    /// Log the memory metrics with each step's (`log_peak_memory_stats`).
    pub log_memory: bool,
    /// Show the progress bar (rank 0 of a run).
    pub show_progress: bool,
    /// Measure [`StepTimes`], synchronising the device at each phase's end (a GPU then loses
    /// its overlap between phases: for benchmarks, not runs).
    pub time_phases: bool,
}

/// The outcome of `fit`, for the final report.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub state: TrainState,
    pub losses: Vec<f64>,
    pub last_metrics: Metrics,
}

/// A step's micro-batches run, before the update: its totals and summed gradients.
struct StepResult {
    totals: StepTotals,
    grads: burn::optim::GradientsParams,
    /// The squared norm of the summed gradients (`loss * weight` summed, not yet scaled).
    squared_norm: f64,
    gradient_bytes: super::parallel::GradientBytes,
}

/// What the guard lets through: the loss, the gradients' norm and the factor that turns the
/// summed gradients into the mean gradient.
struct Checked {
    loss: f64,
    norm: f64,
    scale: f64,
}

pub struct Trainer<B: AutodiffBackend> {
    pub settings: TrainerSettings,
    pub model: CausalLm<B>,
    pub optimizer: Optimizer<B::InnerBackend>,
    pub state: TrainState,
    pub(super) loggers: MetricLoggers,
    pub(super) parallel: Parallelism,
    /// The run's first loss, which the divergence guard compares every step's with.
    first_loss: Option<f64>,
}

impl<B: AutodiffBackend> Trainer<B> {
    /// A trainer at `state` (zero for a fresh run, a checkpoint's for a resume), its workers
    /// dividing the work as `parallel` says; a resumed optimizer state is kept as this rank
    /// holds it.
    pub fn new(
        settings: TrainerSettings,
        model: CausalLm<B>,
        mut optimizer: Optimizer<B::InnerBackend>,
        state: TrainState,
        loggers: MetricLoggers,
        mut parallel: Parallelism,
    ) -> Self {
        crate::device::watch_device_faults();
        parallel.adopt(&model, &mut optimizer);
        Self {
            settings,
            model,
            optimizer,
            state,
            loggers,
            parallel,
            first_loss: None,
        }
    }

    /// This worker's place among the data-parallel workers (a world of one on one device).
    pub fn world(&self) -> &World {
        self.parallel.world()
    }

    /// How the workers divide the work.
    pub fn parallelism(&self) -> &Parallelism {
        &self.parallel
    }

    /// One optimizer step over `micro_batches` (gradient accumulation over them), exactly as
    /// [`run`](Self::run) runs each step: the loss step on each, the world's sums, the guard,
    /// clipping, the schedule's rate and the optimizer; the global step moves one on (the step
    /// in the epoch is the loop's: a GRPO step makes several updates). The trainer is taken
    /// and given back: the optimizer updates the model it owns, in place where no other
    /// reference holds a weight.
    pub fn train_step(
        mut self,
        micro_batches: &[Batch],
        loss_step: &mut dyn LossStep<B>,
    ) -> Result<(Self, StepDone), TrainError> {
        let mut times = self.settings.time_phases.then(StepTimes::default);
        super::activation_checkpointing::take_offloaded_bytes();
        crate::device::take_device_peak();
        let step = self.run_step(micro_batches, loss_step, times.as_mut())?;
        // The step's read has waited for the device: a task that failed there (the previous
        // step's update included) has been recorded by now.
        self.check_device(self.state.global_step + 1)?;
        let offloaded_activation_bytes = super::activation_checkpointing::take_offloaded_bytes();
        let checked = self.guard(&step)?;
        let (mut trainer, lr, grad_norm) = self.update(step.grads, &checked, times.as_mut())?;
        crate::device::sample_device_memory(&trainer.model.device());
        trainer.state.global_step += 1;
        trainer.state.tokens_seen += step.totals.tokens as u64;
        let done = StepDone {
            loss: checked.loss,
            lr,
            grad_norm,
            tokens: step.totals.tokens,
            metrics: step.totals.metric_means(),
            stop: step.totals.stop,
            times,
            gradient_bytes: step.gradient_bytes,
            offloaded_activation_bytes,
            device_memory: crate::device::take_device_peak(),
        };
        Ok((trainer, done))
    }

    /// Every micro-batch's loss and gradients, summed (each weighted by its size, so the sum
    /// divided by the total weight is the step's mean gradient, as torchtune normalises it),
    /// then summed over the world with the step's totals.
    fn run_step(
        &mut self,
        micro_batches: &[Batch],
        loss_step: &mut dyn LossStep<B>,
        mut times: Option<&mut StepTimes>,
    ) -> Result<StepResult, TrainError> {
        let device = self.model.device();
        // Reseeding per step makes dropout reproducible and resumable; each rank draws its
        // own masks (seed + rank, as torchtune seeds its ranks).
        let seed = self
            .settings
            .seed
            .wrapping_add(self.state.global_step as u64)
            .wrapping_add(self.world().rank as u64);
        let info = StepInfo {
            epoch: self.state.epoch,
            global_step: self.state.global_step,
            seed,
        };
        crate::modules::dropout::seed_thread(seed);
        let mut accumulator = GradAccumulator::<B>::default();
        // The loss and metric sums stay on the device until the step's one read below: a read
        // per micro-batch would make a GPU wait for the host.
        let mut sums = DeviceSums::<B::InnerBackend>::default();
        let (mut weight, mut tokens) = (0usize, 0usize);
        for batch in micro_batches {
            check_vocabulary(batch, self.model.args.vocab_size, self.state.global_step)?;
            let started = Instant::now();
            let mut out = loss_step.step(&self.model, batch, info)?;
            // The forward's activations are alive here (unless the step ran its own backward).
            crate::device::sample_device_memory(&device);
            let own_grads = out.grads.is_some();
            let forward_end = self.phase_end(started, &mut times, |t| {
                if own_grads {
                    &mut t.backward
                } else {
                    &mut t.forward
                }
            });
            for grads in out.take_gradients() {
                accumulator.add(&self.model, grads);
            }
            crate::device::sample_device_memory(&device);
            self.phase_end(forward_end, &mut times, |t| &mut t.backward);
            sums.add(out.loss.inner(), out.metrics, out.weight as f64);
            weight += out.weight;
            tokens += out.tokens;
        }
        let mut grads = accumulator.take();
        self.parallel.take_layer_grads(&self.model, &mut grads)?;
        let local_norm = self.parallel.local_norm(&self.model, &grads);
        let gradient_bytes = self.parallel.gradient_bytes(&self.model, &grads);
        let (loss_sum, metrics, local_norm) = sums.read(local_norm);
        let totals = StepTotals {
            weight,
            loss_sum,
            tokens,
            metrics,
            non_finite: !loss_sum.is_finite(),
            // A stop signal is acted on at the end of this step; every rank agrees on it
            // through the step's collective call.
            stop: crate::interrupt::requested(),
        };
        let totals = self.parallel.sum_totals::<B>(totals, &device)?;
        if totals.non_finite {
            return Err(TrainError::Diverged {
                cause: Divergence::NonFiniteLoss(totals.loss_sum),
                step: self.state.global_step + 1,
                epoch: self.state.epoch,
            });
        }
        let (grads, squared_norm) = self.parallel.sum_grads(&self.model, grads, local_norm)?;
        Ok(StepResult {
            totals,
            grads,
            squared_norm,
            gradient_bytes,
        })
    }

    /// The divergence guard, before the update: every rank sees the same global loss and
    /// gradients, so every rank stops at the same step.
    fn guard(&mut self, step: &StepResult) -> Result<Checked, TrainError> {
        let loss = step.totals.loss();
        let first = *self.first_loss.get_or_insert(loss);
        let scale = 1.0 / step.totals.weight.max(1) as f64;
        // `torch.nn.utils.clip_grad_norm_`'s norm of the mean gradient.
        let norm = step.squared_norm.sqrt() * scale;
        let diverged = if loss > EXPLODING_LOSS_FACTOR * first.max(1.0) {
            Some(Divergence::ExplodingLoss { loss, first })
        } else if !norm.is_finite() || norm > MAX_GRAD_NORM {
            Some(Divergence::Gradients(norm))
        } else {
            None
        };
        match diverged {
            Some(cause) => Err(TrainError::Diverged {
                cause,
                step: self.state.global_step + 1,
                epoch: self.state.epoch,
            }),
            None => Ok(Checked { loss, norm, scale }),
        }
    }

    /// Clipping, the schedule's rate and the optimizer step (as the parallelism runs it).
    /// Returns the rate and the clipped norm. The trainer is taken and given back: the model
    /// moves into the update, which changes it in place where nothing else holds a weight.
    fn update(
        mut self,
        grads: burn::optim::GradientsParams,
        checked: &Checked,
        mut times: Option<&mut StepTimes>,
    ) -> Result<(Self, f64, Option<f64>), TrainError> {
        let started = Instant::now();
        let s = &self.settings;
        let mut scale = checked.scale;
        let grad_norm = s.clip_grad_norm.map(|max| {
            scale *= (max / (checked.norm + 1e-6)).min(1.0);
            checked.norm
        });
        let lr = s.lr
            * s.schedule
                .factor(self.state.global_step, self.state.total_steps);
        let model = self.model;
        self.model = self
            .parallel
            .update(model, grads, &mut self.optimizer, (lr, scale))?;
        self.phase_end(started, &mut times, |t| &mut t.optimizer);
        Ok((self, lr, grad_norm))
    }

    /// Fails the run with the device thread's recorded failure, if any (`device::DeviceFault`),
    /// as a failure of `step`.
    pub(super) fn check_device(&self, step: usize) -> Result<(), TrainError> {
        match crate::device::take_device_fault() {
            Some(fault) => Err(TrainError::DeviceFailed { fault, step }),
            None => Ok(()),
        }
    }

    /// With phase timing, waits for the device and adds the time since `since` to the phase
    /// `field` picks; returns now.
    fn phase_end(
        &self,
        since: Instant,
        times: &mut Option<&mut StepTimes>,
        field: impl FnOnce(&mut StepTimes) -> &mut Duration,
    ) -> Instant {
        let Some(t) = times.as_deref_mut() else {
            return since;
        };
        // A GPU backend queues its kernels: wait for them, so each phase gets its own time.
        // A task that failed on the device is recorded there and stops the step at its check
        // (`check_device`), whatever this returns.
        let _ = B::sync(&self.model.device());
        let now = Instant::now();
        *field(t) += now - since;
        now
    }

    /// Optimizer steps per epoch of `loader`'s batches on this world (see
    /// [`steps_per_epoch`]).
    pub fn steps_per_epoch(&self, loader: &DataLoader) -> Result<usize, TrainError> {
        steps_per_epoch(&self.settings, loader, self.world().size)
    }

    /// Runs training from `self.state` on `data`'s batches: each step one optimizer update
    /// over `gradient_accumulation_steps` micro-batches, validation when due.
    pub fn fit(
        self,
        data: &Dataset,
        loader: &DataLoader,
        loss_step: &mut dyn LossStep<B>,
        saver: &mut dyn SaveHook<B>,
        validation: Option<&Validation>,
    ) -> Result<(TrainSummary, CausalLm<B>), TrainError> {
        let mut batches = Batches::new(data, loader, loss_step, validation);
        self.run(&mut batches, saver)
    }

    /// Runs training from `self.state` over the steps `steps` makes: epochs of steps, the
    /// metrics line, validation, periodic, epoch-end and final checkpoints, and the stop
    /// signal's checkpoint, whatever a step is.
    pub fn run(
        mut self,
        steps: &mut dyn EpochSteps<B>,
        saver: &mut dyn SaveHook<B>,
    ) -> Result<(TrainSummary, CausalLm<B>), TrainError> {
        super::memory::enter_training_steady_state();
        let steps_per_epoch = steps.steps_per_epoch(&self)?;
        self.state.steps_per_epoch = steps_per_epoch;
        self.state.total_steps = steps
            .schedule_steps(steps_per_epoch)
            .unwrap_or(steps_per_epoch * self.settings.epochs * steps.updates_per_step());
        let save_every_epochs = steps.save_every_n_epochs().max(1);
        let max_steps = steps.max_steps();
        let mut losses = Vec::new();
        let mut last_metrics = Metrics::new();
        let mut validated_at: Option<usize> = None;
        // Steps run since the start of training (over every epoch, a resumed run's included):
        // what logging, `save_every_n_steps` and `num_steps` count.
        let steps_done =
            |state: &TrainState| state.epoch * state.steps_per_epoch + state.step_in_epoch;

        while self.state.epoch < self.settings.epochs {
            let epoch = self.state.epoch;
            let mut progress = EpochProgress::new(
                epoch,
                steps_per_epoch,
                self.state.step_in_epoch,
                self.settings.show_progress,
            );
            let mut window = LogWindow::new();
            let mut reached_max = false;
            while self.state.step_in_epoch < steps_per_epoch {
                let index = self.state.step_in_epoch;
                let done;
                (self, done) = steps.step(self, epoch, index)?;
                self.state.step_in_epoch += 1;
                window.tokens += done.tokens;
                losses.push(done.loss);
                progress.advance(done.loss, done.lr, window.tokens_per_second());
                let done_so_far = steps_done(&self.state);
                if done_so_far.is_multiple_of(self.settings.log_every_n_steps.max(1)) {
                    last_metrics = self.log_step(&done, &mut window)?;
                }
                if let Some((v, loss_step)) = steps
                    .validation()
                    .filter(|(v, _)| v.due(self.state.global_step))
                {
                    let info = self.validation_info(epoch);
                    self.validate(v, loss_step, info, &progress)?;
                    validated_at = Some(self.state.global_step);
                }
                reached_max = max_steps.is_some_and(|max| done_so_far >= max);
                let saved = !reached_max && self.save_if_due(saver, &progress, done_so_far)?;
                if let Some(signal) = done.stop {
                    progress.finish();
                    if self.settings.save_on_preempt && !saved {
                        self.save(SaveKind::Preempt, saver, None)?;
                    }
                    self.loggers.flush()?;
                    return Err(TrainError::Interrupted {
                        signal,
                        step: self.state.global_step,
                    });
                }
                if reached_max {
                    break;
                }
            }
            // Every epoch ends with a validation score, unless its last step just had one.
            if let Some((v, loss_step)) = steps.validation()
                && validated_at != Some(self.state.global_step)
            {
                let info = self.validation_info(epoch);
                self.validate(v, loss_step, info, &progress)?;
                validated_at = Some(self.state.global_step);
            }
            progress.finish();
            self.state.epoch += 1;
            self.state.step_in_epoch = 0;
            let last = self.state.epoch == self.settings.epochs || reached_max;
            if last {
                self.save(SaveKind::Final, saver, None)?;
                break;
            }
            if self.state.epoch.is_multiple_of(save_every_epochs) {
                self.save(SaveKind::EpochEnd, saver, None)?;
            }
        }
        self.loggers.flush()?;
        // With FSDP the model stays this rank's shards: `unsharded()` gathers it (every rank
        // taking part) for a caller that needs the whole weights.
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
