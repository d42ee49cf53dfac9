//! The top-level keys of the training recipes: those every one reads ([`TrainConfig`]) and
//! those only some read ([`RecipeKeys`]: QAT's quantizer, distillation's teacher, full DPO's
//! reference).

use std::path::PathBuf;

use serde::Serialize;
use serde_yaml::Value;

use super::{
    CheckpointerConfig, CrossEntropyLoss, Datasets, LrSchedulerConfig, MetricLoggerConfig,
    ModelConfig, OptimizerConfig, ProfilerConfig, QuantizerConfig, TokenizerConfig,
};
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{
    Checker, ConfigValue, SectionInfo, Ty, default, keys, off, on, optional, required,
};
use crate::config::values::choices;
use crate::precision::Dtype;
use crate::verbosity::LogLevel;

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

/// How attention is computed (`attention`, also `tune bench --attention`): tune's fused kernels
/// (the CPU's, or the cubecl kernels on cuda and wgpu), which keep no `seq x seq` probabilities
/// for the backward, or burn's composed ops, which do. The two give the same results within
/// float rounding; they differ in memory and speed (BENCHMARKS.md: on an H200 the composed path
/// was faster at 512-4096 tokens and held 11.5x the device memory at 4096).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Attention {
    #[default]
    Fused,
    Composed,
}

choices!(Attention {
    "fused" => Attention::Fused,
    "composed" => Attention::Composed,
});

impl Device {
    /// `device` left out or null: CUDA when this build has it, else the CPU (torchtune's
    /// `get_device`).
    pub fn or_default(device: Option<Device>) -> Device {
        device.unwrap_or(if cfg!(feature = "cuda") {
            Device::Cuda
        } else {
            Device::Cpu
        })
    }

    /// The name a config writes for it.
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
            Device::Wgpu => "wgpu",
        }
    }
}

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

/// `fsdp_cpu_offload` (or the older `fsdp.cpu_offload`) on the run's device. On the CPU every
/// parameter, gradient and optimizer state already lives in host memory, so it changes nothing
/// and says so. On a GPU it offloads FSDP's shards (`training::parallel::offload`), which replicated
/// weights (`data_parallel_shard_dim: 1`) do not have: that pair is refused.
/// Activation offloading moves what checkpointing keeps, so it needs checkpointing (torchtune
/// refuses it without, too); on the CPU, host memory is the device's.
fn activation_offloading(c: &TrainConfig, cx: &mut Checker) {
    if !c.enable_activation_offloading {
        return;
    }
    if !c.enable_activation_checkpointing {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "enable_activation_offloading",
                "offloads the layer inputs activation checkpointing keeps, but enable_activation_checkpointing is False (torchtune refuses this too)",
            )
            .with_fix("set `enable_activation_checkpointing: True`, or remove `enable_activation_offloading`"),
        );
    } else if Device::or_default(c.device) == Device::Cpu {
        cx.warn(
            "enable_activation_offloading",
            "on device cpu the activations already live in host memory: offloading them changes nothing",
        );
    }
}

fn offload_on_device(c: &TrainConfig, offload: bool, path: &str, cx: &mut Checker) {
    if !offload {
        return;
    }
    match Device::or_default(c.device) {
        Device::Cpu => cx.warn(
            path,
            "on device cpu the parameters, gradients and optimizer state already live in host memory: offloading them changes nothing",
        ),
        _ if c.data_parallel_shard_dim == Some(1.0) => cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                path,
                "offloads FSDP's shards to host memory, but data_parallel_shard_dim: 1 keeps every weight whole on every rank (no shards)",
            )
            .with_fix(format!(
                "remove `data_parallel_shard_dim` (FSDP over every rank, torchtune's default), or set `{path}: False`"
            )),
        ),
        _ => {}
    }
}

/// torchtune's older `fsdp:` block. Its dev recipe `lora_finetune_fsdp2.py` read
/// `fsdp.cpu_offload` as FSDP2's `CPUOffloadPolicy`; the recipe's migration into
/// `lora_finetune_distributed` (torchtune #1517) renamed it `fsdp_cpu_offload`, and the block was
/// never read again (0.6.1 and main ignore it), but main's `llama2/7B_qlora`, `llama2/70B_qlora`
/// and `llama3_1/405B_qlora` still carry it. tune reads `fsdp.cpu_offload` with its original
/// meaning, as an alias of `fsdp_cpu_offload` (declared there); `cpu_offload` is the only key the
/// block ever had, so any other is refused by name.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FsdpBlock {}

/// The `fsdp` section as `tune validate` sees it: its one key is `fsdp_cpu_offload`'s alias.
const FSDP_SECTION: SectionInfo = SectionInfo {
    name: "fsdp",
    doc: "torchtune's older FSDP block: `fsdp.cpu_offload` is `fsdp_cpu_offload`.\n",
    component: None,
    keys: &[],
    open: false,
};

impl ConfigValue for FsdpBlock {
    const TY: &'static Ty = &Ty::Section(&FSDP_SECTION);

    fn read(value: &Value, path: &str, cx: &mut Checker) -> Option<Self> {
        let map = value.as_mapping()?;
        for key in map.keys().map(crate::config::yaml::key_str) {
            let at = crate::config::keys::join(path, &key);
            if cx.is_claimed(&at) {
                continue;
            }
            // torchtune's FSDP settings are top-level `fsdp_*` keys: point at the one this
            // key would be, when tune has it.
            let top = format!("fsdp_{key}");
            let fix = if TrainConfig::KEYS.iter().any(|k| k.name == top) {
                format!("set the top-level `{top}` instead, and remove `{at}`")
            } else {
                format!(
                    "remove it (`~{at}`); FSDP's settings are the top-level keys fsdp_cpu_offload, fsdp_reshard_after_forward, custom_sharded_layers and data_parallel_shard_dim"
                )
            };
            cx.problem(
                Problem::new(
                    ProblemKind::UnknownKey,
                    at,
                    format!(
                        "unknown key `{key}` for `{path}`: torchtune's `fsdp:` block only ever had `cpu_offload`"
                    ),
                )
                .with_fix(fix),
            );
        }
        Some(Self {})
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
    /// With activation checkpointing, each decoder layer's kept input waits in host memory
    /// from its forward until one layer before its backward (torchtune's activation
    /// offloading; cuda and wgpu: on the CPU it already lives there).
    enable_activation_offloading: bool = off(),
    /// `fused` (tune's attention kernels, memory linear in the sequence length) or `composed`
    /// (burn's ops: every layer keeps its `seq x seq` probabilities for the backward; faster on
    /// a GPU at short sequences).
    attention: Attention = default(Attention::default),
    /// torch.compile: nothing to compile here.
    compile: bool = off().warn("torch.compile has no equivalent here; running uncompiled"),
    /// Log the metrics every this many steps.
    log_every_n_steps: usize = default(|| 1).range(|v| v >= 1.0, "at least 1"),
    /// Log the memory metrics (`peak_memory_*` and the `*_bytes` of weights, gradients and
    /// optimizer state) with each step's; torchtune's configs set True (False leaves them out).
    log_peak_memory_stats: bool = on(),
    /// How much tune says on stderr: `DEBUG` adds what each stage loaded and wrote, `WARN`
    /// (or `WARNING`) keeps warnings and errors only, `ERROR` errors only (null: `INFO`).
    log_level: Option<LogLevel> = optional(),
    /// A fresh run may delete the checkpoints another run left in its checkpoint directory
    /// (without it, such a run is refused).
    overwrite_output_dir: bool = off(),
    /// On SIGINT/SIGTERM, save a checkpoint at the step boundary before exiting.
    save_on_preempt: bool = off(),
    /// LoRA recipes: save the adapter only, not the merged model too.
    save_adapter_weights_only: bool = off(),
    /// Also checkpoint every this many optimizer steps (null: at epoch ends only).
    save_every_n_steps: Option<usize> = optional().range(|v| v >= 1.0, "at least 1, or null"),
    /// Keep only this many newest checkpoints (torchtune main writes it in `checkpointer`).
    keep_last_n_checkpoints: Option<usize> = optional()
        .range(|v| v >= 1.0, "at least 1, or null to keep all")
        .aliases(&["checkpointer.keep_last_n_checkpoints"]),
    /// torchtune's QLoRA configs' low-memory loading: tune always reads checkpoints
    /// memory-mapped, one tensor at a time, so True is what it does anyway; False asks for
    /// the whole checkpoint in memory first, which would change nothing but the memory, and is
    /// accepted too.
    low_cpu_ram: bool = off().validation_only(
        "tune always loads checkpoints memory-mapped, tensor by tensor: both values load the same weights",
    ),
    /// torchtune's profiler.
    profiler: Option<ProfilerConfig> = optional().validation_only(
        "no traces are recorded: `profiler.enabled: True` is warned about",
    ),
    /// torchtune's optimizer-in-backward: not supported (the optimizer steps after backward).
    optimizer_in_bwd: bool = off().warn(
        "optimizer-in-backward is not supported; the optimizer steps after backward",
    ),
    /// FSDP's units of their own besides the decoder layers (`tok_embeddings`, `output`):
    /// tune always shards both as units of their own.
    custom_sharded_layers: Option<Vec<String>> = optional().rule(own_units).validation_only(
        "tune's FSDP always makes tok_embeddings and output units of their own; another name is refused",
    ),
    /// FSDP: free each layer's gathered weights after its forward and gather them again for
    /// its backward (True, the default), or keep them from the forward until the backward
    /// (False: one all-gather per layer per step, the whole layers held meanwhile).
    fsdp_reshard_after_forward: bool = on(),
    /// FSDP's CPU offload (null: False): on cuda and wgpu each rank's rows of every weight,
    /// their gradients and their optimizer state live in host memory, the optimizer step runs
    /// there and a unit's rows go up to the device to be gathered (FSDP over one rank too, as
    /// torchtune's FSDP on one GPU). On device cpu they already are (accepted, and said once).
    fsdp_cpu_offload: bool = off().aliases(&["fsdp.cpu_offload"]),
    /// torchtune's older block: `fsdp: {cpu_offload: ...}` is `fsdp_cpu_offload`.
    fsdp: Option<FsdpBlock> = optional().validation_only("its one key is an alias of fsdp_cpu_offload"),
    /// Tensor parallelism: only 1.
    tensor_parallel_dim: Option<usize> = optional().range(
        |v| v == 1.0,
        "1: tune has no tensor parallelism, every rank holds the whole model",
    )
    .validation_only("only 1 is accepted, which is what tune does"),
    /// A tensor-parallel plan: with `tensor_parallel_dim: 1` there is nothing to parallelize,
    /// and torchtune does not apply it either (warned about when set).
    tensor_parallel_plan: Option<Value> = optional().warn(
        "ignored: tensor_parallel_dim is 1 (tune has no tensor parallelism), so no plan applies, as in torchtune",
    ),
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
    )
    .validation_only("only 1 is accepted, which is what tune does"),
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
}

/// Keys that only mean something together.
fn train_rules(c: &TrainConfig, _: &str, cx: &mut Checker) {
    activation_offloading(c, cx);
    let at = cx.written_at("fsdp_cpu_offload");
    offload_on_device(c, c.fsdp_cpu_offload, &at, cx);
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

/// What the GRPO recipes do not do with the keys every training recipe has: they train on the
/// rollouts of each batch of prompts at once, and have no validation loss.
pub fn grpo_train_rules(c: &TrainConfig, cx: &mut Checker) {
    if c.gradient_accumulation_steps != 1 {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "gradient_accumulation_steps",
                format!(
                    "is {}, but a GRPO step trains on one batch of prompts' rollouts at once (torchtune's recipe has no accumulation)",
                    c.gradient_accumulation_steps
                ),
            )
            .with_fix("set `gradient_accumulation_steps: 1` and raise `batch_size` (prompts per step) instead"),
        );
    }
    if c.dataset_val.is_some() {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "dataset_val",
                "GRPO has no validation loss to score it with",
            )
            .with_fix("remove `dataset_val` (and `run_val_every_n_steps`)"),
        );
    }
    if c.dataset.iter().any(|d| d.packed) {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "dataset.packed",
                "prompts are generated from one by one; packing them would mix prompts",
            )
            .with_fix("set `dataset.packed: False`"),
        );
    }
}

keys! {
    /// The supervised recipes' own key: their loss (full and LoRA fine-tuning).
    pub struct SftKeys {}
    /// The token cross-entropy.
    loss: CrossEntropyLoss = required().fingerprint(),
}

keys! {
    /// Quantization-aware training's own keys (QAT, and QAT with LoRA).
    pub struct QatKeys {}
    /// The token cross-entropy.
    loss: CrossEntropyLoss = required().fingerprint(),
    /// The fake quantization to train under.
    quantizer: QuantizerConfig = required().fingerprint(),
    /// Train this many steps in float first (null: fake-quantize from the start).
    fake_quant_after_n_steps: Option<usize> = optional(),
}

#[cfg(test)]
mod tests {
    use crate::config::{ValidateOptions, ValidationErrors, Warning, load_config};

    use crate::recipes::validate_with;

    use super::TrainConfig;

    const NO_PATHS: ValidateOptions = ValidateOptions { check_paths: false };

    fn validated(overrides: &[&str]) -> Result<(TrainConfig, Vec<Warning>), ValidationErrors> {
        let overrides: Vec<String> = overrides.iter().map(|o| o.to_string()).collect();
        let cfg = load_config("tiny/full", &overrides).expect("loads");
        validate_with("full_finetune_distributed", &cfg, &NO_PATHS)
            .map(|(typed, warnings)| (typed.as_train().expect("train").clone(), warnings))
    }

    #[test]
    fn fsdp_block_cpu_offload_is_fsdp_cpu_offload() {
        // What torchtune's llama2/7B_qlora and llama3_1/405B_qlora write.
        let (c, warnings) = validated(&["fsdp={cpu_offload: False}"]).unwrap();
        assert!(!c.fsdp_cpu_offload);
        assert!(warnings.is_empty(), "{warnings:?}");
        // tiny/full runs on the CPU: offloading is accepted, and said once, at the key set.
        for (over, key) in [
            ("fsdp={cpu_offload: True}", "fsdp.cpu_offload"),
            ("fsdp_cpu_offload=True", "fsdp_cpu_offload"),
        ] {
            let (c, warnings) = validated(&[over]).unwrap();
            assert!(c.fsdp_cpu_offload, "{over}");
            let said: Vec<_> = warnings.iter().filter(|w| w.key == key).collect();
            assert_eq!(said.len(), 1, "{over}: {warnings:?}");
            assert!(said[0].message.contains("changes nothing"), "{said:?}");
            // On a GPU it offloads, silently; with replicated weights there is nothing to
            // offload, and that is refused naming the key and the fix.
            let (c, warnings) = validated(&[over, "device=cuda"]).unwrap();
            assert!(c.fsdp_cpu_offload && warnings.is_empty(), "{warnings:?}");
            let e = validated(&[over, "device=wgpu", "data_parallel_shard_dim=1"]).unwrap_err();
            assert!(
                e.has(key, "data_parallel_shard_dim: 1 keeps every weight whole")
                    && e.has(key, &format!("set `{key}: False`")),
                "{e}"
            );
        }
        assert!(
            !validated(&["fsdp_cpu_offload=null"])
                .unwrap()
                .0
                .fsdp_cpu_offload
        );
    }

    #[test]
    fn fsdp_block_keys_tune_cannot_honour_are_refused_by_name() {
        let e =
            validated(&["fsdp={cpu_offload: False, reshard_after_forward: False, mp_policy: x}"])
                .unwrap_err();
        assert_eq!(e.problems.len(), 2, "{e}");
        assert!(
            e.has(
                "fsdp.reshard_after_forward",
                "set the top-level `fsdp_reshard_after_forward` instead"
            ),
            "{e}"
        );
        assert!(
            e.has("fsdp.mp_policy", "remove it (`~fsdp.mp_policy`)"),
            "{e}"
        );
        let e = validated(&["fsdp={cpu_offload: 1}"]).unwrap_err();
        assert!(e.has("fsdp.cpu_offload", "expected a boolean"), "{e}");
        let e = validated(&["fsdp=[cpu_offload]"]).unwrap_err();
        assert!(e.has("fsdp", "the `fsdp` section"), "{e}");
        // The two spellings disagreeing is refused rather than one silently winning.
        let e = validated(&["fsdp={cpu_offload: True}", "fsdp_cpu_offload=False"]).unwrap_err();
        assert!(
            e.has(
                "fsdp.cpu_offload",
                "is true, but `fsdp_cpu_offload` is false"
            ),
            "{e}"
        );
        let (c, _) = validated(&["fsdp={cpu_offload: True}", "fsdp_cpu_offload=True"]).unwrap();
        assert!(c.fsdp_cpu_offload);
    }
}
