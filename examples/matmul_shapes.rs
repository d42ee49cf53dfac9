//! Times the SmolLM2-135M linear shapes on Flex: `x @ w^T` with `w` in HF `[out, in]` layout
//! (a strided transpose) against a contiguous `[in, out]` copy. Profiling aid for BENCHMARKS.md.
//! Uses the allocator setup `tune` trains with: without it every fresh output buffer is faulted
//! in and zeroed by the kernel, which understates the matmul by up to 1.5x.
use std::time::Instant;

use burn::backend::Flex;
use burn::tensor::{Distribution, Tensor};

fn time<F: FnMut() -> Tensor<Flex, 2>>(mut f: F) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let y = f();
        let _ = y.into_data();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    tune::training::memory::enter_training_steady_state();
    let rows: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(128);
    let dev = Default::default();
    for (name, i, o) in [
        ("q_proj", 576, 576),
        ("k_proj", 576, 192),
        ("gate_proj", 576, 1536),
        ("down_proj", 1536, 576),
        ("lm_head", 576, 49152),
    ] {
        let x = Tensor::<Flex, 2>::random([rows, i], Distribution::Default, &dev);
        let w = Tensor::<Flex, 2>::random([o, i], Distribution::Default, &dev);
        let wt = w.clone().transpose().into_data();
        let wt = Tensor::<Flex, 2>::from_data(wt, &dev);
        let flops = 2.0 * (rows * i * o) as f64;
        let a = time(|| x.clone().matmul(w.clone().transpose()));
        let b = time(|| x.clone().matmul(wt.clone()));
        // Backward of x: dy @ w
        let dy = Tensor::<Flex, 2>::random([rows, o], Distribution::Default, &dev);
        let c = time(|| dy.clone().matmul(w.clone()));
        println!(
            "{name:10} [{rows}x{i}]x[{i}x{o}]  x@w^T {:7.2} ms {:6.1} GF/s | contiguous {:7.2} ms {:6.1} GF/s | dy@w {:7.2} ms {:6.1} GF/s",
            a * 1e3,
            flops / a / 1e9,
            b * 1e3,
            flops / b / 1e9,
            c * 1e3,
            flops / c / 1e9
        );
    }
}
