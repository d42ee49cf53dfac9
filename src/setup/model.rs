//! Models from the `model` and `checkpointer` sections.

use std::path::Path;

use burn::tensor::backend::Backend;

use super::SetupError;
use crate::checkpoint::StorageDtype;
use crate::config::components::{Component, ModelVariant};
use crate::config::schema::{
    CheckpointFiles, CheckpointerConfig, LoraModule, ModelConfig, StrOrInt,
};
use crate::model_io::hf::{LoadedModel, load_model};
use crate::model_io::{peft, quantized};
use crate::models::CausalLm;
use crate::modules::LoraSettings;

/// The safetensors files `checkpoint_files` names, expanding torchtune's
/// `{filename_format, max_filename}` form.
pub fn checkpoint_files(cfg: &CheckpointerConfig) -> Option<Vec<String>> {
    match cfg.checkpoint_files.as_ref()? {
        CheckpointFiles::List(files) => Some(files.clone()),
        CheckpointFiles::Format {
            filename_format,
            max_filename,
        } => {
            let max = match max_filename {
                StrOrInt::Str(s) => s.clone(),
                StrOrInt::Int(i) => format!("{i:05}"),
            };
            let n: usize = max.parse().unwrap_or(0);
            Some(
                (1..=n)
                    .map(|i| {
                        let idx = format!("{i:0width$}", width = max.len());
                        filename_format
                            .replacen("{}", &idx, 1)
                            .replacen("{}", &max, 1)
                    })
                    .collect(),
            )
        }
    }
}

/// Loads the model the checkpointer points at. `key` names the section for error messages
/// (`checkpointer`, `teacher_checkpointer`, `ref_checkpointer`).
pub fn load<B: Backend>(
    cfg: &CheckpointerConfig,
    key: &'static str,
    device: &B::Device,
) -> Result<LoadedModel<B>, SetupError> {
    // A QAT run's int4 export (`<checkpoint>/quantized/`) loads dequantized, so `generate`
    // and every recipe read it like any other checkpoint.
    if quantized::is_quantized_export(&cfg.checkpoint_dir) {
        let model = quantized::load_quantized_model::<B>(&cfg.checkpoint_dir, device)
            .map_err(|source| SetupError::Model { key, source })?;
        eprintln!(
            "{key}: {} is a tune int4 export; its weights are dequantized on load",
            cfg.checkpoint_dir.display()
        );
        return Ok(LoadedModel {
            model,
            storage_dtype: StorageDtype::F32,
        });
    }
    let files = checkpoint_files(cfg);
    load_model::<B>(&cfg.checkpoint_dir, files.as_deref(), device)
        .map_err(|source| SetupError::Model { key, source })
}

/// LoRA settings and target modules (Hugging Face leaf names) from the `model` section.
pub struct LoraPlan {
    pub settings: LoraSettings,
    pub targets: Vec<String>,
}

pub fn is_lora(model: &ModelConfig) -> bool {
    matches!(&model.component, Component::Model(b) if b.variant != ModelVariant::Full)
}

pub fn lora_plan(model: &ModelConfig) -> Result<LoraPlan, SetupError> {
    let rank = model.lora_rank.ok_or_else(|| SetupError::Invalid {
        key: "model.lora_rank".into(),
        message: "a LoRA model needs lora_rank (e.g. 8)".into(),
    })? as usize;
    let alpha = model.lora_alpha.unwrap_or(2.0 * rank as f64);
    let mut targets: Vec<String> = model
        .lora_attn_modules
        .iter()
        .map(|m| match m {
            LoraModule::QProj => "q_proj",
            LoraModule::KProj => "k_proj",
            LoraModule::VProj => "v_proj",
            LoraModule::OutputProj => "o_proj",
        })
        .map(String::from)
        .collect();
    if model.apply_lora_to_mlp {
        targets.extend(["gate_proj", "up_proj", "down_proj"].map(String::from));
    }
    if model.apply_lora_to_output {
        targets.push("lm_head".into());
    }
    if targets.is_empty() {
        return Err(SetupError::Invalid {
            key: "model.lora_attn_modules".into(),
            message: "no LoRA targets: list some of [q_proj, k_proj, v_proj, output_proj] or set apply_lora_to_mlp: True"
                .into(),
        });
    }
    Ok(LoraPlan {
        settings: LoraSettings {
            rank,
            alpha,
            dropout: model.lora_dropout,
        },
        targets,
    })
}

/// Attaches fresh adapters per `plan` (or loads `checkpointer.adapter_checkpoint`), and
/// returns the PEFT config to save them with.
pub fn attach_adapters<B: Backend>(
    model: &mut CausalLm<B>,
    plan: &LoraPlan,
    checkpointer: &CheckpointerConfig,
    seed: u64,
) -> Result<peft::AdapterConfig, SetupError> {
    if plan.targets.iter().any(|t| t == "lm_head") && model.lm_head.is_none() {
        return Err(SetupError::Invalid {
            key: "model.apply_lora_to_output".into(),
            message: "this model ties its output projection to the embeddings (tie_word_embeddings): set apply_lora_to_output: False".into(),
        });
    }
    // The Hub id of the base model when known, else its path (as peft writes it).
    let base_model = crate::hub::provenance::base_model_name(&checkpointer.checkpoint_dir);
    if let Some(mut config) =
        load_adapter_checkpoint(model, checkpointer, "checkpointer.adapter_checkpoint")?
    {
        config.base_model_name_or_path = Some(base_model);
        return Ok(config);
    }
    let attached = peft::attach_lora(model, &plan.targets, &plan.settings, seed);
    if attached.is_empty() {
        return Err(SetupError::Invalid {
            key: "model.lora_attn_modules".into(),
            message: format!("none of {:?} is a linear layer of this model", plan.targets),
        });
    }
    Ok(peft::AdapterConfig::new(
        Some(base_model),
        &plan.settings,
        plan.targets.clone(),
    ))
}

/// Loads the PEFT adapter `checkpointer.adapter_checkpoint` names, if any, into `model`.
/// `key` names that setting for error messages (`teacher_checkpointer.adapter_checkpoint`, ...).
pub fn load_adapter_checkpoint<B: Backend>(
    model: &mut CausalLm<B>,
    checkpointer: &CheckpointerConfig,
    key: &'static str,
) -> Result<Option<peft::AdapterConfig>, SetupError> {
    let Some(adapter) = &checkpointer.adapter_checkpoint else {
        return Ok(None);
    };
    let path = adapter_dir(&checkpointer.checkpoint_dir, adapter);
    let config = peft::load_adapter(model, &path)
        .map_err(|source| SetupError::Checkpoint { key, source })?;
    Ok(Some(config))
}

/// `adapter_checkpoint` may name a PEFT directory, or a file inside one (torchtune names
/// `adapter_model.safetensors`), absolute or relative to the checkpoint directory.
pub fn adapter_dir(checkpoint_dir: &Path, adapter: &str) -> std::path::PathBuf {
    let given = Path::new(adapter);
    let path = if given.is_absolute() || given.exists() {
        given.to_path_buf()
    } else {
        checkpoint_dir.join(given)
    };
    if path.is_file() {
        path.parent().map(Path::to_path_buf).unwrap_or(path)
    } else {
        path
    }
}

/// The weights a full-weight recipe trains: the checkpoint being resumed (it holds every
/// weight) when there is one, else the checkpointer's.
pub fn load_or_resume<B: Backend>(
    cfg: &CheckpointerConfig,
    resume: Option<&crate::training::checkpointing::Resume>,
    device: &B::Device,
) -> Result<LoadedModel<B>, SetupError> {
    match resume {
        Some(r) => load_model::<B>(&r.dir, None, device).map_err(|source| SetupError::Model {
            key: "resume_from_checkpoint",
            source,
        }),
        None => load(cfg, "checkpointer", device),
    }
}

/// A LoRA recipe's adapters: attached per the `model` section (or loaded from
/// `checkpointer.adapter_checkpoint`), then, when resuming, the checkpoint's adapter weights.
/// Returns the plan and what each checkpoint saves (the PEFT adapter, plus the merged model
/// unless `save_adapter_weights_only`).
pub fn lora<B: Backend>(
    model: &mut CausalLm<B>,
    cfg: &crate::config::schema::TrainConfig,
    run: &super::run::RunStart,
) -> Result<(LoraPlan, crate::training::checkpointing::SaveContent), SetupError> {
    let plan = lora_plan(&cfg.model)?;
    let config = attach_adapters(model, &plan, &cfg.checkpointer, run.seed)?;
    if let Some(r) = &run.resume {
        peft::load_adapter(model, &r.dir).map_err(|source| SetupError::Checkpoint {
            key: "resume_from_checkpoint",
            source,
        })?;
    }
    let content = crate::training::checkpointing::SaveContent::Adapter {
        config,
        merged_model: !cfg.save_adapter_weights_only,
    };
    Ok((plan, content))
}

impl LoraPlan {
    /// "rank 8, alpha 16, on q_proj, v_proj", for start-up lines.
    pub fn describe(&self) -> String {
        format!(
            "rank {}, alpha {}, on {}",
            self.settings.rank,
            self.settings.alpha,
            self.targets.join(", ")
        )
    }
}
