//! The trainer's collective steps. Tensors travel as a few large flat buckets (one all-reduce
//! per ~64 MB, not one per tensor), in the model's parameter order, which every worker shares
//! because every worker built the same model.
//!
//! - [`all_reduce_grads`]: every trainable parameter's gradient summed over the world.
//! - [`all_reduce_entries`], [`sum_by_param`]: flat tensors, some of which only some ranks
//!   hold, summed (a gather, when each has its own: ZeRO-1's, `training::parallel::sharded_optimizer`).
//! - [`all_reduce_scalars`], [`check_same`]: per-step counts and the rendezvous checks.
//!
//! burn-collective offers all-reduce and broadcast, and its global (multi-node) broadcast is
//! not implemented in 0.21, so a gather is an all-reduce in which every rank contributes its
//! own tensors and zeros for the others': `x + 0 == x`, so the result is exact.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, ElementConversion, Tensor};

use super::{DistributedError, World};
use crate::models::{CausalLm, TrainableParam};

/// Elements per all-reduce bucket: 16 Mi floats, 64 MB in fp32 (PyTorch DDP uses 25 MB).
pub const BUCKET_ELEMENTS: usize = 1 << 24;

/// Sums scalars over the world in one call, in fp32 whatever the run's dtype (token counts
/// are exact up to 2^24 per step).
pub fn all_reduce_scalars<B: Backend>(
    world: &World,
    values: &[f64],
    device: &B::Device,
    what: &'static str,
) -> Result<Vec<f64>, DistributedError> {
    if !world.is_distributed() {
        return Ok(values.to_vec());
    }
    let t = crate::precision::f32_tensor::<B, 1>(
        values.iter().map(|&v| v as f32).collect(),
        [values.len()],
        device,
    );
    let summed = world.all_reduce_sum(t, what)?;
    Ok(summed
        .into_data()
        .iter::<f32>()
        .map(|v| v.elem::<f64>())
        .collect())
}

/// One flat tensor taking part in a bucketed all-reduce: this worker's value, or `None`
/// where it has none (it then contributes zeros).
pub struct Entry<B: Backend> {
    pub numel: usize,
    pub value: Option<Tensor<B, 1>>,
}

/// Sums `entries` over the world in buckets. An entry no worker has comes back `None`.
pub fn all_reduce_entries<B: Backend>(
    world: &World,
    entries: Vec<Entry<B>>,
    device: &B::Device,
    what: &'static str,
) -> Result<Vec<Option<Tensor<B, 1>>>, DistributedError> {
    let present: Vec<f64> = entries
        .iter()
        .map(|e| f64::from(u8::from(e.value.is_some())))
        .collect();
    let present = all_reduce_scalars::<B>(world, &present, device, what)?;
    let dtype: Option<DType> = entries
        .iter()
        .find_map(|e| e.value.as_ref().map(|t| t.dtype()));
    let zeros = |n: usize| {
        let z = Tensor::<B, 1>::zeros([n], device);
        match dtype {
            Some(d) => crate::precision::to_dtype(z, d),
            None => z,
        }
    };

    let mut out: Vec<Option<Tensor<B, 1>>> = Vec::with_capacity(entries.len());
    let mut bucket: Vec<(usize, Tensor<B, 1>)> = Vec::new();
    let mut bucket_len = 0;
    let flush = |bucket: &mut Vec<(usize, Tensor<B, 1>)>,
                 out: &mut Vec<Option<Tensor<B, 1>>>|
     -> Result<(), DistributedError> {
        if bucket.is_empty() {
            return Ok(());
        }
        let parts: Vec<Tensor<B, 1>> = bucket.iter().map(|(_, t)| t.clone()).collect();
        let flat = if parts.len() == 1 {
            parts.into_iter().next().expect("one part")
        } else {
            Tensor::cat(parts, 0)
        };
        let summed = world.all_reduce_sum(flat, what)?;
        let mut offset = 0;
        for (index, t) in bucket.drain(..) {
            let n = t.shape().num_elements();
            out[index] = Some(summed.clone().slice(offset..offset + n));
            offset += n;
        }
        Ok(())
    };
    for (index, (entry, anywhere)) in entries.into_iter().zip(present).enumerate() {
        out.push(None);
        if anywhere == 0.0 {
            continue;
        }
        let value = entry.value.unwrap_or_else(|| zeros(entry.numel));
        if bucket_len + entry.numel > BUCKET_ELEMENTS && !bucket.is_empty() {
            flush(&mut bucket, &mut out)?;
            bucket_len = 0;
        }
        bucket.push((index, value));
        bucket_len += entry.numel;
    }
    flush(&mut bucket, &mut out)?;
    Ok(out)
}

/// Sums the flat tensors this rank holds for some of `params` (by id) over the world, in
/// model order; a parameter no rank holds a tensor for is left out of the result.
pub fn sum_by_param<B: Backend>(
    world: &World,
    params: &[TrainableParam],
    mut local: HashMap<ParamId, Tensor<B, 1>>,
    device: &B::Device,
    what: &'static str,
) -> Result<HashMap<ParamId, Tensor<B, 1>>, DistributedError> {
    let entries = params
        .iter()
        .map(|p| Entry {
            numel: p.numel,
            value: local.remove(&p.id),
        })
        .collect();
    let summed = all_reduce_entries(world, entries, device, what)?;
    Ok(params
        .iter()
        .zip(summed)
        .filter_map(|(p, t)| t.map(|t| (p.id, t)))
        .collect())
}

/// Replaces parameters by id with the given flat values (shaped as the parameter).
pub struct SetParams<B: AutodiffBackend> {
    pub values: HashMap<ParamId, Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for SetParams<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(flat) = self.values.remove(&id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let value = Tensor::from_inner(flat.reshape(tensor.shape())).require_grad();
        Param::from_mapped_value(id, value, mapper)
    }
}

/// Puts flat gradients back into `GradientsParams`, shaped as their parameters.
struct Scatter<'a, B: AutodiffBackend> {
    grads: HashMap<ParamId, Tensor<B::InnerBackend, 1>>,
    out: &'a mut GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scatter<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(flat) = self.grads.remove(&param.id) {
            let shape = param.val().shape();
            self.out
                .register::<B::InnerBackend, D>(param.id, flat.reshape(shape));
        }
    }
}

/// Takes each trainable parameter's gradient out of `grads`, flattened, by id.
struct TakeGrads<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    wanted: std::collections::HashSet<ParamId>,
    out: HashMap<ParamId, Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for TakeGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !self.wanted.contains(&param.id) {
            return;
        }
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let n = g.shape().num_elements();
            self.out.insert(param.id, g.reshape([n]));
        }
    }
}

/// Sums every trainable parameter's gradient over the world (FSDP's shards excepted: their
/// layers' backward passes reduce-scattered them). A parameter no worker has a
/// gradient for stays without one (the optimizer skips it, as on one device); one that only
/// some workers have counts as zero on the others.
pub fn all_reduce_grads<B: AutodiffBackend>(
    world: &World,
    model: &CausalLm<B>,
    mut grads: GradientsParams,
) -> Result<GradientsParams, DistributedError> {
    if !world.is_distributed() {
        return Ok(grads);
    }
    let params = whole_trainable_params(model);
    let mut take = TakeGrads::<B> {
        grads: &mut grads,
        wanted: params.iter().map(|p| p.id).collect(),
        out: HashMap::new(),
    };
    model.visit(&mut take);
    let summed = sum_by_param(world, &params, take.out, &model.device(), "gradients")?;
    let mut scatter = Scatter::<B> {
        grads: summed,
        out: &mut grads,
    };
    model.visit(&mut scatter);
    Ok(grads)
}

/// The trainable parameters every rank holds whole: all of them, less FSDP's shards (whose
/// gradients and updates are each rank's own rows).
pub fn whole_trainable_params<B: Backend>(model: &CausalLm<B>) -> Vec<TrainableParam> {
    let mut params = model.trainable_params();
    if let Some(shards) = &model.shards {
        params.retain(|p| !shards.is_sharded(&p.id));
    }
    params
}

/// Rank 0's `value` on every rank (the others' own values are ignored). It travels as its 8
/// bytes, each exact in fp32.
pub fn from_rank_zero<B: Backend>(
    world: &World,
    value: u64,
    device: &B::Device,
    what: &'static str,
) -> Result<u64, DistributedError> {
    if !world.is_distributed() {
        return Ok(value);
    }
    let bytes: Vec<f64> = value
        .to_le_bytes()
        .iter()
        .map(|&b| if world.is_main() { f64::from(b) } else { 0.0 })
        .collect();
    let summed = all_reduce_scalars::<B>(world, &bytes, device, what)?;
    let mut le = [0u8; 8];
    for (b, v) in le.iter_mut().zip(&summed) {
        *b = v.round() as u8;
    }
    Ok(u64::from_le_bytes(le))
}

/// A 64-bit digest of `bytes` (the first 8 bytes of its SHA-256).
pub fn hash64(bytes: &[u8]) -> u64 {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(bytes);
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(first)
}

/// Fails on every worker unless all of them hold the same `value`. Each byte travels with its
/// square: the sums satisfy `(sum x)^2 == W * sum x^2` exactly when every worker's byte is the
/// same (Cauchy-Schwarz), and stay exact in fp32 for up to 256 workers.
pub fn check_same<B: Backend>(
    world: &World,
    device: &B::Device,
    what: &'static str,
    value: u64,
) -> Result<(), DistributedError> {
    if !world.is_distributed() {
        return Ok(());
    }
    let bytes = value.to_le_bytes();
    let mut values: Vec<f64> = bytes.iter().map(|&b| f64::from(b)).collect();
    values.extend(bytes.iter().map(|&b| f64::from(b) * f64::from(b)));
    let sums = all_reduce_scalars::<B>(world, &values, device, "the rendezvous check")?;
    let w = world.size as f64;
    let same = (0..8).all(|i| (sums[i] * sums[i] - w * sums[8 + i]).abs() < 0.5);
    if same {
        Ok(())
    } else {
        Err(DistributedError::Mismatch {
            rank: world.rank,
            what,
        })
    }
}
