//! Models in and out of Hugging Face checkpoints: model directories (`config.json` +
//! safetensors shards), PEFT adapters and tune's int4 export. This is the layer above both
//! `checkpoint` (file formats: safetensors, host tensors, weight lookup) and `models` (the
//! decoder), which therefore never import each other.

pub mod hf;
pub mod peft;
pub mod peft_experts;
pub mod quantized;
pub mod source;
