//! The recipes: one file each, reading top to bottom like torchtune's recipe scripts (set up
//! the pieces from the config, train through the shared trainer core, save). They compose the
//! library; the library never knows about them.

pub mod full_dpo_single_device;
pub mod full_finetune_single_device;
pub mod generate;
pub mod knowledge_distillation_single_device;
pub mod lora_dpo_single_device;
pub mod lora_finetune_single_device;
pub mod qat_lora_finetune_single_device;
pub mod qat_single_device;

use std::path::PathBuf;

use burn::tensor::backend::AutodiffBackend;

use tune::config::recipes::Recipe;
use tune::config::schema::RecipeConfig;
use tune::precision;

/// What every recipe gets besides its typed config.
pub struct RunContext<B: AutodiffBackend> {
    pub recipe: Recipe,
    pub device: B::Device,
    /// The resolved config as YAML, saved beside the outputs.
    pub resolved_yaml: String,
    /// Where relative dataset paths resolve from.
    pub base_dir: PathBuf,
}

pub fn run<B: AutodiffBackend>(config: &RecipeConfig, ctx: &RunContext<B>) -> anyhow::Result<()> {
    match config {
        RecipeConfig::Train(recipe, cfg) => {
            // Before any tensor exists: bf16 becomes the device's float dtype.
            precision::set_device_dtype::<B>(&ctx.device, cfg.dtype, precision::Use::Training)?;
            if cfg.dtype != tune::config::schema::Dtype::Fp32 {
                eprintln!(
                    "Training in {}: weights, activations, gradients and optimizer state; losses, norms and attention softmax upcast to fp32",
                    precision::name(cfg.dtype)
                );
            }
            // The resolved config beside the outputs, as torchtune saves it.
            std::fs::create_dir_all(&cfg.output_dir)?;
            std::fs::write(cfg.output_dir.join("tune_config.yaml"), &ctx.resolved_yaml)?;
            match recipe {
                Recipe::LoraFinetune => lora_finetune_single_device::run(cfg, ctx),
                Recipe::FullFinetune => full_finetune_single_device::run(cfg, ctx),
                Recipe::LoraDpo => lora_dpo_single_device::run(cfg, ctx),
                Recipe::FullDpo => full_dpo_single_device::run(cfg, ctx),
                Recipe::KnowledgeDistillation => {
                    knowledge_distillation_single_device::run(cfg, ctx)
                }
                Recipe::Qat => qat_single_device::run(cfg, ctx),
                Recipe::QatLora => qat_lora_finetune_single_device::run(cfg, ctx),
                other => anyhow::bail!(
                    "the {} recipe is not implemented yet in this version of tune; its configs validate, but `tune run` cannot train them",
                    other.torchtune_name()
                ),
            }
        }
        RecipeConfig::Generate(cfg) => generate::run(cfg, ctx),
    }
}

/// The DPO recipes train on chosen / rejected pairs; an SFT dataset has no rejected side.
pub fn require_preference_data(dataset: &tune::data::Dataset) -> anyhow::Result<()> {
    match dataset.samples() {
        tune::data::Samples::Preference(_) => Ok(()),
        _ => anyhow::bail!(
            "dataset: DPO trains on preference pairs, but this dataset has no chosen/rejected responses; use \
             torchtune.datasets.preference_dataset, hh_rlhf_helpful_dataset or stack_exchange_paired_dataset"
        ),
    }
}

/// The closing lines of a training run.
pub fn report(
    summary: &tune::training::trainer::TrainSummary,
    last: Option<&tune::checkpoint_client::PublishedCheckpoint>,
) {
    let first = summary.losses.first().copied().unwrap_or(f64::NAN);
    let last_loss = summary.losses.last().copied().unwrap_or(f64::NAN);
    eprintln!(
        "Trained {} steps ({} tokens): loss {first:.4} -> {last_loss:.4}",
        summary.state.global_step, summary.state.tokens_seen
    );
    if let Some(p) = last {
        eprintln!("Saved {}", p.dir.display());
    }
}

/// `push_to_hub: {repo_id, private}`: uploads the final checkpoint when the run finishes.
pub fn push_if_configured(
    push: Option<&tune::config::schema::PushToHub>,
    last: Option<&tune::checkpoint_client::PublishedCheckpoint>,
) -> anyhow::Result<()> {
    let (Some(push), Some(last)) = (push, last) else {
        return Ok(());
    };
    let report = tune::hub::push(tune::hub::PushOptions {
        dir: last.dir.clone(),
        repo_id: push.repo_id.clone(),
        private: push.private,
        commit_message: Some(format!("Upload {} trained with tune", last.name)),
        progress: true,
        ..Default::default()
    })?;
    eprintln!("Pushed {} to {}", last.dir.display(), report.repo_url);
    Ok(())
}
