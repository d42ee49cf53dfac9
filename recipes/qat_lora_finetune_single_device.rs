//! Quantization-aware LoRA fine-tuning (torchtune's `qat_lora_finetune_single_device.py`, and
//! with several workers `qat_lora_finetune_distributed.py`): the base model stays frozen and
//! fake-quantized (int4 weights, int8 dynamic activations for
//! `Int8DynActInt4WeightQATQuantizer`) while low-rank adapters train against it; the adapters
//! see the unquantized input, as torchtune's QAT LoRA linear does. Output per checkpoint: the
//! PEFT adapter, the merged float model unless `save_adapter_weights_only: true`, and in the
//! final checkpoint the int4 export of the merged model in `quantized/`.

use burn::tensor::backend::AutodiffBackend;

use tune::config::schema::{QatKeys, TrainConfig};
use tune::setup::{data, model, quant, run as settings, session};
use tune::training::sft::SftLoss;

use super::RunContext;
use tune::distributed::WorkerError;
use tune::setup::run::RunStart;

pub fn run<B: AutodiffBackend>(
    cfg: &TrainConfig,
    qat: &QatKeys,
    ctx: &RunContext<B>,
    run: RunStart,
) -> Result<(), WorkerError> {
    let scheme = quant::scheme(&qat.quantizer);

    // Model: the frozen base from the checkpointer, fake-quantized, with LoRA adapters (a
    // resumed run's adapter weights restored).
    let loaded = model::load::<B>(&cfg.checkpointer, "checkpointer", &ctx.device)?;
    let mut policy = loaded.model;
    let quantized = quant::prepare(&mut policy, scheme)?;
    let (plan, content) = model::lora(&mut policy, cfg, &run)?;
    let policy = policy.set_trainable(plan.trainable());

    let data = data::train_data(cfg, &run, &ctx.base_dir)?;
    let seed = run.seed;
    let session = session::session(
        cfg,
        run,
        policy,
        content,
        loaded.storage_dtype,
        ctx.recipe_name,
        &ctx.device,
    )?
    .with_quantized_export(scheme)?;
    session.announce(|| {
        format!(
            "QAT LoRA fine-tuning {} ({}) with {scheme:?} on {} linear layers{}; {} samples; seed {seed}; metrics in {}",
            cfg.checkpointer.checkpoint_dir.display(),
            plan.describe(),
            quantized.len(),
            quant::delay_note(qat),
            data.dataset.len(),
            session.log_dir,
        )
    });

    let mut loss = SftLoss {
        fake_quant_after: qat.fake_quant_after_n_steps,
        activation_checkpointing: settings::checkpointing(cfg),
        output_chunks: settings::output_chunks(cfg),
        ..SftLoss::default()
    };
    session.fit(&data, &mut loss, cfg.push_to_hub.as_ref())?;
    Ok(())
}
