//! A frozen NF4 weight as the bf16 GEMM's B operand ([`bf16_gemm::PanelSource`]): each block of
//! panels is decoded into the GEMM's packed K-pair layout when its micro-kernels ask for it, so a
//! bf16 QLoRA product never holds the decoded weight whole. The values are
//! [`FrozenNf4::dequantize_bf16`]'s, bit for bit, and so are the products (tested).
//!
//! Why: with the weight dequantized whole, a bf16 QLoRA product wrote the decoded weight (2 bytes
//! per value), read it back to pack it, zeroed and wrote the packed copy, and read that again.
//! On Qwen3-30B-A3B's layer, whose 128 experts' weights are all decoded in the forward pass and
//! again in the backward pass, decoding and packing were a quarter of the step (`perf`); decoded
//! here, in AVX-512, the bf16 step is 32% shorter (3.89 -> 2.64 s, BENCHMARKS.md).
//!
//! Decoding: a block's 16 possible values are one 512-bit table, so 16 codes become 16 values by
//! one `vpermd`. A `W^T` panel's column is a weight row, so 16 rows' pair words are transposed
//! in registers before they are stored; a `W` panel's pair is two rows, interleaved in
//! registers.

use super::frozen_nf4::FrozenNf4;
use super::nf4::{BLOCK_SIZE, Nf4Dtype, block_table};
use crate::kernels::bf16::round_bits;
use crate::kernels::bf16_gemm::{self, NR};

/// Which operand of a product a frozen NF4 weight `W` (`[out, in]`) is, as the bf16 GEMM's B.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// `x @ W^T` (the forward pass): B is `W^T`, `[in, out]`; a panel is 64 of W's rows.
    Transposed,
    /// `g @ W` (the input's gradient): B is `W`, `[out, in]`; a panel is one 64-value block of
    /// each of W's rows, two rows to a K-pair.
    Plain,
}

/// A frozen NF4 weight as one side of bf16 GEMMs (see the module doc).
pub struct Bf16Panels<'a> {
    weight: &'a FrozenNf4,
    side: Side,
    /// Each block's scale in the compute dtype.
    scales: Vec<f32>,
    levels: [f32; 16],
}

impl FrozenNf4 {
    /// This weight as `side` of a bf16 GEMM; `None` unless its rows hold whole blocks (`in` a
    /// multiple of the block size), which the panels' block-aligned decoding needs.
    pub fn bf16_panels(&self, side: Side) -> Option<Bf16Panels<'_>> {
        const _: () = assert!(
            BLOCK_SIZE == bf16_gemm::NR,
            "a Plain panel is one NF4 block"
        );
        let [_, inp] = self.shape();
        inp.is_multiple_of(BLOCK_SIZE).then(|| Bf16Panels {
            weight: self,
            side,
            scales: self.block_scales(),
            levels: self.nf4.levels(),
        })
    }
}

impl Bf16Panels<'_> {
    /// B's columns: the product's output width.
    pub fn cols(&self) -> usize {
        let [out, inp] = self.weight.shape();
        match self.side {
            Side::Transposed => out,
            Side::Plain => inp,
        }
    }

    /// Block `block`'s 16 values as bf16 bits: the compute dtype's values (the fp32 decode)
    /// rounded to bf16 as [`FrozenNf4::dequantize_bf16`] rounds them.
    #[inline(always)]
    fn table(&self, block: usize) -> [u32; 16] {
        let scale = self.scales[block];
        let mut table = [0u32; 16];
        if self.weight.compute == Nf4Dtype::F16 {
            let values = block_table(&self.levels, scale, Nf4Dtype::F16);
            for (t, v) in table.iter_mut().zip(values) {
                *t = u32::from(round_bits(v));
            }
        } else {
            // Rounding an fp32 or bf16 compute dtype's value to bf16 is rounding the fp32
            // product once: spelled out so the 16 lanes vectorise (it was 7% of a step).
            for (t, level) in table.iter_mut().zip(&self.levels) {
                *t = u32::from(round_bits(level * scale));
            }
        }
        table
    }

    /// W's `row` (Hugging Face order), values `k0..k0 + 2 * pairs`, as K-pair words at
    /// `dst[0], dst[step], ...` (`k0` and the run on block boundaries).
    fn row_pairs(&self, row: usize, k0: usize, pairs: usize, dst: &mut [u32], step: usize) {
        let inp = self.weight.shape()[1];
        let start = self.weight.order.quantized_row(row) * inp + k0;
        let codes = &self.weight.nf4.codes[start / 2..][..pairs];
        for (b, bytes) in codes.chunks(BLOCK_SIZE / 2).enumerate() {
            let table = self.table(start / BLOCK_SIZE + b);
            let dst = &mut dst[b * (BLOCK_SIZE / 2) * step..];
            for (j, &byte) in bytes.iter().enumerate() {
                dst[j * step] =
                    table[usize::from(byte >> 4)] | (table[usize::from(byte & 0x0f)] << 16);
            }
        }
    }

    /// W's `row` (Hugging Face order), block `block` of it: its 64 values' bf16 bits ORed into
    /// `dst` shifted by `shift`.
    fn block_values(&self, row: usize, block: usize, dst: &mut [u32], shift: u32) {
        let inp = self.weight.shape()[1];
        let start = self.weight.order.quantized_row(row) * inp + block * BLOCK_SIZE;
        let table = self.table(start / BLOCK_SIZE);
        let codes = &self.weight.nf4.codes[start / 2..][..BLOCK_SIZE / 2];
        for (pair, &byte) in dst.chunks_exact_mut(2).zip(codes) {
            pair[0] |= table[usize::from(byte >> 4)] << shift;
            pair[1] |= table[usize::from(byte & 0x0f)] << shift;
        }
    }
}

/// The decoding loops in AVX-512 (see the module doc); the scalar ones above are their
/// definition, and an f16 compute dtype's (rounded twice) path.
#[cfg(target_arch = "x86_64")]
impl Bf16Panels<'_> {
    /// Block `block`'s table as [`Self::table`] makes it, in one register: `level * scale` in
    /// fp32, rounded to bf16 (nearest, ties to even; NaN kept quiet) as `round_bits` rounds.
    #[target_feature(enable = "avx512f")]
    fn table_avx512(
        &self,
        levels: std::arch::x86_64::__m512,
        block: usize,
    ) -> std::arch::x86_64::__m512i {
        use std::arch::x86_64::*;
        let b = _mm512_castps_si512(_mm512_mul_ps(levels, _mm512_set1_ps(self.scales[block])));
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd);
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, bias));
        let magnitude = _mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff));
        let nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f80_0000));
        let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x40));
        _mm512_mask_mov_epi32(rounded, nan, quiet)
    }

    /// Panel `q`'s pairs `kp0..kp0 + kc` of `W^T`: 16 of W's rows at a time, 16 pairs (half a
    /// block) of each decoded into a register, the 16 x 16 words transposed so each pair's 16
    /// rows are one store. Rows past W's last are zero.
    #[target_feature(enable = "avx512f")]
    unsafe fn transposed_avx512(&self, q: usize, kp0: usize, kc: usize, scratch: &mut [u32]) {
        use std::arch::x86_64::*;
        let [out, inp] = self.weight.shape();
        let lines = NR.min(out - q * NR);
        // SAFETY (loads): the levels are 16 floats.
        let levels = unsafe { _mm512_loadu_ps(self.levels.as_ptr()) };
        let codes = &self.weight.nf4.codes;
        debug_assert!(kc.is_multiple_of(16) && scratch.len() == kc * NR);
        for l0 in (0..NR).step_by(16) {
            let group = 16.min(lines.saturating_sub(l0));
            let starts: [usize; 16] = std::array::from_fn(|i| {
                let row = (q * NR + l0 + i).min(out - 1);
                self.weight.order.quantized_row(row) * inp + 2 * kp0
            });
            for j0 in (0..kc).step_by(16) {
                let mut rows = [_mm512_setzero_si512(); 16];
                for (row, &start) in rows.iter_mut().zip(&starts).take(group) {
                    let v = start + 2 * j0;
                    let table = self.table_avx512(levels, v / BLOCK_SIZE);
                    let bytes = &codes[v / 2..v / 2 + 16];
                    // SAFETY: `bytes` holds the 16 bytes loaded.
                    let bytes = unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) };
                    *row = pair_words(bytes, table, table);
                }
                let columns = bf16_gemm::transpose_16x16(rows);
                for (j, column) in columns.iter().enumerate() {
                    let words = &mut scratch[(j0 + j) * NR + l0..][..16];
                    // SAFETY: `words` holds the 16 words stored.
                    unsafe { _mm512_storeu_si512(words.as_mut_ptr().cast(), *column) };
                }
            }
        }
    }

    /// Panel `q`'s pairs `kp0..kp0 + kc` of `W`: for each pair, block `q` of rows `2kp` and
    /// `2kp + 1`, decoded 16 codes at a time, the even and odd values' words interleaved.
    #[target_feature(enable = "avx512f")]
    unsafe fn plain_avx512(&self, q: usize, kp0: usize, kc: usize, scratch: &mut [u32]) {
        use std::arch::x86_64::*;
        let [out, inp] = self.weight.shape();
        // SAFETY (loads): the levels are 16 floats.
        let levels = unsafe { _mm512_loadu_ps(self.levels.as_ptr()) };
        let codes = &self.weight.nf4.codes;
        let first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        let second =
            _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        for (i, words) in scratch.chunks_exact_mut(NR).take(kc).enumerate() {
            let row = 2 * (kp0 + i);
            let start = |row: usize| self.weight.order.quantized_row(row) * inp + q * BLOCK_SIZE;
            let low = start(row);
            let low_table = self.table_avx512(levels, low / BLOCK_SIZE);
            let (high, high_table) = if row + 1 < out {
                let high = start(row + 1);
                (high, self.table_avx512(levels, high / BLOCK_SIZE))
            } else {
                (low, _mm512_setzero_si512())
            };
            for h in 0..2 {
                // No closures: they would not inherit the target feature, and their
                // intrinsics would become calls.
                let (a, b) = (
                    &codes[low / 2 + 16 * h..][..16],
                    &codes[high / 2 + 16 * h..][..16],
                );
                // SAFETY: `a` and `b` hold the 16 bytes loaded.
                let (a, b) = unsafe {
                    (
                        _mm_loadu_si128(a.as_ptr().cast()),
                        _mm_loadu_si128(b.as_ptr().cast()),
                    )
                };
                let (a, b) = (_mm512_cvtepu8_epi32(a), _mm512_cvtepu8_epi32(b));
                let fifteen = _mm512_set1_epi32(15);
                // The high nibble is the even value.
                let even = _mm512_or_si512(
                    _mm512_permutexvar_epi32(_mm512_srli_epi32::<4>(a), low_table),
                    _mm512_slli_epi32::<16>(_mm512_permutexvar_epi32(
                        _mm512_srli_epi32::<4>(b),
                        high_table,
                    )),
                );
                let odd = _mm512_or_si512(
                    _mm512_permutexvar_epi32(_mm512_and_si512(a, fifteen), low_table),
                    _mm512_slli_epi32::<16>(_mm512_permutexvar_epi32(
                        _mm512_and_si512(b, fifteen),
                        high_table,
                    )),
                );
                let out = &mut words[32 * h..][..32];
                // SAFETY: `out` holds the 32 words stored.
                unsafe {
                    let at = out.as_mut_ptr();
                    _mm512_storeu_si512(at.cast(), _mm512_permutex2var_epi32(even, first, odd));
                    _mm512_storeu_si512(
                        at.add(16).cast(),
                        _mm512_permutex2var_epi32(even, second, odd),
                    );
                }
            }
        }
    }
}

/// 16 code bytes as 16 K-pair words: each byte's high nibble (the even value) looked up in
/// `low`, its low nibble in `high`, the second value in the word's high half.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn pair_words(
    bytes: std::arch::x86_64::__m128i,
    low: std::arch::x86_64::__m512i,
    high: std::arch::x86_64::__m512i,
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let b = _mm512_cvtepu8_epi32(bytes);
    let first = _mm512_permutexvar_epi32(_mm512_srli_epi32::<4>(b), low);
    let second = _mm512_permutexvar_epi32(_mm512_and_si512(b, _mm512_set1_epi32(15)), high);
    _mm512_or_si512(first, _mm512_slli_epi32::<16>(second))
}

impl bf16_gemm::PanelSource for Bf16Panels<'_> {
    const MADE_PER_BLOCK: bool = true;

    fn block<'s>(&'s self, q: usize, kp0: usize, kc: usize, scratch: &'s mut [u32]) -> &'s [u32] {
        let [out, _] = self.weight.shape();
        let scratch = &mut scratch[..kc * NR];
        #[cfg(target_arch = "x86_64")]
        if self.weight.compute != Nf4Dtype::F16 && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has the feature the functions are compiled for; `scratch` holds
            // the block's `kc * NR` words.
            unsafe {
                match self.side {
                    Side::Transposed => self.transposed_avx512(q, kp0, kc, scratch),
                    Side::Plain => self.plain_avx512(q, kp0, kc, scratch),
                }
            }
            return scratch;
        }
        match self.side {
            Side::Transposed => {
                // Column `l` of the panel is W's row `q * NR + l`, pairs along `in`.
                let lines = NR.min(out - q * NR);
                for l in 0..lines {
                    self.row_pairs(q * NR + l, 2 * kp0, kc, &mut scratch[l..], NR);
                }
                if lines < NR {
                    for words in scratch.chunks_exact_mut(NR) {
                        words[lines..].fill(0);
                    }
                }
            }
            Side::Plain => {
                // Pair `kp` of the panel is W's rows `2kp` and `2kp + 1`, block `q` of each.
                for (i, words) in scratch.chunks_exact_mut(NR).enumerate() {
                    let row = 2 * (kp0 + i);
                    words.fill(0);
                    for (half, row) in [row, row + 1].into_iter().enumerate() {
                        if row < out {
                            self.block_values(row, q, words, 16 * half as u32);
                        }
                    }
                }
            }
        }
        scratch
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::modules::frozen_nf4::{RowOrder, test_weight};

    /// The GEMM over panels decoded block by block gives the GEMM over the weight dequantized
    /// whole, bit for bit: both sides, both row orders and compute dtypes, a last panel of half
    /// the columns, K past one cache block (384 values), an odd number of W's rows, and row
    /// counts within one row panel, over several and past a task's 48.
    #[test]
    fn the_gemm_over_decoded_panels_is_the_gemm_over_the_dequantized_weight() {
        use crate::kernels::bf16_gemm::{self, Operand};
        // Rows holding part of a block have no panels (the product dequantizes them whole).
        let partial = FrozenNf4::quantize(
            &test_weight(512 * 96),
            [512, 96],
            Nf4Dtype::Bf16,
            Nf4Dtype::Bf16,
            RowOrder::Stored,
        )
        .unwrap();
        assert!(partial.bf16_panels(Side::Plain).is_none());
        if !bf16_gemm::available() {
            return;
        }
        let shapes = [[160, 512], [1, 16384]];
        let weights = shapes.into_iter().flat_map(|shape| {
            let w = test_weight(shape[0] * shape[1]);
            let orders = [RowOrder::Stored, RowOrder::RopeInterleaved { head_dim: 32 }];
            orders
                .into_iter()
                .filter(move |o| *o == RowOrder::Stored || shape[0] % 32 == 0)
                .flat_map(move |order| {
                    let w = w.clone();
                    [Nf4Dtype::F32, Nf4Dtype::Bf16, Nf4Dtype::F16].map(move |compute| {
                        FrozenNf4::quantize(&w, shape, Nf4Dtype::Bf16, compute, order).unwrap()
                    })
                })
        });
        fn operand(data: &[half::bf16], rows: usize, cols: usize) -> Operand<'_> {
            Operand {
                data,
                offset: 0,
                rows,
                cols,
                row_stride: cols,
                col_stride: 1,
            }
        }
        for q in weights {
            let [out, inp] = q.shape();
            let w = q.dequantize_bf16();
            for side in [Side::Transposed, Side::Plain] {
                let (k, n) = match side {
                    Side::Transposed => (inp, out),
                    Side::Plain => (out, inp),
                };
                // B as the dequantized weight: `W^T` is W's rows read as columns.
                let b = match side {
                    Side::Transposed => Operand {
                        row_stride: 1,
                        col_stride: inp,
                        ..operand(&w, k, n)
                    },
                    Side::Plain => operand(&w, k, n),
                };
                for m in [1, 7, 50] {
                    let x: Vec<half::bf16> = test_weight(m * k)
                        .iter()
                        .map(|v| half::bf16::from_f32(v * 20.0))
                        .collect();
                    let a = operand(&x, m, k);
                    let panels = q.bf16_panels(side).expect("whole blocks");
                    assert_eq!(panels.cols(), n);
                    let got = bf16_gemm::gemm_panels(a, n, &panels);
                    let want = bf16_gemm::gemm(a, b);
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(g, w)| g.to_bits() == w.to_bits());
                    assert!(same, "{:?} {side:?} {:?} m {m}", q.shape(), q.order);
                }
            }
        }
    }
}
