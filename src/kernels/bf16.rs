//! bf16 <-> f32 conversion of Flex tensors in parallel, vectorised passes.
//!
//! Why: burn-flex 0.21 multiplies bf16 matrices by copying strided operands to contiguous
//! (one thread, an index iterator per element), converting element by element and converting
//! the product back, all on one core; that made a bf16 training step on the CPU 2.2x an fp32
//! one. The kernels here widen bf16 to f32 and round back with plain integer lane operations
//! over all cores, and keep a view's strides so a transposed weight is read in place.
//!
//! Rounding is round-to-nearest-even with NaN kept quiet, bit for bit `half::bf16::from_f32`
//! (PyTorch's rounding too).

use burn::tensor::{DType, TensorData, TensorMetadata, bf16};
use std::mem::MaybeUninit;

use burn_flex::{FlexTensor, Layout};
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::simd::multiversion;

/// Elements per parallel task: large enough that a task outweighs rayon's overhead, small
/// enough that a `[rows, 576]` activation still splits across cores.
const CHUNK: usize = 1 << 15;

/// The f32 value of a bf16 bit pattern: its 16 bits are an f32's high half.
#[inline(always)]
pub fn widen_bits(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// `x` rounded to the nearest bf16 and widened back: `half::bf16::from_f32(x).to_f32()` bit for
/// bit, branch-free so a loop of them vectorises (NF4's per-block tables round 16 values per 64
/// weights).
#[inline(always)]
pub fn round_to_bf16(x: f32) -> f32 {
    widen_bits(round_bits(x))
}

/// `x` rounded to the nearest bf16, ties to even; NaN stays NaN (quiet), infinities stay.
#[inline(always)]
pub fn round_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    (if nan { (b >> 16) | 0x0040 } else { rounded }) as u16
}

multiversion! {
    fn widen_chunk(src: &[u16], dst: &mut [MaybeUninit<f32>]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = MaybeUninit::new(widen_bits(s));
        }
    }
}

multiversion! {
    fn round_chunk(src: &[f32], dst: &mut [MaybeUninit<bf16>]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = MaybeUninit::new(bf16::from_bits(round_bits(s)));
        }
    }
}

/// `src` widened into `dst` (cleared first) on this thread: for callers already inside a
/// parallel task.
pub fn widen_into(src: &[bf16], dst: &mut Vec<f32>) {
    dst.clear();
    dst.reserve(src.len());
    widen_chunk(
        src.reinterpret_cast(),
        &mut dst.spare_capacity_mut()[..src.len()],
    );
    // SAFETY: every one of the `src.len()` elements was written above.
    unsafe { dst.set_len(src.len()) };
}

/// `src` rounded into `dst` (same length) on this thread.
pub fn round_into(src: &[f32], dst: &mut [bf16]) {
    // SAFETY: `MaybeUninit<bf16>` has `bf16`'s layout, and only initialised values are written
    // through the view.
    let dst = unsafe { &mut *(dst as *mut [bf16] as *mut [MaybeUninit<bf16>]) };
    round_chunk(src, dst);
}

/// `src` widened to f32 across the rayon pool (the output is written once, never zeroed
/// first: zeroing was a tenth of the conversion's time).
pub fn widen(src: &[bf16]) -> Vec<f32> {
    let src: &[u16] = src.reinterpret_cast();
    let mut out = Vec::with_capacity(src.len());
    out.spare_capacity_mut()[..src.len()]
        .par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| widen_chunk(s, d));
    // SAFETY: every one of the `src.len()` elements was written above.
    unsafe { out.set_len(src.len()) };
    out
}

/// `src` rounded to bf16 across the rayon pool.
pub fn round(src: &[f32]) -> Vec<bf16> {
    let mut out = Vec::with_capacity(src.len());
    out.spare_capacity_mut()[..src.len()]
        .par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| round_chunk(s, d));
    // SAFETY: every one of the `src.len()` elements was written above.
    unsafe { out.set_len(src.len()) };
    out
}

/// The storage range `[first, last]` a layout with non-negative strides reads, or `None` for
/// an empty tensor or a negative stride (a flip).
fn span(layout: &Layout) -> Option<(usize, usize)> {
    let shape = layout.shape();
    if shape.num_elements() == 0 {
        return None;
    }
    let mut extent = 0usize;
    for (&dim, &stride) in shape.iter().zip(layout.strides()) {
        let stride = usize::try_from(stride).ok()?;
        extent += (dim - 1) * stride;
    }
    let first = layout.start_offset();
    Some((first, first + extent))
}

/// `x` (bf16) as f32 with the same shape. A view whose storage range holds at most twice its
/// elements (a transpose, a broadcast, a slice of a few rows) keeps its strides, so the
/// product that reads it needs no contiguous copy; anything sparser is made contiguous first.
pub fn to_f32(x: &FlexTensor) -> FlexTensor {
    debug_assert_eq!(x.dtype(), DType::BF16);
    let layout = x.layout();
    let numel = layout.num_elements();
    match span(layout) {
        Some((first, last)) if last + 1 - first <= 2 * numel.max(1) => {
            let values = widen(&x.storage::<bf16>()[first..=last]);
            let len = values.len();
            let strides = layout.strides().to_vec();
            FlexTensor::from_data(TensorData::new(values, [len])).with_layout(Layout::new(
                layout.shape().clone(),
                strides,
                0,
            ))
        }
        Some(_) => to_f32(&x.to_contiguous()),
        None if numel == 0 => FlexTensor::empty(layout.shape().clone(), DType::F32),
        None => to_f32(&x.to_contiguous()),
    }
}

/// `x` (f32) rounded to bf16, contiguous, with the same shape.
pub fn to_bf16(x: &FlexTensor) -> FlexTensor {
    debug_assert_eq!(x.dtype(), DType::F32);
    let x = x.to_contiguous();
    FlexTensor::from_data(TensorData::new(round(x.storage::<f32>()), x.shape()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_half_bit_for_bit() {
        let mut bits: Vec<u32> = vec![
            0,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0x7f80_0001,
            0xffff_ffff,
            0x0000_8000,
            0x0001_8000,
            0x7f7f_ffff,
            0x0000_0001,
        ];
        // A deterministic sweep: every rounding case (below, at and above the half-way point,
        // odd and even kept bits) across exponents, subnormals and NaN payloads.
        let mut s = 0x9e37_79b9u32;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            bits.push(s);
            bits.push((s & 0xffff_0000) | 0x8000);
        }
        let values: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let got = round(&values);
        for (x, g) in values.iter().zip(&got) {
            let want = bf16::from_f32(*x);
            assert_eq!(g.to_bits(), want.to_bits(), "{:#010x}", x.to_bits());
        }
        let back = widen(&got);
        for (g, b) in got.iter().zip(&back) {
            assert_eq!(b.to_bits(), g.to_f32().to_bits());
        }
    }

    #[test]
    fn strided_views_keep_their_strides_and_values() {
        let values: Vec<bf16> = (0..6 * 5).map(|i| bf16::from_f32(i as f32 - 7.5)).collect();
        let x = FlexTensor::from_data(TensorData::new(values, [6, 5]));
        for view in [
            x.clone(),
            x.transpose(0, 1),
            x.narrow(0, 2, 3),
            x.narrow(1, 1, 2),
        ] {
            let want: Vec<f32> = view
                .to_contiguous()
                .storage::<bf16>()
                .iter()
                .map(|v| v.to_f32())
                .collect();
            let got = to_f32(&view);
            assert_eq!(got.shape(), view.shape());
            assert_eq!(got.to_contiguous().storage::<f32>(), want.as_slice());
            let round_trip = to_bf16(&got);
            assert_eq!(
                round_trip.storage::<bf16>(),
                view.to_contiguous().storage::<bf16>()
            );
        }
    }
}
