//! Where a model's parameters come from ([`ParamSource`]): a checkpoint's weights, seeded random
//! ones ([`RandomInit`], benchmarks and tests), or one FSDP rank's rows of another source
//! ([`build_rows`]).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};

use super::args::ModelArgs;
use super::build::{BaseWeights, build_with};
use super::decoder::CausalLm;
use super::shards::LayerShards;
use crate::checkpoint::dcp::row_range;
use crate::checkpoint::{CheckpointError, HostTensor, StorageDtype, Weights};

/// Where a model's parameters come from.
pub trait ParamSource {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<HostTensor, CheckpointError>;

    /// Rows `rows` of tensor `name` (whole shape `shape`); a source that can read only those
    /// rows does.
    fn take_rows(
        &mut self,
        name: &str,
        shape: &[usize],
        rows: Range<usize>,
    ) -> Result<HostTensor, CheckpointError> {
        Ok(self.take(name, shape)?.rows(rows.start, rows.len()))
    }

    /// The dtype tensor `name` is stored in, when it comes from a file.
    fn stored_dtype(&self, _name: &str) -> Option<StorageDtype> {
        None
    }

    /// Rows `rows` of tensor `name`, which may be read again (a weight read a few rows at a
    /// time); [`Self::done`] says when it has been read for good.
    fn read_rows(
        &mut self,
        name: &str,
        shape: &[usize],
        rows: Range<usize>,
    ) -> Result<HostTensor, CheckpointError> {
        self.take_rows(name, shape, rows)
    }

    /// Tensor `name`, read with [`Self::read_rows`], will not be read again.
    fn done(&mut self, _name: &str) {}

    /// FSDP's per-rank load: the rows of a `rows`-row tensor this source hands out through
    /// [`Self::take`] (`None`: it hands out whole tensors).
    fn own_rows(&self, _rows: usize) -> Option<Range<usize>> {
        None
    }

    /// FSDP's per-rank load: tensor `name`'s whole shape, for a weight the builder cut to this
    /// rank's rows itself (a part of a fused checkpoint tensor, read and split first).
    fn record_full_shape(&mut self, _name: &str, _shape: &[usize]) {}

    /// Whether the source holds tensor `name` (a source that makes its tensors up holds none
    /// of the optional ones).
    fn has(&self, _name: &str) -> bool {
        false
    }

    /// The bytes of the `U8` tensor `name` (MXFP4's codes and scales).
    fn take_u8(&mut self, name: &str, shape: &[usize]) -> Result<Vec<u8>, CheckpointError> {
        Err(CheckpointError::MissingTensor {
            name: name.to_string(),
            dir: Default::default(),
            expected: shape.to_vec(),
        })
    }
}

impl ParamSource for Weights {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<HostTensor, CheckpointError> {
        Weights::take(self, name, shape)
    }

    fn take_rows(
        &mut self,
        name: &str,
        shape: &[usize],
        rows: Range<usize>,
    ) -> Result<HostTensor, CheckpointError> {
        Weights::take_rows(self, name, shape, rows)
    }

    fn stored_dtype(&self, name: &str) -> Option<StorageDtype> {
        self.dtype(name)
    }

    fn read_rows(
        &mut self,
        name: &str,
        shape: &[usize],
        rows: Range<usize>,
    ) -> Result<HostTensor, CheckpointError> {
        Weights::read_rows(self, name, shape, rows)
    }

    fn done(&mut self, name: &str) {
        Weights::done(self, name)
    }

    fn has(&self, name: &str) -> bool {
        self.contains(name)
    }

    fn take_u8(&mut self, name: &str, shape: &[usize]) -> Result<Vec<u8>, CheckpointError> {
        Weights::take_u8(self, name, shape)
    }
}

/// Seeded random weights as transformers initialises them (normal, std 0.02), norms at one
/// (zero for Gemma's `1 + w` norms), biases at zero.
pub struct RandomInit {
    rng: StdRng,
    std: f32,
    norm_value: f32,
}

impl RandomInit {
    pub fn new(seed: u64, args: &ModelArgs) -> Self {
        let norm_value = if args.norm_weight_offset { 0.0 } else { 1.0 };
        Self {
            rng: StdRng::seed_from_u64(seed),
            std: 0.02,
            norm_value,
        }
    }
}

impl ParamSource for RandomInit {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<HostTensor, CheckpointError> {
        let n: usize = shape.iter().product();
        let data = if name.ends_with("norm.weight") {
            vec![self.norm_value; n]
        } else if name.ends_with(".bias") {
            vec![0.0; n]
        } else {
            let normal = Normal::new(0.0f32, self.std).map_err(|e| CheckpointError::Invalid {
                path: name.into(),
                message: e.to_string(),
            })?;
            (0..n).map(|_| normal.sample(&mut self.rng)).collect()
        };
        Ok(HostTensor::new(shape.to_vec(), data))
    }
}

/// FSDP's per-rank load: rank `rank` of `world` reads only its rows of each weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowsOf {
    pub rank: usize,
    pub world: usize,
}

/// Hands out a rank's rows ([`row_range`], FSDP2's split) of every tensor it is asked for and
/// remembers each one's whole shape.
struct RowsSource<'a> {
    inner: &'a mut dyn ParamSource,
    rows: RowsOf,
    full_shapes: HashMap<String, Vec<usize>>,
}

impl ParamSource for RowsSource<'_> {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<HostTensor, CheckpointError> {
        // A vision tower is held whole on every rank (`CausalLm::visual`; its gradients are
        // summed over the world as replicated weights' are), so it is read whole.
        let (Some(&first), false) = (shape.first(), name.starts_with("visual.")) else {
            return self.inner.take(name, shape);
        };
        let rows = row_range(first, self.rows.rank, self.rows.world);
        self.full_shapes.insert(name.to_string(), shape.to_vec());
        self.inner.take_rows(name, shape, rows)
    }

    /// Any rows of `name`, not only this rank's (an NF4 base's quantization reads the whole
    /// weight a few rows at a time).
    fn read_rows(
        &mut self,
        name: &str,
        shape: &[usize],
        rows: Range<usize>,
    ) -> Result<HostTensor, CheckpointError> {
        self.inner.read_rows(name, shape, rows)
    }

    fn done(&mut self, name: &str) {
        self.inner.done(name)
    }

    fn own_rows(&self, rows: usize) -> Option<Range<usize>> {
        Some(row_range(rows, self.rows.rank, self.rows.world))
    }

    fn stored_dtype(&self, name: &str) -> Option<StorageDtype> {
        self.inner.stored_dtype(name)
    }

    fn record_full_shape(&mut self, name: &str, shape: &[usize]) {
        self.full_shapes.insert(name.to_string(), shape.to_vec());
    }

    fn has(&self, name: &str) -> bool {
        self.inner.has(name)
    }

    /// Whole: MXFP4's codes (a quarter of bf16's bytes) are dequantized an expert at a time
    /// and only this rank's rows kept (`Builder::fused_experts_rows`).
    fn take_u8(&mut self, name: &str, shape: &[usize]) -> Result<Vec<u8>, CheckpointError> {
        self.inner.take_u8(name, shape)
    }
}

/// The model as FSDP's rank `rows.rank` keeps it, built from its rows of every weight only:
/// the whole model never exists on this rank, and only those rows are read from `src`. Its
/// `shards` record every weight's whole shape and have no collectives yet (the trainer's
/// setup wires them in: `training::parallel::fsdp`); until then nothing may run it. `None` for models
/// whose checkpoint fuses weights a rank's rows cannot be read from (Phi-3's
/// `qkv_proj`): load those whole and shard them after. gpt-oss's fused experts are read an
/// expert at a time, each cut to this rank's rows (`Builder::fused_experts_rows`). An NF4 base (`base`) keeps each
/// decoder linear's quantized rows, quantized as the whole weight would be.
pub fn build_rows<B: Backend>(
    args: &ModelArgs,
    src: &mut dyn ParamSource,
    device: &B::Device,
    rows: RowsOf,
    base: BaseWeights,
) -> Result<Option<CausalLm<B>>, CheckpointError> {
    if args.fused_projections {
        return Ok(None);
    }
    let mut source = RowsSource {
        inner: src,
        rows,
        full_shapes: HashMap::new(),
    };
    let mut model = build_with(args, &mut source, device, base)?;
    // Adapters attached later take the whole weights' shapes.
    for (path, linear) in model.linears_mut() {
        if let Some(full) = source.full_shapes.get(&format!("{path}.weight")) {
            linear.set_full_rows(full[0]);
        }
    }
    let mut shards = LayerShards::new(rows.rank, rows.world);
    shards.adopt(&model, &source.full_shapes, &|path| args.hf_name(path));
    model.shards = Some(Arc::new(shards));
    Ok(Some(model))
}
