//! Quantization-aware LoRA fine-tuning on one device (torchtune's
//! `qat_lora_finetune_single_device.py`): the base model stays frozen and fake-quantized
//! (int4 weights, int8 dynamic activations for `Int8DynActInt4WeightQATQuantizer`) while
//! low-rank adapters train against it; the adapters see the unquantized input, as torchtune's
//! QAT LoRA linear does. Output per checkpoint: the PEFT adapter, the merged float model
//! unless `save_adapter_weights_only: true`, and in the final checkpoint the int4 export of
//! the merged model in `quantized/`.

use anyhow::Context;
use burn::tensor::backend::AutodiffBackend;

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

    // Model: the frozen base from the checkpointer, fake-quantized, with LoRA adapters.
    let loaded = model::load::<B>(&cfg.checkpointer, "checkpointer", &ctx.device)?;
    let storage_dtype = loaded.storage_dtype;
    let mut policy = loaded.model;
    let quantized = quant::prepare(&mut policy, scheme)?;
    let plan = model::lora_plan(&cfg.model)?;
    let adapter_config = model::attach_adapters(&mut policy, &plan, &cfg.checkpointer, seed)?;

    // Resume: the adapter and optimizer state of the latest complete checkpoint.
    let resume = if cfg.resume_from_checkpoint {
        find_resume(&output_dir, &fingerprint)?
    } else {
        None
    };
    if let Some(r) = &resume {
        tune::checkpoint::peft::load_adapter(&mut policy, &r.dir)
            .with_context(|| format!("loading the adapter to resume from {}", r.dir.display()))?;
        eprintln!(
            "Resuming from {} at step {}",
            r.dir.display(),
            r.state.global_step
        );
    }
    let policy = policy.set_trainable(Trainable::AdaptersOnly);

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
    let content = SaveContent::Adapter {
        config: adapter_config,
        merged_model: !cfg.save_adapter_weights_only,
    };
    let mut saver = settings::checkpointer(
        cfg,
        ctx.recipe.torchtune_name(),
        content,
        fingerprint,
        storage_dtype,
    )?;
    saver.quantized_export = Some(scheme);
    eprintln!(
        "QAT LoRA fine-tuning {} (rank {}, alpha {}, on {}) with {scheme:?} on {} linear layers{}; {} samples; seed {seed}; metrics in {log_dir}",
        cfg.checkpointer.checkpoint_dir.display(),
        plan.settings.rank,
        plan.settings.alpha,
        plan.targets.join(", "),
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
