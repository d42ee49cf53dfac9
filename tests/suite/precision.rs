//! `dtype: bf16` end to end through the binary (each run is its own process, so bf16 as the
//! device default never leaks into this suite's fp32 tests), and fp16 refused for training.

use crate::support;

use crate::lora_recipes::lora_run as lora;
use support::*;
use tune::checkpoint::safetensors_io::SafetensorsFile;
use tune::model_io::hf::load_model;

#[test]
fn bf16_lora_training_follows_fp32_and_writes_loadable_outputs() {
    let (bf16, fp32) = (temp_dir("bf16-lora"), temp_dir("fp32-lora"));
    let args = ["batch_size=2", "max_steps_per_epoch=30"];
    let bf16_loss = column(&lora(&bf16, &[&args[..], &["dtype=bf16"]].concat()), "loss");
    let fp32_loss = column(&lora(&fp32, &args), "loss");
    assert_eq!(bf16_loss.len(), 30);
    let (first, last) = (mean(&bf16_loss[..5]), mean(&bf16_loss[25..]));
    assert!(
        last < first - 1.0,
        "bf16 loss should fall as fp32's does: first {first:.3}, last {last:.3}"
    );
    // Same weights, same batch: the first loss differs only by bf16 rounding. Later steps
    // diverge slowly (bf16 updates round), so the curves are compared on average.
    assert!(
        (bf16_loss[0] - fp32_loss[0]).abs() < 0.02,
        "first loss: bf16 {} vs fp32 {}",
        bf16_loss[0],
        fp32_loss[0]
    );
    let (bf16_tail, fp32_tail) = (mean(&bf16_loss[25..]), mean(&fp32_loss[25..]));
    assert!(
        (bf16_tail - fp32_tail).abs() < 0.25,
        "last losses: bf16 {bf16_tail:.3} vs fp32 {fp32_tail:.3}"
    );

    // The PEFT adapter and the merged model load in an fp32 process, finite.
    let ckpt = bf16.path().join("epoch_0");
    let adapter = SafetensorsFile::open(&ckpt.join("adapter_model.safetensors")).unwrap();
    for name in adapter.names() {
        let t = adapter.read(&name).unwrap();
        assert!(t.data.iter().all(|v| v.is_finite()), "{name} is finite");
    }
    let merged = load_model::<Cpu>(&ckpt, None, &Default::default()).unwrap();
    for (name, t) in merged.model.hf_state_dict() {
        assert!(t.data.iter().all(|v| v.is_finite()), "{name} is finite");
    }
}

#[test]
fn bf16_full_finetune_trains_and_saves_a_checkpoint() {
    let out = temp_dir("bf16-full");
    let metrics = run_recipe(
        "full_finetune_single_device",
        "tiny/full_single_device",
        &out,
        &["dtype=bf16", "max_steps_per_epoch=12", "batch_size=2"],
    );
    let loss = column(&metrics, "loss");
    assert_eq!(loss.len(), 12);
    assert!(
        mean(&loss[9..]) < mean(&loss[..3]),
        "bf16 full fine-tuning lowers the loss: {loss:?}"
    );
    let saved = load_model::<Cpu>(&out.path().join("epoch_0"), None, &Default::default()).unwrap();
    assert_eq!(saved.model.args.num_layers, 2);
    for (name, t) in saved.model.hf_state_dict() {
        assert!(t.data.iter().all(|v| v.is_finite()), "{name} is finite");
    }
}

#[test]
fn fp16_training_is_refused_with_the_fix() {
    let out = temp_dir("fp16");
    let run = tiny_lora(&out, &["dtype=fp16"]);
    assert_eq!(run.status.code(), Some(2), "a config error");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.contains("dtype: expected one of fp32, bf16") && stderr.contains("found `fp16`"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    // The library refuses it too, for callers that skip the config schema (`tune bench`).
    let err = tune::precision::set_device_dtype::<Cpu>(
        &Default::default(),
        tune::precision::Dtype::Fp16,
        tune::precision::Use::Training,
    )
    .unwrap_err();
    assert!(err.to_string().contains("use bf16 or fp32"), "{err}");
}

#[test]
fn bf16_generation_runs_greedy_from_the_tiny_model() {
    let run = tune(&[
        "run",
        "generate",
        "--config",
        "tiny/generation",
        "max_new_tokens=8",
        "dtype=bf16",
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(
        stderr.contains("bf16"),
        "the load line names the dtype: {stderr}"
    );
    assert!(!String::from_utf8_lossy(&run.stdout).trim().is_empty());
}

/// Every other training recipe runs in bf16 too (their losses meet fp32 masks and upcast
/// logits; a dtype mismatch would abort the run), with activation checkpointing on one of them.
#[test]
fn bf16_runs_every_training_recipe() {
    for (recipe, config, extra) in [
        ("lora_dpo_single_device", "tiny/lora_dpo_single_device", ""),
        ("full_dpo_single_device", "tiny/full_dpo_single_device", ""),
        (
            "knowledge_distillation_single_device",
            "tiny/kd_lora_single_device",
            "enable_activation_checkpointing=true",
        ),
        ("qat_single_device", "tiny/qat_single_device", ""),
        (
            "qat_lora_finetune_single_device",
            "tiny/qat_lora_single_device",
            "",
        ),
    ] {
        let out = temp_dir(&format!("bf16-{recipe}"));
        let mut args = vec!["dtype=bf16", "max_steps_per_epoch=3", "epochs=1"];
        if !extra.is_empty() {
            args.push(extra);
        }
        let loss = column(&run_recipe(recipe, config, &out, &args), "loss");
        assert!(!loss.is_empty(), "{recipe}: no steps logged");
        assert!(
            loss.iter().all(|l| l.is_finite()),
            "{recipe}: bf16 losses {loss:?}"
        );
    }
}
