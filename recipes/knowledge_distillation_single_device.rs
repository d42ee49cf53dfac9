//! Knowledge distillation on one device (torchtune's `knowledge_distillation_single_device.py`).
//!
//! A frozen teacher (`teacher_checkpointer`, optionally with a PEFT adapter) runs beside the
//! student; the student minimises `(1 - kd_ratio) * cross_entropy + kd_ratio * kd_loss`, the
//! KD loss comparing its distribution with the teacher's at every labelled position. The
//! student trains LoRA adapters (a `lora_*` model component: saved as a PEFT adapter, plus
//! the merged model unless `save_adapter_weights_only: true`) or every weight (a full model
//! component: saved as a Hugging Face model). The teacher runs without autodiff and is never
//! saved; it must share the student's tokenizer, which setup checks before loading it.

use anyhow::Context;
use burn::tensor::backend::AutodiffBackend;

use tune::checkpoint::hf::load_model;
use tune::config::schema::TrainConfig;
use tune::models::Trainable;
use tune::setup::{data, model, run as settings, teacher};
use tune::training::checkpointing::{SaveContent, find_resume};
use tune::training::kd::KdLoss;

use super::RunContext;

pub fn run<B: AutodiffBackend>(cfg: &TrainConfig, ctx: &RunContext<B>) -> anyhow::Result<()> {
    let seed = settings::seed(cfg);
    let output_dir = settings::checkpoint_dir(cfg);
    let fingerprint = settings::fingerprint(cfg, seed);
    let teacher_ckpt = cfg
        .teacher_checkpointer
        .as_ref()
        .context("teacher_checkpointer: required for distillation")?;
    let kd_loss_cfg = cfg
        .kd_loss
        .as_ref()
        .context("kd_loss: required for distillation")?;
    let objective = teacher::kd_objective(kd_loss_cfg)?;
    let kd_ratio = teacher::kd_ratio(cfg.kd_ratio())?;
    let lora = model::is_lora(&cfg.model);
    let resume = if cfg.resume_from_checkpoint {
        find_resume(&output_dir, &fingerprint)?
    } else {
        None
    };

    // Tokenizer first: the teacher is checked against it before any weights load.
    let tokenizer = data::tokenizer(&cfg.tokenizer)?;

    // Student: LoRA adapters on the frozen base, or the whole model (from the checkpoint
    // being resumed, which holds every weight).
    let loaded = match (&resume, lora) {
        (Some(r), false) => load_model::<B>(&r.dir, None, &ctx.device)?,
        _ => model::load::<B>(&cfg.checkpointer, "checkpointer", &ctx.device)?,
    };
    let storage_dtype = loaded.storage_dtype;
    let mut student = loaded.model;
    let (content, shape) = if lora {
        let plan = model::lora_plan(&cfg.model)?;
        let adapter_config = model::attach_adapters(&mut student, &plan, &cfg.checkpointer, seed)?;
        if let Some(r) = &resume {
            tune::checkpoint::peft::load_adapter(&mut student, &r.dir).with_context(|| {
                format!("loading the adapter to resume from {}", r.dir.display())
            })?;
        }
        let shape = format!(
            "LoRA rank {}, alpha {}, on {}",
            plan.settings.rank,
            plan.settings.alpha,
            plan.targets.join(", ")
        );
        (
            SaveContent::Adapter {
                config: adapter_config,
                merged_model: !cfg.save_adapter_weights_only,
            },
            shape,
        )
    } else {
        (
            SaveContent::FullModel,
            format!("full, {} parameters", student.args.num_params()),
        )
    };
    if let Some(r) = &resume {
        eprintln!(
            "Resuming from {} at step {}",
            r.dir.display(),
            r.state.global_step
        );
    }
    let student = student.set_trainable(if lora {
        Trainable::AdaptersOnly
    } else {
        Trainable::All
    });

    // Teacher: frozen, on the inner backend (no autodiff graph, no optimizer state).
    let teacher_model =
        teacher::load::<B::InnerBackend>(teacher_ckpt, &student.args, &tokenizer, &ctx.device)?;

    // Data.
    let dataset = data::dataset(
        &cfg.dataset,
        &tokenizer,
        cfg.tokenizer.max_seq_len,
        &ctx.base_dir,
    )?;
    let loader = data::loader(&dataset, cfg.batch_size, cfg.shuffle, seed)?;

    // Optimizer, schedule, metrics, checkpoints.
    let (trainer, log_dir) = settings::trainer(cfg, seed, student, resume, &ctx.device)?;
    let mut saver = settings::checkpointer(
        cfg,
        ctx.recipe.torchtune_name(),
        content,
        fingerprint,
        storage_dtype,
    )?;
    eprintln!(
        "Distilling {} ({} parameters) into {} ({shape}) with {objective:?}, kd_ratio {kd_ratio}, on {} samples; seed {seed}; metrics in {log_dir}",
        teacher_ckpt.checkpoint_dir.display(),
        teacher_model.args.num_params(),
        cfg.checkpointer.checkpoint_dir.display(),
        dataset.len(),
    );

    // Train.
    let mut loss = KdLoss::<B> {
        teacher: teacher_model,
        objective,
        kd_ratio,
        activation_checkpointing: cfg.enable_activation_checkpointing,
    };
    let (summary, _student) = trainer.fit(&dataset, &loader, &mut loss, &mut saver)?;
    saver.finish()?;
    super::report(&summary, saver.last_published.as_ref());
    super::push_if_configured(cfg.push_to_hub.as_ref(), saver.last_published.as_ref())
}
