//! The recipes: one file each, reading top to bottom like torchtune's recipe scripts (set up
//! the pieces from the config, train through the shared trainer core, save). They compose the
//! library; the library never knows about them.

pub mod full_dpo_single_device;
pub mod full_finetune_single_device;
pub mod generate;
pub mod grpo_full_finetune_single_device;
pub mod grpo_lora_finetune_single_device;
pub mod knowledge_distillation_single_device;
pub mod lora_dpo_single_device;
pub mod lora_finetune_single_device;
pub mod ppo_full_finetune_single_device;
pub mod qat_lora_finetune_single_device;
pub mod qat_single_device;

use std::path::PathBuf;

use burn::tensor::backend::AutodiffBackend;

use tune::config::schema::{RecipeConfig, RecipeKeys};
use tune::distributed::{WorkerError, World};
use tune::precision;

/// What every recipe gets besides its typed config.
pub struct RunContext<B: AutodiffBackend> {
    /// torchtune's script name the run was started as (`lora_finetune_distributed`, ...),
    /// recorded in every checkpoint.
    pub recipe_name: &'static str,
    pub device: B::Device,
    /// The resolved config as YAML, saved beside the outputs.
    pub resolved_yaml: String,
    /// Where relative dataset paths resolve from.
    pub base_dir: PathBuf,
    /// This worker among the data-parallel workers; a world of one on one device.
    pub world: World,
}

/// Runs the recipe `config` is for; its error says how it ended the worker's run (a stop
/// signal, a failed collective call, or another failure).
pub fn run<B: AutodiffBackend>(
    config: &RecipeConfig,
    ctx: &RunContext<B>,
) -> Result<(), WorkerError> {
    match config {
        RecipeConfig::Train(own, cfg) => {
            // Before any tensor exists: bf16 becomes the device's float dtype.
            precision::set_device_dtype::<B>(&ctx.device, cfg.dtype, precision::Use::Training)?;
            // `attention`: the fused kernels or burn's composed ops, for every model of the run.
            tune::kernels::set_fused_attention(
                cfg.attention == tune::config::schema::Attention::Fused,
            );
            // One run per directory it writes (rank 0 holds the locks for the whole run).
            let _locks = if ctx.world.is_main() {
                Some(tune::setup::run::lock_run_dirs(cfg)?)
            } else {
                None
            };
            if ctx.world.is_main() && cfg.dtype != tune::precision::Dtype::Fp32 {
                eprintln!(
                    "Training in {}: weights, activations, gradients and optimizer state; losses, norms and attention softmax upcast to fp32",
                    precision::name(cfg.dtype)
                );
            }
            // Every worker joins before training; the shared prologue then checks that all of
            // them run the same version and the same run, and that the output directory holds
            // no other run's checkpoints.
            ctx.world.join::<B::InnerBackend>(&ctx.device)?;
            let run = tune::setup::run::start::<B::InnerBackend>(
                cfg,
                own,
                ctx.world.clone(),
                &ctx.device,
            )?;
            if ctx.world.is_main() {
                // The resolved config beside the outputs, as torchtune saves it; only once the
                // directory is known to be this run's.
                let path = cfg.output_dir.join("tune_config.yaml");
                std::fs::write(&path, &ctx.resolved_yaml).map_err(|source| {
                    tune::setup::SetupError::Io {
                        what: "output_dir",
                        path,
                        source,
                    }
                })?;
            }
            let outcome = match own {
                RecipeKeys::LoraFinetune => lora_finetune_single_device::run(cfg, ctx, run),
                RecipeKeys::FullFinetune => full_finetune_single_device::run(cfg, ctx, run),
                RecipeKeys::LoraDpo => lora_dpo_single_device::run(cfg, ctx, run),
                RecipeKeys::FullDpo(keys) => full_dpo_single_device::run(cfg, keys, ctx, run),
                RecipeKeys::KnowledgeDistillation(keys) => {
                    knowledge_distillation_single_device::run(cfg, keys, ctx, run)
                }
                RecipeKeys::Qat(keys) => qat_single_device::run(cfg, keys, ctx, run),
                RecipeKeys::QatLora(keys) => {
                    qat_lora_finetune_single_device::run(cfg, keys, ctx, run)
                }
                RecipeKeys::GrpoFull(keys) => {
                    grpo_full_finetune_single_device::run(cfg, keys, ctx, run)
                }
                RecipeKeys::GrpoLora(keys) => {
                    grpo_lora_finetune_single_device::run(cfg, keys, ctx, run)
                }
                RecipeKeys::PpoFull(keys) => {
                    ppo_full_finetune_single_device::run(cfg, keys, ctx, run)
                }
            };
            if outcome.is_ok() {
                ctx.world.leave::<B::InnerBackend>();
            }
            outcome
        }
        // Generation runs on one worker, with no stop handler: any failure is just that.
        RecipeConfig::Generate(cfg) => generate::run(cfg, ctx).map_err(WorkerError::failed),
    }
}
