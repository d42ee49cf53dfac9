//! What one optimizer step adds up over its micro-batches, and with several workers over the
//! world: its loss, the units the loss is a mean over, the tokens it trained, the recipe's
//! metrics, and whether a loss went non-finite or a stop signal came. Summed on the device
//! while the micro-batches run ([`DeviceSums`]), read once per step, then summed over the
//! world in one collective call ([`StepTotals::all_reduce`]).

use crate::training::metrics::MetricName;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::distributed::{DistributedError, World, sync};
use crate::interrupt::Signal;

/// A step's loss and metrics summed over its micro-batches, each weighted by its size, as
/// device tensors: read once per step, so a GPU does not wait for the host in between.
pub struct DeviceSums<B: Backend> {
    loss: Option<Tensor<B, 1>>,
    metrics: Vec<(&'static str, Tensor<B, 1>)>,
}

impl<B: Backend> Default for DeviceSums<B> {
    fn default() -> Self {
        Self {
            loss: None,
            metrics: Vec::new(),
        }
    }
}

impl<B: Backend> DeviceSums<B> {
    pub fn add(
        &mut self,
        loss: Tensor<B, 1>,
        metrics: Vec<(&'static str, Tensor<B, 1>)>,
        weight: f64,
    ) {
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
    pub fn read(self, extra: Option<Tensor<B, 1>>) -> (f64, Vec<(MetricName, f64)>, f64) {
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
        let metrics = names
            .into_iter()
            .map(MetricName::Borrowed)
            .zip(values[1..].iter().copied())
            .collect();
        (values[0], metrics, extra)
    }
}

/// One step's totals on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct StepTotals {
    /// The units the loss is a mean over (tokens for SFT, pairs for DPO).
    pub weight: usize,
    /// The loss summed over those units.
    pub loss_sum: f64,
    /// Tokens for throughput (see `StepOutput::tokens`).
    pub tokens: usize,
    /// The recipe's metrics, summed weighted by micro-batch weight, by name.
    pub metrics: Vec<(MetricName, f64)>,
    /// This worker's loss sum was not finite, or (after the all-reduce) some worker's was.
    pub non_finite: bool,
    /// The stop signal seen on this worker, or (after the all-reduce) on any.
    pub stop: Option<Signal>,
}

impl StepTotals {
    /// The step's loss: the mean over its units.
    pub fn loss(&self) -> f64 {
        self.loss_sum / self.weight.max(1) as f64
    }

    /// The metrics as means over the step's units.
    pub fn metric_means(&self) -> Vec<(MetricName, f64)> {
        let weight = self.weight.max(1) as f64;
        self.metrics
            .iter()
            .map(|(k, v)| (k.clone(), v / weight))
            .collect()
    }

    /// The totals of every worker summed, in one collective call: one step over the global
    /// batch. A non-finite loss or a stop signal on any worker is every worker's (a signal to
    /// another node reads as SIGTERM). Every worker holds the same metric names, since they
    /// run the same loss step.
    pub fn all_reduce<B: Backend>(
        self,
        world: &World,
        device: &B::Device,
    ) -> Result<Self, DistributedError> {
        if !world.is_distributed() {
            return Ok(self);
        }
        let flag = |on: bool| f64::from(u8::from(on));
        let mut local = vec![
            self.weight as f64,
            self.loss_sum,
            self.tokens as f64,
            flag(self.non_finite),
            flag(self.stop.is_some()),
        ];
        local.extend(self.metrics.iter().map(|(_, v)| *v));
        let global = sync::all_reduce_scalars::<B>(
            world,
            &local,
            device,
            "the step's token count and loss",
        )?;
        let [weight, loss_sum, tokens, non_finite, stop] = [0, 1, 2, 3, 4].map(|i| global[i]);
        Ok(Self {
            weight: weight.round() as usize,
            loss_sum,
            tokens: tokens.round() as usize,
            metrics: self
                .metrics
                .iter()
                .zip(&global[5..])
                .map(|((k, _), v)| (k.clone(), *v))
                .collect(),
            non_finite: non_finite > 0.0,
            stop: self.stop.or((stop > 0.0).then_some(Signal::Terminate)),
        })
    }
}
