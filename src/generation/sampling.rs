//! Choosing the next token from the last position's logits: greedy at temperature 0, else
//! temperature, top-k and top-p (nucleus) filtering and a draw from a seeded host RNG. The
//! draw happens on the host so a seed gives the same text on every backend.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::GenerateError;
use crate::kernels::simd::{self, multiversion};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 selects greedy decoding.
    pub temperature: f64,
    /// Keep only the k most likely tokens (`None` or 0: all).
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches p (`None`: all).
    pub top_p: Option<f64>,
}

impl SamplingParams {
    pub const GREEDY: Self = Self {
        temperature: 0.0,
        top_k: None,
        top_p: None,
    };

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    pub fn validate(&self) -> Result<(), GenerateError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(GenerateError::BadSampling(format!(
                "temperature must be 0 (greedy) or positive, got {}",
                self.temperature
            )));
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(GenerateError::BadSampling(format!(
                "top_p must be in (0, 1], got {p}"
            )));
        }
        Ok(())
    }
}

/// Picks tokens; owns the RNG so a whole generation is one reproducible stream.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams, seed: u64) -> Result<Self, GenerateError> {
        params.validate()?;
        Ok(Self {
            params,
            rng: StdRng::seed_from_u64(seed),
        })
    }

    pub fn params(&self) -> SamplingParams {
        self.params
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        draw_filtered(logits, &self.params, self.rng.random::<f64>())
    }
}

/// The first index of the largest logit (as `torch.argmax`); NaNs never win.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// The inverse-CDF draw at `u` (in [0, 1)) from the distribution after temperature, top-k and
/// top-p, walking the tokens in order of decreasing probability (ties by token id): what
/// [`draw`] over [`filtered_probs`] gives, up to the order of the floating-point sums.
///
/// Why not sort the vocabulary: the walk almost always ends within the first few tokens, so
/// they are ranked a block at a time ([`Ranked`]) and the rest never are. A full sort of
/// SmolLM2's 49 152 tokens for each of GRPO's 16 rows per token, on one core while the other
/// waited, was 23% of a rollout's samples: rollouts went from 76-86 to 105-129 tokens/s.
fn draw_filtered(logits: &[f32], params: &SamplingParams, u: f64) -> u32 {
    let mut ranked = Ranked::new(candidates(logits, params));
    let Some(&(_, max)) = ranked.get(0) else {
        return 0;
    };
    let weight = |l: f64| (l - max).exp();
    let total = mass(&ranked.items, max);
    // Top-p: the tokens kept are those whose mass before them is below p (the token that
    // crosses p stays, so at least one does); their mass renormalises the draw.
    let (kept, kept_mass) = match params.top_p.filter(|&p| p < 1.0) {
        Some(p) => {
            let (mut mass, mut kept) = (0.0, 0);
            while let Some(&(_, l)) = ranked.get(kept) {
                if kept > 0 && mass >= p {
                    break;
                }
                mass += weight(l) / total;
                kept += 1;
            }
            (kept, mass)
        }
        None => (ranked.items.len(), 1.0),
    };
    let mut acc = 0.0;
    let mut last = 0;
    for i in 0..kept {
        let Some(&(id, l)) = ranked.get(i) else { break };
        acc += weight(l) / total / kept_mass;
        last = id;
        if u < acc {
            return id;
        }
    }
    // Rounding left the sum a hair below one: the last kept token.
    last
}

multiversion! {
    /// `sum(e^(l - max))` over the candidates: each term in f32 ([`simd::exp`], within a few
    /// ulp), summed in f64 lanes. Why: libm's f64 `exp` for each of SmolLM2's 49 152 tokens
    /// per row and token was 4% of GRPO's rollouts; the terms' f32 rounding moves each
    /// token's probability by about 1e-7 of itself.
    fn mass(items: &[(u32, f64)], max: f64) -> f64 {
        const LANES: usize = 8;
        let mut lanes = [0.0f64; LANES];
        let chunks = items.chunks_exact(LANES);
        let tail = chunks.remainder();
        for chunk in chunks {
            for (lane, &(_, l)) in lanes.iter_mut().zip(chunk) {
                *lane += f64::from(simd::exp((l - max) as f32));
            }
        }
        let mut total: f64 = lanes.iter().sum();
        for &(_, l) in tail {
            total += f64::from(simd::exp((l - max) as f32));
        }
        total
    }
}

/// `(token, logit / temperature)` of the tokens top-k keeps (all without it), in token order.
///
/// With top-k (the generation configs' 300), only the k candidates (and tokens tied with the
/// k-th, as torchtune, which drops only `probs < pivot`) are ever copied out of the logits: the
/// k-th largest is found with a k-sized heap in one pass over the vocabulary.
fn candidates(logits: &[f32], params: &SamplingParams) -> Vec<(u32, f64)> {
    let t = params.temperature.max(f64::MIN_POSITIVE);
    let scaled = |l: f32| l as f64 / t;
    match params.top_k.filter(|&k| k > 0 && k < logits.len()) {
        Some(k) => {
            // Dividing by t > 0 keeps the order and the ties, so the candidates are found on
            // the raw logits and only they are scaled.
            let pivot = kth_largest(logits, k);
            logits
                .iter()
                .enumerate()
                .filter(|&(_, &l)| l >= pivot)
                .map(|(i, &l)| (i as u32, scaled(l)))
                .collect()
        }
        None => logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, scaled(l)))
            .collect(),
    }
}

/// Decreasing scaled logit, ties by token id: the order tokens are drawn in.
fn by_logit(a: &(u32, f64), b: &(u32, f64)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Candidates ranked on demand: the first `sorted` are the largest, in [`by_logit`] order.
struct Ranked {
    items: Vec<(u32, f64)>,
    sorted: usize,
}

impl Ranked {
    /// Tokens ranked per block: the first block holds nearly all of a trained model's mass.
    const FIRST_BLOCK: usize = 64;

    fn new(items: Vec<(u32, f64)>) -> Self {
        Self { items, sorted: 0 }
    }

    /// The `i`-th in [`by_logit`] order, ranking the next block (twice the last) when `i`
    /// is past the ranked ones.
    fn get(&mut self, i: usize) -> Option<&(u32, f64)> {
        if i >= self.sorted && i < self.items.len() {
            let end = (i + 1)
                .max(self.sorted * 2)
                .max(Self::FIRST_BLOCK)
                .min(self.items.len());
            let rest = &mut self.items[self.sorted..];
            let block = end - self.sorted;
            if block < rest.len() {
                rest.select_nth_unstable_by(block - 1, by_logit);
            }
            rest[..block].sort_by(by_logit);
            self.sorted = end;
        }
        self.items.get(i)
    }
}

/// Probabilities after temperature, top-k and top-p, as `(token, probability)` in order of
/// decreasing probability (ties by token id), renormalised to sum to one: the definition
/// [`draw_filtered`] is tested against.
#[cfg(test)]
fn filtered_probs(logits: &[f32], params: &SamplingParams) -> Vec<(u32, f64)> {
    let mut order = candidates(logits, params);
    order.sort_by(by_logit);
    let max = order.first().map_or(0.0, |(_, l)| *l);
    let mut probs: Vec<(u32, f64)> = order
        .into_iter()
        .map(|(i, l)| (i, (l - max).exp()))
        .collect();
    normalise(&mut probs);
    if let Some(p) = params.top_p.filter(|&p| p < 1.0) {
        // Keep tokens while the mass before them is below p: the token that crosses p stays,
        // so at least one token always survives.
        let mut mass = 0.0;
        let keep = probs
            .iter()
            .take_while(|(_, q)| {
                let before = mass;
                mass += q;
                before < p
            })
            .count();
        probs.truncate(keep.max(1));
        normalise(&mut probs);
    }
    probs
}

/// The `k`-th largest of `values` (`0 < k <= values.len()`) in the total order, from a min-heap
/// of the `k` largest seen so far.
fn kth_largest(values: &[f32], k: usize) -> f32 {
    #[derive(PartialEq)]
    struct Total(f32);
    impl Eq for Total {}
    impl PartialOrd for Total {
        fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(other))
        }
    }
    impl Ord for Total {
        fn cmp(&self, other: &Self) -> std::cmp::Ordering {
            self.0.total_cmp(&other.0)
        }
    }
    let (first, rest) = values.split_at(k.min(values.len()));
    let mut heap: BinaryHeap<Reverse<Total>> = first.iter().map(|&v| Reverse(Total(v))).collect();
    // The heap's smallest, cached: most values are below it and cost one comparison.
    let mut smallest = heap.peek().map_or(f32::NEG_INFINITY, |s| s.0.0);
    for &v in rest {
        if v.total_cmp(&smallest).is_gt() {
            if let Some(mut top) = heap.peek_mut() {
                *top = Reverse(Total(v));
            }
            smallest = heap.peek().map_or(f32::NEG_INFINITY, |s| s.0.0);
        }
    }
    smallest
}

#[cfg(test)]
fn normalise(probs: &mut [(u32, f64)]) {
    let sum: f64 = probs.iter().map(|(_, q)| q).sum();
    if sum > 0.0 {
        probs.iter_mut().for_each(|(_, q)| *q /= sum);
    }
}

/// Inverse-CDF draw with `u` in [0, 1).
#[cfg(test)]
fn draw(probs: &[(u32, f64)], u: f64) -> u32 {
    let mut acc = 0.0;
    for &(id, q) in probs {
        acc += q;
        if u < acc {
            return id;
        }
    }
    // Rounding left the sum a hair below one: the last kept token.
    probs.last().map_or(0, |(id, _)| *id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        let mut s = Sampler::new(SamplingParams::GREEDY, 0).unwrap();
        assert_eq!(s.sample(&[0.0, -2.0, 5.0]), 2);
    }

    #[test]
    fn top_k_keeps_k_tokens() {
        let p = SamplingParams {
            temperature: 1.0,
            top_k: Some(2),
            top_p: None,
        };
        let probs = filtered_probs(&[1.0, 4.0, 3.0, 2.0], &p);
        let ids: Vec<u32> = probs.iter().map(|(i, _)| *i).collect();
        assert_eq!(ids, vec![1, 2]);
        let sum: f64 = probs.iter().map(|(_, q)| q).sum();
        assert!((sum - 1.0).abs() < 1e-12);
    }

    /// The top-k selection keeps exactly what sorting the whole vocabulary and cutting after
    /// the k-th (ties included) keeps, in the same order.
    #[test]
    fn top_k_selection_equals_a_full_sort() {
        let mut state = 7u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as f32 / (1u64 << 31) as f32
        };
        for round in 0..50 {
            // Coarse values make ties common.
            let logits: Vec<f32> = (0..500).map(|_| (next() * 20.0).round() / 4.0).collect();
            for k in [1, 2, 10, 37, 300, 499] {
                let params = SamplingParams {
                    temperature: 0.7,
                    top_k: Some(k),
                    top_p: None,
                };
                let mut full: Vec<(u32, f64)> = logits
                    .iter()
                    .enumerate()
                    .map(|(i, &l)| (i as u32, l as f64 / 0.7))
                    .collect();
                full.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                let pivot = full[k - 1].1;
                let expected: Vec<u32> = full
                    .iter()
                    .take_while(|(_, l)| *l >= pivot)
                    .map(|(i, _)| *i)
                    .collect();
                let got: Vec<u32> = filtered_probs(&logits, &params)
                    .iter()
                    .map(|(i, _)| *i)
                    .collect();
                assert_eq!(got, expected, "round {round}, k {k}");
            }
        }
    }

    #[test]
    fn top_p_keeps_the_token_that_crosses_p() {
        // softmax of ln([0.5, 0.3, 0.2]) = [0.5, 0.3, 0.2]
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let p = SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: Some(0.6),
        };
        let ids: Vec<u32> = filtered_probs(&logits, &p)
            .iter()
            .map(|(i, _)| *i)
            .collect();
        assert_eq!(ids, vec![0, 1]);
        let p = SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: Some(0.1),
        };
        let ids: Vec<u32> = filtered_probs(&logits, &p)
            .iter()
            .map(|(i, _)| *i)
            .collect();
        assert_eq!(ids, vec![0]);
    }

    /// Drawing from the tokens ranked a block at a time gives the token the fully sorted,
    /// filtered distribution gives, for every setting, over vocabularies past several blocks.
    #[test]
    fn draws_equal_the_fully_sorted_distributions() {
        let mut state = 11u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut draws = 0;
        for round in 0..40 {
            let vocab = [3, 70, 500, 3000][round % 4];
            // Peaked logits (most mass in a few tokens, as a trained model's) and flat ones
            // (the walk goes past several blocks), with ties.
            let spread = if round % 2 == 0 { 12.0 } else { 0.5 };
            let logits: Vec<f32> = (0..vocab)
                .map(|_| ((next() * spread * 8.0).round() / 8.0) as f32)
                .collect();
            for (temperature, top_k, top_p) in [
                (1.0, None, None),
                (0.7, Some(40), None),
                (1.3, None, Some(0.9)),
                (0.6, Some(300), Some(0.5)),
                (1.0, None, Some(1e-9)),
            ] {
                let params = SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                };
                let probs = filtered_probs(&logits, &params);
                for _ in 0..50 {
                    let u = next();
                    let want = draw(&probs, u);
                    assert_eq!(
                        draw_filtered(&logits, &params, u),
                        want,
                        "round {round} vocab {vocab} {params:?} u {u}"
                    );
                    draws += 1;
                }
            }
        }
        assert_eq!(draws, 40 * 5 * 50);
    }

    #[test]
    fn same_seed_same_draws() {
        let p = SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: None,
        };
        let logits = [0.0f32; 50];
        let run = |seed| {
            let mut s = Sampler::new(p, seed).unwrap();
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn bad_parameters_are_rejected() {
        let e = SamplingParams {
            temperature: -1.0,
            top_k: None,
            top_p: None,
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("temperature"), "{e}");
        let e = SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: Some(1.5),
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("top_p"), "{e}");
    }
}
