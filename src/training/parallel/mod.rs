//! How a run's workers divide the work: one [`Parallelism`] value, built by setup, that owns
//! everything the world's size changes about a step and a save. The trainer calls it and knows
//! nothing of FSDP, ZeRO-1 or offload.
//!
//! - Single device: a world of one, every weight whole; each method is the identity.
//! - Replicated (several workers, whole weights): gradients all-reduced; with ZeRO-1
//!   ([`sharded_optimizer`], full-weight training) each rank updates its share of the
//!   parameters and the others' are gathered after the update.
//! - Fully sharded ([`fsdp`]): each rank holds a dim-0 slice of every weight; the layers'
//!   gradients arrive reduce-scattered to this rank's rows, the rest are all-reduced; with CPU
//!   offload ([`offload`]) the rows, their gradients and their optimizer state live in host
//!   memory.
//!
//! Checkpoints ([`Saves`], decided with the rest): rank 0 writes everything, gathered from the
//! other ranks; or every rank writes its own optimizer shard (ZeRO-1, [`optimizer_shards`]) or
//! its own rows (FSDP, [`sharded_checkpoint`]) into a directory they all see.
//!
//! Invariant: one step is the single-device step on the whole global batch, whatever the
//! parallelism: the same loss normalisation, global gradient norm, clipping and update on
//! every rank.

pub mod fsdp;
pub mod offload;
pub mod optimizer_shards;
mod saves;
pub mod sharded_checkpoint;
pub mod sharded_optimizer;

use burn::optim::GradientsParams;
use burn::tensor::ElementConversion;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use super::error::{Divergence, TrainError};
use super::optimizer::{Optimizer, OptimizerSettings};
use super::save_hook::OptimizerSnapshot;
use super::step;
use super::step_totals::StepTotals;
use crate::distributed::{World, sync};
use crate::models::CausalLm;

pub use fsdp::Sharding;
pub use offload::Offload;
pub use saves::{RankWriter, SaveConditions, Saves};
use sharded_optimizer::OptimizerShard;

/// How the run's workers hold the weights and write its checkpoints.
pub struct Parallelism {
    world: World,
    /// ZeRO-1 (full-weight training on several workers): this rank's share of the whole
    /// trainable parameters, whose optimizer state it keeps and updates (FSDP's rows are every
    /// rank's own anyway).
    zero1: Option<OptimizerShard>,
    /// FSDP's CPU offload: the rows, their gradients and optimizer state in host memory.
    offload: Option<Offload>,
    saves: Saves,
}

/// Where a step's gradients were held, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GradientBytes {
    pub device: usize,
    pub offloaded: usize,
}

impl Parallelism {
    /// One device (a world of one), every weight whole.
    pub fn single() -> Self {
        Self {
            world: World::single(),
            zero1: None,
            offload: None,
            saves: Saves::Gathered,
        }
    }

    /// `model` on `world`: with `fsdp`, each rank keeps its rows of every weight (already, when
    /// it was loaded so), in host memory with `cpu_offload` (their optimizer step then runs
    /// there with `optimizer`'s settings); with `zero1` on several workers, each rank keeps the
    /// optimizer state of its share of the whole trainable parameters.
    pub fn new<B: AutodiffBackend>(
        model: CausalLm<B>,
        world: World,
        fsdp: Option<Sharding>,
        zero1: bool,
        optimizer: &OptimizerSettings,
    ) -> (CausalLm<B>, Self) {
        let (model, offload) = match fsdp {
            Some(sharding) => (
                fsdp::shard_model(model, &world, sharding),
                sharding
                    .cpu_offload
                    .then(|| Offload::new(optimizer.clone())),
            ),
            None => (model, None),
        };
        let zero1 = (zero1 && world.is_distributed()).then(|| OptimizerShard::new(&model, &world));
        let parallel = Self {
            world,
            zero1,
            offload,
            saves: Saves::Gathered,
        };
        (model, parallel)
    }

    /// The same, writing checkpoints as `saves` says.
    pub fn with_saves(mut self, saves: Saves) -> Self {
        self.saves = saves;
        self
    }

    pub fn world(&self) -> &World {
        &self.world
    }

    pub fn saves(&self) -> Saves {
        self.saves
    }

    /// FSDP's CPU offload, when the rows live in host memory.
    pub fn offload(&self) -> Option<&Offload> {
        self.offload.as_ref()
    }

    /// Whether the optimizer state is sharded (ZeRO-1).
    pub fn shards_optimizer(&self) -> bool {
        self.zero1.is_some()
    }

    /// A resumed optimizer state as this rank keeps it: ZeRO-1's share, FSDP's rows (whatever
    /// world size wrote it), an offloaded row's state moved to host memory.
    pub fn adopt<B: AutodiffBackend>(
        &mut self,
        model: &CausalLm<B>,
        optimizer: &mut Optimizer<B::InnerBackend>,
    ) {
        if let Some(shard) = &self.zero1 {
            optimizer.retain(|name| shard.owns(name));
        }
        fsdp::keep_own_rows(model, optimizer);
        if let Some(offload) = &mut self.offload {
            offload.adopt_state(model, optimizer);
        }
    }

    /// The layers' gradients FSDP reduce-scattered to this rank's rows, added to `grads`.
    pub fn take_layer_grads<B: AutodiffBackend>(
        &self,
        model: &CausalLm<B>,
        grads: &mut GradientsParams,
    ) -> Result<(), TrainError> {
        if let Some(shards) = &model.shards {
            fsdp::check(model)?;
            shards.take_grads::<B, _>(model, grads);
        }
        Ok(())
    }

    /// On one device, the gradients' squared norm as a tensor, so that it joins the step's one
    /// read from the device (with several workers it is taken after the world's sum).
    pub fn local_norm<B: AutodiffBackend>(
        &self,
        model: &CausalLm<B>,
        grads: &GradientsParams,
    ) -> Option<Tensor<B::InnerBackend, 1>> {
        (!self.world.is_distributed())
            .then(|| step::squared_grad_norm(model, grads))
            .flatten()
    }

    /// This rank's bytes of the step's gradients (FSDP: its rows), on the device and offloaded.
    pub fn gradient_bytes<B: AutodiffBackend>(
        &self,
        model: &CausalLm<B>,
        grads: &GradientsParams,
    ) -> GradientBytes {
        GradientBytes {
            device: step::gradient_bytes(model, grads),
            offloaded: Offload::gradient_bytes(model),
        }
    }

    /// The step's totals summed over the world (one collective call; nothing on one device).
    pub fn sum_totals<B: AutodiffBackend>(
        &self,
        totals: StepTotals,
        device: &B::Device,
    ) -> Result<StepTotals, TrainError> {
        if !self.world.is_distributed() {
            return Ok(totals);
        }
        Ok(totals.all_reduce::<B::InnerBackend>(&self.world, device)?)
    }

    /// The gradients summed over the world and their global squared norm (`local`: the one
    /// device's, read with the step). Whole gradients are the same on every rank after the
    /// all-reduce; FSDP's rows are summed over the ranks, offloaded ones included.
    pub fn sum_grads<B: AutodiffBackend>(
        &self,
        model: &CausalLm<B>,
        grads: GradientsParams,
        local: f64,
    ) -> Result<(GradientsParams, f64), TrainError> {
        let offloaded = |model: &CausalLm<B>| match self.offload() {
            Some(_) => Offload::squared_grad_norm(model),
            None => 0.0,
        };
        if !self.world.is_distributed() {
            return Ok((grads, local + offloaded(model)));
        }
        let grads = sync::all_reduce_grads(&self.world, model, grads)?;
        let norm_of = |sharded: bool| {
            step::squared_grad_norm_of(model, &grads, |id| fsdp::is_sharded(model, id) == sharded)
                .map_or(0.0, |t| t.into_scalar().elem::<f64>())
        };
        let mut squared_norm = norm_of(false);
        if model.shards.is_some() {
            let rows = norm_of(true) + offloaded(model);
            squared_norm += sync::all_reduce_scalars::<B::InnerBackend>(
                &self.world,
                &[rows],
                &model.device(),
                "the gradient norm",
            )?[0];
        }
        Ok((grads, squared_norm))
    }

    /// The optimizer step with the rate and gradient scale `lr_scale`: on this rank's share of
    /// the parameters (ZeRO-1, then every rank gets every parameter), on the rows in host
    /// memory (offload), else on every trainable parameter.
    pub fn update<B: AutodiffBackend>(
        &mut self,
        model: CausalLm<B>,
        grads: GradientsParams,
        optimizer: &mut Optimizer<B::InnerBackend>,
        lr_scale: (f64, f64),
    ) -> Result<CausalLm<B>, TrainError> {
        let mut model = step::apply(model, grads, optimizer, lr_scale, self.zero1.as_ref());
        if let Some(offload) = &mut self.offload {
            offload.update(&model, lr_scale, optimizer.step);
        }
        if let Some(shard) = &self.zero1 {
            model = sharded_optimizer::gather_params(&self.world, model, shard)?;
        }
        Ok(model)
    }

    /// What a checkpoint saves: the optimizer state this rank hands its save hook, and, where
    /// rank 0 writes the whole model, the model gathered whole for it (`None`: the hook gets
    /// the model as this rank holds it). With FSDP every rank takes part in gathering; when
    /// every rank writes its own rows, the weights' health is decided with every rank first,
    /// so that all of them refuse an unhealthy save together.
    pub fn for_save<B: AutodiffBackend>(
        &self,
        model: &mut CausalLm<B>,
        optimizer: &Optimizer<B::InnerBackend>,
        (step, epoch): (usize, usize),
    ) -> Result<(OptimizerSnapshot, Option<CausalLm<B>>), TrainError> {
        if matches!(self.saves, Saves::RankShares { .. }) && model.shards.is_some() {
            if let Some(cause) = fsdp::unhealthy_weight(model, &self.world)? {
                return Err(diverged(cause, step, epoch));
            }
            let mut state = optimizer.state_dict();
            if let Some(offload) = self.offload() {
                state.extend(offload.state_dict());
            }
            let snapshot = OptimizerSnapshot {
                step: optimizer.step,
                state,
            };
            return Ok((snapshot, None));
        }
        let snapshot = self.snapshot(model, optimizer)?;
        let whole = match &model.shards {
            Some(_) if self.world.is_main() => Some(model.unsharded()),
            Some(_) => {
                model.join_unsharding();
                None
            }
            None => None,
        };
        fsdp::check(model)?;
        Ok((snapshot, whole))
    }

    /// The optimizer for a checkpoint: with a sharded state, this rank's share (when every rank
    /// writes its own) or the whole state gathered from every rank; otherwise the state on
    /// rank 0, the one that writes, and nothing elsewhere.
    pub fn snapshot<B: AutodiffBackend>(
        &self,
        model: &CausalLm<B>,
        optimizer: &Optimizer<B::InnerBackend>,
    ) -> Result<OptimizerSnapshot, TrainError> {
        let mut state = match &self.zero1 {
            Some(_) if self.saves == Saves::OptimizerShards => optimizer.state_dict(),
            Some(_) => sharded_optimizer::gather_optimizer_state(&self.world, model, optimizer)?,
            None if self.world.is_main() => optimizer.state_dict(),
            None => Vec::new(),
        };
        if model.shards.is_some() {
            // FSDP: a sharded parameter's moments are this rank's rows; the checkpoint holds
            // them whole.
            let sharded: std::collections::HashSet<String> = model
                .trainable_params()
                .into_iter()
                .filter(|p| fsdp::is_sharded(model, &p.id))
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
                model,
                optimizer,
                self.offload(),
            )?);
        }
        Ok(OptimizerSnapshot {
            step: optimizer.step,
            state,
        })
    }
}

fn diverged(cause: Divergence, step: usize, epoch: usize) -> TrainError {
    TrainError::Diverged { cause, step, epoch }
}
