//! Hugging Face compatible checkpoint I/O: safetensors (sharded or not), model directories,
//! PEFT adapters. Used alike by models, teachers, references and adapters.

pub mod error;
pub mod hf;
pub mod host;
pub mod peft;
pub mod quantized;
pub mod safetensors_io;
pub mod weights;

pub use error::CheckpointError;
pub use host::HostTensor;
pub use safetensors_io::StorageDtype;
pub use weights::Weights;
