//! The decoder-only transformer and its configuration. One model for every family; family
//! differences are fields of `ModelArgs`.

pub mod adapters;
pub mod args;
pub mod build;
pub mod cache;
pub mod decoder;
pub mod family;
pub mod host_rows;
pub mod mask;
pub mod mlp;
pub mod moe;
mod moe_args;
pub mod multimodal;
pub mod param_source;
pub mod params;
pub mod qwen2_vl_vision;
pub mod rope;
pub mod shards;
pub mod text_tower;

use std::path::PathBuf;

pub use args::{Family, ModelArgs};
pub use build::{BaseWeights, ParamSource, RandomInit, build, build_with};
pub use cache::KvCache;
pub use decoder::{CausalLm, TokenBatch};
pub use params::{NamedParam, Trainable, TrainableParam};

use crate::checkpoint::CheckpointError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    BadConfig { path: PathBuf, message: String },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}
