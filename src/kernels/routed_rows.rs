//! A mixture-of-experts layer's routed rows: each expert's tokens gathered from the layer's
//! input ([`gather_rows`]) and each expert's weighted output added back into the layer's output
//! ([`add_rows`]), the rows given on the host (the routing is read there anyway).
//!
//! Elsewhere these are burn's `select` and `select_assign(.., Add)`. On Flex each costs a full
//! `[tokens, hidden]` tensor per expert, not the expert's few rows: `select`'s backward returns
//! a zeroed tensor of the input's size with the expert's rows added (burn-flex's `select_add`
//! copies the zeros first, and the zeros themselves are copied once more to be realigned), which
//! autodiff then adds to the input's gradient so far; and `select_assign` copies the output it
//! adds into. Here the gather's backward adds its rows into the input's gradient so far in place
//! (`Gradients::take`, the vendored burn-autodiff's patch 18), and the forward adds into the
//! output in place when nothing else holds it: per expert only its rows are touched.
//!
//! Why: a differential profile of `tune bench --shape qwen3-30b-a3b-2l --mode lora` (128
//! experts) against its 32-expert twin put about 1.4 CPU-s of the 128-expert run's 5 steps in
//! those full-size copies and adds (0.5 s with 32 experts); the figures with these kernels are in
//! BENCHMARKS.md ("Routed rows in place").
//!
//! The sums are burn's, addition for addition: a row's gradient gets each expert's rows added
//! in the order the experts' backward steps run, and an output row each expert's in the order
//! of the forward, so results are bit for bit those of `select` and `select_assign`.

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::{
    DType, Element, IndexingUpdateOp, Int, Shape, Tensor, TensorData, TensorMetadata, bf16,
};
use burn_flex::{Flex, FlexTensor};

use super::dispatch::{AutodiffFlexTensor, FlexOp, FlexOpN, on_flex, on_flex_n};

/// Rows `rows` of `x` (`[n, width]`, in the order given): `x.select(0, rows)`.
pub fn gather_rows<B: Backend>(x: Tensor<B, 2>, rows: &[i64]) -> Tensor<B, 2> {
    let op = Gather(host_rows(rows));
    match on_flex(x, op) {
        Ok(y) => y,
        Err(x) => {
            let device = x.device();
            x.select(0, int_rows::<B>(rows, &device))
        }
    }
}

/// `into` with `values[i]` added to its row `rows[i]`, in order:
/// `into.select_assign(0, rows, values, Add)`.
pub fn add_rows<B: Backend>(
    into: Tensor<B, 2>,
    rows: &[i64],
    values: Tensor<B, 2>,
) -> Tensor<B, 2> {
    let op = AddRows(host_rows(rows));
    match on_flex_n([into, values], op) {
        Ok(y) => y,
        Err([into, values]) => {
            let device = into.device();
            into.select_assign(
                0,
                int_rows::<B>(rows, &device),
                values,
                IndexingUpdateOp::Add,
            )
        }
    }
}

fn host_rows(rows: &[i64]) -> Arc<[usize]> {
    rows.iter()
        .map(|&r| usize::try_from(r).unwrap_or(usize::MAX))
        .collect()
}

fn int_rows<B: Backend>(rows: &[i64], device: &B::Device) -> Tensor<B, 1, Int> {
    Tensor::from_data(TensorData::new(rows.to_vec(), [rows.len()]), device)
}

fn accepts(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16)
}

struct Gather(Arc<[usize]>);

impl FlexOp for Gather {
    fn accepts(&self, dtype: DType) -> bool {
        accepts(dtype)
    }
    fn forward(&self, x: &FlexTensor) -> FlexTensor {
        gather(x, &self.0)
    }
    fn autodiff<C: CheckpointStrategy>(&self, x: AutodiffFlexTensor<C>) -> AutodiffFlexTensor<C> {
        let y = gather(&x.primitive, &self.0);
        match GatherBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((self.0.clone(), x.primitive.shape()), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

#[derive(Debug)]
struct GatherBackward;

impl Backward<Flex, 1> for GatherBackward {
    /// The rows gathered and the input's shape.
    type State = (Arc<[usize]>, Shape);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (rows, shape) = ops.state;
        let grad = grads.consume::<Flex>(&ops.node);
        let [Some(parent)] = ops.parents else {
            return;
        };
        let so_far = grads
            .take::<Flex>(parent.id)
            .unwrap_or_else(|| zeros(shape, grad.dtype()));
        grads.register::<Flex>(parent.id, add_into(so_far, &rows, &grad));
    }
}

struct AddRows(Arc<[usize]>);

impl FlexOpN<2> for AddRows {
    fn accepts(&self, dtype: DType) -> bool {
        accepts(dtype)
    }
    fn forward(&self, [into, values]: [&FlexTensor; 2]) -> FlexTensor {
        add_into(into.clone(), &self.0, values)
    }
    fn forward_owned(&self, [into, values]: [FlexTensor; 2]) -> FlexTensor {
        add_into(into, &self.0, &values)
    }
    fn autodiff<C: CheckpointStrategy>(
        &self,
        [into, values]: [AutodiffFlexTensor<C>; 2],
    ) -> AutodiffFlexTensor<C> {
        let prep = AddRowsBackward
            .prepare::<C>([into.node.clone(), values.node.clone()])
            .compute_bound()
            .stateful();
        // `into`'s primitive moves here, so the add is in place unless autodiff kept it.
        let y = add_into(into.primitive, &self.0, &values.primitive);
        match prep {
            OpsKind::Tracked(prep) => prep.finish(self.0.clone(), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

#[derive(Debug)]
struct AddRowsBackward;

impl Backward<Flex, 2> for AddRowsBackward {
    /// The rows added to.
    type State = Arc<[usize]>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let rows = ops.state;
        let grad = grads.consume::<Flex>(&ops.node);
        let [into, values] = ops.parents;
        if let Some(node) = values {
            grads.register::<Flex>(node.id, gather(&grad, &rows));
        }
        if let Some(node) = into {
            grads.register::<Flex>(node.id, grad);
        }
    }
}

/// The width of a 2-D tensor's rows.
fn row_width(shape: &Shape) -> usize {
    if shape.num_dims() > 1 { shape[1] } else { 1 }
}

fn zeros(shape: Shape, dtype: DType) -> FlexTensor {
    let n = shape.num_elements();
    // A typed vector keeps its alignment: burn-flex's own zeros allocate bytes and copy them
    // into an aligned buffer.
    match dtype {
        DType::BF16 => FlexTensor::from_data(TensorData::new(vec![bf16::ZERO; n], shape)),
        _ => FlexTensor::from_data(TensorData::new(vec![0.0f32; n], shape)),
    }
}

/// `t` itself when it is contiguous over its whole buffer from offset 0 (so writing its storage
/// writes the tensor, in place when unshared), else a contiguous copy.
fn whole_contiguous(t: FlexTensor) -> FlexTensor {
    let whole = t.is_contiguous()
        && t.layout().start_offset() == 0
        && t.bytes().len() == t.layout().num_elements() * t.dtype().size();
    if whole { t } else { t.to_contiguous() }
}

fn gather(x: &FlexTensor, rows: &[usize]) -> FlexTensor {
    match x.dtype() {
        DType::BF16 => gather_typed::<bf16>(x, rows),
        _ => gather_typed::<f32>(x, rows),
    }
}

fn gather_typed<E: Element + bytemuck::Pod>(x: &FlexTensor, rows: &[usize]) -> FlexTensor {
    let x = x.to_contiguous();
    let width = row_width(&x.shape());
    let (start, _) = x.layout().contiguous_offsets().unwrap_or((0, 0));
    let src = &x.storage::<E>()[start..];
    let mut out = Vec::with_capacity(rows.len() * width);
    for &r in rows {
        out.extend_from_slice(&src[r * width..][..width]);
    }
    FlexTensor::from_data(TensorData::new(out, [rows.len(), width]))
}

/// `into` with `values`' rows added to its rows `rows`, in place when `into` is unshared.
fn add_into(into: FlexTensor, rows: &[usize], values: &FlexTensor) -> FlexTensor {
    match into.dtype() {
        DType::BF16 => add_into_typed::<bf16>(into, rows, values),
        _ => add_into_typed::<f32>(into, rows, values),
    }
}

fn add_into_typed<E>(into: FlexTensor, rows: &[usize], values: &FlexTensor) -> FlexTensor
where
    E: Element + bytemuck::Pod + core::ops::AddAssign,
{
    let mut into = whole_contiguous(into);
    let values = values.to_contiguous();
    let width = row_width(&into.shape());
    let (start, _) = values.layout().contiguous_offsets().unwrap_or((0, 0));
    let src = &values.storage::<E>()[start..];
    let dst = into.storage_mut::<E>();
    for (i, &r) in rows.iter().enumerate() {
        for (d, &v) in dst[r * width..][..width]
            .iter_mut()
            .zip(&src[i * width..][..width])
        {
            *d += v;
        }
    }
    into
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Autodiff;
    use burn::tensor::Distribution;

    type Ad = Autodiff<Flex>;

    fn random(shape: [usize; 2], seed: u64) -> Tensor<Ad, 2> {
        <Flex as Backend>::seed(&Default::default(), seed);
        Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
    }

    fn values<B: Backend>(t: Tensor<B, 2>) -> Vec<u32> {
        t.into_data()
            .to_vec::<f32>()
            .unwrap_or_default()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// A mixture-of-experts layer in miniature: three experts over six tokens, two per token,
    /// each expert's output scaled by a weight that also trains, with `kernels` or burn's ops.
    fn layer(kernels: bool) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
        let x = random([6, 4], 1).require_grad();
        let scale = random([6, 4], 2).require_grad();
        let experts: [&[i64]; 3] = [&[0, 2, 3, 5], &[0, 1, 4], &[1, 2, 3, 4, 5]];
        let mut out = Tensor::<Ad, 2>::zeros([6, 4], &Default::default());
        for (e, rows) in experts.iter().enumerate() {
            let ints = int_rows::<Ad>(rows, &Default::default());
            let picked = if kernels {
                gather_rows(x.clone(), rows)
            } else {
                x.clone().select(0, ints.clone())
            };
            let y = (picked * (e as f64 + 1.5)).tanh() * scale.clone().select(0, ints.clone());
            out = if kernels {
                add_rows(out, rows, y)
            } else {
                out.select_assign(0, ints, y, IndexingUpdateOp::Add)
            };
        }
        let loss = (out.clone() * out.clone()).sum();
        let grads = loss.backward();
        let (gx, gs) = (x.grad(&grads), scale.grad(&grads));
        (
            values(out),
            gx.map(values).unwrap_or_default(),
            gs.map(values).unwrap_or_default(),
        )
    }

    #[test]
    fn routed_rows_give_burns_select_and_select_assign_bit_for_bit_forward_and_backward() {
        let (out, gx, gs) = layer(true);
        let (want_out, want_gx, want_gs) = layer(false);
        assert_eq!(out, want_out);
        assert_eq!(gx.len(), 24);
        assert_eq!(gx, want_gx);
        assert_eq!(gs.len(), 24);
        assert_eq!(gs, want_gs);
    }

    #[test]
    fn adding_rows_leaves_a_tensor_held_elsewhere_unchanged() {
        let device = Default::default();
        let into = Tensor::<Flex, 2>::ones([3, 2], &device);
        let kept = into.clone();
        let added = add_rows(
            into,
            &[2, 0],
            Tensor::from_floats([[1.0, 2.0], [3.0, 4.0]], &device),
        );
        let added: Vec<f32> = added.into_data().to_vec().unwrap_or_default();
        assert_eq!(added, [4.0, 5.0, 1.0, 1.0, 2.0, 3.0]);
        let kept: Vec<f32> = kept.into_data().to_vec().unwrap_or_default();
        assert_eq!(kept, [1.0; 6]);
    }

    #[test]
    fn gathered_rows_come_in_the_order_given_in_bf16_too() {
        let device = Default::default();
        let x = Tensor::<Flex, 2>::from_floats([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], &device)
            .cast(DType::BF16);
        let y = gather_rows(x, &[2, 0, 2]).cast(DType::F32);
        let y: Vec<f32> = y.into_data().to_vec().unwrap_or_default();
        assert_eq!(y, [5.0, 6.0, 1.0, 2.0, 5.0, 6.0]);
    }
}
