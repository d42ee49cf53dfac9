//! Epoch ordering and batching of sample indices.
//!
//! Epoch `e` is shuffled exactly as torch's `DistributedSampler` shuffles it:
//! `torch.randperm(n, generator=torch.Generator().manual_seed(seed + e))`, a Fisher-Yates pass
//! over MT19937's 32-bit draws (rand_mt's `Mt`, the same generator torch's CPU generator is).
//! torchtune's recipes pass the sampler `seed=0` whatever the config's `seed`, so setup does
//! too, and a run visits the samples in torchtune's order (tests/fixtures/torchtune_tokens/
//! sample_order.json).
//! `drop_last` defaults to true, as torchtune's recipes build their `DataLoader`s. An epoch's
//! batches are plain index lists, so resuming at batch `k` of epoch `e` is
//! `batches_for_epoch(e)[k..]`, with no data replayed.
//!
//! With several data-parallel ranks the epoch order is split as torch's `DistributedSampler`
//! splits it (torchtune's distributed recipes use it with its default `drop_last=False`): the
//! order is padded by repeating its start to a multiple of the world size, and rank `r` takes
//! every W-th index from `r`; each rank then batches its share. Batch `k` of all ranks together
//! holds exactly the samples of batch `k` of one device with a W times larger batch size.
use super::error::{DataError, Result};

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
        self.num_batches_per_rank(1)
    }

    /// Batches per epoch of each of `world` ranks.
    pub fn num_batches_per_rank(&self, world: usize) -> usize {
        let b = self.config.batch_size;
        let share = self.num_samples.div_ceil(world.max(1));
        if self.config.drop_last {
            share / b
        } else {
            share.div_ceil(b)
        }
    }

    /// The order of all sample indices in `epoch`.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        if self.config.shuffle {
            torch_randperm(self.num_samples, self.config.seed.wrapping_add(epoch))
        } else {
            (0..self.num_samples).collect()
        }
    }

    /// The sample indices of every batch of `epoch`, in order.
    pub fn batches_for_epoch(&self, epoch: u64) -> Vec<Vec<usize>> {
        self.rank_batches(epoch, 0, 1)
    }

    /// The sample indices of every batch of `epoch` that rank `rank` of `world` trains on.
    pub fn rank_batches(&self, epoch: u64, rank: usize, world: usize) -> Vec<Vec<usize>> {
        let world = world.max(1);
        let n = self.num_batches_per_rank(world);
        let order = self.epoch_order(epoch);
        let share: Vec<usize> = if world == 1 {
            order
        } else {
            let total = self.num_samples.div_ceil(world) * world;
            (rank..total)
                .step_by(world)
                .filter_map(|i| order.get(i % order.len().max(1)).copied())
                .collect()
        };
        share
            .chunks(self.config.batch_size)
            .take(n)
            .map(<[usize]>::to_vec)
            .collect()
    }
}

/// `torch.randperm(n, generator=torch.Generator().manual_seed(seed))` on the CPU: torch's
/// generator is MT19937 seeded with the seed's low 32 bits, and randperm swaps each position
/// `i` with `i + draw % (n - i)`. (torch switches to 64-bit draws past 2^32 / 20 samples, far
/// beyond a fine-tuning set.)
pub fn torch_randperm(n: usize, seed: u64) -> Vec<usize> {
    let mut mt = rand_mt::Mt::new(seed as u32);
    let mut order: Vec<usize> = (0..n).collect();
    for i in 0..n.saturating_sub(1) {
        let z = (u64::from(mt.next_u32()) % (n - i) as u64) as usize;
        order.swap(i, i + z);
    }
    order
}

/// One rank's batches of the epoch being run, drawn from the loader once per epoch (its order
/// is a function of the epoch): what a recipe's steps index into.
#[derive(Debug, Clone, Default)]
pub struct EpochBatches {
    drawn: Option<(usize, Vec<Vec<usize>>)>,
}

impl EpochBatches {
    /// The sample indices of batch `index` of `epoch` for rank `rank` of `world` (empty past
    /// the epoch's last batch).
    pub fn batch(
        &mut self,
        loader: &DataLoader,
        epoch: usize,
        index: usize,
        rank: usize,
        world: usize,
    ) -> &[usize] {
        self.batches(loader, epoch, rank, world)
            .get(index)
            .map_or(&[], Vec::as_slice)
    }

    /// Every batch of `epoch` for rank `rank` of `world`.
    pub fn batches(
        &mut self,
        loader: &DataLoader,
        epoch: usize,
        rank: usize,
        world: usize,
    ) -> &[Vec<usize>] {
        if self.drawn.as_ref().is_none_or(|(e, _)| *e != epoch) {
            self.drawn = Some((epoch, loader.rank_batches(epoch as u64, rank, world)));
        }
        self.drawn.as_ref().map_or(&[], |(_, b)| b.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn randperm_is_torchs() {
        // torch.randperm(10, generator=torch.Generator().manual_seed(0)).tolist()
        assert_eq!(torch_randperm(10, 0), [4, 1, 7, 5, 3, 9, 0, 8, 6, 2]);
    }

    fn loader(n: usize, batch_size: usize) -> DataLoader {
        DataLoader::new(
            n,
            LoaderConfig {
                batch_size,
                shuffle: true,
                seed: 7,
                drop_last: true,
            },
        )
        .unwrap()
    }

    #[test]
    fn ranks_together_hold_the_single_device_batch_of_world_times_the_size() {
        let one = loader(40, 6);
        let ranks = loader(40, 3);
        for epoch in 0..3 {
            let single = one.batches_for_epoch(epoch);
            let r0 = ranks.rank_batches(epoch, 0, 2);
            let r1 = ranks.rank_batches(epoch, 1, 2);
            for (k, batch) in single.iter().enumerate() {
                let mut joined: Vec<usize> = r0[k].iter().chain(&r1[k]).copied().collect();
                let mut want = batch.clone();
                joined.sort_unstable();
                want.sort_unstable();
                assert_eq!(joined, want, "epoch {epoch} batch {k}");
            }
        }
    }

    #[test]
    fn uneven_data_is_padded_from_the_start_like_distributed_sampler() {
        // torch: DistributedSampler(range(5), num_replicas=2, rank=r, shuffle=False)
        // yields [0, 2, 4] and [1, 3, 0].
        let l = DataLoader::new(
            5,
            LoaderConfig {
                batch_size: 1,
                shuffle: false,
                seed: 0,
                drop_last: true,
            },
        )
        .unwrap();
        let flat = |r| l.rank_batches(0, r, 2).concat();
        assert_eq!(flat(0), [0, 2, 4]);
        assert_eq!(flat(1), [1, 3, 0]);
        assert_eq!(l.num_batches_per_rank(2), 3);
        assert_eq!(l.rank_batches(0, 0, 1), l.batches_for_epoch(0));
    }
}
