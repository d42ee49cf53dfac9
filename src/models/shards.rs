//! Fully sharded models (FSDP; `data_parallel_shard_dim: -1` on several ranks): each rank keeps
//! only its rows of every weight, gathers a unit's whole weights (a decoder layer, the
//! embeddings, the output end) just before it runs and drops them after, and keeps only its
//! rows of their gradients.
//!
//! Invariants:
//! - A sharded parameter holds this rank's dim-0 rows [`LayerShards::rows`] of the whole
//!   tensor (FSDP2's even split: `ceil(rows / W)` rows each, the last ranks' shorter or
//!   empty). Rows are contiguous in row-major order, so a shard is one contiguous range of the
//!   flattened tensor and the rank-ordered concatenation of every rank's shard is the whole.
//! - A gathered layer's parameters keep the sharded ones' ids, so gradients, optimizer state
//!   and checkpoints name a parameter alike whether it is sharded or whole.
//! - Every rank makes the same collective calls in the same order: one all-gather per unit
//!   per pass, one reduce-scatter per unit per backward, at points that do not depend on the
//!   data (a rank's batch may be shorter than another's, never a different number of layers).
//! - LoRA/DoRA adapter weights do not shard (they stay whole on every rank, their gradients
//!   summed as on one rank's data-parallel path).
//! - A failed collective call is kept and the pass goes on with zeros; the trainer asks
//!   [`LayerShards::check`] at the end of every step, before anything is updated, and later
//!   calls fail at once, so every rank stops at the same step with the first error.
//! - With CPU offload ([`LayerShards::with_offload`]), a sharded parameter's rows and its
//!   gradient rows live in host memory ([`HostRows`]) and the module holds a placeholder with
//!   no rows; every other invariant holds unchanged.
//!
//! This module knows no collective library: the trainer's setup hands it each backend's
//! all-gather and reduce-scatter ([`Collectives`]), keyed by backend type. Why: one model
//! value is used on its autodiff backend (training) and on the inner one (validation,
//! references), and the collective runs on the inner one; keying by type lets `hidden()` stay
//! generic over the backend, and keeps `models` free of `distributed` (which imports models).

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor};

use super::host_rows::{Host, HostRows, to_device, to_host};
use crate::checkpoint::dcp::row_range;

/// A collective call's failure, as the distributed layer reports it.
pub type CollectiveFailure = Box<dyn std::error::Error + Send + Sync>;

type GatherFn<X> = dyn Fn(Tensor<X, 1>) -> Result<Tensor<X, 1>, CollectiveFailure> + Send + Sync;
type ScatterFn<X> =
    dyn Fn(Tensor<X, 1>, &[usize]) -> Result<Tensor<X, 1>, CollectiveFailure> + Send + Sync;

/// One backend's collective calls over the ranks of the run.
pub struct Collectives<X: Backend> {
    /// Every rank's flat piece, concatenated in rank order.
    pub all_gather: Box<GatherFn<X>>,
    /// The sum over ranks of a flat tensor, of which rank `k` keeps the `k`-th of the given
    /// lengths.
    pub reduce_scatter: Box<ScatterFn<X>>,
}

/// This rank's share of every weight, and how to gather them.
pub struct LayerShards {
    rank: usize,
    world: usize,
    /// The whole shape of every sharded parameter.
    full_shapes: HashMap<ParamId, Vec<usize>>,
    /// `Collectives<X>` by `TypeId::of::<X>()`.
    collectives: HashMap<TypeId, Arc<dyn Any + Send + Sync>>,
    failure: Mutex<Option<CollectiveFailure>>,
    /// `fsdp_reshard_after_forward`: drop a layer's gathered weights after its forward and
    /// gather them again for its backward (true), or keep them from the forward (false: one
    /// gather per layer per step, the whole layers held until the backward).
    pub reshard_after_forward: bool,
    /// Gradients handed over by layer backward passes since the last
    /// [`take_grads`](Self::take_grads): flat `Tensor<inner backend, 1>` by parameter id.
    grads: Mutex<HashMap<ParamId, Box<dyn Any + Send>>>,
    /// FSDP's CPU offload: the rows [`Self::park`] moved to host memory, and their gradients.
    host: Option<HostRows>,
}

impl std::fmt::Debug for LayerShards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerShards")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("sharded_params", &self.full_shapes.len())
            .finish()
    }
}

/// Whether a module path (inside a sharded unit) names an adapter weight, which stays whole.
fn is_adapter(path: &[String]) -> bool {
    path.iter().any(|p| p == "lora")
}

impl LayerShards {
    pub fn new(rank: usize, world: usize) -> Self {
        Self {
            rank,
            world: world.max(1),
            full_shapes: HashMap::new(),
            collectives: HashMap::new(),
            failure: Mutex::new(None),
            reshard_after_forward: true,
            grads: Mutex::new(HashMap::new()),
            host: None,
        }
    }

    /// FSDP's CPU offload: [`Self::park`] keeps rows in host memory, and the gradient rows
    /// of parked parameters are summed there.
    pub fn with_offload(mut self) -> Self {
        self.host = Some(HostRows::default());
        self
    }

    /// The host memory of an offloading run.
    pub fn offloaded(&self) -> Option<&HostRows> {
        self.host.as_ref()
    }

    /// Whether parameter `id`'s rows live in host memory.
    pub fn is_parked(&self, id: &ParamId) -> bool {
        self.host.as_ref().is_some_and(|h| h.is_parked(id))
    }

    /// This rank's shape of sharded parameter `id`: its rows of the whole.
    pub fn shard_shape(&self, id: &ParamId) -> Option<Vec<usize>> {
        let mut shape = self.full_shapes.get(id)?.clone();
        shape[0] = self.rows(shape[0], self.rank).len();
        Some(shape)
    }

    /// This rank's rows of parameter `id` (flat, on the host) when they are parked.
    pub fn parked_value(&self, id: &ParamId) -> Option<Tensor<Host, 1>> {
        self.host.as_ref()?.value(id)
    }

    /// With offload: moves this rank's rows of every sharded parameter of `module` to host
    /// memory, leaving a placeholder with no rows (same id, dtype and training flag); without
    /// it, `module` as it is.
    pub fn park<X: Backend, M: Module<X>>(&self, module: M) -> M {
        struct Park<'a> {
            shards: &'a LayerShards,
            host: &'a HostRows,
        }
        impl<X: Backend> ModuleMapper<X> for Park<'_> {
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<X, D>>,
            ) -> Param<Tensor<X, D>> {
                let (id, tensor, mapper) = param.consume();
                if !self.shards.is_sharded(&id) || self.host.is_parked(&id) {
                    return Param::from_mapped_value(id, tensor, mapper);
                }
                let mut dims = tensor.dims();
                let (dtype, device, trains) =
                    (tensor.dtype(), tensor.device(), tensor.is_require_grad());
                let n = tensor.shape().num_elements();
                self.host.park(id, to_host(tensor.detach().reshape([n])));
                dims[0] = 0;
                let placeholder = Tensor::<X, D>::empty(
                    dims,
                    burn::tensor::TensorCreationOptions::new(device).with_dtype(dtype),
                );
                let placeholder = if trains {
                    placeholder.require_grad()
                } else {
                    placeholder
                };
                Param::from_mapped_value(id, placeholder, mapper)
            }
        }
        match &self.host {
            Some(host) => module.map(&mut Park { shards: self, host }),
            None => module,
        }
    }

    /// Adds backend `X`'s collective calls.
    pub fn with_collectives<X: Backend>(mut self, collectives: Collectives<X>) -> Self {
        self.collectives
            .insert(TypeId::of::<X>(), Arc::new(collectives));
        self
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// The rows of a `rows`-row tensor that `rank` keeps: `ceil(rows / W)` each, in rank order,
    /// as FSDP2 (and the sharded checkpoints, [`row_range`]) split them.
    pub fn rows(&self, rows: usize, rank: usize) -> Range<usize> {
        row_range(rows, rank, self.world)
    }

    /// The flat element range of the whole parameter `id` that `rank` keeps; `None` when the
    /// parameter is not sharded.
    pub fn elements(&self, id: &ParamId, rank: usize) -> Option<Range<usize>> {
        let shape = self.full_shapes.get(id)?;
        let row_len: usize = shape[1..].iter().product();
        let rows = self.rows(shape[0], rank);
        Some(rows.start * row_len..rows.end * row_len)
    }

    /// The whole shape of sharded parameter `id` (its value holds this rank's rows of it).
    pub fn full_shape(&self, id: &ParamId) -> Option<&[usize]> {
        self.full_shapes.get(id).map(Vec::as_slice)
    }

    pub fn is_sharded(&self, id: &ParamId) -> bool {
        self.full_shapes.contains_key(id)
    }

    /// Keeps this rank's rows of every parameter of `module` (a unit: a decoder layer, the
    /// embeddings, the final norm, the output layer), adapters
    /// excepted; a parameter that trains stays one that trains.
    pub fn shard<X: Backend, M: Module<X>>(&mut self, module: M) -> M {
        struct Shard<'a> {
            shards: &'a mut LayerShards,
            path: Vec<String>,
        }
        impl<X: Backend> ModuleMapper<X> for Shard<'_> {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.path.push(name.to_string());
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.path.pop();
            }
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<X, D>>,
            ) -> Param<Tensor<X, D>> {
                let (id, tensor, mapper) = param.consume();
                if is_adapter(&self.path) {
                    return Param::from_mapped_value(id, tensor, mapper);
                }
                let dims = tensor.dims();
                let trains = tensor.is_require_grad();
                let rows = self.shards.rows(dims[0], self.shards.rank);
                let mut ranges = dims.map(|d| 0..d);
                ranges[0] = rows;
                let piece = tensor.slice(ranges).detach();
                let piece = if trains { piece.require_grad() } else { piece };
                self.shards.full_shapes.insert(id, dims.to_vec());
                Param::from_mapped_value(id, piece, mapper)
            }
        }
        module.map(&mut Shard {
            shards: self,
            path: Vec::new(),
        })
    }

    /// Records the whole shape of every parameter of `module` (holding this rank's rows
    /// already, as a per-rank load builds them) that `full_shapes` names: by its checkpoint
    /// name, `checkpoint_name` of its module path.
    pub fn adopt<X: Backend, M: Module<X>>(
        &mut self,
        module: &M,
        full_shapes: &HashMap<String, Vec<usize>>,
        checkpoint_name: &dyn Fn(&str) -> String,
    ) {
        struct Adopt<'a> {
            shards: &'a mut LayerShards,
            full_shapes: &'a HashMap<String, Vec<usize>>,
            checkpoint_name: &'a dyn Fn(&str) -> String,
            path: Vec<String>,
        }
        impl<X: Backend> ModuleVisitor<X> for Adopt<'_> {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.path.push(name.to_string());
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.path.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<X, D>>) {
                let name = (self.checkpoint_name)(&self.path.join("."));
                if let Some(full) = self.full_shapes.get(&name) {
                    self.shards.full_shapes.insert(param.id, full.clone());
                }
            }
        }
        module.visit(&mut Adopt {
            shards: self,
            full_shapes,
            checkpoint_name,
            path: Vec::new(),
        });
    }

    fn collectives<X: Backend>(&self) -> &Collectives<X> {
        self.collectives
            .get(&TypeId::of::<X>())
            .and_then(|c| c.downcast_ref::<Collectives<X>>())
            .unwrap_or_else(|| {
                panic!(
                    "invariant: the trainer's setup gives LayerShards the collectives of every backend the model runs on ({})",
                    std::any::type_name::<X>()
                )
            })
    }

    fn failed(&self) -> bool {
        self.failure.lock().map_or(true, |f| f.is_some())
    }

    fn keep_failure(&self, e: CollectiveFailure) {
        if let Ok(mut f) = self.failure.lock()
            && f.is_none()
        {
            *f = Some(e);
        }
    }

    /// The first collective failure since the run began, if any (see the module doc).
    pub fn check(&self) -> Result<(), CollectiveFailure> {
        match self.failure.lock() {
            Ok(mut f) => f.take().map_or(Ok(()), Err),
            Err(_) => Err("a worker thread panicked while holding the shard state".into()),
        }
    }

    /// `module` (a sharded unit) with every sharded parameter whole: one all-gather.
    /// A gathered parameter is a new leaf that trains when its shard does.
    pub fn gather<X: Backend, M: Module<X>>(&self, module: &M) -> M {
        struct Pieces<'a, X: Backend> {
            shards: &'a LayerShards,
            order: Vec<ParamId>,
            pieces: Vec<Tensor<X, 1>>,
            dtype: Option<DType>,
        }
        impl<X: Backend> ModuleVisitor<X> for Pieces<'_, X> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<X, D>>) {
                if self.shards.is_sharded(&param.id) {
                    let value = param.val();
                    self.dtype.get_or_insert(value.dtype());
                    self.order.push(param.id);
                    // Offloaded rows go up to the device for the gather only.
                    let piece = match self.shards.parked_value(&param.id) {
                        Some(rows) => to_device::<X, 1>(rows, &value.device()),
                        None => {
                            let n = value.shape().num_elements();
                            value.reshape([n])
                        }
                    };
                    if piece.shape().num_elements() > 0 {
                        self.pieces.push(piece);
                    }
                }
            }
        }
        let mut pieces = Pieces::<X> {
            shards: self,
            order: Vec::new(),
            pieces: Vec::new(),
            dtype: None,
        };
        module.visit(&mut pieces);
        if pieces.order.is_empty() {
            return module.clone();
        }
        let device = module.devices().into_iter().next().unwrap_or_default();
        // Every rank sends the layer's dtype, an empty piece included.
        let dtype = pieces.dtype.unwrap_or(DType::F32);
        let local = concat(pieces.pieces, dtype, &device);
        let total: usize = pieces
            .order
            .iter()
            .map(|id| self.full_shapes[id].iter().product::<usize>())
            .sum();
        let whole = if self.failed() {
            None
        } else {
            match (self.collectives::<X>().all_gather)(local) {
                Ok(t) => Some(t),
                Err(e) => {
                    self.keep_failure(e);
                    None
                }
            }
        };
        let whole = whole.unwrap_or_else(|| zeros(total, dtype, &device));
        // Rank-major: rank r's pieces of every parameter, in visit order, then rank r + 1's.
        let mut parts: HashMap<ParamId, Vec<Tensor<X, 1>>> = HashMap::new();
        let mut offset = 0;
        for rank in 0..self.world {
            for id in &pieces.order {
                let len = self.elements(id, rank).map_or(0, |r| r.len());
                if len > 0 {
                    parts
                        .entry(*id)
                        .or_default()
                        .push(whole.clone().slice(offset..offset + len));
                }
                offset += len;
            }
        }
        struct Fill<'a, X: Backend> {
            shards: &'a LayerShards,
            parts: HashMap<ParamId, Vec<Tensor<X, 1>>>,
        }
        impl<X: Backend> ModuleMapper<X> for Fill<'_, X> {
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<X, D>>,
            ) -> Param<Tensor<X, D>> {
                let (id, tensor, mapper) = param.consume();
                let Some(parts) = self.parts.remove(&id) else {
                    return Param::from_mapped_value(id, tensor, mapper);
                };
                let shape: [usize; D] = self.shards.full_shapes[&id]
                    .clone()
                    .try_into()
                    .expect("invariant: a shard keeps its tensor's rank");
                let whole = Tensor::cat(parts, 0).reshape(shape);
                let whole = if tensor.is_require_grad() {
                    whole.require_grad()
                } else {
                    whole
                };
                Param::from_mapped_value(id, whole, mapper)
            }
        }
        module.clone().map(&mut Fill {
            shards: self,
            parts,
        })
    }

    /// Every rank's `local` values (f32, whatever the model's dtype: they carry NF4 codes and
    /// scales exactly), concatenated in rank order: one all-gather. `total` is the whole's
    /// length, for the zeros a failed call goes on with (see the module doc).
    pub fn gather_values<X: Backend>(
        &self,
        local: Vec<f32>,
        total: usize,
        device: &X::Device,
    ) -> Vec<f32> {
        let n = local.len();
        let piece = crate::precision::f32_tensor::<X, 1>(local, [n], device);
        if self.failed() {
            return vec![0.0; total];
        }
        let whole = (self.collectives::<X>().all_gather)(piece).and_then(|t| {
            match t.into_data().into_vec::<f32>() {
                Ok(v) if v.len() == total => Ok(v),
                Ok(v) => Err(format!(
                    "the gathered NF4 weights hold {} values, not the {total} every rank's rows make",
                    v.len()
                )
                .into()),
                Err(e) => Err(format!("the gathered NF4 weights are not f32: {e:?}").into()),
            }
        });
        whole.unwrap_or_else(|e| {
            self.keep_failure(e);
            vec![0.0; total]
        })
    }

    /// After a gathered layer's backward pass: takes its parameters' gradients out of
    /// `grads`, reduce-scatters the sharded ones (one call) so this rank keeps the sum over
    /// ranks of its rows, and keeps them, with the adapters' whole gradients, until
    /// [`take_grads`](Self::take_grads).
    pub fn scatter_grads<X: AutodiffBackend, M: AutodiffModule<X>>(
        &self,
        grads: &mut X::Gradients,
        gathered: &M,
    ) {
        let params = GradientsParams::from_module::<X, M>(grads, gathered);
        struct Take<'a, X: AutodiffBackend> {
            shards: &'a LayerShards,
            params: GradientsParams,
            sharded: Vec<(ParamId, Tensor<X::InnerBackend, 1>)>,
            whole: Vec<(ParamId, Tensor<X::InnerBackend, 1>)>,
        }
        impl<X: AutodiffBackend> ModuleVisitor<X> for Take<'_, X> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<X, D>>) {
                if let Some(g) = self.params.remove::<X::InnerBackend, D>(param.id) {
                    let n = g.shape().num_elements();
                    let flat = g.reshape([n]);
                    if self.shards.is_sharded(&param.id) {
                        self.sharded.push((param.id, flat));
                    } else {
                        self.whole.push((param.id, flat));
                    }
                }
            }
        }
        let mut take = Take::<X> {
            shards: self,
            params,
            sharded: Vec::new(),
            whole: Vec::new(),
        };
        gathered.visit(&mut take);
        let (sharded, whole) = (take.sharded, take.whole);
        for (id, g) in whole {
            self.keep_grad(id, g);
        }
        if sharded.is_empty() {
            return;
        }
        let device = sharded[0].1.device();
        // Rank-major, as the reduce-scatter splits it: every parameter's rows of rank 0, ...
        let mut sizes = vec![0usize; self.world];
        let mut parts = Vec::new();
        for (rank, size) in sizes.iter_mut().enumerate() {
            for (id, g) in &sharded {
                let range = self
                    .elements(id, rank)
                    .expect("invariant: only sharded parameters are here");
                *size += range.len();
                if !range.is_empty() {
                    parts.push(g.clone().slice(range));
                }
            }
        }
        let local_len = sizes[self.rank];
        let dtype = sharded[0].1.dtype();
        let buffer = concat(parts, dtype, &device);
        let mine = if self.failed() {
            None
        } else {
            match (self.collectives::<X::InnerBackend>().reduce_scatter)(buffer, &sizes) {
                Ok(t) => Some(t),
                Err(e) => {
                    self.keep_failure(e);
                    None
                }
            }
        };
        let mine = mine.unwrap_or_else(|| zeros(local_len, dtype, &device));
        // Offloaded: this rank's gradient rows come down to host memory in one copy.
        let host_rows = self.host.as_ref().map(|host| (host, to_host(mine.clone())));
        let mut offset = 0;
        for (id, _) in &sharded {
            let len = self.elements(id, self.rank).map_or(0, |r| r.len());
            if len > 0 {
                match &host_rows {
                    Some((host, rows)) if host.is_parked(id) => {
                        host.add_grad(*id, rows.clone().slice(offset..offset + len));
                    }
                    _ => self.keep_grad(*id, mine.clone().slice(offset..offset + len)),
                }
            }
            offset += len;
        }
    }

    fn keep_grad<X: Backend>(&self, id: ParamId, g: Tensor<X, 1>) {
        let Ok(mut grads) = self.grads.lock() else {
            return;
        };
        let sum = match grads.remove(&id) {
            Some(prev) => match prev.downcast::<Tensor<X, 1>>() {
                Ok(prev) => *prev + g,
                Err(_) => g,
            },
            None => g,
        };
        grads.insert(id, Box::new(sum));
    }

    /// Registers the gradients kept since the last call into `out`, shaped as `model`'s
    /// parameters (a shard's rows for a sharded one).
    pub fn take_grads<X: AutodiffBackend, M: Module<X>>(
        &self,
        model: &M,
        out: &mut GradientsParams,
    ) {
        let kept = match self.grads.lock() {
            Ok(mut g) => std::mem::take(&mut *g),
            Err(_) => return,
        };
        struct Register<'a, X: AutodiffBackend> {
            kept: HashMap<ParamId, Box<dyn Any + Send>>,
            out: &'a mut GradientsParams,
            _x: std::marker::PhantomData<X>,
        }
        impl<X: AutodiffBackend> ModuleVisitor<X> for Register<'_, X> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<X, D>>) {
                let Some(g) = self.kept.remove(&param.id) else {
                    return;
                };
                let Ok(g) = g.downcast::<Tensor<X::InnerBackend, 1>>() else {
                    return;
                };
                let g = g.reshape(param.val().shape());
                let g = match self.out.remove::<X::InnerBackend, D>(param.id) {
                    Some(prev) => prev + g,
                    None => g,
                };
                self.out.register::<X::InnerBackend, D>(param.id, g);
            }
        }
        model.visit(&mut Register::<X> {
            kept,
            out,
            _x: std::marker::PhantomData,
        });
    }
}

/// The concatenation of `parts`, or an empty tensor of `dtype` when there are none.
fn concat<X: Backend>(parts: Vec<Tensor<X, 1>>, dtype: DType, device: &X::Device) -> Tensor<X, 1> {
    if parts.is_empty() {
        zeros(0, dtype, device)
    } else {
        Tensor::cat(parts, 0)
    }
}

fn zeros<X: Backend>(n: usize, dtype: DType, device: &X::Device) -> Tensor<X, 1> {
    crate::precision::to_dtype(Tensor::zeros([n], device), dtype)
}

#[cfg(test)]
mod tests {
    //! W ranks simulated in one thread: each rank's collectives return what the real calls
    //! would, computed from every rank's shard of the same module.

    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::module::Module;
    use burn::tensor::TensorData;

    type A = Autodiff<Flex>;

    /// Shapes with uneven splits and empty shards over 3 ranks: 5 rows (2, 2, 1), 2 rows
    /// (1, 1, 0), 1 row (1, 0, 0).
    #[derive(Module, Debug)]
    struct Block<B: Backend> {
        w: Param<Tensor<B, 2>>,
        norm: Param<Tensor<B, 1>>,
        row: Param<Tensor<B, 2>>,
    }

    fn block(device: &burn::tensor::Device<A>) -> Block<A> {
        let values =
            |n: usize, from: f32| -> Vec<f32> { (0..n).map(|i| from + i as f32).collect() };
        let t2 = |shape: [usize; 2], from| {
            Tensor::<A, 2>::from_data(
                TensorData::new(values(shape[0] * shape[1], from), shape),
                device,
            )
            .require_grad()
        };
        Block {
            w: Param::from_tensor(t2([5, 3], 0.0)),
            norm: Param::from_tensor(
                Tensor::<A, 1>::from_data(TensorData::new(values(2, 100.0), [2]), device)
                    .require_grad(),
            ),
            row: Param::from_tensor(t2([1, 4], 200.0)),
        }
    }

    fn flat<X: Backend, const D: usize>(t: Tensor<X, D>) -> Vec<f32> {
        t.into_data().convert::<f32>().to_vec().unwrap()
    }

    /// Every rank's flat local buffer, in visit order (what `gather` sends).
    fn local_buffer(shards: &LayerShards, module: &Block<A>) -> Vec<f32> {
        let mut out = Vec::new();
        for id in [module.w.id, module.norm.id, module.row.id] {
            assert!(shards.is_sharded(&id));
        }
        out.extend(flat(module.w.val()));
        out.extend(flat(module.norm.val()));
        out.extend(flat(module.row.val()));
        out
    }

    #[test]
    fn every_rank_gathers_the_whole_layer_from_uneven_and_empty_shards() {
        let device = Default::default();
        let whole = block(&device);
        let world = 3;
        let sharded: Vec<(LayerShards, Block<A>)> = (0..world)
            .map(|rank| {
                let mut s = LayerShards::new(rank, world);
                let m = s.shard(whole.clone());
                (s, m)
            })
            .collect();
        let lens: Vec<usize> = sharded.iter().map(|(_, m)| m.w.val().dims()[0]).collect();
        assert_eq!(lens, [2, 2, 1]);
        assert_eq!(sharded[2].1.norm.val().dims(), [0]);
        assert_eq!(sharded[1].1.row.val().dims(), [0, 4]);
        let everything: Vec<f32> = sharded
            .iter()
            .flat_map(|(s, m)| local_buffer(s, m))
            .collect();
        for (shards, module) in sharded {
            let everything = everything.clone();
            let shards = shards.with_collectives(Collectives::<A> {
                all_gather: Box::new(move |_| {
                    let n = everything.len();
                    Ok(Tensor::from_data(
                        TensorData::new(everything.clone(), [n]),
                        &Default::default(),
                    ))
                }),
                reduce_scatter: Box::new(|_, _| Err("unused".into())),
            });
            let gathered = shards.gather(&module);
            assert_eq!(flat(gathered.w.val()), flat(whole.w.val()));
            assert_eq!(flat(gathered.norm.val()), flat(whole.norm.val()));
            assert_eq!(flat(gathered.row.val()), flat(whole.row.val()));
            assert_eq!(gathered.w.id, whole.w.id, "ids are kept");
            assert!(gathered.w.val().is_require_grad());
            shards.check().unwrap();
        }
    }

    /// Rank `rank`'s backward through the whole layer: its gradient of every weight is
    /// `(rank + 1) * weight` (its loss sums `(rank + 1) w^2 / 2`).
    fn backward(rank: usize, whole: &Block<A>) -> <A as AutodiffBackend>::Gradients {
        let loss = (whole.w.val().powf_scalar(2.0).sum()
            + whole.norm.val().powf_scalar(2.0).sum()
            + whole.row.val().powf_scalar(2.0).sum())
            * ((rank + 1) as f64 / 2.0);
        loss.backward()
    }

    #[test]
    fn each_rank_keeps_the_sum_of_its_rows_of_the_gradients() {
        let device = Default::default();
        let whole = block(&device);
        let world = 3;
        // First what each rank sends: its whole gradients, rank-major.
        let mut sent: Vec<Vec<f32>> = Vec::new();
        for rank in 0..world {
            let mut shards = LayerShards::new(rank, world);
            let _ = shards.shard(whole.clone());
            let record = std::sync::Arc::new(Mutex::new(Vec::new()));
            let recorder = record.clone();
            let shards = shards.with_collectives(Collectives::<Flex> {
                all_gather: Box::new(|_| Err("unused".into())),
                reduce_scatter: Box::new(move |buffer, sizes| {
                    assert_eq!(sizes, [2 * 3 + 1 + 4, 2 * 3 + 1, 3]);
                    recorder.lock().unwrap().push(flat(buffer));
                    Err("recorded".into())
                }),
            });
            shards.scatter_grads::<A, _>(&mut backward(rank, &whole), &whole);
            assert!(shards.check().is_err(), "a failed call is reported");
            sent.push(record.lock().unwrap().remove(0));
        }
        let summed: Vec<f32> = (0..21).map(|i| sent.iter().map(|b| b[i]).sum()).collect();
        let segments = [0..11, 11..18, 18..21];
        // Then each rank keeps its segment of the sum, as its rows' gradients: 6 * weight.
        for rank in 0..world {
            let mut shards = LayerShards::new(rank, world);
            let module = shards.shard(whole.clone());
            let mine = summed[segments[rank].clone()].to_vec();
            let shards = shards.with_collectives(Collectives::<Flex> {
                all_gather: Box::new(|_| Err("unused".into())),
                reduce_scatter: Box::new(move |_, _| {
                    let n = mine.len();
                    Ok(Tensor::from_data(
                        TensorData::new(mine.clone(), [n]),
                        &Default::default(),
                    ))
                }),
            });
            shards.scatter_grads::<A, _>(&mut backward(rank, &whole), &whole);
            shards.check().unwrap();
            let mut grads = GradientsParams::new();
            shards.take_grads::<A, _>(&module, &mut grads);
            let six = |t: Tensor<A, 2>| flat(t.inner() * 6.0);
            let w = grads.get::<Flex, 2>(module.w.id).unwrap();
            assert_eq!(w.dims(), module.w.val().dims());
            assert_eq!(flat(w), six(module.w.val()));
            let norm = grads.get::<Flex, 1>(module.norm.id);
            let norm_rows = module.norm.val().dims()[0];
            match norm {
                Some(g) => assert_eq!(flat(g), flat(module.norm.val().inner() * 6.0)),
                None => assert_eq!(norm_rows, 0, "only an empty shard has no gradient"),
            }
            assert_eq!(
                grads.get::<Flex, 2>(module.row.id).map(flat),
                (rank == 0).then(|| six(module.row.val()))
            );
        }
    }

    /// CPU offload: a parked rank's module holds no rows, its rows gather as the device rows
    /// would, and its gradient rows are summed in host memory, never handed to the trainer's
    /// gradients.
    #[test]
    fn parked_rows_gather_from_the_host_and_their_gradients_stay_there() {
        let device = Default::default();
        let whole = block(&device);
        let world = 3;
        let rank = 1;
        let sharded: Vec<Block<A>> = (0..world)
            .map(|r| LayerShards::new(r, world).shard(whole.clone()))
            .collect();
        let everything: Vec<f32> = (0..world)
            .flat_map(|r| {
                let mut s = LayerShards::new(r, world);
                let m = s.shard(whole.clone());
                local_buffer(&s, &m)
            })
            .collect();
        let mut shards = LayerShards::new(rank, world).with_offload();
        let module = shards.shard(whole.clone());
        let module = shards.park(module);
        assert_eq!(module.w.val().dims(), [0, 3], "no rows on the device");
        assert!(module.w.val().is_require_grad(), "it still trains");
        assert_eq!(
            flat(shards.parked_value(&module.w.id).unwrap()),
            flat(sharded[rank].w.val()),
            "the rows are in host memory"
        );
        let sent = std::sync::Arc::new(Mutex::new(Vec::new()));
        let seen = sent.clone();
        // The sum over ranks of rank r's gradient (r + 1) * w is 6 * w; rank 1 keeps its segment.
        let mine: Vec<f32> =
            (0..21).map(|i| 6.0 * everything[i]).collect::<Vec<_>>()[11..18].to_vec();
        let shards = shards
            .with_collectives(Collectives::<A> {
                all_gather: Box::new(move |piece| {
                    seen.lock().unwrap().push(flat(piece));
                    let n = everything.len();
                    Ok(Tensor::from_data(
                        TensorData::new(everything.clone(), [n]),
                        &Default::default(),
                    ))
                }),
                reduce_scatter: Box::new(|_, _| Err("unused".into())),
            })
            .with_collectives(Collectives::<Flex> {
                all_gather: Box::new(|_| Err("unused".into())),
                reduce_scatter: Box::new(move |_, _| {
                    let n = mine.len();
                    Ok(Tensor::from_data(
                        TensorData::new(mine.clone(), [n]),
                        &Default::default(),
                    ))
                }),
            });
        let gathered = shards.gather(&module);
        let own = &sharded[rank];
        let rows: Vec<f32> =
            [flat(own.w.val()), flat(own.norm.val()), flat(own.row.val())].concat();
        assert_eq!(
            sent.lock().unwrap()[0],
            rows,
            "the parked rows are what the rank sends"
        );
        assert_eq!(flat(gathered.w.val()), flat(whole.w.val()));
        shards.scatter_grads::<A, _>(&mut backward(rank, &gathered), &gathered);
        shards.check().unwrap();
        let mut grads = GradientsParams::new();
        shards.take_grads::<A, _>(&module, &mut grads);
        assert!(grads.is_empty(), "parked gradients stay in host memory");
        let host = shards.offloaded().unwrap();
        assert_eq!(
            flat(host.grad(&module.w.id).unwrap()),
            flat(sharded[rank].w.val().inner().reshape([6]) * 6.0)
        );
        assert_eq!(
            flat(host.grad(&module.norm.id).unwrap()),
            flat(sharded[rank].norm.val().inner() * 6.0)
        );
        assert!(
            host.grad(&module.row.id).is_none(),
            "rank 1 has no row of it"
        );
    }
}
