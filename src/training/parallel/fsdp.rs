//! Fully sharded data parallel (`data_parallel_shard_dim: -1`, torchtune's default for its
//! `*_distributed` recipes): the trainer's side of [`LayerShards`].
//!
//! - [`shard_model`]: keeps this rank's rows of every weight (decoder layers, embeddings,
//!   final norm, output) and wires the world's all-gather and reduce-scatter in, on the
//!   autodiff backend and its inner one.
//! - The step: the loss steps' per-layer passes (`activation_checkpointing`) gather each layer
//!   for its forward and again for its backward, and reduce-scatter its gradients; the
//!   trainer then takes them ([`LayerShards::take_grads`]), sums the rest over the world as on
//!   the replicated path, and each rank's optimizer updates its own rows (the AdamW moments
//!   are its rows' only).
//! - Checkpoints: with an output directory every rank sees, every rank writes its own rows of
//!   the model and of the optimizer state (`sharded_checkpoint`), after [`unhealthy_weight`]
//!   decided with every rank that the weights are fit to save; otherwise (and for LoRA, QAT
//!   and fused projections) the whole model and optimizer state are gathered for rank 0 to
//!   write, as with replicated weights ([`optimizer_state`]). A resumed run keeps its rows of
//!   the state ([`keep_own_rows`]), whatever world size wrote it.
//!
//! Why per-layer passes always: burn's autodiff graph keeps every tensor a backward needs, a
//! gathered weight included, until the backward; recomputing each layer from its saved input
//! is what lets a layer's whole weights be dropped after its forward
//! (`fsdp_reshard_after_forward: True`), at the price of one extra forward, as activation
//! checkpointing pays it.

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor};

use super::offload::Offload;
use crate::checkpoint::HostTensor;
use crate::distributed::{DistributedError, World};
use crate::models::CausalLm;
use crate::models::shards::{CollectiveFailure, Collectives, LayerShards};
use crate::training::error::{Divergence, MAX_WEIGHT};
use crate::training::optimizer::Optimizer;

/// The world's collective calls on backend `X`, as boxed closures for [`LayerShards`].
fn collectives<X: Backend>(world: &World) -> Collectives<X> {
    let gather_world = world.clone();
    let scatter_world = world.clone();
    Collectives {
        all_gather: Box::new(move |piece| {
            gather_world
                .all_gather(piece, "a sharded layer's weights")
                .map_err(|e| Box::new(e) as CollectiveFailure)
        }),
        reduce_scatter: Box::new(move |tensor, sizes| {
            scatter_world
                .reduce_scatter_sum(tensor, sizes, "a sharded layer's gradients")
                .map_err(|e| Box::new(e) as CollectiveFailure)
        }),
    }
}

/// The autodiff backend's calls: through the inner backend, the one the world joined.
fn autodiff_collectives<B: AutodiffBackend>(world: &World) -> Collectives<B> {
    let inner = Arc::new(collectives::<B::InnerBackend>(world));
    let scatter = inner.clone();
    Collectives {
        all_gather: Box::new(move |piece: Tensor<B, 1>| {
            (inner.all_gather)(piece.inner()).map(Tensor::from_inner)
        }),
        reduce_scatter: Box::new(move |tensor: Tensor<B, 1>, sizes| {
            (scatter.reduce_scatter)(tensor.inner(), sizes).map(Tensor::from_inner)
        }),
    }
}

/// How a model shards: torchtune's `fsdp_reshard_after_forward` and `fsdp_cpu_offload` (the
/// rows, their gradients and the optimizer state in host memory: the trainer's `offload`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharding {
    pub reshard_after_forward: bool,
    pub cpu_offload: bool,
}

/// `model` with this rank's rows of every weight (adapters stay whole).
pub fn shard_model<B: AutodiffBackend>(
    model: CausalLm<B>,
    world: &World,
    sharding: Sharding,
) -> CausalLm<B> {
    let (model, loaded) = loaded_shards(model, world);
    let rows_loaded = loaded.is_some();
    let mut shards = loaded.unwrap_or_else(|| LayerShards::new(world.rank, world.size));
    shards.reshard_after_forward = sharding.reshard_after_forward;
    let shards = shards
        .with_collectives(autodiff_collectives::<B>(world))
        .with_collectives(collectives::<B::InnerBackend>(world));
    shard_layers(model, shards, rows_loaded, sharding.cpu_offload)
}

/// The shards a per-rank load left on `model` (`models::build::build_rows`: it holds this
/// rank's rows already), taken out to be given their collectives.
fn loaded_shards<X: Backend>(
    mut model: CausalLm<X>,
    world: &World,
) -> (CausalLm<X>, Option<LayerShards>) {
    let loaded = model
        .shards
        .take()
        .and_then(|s| Arc::try_unwrap(s).ok())
        .filter(|s| s.rank() == world.rank);
    (model, loaded)
}

/// Keeps this rank's rows of every weight: each decoder layer, and the embeddings, final norm
/// and output layer, each a unit gathered on its own as torchtune's `custom_sharded_layers`
/// (`tok_embeddings`, `output`) and its root unit (the final norm) shard them. A model a
/// per-rank load built (`rows_loaded`: its weights are rows already, `shards` records them)
/// keeps its weights.
/// With `offload`, the rows then move to host memory ([`LayerShards::park`]).
fn shard_layers<X: Backend>(
    mut model: CausalLm<X>,
    mut shards: LayerShards,
    rows_loaded: bool,
    offload: bool,
) -> CausalLm<X> {
    if !rows_loaded {
        model.model.layers = std::mem::take(&mut model.model.layers)
            .into_iter()
            .map(|layer| shards.shard(layer).shard_nf4(&shards))
            .collect();
        let body = &mut model.model;
        body.embed_tokens = shards.shard(body.embed_tokens.clone());
        body.norm = shards.shard(body.norm.clone());
        model.lm_head = model.lm_head.map(|head| shards.shard(head));
    }
    if offload {
        shards = shards.with_offload();
        model = shards.park(model);
    }
    model.shards = Some(Arc::new(shards));
    model
}

/// The first failed collective call of a sharded model's passes since the last check.
pub fn check<B: Backend>(model: &CausalLm<B>) -> Result<(), DistributedError> {
    let Some(shards) = &model.shards else {
        return Ok(());
    };
    shards
        .check()
        .map_err(|e| match e.downcast::<DistributedError>() {
            Ok(e) => *e,
            Err(e) => DistributedError::AllGather {
                rank: shards.rank(),
                what: "a sharded layer's weights",
                detail: e.to_string(),
            },
        })
}

/// A frozen model (DPO's reference, a distillation teacher) on the backend the world joined,
/// with this rank's rows of every weight (in host memory with `cpu_offload`).
pub fn shard_frozen<X: Backend>(
    model: CausalLm<X>,
    world: &World,
    cpu_offload: bool,
) -> CausalLm<X> {
    let (model, loaded) = loaded_shards(model, world);
    let rows_loaded = loaded.is_some();
    let shards = loaded
        .unwrap_or_else(|| LayerShards::new(world.rank, world.size))
        .with_collectives(collectives::<X>(world));
    shard_layers(model, shards, rows_loaded, cpu_offload)
}

/// Whether parameter `id` is one of `model`'s FSDP shards.
pub fn is_sharded<B: Backend>(model: &CausalLm<B>, id: &ParamId) -> bool {
    model.shards.as_ref().is_some_and(|s| s.is_sharded(id))
}

/// The whole optimizer moments of every sharded parameter (every rank takes part), named as
/// [`Optimizer::state_dict`] names them; rank 0 gets them, the other ranks nothing (each
/// moment is dropped as soon as it is gathered).
pub fn optimizer_state<B: AutodiffBackend>(
    world: &World,
    model: &CausalLm<B>,
    optimizer: &Optimizer<B::InnerBackend>,
    offload: Option<&Offload>,
) -> Result<Vec<(String, HostTensor)>, DistributedError> {
    let Some(shards) = &model.shards else {
        return Ok(Vec::new());
    };
    let (device, dtype) = (model.device(), model.model.norm.weight.val().dtype());
    let mut out = Vec::new();
    for p in model.trainable_params() {
        if !shards.is_sharded(&p.id) {
            continue;
        }
        // Offloaded moments go up to the device for the gather, one at a time.
        let moments = match offload {
            Some(o) => o.moments_on::<B::InnerBackend>(&p.name, &device),
            None => optimizer.moments(&p.name),
        };
        for (moment, value) in moments {
            // A rank without the moment (before the first step, or with no rows of this
            // parameter) sends nothing, so every rank makes the same calls; flat, as the
            // optimizer keeps every moment.
            let value = value.unwrap_or_else(|| {
                let empty = Tensor::<B::InnerBackend, 1>::zeros([0], &device);
                crate::precision::to_dtype(empty, dtype)
            });
            let whole = world.all_gather(value, "optimizer state")?;
            if whole.shape().num_elements() > 0 && world.is_main() {
                out.push((
                    format!("{moment}.{}", p.name),
                    HostTensor::from_tensor(&whole),
                ));
            }
        }
    }
    Ok(out)
}

/// After a resumed run restored the whole optimizer state: each sharded parameter's moments
/// keep this rank's elements only.
pub fn keep_own_rows<B: AutodiffBackend>(
    model: &CausalLm<B>,
    optimizer: &mut Optimizer<B::InnerBackend>,
) {
    let Some(shards) = &model.shards else {
        return;
    };
    let ranges: HashMap<String, std::ops::Range<usize>> = model
        .trainable_params()
        .into_iter()
        .filter_map(|p| Some((p.name, shards.elements(&p.id, shards.rank())?)))
        .collect();
    optimizer.narrow(|name| ranges.get(name).cloned());
}

/// The largest magnitude of `value` when it is not finite or exceeds [`MAX_WEIGHT`] (its sum
/// when only that is not finite), else 0.
fn unhealthy_value<Y: Backend, const D: usize>(value: Tensor<Y, D>) -> f64 {
    if value.shape().num_elements() == 0 {
        return 0.0;
    }
    let largest: f32 = value.clone().abs().max().into_scalar().elem();
    let sum: f32 = value.sum().into_scalar().elem();
    // A NaN largest value fails `is_some_and` too; a sum that is not finite holds a NaN the
    // maximum may have skipped.
    let healthy = largest
        .partial_cmp(&MAX_WEIGHT)
        .is_some_and(|o| o != std::cmp::Ordering::Greater);
    if !healthy {
        f64::from(largest)
    } else if !sum.is_finite() {
        f64::from(sum)
    } else {
        0.0
    }
}

/// Before every rank writes its own share of a checkpoint: the first of `model`'s weights
/// (this rank's rows of the sharded ones) that is not finite or exceeds [`MAX_WEIGHT`] in
/// magnitude, decided with every rank, so that all of them refuse the save together (a rank
/// whose own rows are healthy names the weight another rank found). Every rank takes part.
pub fn unhealthy_weight<B: AutodiffBackend>(
    model: &CausalLm<B>,
    world: &World,
) -> Result<Option<Divergence>, DistributedError> {
    struct Check<'a> {
        shards: Option<&'a LayerShards>,
        path: Vec<String>,
        names: Vec<String>,
        /// Per parameter: this rank's largest magnitude where it is unhealthy, else 0.
        bad: Vec<f64>,
    }
    impl<X: Backend> ModuleVisitor<X> for Check<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<X, D>>) {
            // Offloaded rows are checked where they live, in host memory.
            let bad = match self.shards.and_then(|s| s.parked_value(&param.id)) {
                Some(rows) => unhealthy_value(rows),
                None => unhealthy_value(param.val()),
            };
            self.names.push(self.path.join("."));
            self.bad.push(bad);
        }
    }
    let mut check = Check {
        shards: model.shards.as_deref(),
        path: Vec::new(),
        names: Vec::new(),
        bad: Vec::new(),
    };
    model.visit(&mut check);
    // NaN != 0 too: a NaN weight is flagged.
    let flags: Vec<f64> = check
        .bad
        .iter()
        .map(|&b| f64::from(u8::from(b != 0.0)))
        .collect();
    let device = model.device();
    // On the inner backend, the one the world joined.
    let anywhere = crate::distributed::sync::all_reduce_scalars::<B::InnerBackend>(
        world,
        &flags,
        &device,
        "the weights' health before a sharded checkpoint",
    )?;
    let Some(i) = anywhere.iter().position(|&f| f > 0.0) else {
        return Ok(None);
    };
    let name = check.names[i].clone();
    let value = check.bad[i];
    Ok(Some(if value == 0.0 {
        Divergence::WeightOnAnotherRank { name }
    } else {
        Divergence::Weight {
            name,
            value: value as f32,
        }
    }))
}
