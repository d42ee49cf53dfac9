//! The golden checks again on burn's cubecl backend (`device: wgpu`), the code path every GPU
//! run takes: its JIT-compiled kernels, device transfers, and tune's own ops where
//! they are written against burn's backend API (the NF4 linear). CI runs them on Mesa's
//! software Vulkan (lavapipe); on a machine with a GPU they run on the GPU.
//!
//! Each check is the CPU test's own function with the same fixture tolerances, so a kernel or
//! op that computes something else on the cubecl backend fails here by name. Attention here is
//! tune's cubecl kernels (src/kernels/cube_attention.rs), checked against burn's composed path
//! and, through every model check, against the fixtures; src/kernels' other fused kernels are
//! Flex-only, and on this backend the same functions run burn's composed ops.
//!
//! Built only with `--features wgpu` (.ci/run: `cargo test --features wgpu --test suite gpu`).

use crate::support;

use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Autodiff, Wgpu};
use support::*;
use tune::checkpoint::HostTensor;

type Gpu = Autodiff<Wgpu>;

fn device() -> WgpuDevice {
    WgpuDevice::DefaultDevice
}

#[test]
fn adapter_is_found_and_named() {
    let adapter = tune::device::wgpu_adapter().expect("a wgpu adapter (.ci/run installs lavapipe)");
    eprintln!("wgpu adapter: {adapter}");
    assert!(!adapter.name.is_empty());
}

#[test]
fn llama_logits_loss_and_every_gradient() {
    crate::models::check_model_on::<Gpu>("tiny-llama", "tiny-llama.safetensors", &device());
}

#[test]
fn qwen2_logits_loss_and_every_gradient() {
    crate::models::check_model_on::<Gpu>("tiny-qwen2", "tiny-qwen2.safetensors", &device());
}

#[test]
fn gemma2_logits_loss_and_every_gradient() {
    // Soft-capping, sandwich norms and sliding windows: the family with the most ops of its own.
    crate::models::check_model_on::<Gpu>("families/gemma2", "family-gemma2.safetensors", &device());
}

/// gpt-oss: attention sinks (the cubecl kernels, each row scaled by its sink weight), biased
/// projections, a sparse layer's routing and fused experts, YaRN.
#[test]
fn gpt_oss_logits_loss_and_every_gradient() {
    crate::models::check_model_on::<Gpu>(
        "families/gpt_oss",
        "family-gpt_oss.safetensors",
        &device(),
    );
}

/// The cubecl fused attention (src/kernels/cube_attention.rs) against burn's composed path on
/// wgpu, values and q, k, v gradients within 1e-5: the CPU kernel's cases.
#[test]
fn fused_attention_matches_the_composed_path_with_gradients() {
    crate::kernels::fused_attention_cases::<Wgpu>(&device());
}

#[test]
fn lora_logits_loss_gradients_and_adamw_step() {
    crate::lora::check_lora_and_adamw_step::<Gpu>(&device());
}

#[test]
fn dora_logits_loss_gradients_adamw_step_and_merge() {
    crate::dora::check_dora::<Gpu>(&device());
}

#[test]
fn qlora_logits_loss_gradients_and_merged_export() {
    crate::qlora::check_against_torchtune::<Gpu>("lora", "tiny-llama-nf4-lora", 24, &device());
}

#[test]
fn dpo_log_probs_rewards_loss_and_gradients() {
    crate::dpo::check_lora_dpo::<Gpu>(&device());
}

#[test]
fn kd_logits_losses_and_gradients() {
    crate::kd::check_kd_step::<Gpu>(&device());
}

#[test]
fn qat_fake_quantizers_bit_for_bit() {
    crate::qat::check_int4_weight_fake_quant::<Wgpu>(&device());
    crate::qat::check_int8_activation_fake_quant::<Wgpu>(&device());
}

#[test]
fn qat_logits_loss_and_gradients() {
    crate::qat::check_qat_model::<Gpu>(&device());
}

#[test]
fn greedy_decoding_with_and_without_the_kv_cache() {
    crate::generate::check_greedy_decoding::<Wgpu>(&device());
}

/// The whole LoRA recipe through the binary on `device: wgpu`: it trains (the loss falls), and
/// its first loss (LoRA's B starts at zero, so the base model's) is the CPU run's.
#[test]
fn lora_recipe_trains_on_wgpu() {
    let losses = |device: &str| {
        let out = temp_dir(&format!("gpu-lora-{device}"));
        let run = tiny_lora(&out, &[&format!("device={device}"), "epochs=2"]);
        let stderr = String::from_utf8_lossy(&run.stderr).to_string();
        assert!(run.status.success(), "tune on {device} failed:\n{stderr}");
        let metrics = read_metrics(&out.path().join("logs/metrics.jsonl"));
        (column(&metrics, "loss"), stderr)
    };
    let (gpu, stderr) = losses("wgpu");
    assert!(
        stderr.contains("device: wgpu on"),
        "names its adapter:\n{stderr}"
    );
    let (first, last) = (gpu[0], *gpu.last().unwrap());
    assert!(last < first, "the loss falls on wgpu: {gpu:?}");
    let (cpu, _) = losses("cpu");
    assert_eq!(cpu.len(), gpu.len(), "as many logged steps");
    assert!(
        (cpu[0] - gpu[0]).abs() <= 1e-4,
        "first loss: cpu {} vs wgpu {}",
        cpu[0],
        gpu[0]
    );
}

/// `enable_activation_offloading: True` on wgpu: each decoder layer's input, all activation
/// checkpointing keeps, waits in host memory between its forward and (one layer ahead of) its
/// backward, logged as `offloaded_activation_bytes`; the run trains exactly as checkpointing
/// alone does. Both log the device's own memory (`peak_memory_active`, `peak_memory_reserved`).
#[test]
fn activation_offloading_on_wgpu_trains_as_checkpointing_alone() {
    let run = |extra: &[&str]| {
        let out = temp_dir("gpu-offload");
        let mut args = vec![
            "device=wgpu",
            "max_steps_per_epoch=3",
            "clip_grad_norm=1.0",
            "enable_activation_checkpointing=True",
        ];
        args.extend_from_slice(extra);
        let res = tiny_lora(&out, &args);
        let stderr = String::from_utf8_lossy(&res.stderr).to_string();
        assert!(res.status.success(), "{stderr}");
        read_metrics(&out.path().join("logs/metrics.jsonl"))
    };
    let kept = run(&[]);
    let offloaded = run(&["enable_activation_offloading=True"]);
    for key in ["loss", "grad_norm"] {
        let (a, b) = (column(&offloaded, key), column(&kept, key));
        assert_eq!(a.len(), b.len(), "{key}: steps");
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-6 * y.abs(), "{key}: {a:?} vs {b:?}");
        }
    }
    assert!(kept[0].get("offloaded_activation_bytes").is_none());
    // The device's own memory, as cubecl's memory manager counts it (GiB, torchtune's names).
    // (The tiny model's two layers cannot show offloading's saving: one layer ahead is both.)
    let peak = |m: &[serde_json::Value], key: &str| column(m, key).into_iter().fold(0.0, f64::max);
    let (active_kept, active_offloaded) = (
        peak(&kept, "peak_memory_active"),
        peak(&offloaded, "peak_memory_active"),
    );
    eprintln!("peak_memory_active: {active_kept} GiB kept, {active_offloaded} GiB offloaded");
    for (metrics, active) in [(&kept, active_kept), (&offloaded, active_offloaded)] {
        assert!(active > 0.0 && peak(metrics, "peak_memory_reserved") >= active);
    }
    let bytes = column(&offloaded, "offloaded_activation_bytes");
    // Every layer's input of the largest micro-batch: layers x rows x positions x hidden x 4.
    let layers_times_hidden = 2.0 * 64.0 * 4.0;
    assert!(
        bytes
            .iter()
            .all(|&b| b > 0.0 && b % layers_times_hidden == 0.0),
        "{bytes:?}"
    );
}

/// What wgpu cannot do is refused by name before anything loads: bf16 (WGSL has no bf16), no
/// adapter at all (here: a Vulkan loader pointed at no driver), several workers on one adapter.
#[test]
fn unsupported_wgpu_runs_are_refused_by_name() {
    let out = temp_dir("gpu-refusals");
    let res = tiny_lora(&out, &["device=wgpu", "dtype=bf16"]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(1), "{err}");
    assert!(
        err.contains("dtype: bf16 is not supported on this device") && err.contains("use fp32"),
        "{err}"
    );

    let output_dir = format!("output_dir={}", out.path().display());
    let res = tune_command(&[
        "run",
        "lora_finetune_single_device",
        "--config",
        "tiny/lora_single_device",
        &output_dir,
        "device=wgpu",
    ])
    .env("VK_ICD_FILENAMES", "/nonexistent/icd.json")
    .env("VK_DRIVER_FILES", "/nonexistent/icd.json")
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(2), "{err}");
    assert!(
        err.contains("no Vulkan adapter was found") && err.contains("mesa-vulkan-drivers"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");

    let res = tune(&[
        "run",
        "--nproc_per_node",
        "2",
        "lora_finetune_distributed",
        "--config",
        "tiny/lora",
        &output_dir,
        "device=wgpu",
    ]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(2), "{err}");
    assert!(
        err.contains("device: wgpu runs one worker per node"),
        "{err}"
    );
}

/// `tune bench` of the tiny shape's LoRA step on wgpu, one row of `seq_len` tokens, plus `extra`.
fn tiny_lora_bench(seq_len: &str, extra: &[&str]) -> std::process::Output {
    let args = [
        "bench",
        "--shape",
        "tiny",
        "--mode",
        "lora",
        "--device",
        "wgpu",
        "--batch-size",
        "1",
        "--seq-len",
        seq_len,
    ];
    tune(&[&args[..], extra].concat())
}

/// A buffer the device cannot allocate stops the run by name. cubecl makes buffers on its
/// device thread, and a failed one only logs "Task failed" there: the run went on and reported
/// figures from memory never written. Composed attention at 4096 tokens asks for the tiny
/// shape's 4 heads x 4096^2 fp32 scores, 256 MiB: beyond lavapipe's 128 MiB (on a device that
/// allocates it, the same run must simply succeed).
#[test]
fn a_buffer_the_device_cannot_allocate_stops_the_run_by_name() {
    let scores: u64 = 4 * 4096 * 4096 * 4;
    let largest = tune::device::largest_buffer(&device()).expect("a device limit");
    let res = tiny_lora_bench("4096", &["--steps", "2", "--attention", "composed"]);
    let err = String::from_utf8_lossy(&res.stderr);
    if largest >= scores {
        assert!(res.status.success(), "{largest} bytes at once:\n{err}");
        return;
    }
    assert_eq!(res.status.code(), Some(1), "{err}");
    assert!(
        err.contains("step 1 did not run as computed")
            && err.contains(&format!("can't allocate buffer of size: {scores}"))
            && err.contains("keep attention: fused"),
        "{err}"
    );
    assert!(
        !String::from_utf8_lossy(&res.stdout).contains("tokens/s"),
        "no figures from the failed step"
    );
}

/// `tune bench --attention-block` caps the cubecl attention kernels' block, so that one GPU run
/// can time each block, and the report names the block taken. Another block sums the same
/// terms in another order: the losses agree within rounding.
#[test]
fn the_attention_block_cap_is_taken_and_reported() {
    let bench = |extra: &[&str]| {
        let args = [&["--steps", "1", "--json"][..], extra].concat();
        let res = tiny_lora_bench("100", &args);
        assert!(
            res.status.success(),
            "{}",
            String::from_utf8_lossy(&res.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&res.stdout).expect("one JSON report")
    };
    let (free, capped) = (bench(&[]), bench(&["--attention-block", "8"]));
    assert_eq!(capped["attention_block"], 8, "{capped}");
    assert!(free["attention_block"].as_u64().unwrap_or(0) > 8, "{free}");
    let losses = |r: &serde_json::Value| -> Vec<f64> {
        r["losses"]
            .as_array()
            .expect("losses")
            .iter()
            .filter_map(|l| l.as_f64())
            .collect()
    };
    let (a, b) = (losses(&free), losses(&capped));
    assert_eq!(a.len(), 3);
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "{a:?} against {b:?}");
    }
}

/// NF4 weights dequantize on the device (codes and block scales uploaded once), bit for bit
/// as the host decodes them, in both row orders.
#[test]
fn nf4_dequantizes_on_the_device_as_on_the_host() {
    use tune::modules::frozen_nf4::{FrozenNf4, RowOrder};
    use tune::modules::nf4::Nf4Dtype;
    let (out, inp) = (256, 128);
    let w: Vec<f32> = (0..out * inp)
        .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 0.1)
        .collect();
    for order in [RowOrder::Stored, RowOrder::RopeInterleaved { head_dim: 64 }] {
        let q = FrozenNf4::quantize(&w, [out, inp], Nf4Dtype::Bf16, Nf4Dtype::F32, order).unwrap();
        for pass in ["upload", "cached"] {
            let got = HostTensor::from_tensor(&q.to_tensor::<Wgpu>(&device()));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got.data), bits(&q.dequantize()), "{order:?}, {pass}");
        }
    }
}

/// `tune run generate` on `device: wgpu`: the model runs on the cubecl backend and greedy
/// decoding (top_k 1) writes the CPU run's text.
#[test]
fn generate_on_wgpu_writes_the_cpus_text() {
    let text = |device: &str| {
        let device = format!("device={device}");
        let out = tune_ok(&[
            "run",
            "generate",
            "--config",
            "tiny/generation",
            &device,
            "top_k=1",
            "max_new_tokens=12",
        ]);
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let gpu = text("wgpu");
    assert!(!gpu.trim().is_empty(), "generated nothing");
    assert_eq!(gpu, text("cpu"));
}

/// FSDP's CPU offload through `tune run` on wgpu (`fsdp_cpu_offload: True`): full fine-tuning
/// with accumulation and clipping on two nodes (processes over loopback, one wgpu worker each),
/// with and without offload, and on one worker with it (FSDP over one rank, twice the batch):
/// the same losses, clipped norms, weights and AdamW state; with offload no weight is on the
/// device between steps, all of it in host memory.
#[test]
fn fsdp_cpu_offload_on_two_wgpu_nodes_trains_as_without_it() {
    use crate::distributed::{
        assert_same_curve, assert_same_tensors, column_by_step, model_of, optimizer_of,
        train_on_two_nodes,
    };
    let common = [
        "device=wgpu",
        "max_steps_per_epoch=3",
        "gradient_accumulation_steps=2",
        "clip_grad_norm=0.5",
        "optimizer.lr=1e-4",
    ];
    let with = |extra: &[&'static str]| {
        let mut all = common.to_vec();
        all.extend_from_slice(extra);
        all
    };
    let on_device = temp_dir("gpu-fsdp");
    train_on_two_nodes(
        "full_finetune_distributed",
        "tiny/full",
        &on_device,
        2,
        &common,
    );
    let offloaded = temp_dir("gpu-fsdp-offload");
    train_on_two_nodes(
        "full_finetune_distributed",
        "tiny/full",
        &offloaded,
        2,
        &with(&["fsdp_cpu_offload=True"]),
    );
    let one_rank = temp_dir("gpu-fsdp-offload-1");
    crate::distributed::train(
        1,
        "full_finetune_distributed",
        "tiny/full",
        &one_rank,
        4,
        &with(&["fsdp_cpu_offload=True"]),
    );
    let want_norms = column_by_step(on_device.path(), "grad_norm");
    assert!(want_norms.iter().all(|(_, n)| *n > 0.5), "{want_norms:?}");
    let epoch = |dir: &TempDir| dir.path().join("epoch_0");
    for (what, dir) in [("two nodes", &offloaded), ("one rank", &one_rank)] {
        for key in ["loss", "grad_norm"] {
            assert_same_curve(
                &format!("{what}: {key}"),
                &column_by_step(dir.path(), key),
                &column_by_step(on_device.path(), key),
                1e-4,
            );
        }
        assert_same_tensors(
            what,
            model_of(&epoch(dir)),
            model_of(&epoch(&on_device)),
            1e-5,
        );
        assert_same_tensors(
            what,
            optimizer_of(&epoch(dir)),
            optimizer_of(&epoch(&on_device)),
            1e-5,
        );
    }
    // Full fine-tuning shards every weight: with offload rank 0 keeps none on the device, its
    // rows in host memory, as many bytes as the run without offload keeps on the device.
    let first = |dir: &TempDir, key: &str| column_by_step(dir.path(), key)[0].1;
    assert_eq!(first(&offloaded, "parameter_bytes"), 0.0);
    assert_eq!(
        first(&offloaded, "offloaded_parameter_bytes"),
        first(&on_device, "parameter_bytes")
    );
    assert_eq!(first(&offloaded, "optimizer_state_bytes"), 0.0);
    assert_eq!(
        first(&offloaded, "offloaded_optimizer_state_bytes"),
        first(&on_device, "optimizer_state_bytes")
    );
}
