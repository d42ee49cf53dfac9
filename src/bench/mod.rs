//! `tune bench`: throughput, step-time split, memory, load time, checkpoint blocking and the
//! machine's matmul peak, on random weights of a known shape and synthetic tokens.

pub mod shapes;

use std::path::Path;
use std::time::{Duration, Instant};

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, ElementConversion, Tensor};
use rand::{Rng, SeedableRng};

use crate::checkpoint::StorageDtype;
use crate::data::{SftSample, collate_sft};
use crate::model_io::hf::{DEFAULT_MAX_SHARD_BYTES, load_model_with, save_model};
use crate::models::adapters::attach_lora;
use crate::models::{BaseWeights, ModelArgs, RandomInit, Trainable, build};
use crate::modules::LoraSettings;
use crate::modules::nf4::Nf4Dtype;
use crate::precision;
use crate::precision::Dtype;
use crate::training::activation_checkpointing::Checkpointing;
use crate::training::memory::{enter_training_steady_state, reset_peak_memory};
use crate::training::metrics::{MetricLoggers, peak_memory_bytes};
use crate::training::optimizer::{Optimizer, OptimizerKind, OptimizerSettings};
use crate::training::parallel::Parallelism;
use crate::training::schedule::Schedule;
use crate::training::sft::{self, SftLoss};
use crate::training::{LossStep, StepInfo, StepTimes, TrainState, Trainer, TrainerSettings};

/// What a benchmark step runs (`tune bench --mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchMode {
    /// The validation forward pass (no autodiff).
    Forward,
    Lora,
    /// LoRA with DoRA's magnitudes (peft's `use_dora`).
    Dora,
    /// LoRA on an NF4 base (torchtune's `qlora_*`).
    Qlora,
    /// DoRA on an NF4 base (torchtune's QDoRA).
    Qdora,
    Full,
}

/// `tune bench --dtype`: the dtypes training runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchDtype {
    Fp32,
    Bf16,
}

impl From<BenchDtype> for Dtype {
    fn from(d: BenchDtype) -> Self {
        match d {
            BenchDtype::Fp32 => Dtype::Fp32,
            BenchDtype::Bf16 => Dtype::Bf16,
        }
    }
}

pub use crate::config::schema::Attention;

impl BenchMode {
    /// Adapters train, the base is frozen.
    pub fn is_adapter(self) -> bool {
        matches!(self, Self::Lora | Self::Dora | Self::Qlora | Self::Qdora)
    }

    /// The decoder's linear base weights are stored in NF4.
    pub fn is_nf4(self) -> bool {
        matches!(self, Self::Qlora | Self::Qdora)
    }

    fn is_dora(self) -> bool {
        matches!(self, Self::Dora | Self::Qdora)
    }
}

#[derive(Debug, Clone)]
pub struct BenchSettings {
    pub shape: String,
    pub mode: BenchMode,
    pub batch_size: usize,
    pub seq_len: usize,
    pub steps: usize,
    pub lora_rank: usize,
    /// Per-layer activation checkpointing, offloaded or not (forward and backward interleave,
    /// so the step time is reported whole, under backward).
    pub checkpointing: Checkpointing,
    /// The run's float dtype, as a config's `dtype` (bf16 is what GPU runs use).
    pub dtype: Dtype,
    /// `loss.num_output_chunks` (chunked output projection and loss when it is frozen).
    pub output_chunks: usize,
    /// The CPU's fused attention (fp32 on Flex), or burn's composed ops to compare against.
    pub attention: Attention,
    /// The largest block the cubecl attention kernels may take (cuda / wgpu); `None`: the
    /// largest the device holds.
    pub attention_block: Option<usize>,
    /// Real row lengths, taken `batch_size` at a time (cut to `seq_len`) and padded to each
    /// step's longest; `None`: every row `seq_len` long.
    pub row_lengths: Option<Vec<usize>>,
    /// With `row_lengths`: compute the padded batch as it is instead of padding-free packs.
    pub keep_padding: bool,
}

/// The `lengths` of a `--row-lengths` file (`{"lengths": [312, 140, ...]}`).
pub fn read_row_lengths(path: &Path) -> Result<Vec<usize>, BenchError> {
    #[derive(serde::Deserialize)]
    struct File {
        lengths: Vec<usize>,
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| BenchError::Failed(format!("{}: {e}", path.display())))?;
    let file: File = serde_json::from_str(&text).map_err(|e| {
        BenchError::Failed(format!(
            "{}: {e}; expected {{\"lengths\": [row lengths, ...]}}",
            path.display()
        ))
    })?;
    if file.lengths.is_empty() || file.lengths.contains(&0) {
        return Err(BenchError::Failed(format!(
            "{}: `lengths` needs at least one length, none of them 0",
            path.display()
        )));
    }
    Ok(file.lengths)
}

#[derive(Debug, Clone, Default)]
pub struct BenchReport {
    pub params: usize,
    pub save_seconds: f64,
    pub load_seconds: f64,
    pub tokens_per_second: f64,
    pub forward_seconds: f64,
    pub backward_seconds: f64,
    pub optimizer_seconds: f64,
    pub step_seconds: f64,
    pub peak_memory_bytes: u64,
    /// On a GPU: the most device memory the training steps' samples saw (the process's RSS
    /// above is the host's).
    pub device_memory: Option<crate::device::DeviceMemory>,
    pub achieved_flops: f64,
    pub matmul_peak_flops: f64,
    /// NF4 modes: bytes the quantized base weights hold per parameter they store.
    pub nf4_bytes_per_param: f64,
    /// Checkpoint: training blocked per save (host snapshot) vs a synchronous save of the same state.
    pub snapshot_seconds: f64,
    pub sync_save_seconds: f64,
    pub checkpoint_bytes: u64,
    /// Each training step's loss, the unmeasured first steps included: the same data and
    /// weights every run (seeded), so two runs that differ only in a kernel (`--attention`)
    /// must give the same losses.
    pub losses: Vec<f64>,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("unknown shape `{0}`; known: {known}", known = shapes::SHAPES.join(", "))]
    UnknownShape(String),
    #[error("{0}")]
    Failed(String),
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Float multiply-adds of one step: 2 * params * tokens forward (+ attention), x3 with backward;
/// a mixture of experts counts the experts each token computes with, not all of them.
fn step_flops(args: &ModelArgs, tokens: usize, seq: usize, mode: BenchMode) -> f64 {
    let dense = 2.0 * args.active_params() as f64 * tokens as f64;
    let attention =
        4.0 * args.num_layers as f64 * args.q_dim() as f64 * seq as f64 * tokens as f64 / 2.0;
    let forward = dense + attention;
    match mode {
        BenchMode::Forward => forward,
        // Frozen weights need no weight gradients: backward is about one forward.
        BenchMode::Lora | BenchMode::Dora | BenchMode::Qlora | BenchMode::Qdora => 2.0 * forward,
        BenchMode::Full => 3.0 * forward,
    }
}

/// The best of a few square matmuls, in FLOP/s: the machine's practical peak on this backend.
pub fn matmul_peak<B: burn::tensor::backend::Backend>(device: &B::Device) -> f64 {
    let n = 1024;
    let a = Tensor::<B, 2>::random([n, n], Distribution::Default, device);
    let b = Tensor::<B, 2>::random([n, n], Distribution::Default, device);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let c = a.clone().matmul(b.clone());
        let _: f32 = c.slice([0..1, 0..1]).into_scalar().elem();
        best = best.min(secs(t.elapsed()));
    }
    2.0 * (n as f64).powi(3) / best
}

pub fn run<B: AutodiffBackend>(
    s: &BenchSettings,
    device: &B::Device,
    scratch: &Path,
) -> Result<BenchReport, BenchError> {
    let config =
        shapes::config(&s.shape).ok_or_else(|| BenchError::UnknownShape(s.shape.clone()))?;
    precision::set_device_dtype::<B>(device, s.dtype, precision::Use::Training)
        .map_err(|e| BenchError::Failed(e.to_string()))?;
    let args = ModelArgs::from_json(config).map_err(BenchError::Failed)?;
    crate::kernels::set_fused_attention(s.attention == Attention::Fused);
    crate::kernels::set_attention_block_cap(s.attention_block);
    let fail = |e: &dyn std::fmt::Display| BenchError::Failed(e.to_string());
    let mut report = BenchReport {
        params: args.num_params(),
        ..Default::default()
    };

    // Save and load a checkpoint of this shape.
    let model =
        build::<B::InnerBackend>(&args, &mut RandomInit::new(0, &args), &Default::default())
            .map_err(|e| fail(&e))?;
    // A fresh folder for each run: two benches of one shape at once (the test suite's) must
    // not write and remove each other's checkpoint, and it goes when the run ends, failed or
    // not.
    let scratch_dir = tempfile::Builder::new()
        .prefix(&format!("bench-{}-", s.shape))
        .tempdir_in(scratch)
        .map_err(|e| fail(&e))?;
    let dir = scratch_dir.path();
    let t = Instant::now();
    save_model(
        &model,
        dir,
        None,
        StorageDtype::F32,
        DEFAULT_MAX_SHARD_BYTES,
    )
    .map_err(|e| fail(&e))?;
    report.save_seconds = secs(t.elapsed());
    drop(model);
    let t = Instant::now();
    let base = if s.mode.is_nf4() {
        BaseWeights::Nf4(match s.dtype {
            Dtype::Bf16 => Nf4Dtype::Bf16,
            _ => Nf4Dtype::F32,
        })
    } else {
        BaseWeights::Float
    };
    let mut model = load_model_with::<B>(dir, None, device, base)
        .map_err(|e| fail(&e))?
        .model;
    if s.mode.is_nf4() {
        let (bytes, numel) = model
            .linears_mut()
            .iter()
            .filter_map(|(_, l)| l.nf4())
            .fold((0, 0), |(b, n), q| (b + q.bytes(), n + q.nf4.numel()));
        report.nf4_bytes_per_param = bytes as f64 / numel.max(1) as f64;
    }
    report.load_seconds = secs(t.elapsed());
    report.checkpoint_bytes = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0);

    let trainable = match s.mode {
        mode if mode.is_adapter() => {
            let targets: Vec<String> = [
                "q_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ]
            .map(String::from)
            .to_vec();
            let targets = model.args.lora_targets(&targets);
            let settings = LoraSettings {
                rank: s.lora_rank,
                alpha: 2.0 * s.lora_rank as f64,
                dropout: 0.0,
                dora: s.mode.is_dora(),
            };
            attach_lora(&mut model, &targets, &settings, 0);
            // gpt-oss: its fused experts, as the LoRA recipes adapt them for these MLP targets
            // (DoRA there is refused by the recipes, and left off here).
            if !settings.dora {
                crate::models::adapters::attach_fused_expert_lora(&mut model, &settings, 0);
            }
            Trainable::AdaptersOnly
        }
        BenchMode::Full => Trainable::All,
        _ => Trainable::Nothing,
    };
    let optimizer = Optimizer::<B::InnerBackend>::new(OptimizerSettings {
        kind: OptimizerKind::AdamW,
        weight_decay: 0.01,
        betas: (0.9, 0.999),
        eps: 1e-8,
        momentum: 0.0,
    });
    // The recipes' trainer and SFT step, timed phase by phase.
    let mut trainer = Trainer::new(
        TrainerSettings {
            epochs: 1,
            max_steps_per_epoch: None,
            gradient_accumulation_steps: 1,
            clip_grad_norm: None,
            log_every_n_steps: 1,
            save_every_n_steps: None,
            lr: 1e-5,
            schedule: Schedule::Constant,
            seed: 0,
            save_on_preempt: false,
            log_memory: true,
            show_progress: false,
            time_phases: true,
        },
        model.set_trainable(trainable),
        optimizer,
        TrainState::default(),
        MetricLoggers { sinks: Vec::new() },
        Parallelism::single(),
    );
    let mut loss_step = SftLoss {
        fake_quant_after: None,
        activation_checkpointing: s.checkpointing,
        output_chunks: s.output_chunks,
        padding_free: !s.keep_padding,
    };

    // Peak memory is the training phase's: the save/load above peaks differently per
    // allocator and is measured by its own timing.
    enter_training_steady_state();
    reset_peak_memory();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let mut times = StepTimes::default();
    // The timed steps' labelled tokens (padding excluded) and their useful float operations.
    let (mut timed_tokens, mut timed_flops) = (0usize, 0.0);
    let mut next_row = 0usize;
    // Two unmeasured steps: the first creates the optimizer state and the second still
    // faults in fresh pages around it (the allocator reaches its steady state on the third:
    // SmolLM2-135M full fine-tuning read 70 tokens/s over steps 2-3 and 121 over steps 2-9).
    // benches/pytorch_reference.py warms up the same way.
    let warmup = 2;
    for i in 0..s.steps + warmup {
        let rows: Vec<SftSample> = (0..s.batch_size)
            .map(|_| {
                let len = s.row_lengths.as_ref().map_or(s.seq_len, |lengths| {
                    next_row += 1;
                    lengths[(next_row - 1) % lengths.len()].min(s.seq_len)
                });
                let tokens: Vec<u32> = (0..len)
                    .map(|_| rng.random_range(0..args.vocab_size as u32))
                    .collect();
                let labels = tokens.iter().map(|&t| t as i64).collect();
                SftSample {
                    tokens,
                    labels,
                    images: Vec::new(),
                }
            })
            .collect();
        let batch = collate_sft(&rows.iter().collect::<Vec<_>>(), 0);
        let (step_times, tokens) = if s.mode == BenchMode::Forward {
            // The trainer's validation step: the loss without autodiff, dropout off.
            let info = StepInfo {
                epoch: 0,
                global_step: i,
                seed: 0,
            };
            let started = Instant::now();
            let eval = trainer.model.valid();
            // The loss is read to the host: the forward pass has finished.
            LossStep::<B>::evaluate(&mut loss_step, &eval, &batch, info).map_err(|e| fail(&e))?;
            let step_times = StepTimes {
                forward: started.elapsed(),
                ..Default::default()
            };
            (step_times, sft::labelled_tokens(&batch))
        } else {
            let done;
            (trainer, done) = trainer
                .train_step(std::slice::from_ref(&batch), &mut loss_step)
                .map_err(|e| fail(&e))?;
            report.losses.push(done.loss);
            if let Some(now) = done.device_memory {
                report.device_memory = Some(report.device_memory.map_or(now, |m| m.max(now)));
            }
            (done.times.unwrap_or_default(), done.tokens)
        };
        if i >= warmup {
            timed_tokens += tokens;
            timed_flops += step_flops(&args, tokens, batch.seq_len, s.mode);
            times.forward += step_times.forward;
            times.backward += step_times.backward;
            times.optimizer += step_times.optimizer;
        }
    }
    let n = s.steps as f64;
    let (fwd, bwd, opt) = (
        secs(times.forward),
        secs(times.backward),
        secs(times.optimizer),
    );
    report.forward_seconds = fwd / n;
    report.backward_seconds = bwd / n;
    report.optimizer_seconds = opt / n;
    report.step_seconds = (fwd + bwd + opt) / n;
    report.tokens_per_second = timed_tokens as f64 / (fwd + bwd + opt);
    report.peak_memory_bytes = peak_memory_bytes();
    report.achieved_flops = timed_flops / (fwd + bwd + opt);
    report.matmul_peak_flops = matmul_peak::<B::InnerBackend>(&Default::default());
    let (mut model, optimizer) = (trainer.model, trainer.optimizer);

    // Checkpointing: what blocks training (the host snapshot) vs writing it all synchronously.
    if s.mode != BenchMode::Forward {
        let t = Instant::now();
        let state = if s.mode.is_adapter() {
            crate::model_io::peft::adapter_state_dict(&mut model)
        } else {
            model.hf_state_dict()
        };
        let optim_state = optimizer.state_dict();
        report.snapshot_seconds = secs(t.elapsed());
        let t = Instant::now();
        let out = dir.join("ckpt");
        std::fs::create_dir_all(&out).map_err(|e| fail(&e))?;
        let state = if s.mode.is_adapter() {
            state
        } else {
            model.hf_state_dict()
        };
        crate::checkpoint::safetensors_io::write_file(
            &out.join("weights.safetensors"),
            &state,
            StorageDtype::F32,
        )
        .map_err(|e| fail(&e))?;
        crate::checkpoint::safetensors_io::write_file(
            &out.join("optimizer.safetensors"),
            &optim_state,
            StorageDtype::F32,
        )
        .map_err(|e| fail(&e))?;
        for f in ["weights.safetensors", "optimizer.safetensors"] {
            if let Ok(file) = std::fs::File::open(out.join(f)) {
                let _ = file.sync_all();
            }
        }
        report.sync_save_seconds = report.snapshot_seconds + secs(t.elapsed());
    }
    Ok(report)
}

impl BenchReport {
    /// One JSON object with the keys `benches/pytorch_reference.py` prints, so
    /// `benches/compare.py` can put the two side by side.
    pub fn to_json(&self, s: &BenchSettings) -> serde_json::Value {
        serde_json::json!({
            "impl": "tune",
            "shape": s.shape,
            "mode": format!("{:?}", s.mode).to_lowercase(),
            "dtype": precision::name(s.dtype),
            "output_chunks": s.output_chunks,
            "attention": match s.attention {
                Attention::Fused => "fused",
                Attention::Composed => "composed",
            },
            "attention_block": crate::kernels::attention_block_used(),
            "row_lengths": s.row_lengths.is_some(),
            "padding": if s.keep_padding { "kept" } else { "free" },
            "batch_size": s.batch_size,
            "seq_len": s.seq_len,
            "params": self.params,
            "tokens_per_second": self.tokens_per_second,
            "step_seconds": self.step_seconds,
            "forward_seconds": self.forward_seconds,
            "backward_seconds": self.backward_seconds,
            "optimizer_seconds": self.optimizer_seconds,
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_device_memory_active_bytes": self.device_memory.map(|m| m.in_use),
            "peak_device_memory_reserved_bytes": self.device_memory.map(|m| m.reserved),
            "load_seconds": self.load_seconds,
            "achieved_flops": self.achieved_flops,
            "matmul_peak_flops": self.matmul_peak_flops,
            "nf4_bytes_per_param": self.nf4_bytes_per_param,
            "losses": self.losses,
        })
    }

    pub fn to_markdown(&self, s: &BenchSettings) -> String {
        let gb = |b: u64| b as f64 / 1e9;
        let mut out = format!(
            "| shape | mode | batch x seq | params | tokens/s | step s (fwd / bwd / opt) | peak RSS GB | load s | MFU vs matmul peak |\n\
             |---|---|---|---|---|---|---|---|---|\n\
             | {} | {:?} {}{}{} | {}x{} | {:.1}M | {:.0} | {:.3} ({:.3} / {:.3} / {:.3}) | {:.2} | {:.2} | {:.1}% of {:.0} GFLOP/s |\n",
            s.shape,
            s.mode,
            precision::name(s.dtype),
            match s.attention {
                Attention::Fused => "",
                Attention::Composed => ", composed attention",
            },
            match (&s.row_lengths, s.keep_padding) {
                (None, _) => "",
                (Some(_), false) => ", real row lengths padding-free",
                (Some(_), true) => ", real row lengths padded",
            },
            s.batch_size,
            s.seq_len,
            self.params as f64 / 1e6,
            self.tokens_per_second,
            self.step_seconds,
            self.forward_seconds,
            self.backward_seconds,
            self.optimizer_seconds,
            gb(self.peak_memory_bytes),
            self.load_seconds,
            100.0 * self.achieved_flops / self.matmul_peak_flops.max(1.0),
            self.matmul_peak_flops / 1e9,
        );
        if let Some(device) = self.device_memory {
            out.push_str(&format!(
                "\nDevice memory (cubecl's memory manager, sampled in each step): peak {:.3} GB in use, {:.3} GB reserved\n",
                gb(device.in_use),
                gb(device.reserved)
            ));
        }
        if self.nf4_bytes_per_param > 0.0 {
            out.push_str(&format!(
                "\nNF4 base weights: {:.4} bytes per parameter\n",
                self.nf4_bytes_per_param
            ));
        }
        if self.sync_save_seconds > 0.0 {
            out.push_str(&format!(
                "\ncheckpoint: training blocked {:.3} s per save (host snapshot) vs {:.3} s for a synchronous save ({:.1}x); model checkpoint {:.1} MB saved in {:.2} s ({:.0} MB/s)\n",
                self.snapshot_seconds,
                self.sync_save_seconds,
                self.sync_save_seconds / self.snapshot_seconds.max(1e-9),
                self.checkpoint_bytes as f64 / 1e6,
                self.save_seconds,
                self.checkpoint_bytes as f64 / 1e6 / self.save_seconds.max(1e-9),
            ));
        }
        out
    }
}
