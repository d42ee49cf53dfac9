//! The trainer core every recipe shares: epochs, gradient accumulation, clipping, optimizer
//! and schedule stepping, metrics, progress, the divergence guard, checkpoint triggers and
//! resume. A recipe supplies only its loss step and what to save.
//!
//! One optimizer step ([`Trainer::train_step`], which `tune bench` times too) is:
//! [`run_step`](Trainer::run_step) (every micro-batch's loss and gradients, summed, and with
//! several workers summed over the world), [`guard`](Trainer::guard) (the divergence guard and
//! the gradient's scale), and [`update`](Trainer::update) (clipping, the schedule's rate, the
//! optimizer). [`fit`](Trainer::fit) runs steps, then [`log_step`](Trainer::log_step),
//! validation and [`save_if_due`](Trainer::save_if_due) after each.
//!
//! Data parallelism lives here too: with a [`World`] of W workers each trains on its share of
//! every global batch, and one step is the single-device step on the whole batch: gradients
//! and the trained-token count are summed over the world before the loss normalisation,
//! clipping (on the global norm), the divergence guard and the optimizer step, which every
//! worker applies alike. A world of one skips every collective call.

use crate::training::metrics::MetricName;
use std::time::{Duration, Instant};

use burn::optim::GradientsParams;
use burn::tensor::ElementConversion;
use burn::tensor::backend::AutodiffBackend;

use super::error::{Divergence, EXPLODING_LOSS_FACTOR, MAX_GRAD_NORM, TrainError};
use super::fsdp;
use super::loss_step::{LossStep, StepInfo, check_vocabulary};
use super::metrics::{MetricLoggers, Metrics, peak_memory_bytes};
use super::offload::Offload;
use super::optimizer::Optimizer;
use super::progress::EpochProgress;
use super::save_hook::{OptimizerSnapshot, SaveHook, SaveKind, TrainState};
use super::schedule::Schedule;
use super::sharded_optimizer::{self, OptimizerShard};
use super::step::{self, GradAccumulator};
use super::step_totals::{DeviceSums, StepTotals};
use super::validation::Validation;
use crate::data::{Batch, DataLoader, Dataset};
use crate::distributed::{World, sync};
use crate::interrupt::Signal;
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
    /// Log the memory metrics with each step's (`log_peak_memory_stats`).
    pub log_memory: bool,
}

/// The outcome of `fit`, for the final report.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub state: TrainState,
    pub losses: Vec<f64>,
    pub last_metrics: Metrics,
}

/// Where a step's time went, measured when [`Trainer::time_phases`] is set.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// The loss steps' forward passes.
    pub forward: Duration,
    /// The backward passes and summing the micro-batches' gradients. A loss step that computes
    /// its gradients itself (activation checkpointing, the chunked output) interleaves them
    /// with its forward pass: all of its time counts here.
    pub backward: Duration,
    /// Clipping, the optimizer step and, with ZeRO-1, gathering the updated parameters.
    pub optimizer: Duration,
}

/// One optimizer step, done.
#[derive(Debug, Clone, PartialEq)]
pub struct StepDone {
    /// The mean loss over the step's units (over the world).
    pub loss: f64,
    pub lr: f64,
    /// The gradient norm before clipping, when clipping is on (as torchtune logs it).
    pub grad_norm: Option<f64>,
    /// Tokens for throughput (over the world).
    pub tokens: usize,
    /// The recipe's metrics, means over the step's units.
    pub metrics: Vec<(MetricName, f64)>,
    /// A stop signal came during the step (on any worker): the run ends after it.
    pub stop: Option<Signal>,
    /// With [`Trainer::time_phases`].
    pub times: Option<StepTimes>,
    /// Bytes of the step's gradients this rank held (with FSDP its rows of the sharded
    /// parameters'), on the device and, with FSDP's CPU offload, in host memory.
    pub gradient_bytes: GradientBytes,
    /// Activation offloading: the most bytes of layer inputs one pass of the step held in host
    /// memory (0 without it).
    pub offloaded_activation_bytes: usize,
    /// On a GPU: the most device memory the step's samples saw (`device::sample_device_memory`).
    pub device_memory: Option<crate::device::DeviceMemory>,
}

/// Where a step's gradients were held, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GradientBytes {
    pub device: usize,
    pub offloaded: usize,
}

/// A step's micro-batches run, before the update: its totals and summed gradients.
struct StepResult {
    totals: StepTotals,
    grads: GradientsParams,
    /// The squared norm of the summed gradients (`loss * weight` summed, not yet scaled).
    squared_norm: f64,
    gradient_bytes: GradientBytes,
}

/// What the guard lets through: the loss, the gradients' norm and the factor that turns the
/// summed gradients into the mean gradient.
struct Checked {
    loss: f64,
    norm: f64,
    scale: f64,
}

/// The running record of the steps since the last metrics line.
struct LogWindow {
    tokens: usize,
    start: Instant,
}

impl LogWindow {
    fn new() -> Self {
        Self {
            tokens: 0,
            start: Instant::now(),
        }
    }

    fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.start.elapsed().as_secs_f64().max(1e-9)
    }
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
    /// FSDP: every rank writes its own share of each checkpoint (its rows of the model and its
    /// optimizer state, `sharded_checkpoint`) instead of gathering them for rank 0.
    pub sharded_saves: bool,
    /// Measure [`StepTimes`], synchronising the device at each phase's end (a GPU then loses
    /// its overlap between phases: for benchmarks, not runs).
    pub time_phases: bool,
    /// The run's first loss, which the divergence guard compares every step's with.
    first_loss: Option<f64>,
    /// ZeRO-1's share of this rank, for a sharded optimizer on several workers.
    shard: Option<OptimizerShard>,
    /// FSDP's CPU offload: the optimizer state and step of the rows the model keeps in host
    /// memory (set with a model whose shards offload).
    pub offload: Option<Offload>,
}

impl<B: AutodiffBackend> Trainer<B> {
    /// A trainer at `state` (zero for a fresh run, a checkpoint's for a resume).
    pub fn new(
        settings: TrainerSettings,
        model: CausalLm<B>,
        optimizer: Optimizer<B::InnerBackend>,
        state: TrainState,
        loggers: MetricLoggers,
        show_progress: bool,
        world: World,
    ) -> Self {
        crate::device::watch_device_faults();
        Self {
            settings,
            model,
            optimizer,
            state,
            loggers,
            show_progress,
            world,
            save_optimizer_shards: false,
            sharded_saves: false,
            time_phases: false,
            first_loss: None,
            shard: None,
            offload: None,
        }
    }

    /// One optimizer step over `micro_batches` (gradient accumulation over them), exactly as
    /// [`fit`](Self::fit) runs each step: the loss step on each, the world's sums, the guard,
    /// clipping, the schedule's rate and the optimizer; the global step moves one on (the step
    /// in the epoch is the loop's: a GRPO step makes several updates). The
    /// trainer is taken and given back: the optimizer updates the model it owns, in place
    /// where no other reference holds a weight.
    pub fn train_step(
        mut self,
        micro_batches: &[Batch],
        loss_step: &mut dyn LossStep<B>,
    ) -> Result<(Self, StepDone), TrainError> {
        let mut times = self.time_phases.then(StepTimes::default);
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
        let world = self.world.clone();
        let device = self.model.device();
        // Reseeding per step makes dropout reproducible and resumable; each rank draws its
        // own masks (seed + rank, as torchtune seeds its ranks).
        let seed = self
            .settings
            .seed
            .wrapping_add(self.state.global_step as u64)
            .wrapping_add(world.rank as u64);
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
        if let Some(shards) = &self.model.shards {
            // FSDP: the layers' gradients, already summed over the world to this rank's rows.
            fsdp::check(&self.model)?;
            shards.take_grads::<B, _>(&self.model, &mut grads);
        }
        // On one device the gradient norm joins the same read.
        let squared_norm =
            (!world.is_distributed()).then(|| step::squared_grad_norm(&self.model, &grads));
        let gradient_bytes = GradientBytes {
            device: step::gradient_bytes(&self.model, &grads),
            offloaded: Offload::gradient_bytes(&self.model),
        };
        let (loss_sum, metrics, mut squared_norm) = sums.read(squared_norm.flatten());
        // FSDP's CPU offload: the rows' gradients are in host memory.
        let offloaded = |model: &CausalLm<B>| match self.offload {
            Some(_) => Offload::squared_grad_norm(model),
            None => 0.0,
        };
        if !world.is_distributed() {
            squared_norm += offloaded(&self.model);
        }
        let mut totals = StepTotals {
            weight,
            loss_sum,
            tokens,
            metrics,
            non_finite: !loss_sum.is_finite(),
            // A stop signal is acted on at the end of this step; every rank agrees on it
            // through the step's collective call.
            stop: crate::interrupt::requested(),
        };
        if world.is_distributed() {
            totals = totals.all_reduce::<B::InnerBackend>(&world, &device)?;
        }
        if totals.non_finite {
            return Err(TrainError::Diverged {
                cause: Divergence::NonFiniteLoss(totals.loss_sum),
                step: self.state.global_step + 1,
                epoch: self.state.epoch,
            });
        }
        if world.is_distributed() {
            grads = sync::all_reduce_grads(&world, &self.model, grads)?;
            // Whole gradients are the same on every rank; FSDP's rows are summed over ranks.
            let model = &self.model;
            let norm_of = |sharded: bool| {
                step::squared_grad_norm_of(model, &grads, |id| {
                    fsdp::is_sharded(model, id) == sharded
                })
                .map_or(0.0, |t| t.into_scalar().elem::<f64>())
            };
            squared_norm = norm_of(false);
            if model.shards.is_some() {
                let rows = norm_of(true) + offloaded(model);
                squared_norm += sync::all_reduce_scalars::<B::InnerBackend>(
                    &world,
                    &[rows],
                    &device,
                    "the gradient norm",
                )?[0];
            }
        }
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

    /// Clipping, the schedule's rate and the optimizer step (on this rank's share, then every
    /// rank gets every parameter, with ZeRO-1). Returns the rate and the clipped norm.
    fn update(
        mut self,
        grads: GradientsParams,
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
        self.model = step::apply(
            self.model,
            grads,
            &mut self.optimizer,
            (lr, scale),
            self.shard.as_ref(),
        );
        if let Some(offload) = &mut self.offload {
            offload.update(&self.model, (lr, scale), self.optimizer.step);
        }
        if let Some(shard) = &self.shard {
            self.model = sharded_optimizer::gather_params(&self.world, self.model, shard)?;
        }
        self.phase_end(started, &mut times, |t| &mut t.optimizer);
        Ok((self, lr, grad_norm))
    }

    /// Fails the run with the device thread's recorded failure, if any (`device::DeviceFault`),
    /// as a failure of `step`.
    fn check_device(&self, step: usize) -> Result<(), TrainError> {
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

    /// The metrics line of the step just done, every `log_every_n_steps`.
    fn log_step(&mut self, done: &StepDone, window: &mut LogWindow) -> Result<Metrics, TrainError> {
        let mut m: Metrics = vec![
            ("step".into(), self.state.global_step as f64),
            ("epoch".into(), self.state.epoch as f64),
            ("loss".into(), done.loss),
            ("lr".into(), done.lr),
            ("tokens_per_second".into(), window.tokens_per_second()),
        ];
        if let Some(norm) = done.grad_norm {
            m.push(("grad_norm".into(), norm));
        }
        m.extend(done.metrics.iter().map(|(k, v)| (k.to_string(), *v)));
        if self.settings.log_memory {
            self.memory_metrics(done, &mut m);
        }
        self.loggers.log(self.state.global_step, &m)?;
        *window = LogWindow::new();
        Ok(m)
    }

    /// The step's memory: the process's peak, the device's, and what this rank holds of the
    /// weights, gradients and optimizer state (and keeps in host memory, when offloading).
    fn memory_metrics(&self, done: &StepDone, m: &mut Metrics) {
        m.push(("peak_memory_bytes".into(), peak_memory_bytes() as f64));
        // On a GPU, the device's own memory, in GiB under torchtune's names.
        if let Some(device) = done.device_memory {
            let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
            m.push(("peak_memory_active".into(), gib(device.in_use)));
            m.push(("peak_memory_reserved".into(), gib(device.reserved)));
        }
        // This rank's weights: with FSDP its rows of each decoder layer, the rest whole.
        m.push((
            "parameter_bytes".into(),
            self.model.parameter_bytes() as f64,
        ));
        // This rank's gradients of the step: its rows of each with FSDP.
        m.push(("gradient_bytes".into(), done.gradient_bytes.device as f64));
        // This rank's optimizer state: a 1/W share with a sharded optimizer.
        m.push((
            "optimizer_state_bytes".into(),
            self.optimizer.state_bytes() as f64,
        ));
        // Activation offloading: the layer inputs one pass kept in host memory.
        if done.offloaded_activation_bytes > 0 {
            m.push((
                "offloaded_activation_bytes".into(),
                done.offloaded_activation_bytes as f64,
            ));
        }
        // FSDP's CPU offload: what this rank keeps in host memory instead.
        if let Some(offload) = &self.offload {
            m.push((
                "offloaded_parameter_bytes".into(),
                self.model.offloaded_parameter_bytes() as f64,
            ));
            m.push((
                "offloaded_optimizer_state_bytes".into(),
                offload.state_bytes() as f64,
            ));
            m.push((
                "offloaded_gradient_bytes".into(),
                done.gradient_bytes.offloaded as f64,
            ));
        }
    }

    /// The periodic save, every `save_every_n_steps` steps done (the epoch-end save follows the
    /// last step of an epoch: no periodic one then); returns whether it saved.
    fn save_if_due(
        &mut self,
        saver: &mut dyn SaveHook<B>,
        progress: &EpochProgress,
        steps_done: usize,
    ) -> Result<bool, TrainError> {
        let epoch_done = self.state.step_in_epoch == self.state.steps_per_epoch;
        let due = !epoch_done
            && self
                .settings
                .save_every_n_steps
                .is_some_and(|n| n > 0 && steps_done.is_multiple_of(n));
        if due {
            self.save(SaveKind::Periodic, saver, Some(progress))?;
        }
        Ok(due)
    }

    /// Hands the model, the optimizer and the state to the save hook, and says (rank 0) how
    /// long training waited for it: gathering what is written and the hand-over to the
    /// checkpoint client (the writing itself runs in the background; the client says when it
    /// is done).
    fn save(
        &mut self,
        kind: SaveKind,
        saver: &mut dyn SaveHook<B>,
        progress: Option<&EpochProgress>,
    ) -> Result<(), TrainError> {
        let started = Instant::now();
        // The weights about to be saved: every task that made them has run, and none failed.
        // (A sync that fails reports the failure cubecl's stream kept; a panicked task is the
        // recorded fault.)
        if let Err(e) = B::sync(&self.model.device()) {
            return Err(TrainError::DeviceFailed {
                fault: crate::device::DeviceFault {
                    message: e.to_string(),
                    count: 1,
                },
                step: self.state.global_step,
            });
        }
        self.check_device(self.state.global_step)?;
        if self.sharded_saves && self.model.shards.is_some() {
            self.save_shares(kind, saver, progress)?;
        } else {
            self.save_gathered(kind, saver, progress)?;
        }
        if self.world.is_main() {
            let line = format!(
                "checkpoint: training waited {:.3} s for the save at step {}",
                started.elapsed().as_secs_f64(),
                self.state.global_step
            );
            match progress {
                Some(p) => p.suspend(|| eprintln!("{line}")),
                None => eprintln!("{line}"),
            }
        }
        Ok(())
    }

    /// [`Self::save`] of a model and optimizer state gathered for rank 0 (or held whole).
    fn save_gathered(
        &mut self,
        kind: SaveKind,
        saver: &mut dyn SaveHook<B>,
        progress: Option<&EpochProgress>,
    ) -> Result<(), TrainError> {
        let optimizer = self.snapshot()?;
        // FSDP: every rank takes part in gathering the layers; rank 0's save hook, the one
        // that writes the model, gets them whole, and the other ranks keep nothing.
        let mut whole = match &self.model.shards {
            Some(_) if self.world.is_main() => Some(self.model.unsharded()),
            Some(_) => {
                self.model.join_unsharding();
                None
            }
            None => None,
        };
        fsdp::check(&self.model)?;
        let model = whole.as_mut().unwrap_or(&mut self.model);
        let mut save = || saver.save(kind, model, &optimizer, &self.state);
        match progress {
            Some(p) => p.suspend(save),
            None => save(),
        }
    }

    /// FSDP with sharded checkpoints: every rank's save hook gets the model as this rank holds
    /// it (its rows) and the optimizer state it holds, and writes its own share
    /// (`sharded_checkpoint`); nothing is gathered. The weights' health is decided with every
    /// rank first, so that all of them refuse an unhealthy save together.
    fn save_shares(
        &mut self,
        kind: SaveKind,
        saver: &mut dyn SaveHook<B>,
        progress: Option<&EpochProgress>,
    ) -> Result<(), TrainError> {
        if let Some(cause) = fsdp::unhealthy_weight(&self.model, &self.world)? {
            return Err(TrainError::Diverged {
                cause,
                step: self.state.global_step,
                epoch: self.state.epoch,
            });
        }
        let mut state = self.optimizer.state_dict();
        if let Some(offload) = &self.offload {
            state.extend(offload.state_dict());
        }
        let optimizer = OptimizerSnapshot {
            step: self.optimizer.step,
            state,
        };
        let mut save = || saver.save(kind, &mut self.model, &optimizer, &self.state);
        match progress {
            Some(p) => p.suspend(save),
            None => save(),
        }
    }

    /// The optimizer as a checkpoint holds it, for a recipe that saves a second trainer's
    /// model itself (PPO's value model).
    pub fn optimizer_snapshot(&self) -> Result<OptimizerSnapshot, TrainError> {
        self.snapshot()
    }

    /// The optimizer for a checkpoint: with a sharded state, this rank's share (when every rank
    /// writes its own) or the whole state gathered from every rank; otherwise the state on rank
    /// 0, the one that writes, and nothing elsewhere.
    fn snapshot(&self) -> Result<OptimizerSnapshot, TrainError> {
        let mut state = match &self.shard {
            Some(_) if self.save_optimizer_shards => self.optimizer.state_dict(),
            Some(_) => sharded_optimizer::gather_optimizer_state(
                &self.world,
                &self.model,
                &self.optimizer,
            )?,
            None if self.world.is_main() => self.optimizer.state_dict(),
            None => Vec::new(),
        };
        if self.model.shards.is_some() {
            // FSDP: a sharded parameter's moments are this rank's rows; the checkpoint holds
            // them whole.
            let sharded: std::collections::HashSet<String> = self
                .model
                .trainable_params()
                .into_iter()
                .filter(|p| fsdp::is_sharded(&self.model, &p.id))
                .map(|p| p.name)
                .collect();
            state.retain(|(key, _)| {
                let name = key
                    .strip_prefix("exp_avg_sq.")
                    .or_else(|| key.strip_prefix("exp_avg."))
                    .unwrap_or(key);
                !sharded.contains(name)
            });
            state.extend(fsdp::optimizer_state(
                &self.world,
                &self.model,
                &self.optimizer,
                self.offload.as_ref(),
            )?);
        }
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
        self.check_device(self.state.global_step)?;
        fsdp::check(&self.model)?;
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

    /// Optimizer steps per epoch: this rank's batches over the accumulation steps, at most
    /// `max_steps_per_epoch`; at least one, or the data is too little.
    pub fn steps_per_epoch(&self, loader: &DataLoader) -> Result<usize, TrainError> {
        let accum = self.settings.gradient_accumulation_steps.max(1);
        let batches = loader.num_batches_per_rank(self.world.size);
        let mut steps = batches / accum;
        if let Some(max) = self.settings.max_steps_per_epoch {
            steps = steps.min(max);
        }
        if steps == 0 {
            return Err(TrainError::TooLittleData {
                batches,
                batch_size: loader.config().batch_size,
                accum,
            });
        }
        Ok(steps)
    }

    /// Runs training from `self.state` (zero for a fresh run, a checkpoint's for a resume) on
    /// `data`'s batches: each step one optimizer update over `gradient_accumulation_steps`
    /// micro-batches, validation when due.
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
        if self.settings.shard_optimizer && self.world.is_distributed() {
            let shard = OptimizerShard::new(&self.model, &self.world);
            // A resumed run restores the whole state; each rank keeps its share.
            self.optimizer.retain(|name| shard.owns(name));
            self.shard = Some(shard);
        }
        // FSDP: a resumed run's whole moments keep this rank's rows.
        fsdp::keep_own_rows(&self.model, &mut self.optimizer);
        if let Some(offload) = &mut self.offload {
            offload.adopt_state(&self.model, &mut self.optimizer);
        }
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
                self.show_progress,
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
                    let info = StepInfo {
                        epoch,
                        global_step: self.state.global_step,
                        seed: self.settings.seed,
                    };
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
                let info = StepInfo {
                    epoch,
                    global_step: self.state.global_step,
                    seed: self.settings.seed,
                };
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

/// What the steps of [`Trainer::run`] are and how many an epoch holds: [`Batches`] of a
/// dataset (every SFT, DPO, KD and QAT recipe), or GRPO's rollouts (`training::grpo`).
pub trait EpochSteps<B: AutodiffBackend> {
    /// Steps per epoch on this rank; an error when the data makes none.
    fn steps_per_epoch(&self, trainer: &Trainer<B>) -> Result<usize, TrainError>;

    /// Runs step `index` of `epoch`: one or more optimizer updates
    /// ([`Trainer::train_step`]), the global step moving on with each; the loop moves the
    /// step in the epoch on.
    fn step(
        &mut self,
        trainer: Trainer<B>,
        epoch: usize,
        index: usize,
    ) -> Result<(Trainer<B>, StepDone), TrainError>;

    /// Optimizer updates per step (the schedule runs over all of them): 1, or GRPO's
    /// `ppo_epochs`.
    fn updates_per_step(&self) -> usize {
        1
    }

    /// Stop after this many steps over all epochs (GRPO's `num_steps`), with the final save.
    fn max_steps(&self) -> Option<usize> {
        None
    }

    /// The optimizer updates the learning-rate schedule spans, when not every epoch's
    /// (PPO's: its `num_steps` steps' updates, as torchtune's `lr_steps`).
    fn schedule_steps(&self, _steps_per_epoch: usize) -> Option<usize> {
        None
    }

    /// Save at the end of every this many epochs (GRPO's `save_every_n_epochs`); the last
    /// epoch always saves.
    fn save_every_n_epochs(&self) -> usize {
        1
    }

    /// The validation set and the loss step that scores it, when there is one.
    fn validation(&mut self) -> Option<(&Validation, &mut dyn LossStep<B>)> {
        None
    }
}

/// A dataset's batches: each step collates `gradient_accumulation_steps` micro-batches of
/// this rank's share and makes one update over them.
pub struct Batches<'a, B: AutodiffBackend> {
    pub data: &'a Dataset,
    pub loader: &'a DataLoader,
    pub loss_step: &'a mut dyn LossStep<B>,
    pub validation: Option<&'a Validation>,
    /// This rank's batches of the epoch being run (drawn once per epoch).
    epoch: crate::data::EpochBatches,
}

impl<'a, B: AutodiffBackend> Batches<'a, B> {
    pub fn new(
        data: &'a Dataset,
        loader: &'a DataLoader,
        loss_step: &'a mut dyn LossStep<B>,
        validation: Option<&'a Validation>,
    ) -> Self {
        Self {
            data,
            loader,
            loss_step,
            validation,
            epoch: Default::default(),
        }
    }
}

impl<B: AutodiffBackend> EpochSteps<B> for Batches<'_, B> {
    fn steps_per_epoch(&self, trainer: &Trainer<B>) -> Result<usize, TrainError> {
        trainer.steps_per_epoch(self.loader)
    }

    fn step(
        &mut self,
        trainer: Trainer<B>,
        epoch: usize,
        index: usize,
    ) -> Result<(Trainer<B>, StepDone), TrainError> {
        let accum = trainer.settings.gradient_accumulation_steps.max(1);
        let world = &trainer.world;
        let batches = self
            .epoch
            .batches(self.loader, epoch, world.rank, world.size);
        let first = index * accum;
        let micro_batches = batches[first..first + accum]
            .iter()
            .map(|indices| self.data.collate(indices))
            .collect::<Result<Vec<_>, _>>()?;
        trainer.train_step(&micro_batches, &mut *self.loss_step)
    }

    fn validation(&mut self) -> Option<(&Validation, &mut dyn LossStep<B>)> {
        let v = self.validation?;
        Some((v, &mut *self.loss_step))
    }
}
