//! `dataset` (and `dataset_val`): one builder, or a list of them to concatenate.

use std::collections::BTreeMap;
use std::ops::Deref;

use serde::Serialize;
use serde_yaml::Value;

use crate::config::components::DatasetBuilder;
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{Checker, ConfigValue, Ty, default, join, keys, off, on, optional};
use crate::config::paths;
use crate::config::values::choices;
use crate::data::{ConversationStyle, DataFiles};

choices!(ConversationStyle {
    "sharegpt" => ConversationStyle::Sharegpt,
    "openai" => ConversationStyle::Openai,
});

impl ConfigValue for DataFiles {
    const TY: &'static Ty = &Ty::Either(&Ty::Str, &Ty::List(&Ty::Str));
    fn read(value: &Value, path: &str, cx: &mut Checker) -> Option<Self> {
        match value {
            Value::String(s) => Some(Self::One(s.clone())),
            other => cx.value(other, path).map(Self::Many),
        }
    }
}

keys! {
    /// One dataset: its builder (torchtune's `*_dataset` function), where its rows are and how
    /// they become samples.
    pub struct DatasetConfig {
        section: "dataset",
        component: DatasetBuilder,
        rule: dataset_rules,
    }
    /// `json`, `csv`, `parquet` or `text` (with `data_files`), a local file, or a Hub dataset
    /// (default: the builder's Hub dataset).
    source: Option<String> = optional(),
    /// The files of a `json`/`csv`/`parquet`/`text` source, or the files of a Hub dataset.
    data_files: Option<DataFiles> = optional(),
    /// `train`, or a slice of it (`train[:100]`, `train[10:20]`, `train[:10%]`).
    split: String = default(|| "train".into()),
    /// A Hub dataset's configuration: not supported (its files are chosen with `data_files`).
    name: Option<String> = optional().refuse(
        "choosing a Hub dataset's configuration by `name` is not supported, and reading every configuration's files instead would change the data; select its files with `data_files` (e.g. `data_files: <name>/*.parquet`) and set `name: null`",
    ),
    /// torchtune's column names -> the file's column names.
    column_map: Option<BTreeMap<String, String>> = optional(),
    /// Train on the prompt's tokens too (default: alpaca true, the others false).
    train_on_input: Option<bool> = optional(),
    /// Pack several samples into rows of `tokenizer.max_seq_len`.
    packed: bool = off(),
    /// Replace (or add) the system message of every sample.
    new_system_prompt: Option<String> = optional(),
    /// Chat datasets: the column with the conversation (default `conversations` for sharegpt,
    /// `messages` for openai).
    conversation_column: Option<String> = optional(),
    /// Chat datasets: how messages are written (default sharegpt).
    conversation_style: Option<ConversationStyle> = optional(),
    /// Text completion: the column with the text (default `text`).
    column: Option<String> = optional(),
    /// Text completion: append the end-of-sequence token.
    add_eos: bool = on(),
    /// Packing: a sample that does not fit continues in the next pack (default: text
    /// completion true, the others false).
    split_across_pack: Option<bool> = optional(),
    /// A Python filter: only null (filter the file beforehand).
    filter_fn: Option<String> = optional().refuse(
        "dataset filter functions are Python callables, which tune cannot run, and training on the unfiltered rows would change the data; filter the data file beforehand and set `filter_fn: null`",
    ),
}

/// DPO recipes read preference pairs and the others never do; a builder without a default
/// source needs one; local files must exist.
fn dataset_rules(d: &DatasetConfig, path: &str, cx: &mut Checker) {
    let builder = &d.component;
    let name = builder.name;
    if let Some(recipe) = cx.recipe.filter(|r| r.is_training()) {
        let wants_pairs = recipe.is_dpo();
        if wants_pairs != builder.kind.is_preference() {
            let (msg, fix) = if wants_pairs {
                (
                    format!(
                        "recipe `{recipe}` needs a preference dataset (chosen/rejected), found `{name}`"
                    ),
                    "e.g. `torchtune.datasets.stack_exchange_paired_dataset` or `preference_dataset`",
                )
            } else {
                (
                    format!("`{name}` is a preference dataset, which only DPO recipes use"),
                    "use an instruct, chat or text dataset such as `torchtune.datasets.alpaca_dataset`",
                )
            };
            cx.problem(
                Problem::new(
                    ProblemKind::WrongComponentKind,
                    join(path, "_component_"),
                    msg,
                )
                .with_fix(fix),
            );
        }
    }
    if builder.default_source.is_none() && d.source.is_none() {
        cx.problem(
            Problem::new(
                ProblemKind::MissingKey,
                join(path, "source"),
                format!("`{name}` has no default source; `source` is required"),
            )
            .with_fix("a Hub dataset id, or `json` with `data_files: path/to/file.json`"),
        );
    }
    if !cx.check_paths {
        return;
    }
    let files: Vec<(String, &str)> = match &d.data_files {
        Some(DataFiles::One(f)) => vec![(join(path, "data_files"), f.as_str())],
        Some(DataFiles::Many(files)) => files
            .iter()
            .enumerate()
            .map(|(i, f)| (format!("{path}.data_files.{i}"), f.as_str()))
            .collect(),
        None => Vec::new(),
    };
    for (key, f) in files.into_iter().filter(|(_, f)| paths::looks_local(f)) {
        paths::require(
            std::path::Path::new(f).exists(),
            cx,
            &key,
            "file",
            f,
            "a local JSON/CSV/Parquet/text file",
        );
    }
}

/// `dataset:` one entry, or a list of them that torchtune concatenates.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(transparent)]
pub struct Datasets(pub Vec<DatasetConfig>);

impl Deref for Datasets {
    type Target = [DatasetConfig];
    fn deref(&self) -> &[DatasetConfig] {
        &self.0
    }
}

impl ConfigValue for Datasets {
    const TY: &'static Ty = &Ty::OneOrMany(&DatasetConfig::SECTION);
    fn read(value: &Value, path: &str, cx: &mut Checker) -> Option<Self> {
        match value {
            Value::Sequence(items) => {
                let read: Vec<Option<DatasetConfig>> = items
                    .iter()
                    .enumerate()
                    .map(|(i, item)| {
                        let at = join(path, &i.to_string());
                        if item.is_mapping() {
                            cx.value(item, &at)
                        } else {
                            cx.wrong_type(item, "a mapping (a `dataset` entry)", &at);
                            None
                        }
                    })
                    .collect();
                read.into_iter().collect::<Option<Vec<_>>>().map(Self)
            }
            one => cx.value(one, path).map(|d| Self(vec![d])),
        }
    }
}
