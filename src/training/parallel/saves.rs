//! Who writes what of a run's checkpoints ([`Saves`]), decided once from the run's
//! parallelism, what a checkpoint holds and whether every rank sees the output directory: the
//! trainer's save path, rank 0's checkpoint layout ([`Saves::layout`]) and the other ranks'
//! writer ([`Saves::rank_writer`]) all come from this one value.

use std::path::PathBuf;

use burn::tensor::backend::AutodiffBackend;

use super::optimizer_shards::ShardWriter;
use super::sharded_checkpoint::RankShareWriter;
use crate::checkpoint::StorageDtype;
use crate::distributed::World;
use crate::training::checkpointing::{SaveLayout, ShardedRun};
use crate::training::error::TrainError;
use crate::training::save_hook::SaveHook;

/// Who writes a checkpoint's files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Saves {
    /// Rank 0 writes everything, gathered from the other ranks.
    Gathered,
    /// ZeRO-1 with a directory every rank sees: each rank writes its optimizer shard, rank 0
    /// the rest.
    OptimizerShards,
    /// FSDP with a directory every rank sees: each rank writes its rows of the model and of the
    /// optimizer state (`sharded_checkpoint`); `run` names the run's staging directories.
    RankShares { run: u64 },
}

/// What decides [`Saves`].
#[derive(Debug, Clone, Copy)]
pub struct SaveConditions {
    /// The weights are sharded (FSDP).
    pub fsdp: bool,
    /// The optimizer state is (ZeRO-1).
    pub zero1: bool,
    /// Every rank sees the output directory: the number rank 0 drew for the run (see
    /// `setup::session`), `None` when some rank does not, or on one worker.
    pub shared_dir: Option<u64>,
    /// The checkpoint is a whole model whose rows each rank can write as they are: not an
    /// adapter (its merged model needs whole base weights), not projections the checkpoint
    /// fuses across what shards apart (Phi-3's `qkv_proj`, gpt-oss's experts), not a
    /// multimodal checkpoint's language model (rank 0 copies the vision tower beside it), not
    /// with an int4 export (quantizing needs every weight whole).
    pub rows_are_the_checkpoint: bool,
}

impl Saves {
    pub fn decide(c: SaveConditions) -> Self {
        match c.shared_dir {
            Some(run) if c.fsdp && c.rows_are_the_checkpoint => Self::RankShares { run },
            Some(_) if c.zero1 && !c.fsdp => Self::OptimizerShards,
            _ => Self::Gathered,
        }
    }

    /// Rank 0's checkpoint layout on `world`.
    pub fn layout(self, world: &World) -> SaveLayout {
        SaveLayout {
            world_size: world.size,
            optimizer_shards: (self == Self::OptimizerShards).then_some(world.size),
            sharded: match self {
                Self::RankShares { run } => Some(ShardedRun {
                    id: run,
                    world: world.size,
                }),
                _ => None,
            },
            ..SaveLayout::default()
        }
    }

    /// What a rank other than 0 writes of each checkpoint into `dir` (`None` on rank 0, and
    /// when rank 0 writes everything).
    pub fn rank_writer(
        self,
        world: &World,
        dir: PathBuf,
        storage_dtype: StorageDtype,
        max_shard_bytes: usize,
    ) -> Option<RankWriter> {
        if world.is_main() {
            return None;
        }
        match self {
            Self::Gathered => None,
            Self::OptimizerShards => Some(RankWriter::Optimizer(ShardWriter::new(
                dir, world.rank, world.size,
            ))),
            Self::RankShares { run } => Some(RankWriter::Share(RankShareWriter::new(
                dir,
                run,
                world.rank,
                world.size,
                storage_dtype,
                max_shard_bytes,
            ))),
        }
    }
}

/// What a rank other than 0 writes of each checkpoint.
pub enum RankWriter {
    /// ZeRO-1: its optimizer shard.
    Optimizer(ShardWriter),
    /// FSDP: its rows of the model and its optimizer state.
    Share(RankShareWriter),
}

impl RankWriter {
    pub fn hook<B: AutodiffBackend>(&mut self) -> &mut dyn SaveHook<B> {
        match self {
            Self::Optimizer(w) => w,
            Self::Share(w) => w,
        }
    }

    /// Waits for its last file to be durable.
    pub fn finish(&mut self) -> Result<(), TrainError> {
        match self {
            Self::Optimizer(w) => w.finish(),
            Self::Share(w) => w.finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{SaveConditions, Saves};

    #[test]
    fn every_rank_writes_its_own_files_only_where_all_see_the_directory_and_the_rows_are_the_checkpoint()
     {
        let c = |fsdp, zero1, shared: Option<u64>, rows| {
            Saves::decide(SaveConditions {
                fsdp,
                zero1,
                shared_dir: shared,
                rows_are_the_checkpoint: rows,
            })
        };
        assert_eq!(c(true, false, Some(7), true), Saves::RankShares { run: 7 });
        // LoRA, fused projections, a tower, an int4 export: gathered for rank 0.
        assert_eq!(c(true, false, Some(7), false), Saves::Gathered);
        assert_eq!(c(false, true, Some(7), true), Saves::OptimizerShards);
        // No directory every rank sees: rank 0 gathers.
        assert_eq!(c(true, false, None, true), Saves::Gathered);
        assert_eq!(c(false, true, None, true), Saves::Gathered);
        assert_eq!(c(false, false, Some(7), true), Saves::Gathered);
    }
}
