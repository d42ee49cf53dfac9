//! The recipes: one file each, reading top to bottom like torchtune's recipe scripts (set up
//! the pieces from the config, train through the shared trainer core, save). Each file
//! declares its recipe whole: its names, what it trains, its own keys and their rules
//! (`RECIPE`), and what it builds (`run`). They compose the library; the library never knows
//! about them: the registry below is the one list of them, and `tune ls`, the built-in configs,
//! validation by name and the dispatcher all read it. A new recipe is its file, its name in
//! the list, and its configs.

use std::path::PathBuf;

use burn::tensor::backend::AutodiffBackend;

use crate::config::recipes::{OwnKeys, RecipeSpec, UnknownRecipe, find_in};
use crate::config::schema::TrainConfig;
use crate::config::{
    ResolvedConfig, ValidateOptions, ValidationErrors, Warning, builtin, schema::RecipeConfig,
};
use crate::distributed::{WorkerError, World};
use crate::precision;
use crate::setup::run::RunStart;

/// Declares the recipes: their modules, the registry in `tune ls` order, and the dispatch to
/// each one's `run` with its own keys as the type it declared.
macro_rules! registry {
    (training: [$($train:ident),* $(,)?], alone: [$($alone:ident),* $(,)?] $(,)?) => {
        $(pub mod $train;)*
        $(pub mod $alone;)*

        /// Every recipe, in `tune ls` order.
        pub static RECIPES: &[&RecipeSpec] = &[$(&$train::RECIPE,)* $(&$alone::RECIPE,)*];

        /// Runs the training recipe `spec` after the shared prologue.
        fn train<B: AutodiffBackend>(
            spec: &'static RecipeSpec,
            cfg: &TrainConfig,
            own: &dyn OwnKeys,
            ctx: &RunContext<B>,
            run: RunStart,
        ) -> Result<(), WorkerError> {
            $(
                if std::ptr::eq(spec, &$train::RECIPE) {
                    return $train::run(cfg, own_keys(own, spec)?, ctx, run);
                }
            )*
            Err(not_registered(spec))
        }

        /// Runs a recipe that does not train.
        fn alone<B: AutodiffBackend>(
            spec: &'static RecipeSpec,
            own: &dyn OwnKeys,
            ctx: &RunContext<B>,
        ) -> Result<(), WorkerError> {
            $(
                if std::ptr::eq(spec, &$alone::RECIPE) {
                    return $alone::run(own_keys(own, spec)?, ctx).map_err(WorkerError::failed);
                }
            )*
            Err(not_registered(spec))
        }
    };
}

registry! {
    training: [
        full_finetune_single_device,
        lora_finetune_single_device,
        lora_dpo_single_device,
        full_dpo_single_device,
        qat_single_device,
        qat_lora_finetune_single_device,
        knowledge_distillation_single_device,
        grpo_full_finetune_single_device,
        grpo_lora_finetune_single_device,
        ppo_full_finetune_single_device,
    ],
    alone: [generate],
}

/// A recipe's own keys as the type its `run` takes; validation read them as its spec says, so
/// another type is a bug in the registry, reported rather than panicked on.
fn own_keys<'a, K: 'static>(own: &'a dyn OwnKeys, spec: &RecipeSpec) -> Result<&'a K, WorkerError> {
    own.get::<K>().ok_or_else(|| {
        WorkerError::failed(anyhow::anyhow!(
            "recipe `{spec}`: its keys were read as another type than its run takes (a bug in tune: please report it)"
        ))
    })
}

fn not_registered(spec: &RecipeSpec) -> WorkerError {
    WorkerError::failed(anyhow::anyhow!(
        "recipe `{spec}` is not in the registry (a bug in tune: please report it)"
    ))
}

/// Finds a recipe by tune's name or a torchtune script name (`.py` ignored).
pub fn find(name: &str) -> Result<&'static RecipeSpec, UnknownRecipe> {
    find_in(RECIPES, name)
}

/// Whether `name` is one of torchtune's `*_distributed` recipe names.
pub fn is_distributed_name(name: &str) -> bool {
    RECIPES.iter().any(|r| r.is_distributed_name(name))
}

/// The recipe a built-in config is for (the script its first line names), and whether it is
/// the `*_distributed` one.
pub fn builtin_recipe(config: &builtin::BuiltinConfig) -> Option<(&'static RecipeSpec, bool)> {
    config
        .header_words()
        .find_map(|word| find(word).ok().map(|r| (r, r.is_distributed_name(word))))
}

/// Validates `cfg` for the recipe named `recipe`, with every check on.
pub fn validate(
    recipe: &str,
    cfg: &ResolvedConfig,
) -> Result<(RecipeConfig, Vec<Warning>), ValidationErrors> {
    validate_with(recipe, cfg, &ValidateOptions::default())
}

/// Validates `cfg` for the recipe named `recipe`.
pub fn validate_with(
    recipe: &str,
    cfg: &ResolvedConfig,
    opts: &ValidateOptions,
) -> Result<(RecipeConfig, Vec<Warning>), ValidationErrors> {
    let spec = find(recipe).map_err(|e| ValidationErrors {
        source_name: cfg.source.clone(),
        problems: vec![crate::config::Problem::new(
            crate::config::ProblemKind::UnknownRecipe,
            "recipe",
            e.to_string(),
        )],
    })?;
    crate::config::validate::validate_with(spec, cfg, opts)
}

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
    // The checkpoint client's lines follow `log_level` as tune's own do.
    crate::checkpoint_client::set_notify(|notice, line| match notice {
        crate::checkpoint_client::Notice::Info => crate::say!("{line}"),
        crate::checkpoint_client::Notice::Warning => crate::say_warn!("{line}"),
        crate::checkpoint_client::Notice::Error => eprintln!("{line}"),
    });
    let Some(cfg) = config.as_train() else {
        // Generation runs on one worker, with no stop handler: any failure is just that.
        return alone(config.recipe, config.own.as_ref(), ctx);
    };
    if let Some(level) = cfg.log_level {
        crate::verbosity::set(level);
    }
    // Before any tensor exists: bf16 becomes the device's float dtype.
    precision::set_device_dtype::<B>(&ctx.device, cfg.dtype, precision::Use::Training)?;
    // `attention`: the fused kernels or burn's composed ops, for every model of the run.
    crate::kernels::set_fused_attention(cfg.attention == crate::config::schema::Attention::Fused);
    // One run per directory it writes (rank 0 holds the locks for the whole run).
    let _locks = if ctx.world.is_main() {
        Some(crate::setup::run::lock_run_dirs(cfg)?)
    } else {
        None
    };
    if ctx.world.is_main() && cfg.dtype != precision::Dtype::Fp32 {
        crate::say!(
            "Training in {}: weights, activations, gradients and optimizer state; losses, norms and attention softmax upcast to fp32",
            precision::name(cfg.dtype)
        );
    }
    // Every worker joins before training; the shared prologue then checks that all of them run
    // the same version and the same run, and that the output directory holds no other run's
    // checkpoints.
    ctx.world.join::<B::InnerBackend>(&ctx.device)?;
    let run = crate::setup::run::start::<B::InnerBackend>(config, ctx.world.clone(), &ctx.device)?;
    if ctx.world.is_main() {
        // The resolved config beside the outputs, as torchtune saves it; only once the
        // directory is known to be this run's.
        let path = cfg.output_dir.join("tune_config.yaml");
        std::fs::write(&path, &ctx.resolved_yaml).map_err(|source| {
            crate::setup::SetupError::Io {
                what: "output_dir",
                path,
                source,
            }
        })?;
    }
    let outcome = train(config.recipe, cfg, config.own.as_ref(), ctx, run);
    if outcome.is_ok() {
        ctx.world.leave::<B::InnerBackend>();
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(name: &str) -> &'static str {
        find(name).map(|r| r.name).unwrap_or("none")
    }

    /// tune's names, torchtune's script names (`.py` or not) and its `*_distributed` names
    /// all find their recipe; torchtune's GRPO is a dev recipe, distributed by name.
    #[test]
    fn aliases_and_py_suffix() {
        assert_eq!(named("lora_finetune"), "lora_finetune");
        assert_eq!(named("lora_finetune_single_device"), "lora_finetune");
        assert_eq!(named("lora_finetune_single_device.py"), "lora_finetune");
        assert_eq!(named("lora_finetune_distributed"), "lora_finetune");
        assert_eq!(
            named("knowledge_distillation_single_device"),
            "knowledge_distillation"
        );
        assert_eq!(
            named("knowledge_distillation_distributed.py"),
            "knowledge_distillation"
        );
        assert_eq!(
            qat_lora_finetune_single_device::RECIPE.torchtune_name(),
            "qat_lora_finetune_single_device"
        );
        assert!(is_distributed_name("full_dpo_distributed"));
        assert!(!is_distributed_name("full_dpo_single_device"));
        assert_eq!(
            qat_single_device::RECIPE.script_name(true),
            "qat_distributed"
        );
        assert_eq!(generate::RECIPE.script_name(true), "generate");
        assert_eq!(
            named("dev/grpo_full_finetune_distributed"),
            "grpo_full_finetune"
        );
        assert!(is_distributed_name("dev/grpo_full_finetune_distributed.py"));
        assert!(!is_distributed_name("grpo_full_finetune_single_device"));
    }

    #[test]
    fn unknown_lists_known() {
        let err = find("lora_finetun")
            .map(|r| r.name)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("unknown recipe `lora_finetun` (did you mean"),
            "{err}"
        );
        assert!(
            err.contains("known recipes: full_finetune, lora_finetune"),
            "{err}"
        );
    }

    /// Every name of every recipe finds that recipe and no other.
    #[test]
    fn no_two_recipes_answer_to_one_name() {
        for recipe in RECIPES {
            let names = std::iter::once(recipe.name)
                .chain(recipe.aliases.iter().copied())
                .chain(recipe.distributed);
            for name in names {
                let found: Vec<&str> = RECIPES
                    .iter()
                    .filter(|r| r.answers_to(name))
                    .map(|r| r.name)
                    .collect();
                assert_eq!(found, vec![recipe.name], "{name}");
            }
        }
    }
}
