//! The metrics line of a step ([`metrics_line`]) and the window its throughput is measured
//! over ([`LogWindow`]).

use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;

use super::error::TrainError;
use super::metrics::{Metrics, peak_memory_bytes};
use super::optimizer::Optimizer;
use super::parallel::Parallelism;
use super::step_done::StepDone;
use super::trainer::Trainer;
use crate::models::CausalLm;

/// The running record of the steps since the last metrics line.
pub struct LogWindow {
    pub tokens: usize,
    start: Instant,
}

impl LogWindow {
    pub fn new() -> Self {
        Self {
            tokens: 0,
            start: Instant::now(),
        }
    }

    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.start.elapsed().as_secs_f64().max(1e-9)
    }
}

impl Default for LogWindow {
    fn default() -> Self {
        Self::new()
    }
}

/// What a metrics line reads besides the step.
pub struct LineOf<'a, B: AutodiffBackend> {
    pub step: usize,
    pub epoch: usize,
    pub window: &'a LogWindow,
    /// `log_peak_memory_stats`: with the memory metrics.
    pub memory: Option<MemoryOf<'a, B>>,
}

/// What the memory metrics read: what this rank holds.
pub struct MemoryOf<'a, B: AutodiffBackend> {
    pub model: &'a CausalLm<B>,
    pub optimizer: &'a Optimizer<B::InnerBackend>,
    pub parallel: &'a Parallelism,
}

impl<B: AutodiffBackend> Trainer<B> {
    /// The metrics line of the step just done, every `log_every_n_steps`.
    pub(super) fn log_step(
        &mut self,
        done: &StepDone,
        window: &mut LogWindow,
    ) -> Result<Metrics, TrainError> {
        let memory = self.settings.log_memory.then_some(MemoryOf {
            model: &self.model,
            optimizer: &self.optimizer,
            parallel: &self.parallel,
        });
        let line = metrics_line(
            done,
            LineOf {
                step: self.state.global_step,
                epoch: self.state.epoch,
                window,
                memory,
            },
        );
        self.loggers.log(self.state.global_step, &line)?;
        *window = LogWindow::new();
        Ok(line)
    }
}

/// The metrics line of the step just done, torchtune's names first.
pub fn metrics_line<B: AutodiffBackend>(done: &StepDone, of: LineOf<'_, B>) -> Metrics {
    let mut m: Metrics = vec![
        ("step".into(), of.step as f64),
        ("epoch".into(), of.epoch as f64),
        ("loss".into(), done.loss),
        ("lr".into(), done.lr),
        ("tokens_per_second".into(), of.window.tokens_per_second()),
    ];
    if let Some(norm) = done.grad_norm {
        m.push(("grad_norm".into(), norm));
    }
    m.extend(done.metrics.iter().map(|(k, v)| (k.to_string(), *v)));
    if let Some(memory) = of.memory {
        memory_metrics(done, memory, &mut m);
    }
    m
}

/// The step's memory: the process's peak, the device's, and what this rank holds of the
/// weights, gradients and optimizer state (and keeps in host memory, when offloading).
fn memory_metrics<B: AutodiffBackend>(done: &StepDone, of: MemoryOf<'_, B>, m: &mut Metrics) {
    let MemoryOf {
        model,
        optimizer,
        parallel,
    } = of;
    m.push(("peak_memory_bytes".into(), peak_memory_bytes() as f64));
    // On a GPU, the device's own memory, in GiB under torchtune's names.
    if let Some(device) = done.device_memory {
        let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
        m.push(("peak_memory_active".into(), gib(device.in_use)));
        m.push(("peak_memory_reserved".into(), gib(device.reserved)));
    }
    // This rank's weights: with FSDP its rows of each decoder layer, the rest whole.
    m.push(("parameter_bytes".into(), model.parameter_bytes() as f64));
    // This rank's gradients of the step: its rows of each with FSDP.
    m.push(("gradient_bytes".into(), done.gradient_bytes.device as f64));
    // This rank's optimizer state: a 1/W share with a sharded optimizer.
    m.push((
        "optimizer_state_bytes".into(),
        optimizer.state_bytes() as f64,
    ));
    // Activation offloading: the layer inputs one pass kept in host memory.
    if done.offloaded_activation_bytes > 0 {
        m.push((
            "offloaded_activation_bytes".into(),
            done.offloaded_activation_bytes as f64,
        ));
    }
    // FSDP's CPU offload: what this rank keeps in host memory instead.
    if let Some(offload) = parallel.offload() {
        m.push((
            "offloaded_parameter_bytes".into(),
            model.offloaded_parameter_bytes() as f64,
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
