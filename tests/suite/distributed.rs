//! Data parallelism through the binary: N workers with batch b train exactly like one device
//! with batch N*b (losses, gradient norms, weights), as threads of one process and as two
//! processes joined over loopback; a run resumes on another number of workers; every
//! distributed recipe trains; bad launches and dead nodes are clear errors, never hangs.

use crate::support;

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use support::*;
use tune::checkpoint::HostTensor;
use tune::checkpoint::safetensors_io::{INDEX_FILE, SafetensorsFile};
use tune::training::parallel::optimizer_shards::read_state;
use tune::training::parallel::sharded_checkpoint::read_optimizer_state;

const STEPS: &str = "max_steps_per_epoch=10";

/// `(step, value)` of every metrics line that has `key` (validation lines carry only theirs).
pub(crate) fn column_by_step(dir: &Path, key: &str) -> Vec<(u64, f64)> {
    read_metrics(&dir.join("logs/metrics.jsonl"))
        .iter()
        .filter_map(|m| Some((m["step"].as_u64()?, m.get(key)?.as_f64()?)))
        .collect()
}

/// Per-step values agree within `rel` relative.
pub(crate) fn assert_same_curve(what: &str, got: &[(u64, f64)], want: &[(u64, f64)], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: step count");
    for ((sg, g), (sw, w)) in got.iter().zip(want) {
        assert_eq!(sg, sw);
        assert!(
            (g - w).abs() <= rel * w.abs(),
            "{what} at step {sg}: {g} vs {w} (relative {})",
            (g - w).abs() / w.abs()
        );
    }
}

/// The same losses (1e-4 relative) and final `epoch_0` model (1e-5) as the run in `want`.
fn assert_same_run(got: &Path, want: &Path) {
    assert_same_curve(
        "loss",
        &column_by_step(got, "loss"),
        &column_by_step(want, "loss"),
        1e-4,
    );
    let epoch = Path::new("epoch_0");
    assert_same_tensors(
        &got.join(epoch).display().to_string(),
        model_of(&got.join(epoch)),
        model_of(&want.join(epoch)),
        1e-5,
    );
}

/// Every tensor of two safetensors files agrees within `tol` absolute.
fn assert_same_weights(got: &Path, want: &Path, tol: f32) {
    assert_same_tensors(
        &got.display().to_string(),
        file_tensors(got),
        file_tensors(want),
        tol,
    );
}

/// The same tensor names, and every tensor within `tol` absolute.
pub(crate) fn assert_same_tensors(
    what: &str,
    mut got: Vec<(String, HostTensor)>,
    mut want: Vec<(String, HostTensor)>,
    tol: f32,
) {
    got.sort_by(|a, b| a.0.cmp(&b.0));
    want.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(!want.is_empty());
    let names = |v: &[(String, HostTensor)]| v.iter().map(|t| t.0.clone()).collect::<Vec<_>>();
    assert_eq!(names(&got), names(&want), "{what}");
    let mut worst = 0f32;
    for ((name, g), (_, w)) in got.iter().zip(&want) {
        let d = max_abs_diff(name, g, w);
        assert!(d <= tol, "{what}: {name}: max abs diff {d} > {tol}");
        worst = worst.max(d);
    }
    eprintln!("{what}: max abs diff {worst}");
}

fn file_tensors(file: &Path) -> Vec<(String, HostTensor)> {
    let f = SafetensorsFile::open(file).unwrap();
    f.names()
        .into_iter()
        .map(|n| {
            let t = f.read(&n).unwrap();
            (n, t)
        })
        .collect()
}

/// The Hugging Face model of a checkpoint: `model.safetensors`, or the files its index names.
pub(crate) fn model_of(dir: &Path) -> Vec<(String, HostTensor)> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return file_tensors(&single);
    }
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(INDEX_FILE)).unwrap()).unwrap();
    let mut files: Vec<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .filter_map(|v| v.as_str())
        .collect();
    files.sort_unstable();
    files.dedup();
    files
        .into_iter()
        .flat_map(|f| file_tensors(&dir.join(f)))
        .collect()
}

/// The optimizer state of a checkpoint, whichever way its ranks wrote it.
pub(crate) fn optimizer_of(dir: &Path) -> Vec<(String, HostTensor)> {
    if dir.join("optimizer_sharded").is_dir() {
        read_optimizer_state(dir).unwrap()
    } else {
        let shards = (1..=8)
            .find(|n| {
                dir.join(format!("optimizer-00001-of-0000{n}.safetensors"))
                    .is_file()
            })
            .unwrap_or(1);
        read_state(dir, "optimizer.safetensors", shards).unwrap()
    }
}

fn output(dir: &TempDir) -> String {
    format!("output_dir={}", dir.path().display())
}

/// `tune run <recipe> --config <config> output_dir=<out> batch_size=<batch> <extra...>`, on
/// `workers` workers of this process when more than one.
pub(crate) fn train(
    workers: usize,
    recipe: &str,
    config: &str,
    out: &TempDir,
    batch: usize,
    extra: &[&str],
) {
    let (workers_arg, out, batch) = (
        workers.to_string(),
        output(out),
        format!("batch_size={batch}"),
    );
    let mut args = vec!["run"];
    if workers > 1 {
        args.extend(["--nproc_per_node", workers_arg.as_str()]);
    }
    args.extend([recipe, "--config", config, out.as_str(), batch.as_str()]);
    args.extend_from_slice(extra);
    tune_ok(&args);
}

/// A free loopback port whose successor is free too (node liveness uses port + 1).
fn free_port_pair() -> u16 {
    for _ in 0..100 {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = a.local_addr().unwrap().port();
        if port < 65535 && std::net::TcpListener::bind(("0.0.0.0", port + 1)).is_ok() {
            return port;
        }
    }
    panic!("no free port pair");
}

fn node(port: u16, rank: usize, args: &[&str]) -> Child {
    let endpoint = format!("127.0.0.1:{port}");
    let node_rank = rank.to_string();
    let mut all = vec![
        "run",
        "--nnodes",
        "2",
        "--node_rank",
        &node_rank,
        "--rdzv_endpoint",
        &endpoint,
        "--rdzv_timeout",
        "60",
    ];
    all.extend_from_slice(args);
    tune_command(&all)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The same run as two `tune` processes joined over loopback, one worker each.
pub(crate) fn train_on_two_nodes(
    recipe: &str,
    config: &str,
    out: &TempDir,
    batch: usize,
    extra: &[&str],
) {
    let (out, batch) = (output(out), format!("batch_size={batch}"));
    let mut args = vec![recipe, "--config", config, out.as_str(), batch.as_str()];
    args.extend_from_slice(extra);
    let port = free_port_pair();
    let nodes = [node(port, 0, &args), node(port, 1, &args)];
    for (i, n) in nodes.into_iter().enumerate() {
        let res = wait_with_deadline(n, Duration::from_secs(120));
        assert!(
            res.status.success(),
            "node {i}: {}",
            String::from_utf8_lossy(&res.stderr)
        );
    }
}

fn wait_with_deadline(child: Child, limit: Duration) -> std::process::Output {
    let start = Instant::now();
    let mut child = child;
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("a node did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn two_lora_workers_match_one_device_with_twice_the_batch() {
    let one = temp_dir("dp-lora-1");
    let two = temp_dir("dp-lora-2");
    // Validation too: each rank scores its share of the 8 rows, the sums are all-reduced.
    let common = [
        STEPS,
        "save_adapter_weights_only=True",
        "run_val_every_n_steps=5",
        "batch_size_val=2",
        "dataset_val={_component_: torchtune.datasets.alpaca_dataset, source: json, data_files: assets/data/alpaca_tiny.json, split: 'train[:8]'}",
    ];
    train(
        1,
        "lora_finetune_single_device",
        "tiny/lora",
        &one,
        4,
        &common,
    );
    let o2 = output(&two);
    let mut dp = vec![
        "run",
        "--nproc_per_node",
        "2",
        "lora_finetune_distributed",
        "--config",
        "tiny/lora",
        o2.as_str(),
        "batch_size=2",
    ];
    dp.extend(common);
    let out = tune_ok(&dp);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        log.contains("Launching lora_finetune_distributed with 2 workers"),
        "{log}"
    );
    // Rank 0 alone logs: one start-up line, one report.
    assert_eq!(log.matches("LoRA fine-tuning").count(), 1, "{log}");
    assert_eq!(log.matches("Trained 10 steps").count(), 1, "{log}");

    let losses = column_by_step(two.path(), "loss");
    assert_eq!(losses.len(), 10);
    assert_same_curve("loss", &losses, &column_by_step(one.path(), "loss"), 1e-4);
    let val = column_by_step(two.path(), "val_loss");
    assert_eq!(val.iter().map(|v| v.0).collect::<Vec<_>>(), [5, 10]);
    assert_same_curve(
        "val_loss",
        &val,
        &column_by_step(one.path(), "val_loss"),
        1e-4,
    );
    assert_same_weights(
        &two.path().join("epoch_0/adapter_model.safetensors"),
        &one.path().join("epoch_0/adapter_model.safetensors"),
        1e-5,
    );
    let meta = std::fs::read_to_string(two.path().join("epoch_0/tune_checkpoint.json")).unwrap();
    assert!(meta.contains("lora_finetune_distributed"), "{meta}");
}

/// Full fine-tuning for 10 steps with gradient accumulation and clipping on one device (batch
/// 4) and on two workers (batch 2, with `mode`): the same clipped gradient norms (clipping is
/// active), losses and weights. Returns the two output directories.
fn full_runs_with_accumulation_and_clipping(name: &str, mode: &str) -> (TempDir, TempDir) {
    let one = temp_dir(&format!("{name}-1"));
    let two = temp_dir(&format!("{name}-2"));
    let common = [
        STEPS,
        "gradient_accumulation_steps=2",
        "clip_grad_norm=0.5",
        "optimizer.lr=1e-4",
    ];
    train(
        1,
        "full_finetune_single_device",
        "tiny/full",
        &one,
        4,
        &common,
    );
    let mut distributed = common.to_vec();
    distributed.push(mode);
    train(
        2,
        "full_finetune_distributed",
        "tiny/full",
        &two,
        2,
        &distributed,
    );
    let want = column_by_step(one.path(), "grad_norm");
    assert!(want.iter().all(|(_, n)| *n > 0.5), "{want:?}");
    assert_same_curve(
        "grad_norm",
        &column_by_step(two.path(), "grad_norm"),
        &want,
        1e-4,
    );
    assert_same_run(two.path(), one.path());
    (one, two)
}

/// Full fine-tuning with gradient accumulation and clipping, ZeRO-1 (`data_parallel_shard_dim:
/// 1`): the accumulated, all-reduced gradient is normalised by the global token count and
/// clipped on its global norm.
#[test]
fn two_full_workers_with_accumulation_and_clipping_match_one_device() {
    // ZeRO-1: whole weights on every rank, the optimizer state split.
    let (one, two) =
        full_runs_with_accumulation_and_clipping("dp-full", "data_parallel_shard_dim=1");
    // ZeRO-1: rank 0 holds about half of AdamW's moments; the checkpoint holds all of them,
    // the same as one device's.
    let state = |dir: &TempDir| column_by_step(dir.path(), "optimizer_state_bytes")[9].1;
    let (full, share) = (state(&one), state(&two));
    assert!(
        share > 0.3 * full && share < 0.7 * full,
        "rank 0 keeps {share} of {full} bytes"
    );
    // Each rank wrote its share into the checkpoint; together they are one device's state.
    let epoch = |dir: &TempDir| dir.path().join("epoch_0");
    assert!(
        epoch(&two)
            .join("optimizer-00002-of-00002.safetensors")
            .is_file()
    );
    let merged = |dir: &Path, shards| {
        let mut state = read_state(dir, "optimizer.safetensors", shards).unwrap();
        state.sort_by(|a, b| a.0.cmp(&b.0));
        state
    };
    let (got, want) = (merged(&epoch(&two), 2), merged(&epoch(&one), 1));
    assert_eq!(got.len(), want.len());
    for ((gn, g), (wn, w)) in got.iter().zip(&want) {
        assert_eq!(gn, wn);
        assert!(max_abs_diff(gn, g, w) <= 1e-5, "{gn}");
    }
    let report = tune_ok(&["checkpoints", &two.path().display().to_string()]);
    assert!(String::from_utf8_lossy(&report.stdout).contains("complete"));
}

#[test]
fn two_processes_as_two_nodes_match_one_device() {
    let one = temp_dir("dp-nodes-1");
    let two = temp_dir("dp-nodes-2");
    // Validation too: each rank scores its share of the 8 rows, the sums are all-reduced.
    let common = [
        STEPS,
        "save_adapter_weights_only=True",
        "run_val_every_n_steps=5",
        "batch_size_val=2",
        "dataset_val={_component_: torchtune.datasets.alpaca_dataset, source: json, data_files: assets/data/alpaca_tiny.json, split: 'train[:8]'}",
    ];
    train(
        1,
        "lora_finetune_single_device",
        "tiny/lora",
        &one,
        4,
        &common,
    );
    train_on_two_nodes("lora_finetune_distributed", "tiny/lora", &two, 2, &common);
    assert_same_curve(
        "loss",
        &column_by_step(two.path(), "loss"),
        &column_by_step(one.path(), "loss"),
        1e-4,
    );
    let adapter = Path::new("epoch_0/adapter_model.safetensors");
    assert_same_weights(&two.path().join(adapter), &one.path().join(adapter), 1e-5);
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Full fine-tuning on two nodes (processes) over loopback: ZeRO-1 across nodes, every rank's
/// optimizer shard in the checkpoint (the nodes share this machine's output directory), the
/// same losses as one device.
#[test]
fn two_nodes_shard_full_fine_tuning_like_one_device() {
    let one = temp_dir("dp-nodes-full-1");
    let two = temp_dir("dp-nodes-full-2");
    let common = ["max_steps_per_epoch=4", "optimizer.lr=1e-4"];
    train(
        1,
        "full_finetune_single_device",
        "tiny/full",
        &one,
        4,
        &common,
    );
    train_on_two_nodes("full_finetune_distributed", "tiny/full", &two, 2, &common);
    assert_same_curve(
        "loss",
        &column_by_step(two.path(), "loss"),
        &column_by_step(one.path(), "loss"),
        1e-4,
    );
    // FSDP over two processes: the layers' rows gathered and their gradients
    // reduce-scattered between nodes; each node writes its share of the checkpoint (they share
    // this machine's output directory), consolidated at the epoch's end.
    let (epoch, want) = (two.path().join("epoch_0"), one.path().join("epoch_0"));
    for rank in ["00001", "00002"] {
        let share = format!("optimizer_sharded/shard-{rank}-model-00001-of-00001.safetensors");
        assert!(epoch.join(share).is_file(), "node {rank}'s optimizer share");
    }
    assert_same_tensors("model", model_of(&epoch), model_of(&want), 1e-5);
    assert_same_tensors("optimizer", optimizer_of(&epoch), optimizer_of(&want), 1e-5);
}

/// Bytes of the tensors of a safetensors file whose names start with `prefix`.
fn bytes_named(file: &Path, prefix: &str) -> f64 {
    let f = SafetensorsFile::open(file).unwrap();
    f.names()
        .iter()
        .filter(|n| n.starts_with(prefix))
        .map(|n| f.read(n).unwrap().numel() as f64 * 4.0)
        .sum()
}

/// FSDP (torchtune's default, `data_parallel_shard_dim: -1`) with gradient accumulation and
/// clipping: each rank holds half of every weight's rows, and the run is one device's
/// (losses, clipped gradient norms, weights and the optimizer state rank 0 gathers).
#[test]
fn two_fsdp_workers_hold_half_the_layers_and_train_like_one_device() {
    let (one, two) =
        full_runs_with_accumulation_and_clipping("fsdp-full", "data_parallel_shard_dim=-1");
    // Keeping the gathered layers from the forward for the backward changes nothing computed.
    let kept = temp_dir("fsdp-kept");
    train(
        2,
        "full_finetune_distributed",
        "tiny/full",
        &kept,
        2,
        &[
            STEPS,
            "gradient_accumulation_steps=2",
            "clip_grad_norm=0.5",
            "optimizer.lr=1e-4",
            "fsdp_reshard_after_forward=False",
        ],
    );
    assert_same_run(kept.path(), one.path());
    // Every rank wrote its rows of the model and its optimizer state; the epoch's checkpoint
    // is consolidated into the Hugging Face model, and nothing was left in staging.
    let epoch = |dir: &TempDir| dir.path().join("epoch_0");
    let files = |dir: &Path| {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let written = files(&epoch(&two));
    for name in [
        "model-00001-of-00001.safetensors",
        INDEX_FILE,
        "config.json",
        "optimizer_sharded",
    ] {
        assert!(written.iter().any(|n| n == name), "{name} in {written:?}");
    }
    assert!(!written.iter().any(|n| n == "sharded"), "{written:?}");
    assert_eq!(
        files(&epoch(&two).join("optimizer_sharded")),
        [
            "shard-00001-model-00001-of-00001.safetensors",
            "shard-00002-model-00001-of-00001.safetensors"
        ]
    );
    let staged: Vec<String> = files(two.path())
        .into_iter()
        .filter(|n| n.starts_with(".tmp"))
        .collect();
    assert!(staged.is_empty(), "left behind: {staged:?}");
    assert_same_tensors(
        "optimizer",
        optimizer_of(&epoch(&two)),
        optimizer_of(&epoch(&one)),
        1e-5,
    );
    // Rank 0 holds half of every weight's rows: the layers', the embeddings', the norms'.
    let held = |dir: &TempDir| column_by_step(dir.path(), "parameter_bytes")[0].1;
    let whole = bytes_named(&epoch(&one).join("model.safetensors"), "");
    let dropped = held(&one) - held(&two);
    assert!(
        dropped > 0.45 * whole && dropped <= 0.5 * whole,
        "rank 0 holds {} of {} bytes; the model is {whole}",
        held(&two),
        held(&one)
    );
}

/// Full fine-tuning of tiny/full with `common` on one device (batch 4) and on two workers
/// (batch 2 each, FSDP: the default); returns the two output directories.
fn full_on_one_device_and_two_workers(name: &str, common: &[&str]) -> (TempDir, TempDir) {
    let one = temp_dir(&format!("{name}-1"));
    let two = temp_dir(&format!("{name}-2"));
    train(
        1,
        "full_finetune_single_device",
        "tiny/full",
        &one,
        4,
        common,
    );
    train(2, "full_finetune_distributed", "tiny/full", &two, 2, common);
    (one, two)
}

/// FSDP's consolidation writes every tensor of the one-device save byte for byte: two workers
/// train one step at learning rate 0 (the first step of tiny/full's warm-up; AdamW then leaves
/// every weight exactly as loaded) and write their rows,
/// consolidate them at the epoch's end, and the Hugging Face model equals one device's save of
/// the same weights in every bit, names and shapes included.
#[test]
fn a_consolidated_fsdp_checkpoint_is_the_one_device_save_bit_for_bit() {
    let (one, two) = full_on_one_device_and_two_workers("consolidate", &["max_steps_per_epoch=1"]);
    let bits = |dir: &Path| {
        let mut tensors: Vec<(String, Vec<usize>, Vec<u32>)> = model_of(dir)
            .into_iter()
            .map(|(name, t)| (name, t.shape, t.data.iter().map(|v| v.to_bits()).collect()))
            .collect();
        tensors.sort();
        tensors
    };
    let epoch = |dir: &TempDir| dir.path().join("epoch_0");
    let (got, want) = (bits(&epoch(&two)), bits(&epoch(&one)));
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert!(g == w, "{} differs from the one-device save", g.0);
    }
    // Both are the fp32 checkpoint the run loaded, untouched.
    assert!(want == bits(&fixture("tiny-llama")), "the weights moved");
}

/// A model whose output layer is not tied to its embeddings (the distillation teacher): FSDP
/// shards the output layer as a unit of its own, reduce-scatters its gradient, and the run is
/// one device's (losses, every weight).
#[test]
fn fsdp_shards_an_untied_output_layer_like_one_device() {
    let (one, two) = full_on_one_device_and_two_workers(
        "fsdp-untied",
        &[
            "max_steps_per_epoch=4",
            "optimizer.lr=1e-4",
            "checkpointer.checkpoint_dir=assets/tiny-llama-teacher",
        ],
    );
    let model = model_of(&one.path().join("epoch_0"));
    assert!(model.iter().any(|(name, _)| name == "lm_head.weight"));
    assert_same_run(two.path(), one.path());
}

/// A vision-language model under FSDP: the decoder's layers shard, the vision tower stays
/// whole on every rank (read whole, its gradients summed over the world) and trains; the run
/// is one device's (losses, every weight, the tower's included).
#[test]
fn fsdp_trains_qwen2_vl_with_its_vision_tower_like_one_device() {
    let full: &[&str] = &[
        "model._component_=tune.models.qwen2_vl.qwen2_vl_tiny",
        "~model.lora_attn_modules",
        "~model.apply_lora_to_mlp",
        "~model.apply_lora_to_output",
        "~model.lora_rank",
        "~model.lora_alpha",
        "~model.lora_dropout",
        "~save_adapter_weights_only",
        "optimizer.lr=1e-3",
        "epochs=1",
        "max_steps_per_epoch=2",
    ];
    let config = "tiny/vision_lora_single_device";
    let (one, two) = (temp_dir("fsdp-vl-1"), temp_dir("fsdp-vl-2"));
    train(1, "full_finetune_single_device", config, &one, 4, full);
    train(2, "full_finetune_distributed", config, &two, 2, full);
    let model = model_of(&one.path().join("epoch_0"));
    let base = model_of(&Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-qwen2-vl"));
    let moved = |name: &str| {
        let (a, b) = (
            model.iter().find(|(n, _)| n == name).map(|(_, t)| &t.data),
            base.iter().find(|(n, _)| n == name).map(|(_, t)| &t.data),
        );
        a.is_some() && a != b
    };
    assert!(
        moved("visual.blocks.0.attn.qkv.weight"),
        "the vision tower trains"
    );
    assert_same_run(two.path(), one.path());
}

/// DPO (policy and, for LoRA, the reference as the base without adapters) and knowledge
/// distillation shard their layers too and take one device's steps.
#[test]
fn fsdp_dpo_and_distillation_on_two_workers_match_one_device() {
    for (single, distributed, config, batch) in [
        (
            "lora_dpo_single_device",
            "lora_dpo_distributed",
            "tiny/lora_dpo",
            2,
        ),
        (
            "knowledge_distillation_single_device",
            "knowledge_distillation_distributed",
            "tiny/kd_lora_distributed",
            4,
        ),
    ] {
        let one = temp_dir("fsdp-1");
        let two = temp_dir("fsdp-2");
        let common = [
            "max_steps_per_epoch=4",
            "epochs=1",
            "save_adapter_weights_only=True",
        ];
        train(1, single, config, &one, batch, &common);
        train(2, distributed, config, &two, batch / 2, &common);
        assert_same_curve(
            distributed,
            &column_by_step(two.path(), "loss"),
            &column_by_step(one.path(), "loss"),
            1e-4,
        );
        let held = |dir: &TempDir| column_by_step(dir.path(), "parameter_bytes")[0].1;
        assert!(held(&two) < held(&one), "{distributed}: nothing sharded");
    }
}

/// Shard dimensions other than all ranks or none are refused by name before training.
#[test]
fn fsdp_refuses_partial_shard_groups() {
    let dir = temp_dir("fsdp-refused");
    let out = output(&dir);
    let res = tune_command(&[
        "run",
        "--nproc_per_node",
        "2",
        "full_finetune_distributed",
        "--config",
        "tiny/full",
        &out,
        "data_parallel_shard_dim=3",
    ])
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success(), "{err}");
    assert!(
        err.contains("data_parallel_shard_dim: 3 with 2 ranks"),
        "{err}"
    );
}

/// Nodes that do not share the output directory (here: each its own) cannot write one
/// checkpoint together: rank 0 gathers the whole optimizer state through the collective and
/// writes it alone, as one file; the other node's directory stays empty.
#[test]
fn nodes_without_a_shared_output_dir_gather_the_optimizer_state_to_rank_zero() {
    let one = temp_dir("dp-gather-1");
    let node0_dir = temp_dir("dp-gather-n0");
    let node1_dir = temp_dir("dp-gather-n1");
    let common = ["max_steps_per_epoch=4", "optimizer.lr=1e-4"];
    train(
        1,
        "full_finetune_single_device",
        "tiny/full",
        &one,
        4,
        &common,
    );

    let port = free_port_pair();
    let nodes = [(0, &node0_dir), (1, &node1_dir)].map(|(rank, dir)| {
        let out = output(dir);
        let mut args = vec![
            "full_finetune_distributed",
            "--config",
            "tiny/full",
            out.as_str(),
            "batch_size=2",
            "data_parallel_shard_dim=1",
        ];
        args.extend(common);
        node(port, rank, &args)
    });
    for (i, n) in nodes.into_iter().enumerate() {
        let res = wait_with_deadline(n, Duration::from_secs(120));
        let err = String::from_utf8_lossy(&res.stderr);
        assert!(res.status.success(), "node {i}: {err}");
    }
    assert_same_curve(
        "loss",
        &column_by_step(node0_dir.path(), "loss"),
        &column_by_step(one.path(), "loss"),
        1e-4,
    );
    for file in ["model.safetensors", "optimizer.safetensors"] {
        assert_same_weights(
            &node0_dir.path().join("epoch_0").join(file),
            &one.path().join("epoch_0").join(file),
            1e-5,
        );
    }
    let left: Vec<_> = std::fs::read_dir(node1_dir.path()).unwrap().collect();
    assert!(left.is_empty(), "node 1 writes nothing: {left:?}");

    // Resuming needs every node to see the checkpoint: node 1 cannot, so the run stops
    // instead of node 1 starting over while node 0 resumes.
    let port = free_port_pair();
    let nodes = [(0, &node0_dir), (1, &node1_dir)].map(|(rank, dir)| {
        let out = output(dir);
        let mut args = vec![
            "full_finetune_distributed",
            "--config",
            "tiny/full",
            out.as_str(),
            "batch_size=2",
            "resume_from_checkpoint=True",
            "epochs=2",
        ];
        args.extend(common);
        node(port, rank, &args)
    });
    for (i, n) in nodes.into_iter().enumerate() {
        let res = wait_with_deadline(n, Duration::from_secs(120));
        let err = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(1), "node {i}: {err}");
        assert!(
            err.contains("a different checkpoint to resume from"),
            "node {i}: {err}"
        );
    }
}

/// `seed: null` draws one seed, on rank 0, for every rank: the rendezvous check of the run
/// fingerprint (which holds the seed) passes, and the run trains.
#[test]
fn a_random_seed_is_drawn_once_for_all_ranks() {
    let dir = temp_dir("dp-seed");
    train(
        2,
        "lora_finetune_distributed",
        "tiny/lora",
        &dir,
        2,
        &[
            "seed=null",
            "max_steps_per_epoch=2",
            "save_adapter_weights_only=True",
        ],
    );
    assert_eq!(column_by_step(dir.path(), "loss").len(), 2);
}

/// A full fine-tune on W ranks killed after a step checkpoint resumes on another number of
/// ranks with the same global batch (4) and continues with the uninterrupted run's losses:
/// FSDP ranks write their rows of the model and their optimizer state into the checkpoint
/// (torch's sharded layout), and a resume on any number of ranks re-shards both.
#[test]
fn a_killed_run_resumes_on_another_number_of_ranks() {
    let extra = [
        "max_steps_per_epoch=12",
        "save_every_n_steps=2",
        "optimizer.lr=1e-4",
    ];
    let run = |workers: usize, out: &str| -> Vec<String> {
        let mut v: Vec<String> = vec![
            "run".into(),
            "--nproc_per_node".into(),
            workers.to_string(),
            "full_finetune_distributed".into(),
            "--config".into(),
            "tiny/full".into(),
            format!("batch_size={}", 4 / workers),
            out.to_string(),
        ];
        v.extend(extra.map(String::from));
        v
    };
    let reference = temp_dir("dp-resume-ref");
    let out_ref = output(&reference);
    tune_ok(&strs(&run(2, &out_ref)));

    for (from, to) in [(2, 1), (1, 2), (2, 4)] {
        let crashed = temp_dir("dp-resume");
        let out = output(&crashed);
        let mut child = tune_command(&strs(&run(from, &out)))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline
            && !crashed.path().join("step_4/tune_checkpoint.json").is_file()
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            !crashed.path().join("epoch_0").exists(),
            "{from} -> {to}: killed before the end"
        );

        let mut resume = run(to, &out);
        resume.push("resume_from_checkpoint=True".into());
        let log = String::from_utf8_lossy(&tune_ok(&strs(&resume)).stderr).into_owned();
        assert!(log.contains("Resuming from"), "{log}");
        // The last value logged for each step: the resumed run's where it re-ran one.
        let got: std::collections::BTreeMap<u64, f64> =
            column_by_step(crashed.path(), "loss").into_iter().collect();
        let got: Vec<(u64, f64)> = got.into_iter().collect();
        let want = column_by_step(reference.path(), "loss");
        assert_same_curve(&format!("{from} -> {to} loss"), &got, &want, 1e-4);
        let epoch = Path::new("epoch_0");
        assert_same_tensors(
            &format!("{from} -> {to} model"),
            model_of(&crashed.path().join(epoch)),
            model_of(&reference.path().join(epoch)),
            1e-5,
        );
        // FSDP ranks wrote their own rows of the step checkpoint it resumed from.
        if from > 1 {
            let shard = format!("step_4/sharded/shard-0000{from}-model-00001-of-00001.safetensors");
            assert!(crashed.path().join(&shard).is_file(), "{shard}");
            let report = tune_ok(&["checkpoints", &crashed.path().display().to_string()]);
            let report = String::from_utf8_lossy(&report.stdout).into_owned();
            assert!(
                report.contains("step_4") && report.contains("complete"),
                "{report}"
            );
        }
    }
}

/// Every distributed recipe trains its tiny config on 2 workers: its loss falls.
#[test]
fn every_distributed_recipe_trains_its_tiny_config_on_two_workers() {
    for (recipe, config) in [
        ("lora_finetune_distributed", "tiny/lora"),
        ("full_finetune_distributed", "tiny/full"),
        ("lora_dpo_distributed", "tiny/lora_dpo"),
        ("full_dpo_distributed", "tiny/full_dpo"),
        ("qat_distributed", "tiny/qat_full"),
        ("qat_lora_finetune_distributed", "tiny/qat_lora"),
        (
            "knowledge_distillation_distributed",
            "tiny/kd_lora_distributed",
        ),
    ] {
        let dir = temp_dir("dp-recipe");
        let out = output(&dir);
        tune_ok(&[
            "run",
            "--nproc_per_node",
            "2",
            recipe,
            "--config",
            config,
            &out,
            "save_adapter_weights_only=True",
        ]);
        let losses: Vec<f64> = column_by_step(dir.path(), "loss")
            .into_iter()
            .map(|(_, l)| l)
            .collect();
        let (first, last) = (mean(&losses[..3]), mean(&losses[losses.len() - 3..]));
        assert!(last < first, "{recipe}: loss {first} -> {last}");
        assert!(
            tune::checkpoint_client::latest_complete(dir.path())
                .unwrap()
                .is_some(),
            "{recipe}: a final checkpoint"
        );
    }
}

#[test]
fn bad_launches_are_refused_naming_the_flag() {
    let refused = |args: &[&str], needle: &str| {
        let out = tune(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    };
    refused(
        &[
            "run",
            "--nproc_per_node",
            "2",
            "lora_finetune_single_device",
            "--config",
            "tiny/lora",
        ],
        "use lora_finetune_distributed",
    );
    refused(
        &[
            "run",
            "--nproc_per_node",
            "2",
            "generate",
            "--config",
            "tiny/generation",
        ],
        "does not support distributed runs",
    );
    refused(
        &[
            "run",
            "--nnodes",
            "2",
            "lora_finetune_distributed",
            "--config",
            "tiny/lora",
        ],
        "--rdzv_endpoint HOST:PORT",
    );
    refused(
        &[
            "run",
            "--nproc_per_node",
            "0",
            "lora_finetune_distributed",
            "--config",
            "tiny/lora",
        ],
        "--nproc_per_node must be at least 1",
    );
    let busy = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    refused(
        &[
            "run",
            "--nnodes",
            "2",
            "--rdzv_endpoint",
            &format!("127.0.0.1:{port}"),
            "lora_finetune_distributed",
            "--config",
            "tiny/lora",
        ],
        &format!("port {port} is in use"),
    );
    // Node 1 with nobody at the endpoint: refused after --rdzv_timeout, not a hang.
    let port = free_port_pair();
    let started = Instant::now();
    refused(
        &[
            "run",
            "--nnodes",
            "2",
            "--node_rank",
            "1",
            "--rdzv_endpoint",
            &format!("127.0.0.1:{port}"),
            "--rdzv_timeout",
            "1",
            "lora_finetune_distributed",
            "--config",
            "tiny/lora",
        ],
        "node 0 is not reachable after 1 s",
    );
    assert!(started.elapsed() < Duration::from_secs(20));
}

/// Nodes started with different configs stop at the rendezvous, naming the cause.
#[test]
fn nodes_with_different_configs_are_refused() {
    let dir = temp_dir("dp-mismatch");
    let out = output(&dir);
    let port = free_port_pair();
    let base = [
        "lora_finetune_distributed",
        "--config",
        "tiny/lora",
        out.as_str(),
    ];
    let n0 = node(port, 0, &[&base[..], &["seed=1"]].concat());
    let n1 = node(port, 1, &[&base[..], &["seed=2"]].concat());
    for n in [n0, n1] {
        let res = wait_with_deadline(n, Duration::from_secs(60));
        let err = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(1), "{err}");
        assert!(err.contains("started with a different config"), "{err}");
    }
}

/// A node killed (SIGKILL) mid-run stops the other within seconds with an error naming it, and
/// node 0's rendezvous process never outlives its launcher: killed first (node 0 killed) or
/// last (node 1 killed, node 0 then stops).
#[test]
fn a_killed_node_stops_the_other_naming_it() {
    for killed in [1usize, 0] {
        killed_node_stops_the_other("lora_finetune_distributed", "tiny/lora", killed, false);
    }
}

/// GRPO with FSDP on two nodes, a node killed as soon as the first step is logged: the next
/// step opens with its rollouts, in which every decoding step's forward gathers weights from
/// both ranks and the ranks vote on the end of each group. The other node stops naming it
/// instead of waiting on the vote or a gather.
#[test]
fn a_node_killed_during_grpo_rollouts_stops_the_other_naming_it() {
    killed_node_stops_the_other("grpo_full_finetune_distributed", "tiny/grpo_full", 1, true);
}

/// Runs `recipe` on two nodes, kills node `killed` (SIGKILL) once training runs (its metrics
/// file exists, 200 ms later) or, with `after_first_step`, as soon as a step is logged, and
/// checks that the other stops within seconds naming it, its rendezvous gone too.
fn killed_node_stops_the_other(recipe: &str, config: &str, killed: usize, after_first_step: bool) {
    let dir = temp_dir("dp-killed");
    let out = output(&dir);
    let port = free_port_pair();
    let args = [recipe, "--config", config, out.as_str(), "epochs=50"];
    let mut nodes = vec![node(port, 0, &args), node(port, 1, &args)];
    let metrics = dir.path().join("logs/metrics.jsonl");
    let ready = || match std::fs::read_to_string(&metrics) {
        Ok(text) => !after_first_step || text.lines().next().is_some(),
        Err(_) => false,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(ready(), "{recipe}: no metrics within a minute");
    if !after_first_step {
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut victim = nodes.remove(killed);
    victim.kill().unwrap();
    let killed_at = Instant::now();
    let _ = victim.wait();
    let res = wait_with_deadline(nodes.remove(0), Duration::from_secs(30));
    assert!(killed_at.elapsed() < Duration::from_secs(10));
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(1), "{err}");
    let named = format!("node {killed} (rank {killed}) stopped before the run finished");
    assert!(err.contains(&named), "{err}");
    assert_rendezvous_gone(port);
}

/// The rendezvous child (`tune rendezvous --port P`) exits within seconds of its parent.
fn assert_rendezvous_gone(port: u16) {
    let pattern = format!("rendezvous --port {port}");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let alive = std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
            std::fs::read(e.path().join("cmdline"))
                .map(|c| {
                    String::from_utf8_lossy(&c)
                        .replace('\0', " ")
                        .contains(&pattern)
                })
                .unwrap_or(false)
        });
        if !alive {
            return;
        }
        assert!(Instant::now() < deadline, "the rendezvous outlived node 0");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The NaN guard on several workers: every rank stops at the same step with the guard's
/// message (the non-finite flag travels with the step's counts), not a hang or a collective
/// error.
#[test]
fn a_diverging_run_on_two_workers_stops_every_rank_at_the_same_step() {
    let dir = temp_dir("dp-nan");
    let out = output(&dir);
    let res = tune(&[
        "run",
        "--nproc_per_node",
        "2",
        "lora_finetune_distributed",
        "--config",
        "tiny/lora",
        &out,
        "optimizer.lr=1e30",
        "~lr_scheduler",
        "max_steps_per_epoch=10",
    ]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(1), "{err}");
    assert!(err.contains("the loss became"), "{err}");
    assert!(err.contains("Lower optimizer.lr"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// A full fine-tune of the model `extra` names for `steps` steps, on one device (batch 4) and
/// with FSDP on two workers (batch 2 each): asserts they log the same losses, within 1e-5
/// relative, and returns both runs' output directories (one device's first).
pub(crate) fn one_device_and_fsdp_agree(
    tag: &str,
    extra: &[&str],
    steps: usize,
) -> (TempDir, TempDir) {
    recipes_on_one_device_and_fsdp_agree(tag, FULL_RECIPES, extra, steps)
}

/// The full fine-tuning recipes and tiny configs: one device's, then the distributed ones.
pub(crate) const FULL_RECIPES: [(&str, &str); 2] = [
    ("full_finetune_single_device", "tiny/full_single_device"),
    ("full_finetune_distributed", "tiny/full"),
];

/// The LoRA recipes and tiny configs: one device's, then the distributed ones.
pub(crate) const LORA_RECIPES: [(&str, &str); 2] = [
    ("lora_finetune_single_device", "tiny/lora_single_device"),
    ("lora_finetune_distributed", "tiny/lora"),
];

/// [`one_device_and_fsdp_agree`] for `recipes` (`[(recipe, config)]`: one device's, then the
/// distributed one's).
pub(crate) fn recipes_on_one_device_and_fsdp_agree(
    tag: &str,
    [(single, single_config), (distributed, distributed_config)]: [(&str, &str); 2],
    extra: &[&str],
    steps: usize,
) -> (TempDir, TempDir) {
    let max_steps = format!("max_steps_per_epoch={steps}");
    let mut extra = extra.to_vec();
    extra.push(&max_steps);
    let (one, two) = (temp_dir(&format!("{tag}-1")), temp_dir(&format!("{tag}-2")));
    train(1, single, single_config, &one, 4, &extra);
    train(2, distributed, distributed_config, &two, 2, &extra);
    let losses = |dir: &TempDir| {
        column(
            &read_metrics(&dir.path().join("logs/metrics.jsonl")),
            "loss",
        )
    };
    let (a, b) = (losses(&one), losses(&two));
    assert_eq!(a.len(), steps, "{a:?}");
    assert_eq!(b.len(), steps, "{b:?}");
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "{a:?} vs {b:?}");
    }
    (one, two)
}
