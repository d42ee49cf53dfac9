//! FSDP's CPU offload (`fsdp_cpu_offload: True`): each rank's rows of every weight, their
//! gradients and their AdamW state in host memory, the optimizer step run there. A run offloads
//! only on a GPU (on the CPU the config says it changes nothing); the machinery itself is any
//! backend's, so here it runs on the CPU backend, FSDP over one rank, against the same trainer
//! without it: the same bits. (`gpu::fsdp_cpu_offload_on_two_wgpu_nodes_trains_as_without_it`
//! runs it through `tune run` on wgpu.)

use burn::module::AutodiffModule;
use tune::distributed::World;
use tune::models::{CausalLm, Trainable};
use tune::training::metrics::MetricLoggers;
use tune::training::optimizer::{Optimizer, OptimizerKind, OptimizerSettings};
use tune::training::parallel::Parallelism;
use tune::training::parallel::fsdp::Sharding;
use tune::training::sft::SftLoss;
use tune::training::{TrainState, Trainer};

use crate::support::*;
use crate::trainer::{batch, rows, settings};

fn adamw() -> OptimizerSettings {
    OptimizerSettings {
        kind: OptimizerKind::AdamW,
        weight_decay: 0.01,
        betas: (0.9, 0.999),
        eps: 1e-8,
        momentum: 0.0,
    }
}

/// Full fine-tuning of tiny-llama, FSDP over one rank, clipping at a norm the steps exceed.
fn trainer(cpu_offload: bool) -> Trainer<CpuAutodiff> {
    trainer_from(cpu_offload, Optimizer::new(adamw()))
}

/// The same, from `optimizer` (a resumed run's restored state).
fn trainer_from(cpu_offload: bool, optimizer: Optimizer<Cpu>) -> Trainer<CpuAutodiff> {
    let model = tune::model_io::hf::load_model::<CpuAutodiff>(
        &fixture("tiny-llama"),
        None,
        &Default::default(),
    )
    .unwrap()
    .model
    .set_trainable(Trainable::All);
    let world = World::single();
    let sharding = Sharding {
        reshard_after_forward: true,
        cpu_offload,
    };
    let (model, parallel) = Parallelism::new(model, world, Some(sharding), false, &adamw());
    Trainer::new(
        settings(3, Some(0.5), 1e-3),
        model,
        optimizer,
        TrainState::default(),
        MetricLoggers { sinks: Vec::new() },
        parallel,
    )
}

/// Every weight, whole, by name (an offloaded run's read from host memory).
fn weights(model: &CausalLm<CpuAutodiff>) -> Vec<(String, Vec<f32>)> {
    model
        .unsharded()
        .valid()
        .hf_state_dict()
        .into_iter()
        .map(|(name, t)| (name, t.data))
        .collect()
}

#[test]
fn offloaded_rows_train_bit_for_bit_as_on_the_device_and_leave_none_there() {
    let rows = rows();
    let micro = [batch(&rows[..1]), batch(&rows[1..3]), batch(&rows[3..])];
    let (mut plain, mut offloaded) = (trainer(false), trainer(true));
    let whole_bytes = plain.model.parameter_bytes();
    // Nothing of the weights stays on the device; all of it is in host memory.
    assert_eq!(offloaded.model.parameter_bytes(), 0);
    assert_eq!(offloaded.model.offloaded_parameter_bytes(), whole_bytes);
    assert_eq!(weights(&offloaded.model), weights(&plain.model));
    let before = weights(&plain.model);
    for step in 0..3 {
        let (p, want) = plain.train_step(&micro, &mut SftLoss::default()).unwrap();
        let (o, got) = offloaded
            .train_step(&micro, &mut SftLoss::default())
            .unwrap();
        (plain, offloaded) = (p, o);
        assert_eq!(got.loss, want.loss, "step {step}'s loss");
        let norm = want.grad_norm.expect("clipping logs the norm");
        assert!(norm > 0.5, "the step is clipped: its norm is {norm}");
        assert_eq!(got.grad_norm, want.grad_norm, "step {step}'s norm");
        // The step's gradient rows were in host memory, as many bytes as on the device.
        assert_eq!(got.gradient_bytes.device, 0);
        assert!(want.gradient_bytes.device > 0);
        assert_eq!(got.gradient_bytes.offloaded, want.gradient_bytes.device);
    }
    let after = weights(&offloaded.model);
    assert_eq!(after, weights(&plain.model));
    let moved = after
        .iter()
        .zip(&before)
        .filter(|((_, a), (_, b))| a != b)
        .count();
    assert_eq!(moved, after.len(), "every weight trained");
    // The AdamW moments of the rows are in host memory, none on the device, and equal.
    let device_state = plain.optimizer.state_bytes();
    let host = offloaded.parallelism().offload().unwrap();
    assert_eq!(offloaded.optimizer.state_bytes(), 0);
    assert_eq!(host.state_bytes(), device_state);
    let mut want = plain.optimizer.state_dict();
    let mut got = host.state_dict();
    want.sort_by(|a, b| a.0.cmp(&b.0));
    got.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(got, want);
    assert_eq!(
        offloaded.model.parameter_bytes(),
        0,
        "still none on the device"
    );
}

/// A resumed run restores the optimizer state on the device; the offloaded rows' state moves
/// to host memory, in its dtype, with the step count, and the next step is the same.
#[test]
fn a_resumed_runs_state_moves_to_host_memory_and_steps_alike() {
    let rows = rows();
    let micro = [batch(&rows[..2]), batch(&rows[2..])];
    let (first, _) = trainer(false)
        .train_step(&micro, &mut SftLoss::default())
        .unwrap();
    let (step, state) = (first.optimizer.step, first.optimizer.state_dict());
    // The restored state meets fresh weights here: what is checked is where it goes and
    // that both runs step alike from it.
    let resumed = |cpu_offload: bool| {
        let mut optimizer = Optimizer::new(adamw());
        optimizer.load_state_dict(step, state.clone(), &Default::default());
        trainer_from(cpu_offload, optimizer)
    };
    let (plain, offloaded) = (resumed(false), resumed(true));
    assert_eq!(offloaded.optimizer.state_bytes(), 0);
    assert_eq!(
        offloaded.parallelism().offload().unwrap().state_bytes(),
        plain.optimizer.state_bytes()
    );
    let (plain, want) = plain.train_step(&micro, &mut SftLoss::default()).unwrap();
    let (offloaded, got) = offloaded
        .train_step(&micro, &mut SftLoss::default())
        .unwrap();
    assert_eq!(got.loss, want.loss);
    assert_eq!(weights(&offloaded.model), weights(&plain.model));
    assert_eq!(offloaded.optimizer.step, 2);
}
