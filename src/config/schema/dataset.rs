//! `dataset` (and `dataset_val`): one builder, or a list of them to concatenate.

use std::collections::BTreeMap;
use std::ops::Deref;

use serde::Serialize;
use serde_yaml::Value;

use crate::config::components::{DatasetBuilder, DatasetKind};
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{
    Checker, ConfigValue, Fingerprint, FingerprintEntries, Ty, default, join, keys, off, on,
    optional,
};
use crate::config::paths;
use crate::config::recipes::DataKind;
use crate::config::values::choices;
use crate::data::{ConversationStyle, DataFiles, Partition};

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
    /// gsm8k_dataset, gsm8k_sft: keep row `i` of the split when `start <= i % total <= end`
    /// (`start-end/total`; torchtune's GRPO configs train on `1-9/10`).
    partition: Option<String> = optional().rule(partition_format),
    /// prompt_dataset: format the prompt as a user turn in the tokenizer's chat format, ending
    /// at the assistant's header (false: the text as it is, after BOS).
    apply_chat_template: bool = on(),
    /// Chat datasets with images: the directory relative image paths start at (torchtune's
    /// `image_dir`, prepended to them; default: the working directory).
    image_dir: Option<String> = optional(),
    /// multimodal_chat_dataset: the tag in the first user message's text each of a row's
    /// `image` column images replaces (default none: the images go before its text;
    /// chat_dataset's ShareGPT rows use `<image>`, as torchtune's).
    image_tag: Option<String> = optional(),
    /// A Python filter: only null (filter the file beforehand).
    filter_fn: Option<String> = optional().refuse(
        "dataset filter functions are Python callables, which tune cannot run, and training on the unfiltered rows would change the data; filter the data file beforehand and set `filter_fn: null`",
    ),
}

/// `partition` must parse as torchtune's `start-end/total`.
fn partition_format(partition: &Option<String>, path: &str, cx: &mut Checker) {
    if let Some(Err(message)) = partition.as_deref().map(Partition::parse) {
        cx.problem(
            Problem::new(ProblemKind::InvalidValue, path, message)
                .with_fix("e.g. `1-9/10` (9 rows in 10) or `0-0/10` (the other one)"),
        );
    }
}

/// Prompt datasets (gsm8k, prompt_dataset) hold prompts to generate from, which only the GRPO
/// and PPO recipes read, and the GRPO recipes read nothing else; PPO also reads
/// `text_completion_dataset`'s text as prompts (torchtune's PPO configs); `partition` is
/// gsm8k's.
fn prompt_rules(d: &DatasetConfig, path: &str, cx: &mut Checker) {
    let builder = &d.component;
    let data = cx.recipe.map(|r| r.data);
    let reads = |data: DataKind| {
        builder.kind.is_prompt()
            || (data == DataKind::PromptsOrText && builder.kind == DatasetKind::TextCompletion)
    };
    let generates = |d: &DataKind| matches!(d, DataKind::Prompts | DataKind::PromptsOrText);
    if let (Some(recipe), Some(data)) = (cx.recipe, data.filter(|d| generates(d) && !reads(*d))) {
        let fix = if data == DataKind::PromptsOrText {
            "use `torchtune.datasets.text_completion_dataset` (with `column: <prompt column>`, `add_eos: False`) or `tune.datasets.prompt_dataset`"
        } else {
            "use `tune.datasets.prompt_dataset` (with `column_map: {prompt: <column>}`) or `torchtune.dev.grpo.gsm8k.gsm8k_dataset`"
        };
        cx.problem(
            Problem::new(
                ProblemKind::WrongComponentKind,
                join(path, "_component_"),
                format!(
                    "recipe `{recipe}` generates completions from prompts, but `{}` holds responses to train on",
                    builder.name
                ),
            )
            .with_fix(fix),
        );
    }
    if builder.kind.is_prompt()
        && let Some(recipe) = cx
            .recipe
            .filter(|r| matches!(r.data, DataKind::Responses | DataKind::Pairs))
    {
        cx.problem(
            Problem::new(
                ProblemKind::WrongComponentKind,
                join(path, "_component_"),
                format!(
                    "`{}` holds prompts without responses, for reinforcement learning; recipe `{recipe}` trains on responses",
                    builder.name
                ),
            )
            .with_fix("use an instruct, chat or text dataset such as `torchtune.datasets.alpaca_dataset`"),
        );
    }
    if d.partition.is_some() && !matches!(builder.kind, DatasetKind::Gsm8k | DatasetKind::Gsm8kSft)
    {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                join(path, "partition"),
                format!(
                    "`partition` is a gsm8k_dataset and gsm8k_sft setting, not `{}`'s",
                    builder.name
                ),
            )
            .with_fix("select rows with `split: train[a:b]`, and set `partition: null`"),
        );
    }
}

/// DPO recipes read preference pairs and the others never do; a builder without a default
/// source needs one; local files must exist.
fn dataset_rules(d: &DatasetConfig, path: &str, cx: &mut Checker) {
    let builder = &d.component;
    let name = builder.name;
    prompt_rules(d, path, cx);
    if let Some(recipe) = cx
        .recipe
        .filter(|r| r.is_training() && !builder.kind.is_prompt())
    {
        let wants_pairs = recipe.data == DataKind::Pairs;
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
    multimodal_chat_rules(d, path, cx);
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

/// torchtune's `multimodal_chat_dataset` reads ShareGPT rows and never trains their prompts
/// (it takes no `train_on_input`), nor packs; `image_tag` is its key alone (`chat_dataset`
/// places ShareGPT images at `<image>`, as torchtune's).
fn multimodal_chat_rules(d: &DatasetConfig, path: &str, cx: &mut Checker) {
    let name = d.component.name;
    let refuse = |cx: &mut Checker, key: &str, message: String, fix: &str| {
        cx.problem(Problem::new(ProblemKind::InvalidValue, join(path, key), message).with_fix(fix));
    };
    if d.component.kind != DatasetKind::MultimodalChat {
        if d.image_tag.is_some() {
            refuse(
                cx,
                "image_tag",
                format!("`image_tag` is multimodal_chat_dataset's key; `{name}` does not read it"),
                "use `torchtune.datasets.multimodal.multimodal_chat_dataset`, or drop `image_tag` (chat_dataset's ShareGPT rows place their image at `<image>`)",
            );
        }
        return;
    }
    if d.train_on_input == Some(true) {
        refuse(
            cx,
            "train_on_input",
            format!("`{name}` never trains the prompts of rows with images (torchtune masks them)"),
            "set `train_on_input: false`, or drop it",
        );
    }
    if d.packed {
        refuse(
            cx,
            "packed",
            format!("`{name}` is not packed (torchtune refuses packing multimodal datasets)"),
            "set `packed: false`",
        );
    }
    if d.conversation_style == Some(ConversationStyle::Openai) {
        refuse(
            cx,
            "conversation_style",
            format!("`{name}` reads ShareGPT rows"),
            "for OpenAI-style messages with image parts use `torchtune.datasets.chat_dataset` with `conversation_style: openai`",
        );
    }
    if d.image_tag.as_deref() == Some("") {
        refuse(
            cx,
            "image_tag",
            "an empty `image_tag` marks no place".into(),
            "e.g. `image_tag: \"<image>\"`, or `image_tag: null` to put the image before the text",
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

    /// The whole list, with its entries' declared defaults: a checkpoint written before a key
    /// was added to `dataset` holds none for it, which is its default.
    fn fingerprint(&self, path: &str, mode: Fingerprint, out: &mut FingerprintEntries) {
        self.0.fingerprint(path, mode, out);
    }

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

#[cfg(test)]
mod tests {
    use crate::config::keys::{Fingerprint, FingerprintEntries};
    use crate::config::{ValidateOptions, ValidationErrors, load_config};

    use crate::recipes::validate_with;

    use super::{ConfigValue, Datasets};

    const NO_PATHS: ValidateOptions = ValidateOptions { check_paths: false };

    fn validated(overrides: &[&str]) -> Result<Datasets, ValidationErrors> {
        let overrides: Vec<String> = overrides.iter().map(|o| o.to_string()).collect();
        let cfg = load_config("tiny/full", &overrides).expect("loads");
        validate_with("full_finetune_distributed", &cfg, &NO_PATHS)
            .map(|(typed, _)| typed.as_train().expect("train").dataset.clone())
    }

    #[test]
    fn a_prompt_dataset_in_a_training_recipe_is_refused_by_its_torchtune_name() {
        for name in [
            "torchtune.dev.grpo.gsm8k.gsm8k_dataset",
            "tune.datasets.prompt_dataset",
        ] {
            let e = validated(&[&format!("dataset._component_={name}")]).unwrap_err();
            assert!(
                e.has("dataset._component_", "holds prompts without responses"),
                "{e}"
            );
        }
    }

    #[test]
    fn multimodal_chat_dataset_takes_its_torchtune_keys_and_refuses_the_others() {
        let mm = "dataset._component_=torchtune.datasets.multimodal.multimodal_chat_dataset";
        let ok = validated(&[mm, "dataset.source=json", "dataset.image_tag=<image>"]).unwrap();
        assert_eq!(ok[0].image_tag.as_deref(), Some("<image>"));
        let e = validated(&[mm, "dataset.train_on_input=true", "dataset.packed=true"]).unwrap_err();
        assert!(
            e.has("dataset.train_on_input", "never trains the prompts"),
            "{e}"
        );
        assert!(e.has("dataset.packed", "is not packed"), "{e}");
        let e = validated(&[mm, "dataset.conversation_style=openai"]).unwrap_err();
        assert!(
            e.has("dataset.conversation_style", "reads ShareGPT rows"),
            "{e}"
        );
        let e = validated(&["dataset.image_tag=<image>"]).unwrap_err();
        assert!(
            e.has("dataset.image_tag", "multimodal_chat_dataset's key"),
            "{e}"
        );
    }

    #[test]
    fn partition_must_be_start_end_total_and_only_for_gsm8k() {
        let e = validated(&["dataset.partition=1-9"]).unwrap_err();
        assert!(
            e.has("dataset.partition", "is not `start-end/total`"),
            "{e}"
        );
        let e = validated(&["dataset.partition=1-9/10"]).unwrap_err();
        assert!(
            e.has("dataset.partition", "a gsm8k_dataset and gsm8k_sft setting"),
            "{e}"
        );
    }

    #[test]
    fn the_new_keys_at_their_defaults_leave_the_fingerprint_as_it_was() {
        use crate::training::checkpointing::RunFingerprint;
        let fingerprint = |overrides: &[&str]| {
            let d = validated(overrides).expect("valid");
            let mut out = FingerprintEntries::default();
            d.fingerprint("dataset", Fingerprint::Yes, &mut out);
            RunFingerprint {
                entries: out.entries,
                resume_may_change: out.resume_may_change,
                defaults: out.defaults,
            }
        };
        // A checkpoint written before `partition` and `apply_chat_template` existed holds
        // neither: they had their defaults.
        let current = fingerprint(&[]);
        let mut saved = current.clone();
        for entry in saved.entries["dataset"]
            .as_array_mut()
            .expect("a list")
            .iter_mut()
        {
            let entry = entry.as_object_mut().expect("an entry");
            entry.remove("partition");
            entry.remove("apply_chat_template");
        }
        assert!(saved.differences(&current).is_empty());
        let off = fingerprint(&["dataset.apply_chat_template=False"]);
        assert_eq!(saved.differences(&off), ["dataset"]);
    }
}
