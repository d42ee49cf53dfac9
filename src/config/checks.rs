//! Checks that span keys: recipe-specific rules (LoRA vs full builder, dataset and
//! loss kinds) and filesystem checks. They read the raw tree and skip anything
//! the type walk already reports, so each mistake is reported once.

use std::path::Path;

use serde_yaml::Value;

use crate::config::components::{
    self, Component, DatasetKind, LossKind, ModelVariant, TokenizerKind,
};
use crate::config::error::{Problem, ProblemKind};
use crate::config::paths;
use crate::config::recipes::Recipe;
use crate::config::validate::{Checker, join};
use crate::config::yaml;
use crate::tokenizer::PromptTemplate;

fn component_at(root: &Value, path: &str) -> Option<(String, Component)> {
    let name = yaml::get(root, &join(path, "_component_"))?.as_str()?;
    let found = components::lookup(name, None).ok()?;
    Some((name.to_string(), found.component))
}

/// Every dataset entry: (`dataset` or `dataset.<i>`, its mapping).
fn dataset_entries<'a>(root: &'a Value, key: &str) -> Vec<(String, &'a Value)> {
    match yaml::get(root, key) {
        Some(Value::Sequence(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| (format!("{key}.{i}"), v))
            .collect(),
        Some(v @ Value::Mapping(_)) => vec![(key.to_string(), v)],
        _ => Vec::new(),
    }
}

pub fn recipe_rules(recipe: Recipe, root: &Value, cx: &mut Checker) {
    model_rules(recipe, root, cx);
    prompt_template_rule(root, cx);
    let set = |key: &str| yaml::get(root, key).is_some_and(|v| !v.is_null());
    if yaml::get(root, "tokenizer").is_some_and(Value::is_mapping)
        && !set("tokenizer.path")
        && !set("tokenizer.vocab_path")
        && !set("tokenizer.tokenizer_json_path")
    {
        cx.problem(
            Problem::new(
                ProblemKind::MissingKey,
                "tokenizer.path",
                "missing: the tokenizer needs `path` (or Phi-4's `vocab_path`)",
            )
            .with_fix("point `tokenizer.path` at the model's tokenizer.json"),
        );
    }
    // Generation has ranges too (max_new_tokens, temperature, top_k, top_p).
    range_rules(root, cx);
    if !recipe.is_training() {
        return;
    }
    for key in ["dataset", "dataset_val"] {
        for (path, entry) in dataset_entries(root, key) {
            dataset_rules(recipe, entry, &path, cx);
        }
    }
    let has = |key: &str| yaml::get(root, key).is_some_and(|v| !v.is_null());
    let top = yaml::get(root, "keep_last_n_checkpoints").filter(|v| !v.is_null());
    let nested = yaml::get(root, "checkpointer.keep_last_n_checkpoints").filter(|v| !v.is_null());
    if let (Some(a), Some(b)) = (top, nested)
        && a != b
    {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "checkpointer.keep_last_n_checkpoints",
                format!(
                    "is {}, but the top-level keep_last_n_checkpoints is {}",
                    yaml::short(b),
                    yaml::short(a)
                ),
            )
            .with_fix("keep one of the two"),
        );
    }
    if has("run_val_every_n_steps") && !has("dataset_val") {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "run_val_every_n_steps",
                "is set, but there is no `dataset_val` to validate on (torchtune refuses this too)",
            )
            .with_fix("add a `dataset_val` section, or set `run_val_every_n_steps: null`"),
        );
    }
    let expect_loss = if recipe.is_dpo() {
        LossKind::Dpo
    } else {
        LossKind::CrossEntropy
    };
    loss_rule(root, "loss", &[expect_loss], cx);
    if recipe == Recipe::KnowledgeDistillation {
        loss_rule(
            root,
            "kd_loss",
            &[
                LossKind::ForwardKl,
                LossKind::ReverseKl,
                LossKind::SymmetricKl,
            ],
            cx,
        );
    }
    if let Some(Value::Sequence(b)) = yaml::get(root, "optimizer.betas")
        && b.len() != 2
    {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "optimizer.betas",
                format!("expected 2 numbers, found {}", b.len()),
            )
            .with_fix("e.g. `betas: [0.9, 0.999]`"),
        );
    }
}

/// `tokenizer.prompt_template` must name a template tune knows (or be a `{role: [prefix,
/// suffix]}` mapping), and only a torchtune tokenizer component formats with one.
fn prompt_template_rule(root: &Value, cx: &mut Checker) {
    let key = "tokenizer.prompt_template";
    let Some(value) = yaml::get(root, key).filter(|v| !v.is_null()) else {
        return;
    };
    let chat_template = matches!(
        component_at(root, "tokenizer"),
        Some((
            _,
            Component::Tokenizer(TokenizerKind::HuggingFace | TokenizerKind::SmolLM2)
        ))
    );
    let problem = if chat_template {
        Some((
            "this tokenizer component formats with the checkpoint's chat template, which a prompt template cannot wrap".to_string(),
            "remove `prompt_template`, or name a torchtune tokenizer component (e.g. torchtune.models.llama3.llama3_tokenizer)",
        ))
    } else {
        serde_json::to_value(value)
            .map_err(|e| e.to_string())
            .and_then(|json| PromptTemplate::from_value(&json).map_err(|e| e.to_string()))
            .err()
            .map(|e| {
                (
                    e,
                    "name a built-in template or give a mapping {role: [prefix, suffix]}",
                )
            })
    };
    if let Some((message, fix)) = problem {
        cx.problem(Problem::new(ProblemKind::InvalidValue, key, message).with_fix(fix));
    }
}

/// A key, the test its value must pass, and the allowed range in words.
type RangeRule = (&'static str, fn(f64) -> bool, &'static str);

/// Training values whose type is right but whose value would train nonsense or fail later.
fn range_rules(root: &Value, cx: &mut Checker) {
    let rules: [RangeRule; 22] = [
        ("optimizer.lr", |v| v > 0.0, "greater than 0 (e.g. 2e-5)"),
        ("batch_size", |v| v >= 1.0, "at least 1"),
        ("epochs", |v| v >= 1.0, "at least 1"),
        ("gradient_accumulation_steps", |v| v >= 1.0, "at least 1"),
        (
            "max_steps_per_epoch",
            |v| v >= 1.0,
            "at least 1, or null for no limit",
        ),
        (
            "clip_grad_norm",
            |v| v > 0.0,
            "greater than 0, or null for no clipping",
        ),
        ("model.lora_rank", |v| v >= 1.0, "at least 1 (e.g. 8)"),
        (
            "model.lora_alpha",
            |v| v > 0.0,
            "greater than 0 (usually 2 x lora_rank)",
        ),
        (
            "model.lora_dropout",
            |v| (0.0..1.0).contains(&v),
            "from 0 up to, not including, 1",
        ),
        (
            "tokenizer.max_seq_len",
            |v| v >= 2.0,
            "at least 2, or null for no limit",
        ),
        ("log_every_n_steps", |v| v >= 1.0, "at least 1"),
        ("save_every_n_steps", |v| v >= 1.0, "at least 1, or null"),
        (
            "keep_last_n_checkpoints",
            |v| v >= 1.0,
            "at least 1, or null to keep all",
        ),
        (
            "checkpointer.keep_last_n_checkpoints",
            |v| v >= 1.0,
            "at least 1, or null to keep all",
        ),
        ("kd_ratio", |v| (0.0..=1.0).contains(&v), "from 0 to 1"),
        // Generation.
        ("max_new_tokens", |v| v >= 1.0, "at least 1"),
        (
            "temperature",
            |v| v >= 0.0 && v.is_finite(),
            "0 (greedy) or greater",
        ),
        ("top_k", |v| v >= 1.0, "at least 1, or null for no top-k"),
        (
            "top_p",
            |v| v > 0.0 && v <= 1.0,
            "greater than 0 and at most 1, or null",
        ),
        // Parallelism: data parallelism over every rank is all tune does.
        (
            "tensor_parallel_dim",
            |v| v == 1.0,
            "1: tune has no tensor parallelism, every rank holds the whole model",
        ),
        (
            "data_parallel_replicate_dim",
            |v| v == 1.0,
            "1: tune has no replication groups (HSDP), all ranks form one data-parallel group",
        ),
        (
            "data_parallel_shard_dim",
            |v| v == -1.0 || (v >= 1.0 && v.fract() == 0.0),
            "-1 (all ranks) or the number of ranks",
        ),
    ];
    for (key, ok, allowed) in rules {
        let Some(value) = yaml::get(root, key).and_then(Value::as_f64) else {
            continue;
        };
        // A value the type check already refused (a negative count) is reported once.
        if cx.problems.iter().any(|p| p.key == key) {
            continue;
        }
        if !ok(value) {
            cx.problem(Problem::new(
                ProblemKind::InvalidValue,
                key,
                format!("{value} is out of range: it must be {allowed}"),
            ));
        }
    }
}

fn model_rules(recipe: Recipe, root: &Value, cx: &mut Checker) {
    let Some((name, Component::Model(builder))) = component_at(root, "model") else {
        return;
    };
    let key = "model._component_";
    match recipe.needs_lora() {
        Some(true) if !builder.is_lora() => cx.problem(
            Problem::new(
                ProblemKind::WrongComponentKind,
                key,
                format!(
                    "recipe `{recipe}` trains LoRA adapters, but `{name}` is a full model builder"
                ),
            )
            .with_fix(format!(
                "use the LoRA builder `tune.models.{0}.lora_{0}_{1}`",
                builder.family.module(),
                builder.size
            )),
        ),
        Some(false) if builder.is_lora() => cx.problem(
            Problem::new(
                ProblemKind::WrongComponentKind,
                key,
                format!("recipe `{recipe}` trains every weight, but `{name}` is a LoRA builder"),
            )
            .with_fix(format!(
                "use the full builder `tune.models.{0}.{0}_{1}`, or a LoRA recipe",
                builder.family.module(),
                builder.size
            )),
        ),
        _ => {}
    }
    let quantize_base =
        yaml::get(root, "model.quantize_base").and_then(Value::as_bool) == Some(true);
    if quantize_base && !builder.is_lora() {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "model.quantize_base",
                format!("`{name}` is a full model builder; NF4 base weights (QLoRA) are for LoRA builders, as in torchtune"),
            )
            .with_fix(format!(
                "remove `quantize_base`, or use `tune.models.{0}.qlora_{0}_{1}` with a LoRA recipe",
                builder.family.module(),
                builder.size
            )),
        );
    }
    let qlora = quantize_base || builder.variant == ModelVariant::QLora;
    if qlora && recipe == Recipe::QatLora {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                key,
                format!("`{name}` stores the base in NF4 (QLoRA), but QAT fake-quantizes a float base to int4: torchtune and torchao do not combine the two"),
            )
            .with_fix(format!(
                "use `tune.models.{0}.lora_{0}_{1}` without `quantize_base` for QAT + LoRA, or lora_finetune_single_device for QLoRA",
                builder.family.module(),
                builder.size
            )),
        );
    }
    let dora = yaml::get(root, "model.use_dora").and_then(Value::as_bool) == Some(true);
    if dora && recipe == Recipe::QatLora {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "model.use_dora",
                "DoRA under QAT's fake quantization has no reference implementation to match (torchao and torchtune combine QAT with plain LoRA)",
            )
            .with_fix("set `use_dora: False`, or train DoRA with lora_finetune_single_device"),
        );
    }
    let lora_keys = ["lora_attn_modules", "lora_rank", "lora_alpha"];
    if builder.is_lora() && recipe.is_training() {
        for k in lora_keys {
            if yaml::get(root, &join("model", k)).is_none() {
                cx.problem(
                    Problem::new(
                        ProblemKind::MissingKey,
                        join("model", k),
                        format!("missing required key `{k}` for LoRA builder `{name}`"),
                    )
                    .with_fix(match k {
                        "lora_attn_modules" => "e.g. `lora_attn_modules: [q_proj, v_proj]`",
                        "lora_rank" => "e.g. `lora_rank: 8`",
                        _ => "e.g. `lora_alpha: 16` (usually 2 x rank)",
                    }),
                );
            }
        }
    } else if !builder.is_lora() {
        for k in
            lora_keys
                .iter()
                .chain(&["apply_lora_to_mlp", "apply_lora_to_output", "lora_dropout"])
        {
            if yaml::get(root, &join("model", k)).is_some() {
                cx.warn(
                    join("model", k),
                    format!("ignored: `{name}` is not a LoRA builder"),
                );
            }
        }
    }
}

fn dataset_rules(recipe: Recipe, entry: &Value, path: &str, cx: &mut Checker) {
    let Some((name, Component::Dataset(builder))) = component_at(entry, "") else {
        return;
    };
    let key = join(path, "_component_");
    let wants_pref = recipe.is_dpo();
    let is_pref = builder.kind == DatasetKind::Preference;
    if wants_pref != is_pref {
        let (msg, fix) = if wants_pref {
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
        cx.problem(Problem::new(ProblemKind::WrongComponentKind, key, msg).with_fix(fix));
    }
    if builder.default_source.is_none() && yaml::get(entry, "source").is_none() {
        cx.problem(
            Problem::new(
                ProblemKind::MissingKey,
                join(path, "source"),
                format!("`{name}` has no default source; `source` is required"),
            )
            .with_fix("a Hub dataset id, or `json` with `data_files: path/to/file.json`"),
        );
    }
}

fn loss_rule(root: &Value, key: &str, allowed: &[LossKind], cx: &mut Checker) {
    if let Some((name, Component::Loss(kind))) = component_at(root, key)
        && !allowed.contains(&kind)
    {
        cx.problem(Problem::new(
            ProblemKind::WrongComponentKind,
            join(key, "_component_"),
            format!("`{name}` ({kind:?}) cannot be used as `{key}` for this recipe (expected {allowed:?})"),
        ));
    }
}

/// Existence checks for every path the recipe will read.
pub fn paths(recipe: Recipe, root: &Value, cx: &mut Checker) {
    let resume = yaml::get(root, "resume_from_checkpoint").and_then(Value::as_bool) == Some(true);
    for ck in ["checkpointer", "teacher_checkpointer", "ref_checkpointer"] {
        checkpointer_paths(root, ck, resume, cx);
    }
    let tokenizer_key = [
        "tokenizer.path",
        "tokenizer.tokenizer_json_path",
        "tokenizer.vocab_path",
    ]
    .into_iter()
    .find(|k| yaml::get(root, k).is_some_and(|v| !v.is_null()))
    .unwrap_or("tokenizer.path");
    for key in [
        "tokenizer.tokenizer_config_json_path",
        "tokenizer.generation_config_path",
    ] {
        if let Some(p) = yaml::get(root, key).and_then(Value::as_str) {
            require(Path::new(p).is_file(), cx, key, "file", p, "a JSON file");
        }
    }
    if let Some(p) = yaml::get(root, tokenizer_key).and_then(Value::as_str) {
        match paths::resolve_tokenizer_json(Path::new(p)) {
            Ok(found) if found != Path::new(p) && !Path::new(p).is_dir() => cx.warn(
                tokenizer_key,
                format!("`{p}` is not a tokenizer.json; using {}", found.display()),
            ),
            Ok(_) => {}
            Err(e) => cx.problem(
                Problem::new(ProblemKind::MissingPath, tokenizer_key, e.to_string()).with_fix(
                    format!("point `{tokenizer_key}` at the model's tokenizer.json"),
                ),
            ),
        }
    }
    if recipe == Recipe::Generate {
        if let Some(dir) = yaml::get(root, "adapter_dir").and_then(Value::as_str) {
            require(
                Path::new(dir).is_dir(),
                cx,
                "adapter_dir",
                "directory",
                dir,
                "a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)",
            );
        }
        return;
    }
    for key in ["dataset", "dataset_val"] {
        for (path, entry) in dataset_entries(root, key) {
            let files: Vec<(String, &str)> = match yaml::get(entry, "data_files") {
                Some(Value::String(s)) => vec![(join(&path, "data_files"), s.as_str())],
                Some(Value::Sequence(items)) => items
                    .iter()
                    .enumerate()
                    .filter_map(|(i, v)| Some((format!("{path}.data_files.{i}"), v.as_str()?)))
                    .collect(),
                _ => Vec::new(),
            };
            for (k, f) in files.into_iter().filter(|(_, f)| paths::looks_local(f)) {
                require(
                    Path::new(f).exists(),
                    cx,
                    &k,
                    "file",
                    f,
                    "a local JSON/CSV/Parquet/text file",
                );
            }
        }
    }
}

fn checkpointer_paths(root: &Value, ck: &str, resume: bool, cx: &mut Checker) {
    let Some(dir) = yaml::get(root, &join(ck, "checkpoint_dir")).and_then(Value::as_str) else {
        return;
    };
    let dir_path = Path::new(dir);
    if !dir_path.is_dir() {
        let what = if dir_path.exists() {
            format!("`{dir}` is not a directory")
        } else {
            format!("directory `{dir}` does not exist")
        };
        cx.problem(
            Problem::new(ProblemKind::MissingPath, join(ck, "checkpoint_dir"), what)
            .with_fix(format!(
                "download the model there (`tune download <repo_id> --output-dir {dir}`) or pass `{ck}.checkpoint_dir=<dir>`"
            )),
        );
        return;
    }
    if let Some(Value::Sequence(files)) = yaml::get(root, &join(ck, "checkpoint_files")) {
        for (i, f) in files.iter().enumerate() {
            if let Some(f) = f.as_str() {
                let full = dir_path.join(f);
                if !full.is_file() {
                    cx.problem(
                        Problem::new(
                            ProblemKind::MissingPath,
                            format!("{ck}.checkpoint_files.{i}"),
                            format!("file `{}` does not exist", full.display()),
                        )
                        .with_fix(format!(
                            "list files that exist in `{dir}`, or remove `{ck}.checkpoint_files` to load every *.safetensors there"
                        )),
                    );
                }
            }
        }
    }
    let extra: &[&str] = if resume {
        &["adapter_checkpoint", "recipe_checkpoint"]
    } else {
        &["adapter_checkpoint"]
    };
    for key in extra {
        if let Some(f) = yaml::get(root, &join(ck, key)).and_then(Value::as_str) {
            let full = dir_path.join(f);
            require(
                full.exists(),
                cx,
                &join(ck, key),
                "file",
                &full.display().to_string(),
                "a file inside checkpoint_dir",
            );
        }
    }
}

fn require(ok: bool, cx: &mut Checker, key: &str, what: &str, path: &str, expected: &str) {
    if !ok {
        cx.problem(
            Problem::new(
                ProblemKind::MissingPath,
                key,
                format!("{what} `{path}` does not exist"),
            )
            .with_fix(format!("`{key}` must name {expected}")),
        );
    }
}
