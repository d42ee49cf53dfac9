//! Shared helpers for the integration tests (and the bf16 binary, which includes this file):
//! fixture paths and tolerance checks for the golden-value tests, temporary directories
//! (`tempfile`, removed when dropped), running the `tune` binary, and a temporary tree of the
//! files the tiny configs name under `assets/` for the config tests.

use std::path::{Path, PathBuf};

use serde_yaml::Value;

use tune::checkpoint::HostTensor;
use tune::checkpoint::safetensors_io::SafetensorsFile;

pub type Cpu = burn::backend::Flex;
pub type CpuAutodiff = burn::backend::Autodiff<burn::backend::Flex>;

pub fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(path)
}

pub struct Reference(pub SafetensorsFile);

impl Reference {
    pub fn open(name: &str) -> Self {
        Self(SafetensorsFile::open(&fixture(&format!("reference/{name}"))).expect("reference file"))
    }
    pub fn f32(&self, name: &str) -> HostTensor {
        self.0.read(name).unwrap_or_else(|e| panic!("{name}: {e}"))
    }
    pub fn i64(&self, name: &str) -> Vec<i64> {
        self.0
            .read_i64(name)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    }
    pub fn tokens(&self) -> (Vec<u32>, Vec<i64>, usize) {
        let ids = self.i64("input_ids");
        let labels = self.i64("labels");
        let shape = self.0.shape("input_ids").unwrap();
        (ids.iter().map(|&i| i as u32).collect(), labels, shape[0])
    }
    pub fn names(&self) -> Vec<String> {
        self.0.names()
    }
    /// How many gradients the reference holds (`grad.<parameter>`).
    pub fn grad_count(&self) -> usize {
        self.names()
            .iter()
            .filter(|n| n.starts_with("grad."))
            .count()
    }
}

/// Largest |a - b|, after checking the shapes agree.
pub fn max_abs_diff(what: &str, got: &HostTensor, want: &HostTensor) -> f32 {
    assert_eq!(got.shape, want.shape, "{what}: shape");
    got.data
        .iter()
        .zip(&want.data)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

/// Fixture tolerance for logits and losses: 1e-4 absolute.
pub fn assert_close(what: &str, got: &HostTensor, want: &HostTensor, tol: f32) {
    let d = max_abs_diff(what, got, want);
    assert!(d <= tol, "{what}: max abs diff {d} > {tol}");
}

/// Fixture tolerance for gradients: within 1e-4 absolute or 1e-3 relative, element-wise.
pub fn assert_grad_close(what: &str, got: &HostTensor, want: &HostTensor) {
    assert_eq!(got.shape, want.shape, "{what}: shape");
    for (i, (a, b)) in got.data.iter().zip(&want.data).enumerate() {
        let ok = (a - b).abs() <= 1e-4 || (a - b).abs() <= 1e-3 * b.abs();
        assert!(ok, "{what}[{i}]: got {a}, want {b}");
    }
}

/// Position ids 0..seq for each row.
pub fn positions(batch: usize, seq: usize) -> Vec<u32> {
    (0..batch).flat_map(|_| 0..seq as u32).collect()
}

pub use tempfile::TempDir;

/// A fresh temporary directory named `tune-<tag>-<random>`, removed when dropped: keep the
/// value alive while anything (a spawned `tune` included) still uses the directory.
pub fn temp_dir(tag: &str) -> TempDir {
    tempfile::Builder::new()
        .prefix(&format!("tune-{tag}-"))
        .tempdir()
        .expect("create temp dir")
}

/// Writes `{}` to `rel` under `dir`, creating its folders; returns the file's path.
pub fn touch(dir: &Path, rel: &str) -> PathBuf {
    let p = dir.join(rel);
    if let Some(parent) = p.parent() {
        std::fs::create_dir_all(parent).expect("mkdir");
    }
    std::fs::write(&p, "{}").expect("write");
    p
}

/// `rel` under `dir`, as the string a config override takes.
pub fn path_in(dir: &Path, rel: &str) -> String {
    dir.join(rel).display().to_string()
}

/// A temp root holding the files the tiny configs name under `assets/`.
pub fn tiny_assets() -> TempDir {
    let t = temp_dir("assets");
    for model in [
        "tiny-llama",
        "tiny-llama-teacher",
        "tiny-llama-reward",
        "tiny-qwen2-vl",
    ] {
        for f in [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            touch(t.path(), &format!("assets/{model}/{f}"));
        }
    }
    for f in [
        "alpaca_tiny.json",
        "hh_rlhf_tiny.json",
        "stack_exchange_paired_tiny.json",
        "alpaca_pairs_tiny.json",
        "vision_tiny.json",
    ] {
        touch(t.path(), &format!("assets/data/{f}"));
    }
    t
}

/// Rewrites every string starting with `assets/` to live under `root`, so
/// relative asset paths resolve without changing the process's cwd.
pub fn rebase_assets(value: &mut Value, root: &Path) {
    match value {
        Value::String(s) if s.starts_with("assets/") => {
            *s = root.join(&*s).display().to_string();
        }
        Value::Mapping(m) => m.values_mut().for_each(|v| rebase_assets(v, root)),
        Value::Sequence(items) => items.iter_mut().for_each(|v| rebase_assets(v, root)),
        _ => {}
    }
}

/// Owned copies of string arguments (config overrides).
pub fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// `tune <args>` run from the repository root (so `assets/` resolves); returns the output.
/// `tune run lora_finetune_single_device --config tiny/lora_single_device output_dir=<out>
/// <extra...>`, success or not (for the tests of what a failing run says).
pub fn tiny_lora(out: &TempDir, extra: &[&str]) -> std::process::Output {
    let output_dir = format!("output_dir={}", out.path().display());
    let mut args = vec![
        "run",
        "lora_finetune_single_device",
        "--config",
        "tiny/lora_single_device",
        output_dir.as_str(),
    ];
    args.extend_from_slice(extra);
    tune(&args)
}

pub fn tune(args: &[&str]) -> std::process::Output {
    tune_command(args).output().expect("running tune")
}

pub fn tune_command(args: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_tune"));
    cmd.args(args).current_dir(env!("CARGO_MANIFEST_DIR"));
    cmd
}

/// Runs tune, which must fail (a refusal), and returns its stderr.
pub fn tune_refuses(args: &[&str]) -> String {
    let out = tune(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "tune {args:?} succeeded: {stderr}");
    stderr
}

/// Runs tune and panics with its stderr unless it succeeded.
pub fn tune_ok(args: &[&str]) -> std::process::Output {
    let out = tune(args);
    assert!(
        out.status.success(),
        "tune {args:?} failed ({:?}):\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The objects of a metrics.jsonl file.
pub fn read_metrics(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

pub fn column(metrics: &[serde_json::Value], key: &str) -> Vec<f64> {
    metrics
        .iter()
        .map(|m| {
            m[key]
                .as_f64()
                .unwrap_or_else(|| panic!("{key} missing in {m}"))
        })
        .collect()
}

pub fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// Every gradient in `grads` (summed over any number of backward passes), in module order.
pub fn grad_values(
    model: &tune::models::CausalLm<CpuAutodiff>,
    grads: burn::optim::GradientsParams,
) -> Vec<Vec<f32>> {
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::tensor::Tensor;
    struct Collect(burn::optim::GradientsParams, Vec<Vec<f32>>);
    impl ModuleVisitor<CpuAutodiff> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<CpuAutodiff, D>>) {
            if let Some(g) = self.0.get::<Cpu, D>(param.id) {
                self.1.push(g.into_data().to_vec().unwrap());
            }
        }
    }
    let mut c = Collect(grads, Vec::new());
    model.visit(&mut c);
    c.1
}

/// Sums a loss step's gradients: its own backward passes (activation checkpointing) or one
/// backward of `loss * weight`, as the trainer does.
pub fn step_grads(
    model: &tune::models::CausalLm<CpuAutodiff>,
    mut out: tune::training::StepOutput<CpuAutodiff>,
) -> Vec<Vec<f32>> {
    let mut acc = tune::training::step::GradAccumulator::default();
    for grads in out.take_gradients() {
        acc.add(model, grads);
    }
    grad_values(model, acc.take())
}

/// Two gradient sets agree within `1e-5` of each tensor's largest magnitude.
pub fn assert_same_grads(plain: &[Vec<f32>], other: &[Vec<f32>]) {
    assert!(!plain.is_empty(), "no gradients");
    assert_eq!(plain.len(), other.len(), "number of gradients");
    for (i, (p, c)) in plain.iter().zip(other).enumerate() {
        let scale = p.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
        let diff = p
            .iter()
            .zip(c)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            diff <= 1e-5 * scale,
            "gradient {i}: max diff {diff} (scale {scale})"
        );
    }
}

/// Runs `tune run <recipe> --config <config> output_dir=<out> <extra...>` and returns its
/// metrics.jsonl lines.
pub fn run_recipe(
    recipe: &str,
    config: &str,
    out: &TempDir,
    extra: &[&str],
) -> Vec<serde_json::Value> {
    let output_dir = format!("output_dir={}", out.path().display());
    let mut args = vec!["run", recipe, "--config", config, &output_dir];
    args.extend_from_slice(extra);
    tune_ok(&args);
    read_metrics(&out.path().join("logs/metrics.jsonl"))
}

/// The logits of `batch` unpacked rows of `tokens`, each row at positions 0..seq.
pub fn forward_rows<B: burn::tensor::backend::Backend>(
    model: &tune::models::CausalLm<B>,
    tokens: &[u32],
    batch: usize,
    mode: tune::modules::ForwardMode,
) -> burn::tensor::Tensor<B, 3> {
    let pos = positions(batch, tokens.len() / batch);
    let input = tune::models::TokenBatch {
        tokens,
        positions: &pos,
        document_ids: None,
        continued_documents: None,
        left_padding: None,
        padding: None,
        images: None,
        batch,
    };
    model.forward(input, mode)
}

/// Checks `logits` and their cross-entropy against the reference's `logits` and `loss` (the
/// fixtures' 1e-4) and returns the loss, for the gradient checks that follow.
pub fn assert_logits_and_loss<B: burn::tensor::backend::Backend>(
    r: &Reference,
    logits: burn::tensor::Tensor<B, 3>,
    labels: &[i64],
) -> burn::tensor::Tensor<B, 1> {
    assert_close(
        "logits",
        &HostTensor::from_tensor(&logits),
        &r.f32("logits"),
        1e-4,
    );
    let loss = tune::training::loss::cross_entropy(logits, labels);
    assert_close(
        "loss",
        &HostTensor::from_tensor(&loss),
        &r.f32("loss"),
        1e-4,
    );
    loss
}

/// tiny-llama with the fixture's PEFT adapter, only the adapters trainable.
pub fn lora_model() -> tune::models::CausalLm<CpuAutodiff> {
    lora_model_on(&Default::default())
}

/// [`lora_model`] on any autodiff backend (the golden checks that `gpu` runs again).
pub fn lora_model_on<B: burn::tensor::backend::AutodiffBackend>(
    device: &B::Device,
) -> tune::models::CausalLm<B> {
    let mut model = tune::model_io::hf::load_model::<B>(&fixture("tiny-llama"), None, device)
        .unwrap()
        .model;
    tune::model_io::peft::load_adapter(&mut model, &fixture("tiny-llama-lora")).unwrap();
    model.set_trainable(tune::models::Trainable::AdaptersOnly)
}

/// Internal module path of an adapter tensor -> its PEFT key.
pub fn to_peft(name: &str) -> String {
    use tune::model_io::peft::{magnitude_key, peft_key};
    let (module, which) = name.rsplit_once(".lora.").unwrap();
    match which {
        "a" => peft_key(module, 'A'),
        "b" => peft_key(module, 'B'),
        _ => magnitude_key(module),
    }
}

/// A tokenized row of `n` tokens (ids from `seed`), its first `prompt` labels masked, as a
/// dataset with its prompt not trained gives it.
pub fn masked_row(n: usize, prompt: usize, seed: u32) -> tune::data::SftSample {
    let tokens: Vec<u32> = (0..n as u32)
        .map(|t| (seed * 97 + t * 31) % 1900 + 3)
        .collect();
    let labels = tokens
        .iter()
        .enumerate()
        .map(|(t, &tok)| if t < prompt { -100 } else { tok as i64 })
        .collect();
    tune::data::SftSample {
        tokens,
        labels,
        images: Vec::new(),
    }
}

/// Every tensor of the model's safetensors files in `dir`, as stored: name -> (dtype, shape,
/// bytes).
pub fn stored_tensors(
    dir: &Path,
) -> std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let mut out = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if name.starts_with("model") && name.ends_with(".safetensors") {
            let f = SafetensorsFile::open(&path).unwrap();
            for name in f.names() {
                let (dtype, shape, bytes) = f.raw(&name).unwrap();
                out.insert(name, (format!("{dtype:?}"), shape, bytes.to_vec()));
            }
        }
    }
    out
}

/// The mean of the first and of the last five losses (fewer when the run is shorter).
pub fn first_and_last_mean(losses: &[f64]) -> (f64, f64) {
    let n = losses.len().min(5);
    (mean(&losses[..n]), mean(&losses[losses.len() - n..]))
}
