//! Hugging Face compatible checkpoint files: safetensors (memory-mapped, sharded or not), PyTorch
//! DCP per-rank shard files and their consolidation, host tensors and weight lookup by name. Knows no model: building models from these files, and
//! writing them back, is `model_io`'s.

pub mod dcp;
pub mod error;
pub mod host;
pub mod mxfp4;
pub mod safetensors_io;
pub mod weights;

pub use error::CheckpointError;
pub use host::HostTensor;
pub use safetensors_io::StorageDtype;
pub use weights::Weights;
