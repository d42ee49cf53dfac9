//! Adapter surgery on the model: fresh LoRA (and DoRA) adapters attached to its linear layers
//! and to a fused-experts model's experts (the merged export folds them in as it reads them:
//! `CausalLm::merged_hf_state_dict`). Reading and writing adapters in peft's layout is
//! `model_io::peft`'s.

use burn::tensor::backend::Backend;

use super::args::ExpertNaming;
use super::mlp::Mlp;
use super::{CausalLm, ModelArgs};
use crate::modules::{Lora, LoraSettings, lora};

/// Attaches fresh adapters to the linear layers named in `targets` (leaf names: `q_proj`,
/// `down_proj`, `lm_head`, ...). Returns the module paths that got one.
pub fn attach_lora<B: Backend>(
    model: &mut CausalLm<B>,
    targets: &[String],
    settings: &LoraSettings,
    seed: u64,
) -> Vec<String> {
    let device = model.device();
    let mut rng = lora::init_rng(seed);
    let mut attached = Vec::new();
    let args = model.args.clone();
    for (path, linear) in model.linears_mut() {
        let leaf = path.rsplit('.').next().unwrap_or(&path);
        if targets.iter().any(|t| t == leaf) && args.lora_adapts(&path) {
            let (out, inp) = (linear.out_features(), linear.in_features());
            let mut lora = Lora::init(inp, out, settings, &mut rng, &device);
            if settings.dora {
                lora = lora.with_magnitude(linear.base_weight_on(&device), None);
            }
            linear.lora = Some(lora);
            attached.push(path);
        }
    }
    attached
}

/// Whether `args`' experts are fused parameters on disk (gpt-oss), which peft adapts through
/// `target_parameters` (`model_io::peft_experts`) and never by module name.
pub fn experts_are_fused(args: &ModelArgs) -> bool {
    args.moe
        .as_ref()
        .is_some_and(|m| m.naming == ExpertNaming::GptOss)
}

/// Whether the linear `path` is one of a fused-experts model's experts (their adapters are
/// read and written through `model_io::peft_experts`).
pub fn fused_expert_linear(args: &ModelArgs, path: &str) -> bool {
    experts_are_fused(args) && path.contains(".experts.")
}

/// Each layer index with its experts, when they are fused on disk.
pub fn fused_experts_mut<B: Backend>(model: &mut CausalLm<B>) -> Vec<(usize, &mut Vec<Mlp<B>>)> {
    if !experts_are_fused(&model.args) {
        return Vec::new();
    }
    model
        .model
        .layers
        .iter_mut()
        .enumerate()
        .filter_map(|(i, layer)| layer.moe.as_mut().map(|moe| (i, &mut moe.experts)))
        .collect()
}

/// Attaches fresh adapters to every layer's fused experts, both parameters (peft's
/// `target_parameters`): per expert, one over `gate_up_proj` (on the expert's MLP, its B rows
/// interleaving gate and up as the fused weight's columns do) and one over `down_proj`.
/// Returns whether the model's experts are fused (and so got them).
pub fn attach_fused_expert_lora<B: Backend>(
    model: &mut CausalLm<B>,
    settings: &LoraSettings,
    seed: u64,
) -> bool {
    let device = model.device();
    // Another stream than the linears' adapters, so adding these changes none of theirs.
    let mut rng = lora::init_rng(seed ^ 0x0065_7870_6572_7473);
    let layers = fused_experts_mut(model);
    if layers.is_empty() {
        return false;
    }
    for (_, experts) in layers {
        for mlp in experts.iter_mut() {
            let (width, hidden) = (mlp.gate_proj.out_features(), mlp.gate_proj.in_features());
            mlp.lora = Some(Lora::init(hidden, 2 * width, settings, &mut rng, &device));
            let down = &mut mlp.down_proj;
            let (out, inp) = (down.out_features(), down.in_features());
            down.lora = Some(Lora::init(inp, out, settings, &mut rng, &device));
        }
    }
    true
}
