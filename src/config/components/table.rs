//! Fixed (non-model) components: canonical `tune.*` name, torchtune aliases, and
//! an optional warning when the alias is accepted with a substitution.

use super::{
    Component, ComponentKind, DatasetBuilder, DatasetKind, HfCheckpointer, LoggerKind, Lookup,
    LossKind, OptimizerKind, Profiler, Quantizer, QuantizerKind, RewardKind, SchedulerKind,
    TokenizerKind,
};
use crate::training::grpo_loss::TorchtuneGrpoLoss;

struct Entry {
    canonical: &'static str,
    aliases: &'static [&'static str],
    component: Component,
    /// Warning attached to the aliases only (the canonical name never warns).
    alias_warning: Option<&'static str>,
}

const fn e(
    canonical: &'static str,
    aliases: &'static [&'static str],
    component: Component,
) -> Entry {
    Entry {
        canonical,
        aliases,
        component,
        alias_warning: None,
    }
}

const fn warned(
    canonical: &'static str,
    aliases: &'static [&'static str],
    component: Component,
    warning: &'static str,
) -> Entry {
    Entry {
        canonical,
        aliases,
        component,
        alias_warning: Some(warning),
    }
}

const fn ds(
    name: &'static str,
    kind: DatasetKind,
    default_source: Option<&'static str>,
) -> Component {
    Component::Dataset(DatasetBuilder {
        name,
        kind,
        default_source,
        default_data_files: None,
    })
}

/// A dataset whose default Hub source is read through `files` (see
/// [`DatasetBuilder::default_data_files`]).
const fn ds_files(
    name: &'static str,
    kind: DatasetKind,
    source: &'static str,
    files: &'static str,
) -> Component {
    Component::Dataset(DatasetBuilder {
        name,
        kind,
        default_source: Some(source),
        default_data_files: Some(files),
    })
}

const fn quant(kind: QuantizerKind, module_swap: bool) -> Component {
    Component::Quantizer(Quantizer { kind, module_swap })
}

use DatasetKind::{
    Alpaca, Chat, Gsm8k, Gsm8kSft, Instruct, MultimodalChat, Preference, Prompt,
    StackExchangePaired, TextCompletion,
};

static TABLE: &[Entry] = &[
    // Tokenizers: llama3_1/llama3_2 use llama3's, gemma2 uses gemma's, as in torchtune.
    e(
        "tune.models.llama2.llama2_tokenizer",
        &["torchtune.models.llama2.llama2_tokenizer"],
        Component::Tokenizer(TokenizerKind::Llama2),
    ),
    e(
        "tune.models.llama3.llama3_tokenizer",
        &["torchtune.models.llama3.llama3_tokenizer"],
        Component::Tokenizer(TokenizerKind::Llama3),
    ),
    e(
        "tune.models.qwen2.qwen2_tokenizer",
        &["torchtune.models.qwen2.qwen2_tokenizer"],
        Component::Tokenizer(TokenizerKind::Qwen2),
    ),
    e(
        "tune.models.qwen2_5.qwen2_5_tokenizer",
        &["torchtune.models.qwen2_5.qwen2_5_tokenizer"],
        Component::Tokenizer(TokenizerKind::Qwen2_5),
    ),
    e(
        "tune.models.qwen3.qwen3_tokenizer",
        &["torchtune.models.qwen3.qwen3_tokenizer"],
        Component::Tokenizer(TokenizerKind::Qwen3),
    ),
    e(
        "tune.models.mistral.mistral_tokenizer",
        &["torchtune.models.mistral.mistral_tokenizer"],
        Component::Tokenizer(TokenizerKind::Mistral),
    ),
    e(
        "tune.models.phi3.phi3_mini_tokenizer",
        &["torchtune.models.phi3.phi3_mini_tokenizer"],
        Component::Tokenizer(TokenizerKind::Phi3Mini),
    ),
    e(
        "tune.models.phi4.phi4_tokenizer",
        &["torchtune.models.phi4.phi4_tokenizer"],
        Component::Tokenizer(TokenizerKind::Phi4),
    ),
    e(
        "tune.models.gemma.gemma_tokenizer",
        &["torchtune.models.gemma.gemma_tokenizer"],
        Component::Tokenizer(TokenizerKind::Gemma),
    ),
    e(
        "tune.models.smollm2.smollm2_tokenizer",
        &[],
        Component::Tokenizer(TokenizerKind::SmolLM2),
    ),
    e(
        "tune.tokenizers.HFTokenizer",
        &["torchtune.modules.transforms.tokenizers.HuggingFaceModelTokenizer"],
        Component::Tokenizer(TokenizerKind::HuggingFace),
    ),
    // Checkpointers
    e(
        "tune.checkpoint.HFCheckpointer",
        &[
            "torchtune.training.FullModelHFCheckpointer",
            "torchtune.utils.FullModelHFCheckpointer",
        ],
        Component::Checkpointer(HfCheckpointer),
    ),
    // Datasets (default sources are torchtune's)
    e(
        "tune.datasets.alpaca_dataset",
        &["torchtune.datasets.alpaca_dataset"],
        ds("alpaca_dataset", Alpaca, Some("tatsu-lab/alpaca")),
    ),
    e(
        "tune.datasets.alpaca_cleaned_dataset",
        &["torchtune.datasets.alpaca_cleaned_dataset"],
        ds(
            "alpaca_cleaned_dataset",
            Alpaca,
            Some("yahma/alpaca-cleaned"),
        ),
    ),
    e(
        "tune.datasets.instruct_dataset",
        &["torchtune.datasets.instruct_dataset"],
        ds("instruct_dataset", Instruct, None),
    ),
    e(
        "tune.datasets.chat_dataset",
        &["torchtune.datasets.chat_dataset"],
        ds("chat_dataset", Chat, None),
    ),
    e(
        "tune.datasets.multimodal_chat_dataset",
        &["torchtune.datasets.multimodal.multimodal_chat_dataset"],
        ds("multimodal_chat_dataset", MultimodalChat, None),
    ),
    e(
        "tune.datasets.slimorca_dataset",
        &["torchtune.datasets.slimorca_dataset"],
        ds("slimorca_dataset", Chat, Some("Open-Orca/SlimOrca-Dedup")),
    ),
    e(
        "tune.datasets.text_completion_dataset",
        &["torchtune.datasets.text_completion_dataset"],
        ds("text_completion_dataset", TextCompletion, None),
    ),
    e(
        "tune.datasets.cnn_dailymail_articles_dataset",
        &["torchtune.datasets.cnn_dailymail_articles_dataset"],
        ds(
            "cnn_dailymail_articles_dataset",
            TextCompletion,
            Some("ccdv/cnn_dailymail"),
        ),
    ),
    e(
        "tune.datasets.preference_dataset",
        &["torchtune.datasets.preference_dataset"],
        ds("preference_dataset", Preference, None),
    ),
    e(
        "tune.datasets.stack_exchange_paired_dataset",
        &["torchtune.datasets.stack_exchange_paired_dataset"],
        ds(
            "stack_exchange_paired_dataset",
            StackExchangePaired,
            Some("lvwerra/stack-exchange-paired"),
        ),
    ),
    e(
        "tune.datasets.hh_rlhf_helpful_dataset",
        &["torchtune.datasets.hh_rlhf_helpful_dataset"],
        ds(
            "hh_rlhf_helpful_dataset",
            Preference,
            Some("RLHFlow/HH-RLHF-Helpful-standard"),
        ),
    ),
    e(
        "tune.datasets.gsm8k_sft",
        &["torchtune.dev.grpo.gsm8k.gsm8k_sft"],
        ds_files(
            "gsm8k_sft",
            Gsm8kSft,
            "openai/gsm8k",
            "main/{split}-*.parquet",
        ),
    ),
    // Prompt datasets (the GRPO recipes)
    e(
        "tune.datasets.gsm8k_dataset",
        &[
            "torchtune.dev.grpo.gsm8k.gsm8k_dataset",
            "torchtune.dev.rl.gsm8k.gsm8k_dataset",
        ],
        ds_files(
            "gsm8k_dataset",
            Gsm8k,
            "openai/gsm8k",
            "main/{split}-*.parquet",
        ),
    ),
    e(
        "tune.datasets.prompt_dataset",
        &[],
        ds("prompt_dataset", Prompt, None),
    ),
    // Optimizers
    e(
        "tune.optim.AdamW",
        &["torch.optim.AdamW"],
        Component::Optimizer(OptimizerKind::AdamW),
    ),
    e(
        "tune.optim.Adam",
        &["torch.optim.Adam"],
        Component::Optimizer(OptimizerKind::Adam),
    ),
    e(
        "tune.optim.SGD",
        &["torch.optim.SGD"],
        Component::Optimizer(OptimizerKind::Sgd),
    ),
    warned(
        "tune.optim.AdamW",
        &[
            "bitsandbytes.optim.PagedAdamW",
            "bitsandbytes.optim.PagedAdamW8bit",
            "bitsandbytes.optim.PagedAdamW32bit",
            "bitsandbytes.optim.AdamW8bit",
            "torchao.optim.AdamW8bit",
        ],
        Component::Optimizer(OptimizerKind::AdamW),
        "paged/8-bit bitsandbytes optimizers are not available; using plain AdamW (more optimizer memory)",
    ),
    // LR schedulers
    e(
        "tune.lr_schedulers.cosine_with_warmup",
        &[
            "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "torchtune.modules.get_cosine_schedule_with_warmup",
        ],
        Component::LrScheduler(SchedulerKind::CosineWithWarmup),
    ),
    e(
        "tune.lr_schedulers.linear_with_warmup",
        &[
            "torchtune.training.lr_schedulers.get_linear_schedule_with_warmup",
            "transformers.get_linear_schedule_with_warmup",
        ],
        Component::LrScheduler(SchedulerKind::LinearWithWarmup),
    ),
    e(
        "tune.lr_schedulers.constant_with_warmup",
        &[
            "torchtune.training.lr_schedulers.get_constant_schedule_with_warmup",
            "transformers.get_constant_schedule_with_warmup",
        ],
        Component::LrScheduler(SchedulerKind::ConstantWithWarmup),
    ),
    // Losses: chunked/linear variants are PyTorch memory tricks, same maths.
    e(
        "tune.loss.CrossEntropyLoss",
        &[
            "torchtune.modules.loss.CEWithChunkedOutputLoss",
            "torchtune.modules.loss.LinearCrossEntropyLoss",
            "torch.nn.CrossEntropyLoss",
        ],
        Component::Loss(LossKind::CrossEntropy),
    ),
    e(
        "tune.loss.DPOLoss",
        &[
            "torchtune.rlhf.loss.DPOLoss",
            "torchtune.modules.rlhf.loss.DPOLoss",
        ],
        Component::Loss(LossKind::Dpo),
    ),
    e(
        "tune.loss.ForwardKLLoss",
        &[
            "torchtune.modules.loss.ForwardKLLoss",
            "torchtune.modules.loss.ForwardKLWithChunkedOutputLoss",
        ],
        Component::Loss(LossKind::ForwardKl),
    ),
    e(
        "tune.loss.ReverseKLLoss",
        &[
            "torchtune.modules.loss.ReverseKLLoss",
            "torchtune.modules.loss.ReverseKLWithChunkedOutputLoss",
        ],
        Component::Loss(LossKind::ReverseKl),
    ),
    e(
        "tune.loss.SymmetricKLLoss",
        &[
            "torchtune.modules.loss.SymmetricKLLoss",
            "torchtune.modules.loss.SymmetricKLWithChunkedOutputLoss",
        ],
        Component::Loss(LossKind::SymmetricKl),
    ),
    // GRPO's policy losses (torchtune main's `dev.grpo.loss`; no release shipped them).
    e(
        "tune.loss.GRPOLoss",
        &["torchtune.dev.grpo.loss.GRPOLoss"],
        Component::Loss(LossKind::Grpo(TorchtuneGrpoLoss::Token)),
    ),
    e(
        "tune.loss.GRPOCompletionLoss",
        &["torchtune.dev.grpo.loss.GRPOCompletionLoss"],
        Component::Loss(LossKind::Grpo(TorchtuneGrpoLoss::Completion)),
    ),
    e(
        "tune.loss.GRPOSimpleLoss",
        &["torchtune.dev.grpo.loss.GRPOSimpleLoss"],
        Component::Loss(LossKind::Grpo(TorchtuneGrpoLoss::Simple)),
    ),
    // TRL's GRPOTrainer computes its loss inside the trainer: no class to alias.
    e(
        "tune.loss.TRLGRPOLoss",
        &[],
        Component::Loss(LossKind::TrlGrpo),
    ),
    e(
        "tune.loss.PPOLoss",
        &[
            "torchtune.rlhf.loss.PPOLoss",
            "torchtune.modules.rlhf.loss.PPOLoss",
        ],
        Component::Loss(LossKind::Ppo),
    ),
    // Reward functions (the GRPO recipes' `reward_functions`)
    e(
        "tune.rewards.gsm8k_shaped_correctness",
        &[
            "torchtune.dev.grpo.rewards.batch_shaped_correctness_reward",
            "torchtune.dev.grpo.rewards.shaped_correctness_reward",
        ],
        Component::Reward(RewardKind::Gsm8kShapedCorrectness),
    ),
    e(
        "tune.rewards.thinking_answer_formatting",
        &["torchtune.dev.rl.rewards.ThinkingAnswerFormattingReward"],
        Component::Reward(RewardKind::ThinkingAnswerFormatting),
    ),
    e(
        "tune.rewards.think_presence",
        &["torchtune.dev.rl.rewards.at_least_one_space_between_think_tags"],
        Component::Reward(RewardKind::ThinkPresence),
    ),
    e(
        "tune.rewards.length",
        &[],
        Component::Reward(RewardKind::Length),
    ),
    e(
        "tune.rewards.command",
        &[],
        Component::Reward(RewardKind::Command),
    ),
    // Metric loggers
    e(
        "tune.metric_logging.DiskLogger",
        &[
            "torchtune.training.metric_logging.DiskLogger",
            "torchtune.utils.metric_logging.DiskLogger",
        ],
        Component::MetricLogger(LoggerKind::Disk),
    ),
    e(
        "tune.metric_logging.StdoutLogger",
        &[
            "torchtune.training.metric_logging.StdoutLogger",
            "torchtune.utils.metric_logging.StdoutLogger",
        ],
        Component::MetricLogger(LoggerKind::Stdout),
    ),
    e(
        "tune.metric_logging.TensorBoardLogger",
        &[
            "torchtune.training.metric_logging.TensorBoardLogger",
            "torchtune.utils.metric_logging.TensorBoardLogger",
        ],
        Component::MetricLogger(LoggerKind::TensorBoard),
    ),
    warned(
        "tune.metric_logging.DiskLogger",
        &[
            "torchtune.training.metric_logging.WandBLogger",
            "torchtune.utils.metric_logging.WandBLogger",
            "torchtune.training.metric_logging.CometLogger",
            "torchtune.training.metric_logging.MLFlowLogger",
        ],
        Component::MetricLogger(LoggerKind::Disk),
        "this logger is not supported (no network service); metrics are written to disk instead",
    ),
    // QAT quantizers
    e(
        "tune.quantization.Int8DynActInt4WeightQATQuantizer",
        &["torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer"],
        quant(QuantizerKind::Int8DynActInt4Weight, false),
    ),
    e(
        "tune.quantization.Int4WeightOnlyQATQuantizer",
        &["torchtune.training.quantization.Int4WeightOnlyQATQuantizer"],
        quant(QuantizerKind::Int4WeightOnly, false),
    ),
    e(
        "tune.quantization.Int8DynActInt4WeightQATQuantizerModuleSwap",
        &["torchtune.training.quantization.Int8DynActInt4WeightQATQuantizerModuleSwap"],
        quant(QuantizerKind::Int8DynActInt4Weight, true),
    ),
    e(
        "tune.quantization.Int4WeightOnlyQATQuantizerModuleSwap",
        &["torchtune.training.quantization.Int4WeightOnlyQATQuantizerModuleSwap"],
        quant(QuantizerKind::Int4WeightOnly, true),
    ),
    // Profiler: accepted so torchtune configs load; validation warns when enabled.
    e(
        "tune.profiler",
        &[
            "torchtune.training.setup_torch_profiler",
            "torchtune.utils.setup_torch_profiler",
        ],
        Component::Profiler(Profiler),
    ),
];

/// Names that are recognised but refused, with the reason shown to the user.
static UNSUPPORTED: &[(&str, &str)] = &[
    (
        "torchtune.datasets.samsum_dataset",
        "its SummarizeTemplate prompt is not built in; `torchtune.datasets.instruct_dataset` with `source: Samsung/samsum` and `column_map: {input: dialogue, output: summary}` reads the same rows without it",
    ),
    (
        "torchtune.datasets.grammar_dataset",
        "its GrammarErrorCorrectionTemplate prompt is not built in; `torchtune.datasets.instruct_dataset` with `source: liweili/c4_200m` reads the same rows without it",
    ),
    (
        "torchtune.datasets.wikitext_dataset",
        "it is not built in; `torchtune.datasets.text_completion_dataset` with `source: EleutherAI/wikitext_document_level` and `column: page` reads its rows",
    ),
    ("torchtune.training.FullModelMetaCheckpointer", META),
    ("torchtune.utils.FullModelMetaCheckpointer", META),
    ("torchtune.training.FullModelTorchTuneCheckpointer", META),
    ("torchtune.utils.FullModelTorchTuneCheckpointer", META),
    ("torchtune.training.DistributedCheckpointer", META),
    (
        "torchtune.dev.rl.rewards.FormattedMathCorrectnessReward",
        MATH_VERIFY,
    ),
    (
        "torchtune.dev.rl.rewards.math_response_correct",
        MATH_VERIFY,
    ),
    ("torchtune.dev.rl.rewards.batched_rewards", MATH_VERIFY),
];

const MATH_VERIFY: &str = "it compares answers with the `math_verify` Python package (LaTeX parsing, sympy equivalence), which tune does not reproduce; run it from `tune.rewards.command` (a Python script calling math_verify.parse/verify on each JSON line's `completion` and `answer`), or use `tune.rewards.gsm8k_shaped_correctness` for gsm8k's integer answers";

const META: &str = "only Hugging Face checkpoints are read; convert to HF safetensors \
                    (config.json + *.safetensors) and use torchtune.training.FullModelHFCheckpointer";

const VISION: &str = "vision-language models are not supported: tune fine-tunes text-only decoders \
                      (for Llama 3.2's text models use torchtune.models.llama3_2.*)";

/// Llama 4 is refused as itself, not as a vision model: its text decoder alone is already what
/// tune lacks, and "vision" would send a user looking for a text-only Llama 4 builder.
const LLAMA4: &str = "Llama 4 is not supported: tune has no mixture-of-experts decoder (nor Llama 4's \
                      early-fusion vision encoder); tune's Llama family is Llama 2, 3, 3.1, 3.2 and 3.3";

pub(super) fn unsupported(name: &str) -> Option<&'static str> {
    let model = ["torchtune.models.", "tune.models."]
        .iter()
        .find_map(|ns| name.strip_prefix(ns));
    if let Some(rest) = model {
        if rest.starts_with("llama4.") {
            return Some(LLAMA4);
        }
        if rest.contains("_vision") || rest.starts_with("clip.") {
            return Some(VISION);
        }
    }
    UNSUPPORTED
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, r)| *r)
}

pub(super) fn find(name: &str) -> Option<Lookup> {
    TABLE.iter().find_map(|entry| {
        let is_alias = entry.aliases.contains(&name);
        (entry.canonical == name && entry.alias_warning.is_none() || is_alias).then(|| Lookup {
            component: entry.component.clone(),
            canonical: entry.canonical.to_string(),
            warning: if is_alias {
                entry.alias_warning.map(|w| format!("`{name}`: {w}"))
            } else {
                None
            },
        })
    })
}

pub(super) fn canonical_of(component: &Component) -> Option<&'static str> {
    TABLE
        .iter()
        .find(|e| &e.component == component)
        .map(|e| e.canonical)
}

pub(super) fn names(kind: Option<ComponentKind>) -> Vec<String> {
    let mut out = Vec::new();
    for entry in TABLE {
        if kind.is_some_and(|k| k != entry.component.kind()) {
            continue;
        }
        for name in std::iter::once(&entry.canonical).chain(entry.aliases) {
            if !out.iter().any(|o| o == name) {
                out.push((*name).to_string());
            }
        }
    }
    out
}
