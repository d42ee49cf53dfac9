//! Quantization-aware LoRA fine-tuning (torchtune's `qat_lora_finetune_single_device.py`, and
//! with several workers `qat_lora_finetune_distributed.py`): the base model stays frozen and
//! fake-quantized (int4 weights, int8 dynamic activations for
//! `Int8DynActInt4WeightQATQuantizer`) while low-rank adapters train against it; the adapters
//! see the unquantized input, as torchtune's QAT LoRA linear does. Output per checkpoint: the
//! PEFT adapter, the merged float model unless `save_adapter_weights_only: true`, and in the
//! final checkpoint the int4 export of the merged model in `quantized/`.

use burn::tensor::backend::AutodiffBackend;

use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::Checker;
use crate::config::recipes::read_checked;
use crate::config::schema::{QatKeys, TrainConfig};
use crate::setup::{data, model, quant, run as settings, session};
use crate::training::sft::SftLoss;

use crate::models::BaseWeights;
use super::RunContext;
use crate::config::recipes::{DataKind, Layout, OwnKeysSpec, RecipeSpec, Trains};
use crate::distributed::WorkerError;
use crate::setup::run::RunStart;
use crate::setup::trainer::Plan;

pub static RECIPE: RecipeSpec = RecipeSpec {
    name: "qat_lora",
    aliases: &["qat_lora_finetune_single_device"],
    distributed: Some("qat_lora_finetune_distributed"),
    description: "Quantization-aware LoRA fine-tuning",
    trains: Trains::Lora,
    data: DataKind::Responses,
    layout: Layout::Training,
    own: OwnKeysSpec {
        keys: QatKeys::KEYS,
        read: |root, train, cx| read_checked(root, train, cx, rules),
    },
};

/// QAT fake-quantizes a float base: an NF4 one (QLoRA) and DoRA have no reference to match.
fn rules(cfg: &TrainConfig, _: &QatKeys, cx: &mut Checker) {
    let builder = &cfg.model.component;
    let (name, module, size) = (
        builder.canonical_name(),
        builder.family.module(),
        &builder.size,
    );
    if cfg.model.quantizes_base() {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "model._component_",
                format!("`{name}` stores the base in NF4 (QLoRA), but QAT fake-quantizes a float base to int4: torchtune and torchao do not combine the two"),
            )
            .with_fix(format!(
                "use `tune.models.{module}.lora_{module}_{size}` without `quantize_base` for QAT + LoRA, or lora_finetune_single_device for QLoRA"
            )),
        );
    }
    if cfg.model.lora().is_some_and(|l| l.use_dora) {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "model.use_dora",
                "DoRA under QAT's fake quantization has no reference implementation to match (torchao and torchtune combine QAT with plain LoRA)",
            )
            .with_fix("set `use_dora: False`, or train DoRA with lora_finetune_single_device"),
        );
    }
}

pub fn run<B: AutodiffBackend>(
    cfg: &TrainConfig,
    qat: &QatKeys,
    ctx: &RunContext<B>,
    run: RunStart,
) -> Result<(), WorkerError> {
    let scheme = quant::scheme(&qat.quantizer);

    // Model: the frozen base from the checkpointer, fake-quantized, with LoRA adapters (a
    // resumed run's adapter weights restored).
    let checkpoint = model::open(&cfg.checkpointer, "checkpointer")?;
    let loaded = model::load::<B>(&checkpoint, BaseWeights::Float, None, &ctx.device)?;
    let mut policy = loaded.model;
    let quantized = quant::prepare(&mut policy, scheme)?;
    let (plan, content) = model::lora(&mut policy, cfg, &run)?;
    let policy = policy.set_trainable(plan.trainable());

    let data = data::train_data(cfg, &checkpoint.args, &run, &ctx.base_dir)?;
    let seed = run.seed;
    let session = session::session(
        cfg,
        run,
        policy,
        Plan {
            quantized_export: Some(scheme),
            ..Plan::new(content, loaded.storage_dtype)
        },
        ctx.recipe_name,
        &ctx.device,
    )?;
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
        output_chunks: qat.loss.output_chunks(),
        ..SftLoss::default()
    };
    session.fit(&data, &mut loss, cfg.push_to_hub.as_ref())?;
    Ok(())
}
