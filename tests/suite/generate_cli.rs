//! `tune run generate` end to end: only the completion on stdout, and the same text the
//! library produces for the same prompt.

use crate::support;

use std::process::Command;

use support::*;
use tune::generation::{GenerateOptions, SamplingParams, generate};
use tune::model_io::hf::load_model;
use tune::model_io::peft::load_adapter;
use tune::tokenizer::{Message, Tokenizer};

const PROMPT: &str = "Give three tips for staying healthy.";

struct Run {
    stdout: String,
    stderr: String,
}

/// `tune run generate --config tiny/generation <extra>` that must fail with exit code 1 and
/// print nothing on stdout; its stderr.
fn generate_fails(extra: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tune"))
        .args(["run", "generate", "--config", "tiny/generation"])
        .args(extra)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(out.stdout.is_empty(), "{err}");
    err
}

fn tune_generate(extra: &[&str]) -> Run {
    let mut args = vec![
        "run",
        "generate",
        "--config",
        "tiny/generation",
        "max_new_tokens=8",
    ];
    args.extend_from_slice(extra);
    let out = Command::new(env!("CARGO_BIN_EXE_tune"))
        .args(&args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run tune");
    let run = Run {
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    assert!(
        out.status.success(),
        "tune {args:?} failed:\n{}",
        run.stderr
    );
    run
}

/// The completion the library gives for the tiny config's model, greedy, 8 tokens.
fn expected(chat: bool, adapter: bool) -> String {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-llama");
    let tok = Tokenizer::from_path(dir.join("tokenizer.json")).unwrap();
    let prompt = if chat {
        let text = tok
            .apply_chat_template(&[Message::user(PROMPT)], true)
            .unwrap();
        tok.encode(&text, false).unwrap()
    } else {
        tok.encode(PROMPT, true).unwrap()
    };
    complete(&prompt, adapter)
}

/// The tiny model's greedy 8-token completion of `prompt`, decoded.
fn complete(prompt: &[u32], adapter: bool) -> String {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-llama");
    let mut lm = load_model::<Cpu>(&dir, None, &Default::default())
        .unwrap()
        .model;
    if adapter {
        load_adapter(&mut lm, &fixture("tiny-llama-lora")).unwrap();
    }
    let tok = Tokenizer::from_path(dir.join("tokenizer.json")).unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 8,
        sampling: SamplingParams::GREEDY,
        seed: 0,
        stop_ids: tok.stop_ids().to_vec(),
        stop_at_eos: true,
        use_kv_cache: true,
    };
    let out = generate(&lm, prompt, &opts, |_| {}).unwrap();
    tok.decode(&out.tokens, true).unwrap()
}

fn prompt_arg() -> String {
    format!("prompt.user={PROMPT}")
}

#[test]
fn greedy_prints_only_the_completion() {
    let run = tune_generate(&[&prompt_arg(), "temperature=0"]);
    assert_eq!(run.stdout, format!("{}\n", expected(false, false)));
    assert!(!run.stdout.trim().is_empty(), "empty completion");
    for log in ["Loaded", "Prefill", "tokens/s"] {
        assert!(
            !run.stdout.contains(log),
            "log line on stdout: {}",
            run.stdout
        );
        assert!(
            run.stderr.contains(log),
            "missing `{log}` on stderr: {}",
            run.stderr
        );
    }
}

#[test]
fn chat_uses_the_chat_template() {
    let run = tune_generate(&[&prompt_arg(), "temperature=0", "chat=true"]);
    assert_eq!(run.stdout, format!("{}\n", expected(true, false)));
    // The Llama 3 template adds headers, so the prompt is longer than the plain one.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-llama");
    let tok = Tokenizer::from_path(dir.join("tokenizer.json")).unwrap();
    let text = tok
        .apply_chat_template(&[Message::user(PROMPT)], true)
        .unwrap();
    let n = tok.encode(&text, false).unwrap().len();
    assert!(
        run.stderr.contains(&format!("after a {n}-token prompt")),
        "{}",
        run.stderr
    );
}

#[test]
fn adapter_changes_the_completion() {
    let plain = tune_generate(&[&prompt_arg(), "temperature=0"]);
    let adapted = tune_generate(&[
        &prompt_arg(),
        "temperature=0",
        "adapter_dir=tests/fixtures/tiny-llama-lora",
    ]);
    assert_eq!(adapted.stdout, format!("{}\n", expected(false, true)));
    assert_ne!(
        plain.stdout, adapted.stdout,
        "the adapter made no difference"
    );
    assert!(
        adapted.stderr.contains("Applied the LoRA adapter"),
        "{}",
        adapted.stderr
    );
}

#[test]
fn seeded_sampling_is_reproducible() {
    let sample = |seed: u64| {
        tune_generate(&[
            &prompt_arg(),
            "temperature=1.5",
            "top_k=500",
            "top_p=0.95",
            &format!("seed={seed}"),
        ])
        .stdout
    };
    let a = sample(5);
    assert_eq!(a, sample(5));
    assert!(
        (6..10).any(|s| sample(s) != a),
        "different seeds always gave the same text"
    );
}

#[test]
fn bad_adapter_dir_is_a_clear_error() {
    let err = generate_fails(&["adapter_dir=tests/fixtures/tiny-llama"]);
    assert!(err.contains("adapter_config.json"), "{err}");
}

/// An adapter_config.json whose `r` does not match the weights saved with it: the error names
/// adapter_config.json (not the model's config.json) and the rank the weights have.
#[test]
fn an_adapter_rank_mismatch_names_adapter_config_json() {
    let dir = temp_dir("rank-mismatch");
    let src =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama-lora");
    for name in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(src.join(name), dir.path().join(name)).unwrap();
    }
    let config = dir.path().join("adapter_config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(text.contains("\"r\": 4,"));
    std::fs::write(&config, text.replace("\"r\": 4,", "\"r\": 8,")).unwrap();
    let err = generate_fails(&[&format!("adapter_dir={}", dir.path().display())]);
    assert!(
        err.contains(&format!("{} needs", config.display()))
            && err.contains("the weights have rank 4 but its `r` is 8")
            && !err.contains("model's config.json"),
        "{err}"
    );
}

/// Generation stops at the model's positions: more new tokens than fit are lowered with a
/// warning naming the number used; a prompt that fills them is an error naming config.json.
#[test]
fn generation_stays_within_the_models_positions() {
    let run = tune_generate(&["max_new_tokens=100000", "stop_at_eos=False"]);
    assert!(
        run.stderr
            .contains("would run past the model's 256 positions")
            && run.stderr.contains("generating at most"),
        "{}",
        run.stderr
    );
    let long = format!("prompt={}", "word ".repeat(400));
    let err = generate_fails(&[&long]);
    assert!(
        err.contains("the model has 256 positions") && err.contains("config.json"),
        "{err}"
    );
}

/// On the CPU backend bf16 generation computes in bf16 (tune's bf16 kernels), without a note;
/// fp16 has no kernels there and computes in fp32, which holds fp16 weights exactly, and says
/// so: its text is the fp32 text.
#[test]
fn cpu_generation_computes_bf16_as_asked_and_fp16_in_fp32() {
    let fp32 = tune_generate(&[&prompt_arg(), "temperature=0", "dtype=fp32"]);
    let fp16 = tune_generate(&[&prompt_arg(), "temperature=0", "dtype=fp16"]);
    let bf16 = tune_generate(&[&prompt_arg(), "temperature=0", "dtype=bf16"]);
    assert_eq!(fp16.stdout, fp32.stdout);
    assert!(
        fp16.stderr
            .contains("dtype: generation on the CPU computes in fp32, not fp16"),
        "{}",
        fp16.stderr
    );
    assert!(bf16.stderr.contains("parameters, bf16)"), "{}", bf16.stderr);
    assert!(!bf16.stdout.is_empty());
    for run in [&fp32, &bf16] {
        assert!(!run.stderr.contains("computes in fp32"), "{}", run.stderr);
    }
}

/// A torchtune tokenizer component formats the prompt as torchtune's generate recipe does: the
/// user message and an empty assistant turn that gets its header and nothing after it.
#[test]
fn a_torchtune_tokenizer_formats_the_prompt_as_its_component() {
    let llama3 = "tokenizer._component_=torchtune.models.llama3.llama3_tokenizer";
    let run = tune_generate(&[&prompt_arg(), "temperature=0", llama3]);
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-llama");
    let tok = Tokenizer::from_path(dir.join("tokenizer.json")).unwrap();
    let id = |t: &str| tok.token_to_id(t).unwrap();
    let enc = |t: &str| tok.encode(t, false).unwrap();
    let mut ids = vec![id("<|begin_of_text|>"), id("<|start_header_id|>")];
    ids.extend(enc("user"));
    ids.push(id("<|end_header_id|>"));
    ids.extend(enc("\n\n"));
    ids.extend(enc(PROMPT));
    ids.extend([id("<|eot_id|>"), id("<|start_header_id|>")]);
    ids.extend(enc("assistant"));
    ids.push(id("<|end_header_id|>"));
    ids.extend(enc("\n\n"));
    assert!(
        run.stderr
            .contains(&format!("after a {}-token prompt", ids.len())),
        "{}",
        run.stderr
    );
    // the same prompt through the library gives the same completion
    assert_eq!(run.stdout, format!("{}\n", complete(&ids, false)));
    // chat: True asks for the chat template, which a torchtune component replaces: refused
    // as a config error, before anything loads.
    let out = Command::new(env!("CARGO_BIN_EXE_tune"))
        .args(["run", "generate", "--config", "tiny/generation"])
        .args([prompt_arg().as_str(), llama3, "chat=True"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("chat: True formats the prompt") && err.contains("HuggingFaceModelTokenizer"),
        "{err}"
    );
}
