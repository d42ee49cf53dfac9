//! The fused kernels as burn operations on the Flex backend, with their own backward on
//! `Autodiff<Flex, C>`: the forward keeps what the backward needs (the softmax output, the
//! logits and their log-sum-exp, SiLU's input) instead of burn's default, which re-runs `exp`
//! in the backward and materialises every intermediate of the composed ops.

use std::sync::Arc;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Element, Shape, TensorData, TensorMetadata, bf16, f16};
use burn_flex::{Flex, FlexTensor};

use super::{attention, bf16 as convert, rows};

/// A contiguous f32 copy-free view of `t` (copies only when `t` is a strided view).
fn contiguous(t: &FlexTensor) -> FlexTensor {
    t.to_contiguous()
}

fn new_tensor(values: Vec<f32>, shape: Shape) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

fn last_dim(shape: &Shape) -> usize {
    shape.last().copied().unwrap_or(1).max(1)
}

// ---------------------------------------------------------------------------------------------
// Softmax over the last dimension.

pub fn softmax_forward(x: &FlexTensor) -> FlexTensor {
    let x = contiguous(x);
    let shape = x.shape();
    let input: &[f32] = x.storage();
    let mut out = vec![0.0; input.len()];
    rows::softmax(input, &mut out, last_dim(&shape));
    new_tensor(out, shape)
}

fn softmax_backward(y: &FlexTensor, grad: FlexTensor) -> FlexTensor {
    let grad = contiguous(&grad);
    let shape = y.shape();
    let mut out = vec![0.0; grad.shape().num_elements()];
    rows::softmax_backward(y.storage(), grad.storage(), &mut out, last_dim(&shape));
    new_tensor(out, shape)
}

pub fn masked_softmax_forward(
    x: &FlexTensor,
    mask: &[f32],
    layout: rows::MaskLayout,
) -> FlexTensor {
    let x = contiguous(x);
    let shape = x.shape();
    let input: &[f32] = x.storage();
    let mut out = vec![0.0; input.len()];
    rows::masked_softmax(input, mask, &mut out, last_dim(&shape), layout);
    new_tensor(out, shape)
}

#[derive(Debug)]
struct SoftmaxBackward;

impl Backward<Flex, 1> for SoftmaxBackward {
    /// The forward output.
    type State = FlexTensor;

    fn backward(self, ops: Ops<FlexTensor, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let y = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |grad| {
            softmax_backward(&y, grad)
        });
    }
}

/// Softmax with its own backward; `forward` computes the output from the input primitive
/// (plain or masked softmax: the mask is a constant, so both have the same backward).
pub fn softmax_autodiff<C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<Flex, C>>,
    forward: impl FnOnce(&FlexTensor) -> FlexTensor,
) -> FloatTensor<Autodiff<Flex, C>> {
    let y = forward(&x.primitive);
    match SoftmaxBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(y.clone(), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

// ---------------------------------------------------------------------------------------------
// SiLU, elementwise.

pub fn silu_forward(x: &FlexTensor) -> FlexTensor {
    let x = contiguous(x);
    let shape = x.shape();
    let input: &[f32] = x.storage();
    let mut out = vec![0.0; input.len()];
    rows::silu(input, &mut out);
    new_tensor(out, shape)
}

#[derive(Debug)]
struct SiluBackward;

impl Backward<Flex, 1> for SiluBackward {
    /// The forward input (contiguous).
    type State = FlexTensor;

    fn backward(self, ops: Ops<FlexTensor, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let x = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |grad| {
            let grad = contiguous(&grad);
            let mut out = vec![0.0; grad.shape().num_elements()];
            rows::silu_backward(x.storage(), grad.storage(), &mut out);
            new_tensor(out, x.shape())
        });
    }
}

pub fn silu_autodiff<C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<Flex, C>>,
) -> FloatTensor<Autodiff<Flex, C>> {
    let input = contiguous(&x.primitive);
    let y = silu_forward(&input);
    match SiluBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(input, y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU's hidden activation, `silu(gate) * up`, elementwise.

pub fn swiglu_forward(gate: &FlexTensor, up: &FlexTensor) -> FlexTensor {
    let (gate, up) = (contiguous(gate), contiguous(up));
    let mut out = vec![0.0; gate.shape().num_elements()];
    rows::swiglu(gate.storage(), up.storage(), &mut out);
    new_tensor(out, gate.shape())
}

#[derive(Debug)]
struct SwigluBackward;

impl Backward<Flex, 2> for SwigluBackward {
    /// Both inputs (contiguous): the only activations the pair keeps, where the composed ops
    /// kept `silu(gate)` as well.
    type State = (FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (gate, up) = ops.state;
        let grad = contiguous(&grads.consume::<Flex>(&ops.node));
        let n = grad.shape().num_elements();
        let (mut d_gate, mut d_up) = (vec![0.0; n], vec![0.0; n]);
        rows::swiglu_backward(
            gate.storage(),
            up.storage(),
            grad.storage(),
            &mut d_gate,
            &mut d_up,
        );
        let [gate_parent, up_parent] = ops.parents;
        if let Some(node) = gate_parent {
            grads.register::<Flex>(node.id, new_tensor(d_gate, gate.shape()));
        }
        if let Some(node) = up_parent {
            grads.register::<Flex>(node.id, new_tensor(d_up, up.shape()));
        }
    }
}

pub fn swiglu_autodiff<C: CheckpointStrategy>(
    [gate, up]: [FloatTensor<Autodiff<Flex, C>>; 2],
) -> FloatTensor<Autodiff<Flex, C>> {
    let (gate_in, up_in) = (contiguous(&gate.primitive), contiguous(&up.primitive));
    let y = swiglu_forward(&gate_in, &up_in);
    match SwigluBackward
        .prepare::<C>([gate.node.clone(), up.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((gate_in, up_in), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

// ---------------------------------------------------------------------------------------------
// log_softmax(logits)[target] per row: the cross-entropy's inner term.

/// What the backward needs: the logits (shared, not copied), each row's log-sum-exp and the
/// targets.
#[derive(Debug, Clone)]
struct TargetLogProbsState {
    logits: FlexTensor,
    lse: Arc<Vec<f32>>,
    targets: Arc<Vec<usize>>,
}

/// Forward: `(log-probabilities [rows], log-sum-exp per row, contiguous logits)`.
fn target_log_probs_forward(
    logits: &FlexTensor,
    targets: &[usize],
) -> (FlexTensor, Vec<f32>, FlexTensor) {
    let logits = contiguous(logits);
    let shape = logits.shape();
    let vocab = last_dim(&shape);
    let rows_n = targets.len();
    let values: &[f32] = logits.storage();
    let mut lse = vec![0.0; rows_n];
    rows::log_sum_exp(values, &mut lse, vocab);
    let log_probs: Vec<f32> = targets
        .iter()
        .enumerate()
        .map(|(r, &t)| values[r * vocab + t] - lse[r])
        .collect();
    (new_tensor(log_probs, Shape::new([rows_n])), lse, logits)
}

pub fn target_log_probs_inference(logits: &FlexTensor, targets: &[usize]) -> FlexTensor {
    target_log_probs_forward(logits, targets).0
}

#[derive(Debug)]
struct TargetLogProbsBackward;

impl Backward<Flex, 1> for TargetLogProbsBackward {
    type State = TargetLogProbsState;

    fn backward(
        self,
        ops: Ops<TargetLogProbsState, 1>,
        grads: &mut Gradients,
        _: &mut Checkpointer,
    ) {
        let state = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |grad| {
            let grad = contiguous(&grad);
            let shape = state.logits.shape();
            let mut out = vec![0.0; shape.num_elements()];
            rows::target_log_probs_backward(
                state.logits.storage(),
                &state.lse,
                &state.targets,
                grad.storage(),
                &mut out,
                last_dim(&shape),
            );
            new_tensor(out, shape)
        });
    }
}

pub fn target_log_probs_autodiff<C: CheckpointStrategy>(
    logits: FloatTensor<Autodiff<Flex, C>>,
    targets: Vec<usize>,
) -> FloatTensor<Autodiff<Flex, C>> {
    let (log_probs, lse, contiguous_logits) = target_log_probs_forward(&logits.primitive, &targets);
    match TargetLogProbsBackward
        .prepare::<C>([logits.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            TargetLogProbsState {
                logits: contiguous_logits,
                lse: Arc::new(lse),
                targets: Arc::new(targets),
            },
            log_probs,
        ),
        OpsKind::UnTracked(prep) => prep.finish(log_probs),
    }
}

// ---------------------------------------------------------------------------------------------
// Permute into a contiguous buffer.

/// A contiguous copy of `x`. When the innermost dimension is contiguous (every permute that
/// keeps the last axis last, e.g. splitting or merging attention heads), it copies whole
/// innermost runs with `memcpy`; Flex's own copy walks such 4-D and 5-D layouts one element
/// at a time.
pub fn contiguous_copy(x: &FlexTensor) -> FlexTensor {
    match x.dtype() {
        DType::F32 => copy_runs::<f32>(x),
        DType::BF16 => copy_runs::<bf16>(x),
        _ => x.to_contiguous(),
    }
}

fn copy_runs<E: Element + bytemuck::Pod>(x: &FlexTensor) -> FlexTensor {
    let layout = x.layout();
    let shape = layout.shape().clone();
    let strides = layout.strides().to_vec();
    let rank = strides.len();
    let total = shape.num_elements();
    let runs_are_contiguous =
        rank >= 2 && strides[rank - 1] == 1 && strides.iter().all(|&s| s >= 0);
    if x.is_contiguous() || !runs_are_contiguous || total == 0 {
        return x.to_contiguous();
    }
    let run = shape[rank - 1];
    let src: &[E] = x.storage();
    let mut out: Vec<E> = Vec::with_capacity(total);
    let mut index = vec![0usize; rank - 1];
    let mut offset = layout.start_offset() as isize;
    loop {
        let start = offset as usize;
        out.extend_from_slice(&src[start..start + run]);
        // Odometer over the outer dimensions, last one fastest.
        let mut dim = rank - 1;
        loop {
            if dim == 0 {
                return FlexTensor::from_data(TensorData::new(out, shape));
            }
            dim -= 1;
            index[dim] += 1;
            offset += strides[dim];
            if index[dim] < shape[dim] {
                break;
            }
            offset -= strides[dim] * shape[dim] as isize;
            index[dim] = 0;
        }
    }
}

// Writing positions into a key/value cache.

/// `buffer` (`[batch, heads, capacity, dim]`) with `new` (`[batch, heads, count, dim]`, the same
/// dtype) written at positions `at..at + count`, in place; `Err(buffer)` unchanged when it
/// cannot be: a buffer shared or laid out otherwise, another dtype or shape, too few positions.
///
/// Why: burn-flex 0.21's `slice_assign` copies its whole destination every time (it takes a
/// second handle on the buffer with `to_contiguous` and then writes through a copy-on-write
/// `storage_mut`). A decoding step writes one position per layer, so each token copied every
/// layer's whole cache, a cost growing with the cache (the whole generation quadratic in its
/// length). Written in place, GRPO's rollouts on SmolLM2-135M's shape (16 rows, 32 tokens,
/// BENCHMARKS.md) went from 210 to 255 tokens/s, with the same tokens.
pub fn write_positions(
    buffer: FlexTensor,
    at: usize,
    new: &FlexTensor,
) -> Result<FlexTensor, FlexTensor> {
    match buffer.dtype() {
        DType::F32 => write_positions_of::<f32>(buffer, at, new),
        DType::BF16 => write_positions_of::<bf16>(buffer, at, new),
        DType::F16 => write_positions_of::<f16>(buffer, at, new),
        _ => Err(buffer),
    }
}

fn write_positions_of<E: Element + bytemuck::Pod>(
    mut buffer: FlexTensor,
    at: usize,
    new: &FlexTensor,
) -> Result<FlexTensor, FlexTensor> {
    let (Ok([batch, heads, capacity, dim]), Ok([new_batch, new_heads, count, new_dim])) = (
        <[usize; 4]>::try_from(buffer.layout().shape().to_vec()),
        <[usize; 4]>::try_from(new.layout().shape().to_vec()),
    ) else {
        return Err(buffer);
    };
    let fits = [new_batch, new_heads, new_dim] == [batch, heads, dim] && at + count <= capacity;
    let whole = buffer.layout().contiguous_offsets() == Some((0, batch * heads * capacity * dim));
    if !fits || !whole || new.dtype() != buffer.dtype() || !buffer.is_unique() {
        return Err(buffer);
    }
    let new = contiguous_copy(new);
    let Some(src) = new.as_slice::<E>() else {
        return Err(buffer);
    };
    // Unique, so this is the buffer itself, not a copy.
    let dst = buffer.storage_mut::<E>();
    for (block, values) in src.chunks_exact(count * dim).enumerate() {
        let start = (block * capacity + at) * dim;
        dst[start..start + count * dim].copy_from_slice(values);
    }
    Ok(buffer)
}

pub fn permute_forward(x: &FlexTensor, axes: &[usize]) -> FlexTensor {
    contiguous_copy(&x.permute(axes))
}

#[derive(Debug)]
struct PermuteBackward;

impl Backward<Flex, 1> for PermuteBackward {
    /// The inverse permutation.
    type State = Vec<usize>;

    fn backward(self, ops: Ops<Vec<usize>, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let inverse = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |grad| {
            permute_forward(&grad, &inverse)
        });
    }
}

pub fn permute_autodiff<C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<Flex, C>>,
    axes: &[usize],
) -> FloatTensor<Autodiff<Flex, C>> {
    let y = permute_forward(&x.primitive, axes);
    match PermuteBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let mut inverse = vec![0; axes.len()];
            for (i, &a) in axes.iter().enumerate() {
                inverse[a] = i;
            }
            prep.finish(inverse, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

// ---------------------------------------------------------------------------------------------
// Fused attention (see `attention`): queries `[batch, kv_heads, rows, dim]`, keys and values
// `[batch, kv_heads, k_len, dim]`.

/// The mask (shared by every layer of a pass) and soft cap of one attention call.
#[derive(Debug, Clone)]
pub struct AttentionMasking {
    pub mask: Arc<Vec<f32>>,
    pub spans: Arc<Vec<attention::RowSpan>>,
    pub mask_batch: usize,
    pub q_len: usize,
    pub softcap: Option<f32>,
}

/// `t` when its rows are `dim` apart (contiguous, or a prefix view of the generation cache's
/// buffer), else a contiguous copy.
fn with_rows_adjacent(t: &FlexTensor) -> FlexTensor {
    let layout = t.layout();
    let strides = layout.strides();
    let dim = layout.shape()[3] as isize;
    let adjacent = strides[3] == 1 && strides[2] == dim && strides[0] >= 0 && strides[1] >= 0;
    if adjacent { t.clone() } else { contiguous(t) }
}

fn head_rows(t: &FlexTensor) -> attention::HeadRows<'_> {
    let layout = t.layout();
    let strides = layout.strides();
    attention::HeadRows {
        data: t.storage(),
        offset: layout.start_offset(),
        batch_stride: strides[0] as usize,
        head_stride: strides[1] as usize,
    }
}

/// The call's inputs; `q` contiguous, `k` and `v` from [`with_rows_adjacent`], the sinks (one
/// per query head) as values.
fn attention_inputs<'a>(
    q: &'a FlexTensor,
    k: &'a FlexTensor,
    v: &'a FlexTensor,
    sinks: Option<&'a [f32]>,
    masking: &'a AttentionMasking,
) -> attention::Inputs<'a> {
    let [batch, kv_heads, rows, dim] = q.shape().dims();
    let k_len = k.shape()[2];
    attention::Inputs {
        dims: attention::Dims {
            batch,
            kv_heads,
            rows,
            q_len: masking.q_len,
            k_len,
            dim,
        },
        q: q.storage(),
        k: head_rows(k),
        v: head_rows(v),
        masking: attention::Masking {
            mask: &masking.mask,
            spans: &masking.spans,
            mask_batch: masking.mask_batch,
            softcap: masking.softcap,
        },
        sinks,
    }
}

/// A sinks tensor's values (any shape; one per query head).
fn sink_values(sinks: &FlexTensor) -> Vec<f32> {
    contiguous(sinks).storage().to_vec()
}

/// Output and row statistics, with the inputs as the kernel reads them: `x` is `[q, k, v]`
/// or `[q, k, v, sinks]`.
fn attention_run(
    x: &[&FlexTensor],
    masking: &AttentionMasking,
) -> (FlexTensor, Vec<attention::RowStats>, AttentionInputs) {
    let (q, k, v) = (
        contiguous(x[0]),
        with_rows_adjacent(x[1]),
        with_rows_adjacent(x[2]),
    );
    let sinks = x.get(3).map(|s| (sink_values(s), s.shape()));
    let values = sinks.as_ref().map(|(v, _)| v.as_slice());
    let (out, stats) = attention::forward(&attention_inputs(&q, &k, &v, values, masking));
    let out = new_tensor(out, q.shape());
    (
        out,
        stats,
        AttentionInputs {
            qkv: [q, k, v],
            sinks,
        },
    )
}

/// The inputs as the kernel read them, kept for the backward.
#[derive(Debug, Clone)]
struct AttentionInputs {
    qkv: [FlexTensor; 3],
    /// The sinks' values and the shape their gradient takes.
    sinks: Option<(Vec<f32>, Shape)>,
}

/// Where the attention output's rows go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputLayout {
    /// As the queries: `[batch, kv_heads, n_rep * q_len, dim]`.
    Grouped,
    /// `[batch, q_len, kv_heads * n_rep, dim]`: the output projection's input rows, so the
    /// tensor the backward keeps is the one the projection keeps too (one copy, not two).
    ByPosition,
}

/// The decoder's head permute: `[batch, kv_heads, n_rep * q_len, dim]` to `[batch, q_len,
/// kv_heads * n_rep, dim]`, as [`permute_forward`] copies it.
fn grouped_to_by_position(out: &FlexTensor, q_len: usize) -> FlexTensor {
    let [batch, kv_heads, rows, dim] = out.shape().dims();
    let n_rep = rows / q_len.max(1);
    let split = out.reshape(Shape::from(vec![batch, kv_heads, n_rep, q_len, dim]));
    permute_forward(&split, &[0, 3, 1, 2, 4]).reshape(Shape::from(vec![
        batch,
        q_len,
        kv_heads * n_rep,
        dim,
    ]))
}

/// The inverse of [`grouped_to_by_position`].
fn by_position_to_grouped(x: &FlexTensor, kv_heads: usize) -> FlexTensor {
    let [batch, q_len, heads, dim] = x.shape().dims();
    let n_rep = heads / kv_heads.max(1);
    let split = x.reshape(Shape::from(vec![batch, q_len, kv_heads, n_rep, dim]));
    permute_forward(&split, &[0, 2, 3, 1, 4]).reshape(Shape::from(vec![
        batch,
        kv_heads,
        n_rep * q_len,
        dim,
    ]))
}

/// The forward output in `layout`.
fn laid_out(out: FlexTensor, q_len: usize, layout: OutputLayout) -> FlexTensor {
    match layout {
        OutputLayout::Grouped => out,
        OutputLayout::ByPosition => grouped_to_by_position(&out, q_len),
    }
}

/// `x`: `[q, k, v]`, or `[q, k, v, sinks]`.
pub fn attention_inference(
    x: &[&FlexTensor],
    masking: &AttentionMasking,
    layout: OutputLayout,
) -> FlexTensor {
    laid_out(attention_run(x, masking).0, masking.q_len, layout)
}

#[derive(Debug, Clone)]
struct AttentionState {
    inputs: AttentionInputs,
    /// The output as returned (in `layout`).
    out: FlexTensor,
    layout: OutputLayout,
    stats: Arc<Vec<attention::RowStats>>,
    masking: AttentionMasking,
}

/// `N` is 3 (queries, keys, values) or 4 (and the sinks).
#[derive(Debug)]
struct AttentionBackward<const N: usize>;

impl<const N: usize> Backward<Flex, N> for AttentionBackward<N> {
    type State = AttentionState;

    fn backward(self, ops: Ops<AttentionState, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let state = ops.state;
        let grad = contiguous(&grads.consume::<Flex>(&ops.node));
        let [q, k, v] = &state.inputs.qkv;
        let sinks = state.inputs.sinks.as_ref();
        // The kernel reads the output and its gradient grouped, as the queries.
        let (out, grad) = match state.layout {
            OutputLayout::Grouped => (state.out, grad),
            OutputLayout::ByPosition => {
                let kv_heads = q.shape()[1];
                (
                    by_position_to_grouped(&state.out, kv_heads),
                    by_position_to_grouped(&grad, kv_heads),
                )
            }
        };
        let values = sinks.map(|(v, _)| v.as_slice());
        let x = attention_inputs(q, k, v, values, &state.masking);
        let g = attention::backward(
            &x,
            &attention::Saved {
                out: out.storage(),
                stats: &state.stats,
                grad_out: grad.storage(),
            },
        );
        let mut input_grads: Vec<FlexTensor> = [(g.dq, q), (g.dk, k), (g.dv, v)]
            .into_iter()
            .map(|(g, t)| new_tensor(g, t.shape()))
            .collect();
        if let (Some(ds), Some((_, shape))) = (g.dsinks, sinks) {
            input_grads.push(new_tensor(ds, shape.clone()));
        }
        for (parent, grad) in ops.parents.into_iter().zip(input_grads) {
            if let Some(node) = parent {
                grads.register::<Flex>(node.id, grad);
            }
        }
    }
}

/// `x`: `[q, k, v]`, or `[q, k, v, sinks]` (`N` = 4).
pub fn attention_autodiff<C: CheckpointStrategy, const N: usize>(
    x: [FloatTensor<Autodiff<Flex, C>>; N],
    masking: &AttentionMasking,
    layout: OutputLayout,
) -> FloatTensor<Autodiff<Flex, C>> {
    let primitives: Vec<&FlexTensor> = x.iter().map(|t| &t.primitive).collect();
    let (out, stats, inputs) = attention_run(&primitives, masking);
    let out = laid_out(out, masking.q_len, layout);
    match AttentionBackward::<N>
        .prepare::<C>(x.each_ref().map(|t| t.node.clone()))
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            AttentionState {
                inputs,
                out: out.clone(),
                layout,
                stats: Arc::new(stats),
                masking: masking.clone(),
            },
            out,
        ),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

// ---------------------------------------------------------------------------------------------
// bf16 <-> f32 casts.

/// `x` (f32 or bf16) in the other of the two dtypes, contiguous.
pub fn cast_forward(x: &FlexTensor, dtype: DType) -> FlexTensor {
    match dtype {
        DType::F32 => convert::to_f32(&contiguous_copy(x)),
        _ => convert::to_bf16(x),
    }
}

#[derive(Debug)]
struct CastBackward;

impl Backward<Flex, 1> for CastBackward {
    /// The input's dtype, which the gradient goes back to.
    type State = DType;

    fn backward(self, ops: Ops<DType, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dtype = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |grad| {
            if grad.dtype() == dtype {
                grad
            } else {
                cast_forward(&grad, dtype)
            }
        });
    }
}

pub fn cast_autodiff<C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<Flex, C>>,
    dtype: DType,
) -> FloatTensor<Autodiff<Flex, C>> {
    let y = cast_forward(&x.primitive, dtype);
    match CastBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(x.primitive.dtype(), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}
