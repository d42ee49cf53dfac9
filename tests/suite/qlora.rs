//! Golden tests for QLoRA and QDoRA against torchtune 0.6.1 + torchao 0.11 themselves
//! (tests/fixtures/make_qlora_fixtures.py): the NF4 base weights as torchtune holds them
//! (quantized in the checkpoint's bf16, in torchtune's q/k row order; dequantized in the model's
//! dtype), bit for bit; logits, loss and every adapter gradient of a QLoRA and a QDoRA model;
//! the merged export torchtune writes; and the NF4 layer's own backward.

use crate::support;

use burn::tensor::backend::{AutodiffBackend, Backend};
use support::*;
use tune::checkpoint::HostTensor;
use tune::model_io::hf::load_model_with;
use tune::model_io::peft::load_adapter;
use tune::models::{BaseWeights, CausalLm};
use tune::modules::ForwardMode;
use tune::modules::frozen_nf4::{FrozenNf4, RowOrder};
use tune::modules::nf4::Nf4Dtype;

fn qlora_base<B: Backend>(compute: Nf4Dtype, device: &B::Device) -> CausalLm<B> {
    load_model_with::<B>(
        &fixture("tiny-llama-nf4"),
        None,
        device,
        BaseWeights::Nf4(compute),
    )
    .unwrap()
    .model
}

fn qlora_model<B: AutodiffBackend>(adapter: &str, device: &B::Device) -> CausalLm<B> {
    let mut model = qlora_base::<B>(Nf4Dtype::F32, device);
    load_adapter(&mut model, &fixture(adapter)).unwrap();
    model.set_trainable(tune::models::Trainable::AdaptersOnly)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn nf4_base_weights_equal_torchtunes_bit_for_bit_in_both_model_dtypes() {
    let r = Reference::open("qlora.safetensors");
    for (prefix, compute) in [("nf4_f32", Nf4Dtype::F32), ("nf4_bf16", Nf4Dtype::Bf16)] {
        let mut model = qlora_base::<Cpu>(compute, &Default::default());
        let mut checked = 0;
        for (module, linear) in model.linears_mut() {
            let key = format!("{prefix}.dequant.{module}.weight");
            let Ok(want) = r.0.read(&key) else {
                continue;
            };
            assert!(linear.nf4().is_some(), "{module} is stored in NF4");
            let got = HostTensor::from_tensor(&linear.base_weight());
            assert_eq!(got.shape, want.shape, "{key}");
            let first = got.data.iter().zip(&want.data).position(|(a, b)| a != b);
            assert_eq!(first, None, "{key}: first differing value");
            checked += 1;
        }
        assert!(checked >= 2, "{prefix}: {checked} weights checked");
    }

    // torchtune's NF4Tensor for layer 0's q_proj: quantized from the permuted bf16 weight.
    let mut model = qlora_base::<Cpu>(Nf4Dtype::F32, &Default::default());
    let q0 = "model.layers.0.self_attn.q_proj";
    let (_, linear) = model
        .linears_mut()
        .into_iter()
        .find(|(m, _)| m == q0)
        .unwrap();
    let nf4 = &linear.nf4().unwrap().nf4;
    assert_eq!(
        nf4.dtype,
        Nf4Dtype::Bf16,
        "quantized in the checkpoint's bf16"
    );
    let codes: Vec<i64> = nf4.codes.iter().map(|&c| i64::from(c)).collect();
    assert_eq!(codes, r.i64(&format!("nf4_f32.codes.{q0}.weight")), "codes");
    let scalers: Vec<i64> = nf4.scalers.iter().map(|&s| i64::from(s)).collect();
    assert_eq!(scalers, r.i64(&format!("nf4_f32.scalers.{q0}.weight")));
    let factor = r.f32(&format!("nf4_f32.factor.{q0}.weight"));
    assert_eq!(bits(&nf4.factors), bits(&factor.data), "factors");
    let mean = r.f32(&format!("nf4_f32.mean.{q0}.weight"));
    assert_eq!(nf4.mean.to_bits(), mean.data[0].to_bits(), "mean");
}

/// Where a scaler group is smaller than a head, quantizing Hugging Face's row order gives a
/// different weight from torchtune's: the fixture's `perm.*` weight tells the two apart.
#[test]
fn q_and_k_are_quantized_in_torchtunes_row_order() {
    let r = Reference::open("qlora.safetensors");
    let input = r.f32("perm.input");
    let shape = [input.shape[0], input.shape[1]];
    let bf16 = Nf4Dtype::Bf16;
    let quantize = |order| FrozenNf4::quantize(&input.data, shape, bf16, bf16, order).unwrap();
    let torchtune = quantize(RowOrder::RopeInterleaved { head_dim: 64 });
    assert_eq!(
        bits(&torchtune.dequantize()),
        bits(&r.f32("perm.dequant_torchtune").data)
    );
    let hf_order = quantize(RowOrder::Stored);
    assert_eq!(
        bits(&hf_order.dequantize()),
        bits(&r.f32("perm.dequant_hf_order").data)
    );
    assert_ne!(torchtune.dequantize(), hf_order.dequantize());
}

/// Logits, loss and every adapter gradient of torchtune's float32 QLoRA (`prefix` `lora`) or
/// QDoRA (`dora`) model, then its merged export.
pub fn check_against_torchtune<B: AutodiffBackend>(
    prefix: &str,
    adapter: &str,
    grad_count: usize,
    device: &B::Device,
) {
    let r = Reference::open("qlora.safetensors");
    let (tokens, labels, batch) = r.tokens();
    let model = qlora_model::<B>(adapter, device);
    let logits = forward_rows(&model, &tokens, batch, ForwardMode::default());
    let want = r.f32(&format!("{prefix}.logits"));
    assert_close("logits", &HostTensor::from_tensor(&logits), &want, 1e-4);
    let loss = tune::training::loss::cross_entropy(logits, &labels);
    let want = r.f32(&format!("{prefix}.loss"));
    assert_close("loss", &HostTensor::from_tensor(&loss), &want, 1e-5);

    let grads = loss.backward();
    let named = crate::grads::named_grads(&model, &grads);
    assert_eq!(named.len(), grad_count, "gradients of the adapters only");
    for (name, grad) in &named {
        let want = r.f32(&format!("{prefix}.grad.{}", to_peft(name)));
        assert_grad_close(name, grad, &want);
    }

    // The merged export: NF4 bases dequantized to bf16 as torchtune's state-dict hook does,
    // the adapter folded in; torchtune's LoRA merge adds in place into that bf16 tensor.
    let mut model = qlora_model::<B>(adapter, device);
    let mut checked = 0;
    for (name, value) in model.merged_hf_state_dict() {
        let Ok(want) = r.0.read(&format!("{prefix}.merged.{name}")) else {
            continue;
        };
        let bf16_out = prefix == "lora" || name.contains("k_proj");
        let got = if bf16_out {
            HostTensor::new(
                value.shape.clone(),
                value
                    .data
                    .iter()
                    .map(|v| half::bf16::from_f32(*v).to_f32())
                    .collect(),
            )
        } else {
            value
        };
        if name.contains("k_proj") {
            // Not adapted: exactly the bf16 dequantization.
            let first = got.data.iter().zip(&want.data).position(|(a, b)| a != b);
            assert_eq!(first, None, "merged {name}: first differing value");
        } else {
            // One bf16 step at most: torch's B @ A sums in another order.
            let tol = if bf16_out { 2e-3 } else { 1e-6 };
            assert_close(&format!("merged {name}"), &got, &want, tol);
        }
        checked += 1;
    }
    assert_eq!(checked, 3, "layer 0's q, k and v_proj");
}

#[test]
fn qlora_logits_loss_grads_and_merged_export_match_torchtune() {
    check_against_torchtune::<CpuAutodiff>("lora", "tiny-llama-nf4-lora", 24, &Default::default());
}

#[test]
fn qdora_logits_loss_grads_and_merged_export_match_torchtune() {
    check_against_torchtune::<CpuAutodiff>("dora", "tiny-llama-nf4-dora", 36, &Default::default());
}

/// The NF4 layer's own backward (it dequantizes the weight again rather than keeping it from
/// the forward pass) gives the float layer's output and input gradient.
#[test]
fn the_nf4_layer_backward_equals_the_float_layer_with_the_dequantized_weight() {
    use burn::tensor::{Tensor, TensorData};
    type B = CpuAutodiff;
    let device = Default::default();
    let (out, inp, rows) = (128, 256, 3);
    let w: Vec<f32> = (0..out * inp)
        .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 0.1)
        .collect();
    let q = FrozenNf4::quantize(
        &w,
        [out, inp],
        Nf4Dtype::F32,
        Nf4Dtype::F32,
        RowOrder::Stored,
    )
    .unwrap();
    let dq = q.dequantize();
    let x: Vec<f32> = (0..rows * inp)
        .map(|i| (i % 17) as f32 / 17.0 - 0.5)
        .collect();
    let make_x = || {
        Tensor::<B, 2>::from_data(TensorData::new(x.clone(), [rows, inp]), &device).require_grad()
    };
    let nf4 = tune::modules::Linear::<B>::new_nf4(q, None);
    let float = tune::modules::Linear::<B>::new(
        Tensor::from_data(TensorData::new(dq, [out, inp]), &device),
        None,
    );
    let mut results = Vec::new();
    for layer in [&nf4, &float] {
        let x = make_x();
        let y = layer.forward(x.clone(), ForwardMode::default());
        let loss = (y.clone() * y.clone()).sum();
        let grads = loss.backward();
        let gx = x.grad(&grads).unwrap();
        results.push((HostTensor::from_tensor(&y), HostTensor::from_tensor(&gx)));
    }
    assert_close("y", &results[0].0, &results[1].0, 1e-5);
    assert_close("grad x", &results[0].1, &results[1].1, 1e-5);
}

/// Decoding's few-row products on the CPU skip the dequantization (a fused block-by-block
/// product): greedy decoding with the NF4 model equals decoding with a float model holding the
/// dequantized weights.
#[test]
fn greedy_decoding_on_an_nf4_base_equals_the_dequantized_float_model() {
    let mut nf4 = qlora_base::<Cpu>(Nf4Dtype::F32, &Default::default());
    load_adapter(&mut nf4, &fixture("tiny-llama-nf4-lora")).unwrap();
    let mut float = qlora_base::<Cpu>(Nf4Dtype::F32, &Default::default());
    load_adapter(&mut float, &fixture("tiny-llama-nf4-lora")).unwrap();
    for (_, linear) in float.linears_mut() {
        if linear.nf4().is_some() {
            let w = linear.base_weight();
            linear.set_weight(w);
        }
    }
    assert!(float.linears_mut().iter().all(|(_, l)| l.nf4().is_none()));
    let opts = tune::generation::GenerateOptions {
        max_new_tokens: 12,
        sampling: tune::generation::SamplingParams::GREEDY,
        seed: 0,
        stop_ids: vec![],
        stop_at_eos: false,
        use_kv_cache: true,
    };
    let prompt = [2000u32, 17, 42, 311, 5, 99];
    let a = tune::generation::generate(&nf4, &prompt, &opts, |_| {}).unwrap();
    let b = tune::generation::generate(&float, &prompt, &opts, |_| {}).unwrap();
    assert_eq!(a.tokens, b.tokens);
    // And one decoding step's logits agree closely (only the summation order differs).
    let one = |m: &CausalLm<Cpu>| {
        HostTensor::from_tensor(&forward_rows(m, &prompt[..1], 1, ForwardMode::default()))
    };
    assert_close("one-token logits", &one(&nf4), &one(&float), 1e-5);
}
