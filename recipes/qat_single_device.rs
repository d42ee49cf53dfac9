//! Quantization-aware full fine-tuning on one device (torchtune's `qat_single_device.py`):
//! every weight trains while the decoder's linear layers see fake-quantized int4 weights (and,
//! for `Int8DynActInt4WeightQATQuantizer`, int8 dynamic activations), optionally only after
//! `fake_quant_after_n_steps`. Each checkpoint is a float Hugging Face model; the final one
//! also holds the real int4 export in `quantized/` (see `tune::checkpoint::quantized`).

use burn::tensor::backend::AutodiffBackend;

use tune::checkpoint::hf::load_model;
use tune::config::schema::TrainConfig;
use tune::models::Trainable;
use tune::setup::{data, model, quant, run as settings};
use tune::training::checkpointing::{SaveContent, find_resume};
use tune::training::sft::SftLoss;

use super::RunContext;

pub fn run<B: AutodiffBackend>(cfg: &TrainConfig, ctx: &RunContext<B>) -> anyhow::Result<()> {
    let seed = settings::seed(cfg);
    let output_dir = settings::checkpoint_dir(cfg);
    let fingerprint = settings::fingerprint(cfg, seed);
    let scheme = quant::from_train_config(cfg)?;

    // Model: from the checkpointer, or from the checkpoint being resumed (it holds every
    // float weight); then the quantizer on the decoder's linear layers.
    let resume = if cfg.resume_from_checkpoint {
        find_resume(&output_dir, &fingerprint)?
    } else {
        None
    };
    let loaded = match &resume {
        Some(r) => {
            eprintln!(
                "Resuming from {} at step {}",
                r.dir.display(),
                r.state.global_step
            );
            load_model::<B>(&r.dir, None, &ctx.device)?
        }
        None => model::load::<B>(&cfg.checkpointer, "checkpointer", &ctx.device)?,
    };
    let storage_dtype = loaded.storage_dtype;
    let mut policy = loaded.model;
    let quantized = quant::prepare(&mut policy, scheme)?;
    let policy = policy.set_trainable(Trainable::All);

    // Data.
    let tokenizer = data::tokenizer(&cfg.tokenizer)?;
    let dataset = data::dataset(
        &cfg.dataset,
        &tokenizer,
        cfg.tokenizer.max_seq_len,
        &ctx.base_dir,
    )?;
    let loader = data::loader(&dataset, cfg.batch_size, cfg.shuffle, seed)?;

    // Optimizer, schedule, metrics, checkpoints (the final one with the quantized export).
    let (trainer, log_dir) = settings::trainer(cfg, seed, policy, resume, &ctx.device)?;
    let mut saver = settings::checkpointer(
        cfg,
        ctx.recipe.torchtune_name(),
        SaveContent::FullModel,
        fingerprint,
        storage_dtype,
    )?;
    saver.quantized_export = Some(scheme);
    eprintln!(
        "QAT full fine-tuning {} ({} parameters) with {scheme:?} on {} linear layers{}; {} samples; seed {seed}; metrics in {log_dir}",
        cfg.checkpointer.checkpoint_dir.display(),
        trainer.model.args.num_params(),
        quantized.len(),
        cfg.fake_quant_after_n_steps
            .map_or(String::new(), |n| format!(
                " (fake quantization from step {n})"
            )),
        dataset.len(),
    );

    // Train.
    let mut loss = SftLoss {
        fake_quant_after: cfg.fake_quant_after_n_steps,
        activation_checkpointing: cfg.enable_activation_checkpointing,
        output_chunks: settings::output_chunks(cfg),
    };
    let (summary, _policy) = trainer.fit(&dataset, &loader, &mut loss, &mut saver)?;
    saver.finish()?;
    super::report(&summary, saver.last_published.as_ref());
    super::push_if_configured(cfg.push_to_hub.as_ref(), saver.last_published.as_ref())
}
