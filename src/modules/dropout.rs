//! Dropout masks drawn from a stream of the calling thread's own.
//!
//! burn's backends keep one random generator per process (`Backend::seed` fills it, the next
//! random op takes it). The workers of a node are threads of one process, so seeding it per
//! rank and drawing from it later raced: a rank could draw from another rank's seed, which
//! made runs irreproducible and, with activation checkpointing, made the recomputed layer
//! draw other masks than its forward pass (a wrong gradient).
//!
//! Invariants: each thread's masks depend only on the seed it last gave [`seed_thread`] and
//! the draws it made since; the backend's generator is seeded and drawn from under one lock,
//! so no other thread's draw (through this module) can come between.

use std::cell::RefCell;
use std::sync::Mutex;

use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

thread_local! {
    static STREAM: RefCell<Option<StdRng>> = const { RefCell::new(None) };
}

/// Held from seeding the backend's generator to the draw that consumes it.
static BACKEND_DRAW: Mutex<()> = Mutex::new(());

/// Starts this thread's mask stream at `seed` (the trainer per step and rank; activation
/// checkpointing per layer, so that a recomputation draws what the forward pass drew).
pub fn seed_thread(seed: u64) {
    STREAM.with(|stream| *stream.borrow_mut() = Some(StdRng::seed_from_u64(seed)));
}

/// A `{0, 1}` mask shaped like `x`, each element 1 with probability `keep`.
pub fn keep_mask<B: Backend, const D: usize>(x: &Tensor<B, D>, keep: f64) -> Tensor<B, D> {
    // A thread never seeded (inference, tests) draws from entropy, as burn would.
    let seed = STREAM.with(|stream| {
        stream
            .borrow_mut()
            .get_or_insert_with(|| StdRng::seed_from_u64(rand::random()))
            .random::<u64>()
    });
    // The lock only orders the seed before its draw; a poisoned lock guards nothing broken.
    let _draw = BACKEND_DRAW
        .lock()
        .unwrap_or_else(|poison| poison.into_inner());
    B::seed(&x.device(), seed);
    x.random_like(Distribution::Bernoulli(keep))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_flex::Flex;

    fn masks(seed: u64, draws: usize) -> Vec<Vec<f32>> {
        seed_thread(seed);
        let x = Tensor::<Flex, 2>::ones([8, 64], &Default::default());
        (0..draws)
            .map(|_| keep_mask(&x, 0.5).into_data().to_vec::<f32>().unwrap())
            .collect()
    }

    #[test]
    fn threads_drawing_at_once_draw_what_each_draws_alone() {
        let alone: Vec<_> = (0..4u64).map(|seed| masks(seed, 50)).collect();
        let together: Vec<_> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4u64)
                .map(|seed| scope.spawn(move || masks(seed, 50)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(alone, together);
        assert_ne!(alone[0], alone[1], "different seeds draw different masks");
    }

    #[test]
    fn reseeding_replays_the_same_masks() {
        assert_eq!(masks(9, 3), masks(9, 3));
        let kept: f32 = masks(9, 1)[0].iter().sum();
        assert!(
            (150.0..360.0).contains(&kept),
            "about half of 512 kept: {kept}"
        );
    }
}
