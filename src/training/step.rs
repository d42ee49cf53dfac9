//! One optimizer step over a model's trainable parameters: gradient accumulation across
//! micro-batches, the global gradient norm and clipping, and the update itself.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use super::optimizer::Optimizer;
use super::parallel::sharded_optimizer::OptimizerShard;
use crate::models::CausalLm;

/// Sums gradients over the backward passes of one optimizer step (one per micro-batch, or
/// one per layer with activation checkpointing).
pub struct GradAccumulator<B: AutodiffBackend> {
    inner: GradientsAccumulator<CausalLm<B>>,
}

impl<B: AutodiffBackend> Default for GradAccumulator<B> {
    fn default() -> Self {
        Self {
            inner: GradientsAccumulator::new(),
        }
    }
}

impl<B: AutodiffBackend> GradAccumulator<B> {
    pub fn add(&mut self, model: &CausalLm<B>, grads: B::Gradients) {
        let grads = GradientsParams::from_grads(grads, model);
        self.inner.accumulate(model, grads);
    }

    pub fn take(&mut self) -> GradientsParams {
        self.inner.grads()
    }
}

/// The squares of every gradient summed on the device, so the norm costs one read-back.
struct SquaredNorm<'a, B: AutodiffBackend, F: Fn(&ParamId) -> bool> {
    grads: &'a GradientsParams,
    keep: F,
    total: Option<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend, F: Fn(&ParamId) -> bool> ModuleVisitor<B> for SquaredNorm<'_, B, F> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !(self.keep)(&param.id) {
            return;
        }
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let square = crate::precision::to_f32(g).powi_scalar(2).sum();
            self.total = Some(match self.total.take() {
                Some(total) => total + square,
                None => square,
            });
        }
    }
}

/// The squared L2 norm of all gradients together (`torch.nn.utils.clip_grad_norm_` takes its
/// root), in fp32 on the device; `None` without gradients. Non-finite when any gradient is.
pub fn squared_grad_norm<B: AutodiffBackend>(
    model: &CausalLm<B>,
    grads: &GradientsParams,
) -> Option<Tensor<B::InnerBackend, 1>> {
    squared_grad_norm_of(model, grads, |_| true)
}

/// [`squared_grad_norm`] over the parameters `keep` picks.
pub fn squared_grad_norm_of<B: AutodiffBackend>(
    model: &CausalLm<B>,
    grads: &GradientsParams,
    keep: impl Fn(&ParamId) -> bool,
) -> Option<Tensor<B::InnerBackend, 1>> {
    let mut v = SquaredNorm::<B, _> {
        grads,
        keep,
        total: None,
    };
    model.visit(&mut v);
    v.total
}

/// Bytes of the gradients in `grads` (of `model`'s parameters).
pub fn gradient_bytes<B: AutodiffBackend>(model: &CausalLm<B>, grads: &GradientsParams) -> usize {
    struct Bytes<'a> {
        grads: &'a GradientsParams,
        total: usize,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Bytes<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
                self.total += g.shape().num_elements() * g.dtype().size();
            }
        }
    }
    let mut bytes = Bytes { grads, total: 0 };
    model.visit(&mut bytes);
    bytes.total
}

struct ApplyUpdate<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    optimizer: &'a mut Optimizer<B::InnerBackend>,
    lr: f64,
    scale: f64,
    path: Vec<String>,
    shard: Option<&'a OptimizerShard>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for ApplyUpdate<'_, B> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(grad) = self.grads.remove::<B::InnerBackend, D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let shape = tensor.shape();
        let n = shape.num_elements();
        let name = self.path.join(".");
        if self.shard.is_some_and(|s| !s.owns(&name)) {
            // Another rank updates it; `gather_params` brings the result.
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let inner = tensor.inner().reshape([n]);
        let updated = self
            .optimizer
            .update(&name, inner, grad, self.scale, self.lr);
        let value = Tensor::from_inner(updated.reshape(shape)).require_grad();
        Param::from_mapped_value(id, value, mapper)
    }
}

/// Applies one optimizer step to every parameter that has a gradient (with a `shard`, only
/// to the parameters this rank owns); each gradient is multiplied by `scale` first (token
/// normalisation and clipping folded together).
pub fn apply<B: AutodiffBackend>(
    model: CausalLm<B>,
    mut grads: GradientsParams,
    optimizer: &mut Optimizer<B::InnerBackend>,
    (lr, scale): (f64, f64),
    shard: Option<&OptimizerShard>,
) -> CausalLm<B> {
    optimizer.begin_step();
    let mut mapper = ApplyUpdate::<B> {
        grads: &mut grads,
        optimizer,
        lr,
        scale,
        path: Vec::new(),
        shard,
    };
    model.map(&mut mapper)
}
