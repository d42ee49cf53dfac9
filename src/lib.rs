//! tune: LLM fine-tuning recipes (full, LoRA, DPO, QAT, knowledge distillation, generation)
//! on burn, reading and writing Hugging Face checkpoints.

pub mod bench;
pub mod checkpoint;
pub mod checkpoint_client;
pub mod cli;
pub mod config;
pub mod data;
pub mod device;
pub mod distributed;
pub mod generation;
pub mod hub;
pub mod interrupt;
pub mod kernels;
pub mod model_io;
pub mod models;
pub mod modules;
pub mod out_of_memory;
pub mod plot;
pub mod precision;
pub mod rewards;
pub mod setup;
pub mod tokenizer;
pub mod training;
pub mod verbosity;
pub mod vision;

/// The recipes: one file each (`recipes/`), and their registry.
#[path = "../recipes/mod.rs"]
pub mod recipes;
