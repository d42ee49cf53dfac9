//! Dataset files from the Hub, for recipes whose dataset `source` is a Hub repo.

use std::path::{Path, PathBuf};

use crate::hub::download::{DownloadOptions, download_with_env};
use crate::hub::env::HubEnv;
use crate::hub::error::HubError;
use crate::hub::repo::RepoType;

/// Data files looked for when the recipe names none.
pub const DEFAULT_DATA_PATTERNS: &[&str] = &["*.jsonl", "*.json", "*.parquet", "*.csv"];

/// Metadata files that match the data patterns but are not data.
const METADATA_FILES: &[&str] = &[
    "dataset_info*.json",
    "dataset_infos.json",
    "*/dataset_info*.json",
    ".*",
];

/// Connection settings for [`fetch_dataset_files`]; `None` falls back to the environment.
#[derive(Debug, Clone, Default)]
pub struct DatasetFetchOptions {
    pub token: Option<String>,
    pub endpoint: Option<String>,
    pub cache_dir: Option<PathBuf>,
    pub offline: Option<bool>,
    pub progress: bool,
}

/// Fetches the data files of a dataset repo into the cache and returns their
/// paths, sorted. `data_files` (globs or exact repo paths, as in a recipe's
/// `data_files`) select the files; when empty, every json/jsonl/parquet/csv
/// file of the repo is taken.
pub fn fetch_dataset_files(
    repo_id: &str,
    revision: Option<&str>,
    data_files: &[String],
    opts: &DatasetFetchOptions,
) -> Result<Vec<PathBuf>, HubError> {
    fetch_dataset_files_with_env(repo_id, revision, data_files, opts, &HubEnv::from_process())
}

/// [`fetch_dataset_files`] with explicit environment settings.
pub fn fetch_dataset_files_with_env(
    repo_id: &str,
    revision: Option<&str>,
    data_files: &[String],
    opts: &DatasetFetchOptions,
    env: &HubEnv,
) -> Result<Vec<PathBuf>, HubError> {
    let (allow, ignore): (Vec<String>, Vec<String>) = if data_files.is_empty() {
        (
            DEFAULT_DATA_PATTERNS
                .iter()
                .map(|p| p.to_string())
                .collect(),
            METADATA_FILES.iter().map(|p| p.to_string()).collect(),
        )
    } else {
        (data_files.to_vec(), Vec::new())
    };
    let report = download_with_env(
        DownloadOptions {
            repo_id: repo_id.to_string(),
            repo_type: RepoType::Dataset,
            revision: revision.map(str::to_string),
            allow_patterns: allow.clone(),
            ignore_patterns: ignore,
            token: opts.token.clone(),
            endpoint: opts.endpoint.clone(),
            cache_dir: opts.cache_dir.clone(),
            offline: opts.offline,
            progress: opts.progress,
            output_dir: None,
        },
        env,
    )?;
    if report.files.is_empty() {
        return Err(HubError::NoDataFiles {
            repo: repo_id.to_string(),
            patterns: allow,
        });
    }
    Ok(report.paths())
}

/// True when a recipe's dataset `source` names a Hub repo rather than a local
/// path or a builder such as `json`/`parquet`/`csv`/`text`.
pub fn is_hub_source(source: &str) -> bool {
    let builders = ["json", "parquet", "csv", "text", "arrow"];
    !builders.contains(&source)
        && !Path::new(source).exists()
        && crate::hub::repo::validate_repo_id(source).is_ok()
        && source.contains('/')
}
