//! fp32 products of many rows against a frozen NF4 weight: the whole weight dequantized then
//! one gemm (what tune does past 64 rows) against blocks of its rows decoded into cache and
//! multiplied block by block, for the forward's `x @ W^T` (output column blocks) and the
//! backward's `g @ W` (K blocks accumulated, or output column blocks). Best of five each.
//! Profiling aid for BENCHMARKS.md ("fp32 QLoRA experts decoded in the product").
//!
//! `cargo run --release --example nf4_products -- ROWS OUT IN [BLOCK_KB...]`
use std::time::Instant;

use rayon::prelude::*;
use tune::modules::frozen_nf4::{FrozenNf4, RowOrder};
use tune::modules::nf4::Nf4Dtype;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn best<F: FnMut() -> Vec<f32>>(mut f: F) -> (f64, Vec<f32>) {
    let mut best = f64::MAX;
    let mut out = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        out = f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    (best, out)
}

/// y[m, n] (row stride rs) = a[m,k] (strides ars, acs) @ b[k,n] (strides brs, bcs)
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_into(
    y: *mut f32,
    rs: usize,
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    ars: usize,
    acs: usize,
    b: *const f32,
    brs: usize,
    bcs: usize,
    acc: bool,
) {
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            y,
            1,
            rs as isize,
            acc,
            a,
            acs as isize,
            ars as isize,
            b,
            bcs as isize,
            brs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        )
    }
}

fn main() {
    tune::training::memory::enter_training_steady_state();
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse().unwrap())
        .collect();
    let (m, out, inp) = (args[0], args[1], args[2]);
    let kb: Vec<usize> = args[3..].to_vec();
    let w: Vec<f32> = (0..out * inp)
        .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 0.1)
        .collect();
    let q = FrozenNf4::quantize(
        &w,
        [out, inp],
        Nf4Dtype::Bf16,
        Nf4Dtype::F32,
        RowOrder::Stored,
    )
    .unwrap();
    let scales = q.nf4.block_scales_in(Nf4Dtype::F32);
    let x: Vec<f32> = (0..m * inp).map(|i| (i % 97) as f32 / 97.0 - 0.5).collect();
    let g: Vec<f32> = (0..m * out).map(|i| (i % 89) as f32 / 89.0 - 0.5).collect();
    let decode = |row: usize, vals: &mut [f32], c0: usize| {
        q.nf4
            .dequantize_into(&scales, Nf4Dtype::F32, row * inp + c0, vals)
    };

    let (t, _) = best(|| q.dequantize());
    println!(
        "dequantize [{out},{inp}] {:.2} ms ({:.1} GB/s written)",
        t * 1e3,
        (out * inp * 4) as f64 / t / 1e9
    );
    let (t, _) = best(|| {
        let mut v = vec![0.0f32; out * inp];
        v.par_chunks_mut(inp)
            .enumerate()
            .for_each(|(r, d)| decode(r, d, 0));
        v
    });
    println!("decode straight into a zeroed vec {:.2} ms", t * 1e3);
    let (t, _) = best(|| {
        (0..out)
            .into_par_iter()
            .for_each_init(|| vec![0.0f32; inp], |buf, r| decode(r, buf, 0));
        Vec::new()
    });
    println!("decode into one cached row {:.2} ms", t * 1e3);
    // Forward x @ W^T.
    let (t_whole, y0) = best(|| {
        let wd = q.dequantize();
        let mut y = vec![0.0f32; m * out];
        unsafe {
            gemm_into(
                y.as_mut_ptr(),
                out,
                m,
                out,
                inp,
                x.as_ptr(),
                inp,
                1,
                wd.as_ptr(),
                1,
                inp,
                false,
            )
        };
        y
    });
    println!("fwd  m={m} [{out},{inp}] whole {:.2} ms", t_whole * 1e3);
    for &kbytes in &kb {
        let br = (kbytes * 1024 / 4 / inp).clamp(1, out);
        let (t, y) = best(|| {
            let mut y = vec![0.0f32; m * out];
            let mut buf = vec![0.0f32; br * inp];
            for first in (0..out).step_by(br) {
                let c = br.min(out - first);
                buf[..c * inp]
                    .par_chunks_mut(inp)
                    .enumerate()
                    .for_each(|(i, v)| decode(first + i, v, 0));
                unsafe {
                    gemm_into(
                        y.as_mut_ptr().add(first),
                        out,
                        m,
                        c,
                        inp,
                        x.as_ptr(),
                        inp,
                        1,
                        buf.as_ptr(),
                        1,
                        inp,
                        false,
                    )
                };
            }
            y
        });
        let err = y
            .iter()
            .zip(&y0)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        println!(
            "fwd  rows-blocks {kbytes} KB ({br} rows): {:.2} ms  maxdiff {err:e}",
            t * 1e3
        );
    }

    // Backward g @ W.
    let (t_whole, y0) = best(|| {
        let wd = q.dequantize();
        let mut y = vec![0.0f32; m * inp];
        unsafe {
            gemm_into(
                y.as_mut_ptr(),
                inp,
                m,
                inp,
                out,
                g.as_ptr(),
                out,
                1,
                wd.as_ptr(),
                inp,
                1,
                false,
            )
        };
        y
    });
    println!("bwd  m={m} whole {:.2} ms", t_whole * 1e3);
    for &kbytes in &kb {
        let br = (kbytes * 1024 / 4 / inp).clamp(1, out);
        let (t, y) = best(|| {
            let mut y = vec![0.0f32; m * inp];
            let mut buf = vec![0.0f32; br * inp];
            for first in (0..out).step_by(br) {
                let c = br.min(out - first);
                buf[..c * inp]
                    .par_chunks_mut(inp)
                    .enumerate()
                    .for_each(|(i, v)| decode(first + i, v, 0));
                unsafe {
                    gemm_into(
                        y.as_mut_ptr(),
                        inp,
                        m,
                        inp,
                        c,
                        g.as_ptr().add(first),
                        out,
                        1,
                        buf.as_ptr(),
                        inp,
                        1,
                        true,
                    )
                };
            }
            y
        });
        let err = y
            .iter()
            .zip(&y0)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        println!(
            "bwd  k-blocks {kbytes} KB ({br} rows): {:.2} ms  maxdiff {err:e}",
            t * 1e3
        );
        // Column blocks: W[:, c0..c0+cw] for every row.
        let cw = ((kbytes * 1024 / 4 / out) / 64 * 64).clamp(64, inp);
        let (t, y) = best(|| {
            let mut y = vec![0.0f32; m * inp];
            let mut buf = vec![0.0f32; out * cw];
            for c0 in (0..inp).step_by(cw) {
                let c = cw.min(inp - c0);
                buf[..out * c]
                    .par_chunks_mut(c)
                    .enumerate()
                    .for_each(|(r, v)| decode(r, v, c0));
                unsafe {
                    gemm_into(
                        y.as_mut_ptr().add(c0),
                        inp,
                        m,
                        c,
                        out,
                        g.as_ptr(),
                        out,
                        1,
                        buf.as_ptr(),
                        c,
                        1,
                        false,
                    )
                };
            }
            y
        });
        let err = y
            .iter()
            .zip(&y0)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        println!(
            "bwd  col-blocks {kbytes} KB ({cw} cols): {:.2} ms  maxdiff {err:e}",
            t * 1e3
        );
    }
}
