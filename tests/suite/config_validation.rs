//! Bad inputs: each asserts the message a user sees.

use crate::support::{args, path_in, temp_dir, tiny_assets};
use tune::config::{ProblemKind, ValidateOptions, ValidationErrors, Warning, load_config};

use tune::recipes::{validate, validate_with};

const NO_PATHS: ValidateOptions = ValidateOptions { check_paths: false };

fn errors(config: &str, recipe: &str, overrides: &[&str]) -> ValidationErrors {
    let cfg = load_config(config, &args(overrides)).expect("config loads");
    match validate_with(recipe, &cfg, &NO_PATHS) {
        Ok(_) => panic!("expected validation errors"),
        Err(e) => e,
    }
}

fn warnings(config: &str, recipe: &str, overrides: &[&str]) -> Vec<Warning> {
    let cfg = load_config(config, &args(overrides)).expect("config loads");
    validate_with(recipe, &cfg, &NO_PATHS)
        .unwrap_or_else(|e| panic!("{e}"))
        .1
}

#[test]
fn unknown_key_suggests_the_right_one() {
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &["model.lora_rnak=8", "batch_szie=2"],
    );
    assert!(
        e.has(
            "model.lora_rnak",
            "unknown key `lora_rnak` for `model` (`tune.models.llama3.lora_llama3_tiny`)"
        ) && e.has("model.lora_rnak", "did you mean `lora_rank`?"),
        "{e}"
    );
    assert!(
        e.has(
            "batch_szie",
            "unknown key `batch_szie` for this recipe (did you mean `batch_size`?)"
        ),
        "{e}"
    );
}

/// A top-level key that only `${...}` reads is a variable of the config (torchtune's GRPO
/// configs write `base_model_path` once for both checkpointers): its value is used, so it is
/// not unknown; the same key read by nothing is.
#[test]
fn a_key_read_only_through_interpolation_is_a_variable_not_an_unknown_key() {
    let used = [
        "base_model_path=assets/tiny-llama",
        "checkpointer.checkpoint_dir=${base_model_path}",
        "name=tiny_run",
        "output_dir=/tmp/tune/${name}",
    ];
    let cfg = load_config("tiny/lora_single_device", &args(&used)).expect("config loads");
    validate_with("lora_finetune", &cfg, &NO_PATHS).unwrap_or_else(|e| panic!("{e}"));
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &["base_model_path=assets/tiny-llama"],
    );
    assert!(
        e.has("base_model_path", "unknown key `base_model_path`"),
        "{e}"
    );
}

#[test]
fn wrong_type_names_expected_and_found() {
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &[
            "batch_size=four",
            "model.apply_lora_to_mlp=3",
            "optimizer.lr=fast",
        ],
    );
    assert!(
        e.has(
            "batch_size",
            "expected a non-negative integer, found a string `\"four\"`"
        ),
        "{e}"
    );
    assert!(
        e.has(
            "model.apply_lora_to_mlp",
            "expected a boolean (True/False), found an integer `3`"
        ),
        "{e}"
    );
    assert!(
        e.has(
            "optimizer.lr",
            "expected a number, found a string `\"fast\"`"
        ),
        "{e}"
    );
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &["model.lora_attn_modules=[q_proj,z_proj]"],
    );
    assert!(
        e.has(
            "model.lora_attn_modules.1",
            "expected one of q_proj, k_proj, v_proj, output_proj, found `z_proj`"
        ),
        "{e}"
    );
    let e = errors("tiny/lora_single_device", "lora_finetune", &["device=gpu"]);
    assert!(
        e.has("device", "expected one of cpu, cuda, wgpu, found `gpu`"),
        "{e}"
    );
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &["attention=flash"],
    );
    assert!(
        e.has(
            "attention",
            "expected one of fused, composed, found `flash`"
        ),
        "{e}"
    );
}

#[test]
fn missing_required_keys() {
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &["~optimizer.lr", "~tokenizer"],
    );
    assert!(
        e.has("optimizer.lr", "missing required key `lr` (a number)"),
        "{e}"
    );
    assert!(
        e.has("tokenizer", "missing required key `tokenizer`"),
        "{e}"
    );
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &["~loss._component_"],
    );
    assert!(
        e.has(
            "loss._component_",
            "missing required key `_component_` (which loss to use)"
        ),
        "{e}"
    );
}

#[test]
fn unknown_and_misplaced_components() {
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &[
            "optimizer._component_=torch.optim.AdamX",
            "loss=torch.optim.AdamW",
        ],
    );
    assert!(
        e.has(
            "optimizer._component_",
            "unknown component `torch.optim.AdamX`; did you mean"
        ),
        "{e}"
    );
    assert!(e.has("optimizer._component_", "`torch.optim.AdamW`"), "{e}");
    assert!(
        e.has(
            "loss._component_",
            "`torch.optim.AdamW` is a optimizer, but this section needs a loss"
        ),
        "{e}"
    );
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &["checkpointer=torchtune.training.FullModelMetaCheckpointer"],
    );
    assert!(
        e.has(
            "checkpointer._component_",
            "not supported: only Hugging Face checkpoints are read; convert to HF safetensors"
        ),
        "{e}"
    );
}

#[test]
fn recipe_level_rules() {
    let e = errors("tiny/full_single_device", "lora_finetune", &[]);
    assert!(
        e.has(
            "model._component_",
            "recipe `lora_finetune` trains LoRA adapters"
        ),
        "{e}"
    );
    assert!(
        e.problems.iter().any(|p| p.fix.as_deref()
            == Some("use the LoRA builder `tune.models.llama3.lora_llama3_tiny`")),
        "{e}"
    );
    let e = errors("tiny/lora_single_device", "lora_dpo", &[]);
    assert!(
        e.has("dataset._component_", "needs a preference dataset"),
        "{e}"
    );
    assert!(
        e.has(
            "loss._component_",
            "cannot be `loss` for this recipe: it takes tune.loss.DPOLoss"
        ),
        "{e}"
    );
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &[
            "optimizer.amsgrad=True",
            "dataset._component_=torchtune.datasets.chat_dataset",
            "~dataset.source",
        ],
    );
    assert!(
        e.has("optimizer.amsgrad", "AMSGrad is not supported"),
        "{e}"
    );
    assert!(
        e.has(
            "dataset.source",
            "has no default source; `source` is required"
        ),
        "{e}"
    );
    // Each optimizer and schedule owns its keys: another one's is refused, saying whose.
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &[
            "optimizer._component_=torch.optim.SGD",
            "optimizer.momentum=0.9",
            "optimizer.betas=[0.9,0.95]",
            "optimizer.eps=1e-6",
        ],
    );
    for (key, owner) in [
        (
            "optimizer.betas",
            "it is a setting of tune.optim.AdamW, tune.optim.Adam",
        ),
        (
            "optimizer.eps",
            "it is a setting of tune.optim.AdamW, tune.optim.Adam",
        ),
    ] {
        assert!(
            e.has(key, "is not a setting of `tune.optim.SGD`") && e.has(key, owner),
            "{e}"
        );
    }
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &[
            "optimizer.momentum=0.9",
            "lr_scheduler._component_=torchtune.training.lr_schedulers.get_linear_schedule_with_warmup",
            "lr_scheduler.num_cycles=0.5",
        ],
    );
    assert!(
        e.has("optimizer.momentum", "it is a setting of tune.optim.SGD"),
        "{e}"
    );
    assert!(
        e.has(
            "lr_scheduler.num_cycles",
            "it is a setting of tune.lr_schedulers.cosine_with_warmup"
        ),
        "{e}"
    );
    let e = errors(
        "tiny/kd_lora_single_device",
        "kd",
        &[
            "~teacher_checkpointer",
            "kd_loss=torchtune.rlhf.loss.DPOLoss",
        ],
    );
    assert!(
        e.has(
            "teacher_checkpointer",
            "missing required key `teacher_checkpointer`"
        ),
        "{e}"
    );
    assert!(
        e.has("kd_loss._component_", "cannot be `kd_loss` for this recipe"),
        "{e}"
    );
}

#[test]
fn qlora_is_refused_where_torchtune_has_no_such_combination() {
    let e = errors(
        "tiny/full_single_device",
        "full_finetune",
        &["model.quantize_base=True"],
    );
    assert!(
        e.has(
            "model.quantize_base",
            "`quantize_base` is not a setting of `tune.models.llama3.llama3_tiny`: it is a setting of LoRA builders"
        ),
        "{e}"
    );
    let e = errors(
        "tiny/qat_lora_single_device",
        "qat_lora",
        &["model._component_=tune.models.llama3.qlora_llama3_tiny"],
    );
    assert!(
        e.has(
            "model._component_",
            "stores the base in NF4 (QLoRA), but QAT"
        ),
        "{e}"
    );
    // Accepted, without a warning, by the LoRA recipes.
    assert!(
        warnings(
            "tiny/lora_single_device",
            "lora_finetune",
            &["model.quantize_base=True"]
        )
        .is_empty()
    );
}

#[test]
fn collects_every_problem_and_prints_one_per_line() {
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &[
            "model.lora_rnak=8",
            "batch_size=-1",
            "optimizer=torch.optim.AdamX",
            "~epochs",
        ],
    );
    assert_eq!(e.problems.len(), 4, "{e}");
    let text = e.to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "tiny/lora_single_device: 4 problems");
    assert_eq!(lines.len(), 5);
    assert!(
        lines[1..]
            .iter()
            .all(|l| l.starts_with("  tiny/lora_single_device: ")),
        "{text}"
    );
}

#[test]
fn problems_name_the_config_file() {
    let dir = temp_dir("file");
    let path = path_in(dir.path(), "my.yaml");
    let text = load_config("tiny/generation", &[])
        .unwrap()
        .to_yaml_string();
    std::fs::write(&path, text.replace("max_new_tokens", "max_new_tokenz")).unwrap();
    let cfg = load_config(&path, &[]).unwrap();
    let e = validate_with("generate", &cfg, &NO_PATHS).unwrap_err();
    assert_eq!(e.source_name, path);
    assert!(e.to_string().contains(&format!("{path}: max_new_tokenz: unknown key `max_new_tokenz` for this recipe (did you mean `max_new_tokens`?)")), "{e}");
}

#[test]
fn unknown_recipe() {
    let cfg = load_config("tiny/lora_single_device", &[]).unwrap();
    let e = validate("lora_fintune", &cfg).unwrap_err();
    assert_eq!(e.problems[0].kind, ProblemKind::UnknownRecipe);
    let text = e.to_string();
    assert!(text.contains("unknown recipe `lora_fintune` (did you mean `lora_finetune`?); known recipes: full_finetune, lora_finetune, lora_dpo, full_dpo, qat, qat_lora, knowledge_distillation, grpo_full_finetune, grpo_lora_finetune, ppo_full_finetune, generate"), "{text}");
}

#[test]
fn recipe_aliases_accepted() {
    let cfg = load_config("tiny/lora_single_device", &[]).unwrap();
    for name in [
        "lora_finetune",
        "lora_finetune_single_device",
        "lora_finetune_single_device.py",
    ] {
        assert!(validate_with(name, &cfg, &NO_PATHS).is_ok(), "{name}");
    }
}

#[test]
fn missing_files_name_key_and_path() {
    let assets = tiny_assets();
    let root = assets.path().display().to_string();
    let cfg = load_config(
        "tiny/lora_single_device",
        &args(&[
            "checkpointer.checkpoint_dir=/nonexistent/model",
            "tokenizer.path=/nonexistent/model/tokenizer.json",
            &format!("dataset.data_files={root}/assets/data/missing.json"),
        ]),
    )
    .unwrap();
    let e = validate("lora_finetune", &cfg).unwrap_err();
    assert!(
        e.has(
            "checkpointer.checkpoint_dir",
            "directory `/nonexistent/model` does not exist"
        ),
        "{e}"
    );
    assert!(
        e.has(
            "tokenizer.path",
            "no tokenizer.json found for /nonexistent/model/tokenizer.json"
        ),
        "{e}"
    );
    assert!(
        e.has(
            "dataset.data_files",
            &format!("file `{root}/assets/data/missing.json` does not exist")
        ),
        "{e}"
    );
    assert!(
        e.problems
            .iter()
            .all(|p| p.kind == ProblemKind::MissingPath),
        "{e}"
    );

    let cfg = load_config(
        "tiny/lora_single_device",
        &args(&[
            &format!("checkpointer.checkpoint_dir={root}/assets/tiny-llama"),
            "checkpointer.checkpoint_files=[model-00001-of-00002.safetensors]",
            &format!("tokenizer.path={root}/assets/tiny-llama/tokenizer.json"),
            &format!("dataset.data_files={root}/assets/data/alpaca_tiny.json"),
        ]),
    )
    .unwrap();
    let e = validate("lora_finetune", &cfg).unwrap_err();
    assert_eq!(e.problems.len(), 1, "{e}");
    assert!(
        e.has(
            "checkpointer.checkpoint_files.0",
            &format!(
                "file `{root}/assets/tiny-llama/model-00001-of-00002.safetensors` does not exist"
            )
        ),
        "{e}"
    );
}

#[test]
fn unsupported_options_warn() {
    let w = warnings(
        "tiny/lora_single_device",
        "lora_finetune",
        &[
            "compile=True",
            "enable_activation_checkpointing=True",
            "enable_activation_offloading=True",
            "profiler={_component_: torchtune.training.setup_torch_profiler, enabled: True, cpu: True}",
            "metric_logger._component_=torchtune.training.metric_logging.WandBLogger",
            "metric_logger.project=p",
            "optimizer=bitsandbytes.optim.PagedAdamW8bit",
        ],
    );
    let keys: Vec<&str> = w.iter().map(|w| w.key.as_str()).collect();
    for k in [
        "compile",
        "enable_activation_offloading",
        "profiler.enabled",
        "metric_logger._component_",
        "optimizer._component_",
    ] {
        assert!(keys.contains(&k), "missing warning for {k}: {w:?}");
    }
    assert!(
        w.iter().any(|w| w.to_string()
            == "compile: torch.compile has no equivalent here; running uncompiled")
    );
    // Offloading on the CPU: the activations are in host memory already.
    assert!(
        w.iter().any(|w| w.key == "enable_activation_offloading"
            && w.to_string().contains("changes nothing")),
        "{w:?}"
    );
    // Disabled or false options stay quiet.
    assert!(
        warnings(
            "tiny/lora_single_device",
            "lora_finetune",
            &["compile=False"]
        )
        .is_empty()
    );
}

#[test]
fn kitchen_sink_every_key_deserialises() {
    // Every key the spec accepts for a LoRA recipe, so spec and structs stay in step.
    let cfg = load_config(
        "tiny/lora_single_device",
        &args(&[
            "clip_grad_norm=1.0",
            "log_level=INFO",
            "save_every_n_steps=10",
            "keep_last_n_checkpoints=2",
            "optimizer_in_bwd=False",
            "custom_sharded_layers=null",
            "push_to_hub={repo_id: me/tiny, private: True}",
            "run_val_every_n_steps=5",
            "dataset_val={_component_: torchtune.datasets.alpaca_dataset, source: json, data_files: a.json, split: train}",
            "model.apply_lora_to_output=True",
            "model.quantize_base=False",
            "tokenizer.merges_file=null",
            "tokenizer.prompt_template=null",
            "tokenizer.special_tokens_path=null",
            "checkpointer.adapter_checkpoint=null",
            "checkpointer.safe_serialization=True",
            "dataset.name=null",
            "dataset.column_map={input: prompt}",
            "dataset.train_on_input=True",
            "dataset.new_system_prompt=Be brief.",
            "dataset.conversation_column=messages",
            "dataset.conversation_style=openai",
            "dataset.column=text",
            "dataset.add_eos=False",
            "dataset.filter_fn=null",
            "optimizer.betas=[0.9,0.95]",
            "optimizer.eps=1e-6",
            "optimizer.fused=True",
            "optimizer.amsgrad=False",
            "lr_scheduler.num_cycles=0.5",
            "loss.num_output_chunks=8",
            "metric_logger.filename=log.txt",
            "metric_logger.project=p",
            "enable_activation_offloading=False",
            "compile=False",
            "profiler={_component_: torchtune.training.setup_torch_profiler, enabled: False, wait_steps: 5}",
        ]),
    )
    .unwrap();
    let (typed, _) =
        validate_with("lora_finetune", &cfg, &NO_PATHS).unwrap_or_else(|e| panic!("{e}"));
    let t = typed.as_train().expect("train");
    let tune::config::schema::OptimizerSettings::AdamW(adamw) = &t.optimizer.settings else {
        panic!("tiny/lora_single_device's optimizer is AdamW");
    };
    assert_eq!(adamw.moments.betas, (0.9, 0.95));
    assert_eq!(adamw.moments.eps, 1e-6);
    assert_eq!(t.push_to_hub.as_ref().map(|p| p.private), Some(true));
    assert_eq!(t.dataset_val.as_ref().map(|d| d.len()), Some(1));
    assert_eq!(t.profiler.as_ref().map(|p| p.enabled), Some(false));
}

/// Values of the right type that would train nonsense (or fail deep in the tensor library)
/// are refused by `tune validate` with the key, the value and the allowed range.
#[test]
fn out_of_range_training_values_are_refused_naming_key_value_and_range() {
    for (over, key, says) in [
        (
            "optimizer.lr=-1",
            "optimizer.lr",
            "-1 is out of range: it must be greater than 0",
        ),
        (
            "batch_size=0",
            "batch_size",
            "0 is out of range: it must be at least 1",
        ),
        (
            "epochs=0",
            "epochs",
            "0 is out of range: it must be at least 1",
        ),
        (
            "gradient_accumulation_steps=0",
            "gradient_accumulation_steps",
            "0 is out of range: it must be at least 1",
        ),
        (
            "model.lora_rank=0",
            "model.lora_rank",
            "0 is out of range: it must be at least 1",
        ),
        (
            "model.lora_alpha=0",
            "model.lora_alpha",
            "0 is out of range: it must be greater than 0",
        ),
        (
            "model.lora_dropout=1.5",
            "model.lora_dropout",
            "1.5 is out of range",
        ),
        (
            "tokenizer.max_seq_len=0",
            "tokenizer.max_seq_len",
            "0 is out of range",
        ),
        ("clip_grad_norm=0", "clip_grad_norm", "0 is out of range"),
        ("log_every_n_steps=0", "log_every_n_steps", "at least 1"),
        ("save_every_n_steps=0", "save_every_n_steps", "at least 1"),
        (
            "keep_last_n_checkpoints=0",
            "keep_last_n_checkpoints",
            "at least 1",
        ),
    ] {
        let e = errors("tiny/lora_single_device", "lora_finetune", &[over]);
        assert!(e.has(key, says), "{over}: {e}");
    }
    let e = errors(
        "tiny/kd_lora_single_device",
        "knowledge_distillation_single_device",
        &["kd_ratio=1.5"],
    );
    assert!(
        e.has("kd_ratio", "1.5 is out of range: it must be from 0 to 1"),
        "{e}"
    );
    for (over, key, says) in [
        ("max_new_tokens=0", "max_new_tokens", "at least 1"),
        ("temperature=-0.5", "temperature", "0 (greedy) or greater"),
        ("top_p=0", "top_p", "greater than 0 and at most 1"),
        ("top_p=1.5", "top_p", "1.5 is out of range"),
    ] {
        let e = errors("tiny/generation", "generate", &[over]);
        assert!(e.has(key, says), "{over}: {e}");
    }
    warnings(
        "tiny/generation",
        "generate",
        &["temperature=0", "top_p=1", "top_k=1"],
    );
    // top_k 0 is every token, as transformers and TRL read it (the one sampling group of
    // generation, GRPO and PPO).
    warnings("tiny/generation", "generate", &["top_k=0"]);
    warnings(
        "tiny/ppo_full_single_device",
        "ppo_full_finetune",
        &["top_k=0", "top_p=0.9"],
    );
    // The limits themselves are fine.
    warnings(
        "tiny/lora_single_device",
        "lora_finetune",
        &[
            "batch_size=1",
            "model.lora_dropout=0.0",
            "tokenizer.max_seq_len=2",
        ],
    );
}

/// torchtune's distributed knobs: accepted at the values that mean what tune does (FSDP or
/// ZeRO-1 data parallelism, CPU offload on the CPU), refused by name otherwise.
#[test]
fn torchtune_parallelism_keys_are_accepted_or_refused_by_value() {
    let warned = warnings(
        "tiny/full",
        "full_finetune_distributed",
        &[
            "fsdp_cpu_offload=False",
            "tensor_parallel_dim=1",
            "tensor_parallel_plan={_component_: torchtune.models.llama3.base_llama_tp_plan}",
            "data_parallel_shard_dim=-1",
            "data_parallel_replicate_dim=1",
            "fsdp_reshard_after_forward=True",
            "custom_sharded_layers=[tok_embeddings, output]",
        ],
    );
    // The embeddings and output are units of their own, as the list asks: nothing to say.
    assert!(
        !warned
            .iter()
            .any(|w| w.key == "fsdp_reshard_after_forward" || w.key == "custom_sharded_layers"),
        "{warned:?}"
    );
    // False works too (distributed.rs checks it trains as True does).
    let warned = warnings(
        "tiny/full",
        "full_finetune_distributed",
        &["fsdp_reshard_after_forward=False"],
    );
    assert!(
        !warned.iter().any(|w| w.key == "fsdp_reshard_after_forward"),
        "{warned:?}"
    );
    // CPU offload: on the CPU (tiny/full's device) everything already is in host memory, which
    // is said once; on a GPU it offloads FSDP's shards, which replicated weights do not have.
    let warned = warnings(
        "tiny/full",
        "full_finetune_distributed",
        &["fsdp_cpu_offload=True"],
    );
    assert_eq!(
        warned
            .iter()
            .filter(|w| w.key == "fsdp_cpu_offload" && w.message.contains("changes nothing"))
            .count(),
        1,
        "{warned:?}"
    );
    for device in ["cuda", "wgpu"] {
        let device = format!("device={device}");
        let warned = warnings(
            "tiny/full",
            "full_finetune_distributed",
            &["fsdp_cpu_offload=True", &device],
        );
        assert!(
            !warned.iter().any(|w| w.key == "fsdp_cpu_offload"),
            "{device}: {warned:?}"
        );
        let e = errors(
            "tiny/full",
            "full_finetune_distributed",
            &[
                "fsdp_cpu_offload=True",
                &device,
                "data_parallel_shard_dim=1",
            ],
        );
        assert!(
            e.has("fsdp_cpu_offload", "keeps every weight whole on every rank")
                && e.has("fsdp_cpu_offload", "set `fsdp_cpu_offload: False`"),
            "{device}: {e}"
        );
    }
    for (over, key, says) in [
        (
            "tensor_parallel_dim=8",
            "tensor_parallel_dim",
            "no tensor parallelism",
        ),
        (
            "data_parallel_replicate_dim=2",
            "data_parallel_replicate_dim",
            "no replication groups",
        ),
        (
            "data_parallel_shard_dim=0",
            "data_parallel_shard_dim",
            "-1 (all ranks)",
        ),
        (
            "custom_sharded_layers=[tok_embeddings, layers.0.mlp]",
            "custom_sharded_layers",
            "found `layers.0.mlp`",
        ),
    ] {
        let e = errors("tiny/full", "full_finetune_distributed", &[over]);
        assert!(e.has(key, says), "{over}: {e}");
    }
}

#[test]
fn prompt_templates_are_checked_by_name_and_only_with_a_torchtune_tokenizer() {
    let llama3 = "tokenizer._component_=torchtune.models.llama3.llama3_tokenizer";
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &[llama3, "tokenizer.prompt_template=my.module.MyTemplate"],
    );
    assert!(
        e.to_string().contains("tokenizer.prompt_template")
            && e.to_string().contains("my.module.MyTemplate"),
        "{e}"
    );
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &[llama3, "tokenizer.prompt_template={user: [only]}"],
    );
    assert!(e.to_string().contains("[prefix, suffix]"), "{e}");
    // The checkpoint's chat template formats HFTokenizer's messages: a template cannot apply.
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &["tokenizer.prompt_template=torchtune.data.SummarizeTemplate"],
    );
    assert!(e.to_string().contains("chat template"), "{e}");
    // Built-in names and mappings validate.
    for t in [
        "torchtune.data.QuestionAnswerTemplate",
        "torchtune.models.llama2.Llama2ChatTemplate",
        "{user: ['Q: ', ' A: ']}",
        "null",
    ] {
        let cfg = load_config(
            "tiny/lora_single_device",
            &args(&[llama3, &format!("tokenizer.prompt_template={t}")]),
        )
        .unwrap();
        validate_with("lora_finetune", &cfg, &NO_PATHS).unwrap_or_else(|e| panic!("{t}: {e}"));
    }
}

/// Keys and components of torchtune main's configs: accepted where tune does what they ask,
/// refused by name where it cannot.
#[test]
fn torchtune_main_spellings_are_accepted_or_refused_by_name() {
    let ok = |overrides: &[&str]| {
        let cfg = load_config("tiny/lora_single_device", &args(overrides)).unwrap();
        validate_with("lora_finetune", &cfg, &NO_PATHS)
            .unwrap_or_else(|e| panic!("{overrides:?}: {e}"));
    };
    ok(&["low_cpu_ram=True"]);
    ok(&[
        "tokenizer._component_=torchtune.modules.transforms.tokenizers.HuggingFaceModelTokenizer",
        "~tokenizer.path",
        "tokenizer.tokenizer_json_path=assets/tiny-llama/tokenizer.json",
        "tokenizer.truncation_type=left",
    ]);
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &["~tokenizer.path"],
    );
    assert!(e.to_string().contains("tokenizer.path"), "{e}");
    ok(&["checkpointer.keep_last_n_checkpoints=2"]);
    ok(&[
        "keep_last_n_checkpoints=2",
        "checkpointer.keep_last_n_checkpoints=2",
    ]);
    // A generic builder with its architecture arguments (checked against config.json at run).
    ok(&[
        "model=torchtune.models.llama3.lora_llama3",
        "model.lora_rank=8",
        "model.lora_alpha=16",
        "model.lora_attn_modules=[q_proj,v_proj]",
        "model.num_layers=2",
        "model.embed_dim=64",
        "model.attn_dropout=0.0",
        "model.norm_eps=1e-5",
    ]);
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &[
            "keep_last_n_checkpoints=2",
            "checkpointer.keep_last_n_checkpoints=3",
        ],
    );
    assert!(
        e.to_string()
            .contains("checkpointer.keep_last_n_checkpoints"),
        "{e}"
    );
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &[
            "model.attn_dropout=0.1",
            "dataset.filter_fn=my_module.keep_short",
        ],
    );
    let text = e.to_string();
    assert!(
        text.contains("model.attn_dropout") && text.contains("attention dropout"),
        "{e}"
    );
    assert!(
        text.contains("dataset.filter_fn") && text.contains("filter the data file"),
        "{e}"
    );
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &["model=torchtune.models.llama3_2_vision.lora_llama3_2_vision_11b"],
    );
    assert!(
        e.to_string()
            .contains("vision-language models are not supported"),
        "{e}"
    );
}

/// Generation's prompt goes through the chat template only with `chat: True` and a component
/// that writes it: a system prompt that would not reach the model, and `chat` with a torchtune
/// component (which formats the prompt itself), are refused by name.
#[test]
fn a_generation_prompt_that_would_not_reach_the_model_as_written_is_refused() {
    let e = errors(
        "tiny/generation",
        "generate",
        &["prompt={system: Be brief., user: Hi}", "chat=False"],
    );
    assert!(
        e.has("prompt.system", "a system prompt needs the chat template"),
        "{e}"
    );
    let llama3 = "tokenizer._component_=torchtune.models.llama3.llama3_tokenizer";
    let e = errors("tiny/generation", "generate", &[llama3, "chat=True"]);
    assert!(e.has("chat", "names a torchtune tokenizer"), "{e}");
    // Either alone is fine: a torchtune component formats the system message itself.
    warnings(
        "tiny/generation",
        "generate",
        &[llama3, "prompt={system: Be brief., user: Hi}"],
    );
    warnings(
        "tiny/generation",
        "generate",
        &["prompt={system: Be brief., user: Hi}", "chat=True"],
    );
}

/// Checks setup used to make after loading (so a run failed minutes in) are the keys' own
/// now, refused by `tune validate` with the key and the range; and components and keys tune
/// cannot honour are refused by name rather than failing in setup or being ignored.
#[test]
fn ranges_setup_used_to_check_and_unbuilt_datasets_are_refused_at_validation() {
    for (config, recipe, over, key, says) in [
        (
            "tiny/lora_dpo_single_device",
            "lora_dpo",
            "loss.label_smoothing=0.5",
            "loss.label_smoothing",
            "0.5 is out of range: it must be from 0 up to, not including, 0.5",
        ),
        (
            "tiny/lora_dpo_single_device",
            "lora_dpo",
            "loss.beta=0",
            "loss.beta",
            "DPO's beta must be positive",
        ),
        (
            "tiny/lora_single_device",
            "lora_finetune",
            "enable_activation_offloading=True",
            "enable_activation_offloading",
            "but enable_activation_checkpointing is False",
        ),
        (
            "tiny/lora_single_device",
            "lora_finetune",
            "loss.beta=0.1",
            "loss.beta",
            "`beta` is not a setting of `tune.loss.CrossEntropyLoss`",
        ),
        (
            "tiny/qat_single_device",
            "qat",
            "quantizer.groupsize=1",
            "quantizer.groupsize",
            "1 is out of range: it must be at least 2",
        ),
        (
            "tiny/lora_single_device",
            "lora_finetune",
            "dataset.name=wikitext-103-v1",
            "dataset.name",
            "select its files with `data_files`",
        ),
    ] {
        let e = errors(config, recipe, &[over]);
        assert!(e.has(key, says), "{over}: {e}");
    }
    let e = errors(
        "tiny/kd_lora_single_device",
        "kd",
        &[
            "kd_loss=torchtune.modules.loss.SymmetricKLLoss",
            "kd_loss.sym_kd_ratio=1.5",
        ],
    );
    assert!(
        e.has(
            "kd_loss.sym_kd_ratio",
            "1.5 is out of range: it must be from 0 to 1"
        ),
        "{e}"
    );
    for (builder, instead) in [
        ("samsum_dataset", "instruct_dataset"),
        ("grammar_dataset", "instruct_dataset"),
        ("wikitext_dataset", "text_completion_dataset"),
    ] {
        let e = errors(
            "tiny/lora_single_device",
            "lora_finetune",
            &[&format!("dataset._component_=torchtune.datasets.{builder}")],
        );
        assert!(
            e.problems.iter().any(|p| p.key == "dataset._component_"
                && p.kind == ProblemKind::UnsupportedComponent
                && p.message.contains(instead)),
            "{builder}: {e}"
        );
    }
}

/// torchtune's `lora_*` builders default `lora_rank` to 8 and `lora_alpha` to 16, so a LoRA
/// teacher written with its targets only (torchtune's `qwen2_5/14B_to_7B_KD_lora_single_device`)
/// validates; a frozen teacher has no routers to train.
#[test]
fn a_lora_builder_takes_torchtunes_rank_and_alpha_defaults() {
    let lora_teacher = [
        "teacher_model={_component_: torchtune.models.llama3.lora_llama3_tiny, lora_attn_modules: [q_proj, v_proj, output_proj]}",
    ];
    let cfg = load_config("tiny/kd_lora_single_device", &args(&lora_teacher)).unwrap();
    let (typed, _) = validate_with("kd", &cfg, &NO_PATHS).unwrap_or_else(|e| panic!("{e}"));
    let student = &typed.as_train().expect("training").model;
    assert!(student.lora().is_some());
    let cfg = load_config(
        "tiny/lora_single_device",
        &args(&["~model.lora_rank", "~model.lora_alpha"]),
    )
    .unwrap();
    let (typed, _) = validate_with("lora_finetune", &cfg, &NO_PATHS).unwrap();
    let lora = typed.as_train().and_then(|t| t.model.lora()).cloned();
    assert_eq!(lora.map(|l| (l.lora_rank, l.lora_alpha)), Some((8, 16.0)));
    let mut with_router = lora_teacher.to_vec();
    with_router.push("teacher_model.train_router=True");
    let e = errors("tiny/kd_lora_single_device", "kd", &with_router);
    assert!(
        e.has("teacher_model.train_router", "is not trained by recipe"),
        "{e}"
    );
}

/// Each metric logger takes its own settings (torchtune's classes' arguments): a TensorBoard
/// logger's `organize_logs` on the DiskLogger is refused by name.
#[test]
fn each_metric_logger_reads_its_own_settings() {
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &["metric_logger.organize_logs=True"],
    );
    assert!(
        e.has(
            "metric_logger.organize_logs",
            "is not a setting of `tune.metric_logging.DiskLogger`: it is a setting of tune.metric_logging.TensorBoardLogger"
        ),
        "{e}"
    );
    warnings(
        "tiny/lora_single_device",
        "lora_finetune",
        &[
            "metric_logger={_component_: torchtune.training.metric_logging.TensorBoardLogger, organize_logs: False}",
        ],
    );
    let e = errors(
        "tiny/lora_single_device",
        "lora_finetune",
        &["metric_logger.filename=logs/m.jsonl"],
    );
    assert!(e.has("metric_logger.filename", "is not a file name"), "{e}");
}
