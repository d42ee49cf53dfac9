//! Knowledge distillation (torchtune's `knowledge_distillation_single_device.py`, and with
//! several workers `knowledge_distillation_distributed.py`).
//!
//! A frozen teacher (`teacher_checkpointer`, optionally with a PEFT adapter) runs beside the
//! student; the student minimises `(1 - kd_ratio) * cross_entropy + kd_ratio * kd_loss`, the
//! KD loss comparing its distribution with the teacher's at every labelled position. The
//! student trains LoRA adapters (a `lora_*` model component: saved as a PEFT adapter, plus
//! the merged model unless `save_adapter_weights_only: true`) or every weight (a full model
//! component: saved as a Hugging Face model). The teacher runs without autodiff and is never
//! saved; it must share the student's tokenizer, which setup checks before loading it.

use burn::tensor::backend::AutodiffBackend;

use crate::config::keys::{default, keys, required};
use crate::config::schema::{
    CheckpointerConfig, KdLoss as KdLossConfig, ModelConfig, TrainConfig, WholeCrossEntropyLoss,
};
use crate::models::{BaseWeights, Trainable};
use crate::setup::{data, model, session, teacher};
use crate::training::checkpointing::SaveContent;
use crate::training::parallel::fsdp;
use crate::training::kd::KdLoss;

use super::RunContext;
use crate::config::recipes::{DataKind, Layout, OwnKeysSpec, RecipeSpec, Trains};
use crate::distributed::WorkerError;
use crate::setup::run::RunStart;
use crate::setup::trainer::Plan;

pub static RECIPE: RecipeSpec = RecipeSpec {
    name: "knowledge_distillation",
    aliases: &[
        "knowledge_distillation_single_device",
        "kd_single_device",
        "kd",
    ],
    distributed: Some("knowledge_distillation_distributed"),
    description: "Knowledge distillation from a frozen teacher into a (LoRA) student",
    trains: Trains::Either,
    data: DataKind::Responses,
    layout: Layout::Training,
    own: OwnKeysSpec::of::<KdKeys>(),
};

keys! {
    /// Knowledge distillation's own keys.
    pub struct KdKeys {}
    /// The student's token cross-entropy.
    loss: WholeCrossEntropyLoss = required().fingerprint(),
    /// The teacher's builder (its architecture comes from its config.json).
    teacher_model: ModelConfig = required(),
    /// The frozen teacher's checkpoint (optionally with a PEFT adapter).
    teacher_checkpointer: CheckpointerConfig = required(),
    /// The divergence between the student's and the teacher's distributions.
    kd_loss: KdLossConfig = required().fingerprint(),
    /// The loss is `(1 - kd_ratio) * cross_entropy + kd_ratio * kd_loss`.
    kd_ratio: f64 = default(|| 0.5)
        .range(|v| (0.0..=1.0).contains(&v), "from 0 to 1")
        .fingerprint(),
}

pub fn run<B: AutodiffBackend>(
    cfg: &TrainConfig,
    kd: &KdKeys,
    ctx: &RunContext<B>,
    run: RunStart,
) -> Result<(), WorkerError> {
    let teacher_ckpt = &kd.teacher_checkpointer;
    let objective = teacher::kd_objective(&kd.kd_loss);
    let kd_ratio = kd.kd_ratio;
    // The student's checkpoint: a LoRA student's base, or the whole model (the checkpoint
    // being resumed, which holds every weight).
    let checkpoint = match cfg.model.is_lora() {
        true => model::open(&cfg.checkpointer, "checkpointer")?,
        false => model::policy(&cfg.checkpointer, &run)?,
    };
    // Data first: the teacher is checked against its tokenizer before its weights load.
    let data = data::train_data(cfg, &checkpoint.args, &run, &ctx.base_dir)?;

    // Student: LoRA adapters on the frozen base, or every weight.
    let (student, storage_dtype, content, shape) = if cfg.model.is_lora() {
        let loaded =
            model::load_base::<B>(&checkpoint, &cfg.model, run.load_rows(), &ctx.device)?;
        let mut student = loaded.model;
        let (plan, content) = model::lora(&mut student, cfg, &run)?;
        let student = student.set_trainable(plan.trainable());
        let shape = format!("LoRA {}", plan.describe());
        (student, loaded.storage_dtype, content, shape)
    } else {
        let loaded = model::load::<B>(&checkpoint, BaseWeights::Float, run.load_rows(), &ctx.device)?;
        let student = loaded.model.set_trainable(Trainable::All);
        let shape = format!("full, {} parameters", student.args.num_params());
        (student, loaded.storage_dtype, SaveContent::FullModel, shape)
    };

    // Teacher: frozen, on the inner backend (no autodiff graph, no optimizer state).
    let teacher_model = teacher::load::<B::InnerBackend>(
        teacher_ckpt,
        &kd.teacher_model,
        run.load_rows(),
        &student.args,
        &data.tokenizer,
        &ctx.device,
    )?;
    // FSDP: the teacher shards its layers as the student does.
    let teacher_model = match run.fsdp {
        Some(sharding) => fsdp::shard_frozen(teacher_model, &run.world, sharding.cpu_offload),
        None => teacher_model,
    };

    let seed = run.seed;
    let session = session::session(
        cfg,
        run,
        student,
        Plan::new(content, storage_dtype),
        ctx.recipe_name,
        &ctx.device,
    )?;
    session.announce(|| {
        format!(
            "Distilling {} ({} parameters) into {} ({shape}) with {objective:?}, kd_ratio {kd_ratio}, on {} samples; seed {seed}; metrics in {}",
            teacher_ckpt.checkpoint_dir.display(),
            teacher_model.args.num_params(),
            cfg.checkpointer.checkpoint_dir.display(),
            data.dataset.len(),
            session.log_dir,
        )
    });

    let mut loss = KdLoss::<B> {
        teacher: teacher_model,
        objective,
        kd_ratio,
        activation_checkpointing: crate::setup::run::checkpointing(cfg),
    };
    session.fit(&data, &mut loss, cfg.push_to_hub.as_ref())?;
    Ok(())
}
