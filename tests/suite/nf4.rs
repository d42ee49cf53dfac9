//! NF4 as torchao's `to_nf4` computes it (torchtune's QLoRA base weights), bit for bit: the
//! level indices, the int8 block scalers, the scaler factors and mean, and the dequantized
//! weight, for a normal weight and one with outliers (tests/fixtures/make_nf4_fixtures.py).

use crate::support::Reference;
use half::bf16;
use tune::modules::nf4::Nf4Weight;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn nf4_codes_scales_and_dequantized_weights_match_torchao_bit_for_bit() {
    let r = Reference::open("nf4.safetensors");
    for w in ["w1", "w2"] {
        let input = r.f32(&format!("{w}.input"));
        let weight: Vec<bf16> = input.data.iter().map(|v| bf16::from_f32(*v)).collect();
        assert!(
            weight
                .iter()
                .zip(&input.data)
                .all(|(b, f)| b.to_f32() == *f),
            "{w}: the input is bf16"
        );
        let q = Nf4Weight::quantize_bf16(&weight, &input.shape).unwrap();
        let codes: Vec<i64> = q.indices().iter().map(|&c| i64::from(c)).collect();
        let want_codes = r.i64(&format!("{w}.unpacked_codes"));
        let first = codes.iter().zip(&want_codes).position(|(a, b)| a != b);
        assert_eq!(first, None, "{w}: first differing code");
        let packed: Vec<i64> = q.codes.iter().map(|&c| i64::from(c)).collect();
        assert_eq!(
            packed,
            r.i64(&format!("{w}.quantized_data")),
            "{w}: packing"
        );
        let scalers: Vec<i64> = q.scalers.iter().map(|&s| i64::from(s)).collect();
        assert_eq!(
            scalers,
            r.i64(&format!("{w}.quantized_scalers")),
            "{w}: int8 scalers"
        );
        let factors = q.factors.clone();
        assert_eq!(
            bits(&factors),
            bits(&r.f32(&format!("{w}.quantization_factor")).data),
            "{w}: factors"
        );
        assert_eq!(
            q.mean.to_bits(),
            r.f32(&format!("{w}.scaler_mean")).data[0].to_bits(),
            "{w}: mean"
        );
        let scales = q.block_scales();
        assert_eq!(
            bits(&scales),
            bits(&r.f32(&format!("{w}.block_scales")).data),
            "{w}: scales"
        );
        let deq = q.dequantize();
        assert_eq!(
            bits(&deq),
            bits(&r.f32(&format!("{w}.dequantized")).data),
            "{w}: weight"
        );
        // About half a byte per parameter, as the QLoRA target asks (<= 0.6).
        assert!((q.bytes() as f64) / (weight.len() as f64) < 0.54);
    }
}
