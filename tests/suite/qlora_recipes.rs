//! QLoRA end to end through the binary, on tests/fixtures/tiny-llama-nf4 (the shipped tiny
//! model's linears are too small for NF4): training lowers the loss and writes a PEFT adapter
//! plus a merged model in the checkpoint's bf16; a resumed run equals an uninterrupted one;
//! `generate` applies the adapter to the NF4 base; DPO, distillation, bf16 and two workers
//! train a QLoRA policy; the shipped tiny model is refused with torchao's rule.

use crate::support;

use std::path::Path;

use support::*;
use tune::checkpoint::safetensors_io::SafetensorsFile;

fn nf4_dir() -> String {
    fixture("tiny-llama-nf4").display().to_string()
}

/// Overrides that turn a tiny LoRA config into QLoRA on the NF4-compatible fixture model.
fn qlora(extra: &[&str]) -> Vec<String> {
    let mut v = vec![
        "model._component_=tune.models.llama3.qlora_llama3_tiny".to_string(),
        format!("checkpointer.checkpoint_dir={}", nf4_dir()),
    ];
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn run(recipe: &str, config: &str, out: &TempDir, extra: &[&str]) -> std::process::Output {
    let output_dir = format!("output_dir={}", out.path().display());
    let overrides = qlora(extra);
    let mut args = vec!["run", recipe, "--config", config, output_dir.as_str()];
    args.extend(overrides.iter().map(String::as_str));
    tune_ok(&args)
}

fn losses(dir: &Path) -> Vec<f64> {
    column(&read_metrics(&dir.join("logs/metrics.jsonl")), "loss")
}

const STEPS: &[&str] = &[
    "max_steps_per_epoch=8",
    "batch_size=2",
    "~lr_scheduler",
    "optimizer.lr=3e-3",
];

#[test]
fn qlora_trains_saves_a_merged_bf16_model_resumes_exactly_and_generates() {
    let full = temp_dir("qlora-full");
    let mut extra = STEPS.to_vec();
    extra.push("epochs=2");
    let out = run(
        "lora_finetune_single_device",
        "tiny/lora_single_device",
        &full,
        &extra,
    );
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!log.contains("not supported"), "{log}");
    let loss = losses(full.path());
    assert_eq!(loss.len(), 16);
    assert!(
        mean(&loss[12..]) < mean(&loss[..4]) - 0.3,
        "QLoRA's loss should fall: {loss:?}"
    );

    // The merged export: bf16 as the checkpoint, NF4 bases dequantized as torchtune saves them
    // (k_proj carries no adapter, so it is exactly that).
    let ckpt = full.path().join("epoch_1");
    let merged =
        tune::checkpoint::safetensors_io::SafetensorsFile::open(&ckpt.join("model.safetensors"))
            .unwrap();
    let k = "model.layers.1.self_attn.k_proj.weight";
    assert_eq!(
        merged.dtype(k),
        Some(safetensors::Dtype::BF16),
        "saved in the checkpoint's dtype"
    );
    let base = tune::model_io::hf::load_model_with::<Cpu>(
        &fixture("tiny-llama-nf4"),
        None,
        &Default::default(),
        tune::models::BaseWeights::Nf4(tune::modules::nf4::Nf4Dtype::F32),
    )
    .unwrap()
    .model;
    let want = base
        .hf_state_dict()
        .into_iter()
        .find(|(n, _)| n == k)
        .unwrap()
        .1;
    assert_eq!(merged.read(k).unwrap().data, want.data, "{k}");
    let adapter = tune::checkpoint::safetensors_io::SafetensorsFile::open(
        &ckpt.join("adapter_model.safetensors"),
    )
    .unwrap();
    assert_eq!(
        adapter.shape("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"),
        Some(vec![256, 8])
    );

    // Stopped after one epoch and resumed: every loss and the adapter bit-identical.
    let split = temp_dir("qlora-split");
    let mut first = STEPS.to_vec();
    first.push("epochs=1");
    run(
        "lora_finetune_single_device",
        "tiny/lora_single_device",
        &split,
        &first,
    );
    let mut second = STEPS.to_vec();
    second.extend(["epochs=2", "resume_from_checkpoint=True"]);
    run(
        "lora_finetune_single_device",
        "tiny/lora_single_device",
        &split,
        &second,
    );
    assert_eq!(losses(split.path()), loss, "resumed losses");
    let adapter_bytes = |dir: &Path| std::fs::read(dir.join("epoch_1/adapter_model.safetensors"));
    assert_eq!(
        adapter_bytes(split.path()).unwrap(),
        adapter_bytes(full.path()).unwrap()
    );

    // generate: the adapter on the NF4 base, as the library computes it.
    let adapter_dir = format!("adapter_dir={}", ckpt.display());
    let overrides = qlora(&[
        adapter_dir.as_str(),
        "prompt.user=Give three tips for staying healthy.",
        "max_new_tokens=8",
        "temperature=0",
    ]);
    let mut args = vec!["run", "generate", "--config", "tiny/generation"];
    args.extend(overrides.iter().map(String::as_str));
    let out = tune_ok(&args);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!text.trim().is_empty(), "generate printed nothing");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("Applied the LoRA adapter"), "{log}");
}

#[test]
fn dpo_distillation_bf16_and_two_workers_train_a_qlora_policy() {
    let dpo = temp_dir("qlora-dpo");
    run(
        "lora_dpo_single_device",
        "tiny/lora_dpo_single_device",
        &dpo,
        &["max_steps_per_epoch=3", "save_adapter_weights_only=True"],
    );
    assert!(
        dpo.path()
            .join("epoch_0/adapter_model.safetensors")
            .is_file()
    );

    let kd = temp_dir("qlora-kd");
    run(
        "knowledge_distillation_single_device",
        "tiny/kd_lora_single_device",
        &kd,
        &[
            "epochs=1",
            "max_steps_per_epoch=3",
            "save_adapter_weights_only=True",
        ],
    );
    assert_eq!(losses(kd.path()).len(), 3);

    let bf16 = temp_dir("qlora-bf16");
    run(
        "lora_finetune_single_device",
        "tiny/lora_single_device",
        &bf16,
        &["max_steps_per_epoch=3", "batch_size=2", "dtype=bf16"],
    );
    assert!(losses(bf16.path()).iter().all(|l| l.is_finite()));

    // Two workers with batch 2 equal one device with batch 4: with FSDP (the default) every
    // rank keeps its rows of each NF4 base weight (codes and block scales) and gathers them per
    // use, as torchtune's 70B/405B QLoRA configs shard; with `data_parallel_shard_dim: 1` every
    // rank holds the whole NF4 model. The same losses, adapter and merged model (exported
    // from the gathered base) as one device.
    let one = temp_dir("qlora-dp1");
    let common = ["max_steps_per_epoch=4", "save_adapter_weights_only=False"];
    let mut single = common.to_vec();
    single.push("batch_size=4");
    run("lora_finetune_single_device", "tiny/lora", &one, &single);
    for shard_dim in ["data_parallel_shard_dim=-1", "data_parallel_shard_dim=1"] {
        let two = temp_dir("qlora-dp2");
        let mut overrides = qlora(&common);
        overrides.push(shard_dim.into());
        let overrides: Vec<&str> = overrides.iter().map(String::as_str).collect();
        crate::distributed::train(
            2,
            "lora_finetune_distributed",
            "tiny/lora",
            &two,
            2,
            &overrides,
        );
        let (a, b) = (losses(one.path()), losses(two.path()));
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert!(
                (x - y).abs() <= 1e-4 * x.abs(),
                "{shard_dim}: {a:?} vs {b:?}"
            );
        }
        for file in ["adapter_model.safetensors", "model.safetensors"] {
            let (got, want) = (
                SafetensorsFile::open(&two.path().join("epoch_0").join(file)).unwrap(),
                SafetensorsFile::open(&one.path().join("epoch_0").join(file)).unwrap(),
            );
            assert_eq!(got.names().len(), want.names().len(), "{shard_dim} {file}");
            for name in want.names() {
                let (g, w) = (got.read(&name).unwrap(), want.read(&name).unwrap());
                assert_eq!(g.shape, w.shape, "{shard_dim} {file} {name}");
                // The merged model is stored in bf16: an adapter 1e-7 away may round one
                // element to the neighbouring bf16 value.
                let ulps = if file == "model.safetensors" {
                    1.0
                } else {
                    0.0
                };
                for (a, b) in g.data.iter().zip(&w.data) {
                    let tol = 1e-6 + ulps * b.abs() / 128.0;
                    assert!(
                        (a - b).abs() <= tol,
                        "{shard_dim} {file} {name}: {a} vs {b}"
                    );
                }
            }
        }
        if shard_dim.ends_with("-1") {
            let held = |dir: &TempDir| {
                let m = read_metrics(&dir.path().join("logs/metrics.jsonl"));
                column(&m, "parameter_bytes")[0]
            };
            // Every weight's rows, NF4 bases included (adapters stay whole).
            let (one, two) = (held(&one), held(&two));
            assert!(two < 0.6 * one, "rank 0 holds {two} of {one} bytes");
        }
    }
}

#[test]
fn qlora_on_a_model_torchao_cannot_quantize_names_the_weight_and_the_rule() {
    let out = temp_dir("qlora-refused");
    let run = tiny_lora(
        &out,
        &["model._component_=tune.models.llama3.qlora_llama3_tiny"],
    );
    assert!(!run.status.success());
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        err.contains("model.layers.0.self_attn.q_proj.weight [64, 64]")
            && err.contains("multiple of 16384")
            && err.contains("lora_"),
        "{err}"
    );
}
