//! Epoch ordering and batching of sample indices.
//!
//! Epoch `e` is shuffled with `StdRng::seed_from_u64(seed + e)` (rand 0.9's StdRng; the
//! permutation differs from torch's `DistributedSampler`, which seeds `seed + epoch` the same way).
//! `drop_last` defaults to true, as torchtune's recipes build their `DataLoader`s. An epoch's
//! batches are plain index lists, so resuming at batch `k` of epoch `e` is
//! `batches_for_epoch(e)[k..]`, with no data replayed.
use super::error::{DataError, Result};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

/// How samples are ordered and grouped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoaderConfig {
    pub batch_size: usize,
    pub shuffle: bool,
    pub seed: u64,
    /// Drop the last incomplete batch (torchtune: true).
    pub drop_last: bool,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        LoaderConfig {
            batch_size: 1,
            shuffle: true,
            seed: 0,
            drop_last: true,
        }
    }
}

/// Yields the sample indices of each batch of each epoch.
#[derive(Debug, Clone)]
pub struct DataLoader {
    num_samples: usize,
    config: LoaderConfig,
}

impl DataLoader {
    pub fn new(num_samples: usize, config: LoaderConfig) -> Result<Self> {
        if config.batch_size == 0 {
            return Err(DataError::Spec {
                message: "batch_size must be at least 1".into(),
            });
        }
        Ok(DataLoader {
            num_samples,
            config,
        })
    }

    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }

    pub fn num_samples(&self) -> usize {
        self.num_samples
    }

    /// Batches per epoch.
    pub fn num_batches(&self) -> usize {
        let b = self.config.batch_size;
        if self.config.drop_last {
            self.num_samples / b
        } else {
            self.num_samples.div_ceil(b)
        }
    }

    /// The order of all sample indices in `epoch`.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.num_samples).collect();
        if self.config.shuffle {
            let mut rng = StdRng::seed_from_u64(self.config.seed.wrapping_add(epoch));
            order.shuffle(&mut rng);
        }
        order
    }

    /// The sample indices of every batch of `epoch`, in order.
    pub fn batches_for_epoch(&self, epoch: u64) -> Vec<Vec<usize>> {
        let n = self.num_batches();
        self.epoch_order(epoch)
            .chunks(self.config.batch_size)
            .take(n)
            .map(<[usize]>::to_vec)
            .collect()
    }
}
