//! `_component_` registry: maps the dotted names found in configs (this project's
//! `tune.*` names and torchtune's names as aliases) to a typed [`Component`].

mod models;
mod table;

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::config::suggest;
pub use crate::data::DatasetKind;
pub use crate::training::optimizer::OptimizerKind;

pub use models::{ModelBuilder, ModelFamily, ModelVariant};

/// Which config section a component belongs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ComponentKind {
    Model,
    Tokenizer,
    Checkpointer,
    Dataset,
    Optimizer,
    LrScheduler,
    Loss,
    MetricLogger,
    Quantizer,
    Profiler,
    Reward,
}

impl fmt::Display for ComponentKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Model => "model builder",
            Self::Tokenizer => "tokenizer",
            Self::Checkpointer => "checkpointer",
            Self::Dataset => "dataset",
            Self::Optimizer => "optimizer",
            Self::LrScheduler => "learning-rate scheduler",
            Self::Loss => "loss",
            Self::MetricLogger => "metric logger",
            Self::Quantizer => "quantizer",
            Self::Profiler => "profiler",
            Self::Reward => "reward function",
        })
    }
}

/// Tokenizer flavour; all are loaded from a Hugging Face `tokenizer.json`, the
/// flavour picks special tokens and the default prompt format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    Llama2,
    Llama3,
    Qwen2,
    Qwen2_5,
    Qwen3,
    Mistral,
    Phi3Mini,
    Phi4,
    Gemma,
    SmolLM2,
    /// Any model: everything comes from tokenizer.json / tokenizer_config.json.
    HuggingFace,
}

/// A dataset builder: torchtune's function name, how its rows become samples (the data
/// layer's [`DatasetKind`]) and the Hub dataset it reads when the config gives no `source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DatasetBuilder {
    pub name: &'static str,
    pub kind: DatasetKind,
    /// Hub dataset used when the config gives no `source`.
    pub default_source: Option<&'static str>,
    /// The files of the default source to read when the config names none, `{split}` standing
    /// for the split's name (gsm8k's repo holds two configurations and two splits, each its own
    /// files; torchtune picks `main` and the split by name).
    pub default_data_files: Option<&'static str>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchedulerKind {
    CosineWithWarmup,
    LinearWithWarmup,
    ConstantWithWarmup,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossKind {
    /// Token cross-entropy (chunked or not: chunking is a PyTorch memory trick).
    CrossEntropy,
    Dpo,
    ForwardKl,
    ReverseKl,
    SymmetricKl,
    /// The GRPO recipes' policy losses (`training::grpo_loss`): torchtune's `GRPOLoss`,
    /// `GRPOCompletionLoss` and `GRPOSimpleLoss`.
    Grpo(crate::training::grpo_loss::TorchtuneGrpoLoss),
    /// TRL's `GRPOTrainer` loss (`loss_type` grpo, bnpo, dr_grpo, dapo; GSPO by
    /// `importance_sampling_level: sequence`).
    TrlGrpo,
    /// torchtune's `PPOLoss` (the PPO recipe's clipped policy and value losses).
    Ppo,
}

/// A reward function of the GRPO recipes' `reward_functions` (`crate::rewards`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RewardKind {
    /// torchtune's gsm8k `batch_shaped_correctness_reward`.
    Gsm8kShapedCorrectness,
    /// torchtune's `ThinkingAnswerFormattingReward`.
    ThinkingAnswerFormatting,
    /// torchtune's `at_least_one_space_between_think_tags`.
    ThinkPresence,
    /// Closeness to a target completion length.
    Length,
    /// Any program: one JSON line in, one number out, per completion.
    Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoggerKind {
    Disk,
    Stdout,
    TensorBoard,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantizerKind {
    Int8DynActInt4Weight,
    Int4WeightOnly,
}

/// A QAT quantizer component.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantizer {
    pub kind: QuantizerKind,
    /// torchtune's `...ModuleSwap` variants; same maths here.
    pub module_swap: bool,
}

/// Hugging Face safetensors checkpoints (the only supported format).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HfCheckpointer;

/// torchtune's profiler, accepted so its configs load (validation warns when enabled).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Profiler;

/// A resolved `_component_`.
#[derive(Debug, Clone, PartialEq)]
pub enum Component {
    Model(ModelBuilder),
    Tokenizer(TokenizerKind),
    Checkpointer(HfCheckpointer),
    Dataset(DatasetBuilder),
    Optimizer(OptimizerKind),
    LrScheduler(SchedulerKind),
    Loss(LossKind),
    MetricLogger(LoggerKind),
    Quantizer(Quantizer),
    Profiler(Profiler),
    Reward(RewardKind),
}

impl Component {
    pub fn kind(&self) -> ComponentKind {
        match self {
            Self::Model(_) => ComponentKind::Model,
            Self::Tokenizer(_) => ComponentKind::Tokenizer,
            Self::Checkpointer(_) => ComponentKind::Checkpointer,
            Self::Dataset(_) => ComponentKind::Dataset,
            Self::Optimizer(_) => ComponentKind::Optimizer,
            Self::LrScheduler(_) => ComponentKind::LrScheduler,
            Self::Loss(_) => ComponentKind::Loss,
            Self::MetricLogger(_) => ComponentKind::MetricLogger,
            Self::Quantizer(_) => ComponentKind::Quantizer,
            Self::Profiler(_) => ComponentKind::Profiler,
            Self::Reward(_) => ComponentKind::Reward,
        }
    }

    /// This project's name for the component (`tune.*`).
    pub fn canonical_name(&self) -> String {
        match self {
            Self::Model(m) => m.canonical_name(),
            other => table::canonical_of(other)
                .unwrap_or("<unnamed>")
                .to_string(),
        }
    }
}

/// A successful lookup: the component, its canonical name, and a warning when the
/// name is accepted with a substitution (e.g. PagedAdamW -> AdamW).
#[derive(Debug, Clone, PartialEq)]
pub struct Lookup {
    pub component: Component,
    pub canonical: String,
    pub warning: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    #[error("unknown component `{name}`{}", hint(suggestions))]
    Unknown {
        name: String,
        suggestions: Vec<String>,
    },
    #[error("component `{name}` is not supported: {reason}")]
    Unsupported { name: String, reason: &'static str },
}

fn hint(suggestions: &[String]) -> String {
    let s = suggest::did_you_mean(suggestions);
    if s.is_empty() { s } else { format!("; {s}") }
}

/// Resolves a `_component_` name. `expected` narrows "did you mean" suggestions
/// to the section's kind.
pub fn lookup(name: &str, expected: Option<ComponentKind>) -> Result<Lookup, LookupError> {
    let name = name.trim();
    if let Some(reason) = table::unsupported(name) {
        return Err(LookupError::Unsupported {
            name: name.to_string(),
            reason,
        });
    }
    if let Some(found) = table::find(name) {
        return Ok(found);
    }
    if let Some(found) = models::parse(name) {
        return Ok(found);
    }
    let candidates = known_names(expected);
    Err(LookupError::Unknown {
        name: name.to_string(),
        suggestions: suggest::similar(name, candidates.iter().map(String::as_str)),
    })
}

/// Every known name (canonical and aliases), optionally of one kind. Model
/// names are generated from the known families and sizes.
pub fn known_names(kind: Option<ComponentKind>) -> Vec<String> {
    let mut names = table::names(kind);
    if kind.is_none() || kind == Some(ComponentKind::Model) {
        names.extend(models::example_names());
    }
    names
}

/// What a section's `_component_` resolves to: the section's own part of [`Component`], so a
/// typed section cannot hold another kind's component.
pub trait ComponentOf: Sized {
    const KIND: ComponentKind;

    /// This section's part of a resolved component (`None` for another kind's).
    fn from_component(component: Component) -> Option<Self>;

    /// The resolved component it is.
    fn into_component(self) -> Component;
}

/// Each section's component type: its kind, its part of [`Component`], and its serialised form
/// (the canonical `tune.*` name, as config files and fingerprints hold it).
macro_rules! component_type {
    ($($t:ty => $variant:ident),* $(,)?) => {$(
        impl ComponentOf for $t {
            const KIND: ComponentKind = ComponentKind::$variant;
            fn from_component(component: Component) -> Option<Self> {
                match component {
                    Component::$variant(c) => Some(c),
                    _ => None,
                }
            }

            fn into_component(self) -> Component {
                Component::$variant(self)
            }
        }

        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                Component::$variant(self.clone()).serialize(s)
            }
        }
    )*};
}

component_type!(
    ModelBuilder => Model,
    TokenizerKind => Tokenizer,
    HfCheckpointer => Checkpointer,
    DatasetBuilder => Dataset,
    OptimizerKind => Optimizer,
    SchedulerKind => LrScheduler,
    LossKind => Loss,
    LoggerKind => MetricLogger,
    Quantizer => Quantizer,
    Profiler => Profiler,
    RewardKind => Reward,
);

impl Serialize for Component {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.canonical_name())
    }
}

impl<'de> Deserialize<'de> for Component {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        lookup(&name, None)
            .map(|l| l.component)
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn comp(name: &str) -> Component {
        lookup(name, None).unwrap().component
    }

    #[test]
    fn torchtune_aliases_match_tune_names() {
        for (tt, tune) in [
            (
                "torchtune.models.llama3.llama3_tokenizer",
                "tune.models.llama3.llama3_tokenizer",
            ),
            (
                "torchtune.training.FullModelHFCheckpointer",
                "tune.checkpoint.HFCheckpointer",
            ),
            ("torch.optim.AdamW", "tune.optim.AdamW"),
            (
                "torchtune.datasets.alpaca_cleaned_dataset",
                "tune.datasets.alpaca_cleaned_dataset",
            ),
            (
                "torchtune.modules.loss.CEWithChunkedOutputLoss",
                "tune.loss.CrossEntropyLoss",
            ),
            ("torchtune.rlhf.loss.DPOLoss", "tune.loss.DPOLoss"),
            (
                "torchtune.training.metric_logging.DiskLogger",
                "tune.metric_logging.DiskLogger",
            ),
        ] {
            assert_eq!(comp(tt), comp(tune), "{tt}");
            assert_eq!(lookup(tt, None).unwrap().canonical, tune);
        }
    }

    #[test]
    fn component_kinds() {
        assert_eq!(
            comp("torch.optim.SGD"),
            Component::Optimizer(OptimizerKind::Sgd)
        );
        assert_eq!(
            comp("torchtune.modules.get_cosine_schedule_with_warmup"),
            Component::LrScheduler(SchedulerKind::CosineWithWarmup)
        );
        assert_eq!(
            comp("torchtune.training.quantization.Int4WeightOnlyQATQuantizerModuleSwap"),
            Component::Quantizer(Quantizer {
                kind: QuantizerKind::Int4WeightOnly,
                module_swap: true
            })
        );
        match comp("torchtune.datasets.stack_exchange_paired_dataset") {
            Component::Dataset(d) => {
                assert_eq!(d.kind, DatasetKind::StackExchangePaired);
                assert_eq!(d.default_source, Some("lvwerra/stack-exchange-paired"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            comp("torchtune.modules.loss.ReverseKLLoss"),
            Component::Loss(LossKind::ReverseKl)
        );
    }

    #[test]
    fn substitutions_warn() {
        let l = lookup("bitsandbytes.optim.PagedAdamW8bit", None).unwrap();
        assert_eq!(l.component, Component::Optimizer(OptimizerKind::AdamW));
        assert!(l.warning.unwrap().contains("AdamW"));
        let l = lookup("torchtune.training.metric_logging.WandBLogger", None).unwrap();
        assert_eq!(l.component, Component::MetricLogger(LoggerKind::Disk));
        assert!(l.warning.unwrap().contains("not supported"));
    }

    #[test]
    fn meta_checkpointer_unsupported() {
        let err = lookup("torchtune.training.FullModelMetaCheckpointer", None).unwrap_err();
        assert!(
            err.to_string().contains("convert to HF safetensors"),
            "{err}"
        );
    }

    #[test]
    fn llama4_is_refused_as_llama4() {
        for name in [
            "torchtune.models.llama4.lora_llama4_scout_17b_16e",
            "torchtune.models.llama4.llama4_transform",
            "tune.models.llama4.llama4_maverick_17b_128e",
        ] {
            let err = lookup(name, None).unwrap_err();
            assert!(matches!(err, LookupError::Unsupported { .. }), "{name}");
            let err = err.to_string();
            assert!(
                err.contains(&format!("component `{name}`"))
                    && err.contains("Llama 4 is not supported")
                    && !err.contains("vision-language"),
                "{err}"
            );
        }
        // Vision models keep their own reason.
        let err = lookup("torchtune.models.llama3_2_vision.llama3_2_vision_11b", None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("vision-language models"), "{err}");
    }

    #[test]
    fn unknown_suggests() {
        let err = lookup("torch.optim.AdamX", Some(ComponentKind::Optimizer)).unwrap_err();
        assert!(err.to_string().contains("did you mean"), "{err}");
        assert!(err.to_string().contains("torch.optim.AdamW"), "{err}");
        let err = lookup("torchtune.models.llama3_2.lora_llama3_2_1bb", None);
        // size is only a hint, so an odd size still resolves
        assert!(err.is_ok());
        let err = lookup(
            "torchtune.models.lama3_2.lora_llama3_2_1b",
            Some(ComponentKind::Model),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("torchtune.models.llama3_2.lora_llama3_2_1b"),
            "{err}"
        );
    }

    #[test]
    fn serde_round_trip() {
        let c: Component =
            serde_yaml::from_str("torchtune.models.qwen2_5.lora_qwen2_5_0_5b").unwrap();
        let s = serde_yaml::to_string(&c).unwrap();
        assert_eq!(s.trim(), "tune.models.qwen2_5.lora_qwen2_5_0_5b");
    }
}
