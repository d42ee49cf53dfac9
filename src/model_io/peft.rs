//! PEFT LoRA adapters on disk: load `adapter_model.safetensors` + `adapter_config.json` as
//! `peft` saves them into a model's adapters, and save them back in the same layout so
//! `PeftModel.from_pretrained(base, dir)` loads what tune writes. Attaching fresh adapters and
//! merging them is `models::adapters`'s.

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::backend::Backend;
use serde::{Deserialize, Serialize};

use super::peft_experts::{self, FusedParam};
use crate::checkpoint::error::CheckpointError;
use crate::checkpoint::host::HostTensor;
use crate::checkpoint::safetensors_io::{SafetensorsFile, StorageDtype, write_file};
use crate::models::adapters::{experts_are_fused, fused_expert_linear, fused_experts_mut};
use crate::models::args::ExpertNaming;
use crate::models::mlp::Mlp;
use crate::models::{CausalLm, ModelArgs};
use crate::modules::{Lora, LoraSettings};

pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
const PEFT_PREFIX: &str = "base_model.model.";

/// `adapter_config.json` as peft writes it; unknown keys are kept so a round trip loses nothing.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdapterConfig {
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    pub r: usize,
    pub lora_alpha: f64,
    #[serde(default)]
    pub lora_dropout: f64,
    pub target_modules: TargetModules,
    #[serde(default = "causal_lm")]
    pub task_type: Option<String>,
    #[serde(default = "lora_type")]
    pub peft_type: String,
    #[serde(default)]
    pub use_rslora: bool,
    #[serde(default)]
    pub use_dora: bool,
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

fn causal_lm() -> Option<String> {
    Some("CAUSAL_LM".into())
}

fn lora_type() -> String {
    "LORA".into()
}

/// peft accepts a list of module names or one regular-expression string.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum TargetModules {
    List(Vec<String>),
    Pattern(String),
}

impl AdapterConfig {
    /// The config tune writes for a fresh adapter, with the keys peft 0.1x writes.
    pub fn new(base_model: Option<String>, settings: &LoraSettings, targets: Vec<String>) -> Self {
        let mut other = BTreeMap::new();
        other.insert("bias".into(), "none".into());
        other.insert("fan_in_fan_out".into(), false.into());
        other.insert("inference_mode".into(), true.into());
        other.insert("init_lora_weights".into(), true.into());
        other.insert("modules_to_save".into(), serde_json::Value::Null);
        other.insert("layers_to_transform".into(), serde_json::Value::Null);
        other.insert("revision".into(), serde_json::Value::Null);
        other.insert("rank_pattern".into(), serde_json::json!({}));
        other.insert("alpha_pattern".into(), serde_json::json!({}));
        Self {
            base_model_name_or_path: base_model,
            r: settings.rank,
            lora_alpha: settings.alpha,
            lora_dropout: settings.dropout,
            target_modules: TargetModules::List(targets),
            task_type: causal_lm(),
            peft_type: lora_type(),
            use_rslora: false,
            use_dora: settings.dora,
            other,
        }
    }

    /// [`Self::new`] for `args`' model: a multimodal checkpoint's language model names its
    /// targets by a pattern peft matches against module paths (`target_modules` as a string is
    /// `re.fullmatch`ed), so that peft leaves the vision tower's `q_proj`s and MLPs alone.
    pub fn for_model(
        base_model: Option<String>,
        settings: &LoraSettings,
        targets: Vec<String>,
        args: &ModelArgs,
    ) -> Self {
        let mut config = Self::new(base_model, settings, targets.clone());
        if args.tower.is_some() {
            let (head, inner): (Vec<String>, Vec<String>) =
                targets.into_iter().partition(|t| t == "lm_head");
            let mut pattern = format!(r"model\.language_model\..*\.({})", inner.join("|"));
            if !head.is_empty() {
                pattern = format!("{pattern}|lm_head");
            }
            config.target_modules = TargetModules::Pattern(pattern);
        }
        config
    }

    /// peft's `target_parameters` (parameters adapted through its `ParamWrapper`: gpt-oss's
    /// fused experts); empty when absent or null.
    pub fn target_parameters(&self) -> Vec<String> {
        self.names("target_parameters")
    }

    /// The strings of the list at `key`; empty when absent or null.
    fn names(&self, key: &str) -> Vec<String> {
        self.other
            .get(key)
            .and_then(|v| v.as_array())
            .map(|list| {
                list.iter()
                    .filter_map(|t| t.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// peft's `modules_to_save` (modules trained in full and saved with the adapter); empty
    /// when absent or null.
    pub fn modules_to_save(&self) -> Vec<String> {
        self.names("modules_to_save")
    }

    /// Whether the adapter trains `args`' routers: its `modules_to_save` names the family's
    /// router module ([`ExpertNaming::router_module`]).
    pub fn trains_routers(&self, args: &ModelArgs) -> bool {
        args.moe.as_ref().is_some_and(|moe| {
            let router = moe.naming.router_module();
            self.modules_to_save().iter().any(|m| m == router)
        })
    }

    /// Marks `args`' routers as trained in full (`model.train_router`): peft's
    /// `modules_to_save`, which wraps every module whose name ends with the entry, so the
    /// entry is the router's own path below a layer (`mlp.gate`: a bare `gate` would take
    /// Qwen2-MoE's `shared_expert_gate` too). Nothing for a dense model.
    pub fn set_trains_routers(&mut self, args: &ModelArgs) {
        if let Some(moe) = &args.moe {
            self.other.insert(
                "modules_to_save".into(),
                serde_json::json!([moe.naming.router_module()]),
            );
        }
    }

    /// Sets `target_parameters` (peft >= 0.17 reads it).
    pub fn set_target_parameters(&mut self, targets: Vec<String>) {
        self.other
            .insert("target_parameters".into(), serde_json::json!(targets));
    }

    pub fn settings(&self) -> LoraSettings {
        LoraSettings {
            rank: self.r,
            alpha: self.lora_alpha,
            dropout: self.lora_dropout,
            dora: self.use_dora,
        }
    }

    pub fn read(dir: &Path) -> Result<Self, CheckpointError> {
        let path = dir.join(ADAPTER_CONFIG);
        let text = std::fs::read_to_string(&path).map_err(CheckpointError::io(&path))?;
        let config: Self = serde_json::from_str(&text).map_err(|e| CheckpointError::Invalid {
            path: path.clone(),
            message: e.to_string(),
        })?;
        if config.peft_type != "LORA" {
            return Err(CheckpointError::Invalid {
                path,
                message: format!(
                    "peft_type is {}, tune loads LORA adapters",
                    config.peft_type
                ),
            });
        }
        if config.use_rslora {
            return Err(CheckpointError::Invalid {
                path,
                message: "rsLoRA adapters (use_rslora: true) are not supported yet".into(),
            });
        }
        Ok(config)
    }

    pub fn write(&self, dir: &Path) -> Result<(), CheckpointError> {
        let path = dir.join(ADAPTER_CONFIG);
        let text = serde_json::to_string_pretty(self).unwrap_or_default();
        std::fs::write(&path, text + "\n").map_err(CheckpointError::io(&path))
    }

    fn targets(&self, module_path: &str) -> bool {
        let leaf = module_path.rsplit('.').next().unwrap_or(module_path);
        match &self.target_modules {
            TargetModules::List(list) => list
                .iter()
                .any(|t| t == leaf || module_path.ends_with(&format!(".{t}"))),
            // A full regex engine is not worth a dependency for this rare form: treat the
            // pattern as `name|name|...` alternatives, which is how it is written in practice.
            TargetModules::Pattern(p) => p
                .split(['|', '(', ')', '.', '*', '\\'])
                .filter(|s| !s.is_empty())
                .any(|t| t == leaf),
        }
    }
}

/// The module path peft gives the model's module `module`: the same, except in a multimodal
/// checkpoint's language model, which transformers nests under `model.language_model`.
fn peft_module(args: &ModelArgs, module: &str) -> String {
    match &args.tower {
        Some(tower) => tower.module_path(module),
        None => module.to_string(),
    }
}

/// The PEFT key of sparse layer `layer`'s router tensor `param` (`weight`, `bias`), as peft
/// saves a `modules_to_save` module: `base_model.model.model.layers.0.mlp.gate.weight`.
fn router_key(args: &ModelArgs, naming: ExpertNaming, layer: usize, param: &str) -> String {
    let module = peft_module(
        args,
        &format!("model.layers.{layer}.{}", naming.router_module()),
    );
    format!("{PEFT_PREFIX}{module}.{param}")
}

/// The PEFT key of an adapter tensor: `model.layers.0.self_attn.q_proj` + A ->
/// `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
pub fn peft_key(module_path: &str, which: char) -> String {
    format!("{PEFT_PREFIX}{module_path}.lora_{which}.weight")
}

/// The PEFT key of a DoRA magnitude vector, as peft saves it (its adapter name and the
/// `.weight` of its module dropped): `...q_proj.lora_magnitude_vector`.
pub fn magnitude_key(module_path: &str) -> String {
    format!("{PEFT_PREFIX}{module_path}.lora_magnitude_vector")
}

/// The adapter of `param` on `mlp`, when it has one.
fn fused_adapter<B: Backend>(mlp: &Mlp<B>, param: FusedParam) -> Option<&Lora<B>> {
    match param {
        FusedParam::GateUp => mlp.lora.as_ref(),
        FusedParam::Down => mlp.down_proj.lora.as_ref(),
    }
}

/// `(in, out)` of `param`'s adapter on `mlp`.
fn fused_shape<B: Backend>(mlp: &Mlp<B>, param: FusedParam) -> (usize, usize) {
    match param {
        FusedParam::GateUp => (
            mlp.gate_proj.in_features(),
            2 * mlp.gate_proj.out_features(),
        ),
        FusedParam::Down => (mlp.down_proj.in_features(), mlp.down_proj.out_features()),
    }
}

/// Loads a PEFT adapter directory into `model`, replacing any adapters it has.
pub fn load_adapter<B: Backend>(
    model: &mut CausalLm<B>,
    dir: &Path,
) -> Result<AdapterConfig, CheckpointError> {
    let config = AdapterConfig::read(dir)?;
    check_target_parameters(&config, &model.args, dir)?;
    let path = dir.join(ADAPTER_WEIGHTS);
    if !path.is_file() {
        let bin = dir.join("adapter_model.bin");
        let hint = if bin.is_file() {
            " (found adapter_model.bin: save the adapter with safe_serialization=True)"
        } else {
            ""
        };
        return Err(CheckpointError::Invalid {
            path,
            message: format!("missing{hint}"),
        });
    }
    let file = SafetensorsFile::open(&path)?;
    let settings = config.settings();
    let device = model.device();
    let mut used = 0usize;
    let args = model.args.clone();
    for (module, linear) in model.linears_mut() {
        if !config.targets(&module)
            || !args.lora_adapts(&module)
            || fused_expert_linear(&args, &module)
        {
            continue;
        }
        let (out, inp) = (linear.out_features(), linear.in_features());
        let peft_path = peft_module(&args, &module);
        let take = |which: char, shape: [usize; 2]| {
            read_adapter_tensor(
                &file,
                &peft_key(&peft_path, which),
                shape,
                dir,
                settings.rank,
            )
        };
        let a = take('A', [settings.rank, inp])?;
        let b = take('B', [out, settings.rank])?;
        let mut lora = Lora::from_tensors(a.to_tensor(&device), b.to_tensor(&device), &settings);
        used += 2;
        if settings.dora {
            let m = read_shaped(&file, &magnitude_key(&peft_path), &[out], dir)?.to_tensor(&device);
            lora = lora.with_magnitude(linear.base_weight_on(&device), Some(m));
            used += 1;
        }
        linear.lora = Some(lora);
    }
    if config.trains_routers(&args) {
        used += load_routers(model, &file, dir)?;
    }
    let consumed = load_fused_experts(model, &config, &file, dir)?;
    used += consumed.len();
    let total = file.names().len();
    if used != total {
        let expected: std::collections::HashSet<String> = file.names().into_iter().collect();
        let mut extra: Vec<String> = expected
            .into_iter()
            .filter(|k| !consumed.contains(k) && !model_has_adapter_key(model, k))
            .collect();
        extra.sort();
        return Err(CheckpointError::UnexpectedTensors {
            dir: path,
            names: extra.join(", "),
        });
    }
    Ok(config)
}

/// Refuses `target_parameters` tune cannot load as peft would: on a model whose experts are not
/// fused parameters, or with DoRA or dropout (peft's `ParamWrapper` refuses both).
fn check_target_parameters(
    config: &AdapterConfig,
    args: &ModelArgs,
    dir: &Path,
) -> Result<(), CheckpointError> {
    let targets = config.target_parameters();
    if targets.is_empty() {
        return Ok(());
    }
    let invalid = |message: String| CheckpointError::Invalid {
        path: dir.join(ADAPTER_CONFIG),
        message,
    };
    if !experts_are_fused(args) {
        return Err(invalid(format!(
            "target_parameters {targets:?}: tune adapts parameters only on a model whose experts are fused (gpt-oss)"
        )));
    }
    if config.use_dora || config.lora_dropout != 0.0 {
        return Err(invalid(
            "target_parameters with use_dora or lora_dropout != 0: peft's ParamWrapper supports neither".into(),
        ));
    }
    Ok(())
}

/// The adapters of `config.target_parameters` on a fused-experts model, unstacked onto each
/// expert ([`check_target_parameters`] first); returns the keys read.
fn load_fused_experts<B: Backend>(
    model: &mut CausalLm<B>,
    config: &AdapterConfig,
    file: &SafetensorsFile,
    dir: &Path,
) -> Result<Vec<String>, CheckpointError> {
    let targets = config.target_parameters();
    if targets.is_empty() {
        return Ok(Vec::new());
    }
    let settings = config.settings();
    let device = model.device();
    let mut consumed = Vec::new();
    for (layer, experts) in fused_experts_mut(model) {
        let module = peft_experts::experts_module(layer);
        let params = peft_experts::targeted(&targets, &module);
        let n = experts.len();
        let Some(first) = experts.first() else {
            continue;
        };
        let shapes: Vec<(usize, usize)> = params.iter().map(|&p| fused_shape(first, p)).collect();
        for (&param, (inp, out)) in params.iter().zip(shapes) {
            let r = settings.rank;
            let mut take = |which: char, shape: [usize; 2]| {
                let key = peft_experts::key(&module, param, &params, which);
                let t = read_adapter_tensor(file, &key, shape, dir, r)?;
                consumed.push(key);
                Ok::<_, CheckpointError>(t)
            };
            let a = take('A', [n * r, inp])?;
            let b = take('B', [out, r * n])?;
            for (mlp, (a, b)) in experts.iter_mut().zip(peft_experts::unstack(&a, &b, n, r)) {
                let lora =
                    Lora::from_tensors(a.to_tensor(&device), b.to_tensor(&device), &settings);
                match param {
                    FusedParam::GateUp => mlp.lora = Some(lora),
                    FusedParam::Down => mlp.down_proj.lora = Some(lora),
                }
            }
        }
    }
    Ok(consumed)
}

/// Adapter tensor `key` of `file` (in `dir`), which must have `shape` (an adapter of `rank`).
fn read_adapter_tensor(
    file: &SafetensorsFile,
    key: &str,
    shape: [usize; 2],
    dir: &Path,
    rank: usize,
) -> Result<HostTensor, CheckpointError> {
    let found = file
        .shape(key)
        .ok_or_else(|| CheckpointError::MissingTensor {
            name: key.to_string(),
            dir: dir.join(ADAPTER_WEIGHTS),
            expected: shape.to_vec(),
        })?;
    if found != shape {
        return Err(CheckpointError::AdapterShape {
            name: key.to_string(),
            dir: dir.to_path_buf(),
            rank,
            expected: shape.to_vec(),
            found,
        });
    }
    file.read(key)
}

/// Tensor `key` of the adapter in `dir`, which must have `shape`: a missing tensor or another
/// shape is an error naming it (DoRA magnitudes, routers; the A and B factors name the rank
/// too, [`read_adapter_tensor`]).
fn read_shaped(
    file: &SafetensorsFile,
    key: &str,
    shape: &[usize],
    dir: &Path,
) -> Result<HostTensor, CheckpointError> {
    let path = dir.join(ADAPTER_WEIGHTS);
    let found = file
        .shape(key)
        .ok_or_else(|| CheckpointError::MissingTensor {
            name: key.to_string(),
            dir: path.clone(),
            expected: shape.to_vec(),
        })?;
    if found != shape {
        return Err(CheckpointError::Invalid {
            path,
            message: format!("{key} has shape {found:?}, expected {shape:?}"),
        });
    }
    file.read(key)
}

/// Every sparse layer's router (weight, and bias where the family has one) from an adapter
/// that trained them ([`AdapterConfig::trains_routers`]); returns the tensors read.
fn load_routers<B: Backend>(
    model: &mut CausalLm<B>,
    file: &SafetensorsFile,
    dir: &Path,
) -> Result<usize, CheckpointError> {
    let args = model.args.clone();
    let Some(naming) = args.moe.as_ref().map(|m| m.naming) else {
        return Ok(0);
    };
    let device = model.device();
    let read = |key: String, shape: &[usize]| read_shaped(file, &key, shape, dir);
    let mut used = 0;
    for (i, layer) in model.model.layers.iter_mut().enumerate() {
        let Some(moe) = layer.moe.as_mut() else {
            continue;
        };
        let (out, inp) = (moe.gate.out_features(), moe.gate.in_features());
        let weight = read(router_key(&args, naming, i, "weight"), &[out, inp])?;
        moe.gate.set_weight(weight.to_tensor(&device));
        used += 1;
        if let Some(bias) = moe.gate.bias.as_mut() {
            let value = read(router_key(&args, naming, i, "bias"), &[out])?;
            *bias = burn::module::Param::initialized(bias.id, value.to_tensor(&device));
            used += 1;
        }
    }
    Ok(used)
}

fn model_has_adapter_key<B: Backend>(model: &mut CausalLm<B>, key: &str) -> bool {
    let args = model.args.clone();
    model.linears_mut().iter().any(|(m, l)| {
        let m = peft_module(&args, m);
        l.lora.is_some()
            && (peft_key(&m, 'A') == key || peft_key(&m, 'B') == key || magnitude_key(&m) == key)
    })
}

/// What an adapter checkpoint of `model` holds under peft's keys: the adapter tensors
/// ([`adapter_state_dict`]) and, where `config` trains them, the routers
/// ([`AdapterConfig::trains_routers`]).
pub fn saved_adapter_state<B: Backend>(
    model: &mut CausalLm<B>,
    config: &AdapterConfig,
) -> Vec<(String, HostTensor)> {
    let mut out = adapter_state_dict(model);
    let args = model.args.clone();
    if let Some(naming) = args.moe.as_ref().map(|m| m.naming)
        && config.trains_routers(&args)
    {
        for (i, layer) in model.model.layers.iter().enumerate() {
            let Some(moe) = &layer.moe else {
                continue;
            };
            let weight = HostTensor::from_tensor(&moe.gate.base_weight());
            out.push((router_key(&args, naming, i, "weight"), weight));
            if let Some(bias) = &moe.gate.bias {
                let bias = HostTensor::from_tensor(&bias.val());
                out.push((router_key(&args, naming, i, "bias"), bias));
            }
        }
    }
    out
}

/// The adapter tensors of `model` under their PEFT keys.
pub fn adapter_state_dict<B: Backend>(model: &mut CausalLm<B>) -> Vec<(String, HostTensor)> {
    let mut out = Vec::new();
    let args = model.args.clone();
    for (module, linear) in model.linears_mut() {
        if fused_expert_linear(&args, &module) {
            continue;
        }
        let module = peft_module(&args, &module);
        if let Some(lora) = &linear.lora {
            out.push((
                peft_key(&module, 'A'),
                HostTensor::from_tensor(&lora.a.val()),
            ));
            out.push((
                peft_key(&module, 'B'),
                HostTensor::from_tensor(&lora.b.val()),
            ));
            if let Some(m) = &lora.magnitude {
                out.push((magnitude_key(&module), HostTensor::from_tensor(&m.val())));
            }
        }
    }
    for (layer, experts) in fused_experts_mut(model) {
        let module = peft_experts::experts_module(layer);
        let params: Vec<FusedParam> = FusedParam::ALL
            .into_iter()
            .filter(|&p| experts.iter().all(|mlp| fused_adapter(mlp, p).is_some()))
            .collect();
        for &param in &params {
            let per_expert: Vec<(HostTensor, HostTensor)> = experts
                .iter()
                .filter_map(|mlp| fused_adapter(mlp, param))
                .map(|l| {
                    (
                        HostTensor::from_tensor(&l.a.val()),
                        HostTensor::from_tensor(&l.b.val()),
                    )
                })
                .collect();
            let (a, b) = peft_experts::stack(&per_expert);
            out.push((peft_experts::key(&module, param, &params, 'A'), a));
            out.push((peft_experts::key(&module, param, &params, 'B'), b));
        }
    }
    out
}

/// Writes `adapter_model.safetensors` and `adapter_config.json` into `dir`.
pub fn save_adapter<B: Backend>(
    model: &mut CausalLm<B>,
    config: &AdapterConfig,
    dir: &Path,
) -> Result<Vec<String>, CheckpointError> {
    write_adapter(dir, &saved_adapter_state(model, config), config)
}

/// As [`save_adapter`] from tensors already on the host (for background saves).
pub fn write_adapter(
    dir: &Path,
    tensors: &[(String, HostTensor)],
    config: &AdapterConfig,
) -> Result<Vec<String>, CheckpointError> {
    std::fs::create_dir_all(dir).map_err(CheckpointError::io(dir))?;
    write_file(&dir.join(ADAPTER_WEIGHTS), tensors, StorageDtype::F32)?;
    config.write(dir)?;
    Ok(vec![ADAPTER_WEIGHTS.into(), ADAPTER_CONFIG.into()])
}
