//! End to end: the QAT recipes through the `tune` binary on the tiny configs. QAT LoRA lowers
//! the loss; its quantized export reloads to exactly the fake-quantized merged model (logits,
//! then greedy tokens) at a fraction of the float weights' size; bad quantizer settings fail
//! with the documented message.

use crate::support;

use std::path::Path;
use std::process::Command;

use support::*;
use tune::checkpoint::HostTensor;
use tune::checkpoint::safetensors_io::SafetensorsFile;
use tune::generation::{GenerateOptions, SamplingParams, generate};
use tune::model_io::hf::load_model;
use tune::model_io::quantized::{QUANTIZED_DIR, load_quantized_model};
use tune::models::{CausalLm, TokenBatch};
use tune::modules::ForwardMode;
use tune::modules::fake_quant::QuantScheme;
use tune::setup::quant::prepare;
use tune::tokenizer::Tokenizer;

fn tune(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tune"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run the tune binary")
}

fn losses(output_dir: &Path) -> Vec<f64> {
    let text =
        std::fs::read_to_string(output_dir.join("logs/metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

fn logits(model: &CausalLm<Cpu>, tokens: &[u32]) -> HostTensor {
    let pos: Vec<u32> = (0..tokens.len() as u32).collect();
    let input = TokenBatch {
        tokens,
        positions: &pos,
        document_ids: None,
        continued_documents: None,
        left_padding: None,
        padding: None,
        images: None,
        batch: 1,
    };
    HostTensor::from_tensor(&model.forward(input, ForwardMode::default()))
}

/// Greedy decoding by full forward passes: argmax of the last position, appended.
fn greedy(model: &CausalLm<Cpu>, prompt: &[u32], new_tokens: usize) -> Vec<u32> {
    let mut tokens = prompt.to_vec();
    for _ in 0..new_tokens {
        let l = logits(model, &tokens);
        let vocab = l.shape[2];
        let last = &l.data[l.data.len() - vocab..];
        let next = (0..vocab)
            .max_by(|&a, &b| last[a].total_cmp(&last[b]).then(b.cmp(&a)))
            .unwrap();
        tokens.push(next as u32);
    }
    tokens
}

/// Bytes of the linear weights: float in the float checkpoint, qweight + scales in the export.
fn linear_weight_bytes(float_file: &SafetensorsFile, export: &SafetensorsFile) -> (usize, usize) {
    let mut float_bytes = 0;
    let mut quant_bytes = 0;
    for name in export.names() {
        if let Some(module) = name.strip_suffix(".qweight") {
            float_bytes += float_file.raw(&format!("{module}.weight")).unwrap().2.len();
            quant_bytes += export.raw(&name).unwrap().2.len();
            quant_bytes += export.raw(&format!("{module}.scales")).unwrap().2.len();
        }
    }
    (float_bytes, quant_bytes)
}

#[test]
fn qat_lora_trains_and_its_quantized_export_matches_the_fake_quantized_model() {
    let out = temp_dir("qat-lora");
    let run = tune(&[
        "run",
        "qat_lora_finetune_single_device",
        "--config",
        "tiny/qat_lora_single_device",
        &format!("output_dir={}", out.path().display()),
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");

    let l = losses(out.path());
    let n = l.len();
    assert!(n >= 10, "{n} steps logged");
    let head: f64 = l[..3].iter().sum::<f64>() / 3.0;
    let tail: f64 = l[n - 3..].iter().sum::<f64>() / 3.0;
    eprintln!("QAT LoRA loss: first 3 steps {head:.4}, last 3 steps {tail:.4} over {n} steps");
    assert!(
        tail < head - 0.05,
        "loss fell: first steps {head:.4}, last steps {tail:.4} ({l:?})"
    );

    // The merged float model, fake-quantized as in training, against the dequantized export.
    let ckpt = out.path().join("epoch_0");
    let device = Default::default();
    let mut merged = load_model::<Cpu>(&ckpt, None, &device).unwrap().model;
    prepare(
        &mut merged,
        QuantScheme::Int8DynActInt4Weight { group_size: 32 },
    )
    .unwrap();
    let exported = load_quantized_model::<Cpu>(&ckpt.join(QUANTIZED_DIR), &device).unwrap();
    let prompt: Vec<u32> = vec![2000, 40, 1000, 300, 77, 512, 9, 1500];
    let diff = max_abs_diff(
        "logits",
        &logits(&exported, &prompt),
        &logits(&merged, &prompt),
    );
    assert_eq!(
        diff, 0.0,
        "dequantized export logits == fake-quantized model logits"
    );
    assert_eq!(greedy(&exported, &prompt, 10), greedy(&merged, &prompt, 10));

    // int4 + f32 scales per 32 weights: 4 / (0.5 + 4/32) = 6.4x smaller than f32.
    let float_file = SafetensorsFile::open(&ckpt.join("model.safetensors")).unwrap();
    let export_file =
        SafetensorsFile::open(&ckpt.join(QUANTIZED_DIR).join("model.safetensors")).unwrap();
    let (float_bytes, quant_bytes) = linear_weight_bytes(&float_file, &export_file);
    let factor = float_bytes as f64 / quant_bytes as f64;
    eprintln!(
        "linear weights: {float_bytes} B float32 -> {quant_bytes} B int4 + scales ({factor:.2}x smaller)"
    );
    assert!((6.3..6.5).contains(&factor), "size factor {factor}");
}

#[test]
fn qat_full_writes_a_loadable_quantized_export() {
    let out = temp_dir("qat-full");
    let run = tune(&[
        "run",
        "qat_single_device",
        "--config",
        "tiny/qat_single_device",
        &format!("output_dir={}", out.path().display()),
        "max_steps_per_epoch=4",
        "fake_quant_after_n_steps=2",
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let ckpt = out.path().join("epoch_0");
    let device = Default::default();
    let mut float = load_model::<Cpu>(&ckpt, None, &device).unwrap().model;
    prepare(
        &mut float,
        QuantScheme::Int8DynActInt4Weight { group_size: 32 },
    )
    .unwrap();
    let exported = load_quantized_model::<Cpu>(&ckpt.join(QUANTIZED_DIR), &device).unwrap();
    let prompt: Vec<u32> = vec![2000, 12, 345, 678];
    assert_eq!(
        max_abs_diff(
            "logits",
            &logits(&exported, &prompt),
            &logits(&float, &prompt)
        ),
        0.0
    );

    // `tune run generate` reads the export directly and prints the fake-quantized model's
    // greedy completion.
    let qdir = ckpt.join(QUANTIZED_DIR);
    let run = tune(&[
        "run",
        "generate",
        "--config",
        "tiny/generation",
        &format!("checkpointer.checkpoint_dir={}", qdir.display()),
        "prompt.user=Tell me a joke.",
        "temperature=0",
        "max_new_tokens=8",
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(stderr.contains("int4 export"), "{stderr}");
    let tok = Tokenizer::from_path(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-llama/tokenizer.json"),
    )
    .unwrap();
    let prompt = tok.encode("Tell me a joke.", true).unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 8,
        sampling: SamplingParams::GREEDY,
        seed: 0,
        stop_ids: tok.stop_ids().to_vec(),
        stop_at_eos: true,
        use_kv_cache: true,
    };
    let expected = generate(&float, &prompt, &opts, |_| {}).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&run.stdout).trim_end(),
        tok.decode(&expected.tokens, true).unwrap().trim_end()
    );
}

#[test]
fn group_size_not_dividing_a_layer_is_a_clear_error() {
    let out = temp_dir("qat-badgroup");
    let run = tune(&[
        "run",
        "qat_single_device",
        "--config",
        "tiny/qat_single_device",
        &format!("output_dir={}", out.path().display()),
        "quantizer.groupsize=48",
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(
        stderr.contains(
            "quantizer.groupsize 48 does not divide model.layers.0.self_attn.q_proj in_features 64"
        ),
        "{stderr}"
    );
}

#[test]
fn unknown_quantizer_is_a_config_error() {
    let out = temp_dir("qat-badquant");
    let run = tune(&[
        "run",
        "qat_single_device",
        "--config",
        "tiny/qat_single_device",
        &format!("output_dir={}", out.path().display()),
        "quantizer._component_=torchtune.training.quantization.Int2Quantizer",
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(stderr.contains("quantizer._component_"), "{stderr}");
}

#[test]
fn tune_quantize_writes_an_export_of_the_checkpointer_model() {
    let out = temp_dir("qat-quantize");
    let run = tune(&[
        "quantize",
        "--config",
        "tiny/qat_single_device",
        &format!("output_dir={}", out.path().display()),
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let device = Default::default();
    let exported = load_quantized_model::<Cpu>(&out.path().join(QUANTIZED_DIR), &device).unwrap();
    let mut float = load_model::<Cpu>(Path::new("assets/tiny-llama"), None, &device)
        .unwrap()
        .model;
    prepare(
        &mut float,
        QuantScheme::Int8DynActInt4Weight { group_size: 32 },
    )
    .unwrap();
    let prompt: Vec<u32> = vec![2000, 5, 6, 7];
    assert_eq!(
        max_abs_diff(
            "logits",
            &logits(&exported, &prompt),
            &logits(&float, &prompt)
        ),
        0.0
    );
}
