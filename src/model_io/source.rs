//! A checkpoint directory, opened once ([`ModelSource`]): its config.json read and classified
//! (Hugging Face safetensors, the DCP shard files of a sharded run, or tune's int4 export), the
//! model's [`ModelArgs`] held for whoever needs the architecture before the weights (the data's
//! positions, a teacher's vocabulary), and the weights, or one rank's rows of them, loaded on
//! request.

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;

use super::hf::{LoadedModel, open_weights};
use super::quantized::{self, ExportInfo};
use crate::checkpoint::StorageDtype;
use crate::checkpoint::weights::dcp_source;
use crate::models::build::{RowsOf, build_rows, ignorable_tensor};
use crate::models::{BaseWeights, ModelArgs, ModelError, build_with};

/// What a checkpoint directory holds.
#[derive(Debug, Clone, PartialEq)]
pub enum SourceKind {
    /// A Hugging Face model: `model.safetensors` or an index and its shards.
    Safetensors,
    /// torch's distributed-checkpoint shard files (a sharded run's checkpoint, or torch's
    /// `save_distributed` output), in this directory.
    Dcp(PathBuf),
    /// tune's int4 export (a QAT run's `quantized/`), loaded dequantized.
    Int4Export(ExportInfo),
}

/// A checkpoint directory, read once.
#[derive(Debug, Clone)]
pub struct ModelSource {
    pub dir: PathBuf,
    pub kind: SourceKind,
    /// The model's architecture, from its config.json.
    pub args: ModelArgs,
    /// The safetensors files to read (torchtune's `checkpoint_files`), when not all of them.
    files: Option<Vec<String>>,
}

impl ModelSource {
    /// Reads `dir`'s config.json and tells what the directory holds; `files` names the
    /// safetensors files to read when not every one.
    pub fn open(dir: &Path, files: Option<Vec<String>>) -> Result<Self, ModelError> {
        let config = dir.join("config.json");
        if !config.is_file() {
            return Err(ModelError::BadConfig {
                path: config,
                message: "missing: a Hugging Face checkpoint directory needs its config.json"
                    .into(),
            });
        }
        let raw = ModelArgs::read_json(&config)?;
        let files = files.filter(|f| !f.is_empty());
        if quantized::is_quantized_config(&raw) {
            let (args, info) = quantized::float_args(raw, &config)?;
            return Ok(Self {
                dir: dir.to_path_buf(),
                kind: SourceKind::Int4Export(info),
                args,
                files: None,
            });
        }
        let args = ModelArgs::from_json(raw).map_err(|message| ModelError::BadConfig {
            path: config.clone(),
            message,
        })?;
        let kind = match dcp_source(dir).filter(|_| files.is_none()) {
            Some(shards) => SourceKind::Dcp(shards),
            None => SourceKind::Safetensors,
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            kind,
            args,
            files,
        })
    }

    /// Whether it is tune's int4 export.
    pub fn is_int4_export(&self) -> bool {
        matches!(self.kind, SourceKind::Int4Export(_))
    }

    /// The model, its decoder's linear base weights stored as `base` says (NF4 for QLoRA,
    /// quantized tensor by tensor as they are read). With `rows` (FSDP's per-rank load) only
    /// rank `rows.rank`'s rows of every weight are read and built, so no rank holds the whole
    /// model; a family whose checkpoint fuses projections (Phi-3), and an int4 export, load
    /// whole, to be sharded after.
    pub fn load<B: Backend>(
        &self,
        device: &B::Device,
        base: BaseWeights,
        rows: Option<RowsOf>,
    ) -> Result<LoadedModel<B>, ModelError> {
        if let SourceKind::Int4Export(info) = self.kind {
            let mut model = quantized::build_export::<B>(&self.dir, &self.args, info, device)?;
            if let BaseWeights::Nf4(dtype) = base {
                model.quantize_base_nf4(dtype)?;
            }
            return Ok(LoadedModel {
                model,
                storage_dtype: StorageDtype::F32,
            });
        }
        let mut args = self.args.clone();
        let mut weights = open_weights(&self.dir, self.files.as_deref(), &mut args)?;
        let storage_dtype = weights.storage_dtype;
        let rows_model = match rows {
            Some(rows) => build_rows::<B>(&args, &mut weights, device, rows, base)?,
            None => None,
        };
        let model = match rows_model {
            Some(model) => model,
            None => build_with::<B>(&args, &mut weights, device, base)?,
        };
        weights.finish(|name| ignorable_tensor(&args, name))?;
        Ok(LoadedModel {
            model,
            storage_dtype,
        })
    }
}
