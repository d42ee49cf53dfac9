//! Golden tests for quantization-aware training against torchao's
//! `Int8DynActInt4WeightQATQuantizer(groupsize=32)`: the two fake quantizers on their own,
//! then logits, loss and base-weight gradients of the fake-quantized tiny llama.

use crate::support;

use crate::grads::named_grads;
use burn::tensor::backend::{AutodiffBackend, Backend};
use support::*;
use tune::checkpoint::HostTensor;
use tune::model_io::hf::load_model;
use tune::modules::ForwardMode;
use tune::modules::fake_quant::{QuantScheme, fake_quantize_activation, fake_quantize_weight};
use tune::setup::quant::{QuantError, prepare};

const SCHEME: QuantScheme = QuantScheme::Int8DynActInt4Weight { group_size: 32 };

#[test]
fn int4_weight_fake_quant_is_bit_exact() {
    check_int4_weight_fake_quant::<Cpu>(&Default::default());
}

/// torchao's int4 per-group weight fake quantization, bit for bit, on `B`.
pub fn check_int4_weight_fake_quant<B: Backend>(device: &B::Device) {
    let r = Reference::open("qat.safetensors");
    let input = r.f32("fake_quant_weight.input");
    let want = r.f32("fake_quant_weight.output");
    let got = HostTensor::from_tensor(&fake_quantize_weight(input.to_tensor::<B, 2>(device), 32));
    assert_eq!(got.shape, want.shape);
    let differing = got
        .data
        .iter()
        .zip(&want.data)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(
        differing,
        0,
        "{differing} of {} elements differ from torchao",
        want.numel()
    );
}

#[test]
fn int8_activation_fake_quant_matches_torchao() {
    check_int8_activation_fake_quant::<Cpu>(&Default::default());
}

/// torchao's int8 per-token dynamic activation fake quantization, bit for bit, on `B`.
pub fn check_int8_activation_fake_quant<B: Backend>(device: &B::Device) {
    let r = Reference::open("qat.safetensors");
    let input = r.f32("fake_quant_activation.input");
    let want = r.f32("fake_quant_activation.output");
    let got = HostTensor::from_tensor(&fake_quantize_activation(input.to_tensor::<B, 3>(device)));
    assert_eq!(got.shape, want.shape);
    let differing: Vec<(usize, f32, f32)> = got
        .data
        .iter()
        .zip(&want.data)
        .enumerate()
        .filter(|(_, (a, b))| a.to_bits() != b.to_bits())
        .map(|(i, (a, b))| (i, *a, *b))
        .collect();
    eprintln!(
        "activation fake quant: {} of {} elements differ: {differing:?}",
        differing.len(),
        want.numel()
    );
    assert!(
        differing.is_empty(),
        "{} elements differ from torchao: {differing:?}",
        differing.len()
    );
}

#[test]
fn qat_logits_loss_and_grads_match_torchao() {
    check_qat_model::<CpuAutodiff>(&Default::default());
}

/// The fake-quantized tiny llama's logits, loss and base-weight gradients, on `B`, on the batch
/// of `make_qat_model_fixture.py`: every int8 activation rounding on it lies at least 2e-4 of a
/// quantum from a boundary, so another float32 summation order rounds as torchao did (on the
/// shared fixture's batch one lay 1.4e-5 from it, and AVX2 and AVX-512 products rounded it
/// apart, moving token 0's logits by 5.6e-3).
pub fn check_qat_model<B: AutodiffBackend>(device: &B::Device) {
    let r = Reference::open("qat_model.safetensors");
    assert!(r.f32("rounding_margin").data[0] >= 2e-4);
    assert_eq!(r.i64("group_size"), vec![32]);
    let (tokens, labels, batch) = r.tokens();
    let mut model = load_model::<B>(&fixture("tiny-llama"), None, device)
        .unwrap()
        .model;
    let swapped = prepare(&mut model, SCHEME).unwrap();
    let text = std::fs::read_to_string(fixture("reference/qat_swapped_modules.json")).unwrap();
    let want: Vec<String> = serde_json::from_str(&text).unwrap();
    assert_eq!(swapped, want, "the quantized modules are torchao's");

    let logits = forward_rows(&model, &tokens, batch, ForwardMode::default());
    let loss = assert_logits_and_loss(&r, logits, &labels);
    let grads = loss.backward();
    let named = named_grads(&model, &grads);
    let expected = r.grad_count();
    assert_eq!(named.len(), expected, "one gradient per base weight");
    for (name, grad) in named {
        assert_grad_close(&name, &grad, &r.f32(&format!("grad.{name}")));
    }
}

#[test]
fn fake_quant_off_is_the_float_model() {
    let base = Reference::open("tiny-llama.safetensors");
    let (tokens, _, batch) = base.tokens();
    let device = Default::default();
    let mut model = load_model::<Cpu>(&fixture("tiny-llama"), None, &device)
        .unwrap()
        .model;
    prepare(&mut model, SCHEME).unwrap();
    let mode = ForwardMode {
        fake_quant: false,
        ..ForwardMode::default()
    };
    let logits = forward_rows(&model, &tokens, batch, mode);
    assert_close(
        "logits",
        &HostTensor::from_tensor(&logits),
        &base.f32("logits"),
        1e-4,
    );
}

#[test]
fn group_size_must_divide_every_layer() {
    let device = Default::default();
    let mut model = load_model::<Cpu>(&fixture("tiny-llama"), None, &device)
        .unwrap()
        .model;
    let err = prepare(
        &mut model,
        QuantScheme::Int8DynActInt4Weight { group_size: 48 },
    )
    .unwrap_err();
    assert!(matches!(err, QuantError::GroupSize { .. }));
    assert!(
        err.to_string().starts_with(
            "quantizer.groupsize 48 does not divide model.layers.0.self_attn.q_proj in_features 64"
        ),
        "{err}"
    );
    // 128 divides the MLP's down_proj (128 inputs) but not the attention inputs (64).
    let err = prepare(&mut model, QuantScheme::Int4WeightOnly { group_size: 128 }).unwrap_err();
    assert!(
        err.to_string()
            .contains("model.layers.0.self_attn.q_proj in_features 64"),
        "{err}"
    );
    assert!(
        model.linears_mut().iter().all(|(_, l)| l.quant.is_none()),
        "the model is unchanged on error"
    );
}

fn batch_logits<B: burn::tensor::backend::Backend>(
    model: &tune::models::CausalLm<B>,
) -> HostTensor {
    let r = Reference::open("qat.safetensors");
    let (tokens, _, batch) = r.tokens();
    HostTensor::from_tensor(&forward_rows(model, &tokens, batch, ForwardMode::default()))
}

#[test]
fn int4_packing_round_trips_and_documents_nibble_order() {
    use tune::model_io::quantized::{pack_int4, unpack_int4};
    // Column 0 in the low nibble, column 1 in the high one, each stored as q + 8.
    assert_eq!(pack_int4(&[-8.0, 7.0]), vec![15 << 4]);
    assert_eq!(pack_int4(&[1.0, -1.0]), vec![9 | (7 << 4)]);
    let q: Vec<f32> = (0..64).map(|i| (i % 16) as f32 - 8.0).collect();
    assert_eq!(unpack_int4(&pack_int4(&q), q.len()), q);
}

#[test]
fn quantized_export_reloads_to_the_fake_quantized_model_exactly() {
    use tune::checkpoint::StorageDtype;
    use tune::model_io::quantized::{load_quantized_model, save_quantized};
    let device = Default::default();
    let mut model = load_model::<Cpu>(&fixture("tiny-llama"), None, &device)
        .unwrap()
        .model;
    prepare(&mut model, SCHEME).unwrap();
    let dir = temp_dir("qat-export");
    save_quantized(
        &mut model,
        SCHEME,
        dir.path(),
        StorageDtype::F32,
        Some(&fixture("tiny-llama")),
    )
    .unwrap();
    let loaded = load_quantized_model::<Cpu>(dir.path(), &device).unwrap();
    let (want, got) = (batch_logits(&model), batch_logits(&loaded));
    assert_eq!(
        max_abs_diff("export logits", &got, &want),
        0.0,
        "dequantized export == fake-quantized model"
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["quantization_config"]["weight"]["group_size"], 32);
    assert_eq!(
        config["quantization_config"]["modules"]
            .as_array()
            .unwrap()
            .len(),
        14
    );
    assert!(dir.path().join("tokenizer.json").is_file());
}
