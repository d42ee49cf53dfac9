//! Activation checkpointing (`enable_activation_checkpointing: true`), with torchtune's
//! granularity: one decoder layer. The forward pass runs without autodiff and keeps only each
//! layer's input; the backward pass then walks the layers from the top, recomputing one layer
//! at a time with autodiff and back-propagating the incoming gradient through it. Peak memory
//! holds the layer inputs plus one layer's activations instead of every layer's, for one
//! extra forward pass of compute.
//!
//! It is built from burn's public API (a backward pass per layer, summed by the gradient
//! accumulator), so it works on every backend. burn's own `BalancedCheckpointing` strategy
//! only recomputes element-wise operations and raised peak memory in our measurements.

use burn::module::AutodiffModule;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

use std::cell::RefCell;

use crate::models::decoder::{DecoderLayer, LogitRows, OutputHead};
use crate::models::moe::RouterLoad;
use crate::models::{CausalLm, TokenBatch};
use crate::modules::{ForwardMode, dropout};

/// What a training step keeps of each decoder layer for its backward pass
/// (`enable_activation_checkpointing`, `enable_activation_offloading`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Checkpointing {
    /// Every activation, in the autodiff graph.
    #[default]
    Off,
    /// Each layer's input only; the layer is recomputed in the backward pass.
    Layers,
    /// As `Layers`, each input in host memory from its forward until one layer before its
    /// backward (torchtune's activation offloading): the device holds at most two of them.
    LayersOffloaded,
}

impl Checkpointing {
    /// Per-layer recomputation when `on` (no offloading).
    pub fn layers_if(on: bool) -> Self {
        if on { Self::Layers } else { Self::Off }
    }

    /// Whether the step recomputes each layer in its own backward passes.
    pub fn recomputes(self) -> bool {
        self != Self::Off
    }
}

thread_local! {
    /// The most bytes of layer inputs one pass of this thread (a rank's worker) held in host
    /// memory, since [`take_offloaded_bytes`] last read it.
    static OFFLOADED_BYTES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The most bytes of layer inputs one pass of the calling thread held in host memory since
/// the last call (the trainer reads it per step, as the metric `offloaded_activation_bytes`).
pub fn take_offloaded_bytes() -> usize {
    OFFLOADED_BYTES.with(|bytes| bytes.replace(0))
}

/// A layer's input kept for its backward pass: on the device, or offloaded to host memory.
enum Kept<B: Backend> {
    Device(Tensor<B, 3>),
    Host(TensorData),
}

impl<B: Backend> Kept<B> {
    fn new(t: Tensor<B, 3>, offload: bool) -> Self {
        if offload {
            Self::Host(t.into_data())
        } else {
            Self::Device(t)
        }
    }

    fn host_bytes(&self) -> usize {
        match self {
            Self::Device(_) => 0,
            Self::Host(data) => data.bytes.len(),
        }
    }

    /// On the device again (an upload when it was offloaded).
    fn on(self, device: &B::Device) -> Tensor<B, 3> {
        match self {
            Self::Device(t) => t,
            Self::Host(data) => Tensor::from_data(data, device),
        }
    }
}

/// Seeds each layer's random draws (LoRA dropout) from the step seed, so the recomputation
/// draws exactly what the forward pass drew.
fn layer_seed(step_seed: u64, layer: usize) -> u64 {
    step_seed ^ (layer as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Forward and backward of the model under `head`, with per-layer recomputation. `head` gets
/// the model's output end whole ([`CausalLm::head`]) and the top layer's output (before the
/// final norm) as a leaf that requires a gradient, and returns the loss and the gradient sets
/// of its own backward passes (already weighted), which must include that leaf's gradient.
/// Returns the loss and one gradient set per backward pass; their sum is the gradient of the
/// whole model (for a sharded model: of its whole parameters, the sharded ones' rows being
/// reduce-scattered into its `LayerShards`).
pub fn forward_backward<B: AutodiffBackend>(
    model: &CausalLm<B>,
    input: TokenBatch<'_>,
    mode: ForwardMode,
    offload: bool,
    step_seed: u64,
    head: impl FnOnce(&OutputHead<B>, Tensor<B, 3>) -> (Tensor<B, 1>, Vec<B::Gradients>),
) -> (Tensor<B, 1>, Vec<B::Gradients>) {
    let (loss, grads, _) = passes(model, input, mode, offload, step_seed, head, None);
    (loss, grads)
}

/// [`forward_backward`] with the load-balancing loss of the sparse layers' routing
/// ([`RouterLoad::aux_loss`]) back-propagated times `scale` (its coefficient times the step's
/// weight): the forward pass adds up every layer's expert counts, and each layer's backward
/// pass adds its own probabilities' share, `scale * experts / rows^2 * sum_e counts_e *
/// probs_e`, whose gradient is exactly that layer's part of the whole loss's. Returns the loss
/// of `head` (without the term), the gradients, and the load-balancing loss.
#[allow(clippy::type_complexity)]
pub fn forward_backward_with_aux<B: AutodiffBackend>(
    model: &CausalLm<B>,
    input: TokenBatch<'_>,
    mode: ForwardMode,
    offload: bool,
    step_seed: u64,
    head: impl FnOnce(&OutputHead<B>, Tensor<B, 3>) -> (Tensor<B, 1>, Vec<B::Gradients>),
    scale: f64,
) -> (Tensor<B, 1>, Vec<B::Gradients>, Tensor<B::InnerBackend, 1>) {
    let (loss, grads, aux) = passes(model, input, mode, offload, step_seed, head, Some(scale));
    let aux = aux.unwrap_or_else(|| Tensor::zeros([1], &model.device()));
    (loss, grads, aux)
}

#[allow(clippy::type_complexity)]
fn passes<B: AutodiffBackend>(
    model: &CausalLm<B>,
    input: TokenBatch<'_>,
    mode: ForwardMode,
    offload: bool,
    step_seed: u64,
    head: impl FnOnce(&OutputHead<B>, Tensor<B, 3>) -> (Tensor<B, 1>, Vec<B::Gradients>),
    aux_scale: Option<f64>,
) -> (
    Tensor<B, 1>,
    Vec<B::Gradients>,
    Option<Tensor<B::InnerBackend, 1>>,
) {
    let device = model.device();
    let layers = &model.model.layers;

    // FSDP: the embeddings are gathered for their forward and, when they train, kept until
    // their gradient is reduce-scattered at the end.
    let embeddings_train = model.model.embed_tokens.weight.val().is_require_grad();
    let embedding = model.embedding();
    let embedded = model.embed_with(&embedding, input);
    let embedding = embeddings_train.then_some(embedding);

    // Forward without autodiff, keeping each layer's input.
    let mut inner_ctx = model.pass_context::<B::InnerBackend>(input, 0, mode, &device);
    if aux_scale.is_some() {
        inner_ctx.router_load = Some(RefCell::new(RouterLoad::new(input.padding)));
    }
    let mut layer_inputs = Vec::with_capacity(layers.len());
    let mut h = embedded.clone().inner();
    let sharded = model.shards.is_some();
    let prefetch_beside = sharded && prefetch_on_a_thread::<B>();
    // FSDP keeping the gathered layers for the backward (`fsdp_reshard_after_forward: False`):
    // gathered once, on the autodiff backend, and run here without autodiff.
    let keep = model
        .shards
        .as_ref()
        .is_some_and(|s| !s.reshard_after_forward);
    let mut kept: Vec<DecoderLayer<B>> = Vec::new();
    // FSDP: a layer's whole weights exist only for its forward; the next layer's gather runs
    // beside this one's compute (on the CPU: `prefetch_on_a_thread`).
    let gather_inner = |i: usize| match &model.shards {
        Some(shards) => shards.gather(&layers[i].valid()).gather_nf4(shards),
        None => layers[i].valid(),
    };
    let mut next = (!layers.is_empty() && !keep).then(|| gather_inner(0));
    for i in 0..layers.len() {
        layer_inputs.push(Kept::new(h.clone(), offload));
        dropout::seed_thread(layer_seed(step_seed, i));
        if keep {
            let whole = model.layer(i).into_owned();
            h = whole.valid().forward(h, &inner_ctx, None);
            kept.push(whole);
            continue;
        }
        let Some(layer) = next.take() else { break };
        let prefetch = (prefetch_beside && i + 1 < layers.len()).then_some(|| gather_inner(i + 1));
        let (out, prefetched) = overlap(prefetch, || layer.forward(h, &inner_ctx, None));
        h = out;
        next = prefetched.or_else(|| (i + 1 < layers.len()).then(|| gather_inner(i + 1)));
    }

    // Every layer's input is kept (on the device, or offloaded): a sample of the device's
    // memory for the step's peak.
    crate::device::sample_device_memory(&device);
    let held: usize = layer_inputs.iter().map(Kept::host_bytes).sum();
    OFFLOADED_BYTES.with(|bytes| bytes.set(bytes.get().max(held)));

    // The load-balancing loss: its value, and per expert the weight each layer's summed
    // probability takes in it (the counts are constants of the whole pass).
    let routing = inner_ctx
        .router_load
        .take()
        .map(RefCell::into_inner)
        .filter(|load| load.rows > 0);
    let aux = routing.as_ref().and_then(RouterLoad::aux_loss);
    let per_prob = match (&routing, aux_scale) {
        (Some(load), Some(scale)) => {
            let rows = load.rows as f64;
            let factor = scale * load.counts.len() as f64 / (rows * rows);
            let weights: Vec<f32> = load
                .counts
                .iter()
                .map(|c| (*c as f64 * factor) as f32)
                .collect();
            let n = weights.len();
            Some(Tensor::<B, 1>::from_data(
                TensorData::new(weights, [n]),
                &device,
            ))
        }
        _ => None,
    };
    drop(inner_ctx);

    // The head (final norm, projection, loss) with autodiff from the top layer's output;
    // FSDP gathers the output end for it and reduce-scatters its gradients.
    let top = Tensor::<B, 3>::from_inner(h).require_grad();
    let output = model.head();
    let (loss, mut grads) = head(&output, top.clone());
    let mut upstream = grads
        .iter_mut()
        .filter_map(|g| top.grad_remove(g))
        .reduce(|a, b| a + b);
    if let Some(shards) = &model.shards {
        for set in &mut grads {
            shards.scatter_grads::<B, _>(set, &output);
        }
    }
    drop(output);

    // Back through the layers, recomputing each.
    let mut ctx = model.pass_context::<B>(input, 0, mode, &device);
    if per_prob.is_some() {
        ctx.router_load = Some(RefCell::new(RouterLoad::new(input.padding)));
    }
    // FSDP: each layer is gathered again (the one below it meanwhile), and its weight
    // gradients are reduce-scattered to each rank's rows as soon as its backward ends, so no
    // rank holds the whole model's gradients. The reduce-scatter waits for the prefetch:
    // every rank then makes its collective calls in the same order.
    let gather = |i: usize| model.layer(i).into_owned();
    let mut next = match kept.pop() {
        Some(layer) => Some(layer),
        None => (!layers.is_empty()).then(|| gather(layers.len() - 1)),
    };
    // Offloaded inputs come back one layer ahead: layer i - 1's is uploaded while layer i's
    // backward runs, so the device holds two at most.
    let mut ahead: Option<Tensor<B::InnerBackend, 3>> = None;
    for i in (0..layers.len()).rev() {
        let x = ahead
            .take()
            .or_else(|| layer_inputs.pop().map(|kept| kept.on(&device)));
        ahead = layer_inputs.pop().map(|kept| kept.on(&device));
        let (Some(grad), Some(x), Some(layer)) = (upstream.take(), x, next.take()) else {
            break;
        };
        let x = Tensor::<B, 3>::from_inner(x).require_grad();
        dropout::seed_thread(layer_seed(step_seed, i));
        let prefetch = (prefetch_beside && !keep && i > 0).then_some(|| gather(i - 1));
        let (mut layer_grads, prefetched) = overlap(prefetch, || {
            let y = layer.forward(x.clone(), &ctx, None);
            let mut out = (y * Tensor::from_inner(grad)).sum();
            // A sparse layer's share of the load-balancing loss, from its own probabilities.
            let probs = ctx
                .router_load
                .as_ref()
                .and_then(|cell| cell.borrow_mut().take_probs());
            if let (Some(probs), Some(weights)) = (probs, &per_prob) {
                out = out + (probs * weights.clone()).sum();
            }
            out.backward()
        });
        crate::device::sample_device_memory(&device);
        // Taken out of the layer's set: the sets are kept until the step's update, and the
        // input's gradient would hold a layer input's worth of memory per layer.
        upstream = x.grad_remove(&mut layer_grads);
        if let Some(shards) = &model.shards {
            shards.scatter_grads::<B, _>(&mut layer_grads, &layer);
        }
        grads.push(layer_grads);
        next = match kept.pop() {
            Some(layer) => Some(layer),
            None => prefetched.or_else(|| (i > 0).then(|| gather(i - 1))),
        };
    }

    // The embeddings, when they train (full fine-tuning).
    if let (Some(grad), Some(embedding)) = (upstream, embedding) {
        let mut set = (embedded * Tensor::from_inner(grad)).sum().backward();
        if let Some(shards) = &model.shards {
            shards.scatter_grads::<B, _>(&mut set, &embedding);
        }
        grads.push(set);
    }
    (loss, grads, aux)
}

/// Whether FSDP's gather of the next layer may run on a thread beside the current layer's
/// compute: on the CPU backend (Flex) only. Why: on burn's cubecl backends a gather on a
/// second thread during a layer's backward corrupted that backward's gradients (wgpu, two
/// lavapipe nodes, tiny-llama: a gradient norm of 4.9e7 at the first step, where the gathers
/// one after the other give 7.807, the one-device run's). There the gathers run in order,
/// and the device's own queue is what overlaps transfers with compute.
fn prefetch_on_a_thread<B: AutodiffBackend>() -> bool {
    std::any::TypeId::of::<B::InnerBackend>() == std::any::TypeId::of::<burn::backend::Flex>()
}

/// `work`, with `prefetch` (FSDP's gather of the next layer) on a thread beside it. Why: a
/// gather is memory traffic and, between nodes, network waits that need not hold up the layer's
/// compute. Measured on the 2-core machine (SmolLM2-135M, 2 processes): 32-34 tokens/s with
/// and without it over two runs each, i.e. no difference where both ranks already keep both
/// cores busy (BENCHMARKS.md, "FSDP"); it is for machines with a core or a link to spare.
fn overlap<T, P: Send>(
    prefetch: Option<impl FnOnce() -> P + Send>,
    work: impl FnOnce() -> T,
) -> (T, Option<P>) {
    let Some(prefetch) = prefetch else {
        return (work(), None);
    };
    std::thread::scope(|scope| {
        let gathering = scope.spawn(prefetch);
        let done = work();
        let gathered = gathering
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (done, Some(gathered))
    })
}

/// What a loss step's pass returns ([`loss_and_grads`]).
pub struct LossPass<B: AutodiffBackend> {
    /// The loss, the load-balancing term included when the pass adds it.
    pub loss: Tensor<B, 1>,
    /// The gradients of `loss * weight`, computed with per-layer recomputation; `None` when the
    /// trainer back-propagates `loss` itself.
    pub grads: Option<Vec<B::Gradients>>,
    /// The load-balancing loss alone (for the log), when the pass adds it.
    pub aux_loss: Option<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> LossPass<B> {
    /// `("aux_loss", value)` when the pass added the load-balancing loss: every loss step logs
    /// it under transformers' and TRL's name.
    pub fn aux_metric(&self) -> Option<(&'static str, Tensor<B::InnerBackend, 1>)> {
        self.aux_loss.clone().map(|aux| ("aux_loss", aux))
    }
}

/// A loss step's forward (and, with checkpointing, backward) pass: the loss `loss_of_logits`
/// makes of the model's logits, for the trainer to back-propagate, or with its gradients
/// already computed (for `loss * weight`) when `checkpointing` recomputes each layer.
///
/// With `aux_coef` (the model's `router_aux_loss_coef` when its config.json asks for the
/// load-balancing loss, [`crate::training::load_balancing::aux_loss_coef`]) the loss is `loss_of_logits`
/// plus `aux_coef` times the load-balancing loss of this pass's routing, as TRL's DPO and GRPO
/// trainers add it to each micro-batch's loss (`loss + router_aux_loss_coef * aux_loss`),
/// over the tokens `input.padding` leaves in (their `attention_mask`). Gradient contract: that
/// of the sum; the expert counts are constants, as transformers' histogram is.
pub fn loss_and_grads<B: AutodiffBackend>(
    model: &CausalLm<B>,
    input: TokenBatch<'_>,
    mode: ForwardMode,
    checkpointing: (Checkpointing, u64),
    weight: f64,
    aux_coef: Option<f64>,
    loss_of_logits: impl FnOnce(Tensor<B, 3>) -> Tensor<B, 1>,
) -> LossPass<B> {
    let head = LossHead {
        logits_at: None,
        loss_of_logits,
    };
    loss_pass(model, input, mode, checkpointing, weight, aux_coef, head)
}

/// [`loss_and_grads`] with logits only at `logits_at`: `loss_of_logits` gets
/// `[sequences, width, vocab]` ([`OutputHead::logits_at`]).
pub fn loss_and_grads_at<B: AutodiffBackend>(
    model: &CausalLm<B>,
    input: TokenBatch<'_>,
    mode: ForwardMode,
    checkpointing: (Checkpointing, u64),
    weight: f64,
    aux_coef: Option<f64>,
    (logits_at, loss_of_logits): (LogitRows<'_>, impl FnOnce(Tensor<B, 3>) -> Tensor<B, 1>),
) -> LossPass<B> {
    let head = LossHead {
        logits_at: Some(logits_at),
        loss_of_logits,
    };
    loss_pass(model, input, mode, checkpointing, weight, aux_coef, head)
}

/// What a pass makes of its top hidden states: logits (at every position, or at the given
/// ones) and the loss of them.
struct LossHead<'a, F> {
    logits_at: Option<LogitRows<'a>>,
    loss_of_logits: F,
}

impl<F> LossHead<'_, F> {
    /// The loss of the logits of `normed` (final norm applied).
    fn loss<B: Backend>(
        self,
        output: &OutputHead<B>,
        normed: Tensor<B, 3>,
        mode: ForwardMode,
    ) -> Tensor<B, 1>
    where
        F: FnOnce(Tensor<B, 3>) -> Tensor<B, 1>,
    {
        let logits = match self.logits_at {
            Some(at) => output.logits_at(normed, at, mode),
            None => output.logits(normed, mode),
        };
        (self.loss_of_logits)(logits)
    }
}

fn loss_pass<B: AutodiffBackend>(
    model: &CausalLm<B>,
    input: TokenBatch<'_>,
    mode: ForwardMode,
    (checkpointing, step_seed): (Checkpointing, u64),
    weight: f64,
    aux_coef: Option<f64>,
    loss_head: LossHead<'_, impl FnOnce(Tensor<B, 3>) -> Tensor<B, 1>>,
) -> LossPass<B> {
    // A sharded model trains only through per-layer passes: its layers are whole one at a
    // time, and their gradients reach its shards only from here.
    if checkpointing.recomputes() || model.shards.is_some() {
        let head = |output: &OutputHead<B>, top: Tensor<B, 3>| {
            let loss = loss_head.loss(output, output.norm(top), mode);
            let grads = (loss.clone() * weight).backward();
            (loss, vec![grads])
        };
        let offload = checkpointing == Checkpointing::LayersOffloaded;
        let aux_scale = aux_coef.map(|coef| coef * weight);
        let (loss, grads, aux) = passes(model, input, mode, offload, step_seed, head, aux_scale);
        let Some(coef) = aux_coef else {
            return LossPass {
                loss,
                grads: Some(grads),
                aux_loss: None,
            };
        };
        let aux = aux.unwrap_or_else(|| Tensor::zeros([1], &model.device()));
        return LossPass {
            loss: Tensor::from_inner(loss.inner() + aux.clone() * coef),
            grads: Some(grads),
            aux_loss: Some(aux),
        };
    }
    let Some(coef) = aux_coef else {
        let hidden = model.hidden(input, mode, None);
        return LossPass {
            loss: loss_head.loss(&model.head(), hidden, mode),
            grads: None,
            aux_loss: None,
        };
    };
    let (hidden, load) = model.hidden_with_router_load(input, mode);
    let aux = load
        .aux_loss()
        .unwrap_or_else(|| Tensor::zeros([1], &model.device()));
    let loss = loss_head.loss(&model.head(), hidden, mode) + aux.clone() * coef;
    LossPass {
        loss,
        grads: None,
        aux_loss: Some(aux.inner()),
    }
}
