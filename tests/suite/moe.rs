//! Mixture-of-experts checkpoints through tune: saved as the Hub stores them, trained by the
//! LoRA and full recipes (the golden logits and gradients are in `models.rs`).

use crate::support::*;

use std::path::Path;

use serde_json::json;
use tune::checkpoint::safetensors_io::SafetensorsFile;
use tune::checkpoint::{HostTensor, StorageDtype};
use tune::model_io::hf::{DEFAULT_MAX_SHARD_BYTES, load_model, save_model};
use tune::models::{ModelArgs, RandomInit, build};

/// The four families' checkpoints save back byte for byte under the Hub's names (per-expert
/// tensors; Mixtral's `block_sparse_moe` and `w1`/`w3`/`w2`; gpt-oss's fused experts, split on
/// load and fused again).
#[test]
fn moe_checkpoints_save_as_the_hub_stores_them() {
    for family in ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"] {
        let src = fixture(&format!("families/{family}"));
        let lm = load_model::<Cpu>(&src, None, &Default::default())
            .unwrap()
            .model;
        let out = temp_dir(&format!("moe-save-{family}"));
        save_model(
            &lm,
            out.path(),
            Some(&src),
            StorageDtype::F32,
            DEFAULT_MAX_SHARD_BYTES,
        )
        .unwrap();
        let (want, got) = (stored_tensors(&src), stored_tensors(out.path()));
        assert_eq!(
            want.keys().collect::<Vec<_>>(),
            got.keys().collect::<Vec<_>>(),
            "{family}: tensor names"
        );
        for (name, tensor) in &want {
            assert!(got[name] == *tensor, "{family}: {name} differs");
        }
    }
}

/// A Qwen3-MoE checkpoint the tiny tokenizer fits: 3 layers, the middle one dense
/// (`mlp_only_layers`), 4 experts of which each token takes 2.
fn tiny_qwen3_moe() -> TempDir {
    tiny_qwen3_moe_with(json!({}))
}

/// [`tiny_qwen3_moe`] with `extra` keys in its config.json.
fn tiny_qwen3_moe_with(extra: serde_json::Value) -> TempDir {
    let mut config = json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": true, "mlp_only_layers": [1], "decoder_sparse_step": 1,
        "output_router_logits": false, "tie_word_embeddings": false, "bos_token_id": 2000,
        "eos_token_id": 2004, "pad_token_id": 2005, "torch_dtype": "float32"
    });
    overridden(&mut config, extra);
    saved_random(config, 3, "tiny-qwen3-moe")
}

/// `config` with `extra`'s keys set.
fn overridden(config: &mut serde_json::Value, extra: serde_json::Value) {
    for (key, value) in extra.as_object().into_iter().flatten() {
        config[key] = value.clone();
    }
}

/// A model of `config` with seeded random weights, saved with the tiny tokenizer beside it.
fn saved_random(config: serde_json::Value, seed: u64, tag: &str) -> TempDir {
    let args = ModelArgs::from_json(config).unwrap();
    let mut init = RandomInit::new(seed, &args);
    let lm = build::<Cpu>(&args, &mut init, &Default::default()).unwrap();
    let dir = temp_dir(tag);
    let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-llama");
    save_model(
        &lm,
        dir.path(),
        Some(&assets),
        StorageDtype::F32,
        DEFAULT_MAX_SHARD_BYTES,
    )
    .unwrap();
    dir
}

/// LoRA on q/v and every expert of the tiny Qwen3-MoE, rank 8, alpha 16.
const LORA_ON_EXPERTS: [&str; 5] = [
    "model=tune.models.qwen3_moe.lora_qwen3_moe_tiny",
    "model.lora_attn_modules=[q_proj,v_proj]",
    "model.apply_lora_to_mlp=True",
    "model.lora_rank=8",
    "model.lora_alpha=16",
];

/// LoRA on a sparse model adapts what peft adapts when it loads the adapter on transformers 5:
/// attention and every routed expert's projections (peft maps `gate_proj`/`up_proj`/`down_proj`
/// onto the fused experts, so a dense layer's MLP takes none); routers stay as loaded, and the
/// loss falls.
#[test]
fn lora_on_a_moe_adapts_attention_and_experts_as_peft_does() {
    let ckpt = tiny_qwen3_moe();
    let out = temp_dir("moe-lora");
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let metrics = run_recipe(
        "lora_finetune_single_device",
        "tiny/lora_single_device",
        &out,
        &[
            &LORA_ON_EXPERTS[..],
            &[&checkpoint_dir, "max_steps_per_epoch=25"],
        ]
        .concat(),
    );
    let (first, last) = first_and_last_mean(&column(&metrics, "loss"));
    assert!(last < first, "loss {first} -> {last}");

    let epoch = out.path().join("epoch_0");
    let adapter = SafetensorsFile::open(&epoch.join("adapter_model.safetensors")).unwrap();
    let names = adapter.names();
    for module in [
        "model.layers.0.self_attn.q_proj",
        "model.layers.2.self_attn.v_proj",
        "model.layers.0.mlp.experts.0.gate_proj",
        "model.layers.2.mlp.experts.3.down_proj",
    ] {
        let key = format!("base_model.model.{module}.lora_A.weight");
        assert!(names.contains(&key), "{key} not in {names:?}");
    }
    assert!(
        names.iter().all(|n| !n.contains("layers.1.mlp.")),
        "{names:?}"
    );
    // q and v in 3 layers, 3 projections of 4 experts in 2 layers; A and B each
    assert_eq!(names.len(), 2 * (3 * 2 + 2 * 4 * 3), "{names:?}");

    // The merged export: adapted weights changed, routers and the dense MLP exactly as loaded.
    let (before, after) = (stored_tensors(ckpt.path()), stored_tensors(&epoch));
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>()
    );
    for (name, tensor) in &before {
        let same = after[name] == *tensor;
        let adapted =
            name.contains("q_proj") || name.contains("v_proj") || name.contains(".experts.");
        assert_eq!(same, !adapted, "{name}: changed = {}", !same);
    }
}

/// `model.train_router: True` trains every sparse layer's router in full beside the adapters,
/// as peft's `modules_to_save: ["mlp.gate"]` does: the adapter holds the routers under peft's
/// keys, the merged export the same trained routers (everything else as the plain LoRA run
/// leaves it), and loading the adapter back sets them.
#[test]
fn lora_with_train_router_trains_the_routers_and_saves_them_as_peft_does() {
    let ckpt = tiny_qwen3_moe();
    let out = temp_dir("moe-lora-router");
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let mut args = LORA_ON_EXPERTS.to_vec();
    args.extend([
        "model.train_router=True",
        checkpoint_dir.as_str(),
        "max_steps_per_epoch=25",
    ]);
    let metrics = run_recipe(
        "lora_finetune_single_device",
        "tiny/lora_single_device",
        &out,
        &args,
    );
    let (first, last) = first_and_last_mean(&column(&metrics, "loss"));
    assert!(last < first, "loss {first} -> {last}");

    let epoch = out.path().join("epoch_0");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(epoch.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["modules_to_save"], json!(["mlp.gate"]));
    let adapter = SafetensorsFile::open(&epoch.join("adapter_model.safetensors")).unwrap();
    let names = adapter.names();
    // The plain run's 36 adapter tensors and the routers of the two sparse layers.
    assert_eq!(names.len(), 2 * (3 * 2 + 2 * 4 * 3) + 2, "{names:?}");

    let (before, after) = (stored_tensors(ckpt.path()), stored_tensors(&epoch));
    for layer in [0, 2] {
        let name = format!("model.layers.{layer}.mlp.gate.weight");
        let saved = adapter.read(&format!("base_model.model.{name}")).unwrap();
        assert!(before[&name] != after[&name], "{name} did not train");
        let exported = stored_f32(&epoch, &name);
        assert_eq!(
            saved.data, exported,
            "{name}: the adapter's router is the export's"
        );
    }
    assert_eq!(
        before["model.layers.1.mlp.up_proj.weight"], after["model.layers.1.mlp.up_proj.weight"],
        "the dense layer's MLP is no router"
    );

    adapter_sets_on_load(ckpt.path(), &epoch, "model.layers.2.mlp.gate.weight");

    // Continuing that adapter (`checkpointer.adapter_checkpoint`) without the routers is
    // refused by key: it would freeze what the adapter trained.
    let again = temp_dir("moe-lora-router-again");
    let adapter_checkpoint = format!("checkpointer.adapter_checkpoint={}", epoch.display());
    let mut args = LORA_ON_EXPERTS.to_vec();
    args.extend([checkpoint_dir.as_str(), adapter_checkpoint.as_str()]);
    let run = tiny_lora(&again, &args);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(
        stderr.contains("model.train_router") && stderr.contains("train_router: True"),
        "{stderr}"
    );
}

/// Tensor `name` of the checkpoint in `dir`, in f32.
fn stored_f32(dir: &Path, name: &str) -> Vec<f32> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .filter_map(|p| SafetensorsFile::open(&p).unwrap().read(name).ok())
        .map(|t| t.data)
        .next()
        .unwrap_or_else(|| panic!("{name} not in {}", dir.display()))
}

/// Routers trained under LoRA on two FSDP workers take the same steps as on one device, and
/// both adapters hold the same routers.
#[test]
fn fsdp_lora_with_trained_routers_matches_one_device() {
    let ckpt = tiny_qwen3_moe();
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let mut extra = LORA_ON_EXPERTS.to_vec();
    extra.extend(["model.train_router=True", checkpoint_dir.as_str()]);
    let (one, two) = crate::distributed::recipes_on_one_device_and_fsdp_agree(
        "moe-router-fsdp",
        crate::distributed::LORA_RECIPES,
        &extra,
        4,
    );
    let router = |dir: &TempDir| {
        SafetensorsFile::open(&dir.path().join("epoch_0/adapter_model.safetensors"))
            .unwrap()
            .read("base_model.model.model.layers.0.mlp.gate.weight")
            .unwrap()
            .data
    };
    let (a, b) = (router(&one), router(&two));
    let base = stored_f32(ckpt.path(), "model.layers.0.mlp.gate.weight");
    assert!(a != base, "the router did not train");
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5, "{x} vs {y}");
    }
}

/// A LoRA run that trains the routers, stopped after an epoch and resumed, takes the
/// uninterrupted run's steps bit for bit and ends with the same adapter, routers included:
/// the routers come back from the adapter, their AdamW moments from the optimizer state.
#[test]
fn a_resumed_run_with_trained_routers_matches_an_uninterrupted_one() {
    let ckpt = tiny_qwen3_moe();
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let run = |out: &TempDir, extra: &[&str]| {
        let mut args = vec![
            "max_steps_per_epoch=4",
            "save_adapter_weights_only=True",
            "~lr_scheduler",
            "model.train_router=True",
            checkpoint_dir.as_str(),
        ];
        args.extend(LORA_ON_EXPERTS);
        args.extend(extra);
        let run = tiny_lora(out, &args);
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
    };
    let losses = |out: &TempDir| {
        column(
            &read_metrics(&out.path().join("logs/metrics.jsonl")),
            "loss",
        )
    };
    let adapter = |out: &TempDir| {
        std::fs::read(out.path().join("epoch_1/adapter_model.safetensors")).unwrap()
    };
    let full = temp_dir("moe-router-resume-full");
    run(&full, &["epochs=2"]);
    let split = temp_dir("moe-router-resume-split");
    run(&split, &["epochs=1"]);
    run(&split, &["epochs=2", "resume_from_checkpoint=True"]);
    assert_eq!(losses(&full), losses(&split), "every step's loss");
    assert_eq!(adapter(&full), adapter(&split), "the final adapters");
}

/// gpt-oss's routers (`mlp.router`, weight and bias) train under LoRA when asked, are saved
/// under peft's keys for `modules_to_save: ["mlp.router"]`, and load back.
#[test]
fn gpt_oss_routers_train_under_lora_with_their_biases() {
    let ckpt = tiny_gpt_oss();
    let out = temp_dir("gpt-oss-lora-router");
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    run_recipe(
        "lora_finetune_single_device",
        "tiny/lora_single_device",
        &out,
        &[
            "model=tune.models.gpt_oss.lora_gpt_oss_tiny",
            "model.lora_attn_modules=[q_proj,v_proj]",
            "model.lora_rank=8",
            "model.lora_alpha=16",
            "model.train_router=True",
            &checkpoint_dir,
            "max_steps_per_epoch=4",
        ],
    );
    let epoch = out.path().join("epoch_0");
    let config = tune::model_io::peft::AdapterConfig::read(&epoch).unwrap();
    assert_eq!(config.modules_to_save(), ["mlp.router"]);
    let adapter = SafetensorsFile::open(&epoch.join("adapter_model.safetensors")).unwrap();
    for param in ["weight", "bias"] {
        let key = format!("base_model.model.model.layers.1.mlp.router.{param}");
        let saved = adapter.read(&key).unwrap();
        let name = format!("model.layers.1.mlp.router.{param}");
        assert!(
            saved.data != stored_f32(ckpt.path(), &name),
            "{name} did not train"
        );
        assert_eq!(
            saved.data,
            stored_f32(&epoch, &name),
            "{name}: the export's"
        );
    }
    adapter_sets_on_load(ckpt.path(), &epoch, "model.layers.1.mlp.router.bias");
}

/// Loading the adapter in `adapter_dir` onto the checkpoint in `base` sets tensor `name` to
/// the adapter's copy of it.
fn adapter_sets_on_load(base: &Path, adapter_dir: &Path, name: &str) {
    let mut model = load_model::<Cpu>(base, None, &Default::default())
        .unwrap()
        .model;
    tune::model_io::peft::load_adapter(&mut model, adapter_dir).unwrap();
    let loaded = model.hf_state_dict();
    let (_, value) = loaded.iter().find(|(n, _)| n == name).unwrap();
    let saved = SafetensorsFile::open(&adapter_dir.join("adapter_model.safetensors"))
        .unwrap()
        .read(&format!("base_model.model.{name}"))
        .unwrap();
    assert_eq!(value.data, saved.data, "loading the adapter sets {name}");
}

/// `train_router` on a dense model is refused by key at load; in validation, with LoRA DPO and
/// GRPO (whose reference is this model with the adapters off, where peft would switch the
/// routers back too), as `False` on a full builder (which trains them anyway) and on a frozen
/// teacher.
#[test]
fn train_router_where_it_cannot_work_is_refused_by_key() {
    let out = temp_dir("dense-router");
    let run = tiny_lora(&out, &["model.train_router=True"]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(
        stderr.contains("model.train_router") && stderr.contains("dense"),
        "{stderr}"
    );
    // (config, override, what the refusal says)
    for (config, key, says) in [
        (
            "tiny/lora_dpo_single_device",
            "model.train_router=True",
            "reference model",
        ),
        (
            "tiny/grpo_lora_single_device",
            "model.train_router=True",
            "reference model",
        ),
        // A full builder takes no LoRA settings: full fine-tuning trains the routers anyway.
        (
            "tiny/full_single_device",
            "model.train_router=False",
            "it is a setting of LoRA builders",
        ),
        // The tiny teacher's full builder takes no LoRA settings (a LoRA teacher's is refused
        // as not trained: config_validation).
        (
            "tiny/kd_lora_single_device",
            "teacher_model.train_router=True",
            "it is a setting of LoRA builders",
        ),
    ] {
        let run = tune(&["validate", config, key]);
        let stderr = String::from_utf8_lossy(&run.stderr);
        let named = key.split('=').next().unwrap();
        assert!(!run.status.success(), "{config} {key}");
        assert!(
            stderr.contains(named) && stderr.contains(says),
            "{config} {key}: {stderr}"
        );
    }
}

/// DoRA on experts would write magnitudes peft cannot load onto transformers' fused experts:
/// refused by key before training.
#[test]
fn dora_on_experts_is_refused_by_key() {
    let ckpt = tiny_qwen3_moe();
    let out = temp_dir("moe-dora");
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let run = tiny_lora(
        &out,
        &[
            &LORA_ON_EXPERTS[..],
            &["model.use_dora=True", &checkpoint_dir],
        ]
        .concat(),
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(
        stderr.contains("model.use_dora") && stderr.contains("apply_lora_to_mlp: False"),
        "{stderr}"
    );
}

/// Full fine-tuning trains every weight of a sparse model, routers included, and saves it as
/// it was loaded (the same names, shapes and dtypes).
#[test]
fn full_finetuning_a_moe_trains_its_routers_and_experts() {
    full_finetuning_trains(
        &tiny_qwen3_moe(),
        "tune.models.qwen3_moe.qwen3_moe_tiny",
        &[
            "model.layers.0.mlp.gate.weight",
            "model.layers.2.mlp.experts.3.up_proj.weight",
            "model.layers.1.mlp.up_proj.weight",
        ],
    );
}

/// A full fine-tuning run of `model` on `ckpt`: the loss falls, the save has the checkpoint's
/// names, and each of `trained` keeps its shape and changes.
fn full_finetuning_trains(ckpt: &TempDir, model: &str, trained: &[&str]) {
    let out = temp_dir("moe-full");
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let model = format!("model={model}");
    let metrics = run_recipe(
        "full_finetune_single_device",
        "tiny/full_single_device",
        &out,
        &[&model, &checkpoint_dir, "max_steps_per_epoch=25"],
    );
    let (first, last) = first_and_last_mean(&column(&metrics, "loss"));
    assert!(last < first, "loss {first} -> {last}");
    let (before, after) = (
        stored_tensors(ckpt.path()),
        stored_tensors(&out.path().join("epoch_0")),
    );
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>()
    );
    for name in trained {
        assert_eq!(before[*name].1, after[*name].1, "{name}: shape");
        assert!(before[*name] != after[*name], "{name} did not train");
    }
}

/// FSDP over two workers (each holding its rows of every expert and router) takes the same
/// steps as one device, and its sharded save is the Hub's layout, as the one-device save is.
#[test]
fn fsdp_on_a_moe_matches_one_device_and_saves_the_hub_layout() {
    let ckpt = tiny_qwen3_moe();
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let extra = [
        "model=tune.models.qwen3_moe.qwen3_moe_tiny",
        checkpoint_dir.as_str(),
    ];
    let (one, two) = crate::distributed::one_device_and_fsdp_agree("moe-fsdp", &extra, 4);
    let (a, b) = (
        stored_tensors(&one.path().join("epoch_0")),
        stored_tensors(&two.path().join("epoch_0")),
    );
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    assert!(a.contains_key("model.layers.2.mlp.experts.3.down_proj.weight"));
}

use tune::training::activation_checkpointing::Checkpointing;

const TRAIN: tune::modules::ForwardMode = tune::modules::ForwardMode {
    adapters: true,
    fake_quant: false,
    train: true,
};

/// The `qwen3_moe_aux` fixture: its reference, batch and model.
struct AuxFixture {
    r: Reference,
    tokens: Vec<u32>,
    labels: Vec<i64>,
    batch: usize,
    positions: Vec<u32>,
    model: tune::models::CausalLm<CpuAutodiff>,
}

impl AuxFixture {
    fn open() -> Self {
        let r = Reference::open("family-qwen3_moe_aux.safetensors");
        let (tokens, labels, batch) = r.tokens();
        let positions = positions(batch, tokens.len() / batch);
        let model = load_model::<CpuAutodiff>(
            &fixture("families/qwen3_moe_aux"),
            None,
            &Default::default(),
        )
        .unwrap()
        .model;
        Self {
            r,
            tokens,
            labels,
            batch,
            positions,
            model,
        }
    }

    fn input(&self) -> tune::models::TokenBatch<'_> {
        tune::models::TokenBatch {
            tokens: &self.tokens,
            positions: &self.positions,
            document_ids: None,
            continued_documents: None,
            left_padding: None,
            padding: None,
            images: None,
            batch: self.batch,
        }
    }
}

/// The gradient of every parameter summed over the backward passes `parts`.
fn summed_grads(
    model: &tune::models::CausalLm<CpuAutodiff>,
    parts: Vec<<CpuAutodiff as burn::tensor::backend::AutodiffBackend>::Gradients>,
) -> Vec<Vec<f32>> {
    let mut acc = tune::training::step::GradAccumulator::default();
    for g in parts {
        acc.add(model, g);
    }
    grad_values(model, acc.take())
}

/// `output_router_logits: true`: the loss is transformers' cross-entropy plus
/// `router_aux_loss_coef` times its load-balancing loss over both sparse layers' routers, and
/// every gradient (routers included) is that sum's.
#[test]
fn the_load_balancing_loss_matches_transformers() {
    let f = AuxFixture::open();
    let (r, labels, input, model) = (&f.r, f.labels.as_slice(), f.input(), f.model.clone());
    let tokens = &f.tokens;
    let coef =
        tune::training::load_balancing::aux_loss_coef(&model).expect("the config asks for it");
    assert_eq!(coef, 0.05);
    let (loss, aux, grads) = tune::training::sft::loss_with_aux_in_chunks(
        &model,
        input,
        labels,
        TRAIN,
        std::slice::from_ref(&(0..tokens.len())),
        (Checkpointing::Off, 7),
        1.0,
        coef,
    );
    assert!(grads.is_none(), "one chunk: the trainer back-propagates");
    let host = |t: &burn::tensor::Tensor<Cpu, 1>| tune::checkpoint::HostTensor::from_tensor(t);
    assert_close("aux_loss", &host(&aux), &r.f32("aux_loss"), 1e-5);
    assert_loss_and_grads_match(&model, loss, r);
}

/// The batch of reference `r` (`input_ids`, `labels`, `attention_mask`: 0 is padding), its
/// labels first changed by `edit` (given the row length).
fn padded_batch(r: &Reference, edit: impl FnOnce(&mut Vec<i64>, usize)) -> tune::data::Batch {
    let (tokens, mut labels, rows) = r.tokens();
    let seq = tokens.len() / rows;
    edit(&mut labels, seq);
    let padding: Vec<bool> = r.i64("attention_mask").iter().map(|&m| m == 0).collect();
    tune::data::Batch {
        position_ids: positions(rows, seq),
        num_trained_tokens: labels.iter().filter(|&&l| l != -100).count(),
        tokens,
        labels,
        document_ids: None,
        batch_size: rows,
        seq_len: seq,
        padding: Some(padding),
        images: None,
    }
}

/// `loss` is the reference's, and so is every gradient of it, one per parameter.
fn assert_loss_and_grads_match(
    model: &tune::models::CausalLm<CpuAutodiff>,
    loss: burn::tensor::Tensor<CpuAutodiff, 1>,
    r: &Reference,
) {
    use crate::grads::named_grads;
    let total = tune::checkpoint::HostTensor::from_tensor(&loss);
    assert_close("loss", &total, &r.f32("loss"), 1e-4);
    let grads = loss.backward();
    let named = model.to_hf_layout(named_grads(model, &grads));
    assert_eq!(named.len(), r.grad_count(), "one gradient per parameter");
    for (name, grad) in named {
        assert_grad_close(&name, &grad, &r.f32(&format!("grad.{name}")));
    }
}

/// Padding leaves the load-balancing loss as transformers' `attention_mask` leaves it: a
/// right-padded row's tail (`TokenBatch::padding`) adds nothing to the router statistics, so
/// the loss, `aux_loss` and every gradient match transformers' on a padded batch; counting the
/// padding gives another `aux_loss`.
#[test]
fn the_load_balancing_loss_leaves_padding_out_as_transformers_does() {
    let f = AuxFixture::open();
    let r = Reference::open("family-qwen3_moe_aux-padded.safetensors");
    let (tokens, labels, batch) = r.tokens();
    let padding: Vec<bool> = r.i64("attention_mask").iter().map(|&m| m == 0).collect();
    assert!(padding.contains(&true));
    let positions = positions(batch, tokens.len() / batch);
    let model = f.model.clone();
    let input = |padding| tune::models::TokenBatch {
        tokens: &tokens,
        positions: &positions,
        document_ids: None,
        continued_documents: None,
        left_padding: None,
        padding,
        images: None,
        batch,
    };
    let run = |padding| {
        tune::training::sft::loss_with_aux_in_chunks(
            &model,
            input(padding),
            &labels,
            TRAIN,
            std::slice::from_ref(&(0..tokens.len())),
            (Checkpointing::Off, 7),
            1.0,
            0.05,
        )
    };
    let host = |t: &burn::tensor::Tensor<Cpu, 1>| tune::checkpoint::HostTensor::from_tensor(t);
    let (_, counted, _) = run(None);
    let counted = host(&counted).data[0];
    let (loss, aux, _) = run(Some(&padding));
    assert_close("aux_loss", &host(&aux), &r.f32("aux_loss"), 1e-5);
    assert!(
        (counted - r.f32("aux_loss").data[0]).abs() > 1e-4,
        "counting the padding changes aux_loss ({counted})"
    );
    assert_loss_and_grads_match(&model, loss, &r);
}

/// The SFT step's padding-free packs keep every real token of a model that adds the
/// load-balancing loss, labelled or not: the same loss, `aux_loss` and gradients as the padded
/// batch as transformers lays it out, where packs through the last counted label alone would
/// leave a row's untrained tail out of the router statistics.
#[test]
fn padding_free_packs_keep_every_token_the_load_balancing_loss_counts() {
    use tune::training::LossStep;
    use tune::training::sft::SftLoss;
    let f = AuxFixture::open();
    let r = Reference::open("family-qwen3_moe_aux-padded.safetensors");
    // Row 0's last three tokens train nothing (a trailing untrained turn).
    let batch = padded_batch(&r, |labels, seq| labels[seq - 3..seq].fill(-100));
    assert!(tune::training::sft::padding_free(&f.model, &batch).is_some());
    let model = f.model.clone();
    let info = tune::training::StepInfo {
        epoch: 0,
        global_step: 0,
        seed: 7,
    };
    let step = |padding_free| {
        let mut sft = SftLoss {
            padding_free,
            ..SftLoss::default()
        };
        let out = LossStep::<CpuAutodiff>::step(&mut sft, &model, &batch, info).unwrap();
        let aux = out
            .metrics
            .iter()
            .find(|(k, _)| *k == "aux_loss")
            .map(|(_, v)| v.clone().into_scalar())
            .expect("aux_loss logged");
        let loss: f32 = out.loss.clone().into_scalar();
        let parts = out.grads.unwrap_or_else(|| vec![out.loss.backward()]);
        (loss, aux, summed_grads(&model, parts))
    };
    let (loss, aux, grads) = step(false);
    let (packed_loss, packed_aux, packed_grads) = step(true);
    assert!((aux - packed_aux).abs() < 1e-6, "{aux} vs {packed_aux}");
    assert!((loss - packed_loss).abs() < 1e-5, "{loss} vs {packed_loss}");
    assert_same_grads(&grads, &packed_grads);
}

/// With the output projection frozen (LoRA) and computed in chunks, the load-balancing term
/// goes back with the body's pass: the same loss and gradients as in one piece, and not those
/// of the cross-entropy alone.
#[test]
fn the_load_balancing_loss_is_the_same_in_chunks() {
    let f = AuxFixture::open();
    let (labels, input, mut model) = (f.labels.as_slice(), f.input(), f.model.clone());
    let tokens = &f.tokens;
    let settings = tune::modules::LoraSettings {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        dora: false,
    };
    let targets = ["q_proj", "v_proj", "gate_proj"].map(String::from);
    assert!(!tune::models::adapters::attach_lora(&mut model, &targets, &settings, 5).is_empty());
    let model = model.set_trainable(tune::models::Trainable::AdaptersOnly);
    let sum = |parts| summed_grads(&model, parts);
    let weight = 3.0;
    let run = |chunks: &[std::ops::Range<usize>], coef: f64| {
        let passes = (Checkpointing::Off, 7);
        let (loss, _, grads) = tune::training::sft::loss_with_aux_in_chunks(
            &model, input, labels, TRAIN, chunks, passes, weight, coef,
        );
        let value: f32 = loss.clone().into_scalar();
        let parts = grads.unwrap_or_else(|| vec![(loss * weight).backward()]);
        (value, sum(parts))
    };
    let rows = tokens.len();
    let (plain_loss, plain) = run(std::slice::from_ref(&(0..rows)), 0.05);
    let (chunked_loss, chunked) = run(&[0..5, 5..13, 13..rows], 0.05);
    assert!(
        (plain_loss - chunked_loss).abs() < 1e-5,
        "{plain_loss} vs {chunked_loss}"
    );
    assert_same_grads(&plain, &chunked);
    let (_, without) = run(&[0..5, 5..13, 13..rows], 0.0);
    let differs = plain
        .iter()
        .zip(&without)
        .any(|(a, b)| a.iter().zip(b).any(|(x, y)| (x - y).abs() > 1e-7));
    assert!(differs, "the load-balancing term reaches the adapters");
}

fn with_aux_loss() -> TempDir {
    tiny_qwen3_moe_with(json!({"output_router_logits": true, "router_aux_loss_coef": 0.02}))
}

/// A full fine-tune of a checkpoint that asks for the load-balancing loss logs it beside the
/// loss (which includes it), and trains.
#[test]
fn a_run_with_the_load_balancing_loss_logs_it_and_trains() {
    let ckpt = with_aux_loss();
    let out = temp_dir("moe-aux");
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let metrics = run_recipe(
        "full_finetune_single_device",
        "tiny/full_single_device",
        &out,
        &[
            "model=tune.models.qwen3_moe.qwen3_moe_tiny",
            &checkpoint_dir,
            "max_steps_per_epoch=20",
        ],
    );
    let aux = column(&metrics, "aux_loss");
    assert_eq!(aux.len(), 20, "aux_loss logged every step");
    // perfectly balanced routing gives experts x sum_e (k / E)(1 / E) = k = 2
    assert!(aux.iter().all(|a| *a >= 1.0 && *a < 4.0), "{aux:?}");
    let (first, last) = first_and_last_mean(&column(&metrics, "loss"));
    assert!(last < first, "loss {first} -> {last}");
}

/// TRL's DPO with the load-balancing loss: the sigmoid loss of the pairs plus
/// `router_aux_loss_coef` times the policy forward's `aux_loss` over the batch's real tokens
/// (both halves, padding out). The loss, `aux_loss` and every gradient match TRL's computation
/// (family-qwen3_moe_aux-dpo.safetensors), and layer by layer (activation checkpointing) the
/// step takes the same gradients.
#[test]
fn dpo_adds_the_load_balancing_loss_as_trl_does() {
    use tune::training::LossStep;
    use tune::training::dpo::{DpoLoss, DpoReference, DpoSettings};
    let f = AuxFixture::open();
    let r = Reference::open("family-qwen3_moe_aux-dpo.safetensors");
    let batch = padded_batch(&r, |_, _| ());
    let model = f.model.clone();
    let info = tune::training::StepInfo {
        epoch: 0,
        global_step: 0,
        seed: 7,
    };
    let step = |checkpointing| {
        let reference = DpoReference::Frozen(Box::new(burn::module::AutodiffModule::valid(&model)));
        let settings = DpoSettings {
            beta: 0.1,
            label_smoothing: 0.0,
        };
        let mut dpo = DpoLoss::new(settings, reference);
        dpo.activation_checkpointing = checkpointing;
        dpo.step(&model, &batch, info).unwrap()
    };
    let out = step(Checkpointing::Off);
    assert_eq!(out.weight, 2, "two pairs");
    let aux = out
        .metrics
        .iter()
        .find(|(k, _)| *k == "aux_loss")
        .map(|(_, v)| HostTensor::from_tensor(v))
        .expect("aux_loss logged");
    assert_close("aux_loss", &aux, &r.f32("aux_loss"), 1e-5);
    assert!(out.grads.is_none(), "the trainer back-propagates");
    assert_loss_and_grads_match(&model, out.loss, &r);

    let again = step(Checkpointing::Off).loss;
    let plain = summed_grads(&model, vec![(again * 2.0).backward()]);

    let layered = step(Checkpointing::Layers);
    let loss: f32 = layered.loss.into_scalar();
    assert!((loss - r.f32("loss").data[0]).abs() < 1e-4, "{loss}");
    let parts = layered
        .grads
        .expect("per-layer passes compute the gradients");
    assert_same_grads(&plain, &summed_grads(&model, parts));
}

/// LoRA DPO, GRPO and KD runs of a checkpoint that asks for the load-balancing loss log it
/// every step (and DPO's loss, which includes it, falls).
#[test]
fn dpo_grpo_and_kd_runs_log_the_load_balancing_loss() {
    let ckpt = with_aux_loss();
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let out = temp_dir("moe-aux-dpo");
    let metrics = run_recipe(
        "lora_dpo_single_device",
        "tiny/lora_dpo_single_device",
        &out,
        &[
            &checkpoint_dir,
            "model=tune.models.qwen3_moe.lora_qwen3_moe_tiny",
            "max_steps_per_epoch=4",
        ],
    );
    let aux = column(&metrics, "aux_loss");
    assert_eq!(
        aux.len(),
        column(&metrics, "loss").len(),
        "aux_loss logged every step"
    );
    assert!(aux.iter().all(|a| *a >= 1.0 && *a < 4.0), "{aux:?}");
    let (first, last) = first_and_last_mean(&column(&metrics, "loss"));
    assert!(last < first, "loss {first} -> {last}");

    let out = temp_dir("moe-aux-grpo");
    let metrics = run_recipe(
        "grpo_lora_finetune_single_device",
        "tiny/grpo_lora_single_device",
        &out,
        &[
            &checkpoint_dir,
            "model=tune.models.qwen3_moe.lora_qwen3_moe_tiny",
            "num_steps=3",
        ],
    );
    let aux = column(&metrics, "aux_loss");
    assert_eq!(aux.len(), 3, "aux_loss logged every step");
    assert!(aux.iter().all(|a| *a >= 1.0 && *a < 4.0), "{aux:?}");

    // KD: the student's term, as its SFT step adds it (the teacher is dense).
    let out = temp_dir("moe-aux-kd");
    let metrics = run_recipe(
        "knowledge_distillation_single_device",
        "tiny/kd_lora_single_device",
        &out,
        &[
            &checkpoint_dir,
            "model=tune.models.qwen3_moe.lora_qwen3_moe_tiny",
            "epochs=1",
            "max_steps_per_epoch=3",
        ],
    );
    let aux = column(&metrics, "aux_loss");
    assert_eq!(aux.len(), 3, "aux_loss logged every step");
    assert!(aux.iter().all(|a| *a >= 1.0 && *a < 4.0), "{aux:?}");
}

/// Per-layer backward passes (activation checkpointing) take the load-balancing loss's
/// gradient layer by layer: the same loss, `aux_loss` and gradients as one pass.
#[test]
fn the_load_balancing_loss_takes_the_same_gradients_layer_by_layer() {
    let f = AuxFixture::open();
    let (labels, model) = (f.labels.as_slice(), f.model.clone());
    // Also with the second row's last 6 positions flagged as padding.
    let seq = f.tokens.len() / f.batch;
    let padded: Vec<bool> = (0..f.tokens.len()).map(|i| i >= 2 * seq - 6).collect();
    for padding in [None, Some(padded.as_slice())] {
        let input = tune::models::TokenBatch {
            padding,
            ..f.input()
        };
        layer_by_layer_agrees(&model, input, labels);
    }
}

fn layer_by_layer_agrees(
    model: &tune::models::CausalLm<CpuAutodiff>,
    input: tune::models::TokenBatch<'_>,
    labels: &[i64],
) {
    let weight = 2.0;
    let run = |checkpointing| {
        let (loss, aux, grads) = tune::training::sft::loss_with_aux(
            model,
            input,
            labels,
            TRAIN,
            (checkpointing, 1),
            (7, weight),
            0.05,
        );
        let value: f32 = loss.clone().into_scalar();
        let aux: f32 = aux.into_scalar();
        let parts = grads.unwrap_or_else(|| vec![(loss * weight).backward()]);
        (value, aux, summed_grads(model, parts))
    };
    let (loss, aux, plain) = run(Checkpointing::Off);
    let (loss_layers, aux_layers, layered) = run(Checkpointing::Layers);
    assert!((loss - loss_layers).abs() < 1e-5, "{loss} vs {loss_layers}");
    assert!((aux - aux_layers).abs() < 1e-6, "{aux} vs {aux_layers}");
    assert_same_grads(&plain, &layered);
}

/// FSDP over two workers with the load-balancing loss takes one device's steps, and both log
/// `aux_loss`.
#[test]
fn fsdp_with_the_load_balancing_loss_matches_one_device() {
    let ckpt = with_aux_loss();
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let extra = [
        "model=tune.models.qwen3_moe.qwen3_moe_tiny",
        checkpoint_dir.as_str(),
    ];
    let (one, two) = crate::distributed::one_device_and_fsdp_agree("moe-aux-fsdp", &extra, 3);
    let metrics = |dir: &TempDir| read_metrics(&dir.path().join("logs/metrics.jsonl"));
    let (a, b) = (metrics(&one), metrics(&two));
    assert_eq!(column(&a, "aux_loss").len(), 3);
    assert_eq!(column(&b, "aux_loss").len(), 3);
}

/// gpt-oss as the Hub's release stores it, its experts' weights in MXFP4 (`*_blocks` and
/// `*_scales`): they dequantize to what transformers' `convert_moe_packed_tensors` gives, the
/// logits are those of the dequantized model, and a save writes plain weights under a
/// config.json without the MXFP4 `quantization_config` (transformers would look for blocks).
#[test]
fn gpt_oss_mxfp4_experts_dequantize_as_transformers_does() {
    let src = fixture("families/gpt_oss_mxfp4");
    let r = Reference::open("family-gpt_oss_mxfp4.safetensors");
    let lm = load_model::<Cpu>(&src, None, &Default::default())
        .unwrap()
        .model;
    let saved: std::collections::BTreeMap<String, HostTensor> =
        lm.hf_state_dict().into_iter().collect();
    for layer in 0..2 {
        for name in ["gate_up_proj", "down_proj"] {
            let name = format!("model.layers.{layer}.mlp.experts.{name}");
            let want = r.f32(&format!("weight.{name}"));
            assert_eq!(saved[&name].shape, want.shape, "{name}");
            assert_eq!(saved[&name].data, want.data, "{name}");
        }
    }
    let tokens: Vec<u32> = r.i64("input_ids").iter().map(|&t| t as u32).collect();
    let batch = r.0.shape("input_ids").unwrap()[0];
    let logits = |lm: &tune::models::CausalLm<Cpu>| {
        HostTensor::from_tensor(&forward_rows(lm, &tokens, batch, Default::default()))
    };
    assert_close("logits", &logits(&lm), &r.f32("logits"), 1e-4);
    let out = temp_dir("gpt-oss-mxfp4-save");
    save_model(
        &lm,
        out.path(),
        Some(&src),
        StorageDtype::F32,
        DEFAULT_MAX_SHARD_BYTES,
    )
    .unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
            .unwrap();
    assert!(config.get("quantization_config").is_none(), "{config}");
    let written = stored_tensors(out.path());
    assert!(written.contains_key("model.layers.0.mlp.experts.gate_up_proj"));
    assert!(
        !written
            .keys()
            .any(|k| k.ends_with("_blocks") || k.ends_with("_scales"))
    );
    let reloaded = load_model::<Cpu>(out.path(), None, &Default::default())
        .unwrap()
        .model;
    assert_close(
        "reloaded logits",
        &logits(&reloaded),
        &r.f32("logits"),
        1e-4,
    );
}

/// A gpt-oss checkpoint the tiny tokenizer fits, saved as transformers saves one (experts
/// fused): 2 layers (sliding, then full), 4 experts of which each token takes 2, attention
/// sinks, YaRN.
fn tiny_gpt_oss() -> TempDir {
    tiny_gpt_oss_with(json!({}))
}

/// [`tiny_gpt_oss`] with `extra`'s config.json keys.
fn tiny_gpt_oss_with(extra: serde_json::Value) -> TempDir {
    let mut config = json!({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "sliding_window": 16,
        "num_local_experts": 4, "num_experts_per_tok": 2, "swiglu_limit": 7.0,
        "attention_bias": true, "tie_word_embeddings": false, "bos_token_id": 2000,
        "eos_token_id": 2004, "pad_token_id": 2005, "torch_dtype": "float32",
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": false, "original_max_position_embeddings": 128},
        "rope_theta": 150000.0
    });
    overridden(&mut config, extra);
    saved_random(config, 5, "tiny-gpt-oss")
}

/// LoRA on gpt-oss adapts its attention projections and, with `apply_lora_to_mlp`, its fused
/// experts as peft's `target_parameters` does (one stacked adapter per parameter and layer),
/// and the loss falls; the merged export changes q, v and the experts' two fused weights only
/// (routers, sinks and biases exactly as loaded). Dropout there is refused by key, as peft
/// refuses it.
#[test]
fn lora_on_gpt_oss_adapts_attention_and_fused_experts() {
    let ckpt = tiny_gpt_oss();
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let lora = |dropout: &str, steps: &str| {
        vec![
            "model=tune.models.gpt_oss.lora_gpt_oss_tiny".to_string(),
            "model.lora_attn_modules=[q_proj,v_proj]".into(),
            "model.apply_lora_to_mlp=True".into(),
            "model.lora_rank=8".into(),
            "model.lora_alpha=16".into(),
            format!("model.lora_dropout={dropout}"),
            checkpoint_dir.clone(),
            format!("max_steps_per_epoch={steps}"),
        ]
    };
    let refused_out = temp_dir("gpt-oss-lora-dropout");
    let args = lora("0.1", "2");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = tiny_lora(&refused_out, &args);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(
        stderr.contains("model.lora_dropout") && stderr.contains("fused experts"),
        "{stderr}"
    );

    let out = temp_dir("gpt-oss-lora");
    let args = lora("0.0", "25");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let metrics = run_recipe(
        "lora_finetune_single_device",
        "tiny/lora_single_device",
        &out,
        &args,
    );
    let (first, last) = first_and_last_mean(&column(&metrics, "loss"));
    assert!(last < first, "loss {first} -> {last}");
    let epoch = out.path().join("epoch_0");
    let adapter = SafetensorsFile::open(&epoch.join("adapter_model.safetensors")).unwrap();
    // 2 layers x (q, v, gate_up, down) x (A, B); experts stacked as peft stacks them
    assert_eq!(adapter.names().len(), 2 * 4 * 2, "{:?}", adapter.names());
    let gate_up_b = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight";
    assert_eq!(adapter.shape(gate_up_b), Some(vec![2 * 64, 8 * 4]));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(epoch.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        config["target_parameters"],
        json!(["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    );
    assert_eq!(config["target_modules"], json!(["q_proj", "v_proj"]));
    let (before, after) = (stored_tensors(ckpt.path()), stored_tensors(&epoch));
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>()
    );
    for (name, tensor) in &before {
        let adapted = [
            "q_proj.weight",
            "v_proj.weight",
            "experts.gate_up_proj",
            "experts.down_proj",
        ]
        .iter()
        .any(|suffix| name.ends_with(suffix));
        assert_eq!(after[name] == *tensor, !adapted, "{name}");
    }
}

/// A peft adapter on gpt-oss's fused experts (`target_parameters`: one stacked pair of factors
/// per parameter for all the experts) loads onto each expert: the adapted model's logits, loss
/// and every adapter gradient are peft's (family-gpt_oss-lora.safetensors, random factors), and
/// saved back it is peft's tensors under peft's keys.
#[test]
fn a_peft_adapter_on_gpt_oss_fused_experts_computes_as_peft_does() {
    use tune::model_io::peft::{self, peft_key};
    use tune::model_io::peft_experts::{self, FusedParam};
    let r = Reference::open("family-gpt_oss-lora.safetensors");
    let dir = fixture("families/gpt_oss-lora");
    let mut model =
        load_model::<CpuAutodiff>(&fixture("families/gpt_oss"), None, &Default::default())
            .unwrap()
            .model;
    let config = peft::load_adapter(&mut model, &dir).unwrap();
    assert_eq!(config.target_parameters().len(), 2);
    let mut model = model.set_trainable(tune::models::Trainable::AdaptersOnly);

    let saved = SafetensorsFile::open(&dir.join("adapter_model.safetensors")).unwrap();
    let written = peft::adapter_state_dict(&mut model);
    assert_eq!(written.len(), saved.names().len(), "every tensor, once");
    for (name, tensor) in &written {
        assert_eq!(*tensor, saved.read(name).unwrap(), "{name} round trip");
    }

    let (tokens, labels, batch) = r.tokens();
    let positions = positions(batch, tokens.len() / batch);
    let input = tune::models::TokenBatch {
        tokens: &tokens,
        positions: &positions,
        document_ids: None,
        continued_documents: None,
        left_padding: None,
        padding: None,
        images: None,
        batch,
    };
    let logits = model.forward(input, TRAIN);
    assert_close(
        "logits",
        &HostTensor::from_tensor(&logits),
        &r.f32("logits"),
        1e-4,
    );
    let loss = tune::training::loss::cross_entropy(logits, &labels);
    assert_close(
        "loss",
        &HostTensor::from_tensor(&loss),
        &r.f32("loss"),
        1e-5,
    );
    let grads = loss.backward();
    let grad = |p: &burn::module::Param<burn::tensor::Tensor<CpuAutodiff, 2>>| {
        HostTensor::from_tensor(&p.val().grad(&grads).expect("an adapter trains"))
    };
    let mut checked = 0;
    let mut check = |key: String, got: HostTensor| {
        assert_grad_close(&key, &got, &r.f32(&format!("grad.{key}")));
        checked += 1;
    };
    for (i, layer) in model.model.layers.iter().enumerate() {
        for (name, linear) in [
            ("q_proj", &layer.self_attn.q_proj),
            ("v_proj", &layer.self_attn.v_proj),
        ] {
            let lora = linear.lora.as_ref().expect("q and v adapted");
            let module = format!("model.layers.{i}.self_attn.{name}");
            check(peft_key(&module, 'A'), grad(&lora.a));
            check(peft_key(&module, 'B'), grad(&lora.b));
        }
        let experts = &layer
            .moe
            .as_ref()
            .expect("every gpt-oss layer is sparse")
            .experts;
        let module = peft_experts::experts_module(i);
        for param in FusedParam::ALL {
            let per_expert: Vec<_> = experts
                .iter()
                .map(|mlp| {
                    let lora = match param {
                        FusedParam::GateUp => mlp.lora.as_ref(),
                        FusedParam::Down => mlp.down_proj.lora.as_ref(),
                    };
                    let lora = lora.expect("every expert adapted");
                    (grad(&lora.a), grad(&lora.b))
                })
                .collect();
            let (a, b) = peft_experts::stack(&per_expert);
            check(peft_experts::key(&module, param, &FusedParam::ALL, 'A'), a);
            check(peft_experts::key(&module, param, &FusedParam::ALL, 'B'), b);
        }
    }
    assert_eq!(checked, r.grad_count(), "one gradient per adapter tensor");
}

/// A `target_parameters` adapter tune cannot load as peft would is refused naming the key:
/// with dropout (peft's `ParamWrapper` refuses it), or onto a model whose experts are not fused
/// parameters.
#[test]
fn target_parameters_adapters_tune_cannot_load_are_refused_by_key() {
    let src = fixture("families/gpt_oss-lora");
    let dir = temp_dir("gpt-oss-lora-dropout-adapter");
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let path = dir.path().join("adapter_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["lora_dropout"] = json!(0.1);
    std::fs::write(&path, config.to_string()).unwrap();
    let load = |base: &str| {
        let mut model =
            load_model::<crate::support::Cpu>(&fixture(base), None, &Default::default())
                .unwrap()
                .model;
        tune::model_io::peft::load_adapter(&mut model, dir.path())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let e = load("families/gpt_oss");
    assert!(
        e.contains("lora_dropout") && e.contains("adapter_config.json"),
        "{e}"
    );
    config["lora_dropout"] = json!(0.0);
    std::fs::write(&path, config.to_string()).unwrap();
    let e = load("tiny-llama");
    assert!(e.contains("target_parameters"), "{e}");
}

/// Full fine-tuning trains every gpt-oss weight (sinks, routers with their biases, the fused
/// experts) and saves it in the layout it was loaded from.
#[test]
fn full_finetuning_gpt_oss_trains_sinks_routers_and_fused_experts() {
    full_finetuning_trains(
        &tiny_gpt_oss(),
        "tune.models.gpt_oss.gpt_oss_tiny",
        &[
            "model.layers.0.self_attn.sinks",
            "model.layers.1.mlp.router.weight",
            "model.layers.1.mlp.router.bias",
            "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj_bias",
        ],
    );
}

/// QAT's int4 export would write gpt-oss's fused experts in float, unlike the fake-quantized
/// experts that trained: refused by key before training, as is `tune quantize`.
#[test]
fn the_int4_export_of_gpt_oss_is_refused_by_key() {
    let ckpt = tiny_gpt_oss();
    let out = temp_dir("gpt-oss-qat");
    let output_dir = format!("output_dir={}", out.path().display());
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let stderr = tune_refuses(&[
        "run",
        "qat_single_device",
        "--config",
        "tiny/qat_single_device",
        &output_dir,
        &checkpoint_dir,
        "model=tune.models.gpt_oss.gpt_oss_tiny",
    ]);
    assert!(
        stderr.contains("quantizer") && stderr.contains("\"gpt_oss\""),
        "{stderr}"
    );
    let steps = std::fs::read_to_string(out.path().join("logs/metrics.jsonl")).unwrap_or_default();
    assert!(
        !steps.contains("\"loss\""),
        "trained before refusing: {steps}"
    );
}

/// FSDP over two processes on gpt-oss: the fused experts load whole on each rank and are
/// sharded after (sinks and router biases among the sharded weights); the steps are one
/// device's, and the gathered save is the fused layout the checkpoint came in.
#[test]
fn fsdp_on_gpt_oss_matches_one_device_and_saves_the_fused_layout() {
    let ckpt = tiny_gpt_oss();
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let extra = [
        "model=tune.models.gpt_oss.gpt_oss_tiny",
        checkpoint_dir.as_str(),
    ];
    let (_, two) = crate::distributed::one_device_and_fsdp_agree("gpt-oss-fsdp", &extra, 3);
    let saved = stored_tensors(&two.path().join("epoch_0"));
    let source = stored_tensors(ckpt.path());
    assert_eq!(
        saved.keys().collect::<Vec<_>>(),
        source.keys().collect::<Vec<_>>()
    );
}

/// LoRA on gpt-oss's fused experts under FSDP (2 workers, the experts' adapters sharded with
/// the layer) takes one device's steps, and rank 0 saves the same peft adapter.
#[test]
fn fsdp_lora_on_gpt_oss_experts_matches_one_device() {
    let ckpt = tiny_gpt_oss();
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let extra = [
        "model=tune.models.gpt_oss.lora_gpt_oss_tiny",
        "model.lora_attn_modules=[q_proj,v_proj]",
        "model.apply_lora_to_mlp=True",
        "model.lora_dropout=0.0",
        checkpoint_dir.as_str(),
    ];
    let (one, two) = crate::distributed::recipes_on_one_device_and_fsdp_agree(
        "gpt-oss-lora",
        crate::distributed::LORA_RECIPES,
        &extra,
        3,
    );
    let adapter = |dir: &TempDir| {
        SafetensorsFile::open(&dir.path().join("epoch_0/adapter_model.safetensors")).unwrap()
    };
    let (a, b) = (adapter(&one), adapter(&two));
    assert_eq!(a.names().len(), 16);
    for name in a.names() {
        let (x, y) = (a.read(&name).unwrap(), b.read(&name).unwrap());
        assert_close(&name, &x, &y, 1e-5);
    }
}

/// FSDP's per-rank load of gpt-oss: each rank of 3 holds only its rows of every weight, the
/// fused experts included (read an expert at a time; MXFP4 dequantized per expert), and those
/// are exactly the rows of the whole load's; the shards record every weight's whole shape.
#[test]
fn each_rank_loads_only_its_rows_of_gpt_oss_fused_experts() {
    for source in ["families/gpt_oss", "families/gpt_oss_mxfp4"] {
        let names = crate::dcp::each_rank_holds_its_rows(source, source, 3);
        let experts = names.iter().filter(|n| n.contains(".experts.")).count();
        // 2 layers x 4 experts x (gate, up, down) x (weight, bias)
        assert_eq!(experts, 2 * 4 * 3 * 2, "{source}");
    }
}

/// QLoRA on gpt-oss with adapters on its fused experts, under FSDP (2 workers, each expert's
/// NF4 rows quantized from the expert's whole weight as one device quantizes it): one device's
/// losses. The model is sized for NF4 (every decoder linear 16384 values).
#[test]
fn fsdp_qlora_on_gpt_oss_experts_matches_one_device() {
    let ckpt = tiny_gpt_oss_with(json!({
        "hidden_size": 128, "intermediate_size": 128, "num_key_value_heads": 4, "head_dim": 32
    }));
    let checkpoint_dir = format!("checkpointer.checkpoint_dir={}", ckpt.path().display());
    let extra = [
        "model=tune.models.gpt_oss.qlora_gpt_oss_tiny",
        "model.lora_attn_modules=[q_proj,v_proj]",
        "model.apply_lora_to_mlp=True",
        "model.lora_dropout=0.0",
        checkpoint_dir.as_str(),
    ];
    crate::distributed::recipes_on_one_device_and_fsdp_agree(
        "gpt-oss-qlora",
        crate::distributed::LORA_RECIPES,
        &extra,
        3,
    );
}

/// An MXFP4 checkpoint missing one expert weight's scales is refused at load, naming the
/// tensor, rather than read with made-up scales.
#[test]
fn an_mxfp4_checkpoint_missing_its_scales_is_refused_naming_them() {
    let src = fixture("families/gpt_oss_mxfp4");
    let dir = temp_dir("gpt-oss-mxfp4-broken");
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let missing = "model.layers.1.mlp.experts.down_proj_scales";
    let mut kept = stored_tensors(&src);
    kept.remove(missing).expect("the fixture has it");
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = kept
        .iter()
        .map(|(name, (dtype, shape, bytes))| {
            let dtype = match dtype.as_str() {
                "U8" => safetensors::Dtype::U8,
                _ => safetensors::Dtype::F32,
            };
            let view = safetensors::tensor::TensorView::new(dtype, shape.clone(), bytes).unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    let err = match load_model::<Cpu>(dir.path(), None, &Default::default()) {
        Ok(_) => panic!("loaded without {missing}"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains(missing), "{err}");
}
