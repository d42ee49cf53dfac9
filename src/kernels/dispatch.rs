//! Choosing the fused kernel at run time: model code is generic over `B: Backend`, and Rust has
//! no specialisation, so [`on_flex`] compares `B` with the Flex backends by `TypeId` and, on a
//! match, moves the tensor across to the concrete type (a move, never a copy).

use std::any::{Any, TypeId};

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_flex::{Flex, FlexTensor};

/// The autodiff tensor primitive over Flex with checkpoint strategy `C`.
pub type AutodiffFlexTensor<C> = FloatTensor<Autodiff<Flex, C>>;

/// A fused operation with a Flex forward and an autodiff version with its own backward.
pub trait FlexOp {
    /// Whether the op runs on an input of this dtype; f32 unless said.
    fn accepts(&self, dtype: DType) -> bool {
        dtype == DType::F32
    }
    fn forward(&self, x: &FlexTensor) -> FlexTensor;
    fn autodiff<C: CheckpointStrategy>(&self, x: AutodiffFlexTensor<C>) -> AutodiffFlexTensor<C>;
}

/// A fused operation of `N` inputs (attention's queries, keys and values).
pub trait FlexOpN<const N: usize> {
    /// Whether the op runs on inputs of this dtype (all inputs share it); f32 unless said.
    fn accepts(&self, dtype: DType) -> bool {
        dtype == DType::F32
    }
    fn forward(&self, x: [&FlexTensor; N]) -> FlexTensor;
    /// [`Self::forward`] given the inputs to keep, for an op that can write into one of them
    /// (in place when nothing else holds it).
    fn forward_owned(&self, x: [FlexTensor; N]) -> FlexTensor {
        self.forward(x.each_ref())
    }
    fn autodiff<C: CheckpointStrategy>(
        &self,
        x: [AutodiffFlexTensor<C>; N],
    ) -> AutodiffFlexTensor<C>;
}

/// Whether `B` is the CPU backend, Flex, with or without autodiff (either checkpoint strategy).
pub fn is_flex<B: Backend>() -> bool {
    let b = TypeId::of::<B>();
    b == TypeId::of::<Flex>()
        || b == TypeId::of::<Autodiff<Flex, NoCheckpointing>>()
        || b == TypeId::of::<Autodiff<Flex, BalancedCheckpointing>>()
}

/// `Ok(x)` as a `To` when `From` and `To` are the same type, else `Err(x)` unchanged.
fn cast<From: 'static, To: 'static>(x: From) -> Result<To, From> {
    let mut slot = Some(x);
    if let Some(x) = (&mut slot as &mut dyn Any)
        .downcast_mut::<Option<To>>()
        .and_then(Option::take)
    {
        return Ok(x);
    }
    match slot {
        Some(x) => Err(x),
        None => unreachable!("the value is only taken when the types are equal"),
    }
}

/// `Ok(x)` as a `To` when `From` and `To` are the same type (for the cubecl kernels' own
/// dispatch), else `Err(x)` unchanged.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub(crate) fn same_type<From: 'static, To: 'static>(x: From) -> Result<To, From> {
    cast(x)
}

/// Moves a value back to the type it was cast from (the types are equal by construction).
pub(crate) fn cast_back<From: 'static, To: 'static>(x: From) -> To {
    match cast(x) {
        Ok(x) => x,
        Err(_) => unreachable!("cast_back is only called after a successful cast"),
    }
}

/// Runs `op` on `x` when `B` is Flex or `Autodiff<Flex>` (either checkpoint strategy) and `x`
/// has a dtype the op accepts (f32 unless it says otherwise); otherwise hands `x` back for the
/// caller's generic path.
pub fn on_flex<B: Backend, const D: usize, const E: usize, Op: FlexOp>(
    x: Tensor<B, D>,
    op: Op,
) -> Result<Tensor<B, E>, Tensor<B, D>> {
    struct One<Op>(Op);
    impl<Op: FlexOp> FlexOpN<1> for One<Op> {
        fn accepts(&self, dtype: DType) -> bool {
            self.0.accepts(dtype)
        }
        fn forward(&self, [x]: [&FlexTensor; 1]) -> FlexTensor {
            self.0.forward(x)
        }
        fn autodiff<C: CheckpointStrategy>(
            &self,
            [x]: [AutodiffFlexTensor<C>; 1],
        ) -> AutodiffFlexTensor<C> {
            self.0.autodiff::<C>(x)
        }
    }
    on_flex_n([x], One(op)).map_err(|[x]| x)
}

/// [`on_flex`] for an op of `N` inputs: runs it when `B` is Flex or `Autodiff<Flex>` and every
/// input has a dtype the op accepts (f32 unless it says otherwise), else hands the inputs back.
pub fn on_flex_n<B: Backend, const N: usize, const D: usize, const E: usize, Op: FlexOpN<N>>(
    x: [Tensor<B, D>; N],
    op: Op,
) -> Result<Tensor<B, E>, [Tensor<B, D>; N]> {
    let x = match on_autodiff::<B, NoCheckpointing, N, D, E, Op>(x, &op) {
        Ok(y) => return Ok(y),
        Err(x) => x,
    };
    let x = match on_autodiff::<B, BalancedCheckpointing, N, D, E, Op>(x, &op) {
        Ok(y) => return Ok(y),
        Err(x) => x,
    };
    if TypeId::of::<B>() != TypeId::of::<Flex>() {
        return Err(x);
    }
    let p = x.map(|t| {
        cast_back::<Tensor<B, D>, Tensor<Flex, D>>(t)
            .into_primitive()
            .tensor()
    });
    if !p.iter().all(|t| op.accepts(t.dtype())) {
        return Err(
            p.map(|t| cast_back(Tensor::<Flex, D>::from_primitive(TensorPrimitive::Float(t))))
        );
    }
    let y = op.forward_owned(p);
    Ok(cast_back(Tensor::<Flex, E>::from_primitive(
        TensorPrimitive::Float(y),
    )))
}

fn on_autodiff<
    B: Backend,
    C: CheckpointStrategy,
    const N: usize,
    const D: usize,
    const E: usize,
    Op: FlexOpN<N>,
>(
    x: [Tensor<B, D>; N],
    op: &Op,
) -> Result<Tensor<B, E>, [Tensor<B, D>; N]> {
    if TypeId::of::<B>() != TypeId::of::<Autodiff<Flex, C>>() {
        return Err(x);
    }
    let p = x.map(|t| {
        cast_back::<Tensor<B, D>, Tensor<Autodiff<Flex, C>, D>>(t)
            .into_primitive()
            .tensor()
    });
    if !p.iter().all(|t| op.accepts(t.primitive.dtype())) {
        return Err(p.map(from_autodiff::<B, Flex, C, D>));
    }
    Ok(from_autodiff::<B, Flex, C, E>(op.autodiff::<C>(p)))
}

/// `x` as a Flex tensor primitive when `B` is Flex (no autodiff) and `accepts` its dtype.
pub fn as_flex_of<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    accepts: impl Fn(DType) -> bool,
) -> Result<FlexTensor, Tensor<B, D>> {
    let x = cast::<Tensor<B, D>, Tensor<Flex, D>>(x)?;
    let primitive = x.into_primitive().tensor();
    if accepts(primitive.dtype()) {
        Ok(primitive)
    } else {
        Err(cast_back(Tensor::<Flex, D>::from_primitive(
            TensorPrimitive::Float(primitive),
        )))
    }
}

/// The inverse of [`as_flex`]: only called with `B` = Flex.
pub fn from_flex<B: Backend, const D: usize>(x: FlexTensor) -> Tensor<B, D> {
    cast_back(Tensor::<Flex, D>::from_primitive(TensorPrimitive::Float(x)))
}

/// `x`'s primitive when `B` is `Autodiff<I, C>` (any inner backend), else `x` back: for ops
/// with a backward of their own written once for every backend.
pub fn as_autodiff<B: Backend, I: Backend, C: CheckpointStrategy, const D: usize>(
    x: Tensor<B, D>,
) -> Result<FloatTensor<Autodiff<I, C>>, Tensor<B, D>> {
    let x = cast::<Tensor<B, D>, Tensor<Autodiff<I, C>, D>>(x)?;
    Ok(x.into_primitive().tensor())
}

/// The inverse of [`as_autodiff`]: only called with `B` = `Autodiff<I, C>`.
pub fn from_autodiff<B: Backend, I: Backend, C: CheckpointStrategy, const D: usize>(
    x: FloatTensor<Autodiff<I, C>>,
) -> Tensor<B, D> {
    cast_back(Tensor::<Autodiff<I, C>, D>::from_primitive(
        TensorPrimitive::Float(x),
    ))
}
