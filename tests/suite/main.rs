//! The integration tests, compiled as one test binary: each file here is a module, so cargo
//! links one executable instead of one per file (each link of burn's generic code is large).

mod activation_checkpointing;
mod bench_cli;
mod checkpoint_errors;
mod checkpoint_families;
mod chunked_loss;
mod config_builtin_configs;
mod config_keys;
mod config_torchtune_fixture;
mod config_validation;
mod data;
mod dcp;
mod distributed;
mod dora;
mod dpo;
mod dpo_recipes;
mod fuzz;
mod generate;
mod generate_cli;
#[cfg(feature = "wgpu")]
mod gpu;
mod grpo_recipes;
mod hub_roundtrip;
mod kd;
mod kd_recipes;
mod kernels;
mod lora;
mod lora_recipes;
mod models;
mod moe;
mod nf4;
mod offload;
mod plot;
mod ppo;
mod precision;
mod qat;
mod qat_recipes;
mod qlora;
mod qlora_recipes;
mod resume;
mod support;
mod tokenizer;
mod torchtune_tokens;
mod trainer;
mod unpad;
mod validation;
