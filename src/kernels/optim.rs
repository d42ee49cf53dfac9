//! Adam/AdamW as one fused, in-place, parallel pass over a parameter, its gradient and both
//! moments, on Flex. burn-flex runs each element-wise op of the composed update on one core
//! with a fresh buffer per term; PyTorch's `foreach` AdamW is one multi-threaded pass.
//!
//! bf16 parameters and moments are updated as PyTorch's fused Adam updates them: each chunk is
//! widened to f32, updated in f32 with f32 constants and rounded back once. (burn-flex's
//! composed bf16 ops round every intermediate and every constant to bf16: `beta2 = 0.999`
//! becomes 1.0 there.)

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, bf16};
use burn_flex::FlexTensor;
use rayon::prelude::*;

use super::bf16::{round_into, widen_into};
use super::dispatch::{as_flex_of, from_flex};
use super::simd::multiversion;

/// The step's constants, as `torch.optim.Adam(W)` computes them, already in f32.
#[derive(Debug, Clone, Copy)]
pub struct AdamStep {
    /// Multiplies the gradient first (token normalisation and clipping).
    pub grad_scale: f32,
    /// AdamW: `1 - lr * weight_decay` (1 for Adam).
    pub decay: f32,
    /// Adam: the L2 coefficient added to the gradient (0 for AdamW).
    pub l2: f32,
    pub beta1: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bias2_sqrt: f32,
    pub eps: f32,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
}

const CHUNK: usize = 1 << 14;

multiversion! {
    fn adam_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: AdamStep) {
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            // The composed path's order of operations, so both paths agree to the last bit
            // wherever the compiler does not contract into FMAs.
            let g = if s.grad_scale == 1.0 { g } else { g * s.grad_scale };
            let g = g + *p * s.l2;
            let param = *p * s.decay;
            *m = *m * s.beta1 + g * s.one_minus_beta1;
            *v = *v * s.beta2 + g * g * s.one_minus_beta2;
            let denom = v.sqrt() / s.bias2_sqrt + s.eps;
            *p = param - *m / denom * s.step_size;
        }
    }
}

fn owned(t: FlexTensor) -> FlexTensor {
    // Contiguous and uniquely owned, so `storage_mut` writes in place without a copy when the
    // caller held the only reference.
    if t.is_contiguous() && t.layout().start_offset() == 0 {
        t
    } else {
        t.to_contiguous()
    }
}

/// The fewest rows of a transposed gradient gathered per task: 16 floats of each column are
/// one cache line. Narrow gradients (a LoRA B has rank columns) take more rows per tile, up
/// to about [`CHUNK`] values, so a task is never only a few hundred values.
const TILE_ROWS: usize = 16;

/// `[rows, cols]` when `g` is the transposed view of a contiguous `[cols, rows]` buffer: what
/// burn's matmul backward leaves as a linear layer's weight gradient.
fn transposed_dims(g: &FlexTensor) -> Option<[usize; 2]> {
    let layout = g.layout();
    let (shape, strides) = (layout.shape(), layout.strides());
    match (shape.num_dims(), strides) {
        (2, &[1, s]) if s == shape[0] as isize && layout.start_offset() == 0 => {
            Some([shape[0], shape[1]])
        }
        _ => None,
    }
}

/// One update of `param` with `grad` and the moments `(exp_avg, exp_avg_sq)`, all of
/// `param`'s `n` elements (`grad` may be `[rows, cols]`, even a transposed view, which is read
/// in tiles rather than copied first): `Ok((param, exp_avg, exp_avg_sq))` on Flex, or the
/// inputs back, `grad` flattened, for the composed path.
#[allow(clippy::type_complexity)]
pub fn adam<B: Backend, const D: usize>(
    param: Tensor<B, 1>,
    grad: Tensor<B, D>,
    exp_avg: Tensor<B, 1>,
    exp_avg_sq: Tensor<B, 1>,
    step: AdamStep,
) -> Result<
    (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>),
    (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>),
> {
    let n = param.dims()[0];
    let flat = |g: Tensor<B, D>| g.reshape([n]);
    let dtype = param.dtype();
    let same = grad.dtype() == dtype && exp_avg.dtype() == dtype && exp_avg_sq.dtype() == dtype;
    let accepts = |d: DType| same && matches!(d, DType::F32 | DType::BF16);
    let p = match as_flex_of(param, accepts) {
        Ok(p) => p,
        Err(param) => return Err((param, flat(grad), exp_avg, exp_avg_sq)),
    };
    // Same backend and dtype from here on: the casts cannot fail.
    let (g, m, v) = match (
        as_flex_of(grad, accepts),
        as_flex_of(exp_avg, accepts),
        as_flex_of(exp_avg_sq, accepts),
    ) {
        (Ok(g), Ok(m), Ok(v)) => (g, m, v),
        (g, m, v) => {
            let g = g.map_or_else(flat, |g| flat(from_flex(g)));
            let back = |t: Result<FlexTensor, Tensor<B, 1>>| t.map_or_else(|t| t, from_flex);
            return Err((from_flex(p), g, back(m), back(v)));
        }
    };
    let (mut p, mut m, mut v) = (owned(p), owned(m), owned(v));
    match dtype {
        DType::F32 => update::<f32>(&mut p, &g, &mut m, &mut v, step),
        _ => update::<bf16>(&mut p, &g, &mut m, &mut v, step),
    }
    Ok((from_flex(p), from_flex(m), from_flex(v)))
}

/// A float the update reads and writes: f32 in place, or bf16 through f32 buffers.
trait Stored: burn::tensor::Element + bytemuck::Pod + Send + Sync {
    /// `src` as f32 into `dst` (same length).
    fn widen(src: &[Self], dst: &mut Vec<f32>);
    /// `src` stored into `dst` (same length).
    fn store(src: &[f32], dst: &mut [Self]);
    /// `x` itself when `Self` is f32 (read and updated in place, no buffers).
    fn as_f32(x: &[Self]) -> Option<&[f32]>;
    fn as_f32_mut(x: &mut [Self]) -> Option<&mut [f32]>;
}

impl Stored for f32 {
    fn widen(src: &[f32], dst: &mut Vec<f32>) {
        dst.clear();
        dst.extend_from_slice(src);
    }
    fn store(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn as_f32(x: &[f32]) -> Option<&[f32]> {
        Some(x)
    }
    fn as_f32_mut(x: &mut [f32]) -> Option<&mut [f32]> {
        Some(x)
    }
}

impl Stored for bf16 {
    fn widen(src: &[bf16], dst: &mut Vec<f32>) {
        widen_into(src, dst);
    }
    fn store(src: &[f32], dst: &mut [bf16]) {
        round_into(src, dst);
    }
    fn as_f32(_: &[bf16]) -> Option<&[f32]> {
        None
    }
    fn as_f32_mut(_: &mut [bf16]) -> Option<&mut [f32]> {
        None
    }
}

/// `g` as f32 values: itself when `T` is f32, else widened into `buf`.
fn as_f32<'a, T: Stored>(g: &'a [T], buf: &'a mut Vec<f32>) -> &'a [f32] {
    match T::as_f32(g) {
        Some(g) => g,
        None => {
            T::widen(g, buf);
            buf
        }
    }
}

/// One task's share: `p`, `m`, `v` updated with the gradient values `g` (f32).
fn update_chunk<T: Stored>(p: &mut [T], g: &[f32], m: &mut [T], v: &mut [T], step: AdamStep) {
    if let (Some(p), Some(m), Some(v)) = (
        T::as_f32_mut(&mut *p),
        T::as_f32_mut(&mut *m),
        T::as_f32_mut(&mut *v),
    ) {
        return adam_chunk(p, g, m, v, step);
    }
    let (mut pf, mut mf, mut vf) = (Vec::new(), Vec::new(), Vec::new());
    T::widen(p, &mut pf);
    T::widen(m, &mut mf);
    T::widen(v, &mut vf);
    adam_chunk(&mut pf, g, &mut mf, &mut vf, step);
    T::store(&pf, p);
    T::store(&mf, m);
    T::store(&vf, v);
}

fn update<T: Stored>(
    p: &mut FlexTensor,
    g: &FlexTensor,
    m: &mut FlexTensor,
    v: &mut FlexTensor,
    step: AdamStep,
) {
    let ps: &mut [T] = p.storage_mut();
    let ms: &mut [T] = m.storage_mut();
    let vs: &mut [T] = v.storage_mut();
    match transposed_dims(g) {
        // Tiles of whole rows: each gathers its rows' gradient (a cache line per column)
        // into a small buffer, then updates them as the contiguous path does.
        Some([rows, cols]) => {
            let gs: &[T] = g.storage();
            let tile_rows = (CHUNK / cols.max(1)).next_multiple_of(TILE_ROWS);
            let tile = tile_rows * cols;
            ps.par_chunks_mut(tile)
                .zip(ms.par_chunks_mut(tile))
                .zip(vs.par_chunks_mut(tile))
                .enumerate()
                .for_each(|(t, ((p, m), v))| {
                    let first = t * tile_rows;
                    let mut gathered: Vec<T> = Vec::with_capacity(p.len());
                    for r in 0..p.len() / cols {
                        gathered.extend((0..cols).map(|c| gs[c * rows + first + r]));
                    }
                    let mut buf = Vec::new();
                    update_chunk(p, as_f32(&gathered, &mut buf), m, v, step);
                });
        }
        None => {
            let g = g.to_contiguous();
            let gs: &[T] = g.storage();
            ps.par_chunks_mut(CHUNK)
                .zip(gs.par_chunks(CHUNK))
                .zip(ms.par_chunks_mut(CHUNK))
                .zip(vs.par_chunks_mut(CHUNK))
                .for_each(|(((p, g), m), v)| {
                    let mut buf = Vec::new();
                    update_chunk(p, as_f32(g, &mut buf), m, v, step)
                });
        }
    }
}
