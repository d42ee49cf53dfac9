//! Tokenizer, datasets and loader from the `tokenizer`, `dataset` and batching keys.

use std::path::Path;

use super::SetupError;
use crate::config::components::{Component, TokenizerKind};
use crate::config::paths::resolve_tokenizer_json;
use crate::config::schema::{
    ConversationStyle, DataFiles, DatasetConfig, TokenizerConfig, TruncationType,
};
use crate::data::{self, DataLoader, Dataset, DatasetKind, DatasetSpec, LoaderConfig, OneOrMany};
use crate::tokenizer::{
    ConfigFiles, MessageFormat, ModelFormat, PromptTemplate, Tokenizer, Truncation,
};
use crate::training::validation::Validation;

/// The model's tokenizer.json with the message format of the component the config names.
pub fn tokenizer(cfg: &TokenizerConfig) -> Result<Tokenizer, SetupError> {
    let Some((key, location)) = cfg.location() else {
        return Err(SetupError::Invalid {
            key: "tokenizer.path".into(),
            message: "missing: point it at the model's tokenizer.json".into(),
        });
    };
    let path = resolve_tokenizer_json(location).map_err(|e| SetupError::Invalid {
        key: key.into(),
        message: e.to_string(),
    })?;
    let configs = ConfigFiles {
        tokenizer_config: cfg.tokenizer_config_json_path.clone(),
        generation_config: cfg.generation_config_path.clone(),
    };
    let mut tokenizer = Tokenizer::from_files(&path, &configs)?;
    if let Some(special) = &cfg.special_tokens_path {
        check_special_tokens(&tokenizer, special)?;
    }
    tokenizer.set_format(model_format(cfg)?)?;
    Ok(tokenizer)
}

/// torchtune's `special_tokens_path` (a tokenizer.json whose `added_tokens` give the special
/// tokens' ids): tune takes them from the model's tokenizer.json, so the file must agree with
/// it, or the ids torchtune would use are not the ones tune trains on.
fn check_special_tokens(tokenizer: &Tokenizer, path: &Path) -> Result<(), SetupError> {
    let key = "tokenizer.special_tokens_path";
    let invalid = |message: String| SetupError::Invalid {
        key: key.into(),
        message,
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| invalid(format!("cannot read {}: {e}", path.display())))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| invalid(format!("{} is not JSON: {e}", path.display())))?;
    let tokens = json
        .get("added_tokens")
        .and_then(serde_json::Value::as_array)
        .ok_or_else(|| {
            invalid(format!(
                "{} has no `added_tokens` list (torchtune reads the special tokens from it)",
                path.display()
            ))
        })?;
    for t in tokens {
        let (Some(content), Some(id)) = (
            t.get("content").and_then(serde_json::Value::as_str),
            t.get("id").and_then(serde_json::Value::as_u64),
        ) else {
            continue;
        };
        let ours = tokenizer.token_to_id(content);
        if ours != Some(id as u32) {
            return Err(invalid(format!(
                "{} gives {content:?} id {id}, but {} has {}: point both at the same model's tokenizer.json, or drop special_tokens_path",
                path.display(),
                tokenizer.path().display(),
                ours.map_or("no such token".to_string(), |i| format!("id {i}")),
            )));
        }
    }
    Ok(())
}

/// The format torchtune's tokenizer component writes, and its prompt template: the configured
/// one, or the component's default.
pub fn model_format(cfg: &TokenizerConfig) -> Result<ModelFormat, SetupError> {
    let kind = match &cfg.component {
        Component::Tokenizer(kind) => *kind,
        _ => TokenizerKind::HuggingFace,
    };
    let format = match kind {
        TokenizerKind::Llama3 => MessageFormat::Llama3,
        TokenizerKind::Qwen2 => MessageFormat::Qwen2,
        TokenizerKind::Qwen2_5 | TokenizerKind::Qwen3 => MessageFormat::Qwen2_5,
        TokenizerKind::Llama2 | TokenizerKind::Mistral | TokenizerKind::Gemma => {
            MessageFormat::SentencePiece
        }
        TokenizerKind::Phi3Mini => MessageFormat::Phi3,
        TokenizerKind::Phi4 => MessageFormat::Phi4,
        TokenizerKind::SmolLM2 | TokenizerKind::HuggingFace => MessageFormat::ChatTemplate,
    };
    let invalid = |message: String| SetupError::Invalid {
        key: "tokenizer.prompt_template".into(),
        message,
    };
    let prompt_template = match &cfg.prompt_template {
        None => match kind {
            TokenizerKind::Llama2 => Some(PromptTemplate::Llama2Chat),
            TokenizerKind::Mistral => Some(PromptTemplate::MistralChat),
            _ => None,
        },
        Some(None) => None,
        Some(Some(value)) => {
            if format == MessageFormat::ChatTemplate {
                return Err(invalid(
                    "the checkpoint's chat template formats the messages with this tokenizer component, so a prompt template cannot apply; remove `prompt_template`, or name a torchtune tokenizer component (e.g. torchtune.models.llama3.llama3_tokenizer)".into(),
                ));
            }
            let json = serde_json::to_value(value).map_err(|e| invalid(e.to_string()))?;
            Some(PromptTemplate::from_value(&json).map_err(|e| invalid(e.to_string()))?)
        }
    };
    Ok(ModelFormat {
        format,
        prompt_template,
        truncation: match cfg.truncation_type {
            Some(TruncationType::Left) => Truncation::Left,
            Some(TruncationType::Right) | None => Truncation::Right,
        },
    })
}

/// The data module's view of one `dataset` entry.
pub fn spec(cfg: &DatasetConfig) -> Result<(DatasetSpec, DatasetKind), SetupError> {
    let Component::Dataset(builder) = &cfg.component else {
        return Err(SetupError::Invalid {
            key: "dataset._component_".into(),
            message: "not a dataset builder".into(),
        });
    };
    let kind = DatasetKind::from_component(builder.name).ok_or_else(|| SetupError::Invalid {
        key: "dataset._component_".into(),
        message: format!("{} is not supported by the data pipeline yet", builder.name),
    })?;
    let spec = DatasetSpec {
        component: Some(builder.name.to_string()),
        source: cfg
            .source
            .clone()
            .or_else(|| builder.default_source.map(String::from)),
        data_files: cfg.data_files.as_ref().map(|f| match f {
            DataFiles::One(s) => OneOrMany::One(s.clone()),
            DataFiles::Many(v) => OneOrMany::Many(v.clone()),
        }),
        split: Some(cfg.split.clone()),
        column_map: cfg.column_map.clone(),
        train_on_input: cfg.train_on_input,
        packed: Some(cfg.packed),
        new_system_prompt: cfg.new_system_prompt.clone(),
        conversation_column: cfg.conversation_column.clone(),
        conversation_style: cfg.conversation_style.map(|s| match s {
            ConversationStyle::Sharegpt => data::ConversationStyle::Sharegpt,
            ConversationStyle::Openai => data::ConversationStyle::Openai,
        }),
        column: cfg.column.clone(),
        add_eos: Some(cfg.add_eos),
        split_across_pack: cfg.split_across_pack,
        ..Default::default()
    };
    Ok((spec, kind))
}

/// Builds every dataset entry (torchtune concatenates a list of them) and joins them.
pub fn dataset(
    entries: &[DatasetConfig],
    tokenizer: &Tokenizer,
    max_seq_len: Option<usize>,
    base_dir: &Path,
) -> Result<Dataset, SetupError> {
    let mut parts = Vec::with_capacity(entries.len());
    for entry in entries {
        let (mut spec, kind) = spec(entry)?;
        fetch_if_hub(&mut spec)?;
        parts.push(Dataset::build(
            &spec,
            kind,
            tokenizer,
            max_seq_len,
            base_dir,
        )?);
    }
    Ok(Dataset::concat(parts)?)
}

pub fn loader(
    dataset: &Dataset,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
) -> Result<DataLoader, SetupError> {
    Ok(DataLoader::new(
        dataset.len(),
        LoaderConfig {
            batch_size,
            shuffle,
            seed,
            drop_last: true,
        },
    )?)
}

/// A `source` naming a Hub dataset repo (`tatsu-lab/alpaca`) is fetched into the HF cache and
/// replaced by its local files, so the rest of the pipeline only sees local data.
fn fetch_if_hub(spec: &mut DatasetSpec) -> Result<(), SetupError> {
    let Some(source) = spec
        .source
        .clone()
        .filter(|s| crate::hub::datasets::is_hub_source(s))
    else {
        return Ok(());
    };
    let patterns = spec
        .data_files
        .as_ref()
        .map(OneOrMany::to_vec)
        .unwrap_or_default();
    let opts = crate::hub::DatasetFetchOptions {
        progress: true,
        ..Default::default()
    };
    let files = crate::hub::fetch_dataset_files(&source, None, &patterns, &opts).map_err(|e| {
        SetupError::Invalid {
            key: "dataset.source".into(),
            message: e.to_string(),
        }
    })?;
    let ext = files
        .first()
        .and_then(|f| f.extension())
        .and_then(|e| e.to_str())
        .unwrap_or("json");
    spec.source = Some(if ext == "jsonl" {
        "json".into()
    } else {
        ext.to_string()
    });
    spec.data_files = Some(OneOrMany::Many(
        files.iter().map(|f| f.display().to_string()).collect(),
    ));
    Ok(())
}

/// The tokenizer, the dataset and this rank's loader, as every training recipe builds them.
pub fn train_data(
    cfg: &crate::config::schema::TrainConfig,
    run: &super::run::RunStart,
    base_dir: &Path,
) -> Result<super::session::TrainData, SetupError> {
    let tokenizer = tokenizer(&cfg.tokenizer)?;
    let args =
        crate::model_io::hf::load_args(&cfg.checkpointer.checkpoint_dir).map_err(|source| {
            SetupError::Model {
                key: "checkpointer.checkpoint_dir",
                source,
            }
        })?;
    super::model::check_architecture("model", &cfg.model.architecture, &args)?;
    let positions = args.max_position_embeddings;
    let max_seq_len = within_positions(cfg.tokenizer.max_seq_len, positions, run.world.is_main());
    let dataset = dataset(&cfg.dataset, &tokenizer, Some(max_seq_len), base_dir)?;
    // torchtune's recipes give their sampler seed 0 whatever the config's `seed` (which seeds
    // initialisation and dropout), so the epochs visit the samples in torchtune's order.
    let loader = loader(
        &dataset,
        cfg.batch_size,
        cfg.shuffle,
        TORCHTUNE_SAMPLER_SEED,
    )?;
    let validation = match &cfg.dataset_val {
        Some(entries) => Some(validation(
            entries,
            cfg,
            &tokenizer,
            max_seq_len,
            run.world.size,
            base_dir,
        )?),
        None => None,
    };
    Ok(super::session::TrainData {
        tokenizer,
        dataset,
        loader,
        validation,
    })
}

/// The seed torchtune's recipes pass their `StatefulDistributedSampler`.
pub const TORCHTUNE_SAMPLER_SEED: u64 = 0;

/// The validation set (`dataset_val`, tokenized as the training set) and its loader:
/// unshuffled batches of `batch_size_val` (default `batch_size`), the partial last one dropped,
/// as torchtune's validation loader.
fn validation(
    entries: &[DatasetConfig],
    cfg: &crate::config::schema::TrainConfig,
    tokenizer: &Tokenizer,
    max_seq_len: usize,
    world_size: usize,
    base_dir: &Path,
) -> Result<Validation, SetupError> {
    let dataset = dataset(entries, tokenizer, Some(max_seq_len), base_dir)?;
    let batch_size = cfg.batch_size_val.unwrap_or(cfg.batch_size);
    let loader = loader(&dataset, batch_size, false, 0)?;
    if loader.num_batches_per_rank(world_size) == 0 {
        return Err(SetupError::Invalid {
            key: "dataset_val".into(),
            message: format!(
                "the validation set has {} samples, too few for one batch of batch_size_val={batch_size} on each of {world_size} worker(s); lower batch_size_val or add data",
                dataset.len()
            ),
        });
    }
    Ok(Validation {
        dataset,
        loader,
        every_n_steps: cfg.run_val_every_n_steps,
    })
}

/// The sample length: `tokenizer.max_seq_len`, at most the model's positions
/// (`max_position_embeddings`; RoPE would run past them, on positions the model never saw). A
/// longer `max_seq_len` is lowered with a warning naming the length used; `null` means the
/// model's positions.
pub fn within_positions(max_seq_len: Option<usize>, positions: usize, announce: bool) -> usize {
    match max_seq_len {
        Some(len) if len > positions => {
            if announce {
                eprintln!(
                    "warning: tokenizer.max_seq_len={len} is more than the model's {positions} positions (max_position_embeddings in its config.json): samples are truncated to {positions} tokens"
                );
            }
            positions
        }
        Some(len) => len,
        None => positions,
    }
}

/// The DPO recipes train (and validate) on chosen / rejected pairs; an SFT dataset has no
/// rejected side.
pub fn require_preference_data(data: &super::session::TrainData) -> Result<(), SetupError> {
    let sets = std::iter::once(("dataset", &data.dataset)).chain(
        data.validation
            .as_ref()
            .map(|v| ("dataset_val", &v.dataset)),
    );
    for (key, dataset) in sets {
        if !matches!(dataset.samples(), data::Samples::Preference(_)) {
            return Err(SetupError::Invalid {
                key: key.into(),
                message: "DPO trains on preference pairs, but this dataset has no chosen/rejected responses; use \
                          torchtune.datasets.preference_dataset, hh_rlhf_helpful_dataset or stack_exchange_paired_dataset"
                    .into(),
            });
        }
    }
    Ok(())
}
