//! Hugging Face Hub integration: download models/datasets into the standard
//! Hugging Face cache, and push adapters/checkpoints with a model card.
//!
//! Every network call goes through hf-hub 1.0's blocking client ([`client`]); what is ours is
//! the model card, the checks before a push, what a push uploads, provenance, progress bars
//! and errors that say what to do.

pub mod client;
pub mod datasets;
pub mod download;
pub mod env;
pub mod error;
pub mod model_card;
pub mod patterns;
pub mod progress;
pub mod provenance;
pub mod push;
pub mod repo;
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
