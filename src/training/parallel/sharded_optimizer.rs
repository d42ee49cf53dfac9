//! ZeRO-1: with several workers, each rank keeps and updates the optimizer state of a share of
//! the trainable parameters only ([`OptimizerShard`]); after the step every rank gets every
//! updated parameter from its owner ([`gather_params`]), and a checkpoint the whole state
//! ([`gather_optimizer_state`]) unless every rank writes its own (`optimizer_shards`).

use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use crate::checkpoint::HostTensor;
use crate::distributed::sync::BUCKET_ELEMENTS;
use crate::distributed::sync::{Entry, SetParams, all_reduce_entries, whole_trainable_params};
use crate::distributed::{DistributedError, World};
use crate::models::{CausalLm, TrainableParam};
use crate::training::optimizer::Optimizer;

/// ZeRO-1: which rank updates, and keeps the optimizer state of, each trainable parameter.
#[derive(Debug, Clone)]
pub struct OptimizerShard {
    pub rank: usize,
    pub world: usize,
    /// Owner rank of each trainable parameter, by module path, in model order.
    owners: Vec<(String, usize, usize)>,
}

impl OptimizerShard {
    /// Contiguous runs of the trainable parameters in model order, balanced by element count:
    /// a parameter belongs to the rank whose share holds its middle element.
    pub fn new<B: AutodiffBackend>(model: &CausalLm<B>, world: &World) -> Self {
        let params = whole_trainable_params(model);
        let total: usize = params.iter().map(|p| p.numel).sum::<usize>().max(1);
        let size = world.size.max(1);
        let mut before = 0usize;
        let owners = params
            .into_iter()
            .map(|p| {
                let middle = before + p.numel / 2;
                before += p.numel;
                let owner = (middle * size / total).min(size - 1);
                (p.name, p.numel, owner)
            })
            .collect();
        Self {
            rank: world.rank,
            world: size,
            owners,
        }
    }

    /// Whether this rank updates `name`: its share of the whole parameters, and every FSDP
    /// shard (each rank's own rows), which ZeRO-1 does not place.
    pub fn owns(&self, name: &str) -> bool {
        self.owners
            .iter()
            .find(|(n, _, _)| n == name)
            .is_none_or(|(_, _, owner)| *owner == self.rank)
    }
}

/// After a sharded optimizer step: every rank gets every trainable parameter from its owner.
pub fn gather_params<B: AutodiffBackend>(
    world: &World,
    model: CausalLm<B>,
    shard: &OptimizerShard,
) -> Result<CausalLm<B>, DistributedError> {
    struct Values<B: AutodiffBackend> {
        wanted: HashMap<ParamId, bool>,
        out: HashMap<ParamId, Tensor<B::InnerBackend, 1>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Values<B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.wanted.get(&param.id) == Some(&true) {
                let v = param.val().inner();
                let n = v.shape().num_elements();
                self.out.insert(param.id, v.reshape([n]));
            }
        }
    }
    let params = whole_trainable_params(&model);
    let mut values = Values::<B> {
        wanted: params.iter().map(|p| (p.id, shard.owns(&p.name))).collect(),
        out: HashMap::new(),
    };
    model.visit(&mut values);
    let mut owned = values.out;
    let dtype = owned.values().next().map(|t| t.dtype());
    let device = model.device();
    // Owners rise with model order (each rank's share is one contiguous run), so the rank-
    // ordered all-gather of each rank's owned parameters in a bucket is the bucket in model
    // order: every element travels once, not as the zero-padded sum it used to be.
    let mut values = HashMap::new();
    for bucket in buckets(&params) {
        let mine: Vec<_> = bucket.iter().filter_map(|p| owned.remove(&p.id)).collect();
        let local = match (mine.is_empty(), dtype) {
            (false, _) => Tensor::cat(mine, 0),
            (true, Some(d)) => crate::precision::to_dtype(Tensor::zeros([0], &device), d),
            (true, None) => Tensor::zeros([0], &device),
        };
        let whole = world.all_gather(local, "updated parameters")?;
        let mut offset = 0;
        for p in bucket {
            values.insert(p.id, whole.clone().slice(offset..offset + p.numel));
            offset += p.numel;
        }
    }
    Ok(model.map(&mut SetParams::<B> { values }))
}

/// Consecutive runs of `params` of at most [`BUCKET_ELEMENTS`] elements (or one parameter).
fn buckets(params: &[TrainableParam]) -> Vec<&[TrainableParam]> {
    let mut out = Vec::new();
    let (mut start, mut len) = (0, 0);
    for (i, p) in params.iter().enumerate() {
        if len + p.numel > BUCKET_ELEMENTS && i > start {
            out.push(&params[start..i]);
            (start, len) = (i, 0);
        }
        len += p.numel;
    }
    if start < params.len() {
        out.push(&params[start..]);
    }
    out
}

/// The whole optimizer state (as [`Optimizer::state_dict`] names it) from every rank's shard,
/// for a checkpoint. Every rank takes part; the returned state is complete on every rank.
pub fn gather_optimizer_state<B: AutodiffBackend>(
    world: &World,
    model: &CausalLm<B>,
    optimizer: &Optimizer<B::InnerBackend>,
) -> Result<Vec<(String, HostTensor)>, DistributedError> {
    let params = whole_trainable_params(model);
    let mut keys = Vec::new();
    let mut entries = Vec::new();
    for p in &params {
        for (moment, value) in optimizer.moments(&p.name) {
            keys.push(format!("{moment}.{}", p.name));
            entries.push(Entry {
                numel: p.numel,
                value,
            });
        }
    }
    let gathered = all_reduce_entries(world, entries, &model.device(), "optimizer state")?;
    Ok(keys
        .into_iter()
        .zip(gathered)
        .filter_map(|(k, v)| v.map(|v| (k, HostTensor::from_tensor(&v))))
        .collect())
}
