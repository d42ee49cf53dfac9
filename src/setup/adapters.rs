//! A LoRA recipe's adapters, as the `model` section asks for them: the plan (rank, alpha,
//! targets, DoRA, the routers), fresh adapters attached or an adapter checkpoint continued,
//! and a resumed run's adapter weights.

use std::path::Path;

use burn::tensor::backend::Backend;

use super::SetupError;
use super::model_error::ModelConfigError;
use crate::config::schema::{CheckpointerConfig, ModelConfig, TrainConfig};
use crate::model_io::peft;
use crate::model_io::peft_experts::FusedParam;
use crate::models::adapters;
use crate::models::{CausalLm, Trainable};
use crate::modules::LoraSettings;

/// LoRA settings and target modules (Hugging Face leaf names) from the `model` section.
pub struct LoraPlan {
    pub settings: LoraSettings,
    pub targets: Vec<String>,
    /// `model.train_router`: every sparse layer's router trains in full beside the adapters.
    pub train_router: bool,
}

/// The adapters a LoRA builder's section asks for (`None` for a full builder).
pub fn lora_plan(model: &ModelConfig) -> Option<LoraPlan> {
    let lora = model.lora()?;
    let mut targets: Vec<String> = lora
        .lora_attn_modules
        .iter()
        .map(|m| m.hf_name().to_string())
        .collect();
    if lora.apply_lora_to_mlp {
        targets.extend(["gate_proj", "up_proj", "down_proj"].map(String::from));
    }
    if lora.apply_lora_to_output {
        targets.push("lm_head".into());
    }
    Some(LoraPlan {
        settings: LoraSettings {
            rank: lora.lora_rank as usize,
            alpha: lora.lora_alpha,
            dropout: lora.lora_dropout,
            dora: lora.use_dora,
        },
        targets,
        train_router: lora.train_router,
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
        return Err(ModelConfigError::TiedOutput.into());
    }
    if plan.train_router && model.args.moe.is_none() {
        return Err(ModelConfigError::RouterOfDenseModel {
            model_type: model.args.family.model_type(),
        }
        .into());
    }
    // The Hub id of the base model when known, else its path (as peft writes it).
    let base_model = crate::hub::provenance::base_model_name(&checkpointer.checkpoint_dir);
    if let Some(mut config) =
        load_adapter_checkpoint(model, checkpointer, "checkpointer.adapter_checkpoint")?
    {
        config.base_model_name_or_path = Some(base_model);
        if plan.train_router != config.trains_routers(&model.args) {
            return Err(ModelConfigError::RouterTrainingDiffers {
                adapter: config.trains_routers(&model.args),
            }
            .into());
        }
        return Ok(config);
    }
    let targets = model.args.lora_targets(&plan.targets);
    let mlp = ["gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"];
    let adapts_experts =
        model.args.moe.is_some() && targets.iter().any(|t| mlp.contains(&t.as_str()));
    if plan.settings.dora && adapts_experts {
        return Err(ModelConfigError::DoraOnExperts.into());
    }
    // gpt-oss: the MLP targets mean its fused experts, adapted as peft's `target_parameters`
    // adapts them (one adapter per expert over gate_up_proj, one over down_proj).
    let fused = adapters::experts_are_fused(&model.args) && adapts_experts;
    if fused && plan.settings.dropout != 0.0 {
        return Err(ModelConfigError::DropoutOnFusedExperts {
            model_type: model.args.family.model_type(),
        }
        .into());
    }
    let mut attached = adapters::attach_lora(model, &targets, &plan.settings, seed);
    let target_parameters: Vec<String> =
        if fused && adapters::attach_fused_expert_lora(model, &plan.settings, seed) {
            FusedParam::ALL.iter().map(|p| p.target()).collect()
        } else {
            Vec::new()
        };
    attached.extend(target_parameters.iter().cloned());
    if attached.is_empty() {
        return Err(ModelConfigError::NoTargets { targets }.into());
    }
    let module_targets: Vec<String> = if fused {
        targets
            .into_iter()
            .filter(|t| !mlp.contains(&t.as_str()))
            .collect()
    } else {
        targets
    };
    let mut config = peft::AdapterConfig::for_model(
        Some(base_model),
        &plan.settings,
        module_targets,
        &model.args,
    );
    if !target_parameters.is_empty() {
        config.set_target_parameters(target_parameters);
    }
    if plan.train_router {
        config.set_trains_routers(&model.args);
    }
    Ok(config)
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

/// A LoRA recipe's adapters: attached per the `model` section (or loaded from
/// `checkpointer.adapter_checkpoint`), then, when resuming, the checkpoint's adapter weights.
/// Returns the plan and what each checkpoint saves (the PEFT adapter, plus the merged model
/// unless `save_adapter_weights_only`).
pub fn lora<B: Backend>(
    model: &mut CausalLm<B>,
    cfg: &TrainConfig,
    run: &super::run::RunStart,
) -> Result<(LoraPlan, crate::training::checkpointing::SaveContent), SetupError> {
    let plan = lora_plan(&cfg.model).ok_or_else(|| ModelConfigError::NotLora {
        builder: cfg.model.component.canonical_name(),
    })?;
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
            "rank {}, alpha {}, on {}{}",
            self.settings.rank,
            self.settings.alpha,
            self.targets.join(", "),
            if self.train_router {
                "; routers trained in full"
            } else {
                ""
            }
        )
    }

    /// What the recipe trains: the adapters, and the routers where asked.
    pub fn trainable(&self) -> Trainable {
        if self.train_router {
            Trainable::AdaptersAndRouters
        } else {
            Trainable::AdaptersOnly
        }
    }
}
