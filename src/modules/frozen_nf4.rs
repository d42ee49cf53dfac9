//! A linear layer's frozen base weight stored in NF4 (QLoRA), as torchtune stores it: torchao's
//! `to_nf4` of the weight in the dtype the checkpoint stores it in, in torchtune's own row
//! order, dequantized in the model's dtype.
//!
//! torchtune permutes the rows of q_proj and k_proj when it converts a Hugging Face checkpoint
//! (its RoPE rotates interleaved pairs, Hugging Face's rotates halves), and quantizes the
//! permuted weight. NF4's double-quantized scales group 256 blocks of 64 values, so which rows
//! share a scaler block depends on the row order: quantizing Hugging Face's order would give a
//! different weight once a head spans several scaler blocks (any real model). So the rows are
//! permuted as torchtune permutes them before quantizing, and back on every dequantization.

use std::any::{Any, TypeId};
use std::ops::Range;
use std::sync::{Arc, Mutex};

use burn::tensor::backend::Backend;
use burn::tensor::{
    DType, ElementConversion, Int, Tensor, TensorCreationOptions, TensorData, get_device_settings,
};
use rayon::prelude::*;

use super::nf4::{BLOCK_SIZE, Nf4Dtype, Nf4Error, Nf4Weight, block_table};
use crate::kernels::simd::{self, multiversion};
use crate::precision::f32_tensor;

/// The row order a weight is quantized in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowOrder {
    /// Hugging Face's order, as stored.
    Stored,
    /// torchtune's `hf_to_tune` permutation of q_proj/k_proj rows for heads of `head_dim`:
    /// within each head, the two halves interleaved (row `2i + j` of the head is Hugging
    /// Face's row `j * head_dim / 2 + i`).
    RopeInterleaved { head_dim: usize },
}

impl RowOrder {
    /// The Hugging Face row that lands at quantized row `row`.
    fn source_row(self, row: usize) -> usize {
        match self {
            Self::Stored => row,
            Self::RopeInterleaved { head_dim } => {
                let (head, within) = (row / head_dim, row % head_dim);
                head * head_dim + (within % 2) * (head_dim / 2) + within / 2
            }
        }
    }

    /// The quantized row that holds Hugging Face's row `row` (the inverse of `source_row`).
    pub(crate) fn quantized_row(self, row: usize) -> usize {
        match self {
            Self::Stored => row,
            Self::RopeInterleaved { head_dim } => {
                let (head, within) = (row / head_dim, row % head_dim);
                let half = head_dim / 2;
                head * head_dim + 2 * (within % half) + within / half
            }
        }
    }
}

/// Bytes of decoded fp32 weight rows [`FrozenNf4::matmul_rows_plain_decoded`] holds at a time:
/// a quarter of a 2 MB L2, so the block stays there while gemm packs and multiplies it.
const DECODED_BYTES: usize = 512 * 1024;

/// A frozen `[out, in]` weight in NF4.
#[derive(Debug, Clone)]
pub struct FrozenNf4 {
    pub nf4: Nf4Weight,
    pub order: RowOrder,
    /// The dtype it is dequantized in for the forward and backward passes: the model's.
    pub compute: Nf4Dtype,
    /// Each block's scale in `compute`, when held as such instead of through `nf4`'s double
    /// quantization (FSDP's rows of a weight, and a weight gathered from them, [`Nf4Rows`]).
    scales: Option<Arc<Vec<f32>>>,
    /// The codes and block scales uploaded to a GPU backend's device, once.
    on_device: DeviceCopies,
}

/// FSDP's share of a frozen NF4 weight on one rank: some of its quantized rows (of `full`, in
/// the order they were quantized in; which ones, the rank's `LayerShards::rows` say), their
/// codes and their blocks' scales exactly as the whole weight dequantizes them, so the weight
/// gathered from every rank's share ([`Nf4Rows::gather_parts`]) dequantizes bit for bit as the
/// whole one.
#[derive(Debug, Clone)]
pub struct Nf4Rows {
    pub full: [usize; 2],
    pub order: RowOrder,
    pub compute: Nf4Dtype,
    pub dtype: Nf4Dtype,
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
}

impl Nf4Rows {
    /// Rows `rows` (of the quantized order) of the `[out, in]` weight `read` reads, quantized
    /// as [`FrozenNf4::quantize`] quantizes the whole weight and [`FrozenNf4::rows`] keeps them,
    /// bit for bit, without the whole weight ever held: `read` gives Hugging Face rows (a range,
    /// row-major values), read once in order, a few at a time (a head's rows in torchtune's
    /// RoPE order). FSDP's per-rank load of an NF4 base.
    pub fn quantize<E>(
        mut read: impl FnMut(Range<usize>) -> Result<Vec<f32>, E>,
        full: [usize; 2],
        rows: Range<usize>,
        (dtype, compute): (Nf4Dtype, Nf4Dtype),
        order: RowOrder,
    ) -> Result<Result<Self, Nf4Error>, E> {
        let [out, inp] = full;
        if let Err(e) = Nf4Weight::check_numel(out * inp) {
            return Ok(Err(e));
        }
        if !inp.is_multiple_of(BLOCK_SIZE) {
            // A row holding part of a block: FSDP keeps such a weight whole (`FrozenNf4::rows`).
            return Ok(Err(Nf4Error::Shape { numel: out * inp }));
        }
        // Rows per read: a head in RoPE order (its rows are permuted within it), else enough
        // rows for about a million values.
        let step = match order {
            RowOrder::Stored => (1usize << 20).div_ceil(inp).max(1),
            RowOrder::RopeInterleaved { head_dim } => head_dim,
        };
        let chunks = (0..out).step_by(step).map(|start| {
            let span = start..(start + step).min(out);
            let stored = read(span.clone())?;
            Ok(match order {
                RowOrder::Stored => stored,
                RowOrder::RopeInterleaved { .. } => span
                    .clone()
                    .flat_map(|row| {
                        let src = order.source_row(row) - span.start;
                        stored[src * inp..(src + 1) * inp].iter().copied()
                    })
                    .collect(),
            })
        });
        let keep = rows.start * inp..rows.end * inp;
        let part = crate::modules::nf4::quantize_part(chunks, out * inp, keep, dtype, compute)?;
        Ok(Ok(Self {
            full,
            order,
            compute,
            dtype,
            codes: part.codes,
            scales: part.scales,
        }))
    }

    /// What a rank sends to gather the weight, exactly representable in f32: the codes, three
    /// bytes to a value (`b0 * 65536 + b1 * 256 + b2`, under f32's 2^24 exact integers), then
    /// the block scales. Why three: 0.73 bytes per weight travel instead of 2.06 with one byte
    /// to a value (NF4 itself holds 0.52).
    pub fn to_values(&self) -> Vec<f32> {
        let mut values: Vec<f32> = self.codes.chunks(3).map(pack).collect();
        values.extend_from_slice(&self.scales);
        values
    }

    /// How many values [`Self::to_values`] sends for rows `rows` of this weight.
    pub fn values_len(&self, rows: &Range<usize>) -> usize {
        let n = rows.len() * self.full[1];
        (n / 2).div_ceil(3) + n / BLOCK_SIZE
    }

    /// The whole weight from every rank's [`Self::to_values`] (`parts`, in rank order, of rows
    /// `rows`: together every row in order).
    pub fn gather_parts(&self, parts: &[&[f32]], rows: &[Range<usize>]) -> FrozenNf4 {
        let [out, inp] = self.full;
        let mut codes = Vec::with_capacity(out * inp / 2);
        let mut scales = Vec::with_capacity(out * inp / BLOCK_SIZE);
        for (part, rows) in parts.iter().zip(rows) {
            let bytes = rows.len() * inp / 2;
            let (packed, sc) = part.split_at(bytes.div_ceil(3));
            let start = codes.len();
            codes.extend(packed.iter().flat_map(|&v| unpack(v)));
            codes.truncate(start + bytes);
            scales.extend_from_slice(sc);
        }
        FrozenNf4 {
            nf4: Nf4Weight {
                shape: vec![out, inp],
                dtype: self.dtype,
                codes,
                scalers: Vec::new(),
                factors: Vec::new(),
                mean: 0.0,
            },
            order: self.order,
            compute: self.compute,
            scales: Some(Arc::new(scales)),
            on_device: DeviceCopies::default(),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * self.scales.len()
    }
}

/// Up to three code bytes as one f32 (missing ones are 0).
fn pack(bytes: &[u8]) -> f32 {
    let byte = |i: usize| u32::from(bytes.get(i).copied().unwrap_or(0));
    ((byte(0) << 16) | (byte(1) << 8) | byte(2)) as f32
}

/// The three bytes [`pack`] made `value` of.
fn unpack(value: f32) -> [u8; 3] {
    let v = value as u32;
    [(v >> 16) as u8, (v >> 8) as u8, v as u8]
}

/// Per backend type and device, the weight as [`OnDevice`] holds it. Cloning a [`FrozenNf4`]
/// starts with none: a clone may go to another device.
#[derive(Default)]
struct DeviceCopies(Mutex<Vec<DeviceCopy>>);

/// The backend's type, the device (as it prints), and an `Arc<OnDevice<that backend>>`.
type DeviceCopy = (TypeId, String, Arc<dyn Any + Send + Sync>);

impl Clone for DeviceCopies {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl std::fmt::Debug for DeviceCopies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map_or(0, |c| c.len());
        write!(f, "DeviceCopies({n})")
    }
}

/// An NF4 weight on a device that dequantizes it there: 0.56 bytes per value (the packed codes
/// and one fp32 scale per block of 64) instead of the 4 or 2 of a float weight.
struct OnDevice<B: Backend> {
    /// Eight 4-bit level indices per int, the first in the top bits, in quantized row order.
    words: Tensor<B, 1, Int>,
    /// `[1, 8]`: how far each of a word's eight indices is shifted.
    shifts: Tensor<B, 2, Int>,
    /// The 16 levels (values of the quantization dtype), fp32.
    levels: Tensor<B, 1>,
    /// `[blocks, 1]`: each block's scale (a value of the compute dtype, exactly as the host
    /// has it), fp32.
    scales: Tensor<B, 2>,
    /// For q/k's torchtune row order: the quantized row holding each Hugging Face row.
    rows: Option<Tensor<B, 1, Int>>,
}

impl FrozenNf4 {
    /// Quantizes `weight` (`[out, in]` row-major, Hugging Face order) in `dtype` (torchtune:
    /// the dtype the checkpoint stores it in), to be dequantized in `compute`.
    pub fn quantize(
        weight: &[f32],
        shape: [usize; 2],
        dtype: Nf4Dtype,
        compute: Nf4Dtype,
        order: RowOrder,
    ) -> Result<Self, Nf4Error> {
        let [out, inp] = shape;
        let reordered;
        let values = match order {
            RowOrder::Stored => weight,
            RowOrder::RopeInterleaved { .. } => {
                reordered = (0..out)
                    .flat_map(|row| {
                        let src = order.source_row(row);
                        weight[src * inp..(src + 1) * inp].iter().copied()
                    })
                    .collect::<Vec<f32>>();
                &reordered
            }
        };
        Ok(Self {
            nf4: Nf4Weight::quantize(values, &shape, dtype)?,
            order,
            compute,
            scales: None,
            on_device: DeviceCopies::default(),
        })
    }

    /// Each block's scale in the compute dtype.
    pub(crate) fn block_scales(&self) -> Vec<f32> {
        match &self.scales {
            Some(scales) => scales.as_ref().clone(),
            None => self.nf4.block_scales_in(self.compute),
        }
    }

    /// Quantized rows `rows` of this weight as FSDP keeps them on one rank ([`Nf4Rows`]);
    /// `None` when a row does not hold whole blocks (`in` not a multiple of the block size:
    /// such a weight stays whole on every rank).
    pub fn rows(&self, rows: Range<usize>) -> Option<Nf4Rows> {
        let [out, inp] = self.shape();
        if !inp.is_multiple_of(BLOCK_SIZE) || rows.end > out {
            return None;
        }
        let (start, end) = (rows.start * inp, rows.end * inp);
        let scales = self.block_scales();
        Some(Nf4Rows {
            full: [out, inp],
            order: self.order,
            compute: self.compute,
            dtype: self.nf4.dtype,
            codes: self.nf4.codes[start / 2..end / 2].to_vec(),
            scales: scales[start / BLOCK_SIZE..end / BLOCK_SIZE].to_vec(),
        })
    }

    pub fn shape(&self) -> [usize; 2] {
        [self.nf4.shape[0], self.nf4.shape[1]]
    }

    /// The weight as torchtune saves it: its QLoRA state-dict hook casts the NF4 tensor to
    /// bf16 whatever the model dtype, i.e. the compute-dtype dequantization rounded to bf16.
    pub fn dequantize_for_export(&self) -> Vec<f32> {
        let mut values = self.dequantize();
        if self.compute != Nf4Dtype::Bf16 {
            values
                .par_iter_mut()
                .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
        }
        values
    }

    /// The dequantized weight in the compute dtype, Hugging Face's row order, `[out, in]`
    /// row-major. Rows are decoded in parallel: this runs for every NF4 layer in every forward
    /// and backward pass.
    pub fn dequantize(&self) -> Vec<f32> {
        self.decode_rows(|row, dst| dst.copy_from_slice(row))
    }

    /// [`Self::dequantize`] rounded to bf16 as `kernels::cast` rounds (to nearest, ties to
    /// even), without the fp32 weight in between. Why: a bf16 QLoRA step decoded each weight
    /// into a zeroed fp32 buffer of its size and rounded that in a second pass; on
    /// Qwen3-30B-A3B's layer, whose 128 experts' weights are all decoded twice a step, the
    /// zeroing, decoding and rounding passes were a third of the step.
    pub fn dequantize_bf16(&self) -> Vec<half::bf16> {
        self.decode_rows(crate::kernels::bf16::round_into)
    }

    /// Every row decoded in fp32 into a buffer that stays in cache, `convert`ed into a second
    /// one, and copied into its place in the result, which is never zeroed first.
    fn decode_rows<T: Copy + Default + Send>(
        &self,
        convert: impl Fn(&[f32], &mut [T]) + Sync,
    ) -> Vec<T> {
        let [out, inp] = self.shape();
        let compute = self.compute;
        let scales = self.block_scales();
        let mut values = Vec::with_capacity(out * inp);
        values.spare_capacity_mut()[..out * inp]
            .par_chunks_mut(inp.max(1))
            .enumerate()
            .for_each_init(
                || (vec![0.0f32; inp], vec![T::default(); inp]),
                |(decoded, converted), (row, dst)| {
                    let start = self.order.quantized_row(row) * inp;
                    self.nf4.dequantize_into(&scales, compute, start, decoded);
                    convert(decoded, converted);
                    for (d, &v) in dst.iter_mut().zip(converted.iter()) {
                        d.write(v);
                    }
                },
            );
        // SAFETY: the chunks cover all `out * inp` elements, and each chunk (a row, `inp`
        // long) had every element written from the row's `inp` converted values.
        unsafe { values.set_len(out * inp) };
        values
    }

    /// The dequantized weight as a tensor of the device's float dtype. On the CPU (with or
    /// without autodiff: DoRA takes its base weight on the autodiff backend) it is decoded on the
    /// host ([`Self::dequantize`]); any other backend decodes it on its device from codes
    /// and scales uploaded once ([`Self::dequantize_on_device`]), so a GPU step neither waits for
    /// the host to decode nor uploads float weights.
    pub fn to_tensor<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2> {
        if crate::kernels::is_flex::<B>() {
            let dtype: DType = burn::tensor::get_device_settings::<B>(device)
                .float_dtype
                .into();
            if dtype == DType::BF16 {
                return Tensor::from_data(
                    TensorData::new(self.dequantize_bf16(), self.shape()),
                    TensorCreationOptions::new(device.clone()).with_dtype(DType::BF16),
                );
            }
            // Made in fp32 (what the host decodes to) and rounded to the device's dtype by the
            // parallel cast: `from_data` would convert one element at a time.
            let w = crate::precision::f32_tensor(self.dequantize(), self.shape(), device);
            crate::kernels::cast(w, dtype)
        } else {
            self.dequantize_on_device(device)
        }
    }

    /// The dequantized weight computed by tensor ops on `device`, in its float dtype: each
    /// level index picks its level, times its block's scale in fp32, rounded to the device's
    /// dtype (the host's [`block_table`] rounds the same fp32 product to the compute dtype),
    /// rows back in Hugging Face's order. Bit for bit [`Self::dequantize`] where the device
    /// multiplies fp32 as IEEE 754 does and the compute dtype is the device's.
    pub fn dequantize_on_device<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2> {
        let copy = self.uploaded::<B>(device);
        let [out, inp] = self.shape();
        let words = copy.words.dims()[0];
        let codes = copy
            .words
            .clone()
            .reshape([words, 1])
            .expand([words, 8])
            .bitwise_right_shift(copy.shifts.clone().expand([words, 8]))
            .bitwise_and_scalar(15.elem());
        let values = copy.levels.clone().select(0, codes.reshape([words * 8]));
        let blocks = copy.scales.dims()[0];
        let w = (values.reshape([blocks, BLOCK_SIZE]) * copy.scales.clone()).reshape([out, inp]);
        let w = match &copy.rows {
            Some(rows) => w.select(0, rows.clone()),
            None => w,
        };
        crate::precision::to_dtype(w, get_device_settings::<B>(device).float_dtype.into())
    }

    /// The codes and scales on `device` for backend `B`, uploaded on first use.
    fn uploaded<B: Backend>(&self, device: &B::Device) -> Arc<OnDevice<B>> {
        let key = (TypeId::of::<B>(), format!("{device:?}"));
        let mut copies = self
            .on_device
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let found = copies
            .iter()
            .find(|(ty, dev, _)| (*ty, dev) == (key.0, &key.1))
            .and_then(|(_, _, copy)| Arc::clone(copy).downcast::<OnDevice<B>>().ok());
        if let Some(copy) = found {
            return copy;
        }
        let copy = Arc::new(self.upload::<B>(device));
        copies.push((key.0, key.1, copy.clone()));
        copy
    }

    fn upload<B: Backend>(&self, device: &B::Device) -> OnDevice<B> {
        let [out, _] = self.shape();
        // Four bytes (eight codes, the first in the high nibble of the first byte) per int.
        let words: Vec<i32> = self
            .nf4
            .codes
            .chunks_exact(4)
            .map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let n = words.len();
        let scales = self.block_scales();
        let blocks = scales.len();
        let rows = match self.order {
            RowOrder::Stored => None,
            order => {
                let rows: Vec<i32> = (0..out).map(|r| order.quantized_row(r) as i32).collect();
                Some(Tensor::from_data(TensorData::new(rows, [out]), device))
            }
        };
        OnDevice {
            words: Tensor::from_data(TensorData::new(words, [n]), device),
            shifts: Tensor::from_data(
                TensorData::new((0..8).map(|j| 28 - 4 * j).collect::<Vec<i32>>(), [1, 8]),
                device,
            ),
            levels: f32_tensor(self.nf4.levels().to_vec(), [16], device),
            scales: f32_tensor(scales, [blocks, 1], device),
            rows,
        }
    }

    /// `x @ W^T` for a few rows of `x` (`[rows, in]` row-major; decoding's one token), without
    /// materialising `W`: each 64-value block is decoded into a small buffer through a table of
    /// its 16 possible values (the dequantized weight's exact values) and dotted with the rows.
    /// Reads half a byte per weight where a float matmul reads four, so a decode step is
    /// cheaper than dequantizing. Only the summation order differs from the dequantized
    /// matmul. Needs `in` a multiple of the block size (blocks within rows).
    pub fn matmul_rows(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let [out, inp] = self.shape();
        debug_assert!(inp.is_multiple_of(BLOCK_SIZE) && x.len() == rows * inp);
        let scales = self.block_scales();
        let levels = self.nf4.levels();
        // y^T [out, rows], one output row per task.
        let mut yt = vec![0.0f32; out * rows];
        yt.par_chunks_mut(rows).enumerate().for_each(|(o, acc)| {
            let start = self.order.quantized_row(o) * inp;
            let codes = &self.nf4.codes[start / 2..(start + inp) / 2];
            let scales = &scales[start / BLOCK_SIZE..(start + inp) / BLOCK_SIZE];
            decode_dot(codes, scales, &levels, self.compute, x, inp, acc);
        });
        let mut y = vec![0.0f32; rows * out];
        for (o, acc) in yt.chunks_exact(rows).enumerate() {
            for (r, v) in acc.iter().enumerate() {
                y[r * out + o] = *v;
            }
        }
        y
    }

    /// `x @ W` for 2-64 rows of `x` (`[rows, out]` row-major: the backward's input gradient)
    /// by gemm over blocks of the weight's rows, each decoded into a buffer that stays in L2
    /// and accumulated into the result, so the dequantized weight is never written whole.
    /// Sums run in K blocks, so they may differ from the whole product's in the last bits.
    /// `None` for other row counts or a weight of another shape than `x` needs.
    pub fn matmul_rows_plain_decoded(&self, x: &[f32], rows: usize) -> Option<Vec<f32>> {
        let [out, inp] = self.shape();
        if !crate::kernels::f32_skinny::ROWS.contains(&rows) || x.len() != rows * out {
            return None;
        }
        let scales = self.block_scales();
        let block_rows = (DECODED_BYTES / 4 / inp.max(1)).clamp(1, out.max(1));
        let mut block = vec![0.0f32; block_rows * inp];
        let mut y = vec![0.0f32; rows * inp];
        for first in (0..out).step_by(block_rows) {
            let count = block_rows.min(out - first);
            block[..count * inp]
                .par_chunks_mut(inp)
                .enumerate()
                .for_each(|(i, values)| self.decode_row(&scales, first + i, values));
            crate::kernels::matmul_accumulate(&mut y, x, rows, out, first, count, &block, inp);
        }
        Some(y)
    }

    /// `x @ W^T` for 2-64 rows of `x` (`[rows, in]` row-major) by the f32 skinny product, its
    /// weight lines decoded a few at a time into a buffer that stays in cache: bit for bit the
    /// product over [`Self::dequantize`]'s weight, without writing it. `None` for other row
    /// counts or a weight of another shape than `x` needs.
    pub fn matmul_rows_decoded(&self, x: &[f32], rows: usize) -> Option<Vec<f32>> {
        let [out, inp] = self.shape();
        if !crate::kernels::f32_skinny::ROWS.contains(&rows) || x.len() != rows * inp {
            return None;
        }
        let scales = self.block_scales();
        Some(crate::kernels::f32_skinny::product_decoded(
            x,
            rows,
            inp,
            out,
            |line, values| self.decode_row(&scales, line, values),
        ))
    }

    /// Row `row` (Hugging Face's order) decoded into `values` in the compute dtype, given
    /// [`Self::block_scales`].
    fn decode_row(&self, scales: &[f32], row: usize, values: &mut [f32]) {
        let start = self.order.quantized_row(row) * self.shape()[1];
        self.nf4
            .dequantize_into(scales, self.compute, start, values);
    }

    /// Bytes held by the quantized weight.
    pub fn bytes(&self) -> usize {
        match &self.scales {
            Some(scales) => self.nf4.codes.len() + 4 * scales.len(),
            None => self.nf4.bytes(),
        }
    }
}

multiversion! {
    /// One output row: `acc[r] = x[r] . w` for `w` the row's blocks (`codes`, `scales`).
    fn decode_dot(
        codes: &[u8],
        scales: &[f32],
        levels: &[f32; 16],
        compute: Nf4Dtype,
        x: &[f32],
        inp: usize,
        acc: &mut [f32],
    ) {
        let mut w = [0.0f32; BLOCK_SIZE];
        for (b, (block, &scale)) in codes.chunks_exact(BLOCK_SIZE / 2).zip(scales).enumerate() {
            let table = block_table(levels, scale, compute);
            for (pair, byte) in w.chunks_exact_mut(2).zip(block) {
                pair[0] = table[usize::from(byte >> 4)];
                pair[1] = table[usize::from(byte & 0x0f)];
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let xs = &x[r * inp + b * BLOCK_SIZE..r * inp + (b + 1) * BLOCK_SIZE];
                *a += simd::dot(&w, xs);
            }
        }
    }
}

/// Values in [-0.05, 0.05) without a pattern a block's scale would hide: a weight for tests.
#[cfg(test)]
pub(crate) fn test_weight(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 0.1)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_flex::Flex;

    /// A `[256, 128]` weight quantized in bf16, for both row orders and compute dtypes.
    fn cases() -> impl Iterator<Item = (RowOrder, Nf4Dtype, FrozenNf4)> {
        let w = test_weight(256 * 128);
        let orders = [RowOrder::Stored, RowOrder::RopeInterleaved { head_dim: 64 }];
        orders.into_iter().flat_map(move |order| {
            let w = w.clone();
            [Nf4Dtype::F32, Nf4Dtype::Bf16].map(move |compute| {
                let q = FrozenNf4::quantize(&w, [256, 128], Nf4Dtype::Bf16, compute, order);
                (order, compute, q.unwrap())
            })
        })
    }

    /// FSDP's per-rank load: a rank quantizes its rows from reads of a few rows at a time,
    /// in order, never the whole weight, and gets what quantizing the whole weight and
    /// keeping its rows gives, bit for bit (ranks whose rows cross scaler blocks included).
    #[test]
    fn a_ranks_rows_quantize_alone_as_the_whole_weight_keeps_them() {
        let w = test_weight(256 * 128);
        for (order, compute, q) in cases() {
            for world in [1, 2, 3, 5] {
                for rank in 0..world {
                    let rows = crate::checkpoint::dcp::row_range(256, rank, world);
                    let mut reads = Vec::new();
                    let read = |r: Range<usize>| {
                        reads.push(r.clone());
                        Ok::<_, ()>(w[r.start * 128..r.end * 128].to_vec())
                    };
                    let got = Nf4Rows::quantize(
                        read,
                        [256, 128],
                        rows.clone(),
                        (Nf4Dtype::Bf16, compute),
                        order,
                    )
                    .unwrap()
                    .unwrap();
                    let want = q.rows(rows.clone()).unwrap();
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(got.codes, want.codes, "{order:?} {world} {rank}");
                    assert_eq!(
                        bits(&got.scales),
                        bits(&want.scales),
                        "{order:?} {world} {rank}"
                    );
                    assert_eq!(
                        (got.full, got.dtype, got.compute),
                        (want.full, want.dtype, want.compute)
                    );
                    // Every row read once, in order, at most a head's (64) at a time in RoPE
                    // order.
                    let starts: Vec<usize> = reads.iter().map(|r| r.start).collect();
                    assert_eq!(reads.last().map(|r| r.end), Some(256));
                    assert!(
                        reads.windows(2).all(|p| p[0].end == p[1].start),
                        "{reads:?}"
                    );
                    assert_eq!(starts[0], 0);
                    if matches!(order, RowOrder::RopeInterleaved { .. }) {
                        assert!(reads.iter().all(|r| r.len() == 64), "{reads:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn every_ranks_rows_gather_into_the_whole_weight_bit_for_bit() {
        for (order, compute, q) in cases() {
            let whole = q.dequantize();
            for world in [1, 2, 3, 5] {
                let rows: Vec<_> = (0..world)
                    .map(|r| crate::checkpoint::dcp::row_range(256, r, world))
                    .collect();
                let values: Vec<Vec<f32>> = rows
                    .iter()
                    .map(|r| q.rows(r.clone()).expect("whole blocks").to_values())
                    .collect();
                let piece = q.rows(rows[0].clone()).expect("whole blocks");
                for (r, v) in rows.iter().zip(&values) {
                    assert_eq!(v.len(), piece.values_len(r), "{world} ranks");
                }
                let parts: Vec<&[f32]> = values.iter().map(Vec::as_slice).collect();
                let gathered = piece.gather_parts(&parts, &rows);
                assert_eq!(gathered.shape(), [256, 128]);
                assert_eq!(
                    gathered.dequantize(),
                    whole,
                    "{order:?} {compute:?} {world} ranks"
                );
                assert_eq!(gathered.dequantize_for_export(), q.dequantize_for_export());
            }
        }
    }

    #[test]
    fn the_fused_row_product_equals_the_dequantized_matmul() {
        let (out, inp) = (256, 128);
        for (order, compute, q) in cases() {
            let dq = q.dequantize();
            for rows in 1..=3 {
                let x: Vec<f32> = (0..rows * inp).map(|i| (i % 13) as f32 - 6.0).collect();
                let y = q.matmul_rows(&x, rows);
                for r in 0..rows {
                    for o in 0..out {
                        let want: f32 = (0..inp).map(|k| x[r * inp + k] * dq[o * inp + k]).sum();
                        let got = y[r * out + o];
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{order:?} {compute:?} rows {rows}: [{r}, {o}] {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// An expert's few rows in fp32 QLoRA: the skinny product over lines decoded a few at a
    /// time is the skinny product over the dequantized weight bit for bit, in both row orders
    /// and compute dtypes; other row counts are left to the dequantizing path.
    #[test]
    fn the_decoded_line_product_is_the_product_over_the_dequantized_weight() {
        let (out, inp) = (256, 128);
        for (order, compute, q) in cases() {
            let dq = q.dequantize();
            for rows in [2, 5, 32, 64] {
                let x: Vec<f32> = (0..rows * inp).map(|i| (i % 13) as f32 - 6.0).collect();
                let want = crate::kernels::f32_skinny::product(&x, rows, inp, &dq, 0, inp, out);
                let got = q.matmul_rows_decoded(&x, rows);
                assert_eq!(got, Some(want), "{order:?} {compute:?} rows {rows}");
            }
            for rows in [1, 65] {
                let x = vec![1.0; rows * inp];
                assert_eq!(q.matmul_rows_decoded(&x, rows), None, "rows {rows}");
            }
        }
    }

    /// The backward's `g @ W` for an expert's few rows, over blocks of decoded weight rows
    /// accumulated by gemm, is the product over the dequantized weight (to f32 rounding), in
    /// both row orders and compute dtypes, with a weight of several blocks and a partial one.
    #[test]
    fn the_plain_product_over_decoded_row_blocks_is_the_product_over_the_dequantized_weight() {
        // 2304 rows of 128: 1024 rows per 512 KB block, so two whole blocks and a partial one.
        let (out, inp) = (2304, 128);
        let w = test_weight(out * inp);
        for order in [RowOrder::Stored, RowOrder::RopeInterleaved { head_dim: 64 }] {
            for compute in [Nf4Dtype::F32, Nf4Dtype::Bf16] {
                let q =
                    FrozenNf4::quantize(&w, [out, inp], Nf4Dtype::Bf16, compute, order).unwrap();
                let dq = q.dequantize();
                for rows in [2, 33] {
                    let x: Vec<f32> = (0..rows * out).map(|i| (i % 13) as f32 - 6.0).collect();
                    let y = q.matmul_rows_plain_decoded(&x, rows).unwrap();
                    for r in 0..rows {
                        for c in 0..inp {
                            let want: f64 = (0..out)
                                .map(|o| f64::from(x[r * out + o]) * f64::from(dq[o * inp + c]))
                                .sum();
                            let got = f64::from(y[r * inp + c]);
                            assert!(
                                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                                "{order:?} {compute:?} rows {rows}: [{r}, {c}] {got} vs {want}"
                            );
                        }
                    }
                }
                assert_eq!(q.matmul_rows_plain_decoded(&vec![1.0; out], 1), None);
            }
        }
    }

    /// The device path's values for `B` on `device`, against the host's for both row orders:
    /// bit for bit in fp32, and its fp32 products rounded to bf16 give the host's bf16 ones.
    fn check_device_dequantization<B: Backend>(device: &B::Device) {
        let (out, inp) = (256, 128);
        for (order, compute, q) in cases() {
            let got = q.dequantize_on_device::<B>(device);
            assert_eq!(got.dims(), [out, inp]);
            // Twice: the second use takes the uploaded copy.
            let again = q.dequantize_on_device::<B>(device);
            // Rounded to the compute dtype, as a device of that dtype stores the product.
            let bits = |t: Tensor<B, 2>| -> Vec<u32> {
                let v = t.into_data().convert::<f32>().to_vec::<f32>().unwrap();
                v.iter().map(|x| compute.round(*x).to_bits()).collect()
            };
            let want: Vec<u32> = q.dequantize().iter().map(|x| x.to_bits()).collect();
            assert_eq!(bits(got), want, "{order:?} {compute:?}");
            assert_eq!(bits(again), want, "{order:?} {compute:?}, cached");
        }
    }

    /// A bf16 run's weight decoded straight to bf16 is the fp32 decode rounded as
    /// `kernels::cast` rounds, bit for bit, in both row orders and compute dtypes.
    #[test]
    fn the_bf16_decode_is_the_fp32_decode_rounded() {
        for (_, _, q) in cases() {
            let want = crate::kernels::bf16::round(&q.dequantize());
            let got = q.dequantize_bf16();
            assert_eq!(got.len(), want.len());
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
        }
    }

    #[test]
    fn device_dequantization_equals_the_hosts() {
        check_device_dequantization::<Flex>(&Default::default());
        // The CPU takes the host path.
        let q = FrozenNf4::quantize(
            &vec![0.5; 64 * 256],
            [64, 256],
            Nf4Dtype::F32,
            Nf4Dtype::F32,
            RowOrder::Stored,
        )
        .unwrap();
        let _ = q.to_tensor::<Flex>(&Default::default());
        let _ = q.to_tensor::<burn::backend::Autodiff<Flex>>(&Default::default());
        assert_eq!(format!("{:?}", q.on_device), "DeviceCopies(0)");
    }

    #[test]
    fn interleaved_rows_follow_torchtunes_permute() {
        // head_dim 4: torchtune's rows are HF rows [0, 2, 1, 3] per head.
        let order = RowOrder::RopeInterleaved { head_dim: 4 };
        let rows: Vec<usize> = (0..8).map(|r| order.source_row(r)).collect();
        assert_eq!(rows, [0, 2, 1, 3, 4, 6, 5, 7]);
        for row in 0..8 {
            assert_eq!(order.quantized_row(order.source_row(row)), row);
        }
    }

    #[test]
    fn the_interleaved_order_quantizes_torchtunes_rows_and_dequantizes_to_hugging_faces() {
        let (heads, head_dim, inp) = (2, 128, 64);
        let out = heads * head_dim;
        let weight: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5 + (i / inp) as f32 * 0.01)
            .collect();
        // torchtune's `t.view(heads, 2, head_dim / 2, in).transpose(1, 2).reshape(out, in)`
        let mut permuted = Vec::with_capacity(weight.len());
        for h in 0..heads {
            for i in 0..head_dim / 2 {
                for j in 0..2 {
                    let src = h * head_dim + j * head_dim / 2 + i;
                    permuted.extend_from_slice(&weight[src * inp..(src + 1) * inp]);
                }
            }
        }
        let f32 = Nf4Dtype::F32;
        let tt = FrozenNf4::quantize(&permuted, [out, inp], f32, f32, RowOrder::Stored);
        let ours = FrozenNf4::quantize(
            &weight,
            [out, inp],
            f32,
            f32,
            RowOrder::RopeInterleaved { head_dim },
        );
        let (tt, ours) = (tt.unwrap(), ours.unwrap());
        assert_eq!(tt.nf4, ours.nf4, "the same quantized weight as torchtune's");
        let (tt_rows, ours_rows) = (tt.dequantize(), ours.dequantize());
        for row in 0..out {
            let src = RowOrder::RopeInterleaved { head_dim }.source_row(row);
            assert_eq!(
                tt_rows[row * inp..(row + 1) * inp],
                ours_rows[src * inp..(src + 1) * inp],
                "row {row}"
            );
        }
    }
}
