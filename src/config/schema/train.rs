//! The top-level keys of the training recipes: those every one reads ([`TrainConfig`]) and
//! those only some read ([`RecipeKeys`]: QAT's quantizer, distillation's teacher, full DPO's
//! reference).

use std::path::PathBuf;

use serde::Serialize;
use serde_yaml::{Mapping, Value};

use super::{
    CheckpointerConfig, Datasets, LossConfig, LrSchedulerConfig, MetricLoggerConfig, ModelConfig,
    OptimizerConfig, ProfilerConfig, QuantizerConfig, TokenizerConfig,
};
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{
    Checker, Fingerprint, FingerprintEntries, KeyInfo, default, keys, off, on, optional, required,
};
use crate::config::recipes::Recipe;
use crate::config::values::choices;
use crate::precision::Dtype;

/// Where a run computes (also `tune bench --device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    Cpu,
    Cuda,
    /// burn's cubecl backend on wgpu: Vulkan, Metal or DX12 (a `wgpu` build).
    Wgpu,
}

choices!(Device {
    "cpu" => Device::Cpu,
    "cuda" => Device::Cuda,
    "wgpu" => Device::Wgpu,
});

choices!(Dtype {
    "fp32" => Dtype::Fp32,
    "bf16" => Dtype::Bf16,
    "fp16" => Dtype::Fp16,
    "float32" => Dtype::Fp32,
    "bfloat16" => Dtype::Bf16,
    "float16" => Dtype::Fp16,
});

/// The dtypes training runs in: fp16 is refused, as torchtune's recipes refuse it (no loss
/// scaling), before a run starts.
const TRAIN_DTYPES: &[&str] = &["fp32", "bf16", "float32", "bfloat16"];

fn trains_in(dtype: &Dtype, path: &str, cx: &mut Checker) {
    if *dtype == Dtype::Fp16 {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                path,
                format!("expected one of {}, found `fp16`", TRAIN_DTYPES.join(", ")),
            )
            .with_fix("train in bf16 or fp32: fp16's range overflows without loss scaling"),
        );
    }
}

/// The modules `custom_sharded_layers` may name, as torchtune's configs name them: tune's FSDP
/// shards every weight and always makes these units of their own (gathered for their own
/// forward and backward, apart from the decoder layers), so listing them, or leaving them out,
/// changes nothing; torchtune's root unit (the final norm) is one too.
const OWN_UNITS: &[&str] = &["tok_embeddings", "output"];

fn own_units(names: &Option<Vec<String>>, path: &str, cx: &mut Checker) {
    for name in names.iter().flatten() {
        if !OWN_UNITS.contains(&name.as_str()) {
            cx.problem(
                Problem::new(
                    ProblemKind::InvalidValue,
                    path,
                    format!("expected names among {}, found `{name}`", OWN_UNITS.join(", ")),
                )
                .with_fix(
                    "tune's FSDP units are the decoder layers, tok_embeddings and output: remove the name",
                ),
            );
        }
    }
}
keys! {
    /// `push_to_hub`: upload the final checkpoint when the run finishes.
    pub struct PushToHub {
        section: "push_to_hub",
    }
    /// The Hub repository (`user/name`), created when missing.
    repo_id: String = required(),
    /// Create the repository private.
    private: bool = off(),
}

keys! {
    /// The keys every training recipe reads.
    pub struct TrainConfig {
        rule: train_rules,
    }
    /// Where the resolved config, the metrics and (without `checkpointer.output_dir`) the
    /// checkpoints go.
    output_dir: PathBuf = required(),
    /// The model to train.
    model: ModelConfig = required().fingerprint(),
    /// Its tokenizer.
    tokenizer: TokenizerConfig = required().fingerprint(),
    /// The checkpoint it loads, and where checkpoints go.
    checkpointer: CheckpointerConfig = required(),
    /// Continue from the latest complete checkpoint in the checkpoint directory.
    resume_from_checkpoint: bool = off(),
    /// The training data (a list is concatenated).
    dataset: Datasets = required().fingerprint(),
    /// Validation data, scored every `run_val_every_n_steps` and at each epoch's end.
    dataset_val: Option<Datasets> = optional(),
    /// Seeds initialisation and dropout (null: drawn at random and reported).
    seed: Option<u64> = optional().fingerprint(),
    /// Shuffle the samples every epoch (torchtune's order).
    shuffle: bool = on().fingerprint(),
    /// Samples per step on each worker.
    batch_size: usize = required().range(|v| v >= 1.0, "at least 1").fingerprint(),
    /// The validation batch size (default `batch_size`).
    batch_size_val: Option<usize> = optional(),
    /// The optimizer.
    optimizer: OptimizerConfig = required().fingerprint(),
    /// The learning-rate schedule (none: constant).
    lr_scheduler: Option<LrSchedulerConfig> = optional(),
    /// The loss.
    loss: LossConfig = required().fingerprint().rule(super::loss::recipe_loss),
    /// Passes over the data.
    epochs: usize = required().range(|v| v >= 1.0, "at least 1"),
    /// At most this many optimizer steps per epoch.
    max_steps_per_epoch: Option<usize> = optional().range(|v| v >= 1.0, "at least 1, or null for no limit"),
    /// Micro-batches summed into each optimizer step.
    gradient_accumulation_steps: usize = default(|| 1)
        .range(|v| v >= 1.0, "at least 1")
        .fingerprint(),
    /// Clip the gradient's global norm to this (null: no clipping).
    clip_grad_norm: Option<f64> = optional().range(|v| v > 0.0, "greater than 0, or null for no clipping"),
    /// `cpu`, `cuda` or `wgpu` (null: CUDA in a CUDA build, else the CPU).
    device: Option<Device> = optional(),
    /// The float precision of weights, activations, gradients and optimizer state.
    dtype: Dtype = default(Dtype::default).rule(trains_in),
    /// Recompute each decoder layer in the backward pass instead of keeping its activations.
    enable_activation_checkpointing: bool = off(),
    /// torchtune's activation offloading: not supported (activations stay on the device).
    enable_activation_offloading: bool = off().warn(
        "activation offloading is not supported; activations stay on the device",
    ),
    /// torch.compile: nothing to compile here.
    compile: bool = off().warn("torch.compile has no equivalent here; running uncompiled"),
    /// Log the metrics every this many steps.
    log_every_n_steps: usize = default(|| 1).range(|v| v >= 1.0, "at least 1"),
    /// torchtune's flag for memory metrics: tune always logs `peak_memory_bytes`.
    log_peak_memory_stats: bool = off(),
    /// torchtune's log level.
    log_level: Option<String> = optional(),
    /// A fresh run may delete the checkpoints another run left in its checkpoint directory
    /// (without it, such a run is refused).
    overwrite_output_dir: bool = off(),
    /// On SIGINT/SIGTERM, save a checkpoint at the step boundary before exiting.
    save_on_preempt: bool = off(),
    /// LoRA recipes: save the adapter only, not the merged model too.
    save_adapter_weights_only: bool = off(),
    /// Also checkpoint every this many optimizer steps (null: at epoch ends only).
    save_every_n_steps: Option<usize> = optional().range(|v| v >= 1.0, "at least 1, or null"),
    /// Keep only this many newest checkpoints (also `checkpointer.keep_last_n_checkpoints`).
    keep_last_n_checkpoints: Option<usize> = optional().range(|v| v >= 1.0, "at least 1, or null to keep all"),
    /// torchtune's QLoRA configs: checkpoints always load memory-mapped, one tensor at a time.
    low_cpu_ram: bool = off(),
    /// torchtune's profiler.
    profiler: Option<ProfilerConfig> = optional(),
    /// torchtune's optimizer-in-backward: not supported (the optimizer steps after backward).
    optimizer_in_bwd: bool = off().warn(
        "optimizer-in-backward is not supported; the optimizer steps after backward",
    ),
    /// FSDP's units of their own besides the decoder layers (`tok_embeddings`, `output`):
    /// tune always shards both as units of their own.
    custom_sharded_layers: Option<Vec<String>> = optional().rule(own_units),
    /// FSDP: free each layer's gathered weights after its forward and gather them again for
    /// its backward (True, the default), or keep them from the forward until the backward
    /// (False: one all-gather per layer per step, the whole layers held meanwhile).
    fsdp_reshard_after_forward: Option<bool> = optional(),
    /// FSDP's CPU offload: only False (parameters stay on the device).
    fsdp_cpu_offload: bool = off().refuse(
        "offloading parameters, gradients and optimizer state to the CPU is not supported: tune keeps them on the device; set fsdp_cpu_offload: False",
    ),
    /// Tensor parallelism: only 1.
    tensor_parallel_dim: Option<usize> = optional().range(
        |v| v == 1.0,
        "1: tune has no tensor parallelism, every rank holds the whole model",
    ),
    /// A tensor-parallel plan: unused at `tensor_parallel_dim: 1`.
    tensor_parallel_plan: Option<Value> = optional(),
    /// FSDP: -1 (the default) or the number of ranks shards every decoder layer's weights,
    /// gradients and optimizer state over the ranks; 1 keeps whole weights on every rank
    /// (optimizer state split, ZeRO-1). Only with several ranks.
    data_parallel_shard_dim: Option<f64> = optional().range(
        |v| v == -1.0 || (v >= 1.0 && v.fract() == 0.0),
        "-1 (all ranks) or the number of ranks",
    ),
    /// HSDP's replica groups: only 1.
    data_parallel_replicate_dim: Option<usize> = optional().range(
        |v| v == 1.0,
        "1: tune has no replication groups (HSDP), all ranks form one data-parallel group",
    ),
    /// Upload the final checkpoint to the Hub.
    push_to_hub: Option<PushToHub> = optional(),
    /// Score `dataset_val` every this many steps (and at each epoch's end).
    run_val_every_n_steps: Option<usize> = optional(),
    /// Where metrics go (default: metrics.jsonl under `<output_dir>/logs`).
    metric_logger: Option<MetricLoggerConfig> = optional(),
}

impl TrainConfig {
    /// Where checkpoints go: `checkpointer.output_dir`, else `output_dir`.
    pub fn checkpoint_dir(&self) -> &std::path::Path {
        self.checkpointer
            .output_dir
            .as_deref()
            .unwrap_or(&self.output_dir)
    }

    /// The config key that chose [`Self::checkpoint_dir`].
    pub fn checkpoint_dir_key(&self) -> &'static str {
        if self.checkpointer.output_dir.is_some() {
            "checkpointer.output_dir"
        } else {
            "output_dir"
        }
    }

    /// `keep_last_n_checkpoints`, at the top level or where torchtune main puts it.
    pub fn keep_last_n_checkpoints(&self) -> Option<usize> {
        self.keep_last_n_checkpoints
            .or(self.checkpointer.keep_last_n_checkpoints)
    }
}

/// Keys that only mean something together.
fn train_rules(c: &TrainConfig, _: &str, cx: &mut Checker) {
    if let (Some(top), Some(nested)) = (
        c.keep_last_n_checkpoints,
        c.checkpointer.keep_last_n_checkpoints,
    ) && top != nested
    {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "checkpointer.keep_last_n_checkpoints",
                format!("is {nested}, but the top-level keep_last_n_checkpoints is {top}"),
            )
            .with_fix("keep one of the two"),
        );
    }
    if c.run_val_every_n_steps.is_some() && c.dataset_val.is_none() {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "run_val_every_n_steps",
                "is set, but there is no `dataset_val` to validate on (torchtune refuses this too)",
            )
            .with_fix("add a `dataset_val` section, or set `run_val_every_n_steps: null`"),
        );
    }
}

keys! {
    /// Quantization-aware training's own keys.
    pub struct QatKeys {}
    /// The fake quantization to train under.
    quantizer: QuantizerConfig = required().fingerprint(),
    /// Train this many steps in float first (null: fake-quantize from the start).
    fake_quant_after_n_steps: Option<usize> = optional(),
}

keys! {
    /// Knowledge distillation's own keys.
    pub struct KdKeys {}
    /// The teacher's builder (its architecture comes from its config.json).
    teacher_model: ModelConfig = required(),
    /// The frozen teacher's checkpoint (optionally with a PEFT adapter).
    teacher_checkpointer: CheckpointerConfig = required(),
    /// The divergence between the student's and the teacher's distributions.
    kd_loss: LossConfig = required().fingerprint().rule(super::loss::kd_loss),
    /// The loss is `(1 - kd_ratio) * cross_entropy + kd_ratio * kd_loss`.
    kd_ratio: f64 = default(|| 0.5)
        .range(|v| (0.0..=1.0).contains(&v), "from 0 to 1")
        .fingerprint(),
}

keys! {
    /// Full DPO's own keys.
    pub struct FullDpoKeys {}
    /// The frozen reference model (usually the checkpoint being trained).
    ref_checkpointer: CheckpointerConfig = required(),
}

/// A training recipe, with the keys only it reads.
#[derive(Debug, Clone, PartialEq)]
pub enum RecipeKeys {
    FullFinetune,
    LoraFinetune,
    LoraDpo,
    FullDpo(Box<FullDpoKeys>),
    Qat(Box<QatKeys>),
    QatLora(Box<QatKeys>),
    KnowledgeDistillation(Box<KdKeys>),
}

impl RecipeKeys {
    pub fn recipe(&self) -> Recipe {
        match self {
            Self::FullFinetune => Recipe::FullFinetune,
            Self::LoraFinetune => Recipe::LoraFinetune,
            Self::LoraDpo => Recipe::LoraDpo,
            Self::FullDpo(_) => Recipe::FullDpo,
            Self::Qat(_) => Recipe::Qat,
            Self::QatLora(_) => Recipe::QatLora,
            Self::KnowledgeDistillation(_) => Recipe::KnowledgeDistillation,
        }
    }

    /// The top-level keys `recipe` reads besides [`TrainConfig`]'s (none for generation,
    /// whose keys are all its own).
    pub fn keys_of(recipe: Recipe) -> &'static [KeyInfo] {
        match recipe {
            Recipe::Qat | Recipe::QatLora => QatKeys::KEYS,
            Recipe::KnowledgeDistillation => KdKeys::KEYS,
            Recipe::FullDpo => FullDpoKeys::KEYS,
            Recipe::FullFinetune | Recipe::LoraFinetune | Recipe::LoraDpo | Recipe::Generate => &[],
        }
    }

    /// Reads `recipe`'s own keys from the top-level mapping (`None` for generation, which is
    /// no training recipe, or after reporting a problem).
    pub fn read(recipe: Recipe, root: &Mapping, cx: &mut Checker) -> Option<Self> {
        Some(match recipe {
            Recipe::FullFinetune => Self::FullFinetune,
            Recipe::LoraFinetune => Self::LoraFinetune,
            Recipe::LoraDpo => Self::LoraDpo,
            Recipe::FullDpo => Self::FullDpo(Box::new(FullDpoKeys::read_keys(root, "", cx)?)),
            Recipe::Qat => Self::Qat(Box::new(QatKeys::read_keys(root, "", cx)?)),
            Recipe::QatLora => Self::QatLora(Box::new(QatKeys::read_keys(root, "", cx)?)),
            Recipe::KnowledgeDistillation => {
                Self::KnowledgeDistillation(Box::new(KdKeys::read_keys(root, "", cx)?))
            }
            Recipe::Generate => return None,
        })
    }

    /// Adds the fingerprint entries of the recipe's own keys.
    pub fn fingerprint_keys(&self, out: &mut FingerprintEntries) {
        let top = Fingerprint::Inherit;
        match self {
            Self::FullFinetune | Self::LoraFinetune | Self::LoraDpo => {}
            Self::FullDpo(keys) => keys.fingerprint_keys("", top, out),
            Self::Qat(keys) | Self::QatLora(keys) => keys.fingerprint_keys("", top, out),
            Self::KnowledgeDistillation(keys) => keys.fingerprint_keys("", top, out),
        }
    }

    /// QAT's keys, for the QAT recipes.
    pub fn qat(&self) -> Option<&QatKeys> {
        match self {
            Self::Qat(keys) | Self::QatLora(keys) => Some(keys),
            _ => None,
        }
    }
}
