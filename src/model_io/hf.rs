//! Hugging Face model directories: load `config.json` + safetensors into a `CausalLm`
//! (through [`ModelSource`], which reads the directory once), and save a model so
//! `AutoModelForCausalLM.from_pretrained(dir)` loads it unchanged.

use std::path::Path;

use burn::tensor::backend::Backend;

use super::source::ModelSource;
use crate::checkpoint::error::CheckpointError;
use crate::checkpoint::safetensors_io::{
    SafetensorsFile, StorageDtype, StoredTensor, save_sharded, save_sharded_with,
};
use crate::checkpoint::weights::{Weights, checkpoint_files, dcp_source};
use crate::models::args::Family;
use crate::models::build::RowsOf;
use crate::models::text_tower::{TextTower, TowerLayout};
use crate::models::{BaseWeights, CausalLm, ModelArgs, ModelError};

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
    // A vision-language model's processor (AutoProcessor reads these beside the model).
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
    "video_preprocessor_config.json",
];

/// Default shard size, as transformers' `max_shard_size="5GB"`.
pub const DEFAULT_MAX_SHARD_BYTES: usize = 5_000_000_000;

pub struct LoadedModel<B: Backend> {
    pub model: CausalLm<B>,
    pub storage_dtype: StorageDtype,
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
    ModelSource::open(dir, files.map(<[String]>::to_vec))?.load(device, base, None)
}

/// [`load_model`] as FSDP's rank `rows.rank` keeps it (see [`ModelSource::load`]).
pub fn load_model_rows<B: Backend>(
    dir: &Path,
    files: Option<&[String]>,
    device: &B::Device,
    rows: RowsOf,
    base: BaseWeights,
) -> Result<LoadedModel<B>, ModelError> {
    ModelSource::open(dir, files.map(<[String]>::to_vec))?.load(device, base, Some(rows))
}

/// Opens a checkpoint's weights as the model reads them: a multimodal checkpoint's language
/// model under its text names (its key layout recorded in `args.tower`), the rest set aside for
/// saves to copy through.
pub(super) fn open_weights(
    dir: &Path,
    files: Option<&[String]>,
    args: &mut ModelArgs,
) -> Result<Weights, ModelError> {
    // Saves copy the vision tower from the source's safetensors files: refused here, before
    // training, rather than at the first save.
    if let Some(tower) = &args.tower
        && files.is_none_or(<[String]>::is_empty)
        && dcp_source(dir).is_some()
    {
        return Err(ModelError::BadConfig {
            path: dir.to_path_buf(),
            message: format!(
                "this \"{}\" checkpoint holds DCP shard files; tune reads a multimodal checkpoint's language model from safetensors files (model.safetensors or an index) so that its saves can copy the vision tower through: consolidate the shards into model.safetensors first",
                tower.wrapper
            ),
        });
    }
    refuse_foreign_quantization(dir, args)?;
    let mut weights = Weights::open(dir, files)?;
    if let Some(tower) = args.tower.as_mut() {
        tower.layout = TowerLayout::detect(weights.names());
        let tower = tower.clone();
        weights.rename(|name| tower.model_name(name));
        // A stored output projection is the model's own, whatever the config says of tying.
        if weights.contains("lm_head.weight") {
            args.tie_word_embeddings = false;
        }
    }
    Ok(weights)
}

/// A checkpoint another library quantized (`quantization_config`: bitsandbytes, GPTQ, AWQ, FP8,
/// ...) holds codes and scales where the model reads float weights: refused by that key, naming
/// the method, before any tensor is read (the error would otherwise be a missing or misshapen
/// tensor). gpt-oss's MXFP4 experts are the exception: `models::build` dequantizes them. tune's
/// own int4 exports never come here (`setup::model` routes them to their loader).
fn refuse_foreign_quantization(dir: &Path, args: &ModelArgs) -> Result<(), ModelError> {
    let Some(method) = args
        .raw
        .get("quantization_config")
        .map(|q| q.get("quant_method").and_then(serde_json::Value::as_str))
    else {
        return Ok(());
    };
    if method == Some("mxfp4") && args.family == Family::GptOss {
        return Ok(());
    }
    Err(ModelError::BadConfig {
        path: dir.join("config.json"),
        message: format!(
            "quantization_config.quant_method {}: tune reads float checkpoints (bf16, f16, f32; and gpt-oss's MXFP4 experts, which it dequantizes); use the unquantized checkpoint (for a 4-bit base, tune's QLoRA quantizes it to NF4 as it loads)",
            method.map_or_else(|| "is missing".to_string(), |m| format!("\"{m}\"")),
        ),
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
        &model.args,
        dtype,
        max_shard_bytes,
        source_dir,
    )
}

/// Writes a complete Hugging Face model directory from host tensors: weights (sharded as
/// transformers shards them), `config.json` with the storage dtype, and the tokenizer and
/// generation files copied from `source_dir`. For a multimodal checkpoint's language model
/// (`args.tower`) the source's other tensors (vision tower, projector) are copied through as
/// stored. Needs no model, so it runs in the background.
pub fn save_hf_dir(
    dir: &Path,
    state: &[(String, crate::checkpoint::HostTensor)],
    args: &ModelArgs,
    dtype: StorageDtype,
    max_shard_bytes: usize,
    source_dir: Option<&Path>,
) -> Result<Vec<String>, CheckpointError> {
    std::fs::create_dir_all(dir).map_err(CheckpointError::io(dir))?;
    let mut files = match &args.tower {
        Some(tower) => {
            let source = source_dir.ok_or_else(|| CheckpointError::Invalid {
                path: dir.to_path_buf(),
                message: format!(
                    "a \"{}\" checkpoint's language model is saved with the rest of the checkpoint it came from, and no source directory was given",
                    tower.wrapper
                ),
            })?;
            let sources = open_sources(source)?;
            let copied = not_the_language_model(&sources, tower)?;
            save_sharded_with(dir, state, dtype, &copied, max_shard_bytes)?
        }
        None => save_sharded(dir, state, dtype, max_shard_bytes)?,
    };
    files.extend(save_hf_companions(dir, &args.raw, dtype, source_dir)?);
    Ok(files)
}

/// The safetensors files of checkpoint directory `dir`, memory-mapped.
fn open_sources(dir: &Path) -> Result<Vec<SafetensorsFile>, CheckpointError> {
    checkpoint_files(dir, None)?
        .iter()
        .map(|path| SafetensorsFile::open(path))
        .collect()
}

/// Every tensor of `sources` that is not the language model's, as stored, in name order.
fn not_the_language_model<'a>(
    sources: &'a [SafetensorsFile],
    tower: &TextTower,
) -> Result<Vec<StoredTensor<'a>>, CheckpointError> {
    let mut copied = Vec::new();
    for file in sources {
        for name in file.names() {
            if tower.model_name(&name).is_none() {
                let (dtype, shape, bytes) = file.raw(&name)?;
                copied.push((name, dtype, shape, bytes));
            }
        }
    }
    copied.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(copied)
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
        // gpt-oss's release stores its experts in MXFP4; tune dequantizes them on load and saves
        // them in `dtype`, so the saved config must not tell transformers to read MXFP4 blocks.
        if obj
            .get("quantization_config")
            .and_then(|q| q.get("quant_method"))
            .and_then(serde_json::Value::as_str)
            == Some("mxfp4")
        {
            obj.remove("quantization_config");
        }
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
