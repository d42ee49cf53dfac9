//! Parameter traversal by Hugging Face name: every linear layer with its module path, and the
//! flat state dict used for saving, optimizers and gradient checks.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::decoder::CausalLm;
use super::shards::LayerShards;
use crate::checkpoint::HostTensor;
use crate::modules::Linear;

impl<B: Backend> CausalLm<B> {
    /// Every linear layer with its name in the checkpoint (`model.layers.0.self_attn.q_proj`;
    /// a sparse layer's as the family names it, [`ModelArgs::hf_name`](super::ModelArgs::hf_name)), in order. Routers
    /// are not among them.
    pub fn linears_mut(&mut self) -> Vec<(String, &mut Linear<B>)> {
        let mut out = Vec::new();
        let args = &self.args;
        for (i, layer) in self.model.layers.iter_mut().enumerate() {
            for (path, linear) in layer.named_linears_mut() {
                out.push((args.hf_name(&format!("model.layers.{i}.{path}")), linear));
            }
        }
        let head_name = self.args.head_name();
        if let Some(head) = &mut self.lm_head {
            out.push((head_name.to_string(), head));
        }
        out
    }

    /// Whether a training pass draws dropout masks: some adapter has `lora_dropout` > 0.
    pub fn has_dropout(&self) -> bool {
        self.model.layers.iter().any(|layer| {
            layer
                .linears()
                .iter()
                .any(|l| l.lora.as_ref().is_some_and(|a| a.dropout > 0.0))
        })
    }

    /// The base weights stored in NF4 (QLoRA), dequantized as exported (bf16, as torchtune
    /// saves them), by Hugging Face name. They are not parameters (nothing trains them), so
    /// `named_params` does not list them.
    fn nf4_weights(&self) -> Vec<(String, HostTensor)> {
        let mut out = Vec::new();
        for (i, layer) in self.model.layers.iter().enumerate() {
            for (name, linear) in layer.named_linears() {
                if let Some(q) = linear.nf4() {
                    let value = HostTensor::new(q.shape().to_vec(), q.dequantize_for_export());
                    out.push((format!("model.layers.{i}.{name}.weight"), value));
                }
            }
        }
        out
    }

    /// All float parameters by module path, with whether each one trains.
    pub fn named_params(&self) -> Vec<NamedParam> {
        let mut v = Collector {
            shards: self.shards.as_deref(),
            path: Vec::new(),
            out: Vec::new(),
        };
        self.visit(&mut v);
        v.out
    }

    /// Bytes of the weights this model holds: its float parameters and its NF4 base weights
    /// as stored (with FSDP, this rank's rows of each; with its CPU offload, the float rows
    /// are in host memory instead, [`Self::offloaded_parameter_bytes`]).
    pub fn parameter_bytes(&self) -> usize {
        let nf4: usize = self
            .model
            .layers
            .iter()
            .flat_map(|layer| layer.linears())
            .map(|l| l.nf4().map_or(0, |q| q.bytes()) + l.nf4_rows().map_or(0, |r| r.bytes()))
            .sum();
        nf4 + self.float_parameter_bytes()
    }

    /// Bytes of this rank's rows that FSDP's CPU offload keeps in host memory instead
    /// (not counted by [`Self::parameter_bytes`]).
    pub fn offloaded_parameter_bytes(&self) -> usize {
        self.shards
            .as_ref()
            .and_then(|s| s.offloaded())
            .map_or(0, |h| h.bytes())
    }

    fn float_parameter_bytes(&self) -> usize {
        struct Bytes(usize);
        impl<B: Backend> ModuleVisitor<B> for Bytes {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let value = param.val();
                self.0 += value.shape().num_elements() * value.dtype().size();
            }
        }
        let mut bytes = Bytes(0);
        self.visit(&mut bytes);
        bytes.0
    }

    /// The parameters that train, by module path, in model order, without copying their
    /// values (the data-parallel collectives list them every step).
    pub fn trainable_params(&self) -> Vec<TrainableParam> {
        struct List<'a> {
            shards: Option<&'a LayerShards>,
            path: Vec<String>,
            out: Vec<TrainableParam>,
        }
        impl<B: Backend> ModuleVisitor<B> for List<'_> {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.path.push(name.to_string());
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.path.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let value = param.val();
                if value.is_require_grad() {
                    // An offloaded parameter's rows are in host memory, not in its value.
                    let numel = match self.shards.filter(|s| s.is_parked(&param.id)) {
                        Some(s) => s.elements(&param.id, s.rank()).map_or(0, |r| r.len()),
                        None => value.shape().num_elements(),
                    };
                    self.out.push(TrainableParam {
                        name: self.path.join("."),
                        id: param.id,
                        numel,
                    });
                }
            }
        }
        let mut list = List {
            shards: self.shards.as_deref(),
            path: Vec::new(),
            out: Vec::new(),
        };
        self.visit(&mut list);
        list.out
    }

    /// Base-model tensors with Hugging Face names (adapters excluded), as saved to
    /// `model.safetensors`: Phi-3's projections fused back into `qkv_proj`/`gate_up_proj`.
    /// NF4 base weights are saved dequantized to bf16, as torchtune's state-dict hook saves them.
    pub fn hf_state_dict(&self) -> Vec<(String, HostTensor)> {
        let mut params: Vec<(String, HostTensor)> = self
            .named_params()
            .into_iter()
            .filter(|p| !p.is_adapter())
            .map(|p| (p.name, p.value))
            .collect();
        params.extend(self.nf4_weights());
        self.to_hf_layout(params)
    }

    /// As [`Self::hf_state_dict`], with every LoRA adapter folded into its base weight
    /// (the model itself is left unchanged): the merged model a LoRA run exports.
    pub fn merged_hf_state_dict(&mut self) -> Vec<(String, HostTensor)> {
        let mut merged: std::collections::HashMap<String, HostTensor> = self
            .linears_mut()
            .into_iter()
            .filter(|(_, l)| l.lora.is_some())
            .map(|(p, l)| {
                (
                    format!("{p}.weight"),
                    HostTensor::from_tensor(&l.merged_weight()),
                )
            })
            .collect();
        // gpt-oss's experts: the fused gate/up adapter, folded into both halves.
        for (i, layer) in self.model.layers.iter().enumerate() {
            let experts = layer.moe.iter().flat_map(|moe| moe.experts.iter());
            for (e, mlp) in experts.enumerate() {
                let Some((gate, up)) = mlp.merged_gate_up() else {
                    continue;
                };
                for (proj, weight) in [("gate_proj", gate), ("up_proj", up)] {
                    let path = format!("model.layers.{i}.moe.experts.{e}.{proj}");
                    let name = format!("{}.weight", self.args.hf_name(&path));
                    merged.insert(name, HostTensor::from_tensor(&weight));
                }
            }
        }
        let mut params: Vec<(String, HostTensor)> = self
            .named_params()
            .into_iter()
            .filter(|p| !p.is_adapter())
            .map(|p| {
                let value = merged
                    .remove(&self.args.hf_name(&p.name))
                    .unwrap_or(p.value);
                (p.name, value)
            })
            .collect();
        // NF4 bases: merged when adapted, else dequantized.
        for (name, value) in self.nf4_weights() {
            let value = merged.remove(&self.args.hf_name(&name)).unwrap_or(value);
            params.push((name, value));
        }
        self.to_hf_layout(params)
    }

    /// Names and tensors (weights or their gradients) in the on-disk layout of the model's family
    /// (and of the multimodal checkpoint it came from: a vision tower tune reads, Qwen2-VL's, by
    /// its names there; one it does not read is not the model's, so not here, and
    /// `model_io::hf::save_hf_dir` copies it through).
    pub fn to_hf_layout(&self, params: Vec<(String, HostTensor)>) -> Vec<(String, HostTensor)> {
        // A classifier's head is the module `lm_head` here and `score` on disk.
        let params = match self.args.head_name() {
            "lm_head" => params,
            head => params
                .into_iter()
                .map(|(name, value)| match name.strip_prefix("lm_head.") {
                    Some(rest) => (format!("{head}.{rest}"), value),
                    None => (name, value),
                })
                .collect(),
        };
        // A sparse layer's block is `moe` here, named as the family's checkpoints name it.
        let params = params
            .into_iter()
            .map(|(name, value)| (self.args.hf_name(&name), value))
            .collect();
        let params = if self.args.fused_projections {
            fuse_projections(params)
        } else {
            params
        };
        let params = match &self.args.moe {
            Some(moe) if moe.naming == super::args::ExpertNaming::GptOss => {
                fuse_experts(params, moe.num_experts)
            }
            _ => params,
        };
        // The vision tower's tensors as its checkpoint names and shapes them.
        let params = match &self.args.vision {
            Some(vision) => params
                .into_iter()
                .map(|(name, value)| match name.strip_prefix("visual.") {
                    Some(rest) => {
                        let (disk, value) =
                            super::qwen2_vl_vision::on_disk(rest, value, &vision.encoder);
                        (format!("visual.{disk}"), value)
                    }
                    None => (name, value),
                })
                .collect(),
            None => params,
        };
        // A multimodal checkpoint's language model, named as that checkpoint nests it.
        match &self.args.tower {
            Some(tower) => params
                .into_iter()
                .map(|(name, value)| (tower.checkpoint_name(&name), value))
                .collect(),
            None => params,
        }
    }
}

/// One parameter: its module path, value on the host, and whether it is trainable.
#[derive(Debug, Clone)]
pub struct NamedParam {
    pub name: String,
    pub id: ParamId,
    pub value: HostTensor,
    pub trainable: bool,
}

/// A parameter that trains: its module path, id and element count.
#[derive(Debug, Clone)]
pub struct TrainableParam {
    pub name: String,
    pub id: ParamId,
    pub numel: usize,
}

impl NamedParam {
    pub fn is_adapter(&self) -> bool {
        self.name.contains(".lora.")
    }
}

struct Collector<'a> {
    /// FSDP's shards: an offloaded parameter's rows are read from host memory.
    shards: Option<&'a LayerShards>,
    path: Vec<String>,
    out: Vec<NamedParam>,
}

impl<B: Backend> ModuleVisitor<B> for Collector<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val();
        let parked = self.shards.and_then(|s| {
            let rows = s.parked_value(&param.id)?;
            Some(HostTensor::new(
                s.shard_shape(&param.id)?,
                host_values(rows),
            ))
        });
        self.out.push(NamedParam {
            name: self.path.join("."),
            id: param.id,
            value: parked.unwrap_or_else(|| HostTensor::from_tensor(&value)),
            trainable: value.is_require_grad(),
        });
    }
}

/// Host rows as f32 values.
fn host_values(rows: Tensor<crate::models::host_rows::Host, 1>) -> Vec<f32> {
    HostTensor::from_tensor(&rows).data
}

fn fuse_projections(params: Vec<(String, HostTensor)>) -> Vec<(String, HostTensor)> {
    use std::collections::HashMap;
    let mut map: HashMap<String, HostTensor> = params.iter().cloned().collect();
    let mut out = Vec::new();
    for (name, _) in &params {
        let Some(value) = map.remove(name) else {
            continue;
        };
        if let Some(prefix) = name.strip_suffix(".self_attn.q_proj.weight") {
            let k = map.remove(&format!("{prefix}.self_attn.k_proj.weight"));
            let v = map.remove(&format!("{prefix}.self_attn.v_proj.weight"));
            if let (Some(k), Some(v)) = (k, v) {
                out.push((
                    format!("{prefix}.self_attn.qkv_proj.weight"),
                    HostTensor::concat_rows(&[value, k, v]),
                ));
                continue;
            }
        }
        if let Some(prefix) = name.strip_suffix(".mlp.gate_proj.weight")
            && let Some(up) = map.remove(&format!("{prefix}.mlp.up_proj.weight"))
        {
            out.push((
                format!("{prefix}.mlp.gate_up_proj.weight"),
                HostTensor::concat_rows(&[value, up]),
            ));
            continue;
        }
        out.push((name.clone(), value));
    }
    out
}

/// gpt-oss's experts fused back as its checkpoints store them (`build.rs` splits them):
/// per layer `mlp.experts.gate_up_proj` `[experts, hidden, 2 * inter]` with the gate's and up's
/// output columns interleaved, `gate_up_proj_bias` `[experts, 2 * inter]`, `down_proj`
/// `[experts, inter, hidden]` and `down_proj_bias`, written where the layer's first expert
/// tensor was. A layer missing any piece (none does) keeps its pieces as they are.
fn fuse_experts(params: Vec<(String, HostTensor)>, experts: usize) -> Vec<(String, HostTensor)> {
    use std::collections::HashMap;
    const PIECES: [&str; 6] = [
        "gate_proj.weight",
        "up_proj.weight",
        "down_proj.weight",
        "gate_proj.bias",
        "up_proj.bias",
        "down_proj.bias",
    ];
    // `<layer>.mlp.experts.<e>.<piece>` -> (`<layer>.mlp.experts`, e, piece)
    let split = |name: &str| -> Option<(String, usize, &'static str)> {
        let (block, rest) = name.split_once(".mlp.experts.")?;
        let (e, piece) = rest.split_once('.')?;
        let piece = PIECES.iter().find(|p| **p == piece)?;
        Some((format!("{block}.mlp.experts"), e.parse().ok()?, piece))
    };
    let mut pieces: HashMap<(String, usize, &str), HostTensor> = HashMap::new();
    let mut order: Vec<Result<String, (String, HostTensor)>> = Vec::new();
    for (name, value) in params {
        match split(&name) {
            Some((block, e, piece)) => {
                if !order.iter().any(|o| o.as_ref().is_ok_and(|b| *b == block)) {
                    order.push(Ok(block.clone()));
                }
                pieces.insert((block, e, piece), value);
            }
            None => order.push(Err((name, value))),
        }
    }
    let mut out = Vec::new();
    for entry in order {
        let block = match entry {
            Err(param) => {
                out.push(param);
                continue;
            }
            Ok(block) => block,
        };
        let mut take = |e: usize, piece: &'static str| pieces.remove(&(block.clone(), e, piece));
        let layer: Vec<[Option<HostTensor>; 6]> = (0..experts)
            .map(|e| PIECES.map(|piece| take(e, piece)))
            .collect();
        if layer.iter().flatten().any(Option::is_none) {
            for (e, parts) in layer.into_iter().enumerate() {
                for (piece, value) in PIECES.iter().zip(parts) {
                    if let Some(value) = value {
                        out.push((format!("{block}.{e}.{piece}"), value));
                    }
                }
            }
            continue;
        }
        let layer: Vec<[HostTensor; 6]> = layer
            .into_iter()
            .map(|parts| parts.map(|p| p.expect("checked above")))
            .collect();
        let [inter, hidden] = [layer[0][0].shape[0], layer[0][0].shape[1]];
        let mut gate_up = vec![0.0f32; experts * hidden * 2 * inter];
        let mut gate_up_bias = vec![0.0f32; experts * 2 * inter];
        let mut down = vec![0.0f32; experts * inter * hidden];
        let mut down_bias = Vec::with_capacity(experts * hidden);
        for (e, [gate, up, down_w, gate_b, up_b, down_b]) in layer.iter().enumerate() {
            let fused = &mut gate_up[e * hidden * 2 * inter..][..hidden * 2 * inter];
            for j in 0..inter {
                for r in 0..hidden {
                    fused[r * 2 * inter + 2 * j] = gate.data[j * hidden + r];
                    fused[r * 2 * inter + 2 * j + 1] = up.data[j * hidden + r];
                }
                gate_up_bias[e * 2 * inter + 2 * j] = gate_b.data[j];
                gate_up_bias[e * 2 * inter + 2 * j + 1] = up_b.data[j];
            }
            // down_proj `[hidden, inter]` as `[inter, hidden]`.
            let fused = &mut down[e * inter * hidden..][..inter * hidden];
            for r in 0..hidden {
                for c in 0..inter {
                    fused[c * hidden + r] = down_w.data[r * inter + c];
                }
            }
            down_bias.extend_from_slice(&down_b.data);
        }
        out.push((
            format!("{block}.gate_up_proj"),
            HostTensor::new(vec![experts, hidden, 2 * inter], gate_up),
        ));
        out.push((
            format!("{block}.gate_up_proj_bias"),
            HostTensor::new(vec![experts, 2 * inter], gate_up_bias),
        ));
        out.push((
            format!("{block}.down_proj"),
            HostTensor::new(vec![experts, inter, hidden], down),
        ));
        out.push((
            format!("{block}.down_proj_bias"),
            HostTensor::new(vec![experts, hidden], down_bias),
        ));
    }
    out
}

/// Which parameters a recipe trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trainable {
    /// Full fine-tuning: everything.
    All,
    /// LoRA: only adapter weights; the base stays frozen and never gets gradients or
    /// optimizer state.
    AdaptersOnly,
    /// LoRA with `train_router: True`: the adapters and every sparse layer's router (weight
    /// and bias), as peft trains a module in `modules_to_save`.
    AdaptersAndRouters,
    /// Frozen teachers and references.
    Nothing,
}

struct SetTrainable {
    which: Trainable,
    path: Vec<String>,
}

impl<B: Backend> burn::module::ModuleMapper<B> for SetTrainable {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let is_adapter = self.path.iter().any(|p| p == "lora");
        // `SparseMoe::gate`, below a decoder layer's `moe`.
        let is_router = self
            .path
            .windows(2)
            .any(|w| w[0] == "moe" && w[1] == "gate");
        let train = match self.which {
            Trainable::All => true,
            Trainable::AdaptersOnly => is_adapter,
            Trainable::AdaptersAndRouters => is_adapter || is_router,
            Trainable::Nothing => false,
        };
        param.set_require_grad(train)
    }
}

impl<B: Backend> CausalLm<B> {
    pub fn set_trainable(self, which: Trainable) -> Self {
        self.map(&mut SetTrainable {
            which,
            path: Vec::new(),
        })
    }
}
