//! Models from the `checkpointer` sections: each checkpoint directory a config key names is
//! opened once ([`open`], its config.json read and classified, its `model_type` checked), and
//! its model loaded from that ([`load`]): whole or, with FSDP, as this rank's rows; its base in
//! NF4 where the `model` section asks for QLoRA ([`load_base`]); frozen and sharded as the
//! policy is, for a reference ([`frozen`]).

use std::ops::Deref;

use burn::tensor::backend::Backend;

pub use super::adapters::{LoraPlan, adapter_dir, attach_adapters, lora, lora_plan};
pub use super::architecture::check_architecture;
pub use super::model_error::ModelConfigError;

use super::SetupError;
use super::run::RunStart;
use crate::config::schema::{CheckpointerConfig, ModelConfig};
use crate::model_io::hf::LoadedModel;
use crate::model_io::source::ModelSource;
use crate::models::args::ExpertNaming;
use crate::models::build::RowsOf;
use crate::models::{BaseWeights, CausalLm};
use crate::modules::nf4::Nf4Dtype;
use crate::precision::Dtype;

/// A checkpoint directory a config key names, opened once.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The key that named it, for messages (`checkpointer`, `teacher_checkpointer`,
    /// `resume_from_checkpoint`, ...).
    pub key: &'static str,
    pub source: ModelSource,
}

impl Deref for Checkpoint {
    type Target = ModelSource;
    fn deref(&self) -> &ModelSource {
        &self.source
    }
}

/// Opens the directory `cfg` (at config key `key`) names: its config.json read once, and the
/// section's `model_type` held against it.
pub fn open(cfg: &CheckpointerConfig, key: &'static str) -> Result<Checkpoint, SetupError> {
    let source = ModelSource::open(&cfg.checkpoint_dir, cfg.files())
        .map_err(|source| SetupError::Model { key, source })?;
    super::architecture::check_model_type(key, cfg.model_type, &source.args)?;
    Ok(Checkpoint { key, source })
}

/// The weights a full-weight recipe trains: the checkpoint being resumed (it holds every
/// weight) when there is one, else the checkpointer's.
pub fn policy(cfg: &CheckpointerConfig, run: &RunStart) -> Result<Checkpoint, SetupError> {
    let Some(resume) = &run.resume else {
        return open(cfg, "checkpointer");
    };
    let key = "resume_from_checkpoint";
    let source =
        ModelSource::open(&resume.dir, None).map_err(|source| SetupError::Model { key, source })?;
    Ok(Checkpoint { key, source })
}

/// The model of `checkpoint`, its decoder's linear base weights stored as `base` says; with
/// FSDP (`rows`) only this rank's rows of each weight are read (an NF4 base's rows quantized
/// as the whole weight's would be; an int4 export loads whole, to be sharded after).
pub fn load<B: Backend>(
    checkpoint: &Checkpoint,
    base: BaseWeights,
    rows: Option<RowsOf>,
    device: &B::Device,
) -> Result<LoadedModel<B>, SetupError> {
    if checkpoint.is_int4_export() {
        crate::say!(
            "{}: {} is a tune int4 export; its weights are dequantized on load",
            checkpoint.key,
            checkpoint.dir.display()
        );
    }
    let started = std::time::Instant::now();
    let loaded = checkpoint
        .load(device, base, rows)
        .map_err(|source| SetupError::Model {
            key: checkpoint.key,
            source,
        })?;
    crate::say_debug!(
        "{}: loaded {} ({:?}, a {} model, {} base{}) in {:.2}s",
        checkpoint.key,
        checkpoint.dir.display(),
        checkpoint.kind,
        checkpoint.args.family.model_type(),
        match base {
            BaseWeights::Float => "float",
            BaseWeights::Nf4(_) => "NF4",
        },
        rows.map_or(String::new(), |r| format!(
            ", rank {}'s rows of {}",
            r.rank, r.world
        )),
        started.elapsed().as_secs_f64()
    );
    Ok(loaded)
}

/// The model a LoRA recipe trains adapters on (or generation runs), its base stored as the
/// `model` section says (NF4 for QLoRA); a DoRA base loads whole (the magnitude starts from
/// whole rows' norms) and is sharded after.
pub fn load_base<B: Backend>(
    checkpoint: &Checkpoint,
    model: &ModelConfig,
    rows: Option<RowsOf>,
    device: &B::Device,
) -> Result<LoadedModel<B>, SetupError> {
    let base = base_weights::<B>(model, device)?;
    let rows = rows.filter(|_| !model.lora().is_some_and(|l| l.use_dora));
    load(checkpoint, base, rows, device)
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

/// A frozen model the policy is compared with (full DPO's and full GRPO's reference), on a
/// backend without autodiff so it never joins the graph; with FSDP each rank loads only its
/// rows and the layers shard as the policy's do.
pub fn frozen<B: Backend>(
    checkpoint: &Checkpoint,
    run: &RunStart,
    device: &B::Device,
) -> Result<CausalLm<B>, SetupError> {
    let reference = load::<B>(checkpoint, BaseWeights::Float, run.load_rows(), device)?.model;
    Ok(match run.fsdp {
        Some(sharding) => crate::training::parallel::fsdp::shard_frozen(
            reference,
            &run.world,
            sharding.cpu_offload,
        ),
        None => reference,
    })
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
