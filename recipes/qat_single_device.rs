//! Quantization-aware full fine-tuning (torchtune's `qat_single_device.py`, and with several
//! workers `qat_distributed.py`): every weight trains while the decoder's linear layers see
//! fake-quantized int4 weights (and, for `Int8DynActInt4WeightQATQuantizer`, int8 dynamic
//! activations), optionally only after `fake_quant_after_n_steps`. Each checkpoint is a float
//! Hugging Face model; the final one also holds the real int4 export in `quantized/` (see
//! `crate::model_io::quantized`).

use burn::tensor::backend::AutodiffBackend;

use crate::config::schema::{QatKeys, TrainConfig};
use crate::models::{BaseWeights, Trainable};
use crate::setup::{data, model, quant, run as settings, session};
use crate::training::checkpointing::SaveContent;
use crate::training::sft::SftLoss;

use super::RunContext;
use crate::config::recipes::{DataKind, Layout, OwnKeysSpec, RecipeSpec, Trains};
use crate::distributed::WorkerError;
use crate::setup::run::RunStart;
use crate::setup::trainer::Plan;

pub static RECIPE: RecipeSpec = RecipeSpec {
    name: "qat",
    aliases: &["qat_single_device"],
    distributed: Some("qat_distributed"),
    description: "Quantization-aware full fine-tuning (fake-quantized int4/int8)",
    trains: Trains::Full,
    data: DataKind::Responses,
    layout: Layout::Training,
    own: OwnKeysSpec::of::<QatKeys>(),
};

pub fn run<B: AutodiffBackend>(
    cfg: &TrainConfig,
    qat: &QatKeys,
    ctx: &RunContext<B>,
    run: RunStart,
) -> Result<(), WorkerError> {
    let scheme = quant::scheme(&qat.quantizer);

    // Model: from the checkpointer, or from the checkpoint being resumed (it holds every
    // float weight); then the quantizer on the decoder's linear layers.
    let checkpoint = model::policy(&cfg.checkpointer, &run)?;
    let loaded = model::load::<B>(&checkpoint, BaseWeights::Float, run.load_rows(), &ctx.device)?;
    let mut policy = loaded.model;
    let quantized = quant::prepare(&mut policy, scheme)?;
    let policy = policy.set_trainable(Trainable::All);

    let data = data::train_data(cfg, &checkpoint.args, &run, &ctx.base_dir)?;
    let seed = run.seed;
    let session = session::session(
        cfg,
        run,
        policy,
        Plan {
            quantized_export: Some(scheme),
            ..Plan::new(SaveContent::FullModel, loaded.storage_dtype)
        },
        ctx.recipe_name,
        &ctx.device,
    )?;
    session.announce(|| {
        format!(
            "QAT full fine-tuning {} ({} parameters) with {scheme:?} on {} linear layers{}; {} samples; seed {seed}; metrics in {}",
            cfg.checkpointer.checkpoint_dir.display(),
            session.trainer.model.args.num_params(),
            quantized.len(),
            quant::delay_note(qat),
            data.dataset.len(),
            session.log_dir,
        )
    });

    let mut loss = SftLoss {
        fake_quant_after: qat.fake_quant_after_n_steps,
        activation_checkpointing: settings::checkpointing(cfg),
        output_chunks: qat.loss.output_chunks(),
        ..SftLoss::default()
    };
    session.fit(&data, &mut loss, cfg.push_to_hub.as_ref())?;
    Ok(())
}
