//! peft's LoRA of fused expert parameters: gpt-oss's `mlp.experts.gate_up_proj` and
//! `mlp.experts.down_proj`, which transformers holds as 3-D parameters (`[experts, in, out]`)
//! and peft adapts only through `target_parameters` (its `ParamWrapper`, peft >= 0.17).
//!
//! peft keeps one pair of factors per parameter for all the experts (`lora_A` an
//! `nn.Linear(in, rank * experts)`, `lora_B` an `nn.Linear(rank * experts, out)`); its
//! `get_delta_weight` reads A as `(experts, rank, in)` and B as `(out, rank, experts)`, so
//! expert `e`'s A is rows `e * rank ..` of A, and its B the columns `k * experts + e` of B. tune
//! holds each expert's slice as an ordinary adapter: on its `down_proj` linear, and for
//! `gate_up_proj` on the expert's MLP ([`Mlp::lora`](crate::models::mlp::Mlp)), whose B rows
//! interleave gate and up as the fused weight's columns do.
//!
//! Keys: peft wraps the experts module once per targeted parameter, in the order of the
//! module's parameters (`gate_up_proj` before `down_proj`), so with both targeted the
//! `gate_up_proj` adapter sits one `base_layer` deeper:
//! `...mlp.experts.base_layer.lora_A.weight` (gate_up) and `...mlp.experts.lora_A.weight`
//! (down); with one alone, that one is `...mlp.experts.lora_A.weight`.

use crate::checkpoint::host::HostTensor;

/// A fused parameter of a layer's experts that peft's `target_parameters` can adapt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FusedParam {
    /// `gate_up_proj`, `[experts, hidden, 2 * intermediate]`.
    GateUp,
    /// `down_proj`, `[experts, intermediate, hidden]`.
    Down,
}

impl FusedParam {
    /// In the order peft wraps them.
    pub const ALL: [FusedParam; 2] = [FusedParam::GateUp, FusedParam::Down];

    fn name(self) -> &'static str {
        match self {
            Self::GateUp => "gate_up_proj",
            Self::Down => "down_proj",
        }
    }

    /// The `target_parameters` entry tune writes: every layer's experts' parameter.
    pub fn target(self) -> String {
        format!("mlp.experts.{}", self.name())
    }
}

/// The module path of layer `layer`'s experts, as peft names it.
pub fn experts_module(layer: usize) -> String {
    format!("model.layers.{layer}.mlp.experts")
}

/// The fused parameters of `experts_module` that `targets` (`target_parameters`) adapt, in
/// peft's order: an entry matches a parameter's full name exactly or as a dotted suffix.
pub fn targeted(targets: &[String], experts_module: &str) -> Vec<FusedParam> {
    FusedParam::ALL
        .into_iter()
        .filter(|p| {
            let full = format!("{experts_module}.{}", p.name());
            targets
                .iter()
                .any(|t| *t == full || full.ends_with(&format!(".{t}")))
        })
        .collect()
}

/// peft's key of factor `which` ('A' or 'B') of `param`'s adapter in `experts_module`, where
/// `targeted` are the module's adapted parameters.
pub fn key(
    experts_module: &str,
    param: FusedParam,
    targeted: &[FusedParam],
    which: char,
) -> String {
    let nested = param == FusedParam::GateUp && targeted.contains(&FusedParam::Down);
    let base_layer = if nested { "base_layer." } else { "" };
    format!("base_model.model.{experts_module}.{base_layer}lora_{which}.weight")
}

/// peft's stacked factors from each expert's `(A [rank, in], B [out, rank])`: A
/// `[experts * rank, in]`, B `[out, rank * experts]`.
pub fn stack(per_expert: &[(HostTensor, HostTensor)]) -> (HostTensor, HostTensor) {
    let experts = per_expert.len();
    let a_parts: Vec<HostTensor> = per_expert.iter().map(|(a, _)| a.clone()).collect();
    let a = HostTensor::concat_rows(&a_parts);
    let (out, rank) = per_expert
        .first()
        .map_or((0, 0), |(_, b)| (b.shape[0], b.shape[1]));
    let mut data = vec![0.0f32; out * rank * experts];
    for (e, (_, b)) in per_expert.iter().enumerate() {
        for o in 0..out {
            for k in 0..rank {
                data[o * rank * experts + k * experts + e] = b.data[o * rank + k];
            }
        }
    }
    (a, HostTensor::new(vec![out, rank * experts], data))
}

/// Each expert's `(A [rank, in], B [out, rank])` from peft's stacked factors (the inverse of
/// [`stack`]); the shapes must be `[experts * rank, in]` and `[out, rank * experts]`.
pub fn unstack(
    a: &HostTensor,
    b: &HostTensor,
    experts: usize,
    rank: usize,
) -> Vec<(HostTensor, HostTensor)> {
    let out = b.shape[0];
    (0..experts)
        .map(|e| {
            let a_e = a.rows(e * rank, rank);
            let mut data = Vec::with_capacity(out * rank);
            for o in 0..out {
                for k in 0..rank {
                    data.push(b.data[o * rank * experts + k * experts + e]);
                }
            }
            (a_e, HostTensor::new(vec![out, rank], data))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn experts_slices_are_pefts_reshapes() {
        // 3 experts, rank 2, in 4, out 5: expert e's A rows e*2.., B column k*3 + e.
        let (experts, rank, inp, out) = (3, 2, 4, 5);
        let a = HostTensor::new(
            vec![experts * rank, inp],
            (0..experts * rank * inp).map(|v| v as f32).collect(),
        );
        let b = HostTensor::new(
            vec![out, rank * experts],
            (0..out * rank * experts)
                .map(|v| 100.0 + v as f32)
                .collect(),
        );
        let per = unstack(&a, &b, experts, rank);
        // torch: B.reshape(out, rank, experts)[o, k, e] = B[o, k * experts + e]
        assert_eq!(
            per[2].1.data[2 * rank + 1],
            b.data[2 * rank * experts + experts + 2]
        );
        assert_eq!(per[1].0.data[..inp], a.data[rank * inp..rank * inp + inp]);
        let (a2, b2) = stack(&per);
        assert_eq!(
            (a2.shape.clone(), b2.shape.clone()),
            (a.shape.clone(), b.shape.clone())
        );
        assert_eq!((a2.data, b2.data), (a.data, b.data));
    }

    #[test]
    fn gate_up_nests_under_down_as_peft_wraps_them() {
        let m = experts_module(3);
        let both = targeted(
            &[
                "mlp.experts.gate_up_proj".into(),
                "mlp.experts.down_proj".into(),
            ],
            &m,
        );
        assert_eq!(both, FusedParam::ALL);
        assert_eq!(
            key(&m, FusedParam::GateUp, &both, 'A'),
            "base_model.model.model.layers.3.mlp.experts.base_layer.lora_A.weight"
        );
        assert_eq!(
            key(&m, FusedParam::Down, &both, 'B'),
            "base_model.model.model.layers.3.mlp.experts.lora_B.weight"
        );
        // The OpenAI cookbook's form: chosen layers only.
        let layer_7 = ["7.mlp.experts.gate_up_proj".to_string()];
        assert_eq!(targeted(&layer_7, &experts_module(7)), [FusedParam::GateUp]);
        assert!(targeted(&layer_7, &experts_module(17)).is_empty());
        assert_eq!(
            key(
                &experts_module(7),
                FusedParam::GateUp,
                &[FusedParam::GateUp],
                'A'
            ),
            "base_model.model.model.layers.7.mlp.experts.lora_A.weight"
        );
    }
}
