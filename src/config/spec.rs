//! The shape of every config section: which keys exist, their types, which are
//! required, and which are accepted with a warning. The validator walks the YAML
//! tree against these tables so it can report every problem, not just serde's first.
//! The typed structs in `schema` mirror these tables (a test keeps them in step).

use crate::config::components::ComponentKind;
use crate::config::recipes::Recipe;

#[derive(Debug)]
pub enum Ty {
    Bool,
    /// Non-negative integer.
    UInt,
    /// Float; integers are accepted.
    Float,
    Str,
    Enum(&'static [&'static str]),
    List(&'static Ty),
    /// Mapping of string keys to values of one type.
    Map(&'static Ty),
    Nullable(&'static Ty),
    Section(&'static Section),
    /// One section or a list of them (concatenated datasets).
    OneOrMany(&'static Section),
    Either(&'static Ty, &'static Ty),
    Any,
}

/// Extra rule attached to a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Note {
    None,
    /// Accepted, but a truthy value is not honoured: warn with this text.
    Warn(&'static str),
    /// Accepted only when unset, null, false, zero or empty: anything else would change the
    /// result in a way tune cannot honour, so it is an error with this text.
    Refuse(&'static str),
}

#[derive(Debug)]
pub struct Field {
    pub key: &'static str,
    pub ty: Ty,
    pub required: bool,
    pub note: Note,
}

#[derive(Debug)]
pub struct Section {
    pub name: &'static str,
    /// Sections built from a `_component_` of this kind (the key is then required).
    pub component: Option<ComponentKind>,
    pub fields: &'static [Field],
    /// Unknown keys are accepted silently (profiler options we never read).
    pub open: bool,
}

/// The warning for torchtune's FSDP sharding knobs.
const NO_FSDP: &str = "tune shards no parameters: every rank holds the whole model (full-weight training shards only the optimizer state), so the FSDP sharding this key tunes does not apply";

const fn opt(key: &'static str, ty: Ty) -> Field {
    Field {
        key,
        ty,
        required: false,
        note: Note::None,
    }
}
const fn req(key: &'static str, ty: Ty) -> Field {
    Field {
        key,
        ty,
        required: true,
        note: Note::None,
    }
}
const fn warn(key: &'static str, ty: Ty, msg: &'static str) -> Field {
    Field {
        key,
        ty,
        required: false,
        note: Note::Warn(msg),
    }
}
const fn refuse(key: &'static str, ty: Ty, msg: &'static str) -> Field {
    Field {
        key,
        ty,
        required: false,
        note: Note::Refuse(msg),
    }
}
const fn section(
    name: &'static str,
    component: Option<ComponentKind>,
    fields: &'static [Field],
) -> Section {
    Section {
        name,
        component,
        fields,
        open: false,
    }
}

const NSTR: Ty = Ty::Nullable(&Ty::Str);
const NUINT: Ty = Ty::Nullable(&Ty::UInt);
const NFLOAT: Ty = Ty::Nullable(&Ty::Float);

pub const LORA_MODULES: &[&str] = &["q_proj", "k_proj", "v_proj", "output_proj"];
pub const DEVICES: &[&str] = &["cpu", "cuda", "wgpu"];
pub const DTYPES: &[&str] = &["fp32", "bf16", "fp16", "float32", "bfloat16", "float16"];
/// Training refuses fp16, as torchtune's recipes do (no loss scaling): `tune validate` says so
/// before a run starts.
pub const TRAIN_DTYPES: &[&str] = &["fp32", "bf16", "float32", "bfloat16"];

pub static MODEL: Section = section(
    "model",
    Some(ComponentKind::Model),
    &[
        opt("lora_attn_modules", Ty::List(&Ty::Enum(LORA_MODULES))),
        opt("apply_lora_to_mlp", Ty::Bool),
        opt("apply_lora_to_output", Ty::Bool),
        opt("lora_rank", Ty::UInt),
        opt("lora_alpha", Ty::Float),
        opt("lora_dropout", Ty::Float),
        // The architecture arguments of torchtune's generic builders (`llama2`, `lora_qwen2`):
        // checked against the checkpoint's config.json, which tune builds the model from.
        opt("vocab_size", Ty::UInt),
        opt("num_layers", Ty::UInt),
        opt("num_heads", Ty::UInt),
        opt("num_kv_heads", Ty::UInt),
        opt("embed_dim", Ty::UInt),
        opt("intermediate_dim", Ty::UInt),
        opt("head_dim", Ty::UInt),
        opt("max_seq_len", Ty::UInt),
        opt("norm_eps", Ty::Float),
        opt("rope_base", Ty::Float),
        opt("tie_word_embeddings", Ty::Bool),
        refuse(
            "attn_dropout",
            Ty::Float,
            "attention dropout is not implemented (torchtune's configs all use 0.0); set `attn_dropout: 0.0`",
        ),
        opt("use_dora", Ty::Bool),
        // QLoRA: the decoder's linear base weights in NF4 (checks.rs: LoRA builders only).
        opt("quantize_base", Ty::Bool),
    ],
);

pub static TOKENIZER: Section = section(
    "tokenizer",
    Some(ComponentKind::Tokenizer),
    &[
        // `path`, Phi-4's `vocab_path` or HuggingFaceModelTokenizer's `tokenizer_json_path`
        // (checks.rs requires one): the tokenizer.json it names or sits beside is the vocabulary.
        opt("path", Ty::Str),
        opt("vocab_path", NSTR),
        opt("merges_path", NSTR),
        opt("merges_file", NSTR),
        opt("max_seq_len", NUINT),
        opt("prompt_template", Ty::Nullable(&Ty::Any)),
        opt("special_tokens_path", NSTR),
        opt("truncation_type", Ty::Enum(&["left", "right"])),
        // torchtune's HuggingFaceModelTokenizer names its files.
        opt("tokenizer_json_path", NSTR),
        opt("tokenizer_config_json_path", NSTR),
        opt("generation_config_path", NSTR),
    ],
);

pub static CHECKPOINT_FILES_FORMAT: Section = section(
    "checkpoint_files",
    None,
    &[
        req("filename_format", Ty::Str),
        req("max_filename", Ty::Either(&Ty::Str, &Ty::UInt)),
    ],
);

pub static CHECKPOINTER: Section = section(
    "checkpointer",
    Some(ComponentKind::Checkpointer),
    &[
        req("checkpoint_dir", Ty::Str),
        opt(
            "checkpoint_files",
            Ty::Either(&Ty::List(&Ty::Str), &Ty::Section(&CHECKPOINT_FILES_FORMAT)),
        ),
        opt("adapter_checkpoint", NSTR),
        opt("recipe_checkpoint", NSTR),
        opt("output_dir", NSTR),
        opt("model_type", NSTR),
        opt("safe_serialization", Ty::Bool),
        // torchtune main's place for it; the same as the top-level key.
        opt("keep_last_n_checkpoints", NUINT),
    ],
);

pub static DATASET: Section = section(
    "dataset",
    Some(ComponentKind::Dataset),
    &[
        opt("source", Ty::Str),
        opt(
            "data_files",
            Ty::Nullable(&Ty::Either(&Ty::Str, &Ty::List(&Ty::Str))),
        ),
        opt("split", Ty::Str),
        opt("name", NSTR),
        opt("column_map", Ty::Nullable(&Ty::Map(&Ty::Str))),
        opt("train_on_input", Ty::Bool),
        opt("packed", Ty::Bool),
        opt("new_system_prompt", NSTR),
        opt("conversation_column", Ty::Str),
        opt("conversation_style", Ty::Enum(&["sharegpt", "openai"])),
        opt("column", Ty::Str),
        opt("add_eos", Ty::Bool),
        opt("split_across_pack", Ty::Bool),
        refuse(
            "filter_fn",
            NSTR,
            "dataset filter functions are Python callables, which tune cannot run, and training on the unfiltered rows would change the data; filter the data file beforehand and set `filter_fn: null`",
        ),
    ],
);

pub static OPTIMIZER: Section = section(
    "optimizer",
    Some(ComponentKind::Optimizer),
    &[
        req("lr", Ty::Float),
        opt("weight_decay", Ty::Float),
        opt("betas", Ty::List(&Ty::Float)),
        opt("eps", Ty::Float),
        opt("momentum", Ty::Float),
        opt("fused", Ty::Bool),
        refuse(
            "amsgrad",
            Ty::Bool,
            "AMSGrad is not supported; remove `amsgrad` or set it to False",
        ),
    ],
);

pub static LR_SCHEDULER: Section = section(
    "lr_scheduler",
    Some(ComponentKind::LrScheduler),
    &[
        opt("num_warmup_steps", Ty::UInt),
        opt("num_cycles", Ty::Float),
    ],
);

pub static LOSS: Section = section(
    "loss",
    Some(ComponentKind::Loss),
    &[
        opt("beta", Ty::Float),
        opt("label_smoothing", Ty::Float),
        opt("num_output_chunks", Ty::UInt),
        opt("sym_kd_ratio", Ty::Float),
    ],
);

pub static METRIC_LOGGER: Section = section(
    "metric_logger",
    Some(ComponentKind::MetricLogger),
    &[
        opt("log_dir", NSTR),
        opt("filename", NSTR),
        opt("project", NSTR),
        opt("organize_logs", Ty::Bool),
    ],
);

pub static QUANTIZER: Section = section(
    "quantizer",
    Some(ComponentKind::Quantizer),
    &[opt("groupsize", Ty::UInt)],
);

pub static PROFILER: Section = Section {
    name: "profiler",
    component: Some(ComponentKind::Profiler),
    fields: &[warn(
        "enabled",
        Ty::Bool,
        "the PyTorch profiler is not available; no traces are recorded",
    )],
    open: true,
};

pub static PUSH_TO_HUB: Section = section(
    "push_to_hub",
    None,
    &[req("repo_id", Ty::Str), opt("private", Ty::Bool)],
);

pub static PROMPT: Section = section("prompt", None, &[opt("system", NSTR), req("user", Ty::Str)]);

/// Keys every training recipe accepts.
static TRAIN_COMMON: &[Field] = &[
    req("output_dir", Ty::Str),
    opt("seed", NUINT),
    opt("shuffle", Ty::Bool),
    req("batch_size", Ty::UInt),
    req("epochs", Ty::UInt),
    opt("max_steps_per_epoch", NUINT),
    opt("gradient_accumulation_steps", Ty::UInt),
    opt("clip_grad_norm", NFLOAT),
    opt("device", Ty::Enum(DEVICES)),
    opt("dtype", Ty::Enum(TRAIN_DTYPES)),
    opt("enable_activation_checkpointing", Ty::Bool),
    warn(
        "enable_activation_offloading",
        Ty::Bool,
        "activation offloading is not supported; activations stay on the device",
    ),
    warn(
        "compile",
        Ty::Bool,
        "torch.compile has no equivalent here; running uncompiled",
    ),
    opt("log_every_n_steps", Ty::UInt),
    opt("log_peak_memory_stats", Ty::Bool),
    opt("log_level", NSTR),
    opt("resume_from_checkpoint", Ty::Bool),
    opt("overwrite_output_dir", Ty::Bool),
    opt("save_on_preempt", Ty::Bool),
    opt("save_adapter_weights_only", Ty::Bool),
    opt("save_every_n_steps", NUINT),
    opt("keep_last_n_checkpoints", NUINT),
    // torchtune's QLoRA configs: load the checkpoint without a full copy in CPU memory. tune
    // always loads memory-mapped, one tensor at a time, so both values load that way.
    opt("low_cpu_ram", Ty::Bool),
    opt("profiler", Ty::Nullable(&Ty::Section(&PROFILER))),
    warn(
        "optimizer_in_bwd",
        Ty::Bool,
        "optimizer-in-backward is not supported; the optimizer steps after backward",
    ),
    warn(
        "custom_sharded_layers",
        Ty::Nullable(&Ty::List(&Ty::Str)),
        NO_FSDP,
    ),
    // torchtune's distributed knobs. What tune does (data parallelism over every rank, ZeRO-1
    // optimizer state) is what they ask for at these values; any other is refused, in
    // checks.rs for the numbers.
    warn("fsdp_reshard_after_forward", Ty::Bool, NO_FSDP),
    refuse(
        "fsdp_cpu_offload",
        Ty::Bool,
        "offloading parameters, gradients and optimizer state to the CPU is not supported: tune keeps them on the device; set fsdp_cpu_offload: False",
    ),
    opt("tensor_parallel_dim", Ty::UInt),
    opt("tensor_parallel_plan", Ty::Any),
    opt("data_parallel_shard_dim", Ty::Float),
    opt("data_parallel_replicate_dim", Ty::UInt),
    opt("push_to_hub", Ty::Nullable(&Ty::Section(&PUSH_TO_HUB))),
    opt("run_val_every_n_steps", NUINT),
    opt("dataset_val", Ty::Nullable(&Ty::OneOrMany(&DATASET))),
    opt("batch_size_val", NUINT),
    req("model", Ty::Section(&MODEL)),
    req("tokenizer", Ty::Section(&TOKENIZER)),
    req("checkpointer", Ty::Section(&CHECKPOINTER)),
    req("dataset", Ty::OneOrMany(&DATASET)),
    req("optimizer", Ty::Section(&OPTIMIZER)),
    opt("lr_scheduler", Ty::Nullable(&Ty::Section(&LR_SCHEDULER))),
    req("loss", Ty::Section(&LOSS)),
    opt("metric_logger", Ty::Nullable(&Ty::Section(&METRIC_LOGGER))),
];

static QAT_EXTRA: &[Field] = &[
    req("quantizer", Ty::Section(&QUANTIZER)),
    opt("fake_quant_after_n_steps", NUINT),
];

static KD_EXTRA: &[Field] = &[
    req("teacher_model", Ty::Section(&MODEL)),
    req("teacher_checkpointer", Ty::Section(&CHECKPOINTER)),
    req("kd_loss", Ty::Section(&LOSS)),
    opt("kd_ratio", Ty::Float),
];

static FULL_DPO_EXTRA: &[Field] = &[req("ref_checkpointer", Ty::Section(&CHECKPOINTER))];

static GENERATE: &[Field] = &[
    req("model", Ty::Section(&MODEL)),
    req("checkpointer", Ty::Section(&CHECKPOINTER)),
    req("tokenizer", Ty::Section(&TOKENIZER)),
    opt("output_dir", NSTR),
    opt("device", Ty::Enum(DEVICES)),
    opt("dtype", Ty::Enum(DTYPES)),
    opt("seed", NUINT),
    opt("log_level", NSTR),
    req("prompt", Ty::Either(&Ty::Str, &Ty::Section(&PROMPT))),
    opt("chat", Ty::Bool),
    opt("max_new_tokens", Ty::UInt),
    opt("temperature", Ty::Float),
    opt("top_k", NUINT),
    opt("top_p", NFLOAT),
    opt("stop_at_eos", Ty::Bool),
    opt("adapter_dir", NSTR),
    opt("enable_kv_cache", Ty::Bool),
    refuse(
        "quantizer",
        Ty::Nullable(&Ty::Section(&QUANTIZER)),
        "quantized generation is not supported, and generating in `dtype` instead would not be the model asked for; set `quantizer: null` (a QAT run's int4 export is in its checkpoint's quantized/ folder)",
    ),
    refuse(
        "instruct_template",
        NSTR,
        "an old torchtune key tune cannot honour; format the prompt with `tokenizer.prompt_template`, or the checkpoint's chat template (`chat: True` with the HuggingFaceModelTokenizer component), and set `instruct_template: null`",
    ),
    refuse(
        "chat_format",
        NSTR,
        "an old torchtune key tune cannot honour; the tokenizer component sets the format (or `chat: True` with the HuggingFaceModelTokenizer component for the chat template); set `chat_format: null`",
    ),
];

/// The top-level keys a recipe accepts.
pub fn top_level(recipe: Recipe) -> Vec<&'static Field> {
    let extra: &[Field] = match recipe {
        Recipe::Generate => return GENERATE.iter().collect(),
        Recipe::Qat | Recipe::QatLora => QAT_EXTRA,
        Recipe::KnowledgeDistillation => KD_EXTRA,
        Recipe::FullDpo => FULL_DPO_EXTRA,
        Recipe::FullFinetune | Recipe::LoraFinetune | Recipe::LoraDpo => &[],
    };
    TRAIN_COMMON.iter().chain(extra).collect()
}
