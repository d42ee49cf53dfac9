//! Hugging Face Hub integration: download models/datasets into the standard
//! Hugging Face cache, and push adapters/checkpoints with a model card.
//!
//! All network calls are blocking (ureq, the client hf-hub 0.4 uses); call them
//! from `tokio::task::spawn_blocking` when inside an async runtime.

pub mod api;
pub mod cache;
pub mod commit;
pub mod create;
pub mod datasets;
pub mod download;
pub mod env;
pub mod error;
pub mod fetch;
pub mod http;
pub mod lfs;
pub mod model_card;
pub mod patterns;
pub mod progress;
pub mod provenance;
pub mod push;
pub mod repo;
pub mod upload_info;
pub mod validate;

#[cfg(test)]
mod tests;

pub use datasets::{DatasetFetchOptions, fetch_dataset_files};
pub use download::{DownloadOptions, DownloadReport, download};
pub use env::HubEnv;
pub use error::HubError;
pub use model_card::{ModelCardInfo, render as render_model_card};
pub use push::{PushOptions, PushReport, PushedFile, TRAINING_STATE, plan as plan_push, push};
pub use repo::RepoType;
