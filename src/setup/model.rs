//! Models from the `model` and `checkpointer` sections.

use std::path::Path;

use burn::tensor::backend::Backend;

use super::SetupError;
use crate::checkpoint::StorageDtype;
use crate::config::schema::{CheckpointerConfig, ModelConfig, TrainConfig};
use crate::model_io::hf::{LoadedModel, load_model, load_model_rows, load_model_with};
use crate::model_io::{peft, quantized};
use crate::models::CausalLm;
use crate::models::args::ExpertNaming;
use crate::models::build::RowsOf;
use crate::models::{BaseWeights, Trainable};
use crate::modules::LoraSettings;
use crate::modules::nf4::Nf4Dtype;
use crate::precision::Dtype;

/// A `model` section this checkpoint or device cannot honour.
#[derive(Debug, thiserror::Error)]
pub enum ModelConfigError {
    /// A LoRA recipe given a full builder (validation refuses it first).
    #[error(
        "model._component_: `{builder}` is a full model builder, and this recipe trains LoRA adapters"
    )]
    NotLora { builder: String },
    #[error(
        "dtype: QLoRA's NF4 base weights are quantized in bf16 or fp32 (as torchtune's QLoRA configs run); set `dtype: bf16` or `dtype: fp32`"
    )]
    Nf4InFp16,
    #[error(
        "model.apply_lora_to_output: this model ties its output projection to the embeddings (tie_word_embeddings): set apply_lora_to_output: False"
    )]
    TiedOutput,
    #[error("model.lora_attn_modules: none of {targets:?} is a linear layer of this model")]
    NoTargets { targets: Vec<String> },
    #[error(
        "model.use_dora: DoRA on a mixture-of-experts model's experts (apply_lora_to_mlp: True) is not supported: peft cannot load DoRA magnitudes onto transformers' fused experts; set apply_lora_to_mlp: False or use_dora: False"
    )]
    DoraOnExperts,
    #[error(
        "model.train_router: a \"{model_type}\" model is dense, it has no router to train; remove `train_router` (it is for mixture-of-experts models: Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss)"
    )]
    RouterOfDenseModel { model_type: &'static str },
    /// `checkpointer.adapter_checkpoint` continues an adapter: whether it trained the routers
    /// (its `modules_to_save`) is part of it.
    #[error(
        "model.train_router: the adapter in checkpointer.adapter_checkpoint {}, so set `train_router: {}` to continue it",
        if *adapter { "trained the routers (modules_to_save)" } else { "left the routers frozen" },
        if *adapter { "True" } else { "False" }
    )]
    RouterTrainingDiffers { adapter: bool },
    /// gpt-oss's experts are fused 3-D parameters, which peft adapts through
    /// `target_parameters` (its `ParamWrapper`), and that refuses dropout: its input cannot be
    /// factored out of the fused product.
    #[error(
        "model.lora_dropout: LoRA on a \"{model_type}\" model's fused experts (apply_lora_to_mlp: True) takes no dropout, as peft's target_parameters adapters do not; set lora_dropout: 0.0, or apply_lora_to_mlp: False"
    )]
    DropoutOnFusedExperts { model_type: &'static str },
    /// QAT's int4 export of a multimodal checkpoint's language model: the export holds one text
    /// decoder, and the vision tower has no int4 form.
    #[error(
        "quantizer: the int4 export of a \"{wrapper}\" checkpoint (its language model, with the vision tower beside it) is not supported; fine-tune it with QAT and no export by using the qat_* recipes on a text-only checkpoint, or train the multimodal checkpoint with full or LoRA fine-tuning"
    )]
    QuantizedExportOfTower { wrapper: &'static str },
    /// QAT's int4 export quantizes linear weights by name; gpt-oss's experts are saved fused
    /// 3-D tensors, which it would write in float, unlike the fake-quantized experts that trained.
    #[error(
        "quantizer: the int4 export of a \"{model_type}\" model is not supported: its experts are saved as fused 3-D tensors, which the export would leave in float while QAT trained them fake-quantized; fine-tune it with the full or LoRA recipes, or use QAT without an export on a model whose experts are stored per expert"
    )]
    QuantizedExportOfFusedExperts { model_type: &'static str },
    /// A generic builder's architecture argument that is not the checkpoint's.
    #[error(
        "{section}.{key}: is {ours}, but the checkpoint's config.json has {hf} = {theirs}; tune builds the model from config.json, so remove `{section}.{key}` or point the checkpointer at the model this config describes"
    )]
    Architecture {
        section: String,
        key: &'static str,
        ours: String,
        theirs: String,
        hf: &'static str,
    },
    /// A classifier builder (a reward or value model) on a checkpoint with a language-model
    /// head, or the other way round.
    #[error(
        "{section}._component_: `{builder}` {wants}, but the checkpoint holds a {holds} ({architecture}); {fix}"
    )]
    Head {
        section: String,
        builder: String,
        wants: &'static str,
        holds: &'static str,
        architecture: String,
        fix: &'static str,
    },
}

/// Loads the model the checkpointer points at. `key` names the section for error messages
/// (`checkpointer`, `teacher_checkpointer`, `ref_checkpointer`).
pub fn load<B: Backend>(
    cfg: &CheckpointerConfig,
    key: &'static str,
    device: &B::Device,
) -> Result<LoadedModel<B>, SetupError> {
    load_with(cfg, key, BaseWeights::Float, device)
}

/// How a `model` section stores the base weights: NF4 for torchtune's `qlora_*` builders and
/// `quantize_base: True`, dequantized in the run's dtype (quantized in the checkpoint's, see
/// `BaseWeights::Nf4`).
pub fn base_weights<B: Backend>(
    model: &ModelConfig,
    device: &B::Device,
) -> Result<BaseWeights, SetupError> {
    if !model.quantizes_base() {
        return Ok(BaseWeights::Float);
    }
    match crate::precision::device_dtype::<B>(device) {
        Dtype::Bf16 => Ok(BaseWeights::Nf4(Nf4Dtype::Bf16)),
        Dtype::Fp32 => Ok(BaseWeights::Nf4(Nf4Dtype::F32)),
        Dtype::Fp16 => Err(ModelConfigError::Nf4InFp16.into()),
    }
}

/// The model a LoRA recipe trains adapters on (or generation runs), its base stored as the
/// `model` section says (NF4 for QLoRA). With FSDP (`rows`) the base is read as this rank's
/// rows only ([`load_rows`]; an NF4 base's rows quantized as the whole weight's would be); a
/// DoRA base loads whole (the magnitude starts from whole rows' norms) and is sharded after.
pub fn load_base<B: Backend>(
    model: &ModelConfig,
    cfg: &CheckpointerConfig,
    rows: Option<RowsOf>,
    device: &B::Device,
) -> Result<LoadedModel<B>, SetupError> {
    let base = base_weights::<B>(model, device)?;
    let rows = rows.filter(|_| !model.lora().is_some_and(|l| l.use_dora));
    load_rows(cfg, "checkpointer", rows, base, device)
}

/// [`load`] with the base weights stored as `base` says.
pub fn load_with<B: Backend>(
    cfg: &CheckpointerConfig,
    key: &'static str,
    base: BaseWeights,
    device: &B::Device,
) -> Result<LoadedModel<B>, SetupError> {
    // A QAT run's int4 export (`<checkpoint>/quantized/`) loads dequantized, so `generate`
    // and every recipe read it like any other checkpoint.
    if quantized::is_quantized_export(&cfg.checkpoint_dir) {
        let mut model = quantized::load_quantized_model::<B>(&cfg.checkpoint_dir, device)
            .map_err(|source| SetupError::Model { key, source })?;
        if let BaseWeights::Nf4(dtype) = base {
            model
                .quantize_base_nf4(dtype)
                .map_err(|source| SetupError::Checkpoint { key, source })?;
        }
        eprintln!(
            "{key}: {} is a tune int4 export; its weights are dequantized on load",
            cfg.checkpoint_dir.display()
        );
        return Ok(LoadedModel {
            model,
            storage_dtype: StorageDtype::F32,
        });
    }
    let files = cfg.files();
    load_model_with::<B>(&cfg.checkpoint_dir, files.as_deref(), device, base)
        .map_err(|source| SetupError::Model { key, source })
}

/// LoRA settings and target modules (Hugging Face leaf names) from the `model` section.
pub struct LoraPlan {
    pub settings: LoraSettings,
    pub targets: Vec<String>,
    /// `model.train_router`: every sparse layer's router trains in full beside the adapters.
    pub train_router: bool,
}

/// Refuses QAT's int4 export of a model it cannot write faithfully: a multimodal checkpoint's
/// language model (the vision tower has no int4 form) or gpt-oss's fused experts.
pub fn refuse_quantized_export(args: &crate::models::ModelArgs) -> Result<(), ModelConfigError> {
    if let Some(tower) = &args.tower {
        return Err(ModelConfigError::QuantizedExportOfTower {
            wrapper: tower.wrapper,
        });
    }
    if args
        .moe
        .as_ref()
        .is_some_and(|m| m.naming == ExpertNaming::GptOss)
    {
        return Err(ModelConfigError::QuantizedExportOfFusedExperts {
            model_type: args.family.model_type(),
        });
    }
    Ok(())
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
    let fused = peft::experts_are_fused(&model.args) && adapts_experts;
    if fused && plan.settings.dropout != 0.0 {
        return Err(ModelConfigError::DropoutOnFusedExperts {
            model_type: model.args.family.model_type(),
        }
        .into());
    }
    let mut attached = peft::attach_lora(model, &targets, &plan.settings, seed);
    let target_parameters = if fused {
        peft::attach_fused_expert_lora(model, &plan.settings, seed)
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

/// The weights a full-weight recipe trains: the checkpoint being resumed (it holds every
/// weight) when there is one, else the checkpointer's. With FSDP (`run.load_rows()`), only this
/// rank's rows of each weight are read ([`load_rows`]).
pub fn load_or_resume<B: Backend>(
    cfg: &CheckpointerConfig,
    run: &super::run::RunStart,
    device: &B::Device,
) -> Result<LoadedModel<B>, SetupError> {
    let rows = run.load_rows();
    match (&run.resume, rows) {
        (Some(r), Some(rows)) => {
            load_model_rows::<B>(&r.dir, None, device, rows, BaseWeights::Float)
        }
        (Some(r), None) => load_model::<B>(&r.dir, None, device),
        (None, _) => return load_rows(cfg, "checkpointer", rows, BaseWeights::Float, device),
    }
    .map_err(|source| SetupError::Model {
        key: "resume_from_checkpoint",
        source,
    })
}

/// [`load_with`], reading only rank `rows.rank`'s rows of each weight when `rows` is set
/// (FSDP's per-rank load: the model is sharded as it is built, never whole on this rank; an
/// NF4 base's rows are quantized as the whole weight would be); a tune int4 export loads
/// whole and is sharded after.
pub fn load_rows<B: Backend>(
    cfg: &CheckpointerConfig,
    key: &'static str,
    rows: Option<RowsOf>,
    base: BaseWeights,
    device: &B::Device,
) -> Result<LoadedModel<B>, SetupError> {
    match rows {
        Some(rows) if !quantized::is_quantized_export(&cfg.checkpoint_dir) => {
            let files = cfg.files();
            load_model_rows::<B>(&cfg.checkpoint_dir, files.as_deref(), device, rows, base)
                .map_err(|source| SetupError::Model { key, source })
        }
        _ => load_with(cfg, key, base, device),
    }
}

/// A frozen model the policy is compared with (full DPO's and full GRPO's reference), from
/// `cfg` at config key `key`, on a backend without autodiff so it never joins the graph; with
/// FSDP each rank loads only its rows and the layers shard as the policy's do.
pub fn frozen_reference<B: Backend>(
    cfg: &CheckpointerConfig,
    key: &'static str,
    run: &super::run::RunStart,
    device: &B::Device,
) -> Result<CausalLm<B>, SetupError> {
    let reference = load_rows::<B>(cfg, key, run.load_rows(), BaseWeights::Float, device)?.model;
    Ok(match run.fsdp {
        Some(sharding) => crate::training::parallel::fsdp::shard_frozen(
            reference,
            &run.world,
            sharding.cpu_offload,
        ),
        None => reference,
    })
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

/// A generic builder's architecture arguments must describe the checkpoint: tune builds the
/// model from config.json, so a disagreement means the config is for another model.
pub fn check_architecture(
    section: &str,
    arch: &ModelConfig,
    args: &crate::models::ModelArgs,
) -> Result<(), SetupError> {
    let mismatch = |key, ours: String, theirs: String, hf| {
        SetupError::from(ModelConfigError::Architecture {
            section: section.to_string(),
            key,
            ours,
            theirs,
            hf,
        })
    };
    let keys = arch.arch();
    let whole = [
        ("vocab_size", keys.vocab_size, args.vocab_size, "vocab_size"),
        (
            "num_layers",
            keys.num_layers,
            args.num_layers,
            "num_hidden_layers",
        ),
        (
            "num_heads",
            keys.num_heads,
            args.num_heads,
            "num_attention_heads",
        ),
        (
            "num_kv_heads",
            keys.num_kv_heads,
            args.num_kv_heads,
            "num_key_value_heads",
        ),
        ("embed_dim", keys.embed_dim, args.hidden_size, "hidden_size"),
        (
            "intermediate_dim",
            keys.intermediate_dim,
            args.intermediate_size,
            "intermediate_size",
        ),
        ("head_dim", keys.head_dim, args.head_dim, "head_dim"),
        (
            "max_seq_len",
            keys.max_seq_len,
            args.max_position_embeddings,
            "max_position_embeddings",
        ),
    ];
    for (key, ours, theirs, hf) in whole {
        if let Some(v) = ours
            && v != theirs
        {
            return Err(mismatch(key, v.to_string(), theirs.to_string(), hf));
        }
    }
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs());
    for (key, ours, theirs, hf) in [
        ("norm_eps", keys.norm_eps, args.rms_norm_eps, "rms_norm_eps"),
        ("rope_base", keys.rope_base, args.rope_theta, "rope_theta"),
    ] {
        if let Some(v) = ours
            && !close(v, theirs)
        {
            return Err(mismatch(key, v.to_string(), theirs.to_string(), hf));
        }
    }
    let architecture = args
        .raw
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(serde_json::Value::as_str)
        .unwrap_or("no `architectures` in config.json")
        .to_string();
    let head = |wants, holds, fix| {
        SetupError::from(ModelConfigError::Head {
            section: section.to_string(),
            builder: arch.component.canonical_name(),
            wants,
            holds,
            architecture: architecture.clone(),
            fix,
        })
    };
    match (arch.is_classifier(), args.num_labels) {
        (true, Some(theirs)) if arch.classes().is_some_and(|ours| ours != theirs) => {
            return Err(mismatch(
                "num_classes",
                arch.classes().map_or_else(String::new, |n| n.to_string()),
                theirs.to_string(),
                "num_labels (the size of id2label)",
            ));
        }
        (true, None) => {
            return Err(head(
                "scores sequences (a reward or value model)",
                "language model",
                "point its checkpointer at a `*ForSequenceClassification` checkpoint with a `score` head (a reward model), as torchtune's `model_type: REWARD` checkpoints are",
            ));
        }
        (false, Some(_)) => {
            return Err(head(
                "is a language model",
                "sequence classifier",
                "point the checkpointer at a `*ForCausalLM` checkpoint",
            ));
        }
        _ => {}
    }
    if let Some(tied) = keys.tie_word_embeddings
        && tied != args.tie_word_embeddings
    {
        return Err(mismatch(
            "tie_word_embeddings",
            tied.to_string(),
            args.tie_word_embeddings.to_string(),
            "tie_word_embeddings",
        ));
    }
    Ok(())
}
