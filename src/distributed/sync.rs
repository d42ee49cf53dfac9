//! The trainer's collective steps. Gradients travel as a few large flat buckets (one
//! all-reduce per ~64 MB, not one per tensor), in the model's parameter order, which every
//! worker shares because every worker built the same model.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor};

use super::{DistributedError, World};
use crate::models::CausalLm;

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

/// Every trainable parameter in model order: its id, element count and local gradient
/// (flattened), or `None` where this worker's backward gave it none.
struct Gather<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    out: Vec<(ParamId, usize, Option<Tensor<B::InnerBackend, 1>>)>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Gather<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val();
        if !value.is_require_grad() {
            return;
        }
        let n = value.shape().num_elements();
        let grad = self
            .grads
            .remove::<B::InnerBackend, D>(param.id)
            .map(|g| g.reshape([n]));
        self.out.push((param.id, n, grad));
    }
}

/// Puts the summed flat gradients back, shaped as their parameters.
struct Scatter<B: AutodiffBackend> {
    reduced: std::collections::HashMap<ParamId, Tensor<B::InnerBackend, 1>>,
    out: GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scatter<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(flat) = self.reduced.remove(&param.id) {
            let shape = param.val().shape();
            self.out
                .register::<B::InnerBackend, D>(param.id, flat.reshape(shape));
        }
    }
}

/// Sums every trainable parameter's gradient over the world. A parameter no worker has a
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
    let mut gather = Gather::<B> {
        grads: &mut grads,
        out: Vec::new(),
    };
    model.visit(&mut gather);
    let params = gather.out;
    let device = model.device();

    // Which parameters have a gradient anywhere.
    let present: Vec<f64> = params
        .iter()
        .map(|(_, _, g)| if g.is_some() { 1.0 } else { 0.0 })
        .collect();
    let present = all_reduce_scalars::<B::InnerBackend>(world, &present, &device, "gradient presence")?;

    let dtype = params
        .iter()
        .find_map(|(_, _, g)| g.as_ref().map(|g| g.dtype()));
    let mut reduced = std::collections::HashMap::new();
    let mut bucket: Vec<(ParamId, usize, Tensor<B::InnerBackend, 1>)> = Vec::new();
    let mut bucket_len = 0;
    let flush = |bucket: &mut Vec<(ParamId, usize, Tensor<B::InnerBackend, 1>)>,
                 reduced: &mut std::collections::HashMap<ParamId, Tensor<B::InnerBackend, 1>>|
     -> Result<(), DistributedError> {
        if bucket.is_empty() {
            return Ok(());
        }
        let parts: Vec<_> = bucket.iter().map(|(_, _, t)| t.clone()).collect();
        let flat = if parts.len() == 1 {
            parts.into_iter().next().expect("one part")
        } else {
            Tensor::cat(parts, 0)
        };
        let summed = world.all_reduce_sum(flat, "gradients")?;
        let mut offset = 0;
        for (id, n, _) in bucket.drain(..) {
            reduced.insert(id, summed.clone().slice(offset..offset + n));
            offset += n;
        }
        Ok(())
    };
    for ((id, n, grad), anywhere) in params.into_iter().zip(present) {
        if anywhere == 0.0 {
            continue;
        }
        let grad = grad.unwrap_or_else(|| {
            let zeros = Tensor::<B::InnerBackend, 1>::zeros([n], &device);
            match dtype {
                Some(d) => crate::precision::to_dtype(zeros, d),
                None => zeros,
            }
        });
        if bucket_len + n > BUCKET_ELEMENTS && !bucket.is_empty() {
            flush(&mut bucket, &mut reduced)?;
            bucket_len = 0;
        }
        bucket.push((id, n, grad));
        bucket_len += n;
    }
    flush(&mut bucket, &mut reduced)?;

    let mut scatter = Scatter::<B> {
        reduced,
        out: GradientsParams::new(),
    };
    model.visit(&mut scatter);
    Ok(scatter.out)
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
