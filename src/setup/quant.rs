//! The `quantizer` section: which fake quantization QAT simulates, applied to the decoder's
//! linear layers as torchtune's QAT recipes apply torchao's quantizers to `model.model`
//! (every projection of every layer; never the output projection, tied or not).

use crate::config::components::QuantizerKind;
use crate::config::schema::{QatKeys, QuantizerConfig};
use crate::models::CausalLm;
use crate::modules::fake_quant::QuantScheme;
use burn::tensor::backend::Backend;

/// A quantizer that cannot apply to this model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error(
        "quantizer.groupsize {group_size} does not divide {layer} in_features {in_features}; choose a group size that divides the in_features of every decoder linear layer (e.g. 32)"
    )]
    GroupSize {
        group_size: usize,
        layer: String,
        in_features: usize,
    },
    #[error("quantizer.groupsize must be at least 2 (got {0})")]
    GroupTooSmall(usize),
}

/// The scheme a `quantizer` section asks for.
pub fn scheme(cfg: &QuantizerConfig) -> QuantScheme {
    let group_size = cfg.groupsize;
    match cfg.component.kind {
        QuantizerKind::Int8DynActInt4Weight => QuantScheme::Int8DynActInt4Weight { group_size },
        QuantizerKind::Int4WeightOnly => QuantScheme::Int4WeightOnly { group_size },
    }
}

/// Whether a linear layer (by module path) is one QAT quantizes: the decoder's, not `lm_head`.
pub fn is_quantized_layer(path: &str) -> bool {
    path.starts_with("model.layers.")
}

/// Sets `scheme` on every decoder linear layer, after checking the group size divides each
/// one's input features (the groups run along the input dimension). Returns the module paths
/// quantized, in model order; the model is unchanged on error.
pub fn prepare<B: Backend>(
    model: &mut CausalLm<B>,
    scheme: QuantScheme,
) -> Result<Vec<String>, QuantError> {
    let Some(group_size) = scheme.group_size() else {
        // Activation-only: nothing to check.
        return Ok(set_all(model, scheme));
    };
    if group_size < 2 {
        return Err(QuantError::GroupTooSmall(group_size));
    }
    let mut layers = model.linears_mut();
    layers.retain(|(path, _)| is_quantized_layer(path));
    for (path, linear) in &layers {
        let in_features = linear.in_features();
        if in_features % group_size != 0 {
            return Err(QuantError::GroupSize {
                group_size,
                layer: path.clone(),
                in_features,
            });
        }
    }
    drop(layers);
    Ok(set_all(model, scheme))
}

fn set_all<B: Backend>(model: &mut CausalLm<B>, scheme: QuantScheme) -> Vec<String> {
    model
        .linears_mut()
        .into_iter()
        .filter(|(path, _)| is_quantized_layer(path))
        .map(|(path, linear)| {
            linear.quant = Some(scheme);
            path
        })
        .collect()
}

/// " (fake quantization from step N)" when `fake_quant_after_n_steps` delays it, for start-up
/// lines.
pub fn delay_note(cfg: &QatKeys) -> String {
    cfg.fake_quant_after_n_steps.map_or(String::new(), |n| {
        format!(" (fake quantization from step {n})")
    })
}
