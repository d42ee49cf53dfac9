//! Typed recipe configs. Deserialised only after `validate` has checked the tree
//! against `spec`, so serde errors here indicate a spec/struct mismatch (tested).
//! Defaults follow torchtune's recipes and builders.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize};
use serde_yaml::Value;

use crate::config::components::Component;
use crate::config::recipes::Recipe;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    Cpu,
    Cuda,
    /// burn's cubecl backend on wgpu: Vulkan, Metal or DX12 (a `wgpu` build).
    Wgpu,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Dtype {
    #[default]
    #[serde(rename = "fp32", alias = "float32")]
    Fp32,
    #[serde(rename = "bf16", alias = "bfloat16")]
    Bf16,
    #[serde(rename = "fp16", alias = "float16")]
    Fp16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoraModule {
    QProj,
    KProj,
    VProj,
    OutputProj,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConversationStyle {
    Sharegpt,
    Openai,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    #[serde(rename = "_component_")]
    pub component: Component,
    #[serde(default)]
    pub lora_attn_modules: Vec<LoraModule>,
    #[serde(default)]
    pub apply_lora_to_mlp: bool,
    #[serde(default)]
    pub apply_lora_to_output: bool,
    /// Required (by validation) for LoRA builders, as in torchtune.
    pub lora_rank: Option<u32>,
    pub lora_alpha: Option<f64>,
    #[serde(default)]
    pub lora_dropout: f64,
    #[serde(default)]
    pub use_dora: bool,
    #[serde(default)]
    pub quantize_base: bool,
    /// A generic builder's architecture (checked against config.json; see `setup::model`).
    #[serde(flatten)]
    pub architecture: Architecture,
}

/// torchtune's generic builders take the architecture as arguments (`torchtune.models.llama2.
/// llama2` with `num_layers`, `embed_dim`, ...). tune builds every model from the checkpoint's
/// config.json, so these only have to agree with it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Architecture {
    pub vocab_size: Option<usize>,
    pub num_layers: Option<usize>,
    pub num_heads: Option<usize>,
    pub num_kv_heads: Option<usize>,
    pub embed_dim: Option<usize>,
    pub intermediate_dim: Option<usize>,
    pub head_dim: Option<usize>,
    pub max_seq_len: Option<usize>,
    pub norm_eps: Option<f64>,
    pub rope_base: Option<f64>,
    pub tie_word_embeddings: Option<bool>,
    /// Refused unless 0 by validation.
    pub attn_dropout: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerConfig {
    #[serde(rename = "_component_")]
    pub component: Component,
    /// As written; use [`TokenizerConfig::location`] and `paths::resolve_tokenizer_json` to
    /// find the tokenizer.json.
    pub path: Option<PathBuf>,
    /// Phi-4's tokenizer names its vocabulary `vocab_path` (vocab.json) instead of `path`.
    pub vocab_path: Option<PathBuf>,
    /// Phi-4's merges.txt (the tokenizer.json beside the vocabulary holds the merges).
    pub merges_path: Option<PathBuf>,
    pub merges_file: Option<PathBuf>,
    /// torchtune main: `left` keeps a too-long sample's last `max_seq_len` tokens.
    pub truncation_type: Option<TruncationType>,
    /// torchtune's `HuggingFaceModelTokenizer`: the tokenizer.json, and the config files that
    /// would otherwise be read from beside it.
    pub tokenizer_json_path: Option<PathBuf>,
    pub tokenizer_config_json_path: Option<PathBuf>,
    pub generation_config_path: Option<PathBuf>,
    pub max_seq_len: Option<usize>,
    /// Absent: the component's default template (Llama2ChatTemplate for `llama2_tokenizer`,
    /// MistralChatTemplate for `mistral_tokenizer`, none otherwise); `Some(None)`: `null`, no
    /// template.
    #[serde(
        default,
        deserialize_with = "explicit_null",
        skip_serializing_if = "Option::is_none"
    )]
    pub prompt_template: Option<Option<Value>>,
    pub special_tokens_path: Option<PathBuf>,
}

impl TokenizerConfig {
    /// What points at the vocabulary and its key: `path`, `tokenizer_json_path` or
    /// `vocab_path` (validation requires one).
    pub fn location(&self) -> Option<(&'static str, &std::path::Path)> {
        [
            ("tokenizer.path", &self.path),
            ("tokenizer.tokenizer_json_path", &self.tokenizer_json_path),
            ("tokenizer.vocab_path", &self.vocab_path),
        ]
        .into_iter()
        .find_map(|(key, p)| p.as_deref().map(|p| (key, p)))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TruncationType {
    Left,
    Right,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StrOrInt {
    Str(String),
    Int(u64),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum CheckpointFiles {
    List(Vec<String>),
    /// `{filename_format: model-{}-of-{}.safetensors, max_filename: "00004"}`.
    Format {
        filename_format: String,
        max_filename: StrOrInt,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointerConfig {
    #[serde(rename = "_component_")]
    pub component: Component,
    pub checkpoint_dir: PathBuf,
    /// None: every `*.safetensors` in checkpoint_dir (via its index.json if present).
    pub checkpoint_files: Option<CheckpointFiles>,
    pub adapter_checkpoint: Option<String>,
    pub recipe_checkpoint: Option<String>,
    /// None: the recipe's top-level `output_dir`.
    pub output_dir: Option<PathBuf>,
    /// Informational only: the architecture comes from config.json.
    pub model_type: Option<String>,
    #[serde(default = "yes")]
    pub safe_serialization: bool,
    /// torchtune main's spelling of the top-level `keep_last_n_checkpoints`.
    pub keep_last_n_checkpoints: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DataFiles {
    One(String),
    Many(Vec<String>),
}

fn train_split() -> String {
    "train".into()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetConfig {
    #[serde(rename = "_component_")]
    pub component: Component,
    /// None: the builder's default source (see `DatasetBuilder::default_source`).
    pub source: Option<String>,
    pub data_files: Option<DataFiles>,
    #[serde(default = "train_split")]
    pub split: String,
    pub name: Option<String>,
    pub column_map: Option<BTreeMap<String, String>>,
    /// None: the builder's default (torchtune: alpaca True, others False).
    pub train_on_input: Option<bool>,
    #[serde(default)]
    pub packed: bool,
    pub new_system_prompt: Option<String>,
    pub conversation_column: Option<String>,
    pub conversation_style: Option<ConversationStyle>,
    /// Text column for text-completion datasets (default `text`).
    pub column: Option<String>,
    #[serde(default = "yes")]
    pub add_eos: bool,
    /// Packing: a sample that does not fit continues in the next pack (torchtune's default:
    /// true for text completion, false otherwise).
    pub split_across_pack: Option<bool>,
    pub filter_fn: Option<String>,
}

fn default_betas() -> (f64, f64) {
    (0.9, 0.999)
}
fn default_eps() -> f64 {
    1e-8
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    #[serde(rename = "_component_")]
    pub component: Component,
    pub lr: f64,
    /// None: PyTorch's default for the optimizer (AdamW 0.01, Adam/SGD 0).
    pub weight_decay: Option<f64>,
    #[serde(default = "default_betas")]
    pub betas: (f64, f64),
    #[serde(default = "default_eps")]
    pub eps: f64,
    #[serde(default)]
    pub momentum: f64,
    /// Accepted for torchtune compatibility; has no effect.
    pub fused: Option<bool>,
    #[serde(default)]
    pub amsgrad: bool,
}

fn half() -> f64 {
    0.5
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LrSchedulerConfig {
    #[serde(rename = "_component_")]
    pub component: Component,
    #[serde(default)]
    pub num_warmup_steps: usize,
    #[serde(default = "half")]
    pub num_cycles: f64,
}

fn dpo_beta() -> f64 {
    0.1
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LossConfig {
    #[serde(rename = "_component_")]
    pub component: Component,
    #[serde(default = "dpo_beta")]
    pub beta: f64,
    #[serde(default)]
    pub label_smoothing: f64,
    /// Row chunks of the output projection and cross-entropy (memory, not maths; default 8,
    /// 1 for none): see `training::chunked_loss`.
    pub num_output_chunks: Option<usize>,
    /// `SymmetricKLLoss`: the forward KL's share (torchtune's default 0.5).
    pub sym_kd_ratio: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricLoggerConfig {
    #[serde(rename = "_component_")]
    pub component: Component,
    pub log_dir: Option<PathBuf>,
    pub filename: Option<String>,
    pub project: Option<String>,
    #[serde(default)]
    pub organize_logs: bool,
}

fn groupsize() -> usize {
    256
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuantizerConfig {
    #[serde(rename = "_component_")]
    pub component: Component,
    #[serde(default = "groupsize")]
    pub groupsize: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProfilerConfig {
    #[serde(rename = "_component_")]
    pub component: Component,
    #[serde(default = "yes")]
    pub enabled: bool,
    /// torchtune's trace options; kept so they are shown, never used.
    #[serde(flatten)]
    pub options: BTreeMap<String, Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PushToHub {
    pub repo_id: String,
    #[serde(default)]
    pub private: bool,
}

fn one_or_many<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<DatasetConfig>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(Box<DatasetConfig>),
        Many(Vec<DatasetConfig>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(one) => vec![*one],
        OneOrMany::Many(many) => many,
    })
}

/// Tells `key: null` (Some(None)) from a missing key (None).
fn explicit_null<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Option<Value>>, D::Error> {
    Ok(Some(Option::<Value>::deserialize(d)?))
}

fn opt_one_or_many<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<DatasetConfig>>, D::Error> {
    let value = Option::<Value>::deserialize(d)?;
    value
        .map(|v| one_or_many(v).map_err(serde::de::Error::custom))
        .transpose()
}

fn one() -> usize {
    1
}

/// Config of every training recipe; recipe-specific sections are `Option`s that
/// validation guarantees are present for the recipe that needs them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    pub output_dir: PathBuf,
    /// None: random seed.
    pub seed: Option<u64>,
    #[serde(default = "yes")]
    pub shuffle: bool,
    pub batch_size: usize,
    pub epochs: usize,
    pub max_steps_per_epoch: Option<usize>,
    #[serde(default = "one")]
    pub gradient_accumulation_steps: usize,
    pub clip_grad_norm: Option<f64>,
    /// None: CUDA when available, else CPU (torchtune's `get_device(None)`).
    pub device: Option<Device>,
    #[serde(default)]
    pub dtype: Dtype,
    #[serde(default)]
    pub enable_activation_checkpointing: bool,
    #[serde(default)]
    pub enable_activation_offloading: bool,
    #[serde(default)]
    pub compile: bool,
    #[serde(default = "one")]
    pub log_every_n_steps: usize,
    #[serde(default)]
    pub log_peak_memory_stats: bool,
    pub log_level: Option<String>,
    #[serde(default)]
    pub resume_from_checkpoint: bool,
    /// tune: a fresh run may delete the checkpoints another run left in `output_dir` (without
    /// it, such a run is refused).
    #[serde(default)]
    pub overwrite_output_dir: bool,
    /// tune: on SIGINT/SIGTERM, save a checkpoint at the step boundary before exiting (without
    /// it, the run stops there keeping the last checkpoint it saved).
    #[serde(default)]
    pub save_on_preempt: bool,
    #[serde(default)]
    pub save_adapter_weights_only: bool,
    /// tune: also checkpoint every N optimizer steps (None: at epoch ends only).
    pub save_every_n_steps: Option<usize>,
    /// tune: delete older `step_*` checkpoints beyond this many (also accepted as
    /// `checkpointer.keep_last_n_checkpoints`, where torchtune main puts it).
    pub keep_last_n_checkpoints: Option<usize>,
    /// torchtune's QLoRA configs: tune always loads checkpoints memory-mapped, one tensor at a
    /// time, which is what this asks for, so both values load the same way.
    #[serde(default)]
    pub low_cpu_ram: bool,
    pub profiler: Option<ProfilerConfig>,
    #[serde(default)]
    pub optimizer_in_bwd: bool,
    pub custom_sharded_layers: Option<Vec<String>>,
    /// torchtune's distributed knobs: accepted at the values that mean what tune does (plain
    /// data parallelism, parameters on the device), refused otherwise (spec.rs, checks.rs).
    pub fsdp_reshard_after_forward: Option<bool>,
    #[serde(default)]
    pub fsdp_cpu_offload: bool,
    pub tensor_parallel_dim: Option<usize>,
    pub tensor_parallel_plan: Option<serde_yaml::Value>,
    pub data_parallel_shard_dim: Option<f64>,
    pub data_parallel_replicate_dim: Option<usize>,
    pub push_to_hub: Option<PushToHub>,
    pub run_val_every_n_steps: Option<usize>,
    #[serde(default, deserialize_with = "opt_one_or_many")]
    pub dataset_val: Option<Vec<DatasetConfig>>,
    /// The validation batch size (torchtune: `batch_size` when unset).
    pub batch_size_val: Option<usize>,
    pub model: ModelConfig,
    pub tokenizer: TokenizerConfig,
    pub checkpointer: CheckpointerConfig,
    /// One entry, or several to concatenate.
    #[serde(deserialize_with = "one_or_many")]
    pub dataset: Vec<DatasetConfig>,
    pub optimizer: OptimizerConfig,
    pub lr_scheduler: Option<LrSchedulerConfig>,
    pub loss: LossConfig,
    pub metric_logger: Option<MetricLoggerConfig>,
    /// QAT recipes.
    pub quantizer: Option<QuantizerConfig>,
    pub fake_quant_after_n_steps: Option<usize>,
    /// Knowledge distillation.
    pub teacher_model: Option<ModelConfig>,
    pub teacher_checkpointer: Option<CheckpointerConfig>,
    pub kd_loss: Option<LossConfig>,
    pub kd_ratio: Option<f64>,
    /// Full DPO: the frozen reference model.
    pub ref_checkpointer: Option<CheckpointerConfig>,
}

impl TrainConfig {
    /// torchtune's default KD mix between the SFT loss and the KD loss.
    pub fn kd_ratio(&self) -> f64 {
        self.kd_ratio.unwrap_or(0.5)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prompt {
    pub system: Option<String>,
    pub user: String,
}

fn prompt<'de, D: Deserializer<'de>>(d: D) -> Result<Prompt, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Text(String),
        Parts {
            #[serde(default)]
            system: Option<String>,
            user: String,
        },
    }
    Ok(match Raw::deserialize(d)? {
        Raw::Text(user) => Prompt { system: None, user },
        Raw::Parts { system, user } => Prompt { system, user },
    })
}

fn max_new_tokens() -> usize {
    300
}
fn temperature() -> f64 {
    0.6
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateConfig {
    pub model: ModelConfig,
    pub checkpointer: CheckpointerConfig,
    pub tokenizer: TokenizerConfig,
    pub output_dir: Option<PathBuf>,
    pub device: Option<Device>,
    #[serde(default)]
    pub dtype: Dtype,
    pub seed: Option<u64>,
    pub log_level: Option<String>,
    /// A plain string is the user turn.
    #[serde(deserialize_with = "prompt")]
    pub prompt: Prompt,
    /// tune: format the prompt with the tokenizer's chat template.
    #[serde(default)]
    pub chat: bool,
    #[serde(default = "max_new_tokens")]
    pub max_new_tokens: usize,
    #[serde(default = "temperature")]
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    #[serde(default = "yes")]
    pub stop_at_eos: bool,
    /// tune: a PEFT adapter directory applied on top of the checkpoint.
    pub adapter_dir: Option<PathBuf>,
    #[serde(default = "yes")]
    pub enable_kv_cache: bool,
    pub quantizer: Option<QuantizerConfig>,
    pub instruct_template: Option<String>,
    pub chat_format: Option<String>,
}

/// A validated config for one recipe.
#[derive(Debug, Clone, PartialEq)]
pub enum RecipeConfig {
    Train(Recipe, Box<TrainConfig>),
    Generate(Box<GenerateConfig>),
}

impl RecipeConfig {
    pub fn recipe(&self) -> Recipe {
        match self {
            Self::Train(r, _) => *r,
            Self::Generate(_) => Recipe::Generate,
        }
    }

    pub fn as_train(&self) -> Option<&TrainConfig> {
        match self {
            Self::Train(_, t) => Some(t),
            Self::Generate(_) => None,
        }
    }

    pub fn as_generate(&self) -> Option<&GenerateConfig> {
        match self {
            Self::Generate(g) => Some(g),
            Self::Train(..) => None,
        }
    }
}
