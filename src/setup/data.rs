//! Tokenizer, datasets and loader from the `tokenizer`, `dataset` and batching keys.

use std::path::Path;

use super::SetupError;
use crate::config::components::TokenizerKind;
use crate::config::paths::resolve_tokenizer_json;
use crate::config::schema::{DatasetConfig, TokenizerConfig, TruncationType};
use crate::data::images::ImagePlan;
use crate::data::{DataLoader, Dataset, DatasetKind, DatasetSpec, LoaderConfig};
use crate::tokenizer::{ConfigFiles, MessageFormat, ModelFormat, Tokenizer, Truncation};
use crate::training::validation::Validation;

/// The model's tokenizer.json with the message format of the component the config names.
pub fn tokenizer(cfg: &TokenizerConfig) -> Result<Tokenizer, SetupError> {
    let (key, location) = cfg.location().ok_or_else(|| SetupError::TokenizerFile {
        key: "tokenizer.path",
        source: crate::config::paths::PathError::TokenizerNotFound {
            path: std::path::PathBuf::new(),
            tried: Vec::new(),
        },
    })?;
    let path = resolve_tokenizer_json(location)
        .map_err(|source| SetupError::TokenizerFile { key, source })?;
    let configs = ConfigFiles {
        tokenizer_config: cfg.tokenizer_config_json_path.clone(),
        generation_config: cfg.generation_config_path.clone(),
    };
    let mut tokenizer = Tokenizer::from_files(&path, &configs)?;
    if let Some(special) = &cfg.special_tokens_path {
        check_special_tokens(&tokenizer, special)?;
    }
    let merges = [
        ("tokenizer.merges_path", &cfg.merges_path),
        ("tokenizer.merges_file", &cfg.merges_file),
    ];
    for (key, merges) in merges
        .iter()
        .filter_map(|(k, m)| m.as_ref().map(|m| (*k, m)))
    {
        check_merges(&path, merges).map_err(|problem| SetupError::Merges {
            key,
            path: merges.clone(),
            problem,
        })?;
    }
    tokenizer.set_format(model_format(cfg))?;
    Ok(tokenizer)
}

/// torchtune's `merges_path` (a merges.txt beside a vocab.json): tune reads the tokenizer.json,
/// which holds the merges too; they must be the file's, or tune would tokenize with other ones.
fn check_merges(tokenizer_json: &Path, merges: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(merges).map_err(|e| format!("cannot read it: {e}"))?;
    let theirs: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with("#version") && !l.trim().is_empty())
        .collect();
    let json = std::fs::read_to_string(tokenizer_json)
        .map_err(|e| format!("cannot read {}: {e}", tokenizer_json.display()))?;
    let json: serde_json::Value = serde_json::from_str(&json)
        .map_err(|e| format!("{} is not JSON: {e}", tokenizer_json.display()))?;
    let ours: Vec<String> = json
        .pointer("/model/merges")
        .and_then(serde_json::Value::as_array)
        .map(|merges| {
            merges
                .iter()
                .map(|m| match m {
                    serde_json::Value::String(s) => s.clone(),
                    pair => pair
                        .as_array()
                        .map(|p| {
                            p.iter()
                                .filter_map(serde_json::Value::as_str)
                                .collect::<Vec<_>>()
                                .join(" ")
                        })
                        .unwrap_or_default(),
                })
                .collect()
        })
        .unwrap_or_default();
    if let Some(i) = (0..theirs.len().max(ours.len()))
        .find(|&i| theirs.get(i).map(|t| t.trim_end()) != ours.get(i).map(String::as_str))
    {
        return Err(format!(
            "merge {} is {:?} there, but {} has {:?} (of {} and {} merges): point it at the merges of the tokenizer.json tune reads, or remove it",
            i + 1,
            theirs.get(i).copied().unwrap_or("nothing"),
            tokenizer_json.display(),
            ours.get(i).map_or("nothing", String::as_str),
            theirs.len(),
            ours.len()
        ));
    }
    Ok(())
}

/// How `tokenizer.special_tokens_path` fails to agree with the model's tokenizer.json.
#[derive(Debug, thiserror::Error)]
pub enum SpecialTokensError {
    #[error("cannot read it: {0}")]
    Read(std::io::Error),
    #[error("it is not JSON: {0}")]
    NotJson(serde_json::Error),
    #[error("it has no `added_tokens` list (torchtune reads the special tokens from it)")]
    NoAddedTokens,
    #[error(
        "it gives {token:?} id {id}, but {vocabulary} has {ours}: point both at the same model's tokenizer.json, or drop special_tokens_path"
    )]
    Disagrees {
        token: String,
        id: u64,
        vocabulary: String,
        ours: String,
    },
}

/// torchtune's `special_tokens_path` (a tokenizer.json whose `added_tokens` give the special
/// tokens' ids): tune takes them from the model's tokenizer.json, so the file must agree with
/// it, or the ids torchtune would use are not the ones tune trains on.
fn check_special_tokens(tokenizer: &Tokenizer, path: &Path) -> Result<(), SetupError> {
    let fail = |problem| SetupError::SpecialTokens {
        path: path.to_path_buf(),
        problem,
    };
    let text = std::fs::read_to_string(path).map_err(|e| fail(SpecialTokensError::Read(e)))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| fail(SpecialTokensError::NotJson(e)))?;
    let tokens = json
        .get("added_tokens")
        .and_then(serde_json::Value::as_array)
        .ok_or_else(|| fail(SpecialTokensError::NoAddedTokens))?;
    for t in tokens {
        let (Some(content), Some(id)) = (
            t.get("content").and_then(serde_json::Value::as_str),
            t.get("id").and_then(serde_json::Value::as_u64),
        ) else {
            continue;
        };
        let ours = tokenizer.token_to_id(content);
        if ours != Some(id as u32) {
            return Err(fail(SpecialTokensError::Disagrees {
                token: content.to_string(),
                id,
                vocabulary: tokenizer.path().display().to_string(),
                ours: ours.map_or("no such token".to_string(), |i| format!("id {i}")),
            }));
        }
    }
    Ok(())
}

/// The format torchtune's tokenizer component writes, and its prompt template.
pub fn model_format(cfg: &TokenizerConfig) -> ModelFormat {
    let format = match cfg.component {
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
    ModelFormat {
        format,
        prompt_template: cfg.prompt_template(),
        truncation: match cfg.truncation_type {
            Some(TruncationType::Left) => Truncation::Left,
            Some(TruncationType::Right) | None => Truncation::Right,
        },
    }
}

/// The data layer's spec of one `dataset` entry: the builder's kind and default source, and
/// torchtune's defaults for what the entry leaves out.
pub fn spec(cfg: &DatasetConfig) -> DatasetSpec {
    let builder = &cfg.component;
    let defaults = DatasetSpec::new(builder.kind);
    let mut spec = DatasetSpec {
        source: cfg
            .source
            .clone()
            .or_else(|| builder.default_source.map(String::from)),
        data_files: cfg
            .data_files
            .as_ref()
            .map(|f| f.to_vec())
            .unwrap_or_default(),
        split: cfg.split.clone(),
        column_map: cfg.column_map.clone().unwrap_or_default(),
        train_on_input: cfg.train_on_input.unwrap_or(defaults.train_on_input),
        packed: cfg.packed,
        split_across_pack: cfg.split_across_pack.unwrap_or(defaults.split_across_pack),
        new_system_prompt: cfg.new_system_prompt.clone(),
        conversation_column: cfg.conversation_column.clone(),
        conversation_style: cfg.conversation_style.unwrap_or_default(),
        column: cfg.column.clone(),
        add_eos: cfg.add_eos,
        partition: cfg.partition.clone(),
        apply_chat_template: cfg.apply_chat_template,
        image_tag: match builder.kind {
            DatasetKind::MultimodalChat => cfg.image_tag.clone(),
            _ => defaults.image_tag.clone(),
        },
        ..defaults
    };
    if let (None, None, Some(files)) = (&cfg.source, &cfg.data_files, builder.default_data_files) {
        (spec.data_files, spec.split) = split_files(files, &cfg.split);
    }
    spec
}

/// The default Hub source's files of a split (`test[:100]` -> `main/test-*.parquet`), and the
/// slice of them to keep, written on `train` as local files' splits are (`train[:100]`).
fn split_files(pattern: &str, split: &str) -> (Vec<String>, String) {
    let split = split.trim();
    let (name, slice) = match split.find('[') {
        Some(i) => split.split_at(i),
        None => (split, ""),
    };
    (
        vec![pattern.replace("{split}", name.trim())],
        format!("train{slice}"),
    )
}

/// Builds every dataset entry (torchtune concatenates a list of them) and joins them; rows
/// with images become `images`' tokens and pixels (a vision-language model's plan).
pub fn dataset(
    entries: &[DatasetConfig],
    tokenizer: &Tokenizer,
    max_seq_len: Option<usize>,
    base_dir: &Path,
    images: Option<&ImagePlan>,
) -> Result<Dataset, SetupError> {
    let mut parts = Vec::with_capacity(entries.len());
    for entry in entries {
        let mut spec = spec(entry);
        // torchtune prepends `image_dir` to relative paths, which are the working directory's.
        spec.image_dir = Some(base_dir.join(entry.image_dir.as_deref().unwrap_or("")));
        spec.images = images.cloned();
        fetch_if_hub(&mut spec)?;
        parts.push(Dataset::build(&spec, tokenizer, max_seq_len, base_dir)?);
    }
    Ok(Dataset::concat(parts)?)
}

pub fn loader(
    dataset: &Dataset,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
) -> Result<DataLoader, SetupError> {
    sample_loader(dataset.len(), batch_size, shuffle, seed)
}

/// Batches of `num_samples` samples' indices, the partial last one dropped.
pub fn sample_loader(
    num_samples: usize,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
) -> Result<DataLoader, SetupError> {
    Ok(DataLoader::new(
        num_samples,
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
pub(super) fn fetch_if_hub(spec: &mut DatasetSpec) -> Result<(), SetupError> {
    let Some(source) = spec
        .source
        .clone()
        .filter(|s| crate::hub::datasets::is_hub_source(s))
    else {
        return Ok(());
    };
    let patterns = spec.data_files.clone();
    let opts = crate::hub::DatasetFetchOptions {
        progress: true,
        ..Default::default()
    };
    let files = crate::hub::fetch_dataset_files(&source, None, &patterns, &opts)
        .map_err(SetupError::DatasetFetch)?;
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
    spec.data_files = files.iter().map(|f| f.display().to_string()).collect();
    Ok(())
}

/// The tokenizer, the dataset and this rank's loader, as every training recipe builds them
/// for the model `args` describe (the `model` section held against them, the samples cut to
/// its positions).
pub fn train_data(
    cfg: &crate::config::schema::TrainConfig,
    args: &crate::models::ModelArgs,
    run: &super::run::RunStart,
    base_dir: &Path,
) -> Result<super::session::TrainData, SetupError> {
    let tokenizer = tokenizer(&cfg.tokenizer)?;
    super::model::check_architecture("model", &cfg.model, args)?;
    let positions = args.max_position_embeddings;
    let max_seq_len = within_positions(cfg.tokenizer.max_seq_len, positions, run.world.is_main());
    let images = image_plan(&cfg.checkpointer.checkpoint_dir, args)?;
    let images = images.as_ref();
    let dataset = dataset(
        &cfg.dataset,
        &tokenizer,
        Some(max_seq_len),
        base_dir,
        images,
    )?;
    // torchtune's recipes give their sampler seed 0 whatever the config's `seed` (which seeds
    // initialisation and dropout), so the epochs visit the samples in torchtune's order.
    let loader = loader(
        &dataset,
        cfg.batch_size,
        cfg.shuffle,
        TORCHTUNE_SAMPLER_SEED,
    )?;
    crate::say_debug!(
        "dataset: {} samples of at most {max_seq_len} tokens, {} batches of {} per rank",
        dataset.len(),
        loader.num_batches_per_rank(run.world.size),
        cfg.batch_size
    );
    let validation = match &cfg.dataset_val {
        Some(entries) => Some(validation(
            entries,
            cfg,
            (&tokenizer, images),
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

/// How a vision-language checkpoint's rows with images become tokens and pixels: its processor
/// (`preprocessor_config.json` in `checkpoint_dir`) and vision config; `None` for a model that
/// reads no images.
pub fn image_plan(
    checkpoint_dir: &Path,
    args: &crate::models::ModelArgs,
) -> Result<Option<ImagePlan>, SetupError> {
    let Some(vision) = &args.vision else {
        return Ok(None);
    };
    match crate::vision::preprocessor::ImageProcessor::read(checkpoint_dir)? {
        crate::vision::preprocessor::ImageProcessor::Qwen2Vl(processor) => {
            if processor.merge_size != vision.encoder.spatial_merge_size
                || processor.patch_size != vision.encoder.patch_size
                || processor.temporal_patch_size != vision.encoder.temporal_patch_size
            {
                return Err(SetupError::Processor {
                    dir: checkpoint_dir.to_path_buf(),
                    message: format!(
                        "preprocessor_config.json's patch_size {}, temporal_patch_size {} and merge_size {} must be config.json's vision_config patch_size {}, temporal_patch_size {} and spatial_merge_size {}",
                        processor.patch_size,
                        processor.temporal_patch_size,
                        processor.merge_size,
                        vision.encoder.patch_size,
                        vision.encoder.temporal_patch_size,
                        vision.encoder.spatial_merge_size
                    ),
                });
            }
            Ok(Some(ImagePlan {
                processor,
                vision: vision.clone(),
            }))
        }
        other => Err(SetupError::Processor {
            dir: checkpoint_dir.to_path_buf(),
            message: format!(
                "preprocessor_config.json is {}'s processor, but config.json is a Qwen2-VL model",
                other.name()
            ),
        }),
    }
}

/// The seed torchtune's recipes pass their `StatefulDistributedSampler`.
pub const TORCHTUNE_SAMPLER_SEED: u64 = 0;

/// The validation set (`dataset_val`, tokenized as the training set) and its loader:
/// unshuffled batches of `batch_size_val` (default `batch_size`), the partial last one dropped,
/// as torchtune's validation loader.
fn validation(
    entries: &[DatasetConfig],
    cfg: &crate::config::schema::TrainConfig,
    (tokenizer, images): (&Tokenizer, Option<&ImagePlan>),
    max_seq_len: usize,
    world_size: usize,
    base_dir: &Path,
) -> Result<Validation, SetupError> {
    let dataset = dataset(entries, tokenizer, Some(max_seq_len), base_dir, images)?;
    let batch_size = cfg.batch_size_val.unwrap_or(cfg.batch_size);
    let loader = loader(&dataset, batch_size, false, 0)?;
    if loader.num_batches_per_rank(world_size) == 0 {
        return Err(SetupError::TooLittleValidationData {
            samples: dataset.len(),
            batch_size,
            world_size,
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
                crate::say_warn!(
                    "tokenizer.max_seq_len={len} is more than the model's {positions} positions (max_position_embeddings in its config.json): samples are truncated to {positions} tokens"
                );
            }
            positions
        }
        Some(len) => len,
        None => positions,
    }
}

#[cfg(test)]
mod tests {
    use super::{check_merges, split_files};

    /// torchtune's `merges_path` is checked against the tokenizer.json's merges, line by line.
    #[test]
    fn a_merges_file_must_be_the_tokenizer_jsons_merges() {
        let json = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("assets/tiny-llama/tokenizer.json");
        let parsed: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let mut lines: Vec<String> = parsed["model"]["merges"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| format!("{} {}", p[0].as_str().unwrap(), p[1].as_str().unwrap()))
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let merges = dir.path().join("merges.txt");
        std::fs::write(&merges, format!("#version: 0.2\n{}\n", lines.join("\n"))).unwrap();
        check_merges(&json, &merges).expect("the same merges");
        lines[2] = "x y".into();
        std::fs::write(&merges, lines.join("\n")).unwrap();
        let e = check_merges(&json, &merges).unwrap_err();
        assert!(e.starts_with("merge 3 is \"x y\" there"), "{e}");
    }

    #[test]
    fn a_default_hub_sources_split_picks_its_files_and_keeps_its_slice() {
        let pattern = "main/{split}-*.parquet";
        assert_eq!(
            split_files(pattern, "train"),
            (
                vec!["main/train-*.parquet".to_string()],
                "train".to_string()
            )
        );
        assert_eq!(
            split_files(pattern, "test[:100]"),
            (
                vec!["main/test-*.parquet".to_string()],
                "train[:100]".to_string()
            )
        );
    }
}
