//! Hugging Face model directories: load `config.json` + safetensors into a `CausalLm`, and
//! save a model so `AutoModelForCausalLM.from_pretrained(dir)` loads it unchanged.

use std::path::Path;

use burn::tensor::backend::Backend;

use crate::checkpoint::error::CheckpointError;
use crate::checkpoint::safetensors_io::{StorageDtype, save_sharded};
use crate::checkpoint::weights::Weights;
use crate::models::build::{RowsOf, build_rows, ignorable_tensor};
use crate::models::{BaseWeights, CausalLm, ModelArgs, ModelError, build_with};

/// Files copied next to saved weights so the output directory is a complete model.
pub const COMPANION_FILES: &[&str] = &[
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
];

/// Default shard size, as transformers' `max_shard_size="5GB"`.
pub const DEFAULT_MAX_SHARD_BYTES: usize = 5_000_000_000;

pub struct LoadedModel<B: Backend> {
    pub model: CausalLm<B>,
    pub storage_dtype: StorageDtype,
}

pub fn load_args(dir: &Path) -> Result<ModelArgs, ModelError> {
    let config = dir.join("config.json");
    if !config.is_file() {
        return Err(ModelError::BadConfig {
            path: config,
            message: "missing: a Hugging Face checkpoint directory needs its config.json".into(),
        });
    }
    ModelArgs::from_file(&config)
}

/// Loads a model; `files` overrides the safetensors files to read (torchtune's
/// `checkpoint_files`), otherwise the index or `model.safetensors` decides.
pub fn load_model<B: Backend>(
    dir: &Path,
    files: Option<&[String]>,
    device: &B::Device,
) -> Result<LoadedModel<B>, ModelError> {
    load_model_with(dir, files, device, BaseWeights::Float)
}

/// [`load_model`] with the decoder's linear base weights stored as `base` says (NF4 for
/// QLoRA, quantized tensor by tensor as they are read).
pub fn load_model_with<B: Backend>(
    dir: &Path,
    files: Option<&[String]>,
    device: &B::Device,
    base: BaseWeights,
) -> Result<LoadedModel<B>, ModelError> {
    let args = load_args(dir)?;
    let mut weights = Weights::open(dir, files)?;
    let storage_dtype = weights.storage_dtype;
    let model = build_with::<B>(&args, &mut weights, device, base)?;
    weights.finish(|name| ignorable_tensor(&args, name))?;
    Ok(LoadedModel {
        model,
        storage_dtype,
    })
}

/// [`load_model`] as FSDP's rank `rows.rank` keeps it: only its rows of every weight are read
/// and built (`models::build::build_rows`), so no rank holds the whole model; a family whose
/// checkpoint fuses projections (Phi-3) loads whole, to be sharded after. `base`: the decoder
/// linears' base weights in float or NF4 (QLoRA: each rank quantizes its rows alone).
pub fn load_model_rows<B: Backend>(
    dir: &Path,
    files: Option<&[String]>,
    device: &B::Device,
    rows: RowsOf,
    base: BaseWeights,
) -> Result<LoadedModel<B>, ModelError> {
    let args = load_args(dir)?;
    let mut weights = Weights::open(dir, files)?;
    let storage_dtype = weights.storage_dtype;
    let model = match build_rows::<B>(&args, &mut weights, device, rows, base)? {
        Some(model) => model,
        None => build_with::<B>(&args, &mut weights, device, base)?,
    };
    weights.finish(|name| ignorable_tensor(&args, name))?;
    Ok(LoadedModel {
        model,
        storage_dtype,
    })
}

/// Saves the base model (adapters excluded: see `merged_hf_state_dict` to export a merged one).
pub fn save_model<B: Backend>(
    model: &CausalLm<B>,
    dir: &Path,
    source_dir: Option<&Path>,
    dtype: StorageDtype,
    max_shard_bytes: usize,
) -> Result<Vec<String>, CheckpointError> {
    save_hf_dir(
        dir,
        &model.hf_state_dict(),
        &model.args.raw,
        dtype,
        max_shard_bytes,
        source_dir,
    )
}

/// Writes a complete Hugging Face model directory from host tensors: weights (sharded as
/// transformers shards them), `config.json` with the storage dtype, and the tokenizer and
/// generation files copied from `source_dir`. Needs no model, so it runs in the background.
pub fn save_hf_dir(
    dir: &Path,
    state: &[(String, crate::checkpoint::HostTensor)],
    config_json: &serde_json::Value,
    dtype: StorageDtype,
    max_shard_bytes: usize,
    source_dir: Option<&Path>,
) -> Result<Vec<String>, CheckpointError> {
    std::fs::create_dir_all(dir).map_err(CheckpointError::io(dir))?;
    let mut files = save_sharded(dir, state, dtype, max_shard_bytes)?;
    files.extend(save_hf_companions(dir, config_json, dtype, source_dir)?);
    Ok(files)
}

/// What a Hugging Face model directory holds besides its weights: `config.json` with the
/// storage dtype, and the tokenizer and generation files copied from `source_dir`. Returns the
/// written file names.
pub fn save_hf_companions(
    dir: &Path,
    config_json: &serde_json::Value,
    dtype: StorageDtype,
    source_dir: Option<&Path>,
) -> Result<Vec<String>, CheckpointError> {
    let mut files = Vec::new();
    let mut config = config_json.clone();
    if let Some(obj) = config.as_object_mut() {
        // Keep whichever dtype key the source used (transformers 5 writes `dtype`).
        let key = if obj.contains_key("dtype") {
            "dtype"
        } else {
            "torch_dtype"
        };
        obj.insert(key.into(), dtype.torch_name().into());
        // The Hub repo the weights came from, as transformers records it; never a local path.
        if let Some(id) = source_dir.and_then(crate::hub::provenance::hub_id) {
            obj.insert("_name_or_path".into(), id.into());
        } else if obj
            .get("_name_or_path")
            .and_then(serde_json::Value::as_str)
            .is_some_and(|name| !crate::hub::provenance::is_hub_id(name))
        {
            obj.remove("_name_or_path");
        }
    }
    let path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&config).unwrap_or_default();
    std::fs::write(&path, text + "\n").map_err(CheckpointError::io(&path))?;
    files.push("config.json".into());
    if let Some(src) = source_dir {
        files.extend(copy_companions(src, dir)?);
    }
    Ok(files)
}

pub fn copy_companions(src: &Path, dst: &Path) -> Result<Vec<String>, CheckpointError> {
    let mut copied = Vec::new();
    for name in COMPANION_FILES {
        let from = src.join(name);
        if from.is_file() {
            let to = dst.join(name);
            std::fs::copy(&from, &to).map_err(CheckpointError::io(&to))?;
            copied.push(name.to_string());
        }
    }
    Ok(copied)
}
