//! The quantized export of a QAT run: the decoder's linear weights stored as real int4 values
//! with per-group scales, everything else as floats, and a loader that dequantizes on load.
//!
//! Layout of `<checkpoint>/quantized/`:
//! - `model.safetensors`: for every quantized linear `P` (`model.layers.0.self_attn.q_proj`),
//!   `P.qweight` (U8 `[out, in / 2]`) and `P.scales` (F32 `[out, in / group_size]`); every
//!   other tensor (embeddings, norms, biases, an untied `lm_head`) under its Hugging Face name
//!   in the run's float storage dtype.
//! - `config.json`: the model's config plus a `quantization_config` entry (see
//!   [`quantization_config`]), and the tokenizer/generation files.
//!
//! Packing: row `r` of `qweight` holds the `in` int4 values of weight row `r`, two per byte:
//! byte `j` holds column `2j` in its low nibble and column `2j + 1` in its high nibble; each
//! nibble is `q + 8` (offset binary, 0..=15) for the signed value `q` in `[-8, 7]`. The
//! weight is `w[r, c] = q[r, c] * scales[r, c / group_size]`, symmetric (no zero point).
//! Scales are f32 so that dequantization reproduces the fake-quantized weights of training
//! bit for bit.

use std::collections::BTreeSet;
use std::path::Path;

use burn::tensor::backend::Backend;
use safetensors::Dtype;
use serde_json::{Value, json};

use super::hf::copy_companions;
use crate::checkpoint::error::CheckpointError;
use crate::checkpoint::host::HostTensor;
use crate::checkpoint::safetensors_io::{SINGLE_FILE, SafetensorsFile, StorageDtype, write_mixed};
use crate::models::{CausalLm, ModelArgs, ModelError, ParamSource, build, build::ignorable_tensor};
use crate::modules::fake_quant::{QuantScheme, int4_weight_values};

/// Sub-directory of a checkpoint that holds its quantized export.
pub const QUANTIZED_DIR: &str = "quantized";
/// Identifies this layout in `quantization_config.quant_method`.
pub const QUANT_METHOD: &str = "tune_int4_groupwise";
pub const FORMAT_VERSION: u64 = 1;

/// One tensor of the export.
#[derive(Debug, Clone)]
pub enum ExportTensor {
    Float {
        name: String,
        value: HostTensor,
    },
    /// `module` is the linear's path (`...q_proj`); `packed` is `[out, in / 2]`.
    Int4 {
        module: String,
        out: usize,
        inp: usize,
        packed: Vec<u8>,
        scales: HostTensor,
    },
}

impl ExportTensor {
    /// Bytes this tensor takes in the file (packed values plus scales for int4).
    pub fn stored_bytes(&self, float_dtype: StorageDtype) -> usize {
        match self {
            Self::Float { value, .. } => value.numel() * float_dtype.bytes_per_element(),
            Self::Int4 { packed, scales, .. } => packed.len() + scales.numel() * 4,
        }
    }
}

/// Whether a state-dict entry is a weight the export quantizes: a 2-D weight of the decoder's
/// layers (all linear projections, fused ones included; norms are 1-D). The output projection
/// and embeddings stay float, as torchtune's QAT quantizes `model.model`'s linears only.
pub fn is_quantized_weight(name: &str, value: &HostTensor) -> bool {
    name.starts_with("model.layers.") && name.ends_with(".weight") && value.shape.len() == 2
}

/// Quantizes a Hugging Face state dict for export. The int4 values and scales come from the
/// same tensor code as training's fake quantization, so `q * scale` equals the fake-quantized
/// weight exactly.
pub fn quantize_state<B: Backend>(
    state: &[(String, HostTensor)],
    group_size: usize,
    device: &B::Device,
) -> Result<Vec<ExportTensor>, CheckpointError> {
    let mut out = Vec::with_capacity(state.len());
    for (name, value) in state {
        if !is_quantized_weight(name, value) {
            out.push(ExportTensor::Float {
                name: name.clone(),
                value: value.clone(),
            });
            continue;
        }
        let (rows, cols) = (value.shape[0], value.shape[1]);
        if group_size < 2 || cols % group_size != 0 || cols % 2 != 0 {
            return Err(CheckpointError::Invalid {
                path: name.into(),
                message: format!(
                    "cannot quantize with group size {group_size}: in_features {cols} is not a multiple of it"
                ),
            });
        }
        let (q, scales) = int4_weight_values(value.to_tensor::<B, 2>(device), group_size);
        let q = HostTensor::from_tensor(&q);
        let scales = HostTensor::from_tensor(&scales);
        let module = name.trim_end_matches(".weight").to_string();
        out.push(ExportTensor::Int4 {
            module,
            out: rows,
            inp: cols,
            packed: pack_int4(&q.data),
            scales: HostTensor::new(vec![rows, cols / group_size], scales.data),
        });
    }
    Ok(out)
}

/// Two int4 values per byte: even index in the low nibble, odd in the high; nibble = q + 8.
pub fn pack_int4(q: &[f32]) -> Vec<u8> {
    q.chunks(2)
        .map(|pair| {
            let nibble = |v: f32| ((v as i32).clamp(-8, 7) + 8) as u8;
            let lo = nibble(pair[0]);
            let hi = pair.get(1).map_or(8, |&v| nibble(v));
            lo | (hi << 4)
        })
        .collect()
}

/// The inverse of [`pack_int4`]: `n` signed values.
pub fn unpack_int4(bytes: &[u8], n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n);
    for b in bytes {
        out.push(((b & 0x0F) as i32 - 8) as f32);
        out.push(((b >> 4) as i32 - 8) as f32);
    }
    out.truncate(n);
    out
}

/// The `quantization_config` entry of the export's config.json.
pub fn quantization_config(scheme: QuantScheme, group_size: usize, modules: &[String]) -> Value {
    let (name, activation) = match scheme {
        QuantScheme::Int4WeightOnly { .. } => ("int4_weight_only", Value::Null),
        _ => (
            "int8_dynamic_activation_int4_weight",
            json!({ "bits": 8, "granularity": "per_token", "symmetric": false, "dynamic": true }),
        ),
    };
    json!({
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "scheme": name,
        "weight": {
            "bits": 4,
            "symmetric": true,
            "group_size": group_size,
            "group_axis": "in_features",
            "qmin": -8,
            "qmax": 7,
            "packing": "qweight U8 [out, in/2]: byte j of a row = (q[2j] + 8) | (q[2j+1] + 8) << 4",
            "scales": "scales F32 [out, in/group_size]; w = q * scale",
        },
        "activation": activation,
        "modules": modules,
    })
}

/// Writes an export directory: `model.safetensors`, `config.json` (with
/// `quantization_config`), and the tokenizer files from `source_dir`. Returns the file names.
pub fn write_quantized(
    dir: &Path,
    tensors: &[ExportTensor],
    config_json: &Value,
    scheme: QuantScheme,
    group_size: usize,
    float_dtype: StorageDtype,
    source_dir: Option<&Path>,
) -> Result<Vec<String>, CheckpointError> {
    std::fs::create_dir_all(dir).map_err(CheckpointError::io(dir))?;
    let mut entries = Vec::with_capacity(tensors.len() * 2);
    let mut modules = Vec::new();
    for t in tensors {
        match t {
            ExportTensor::Float { name, value } => entries.push((
                name.clone(),
                float_dtype.safetensors(),
                value.shape.clone(),
                float_dtype.encode(&value.data),
            )),
            ExportTensor::Int4 {
                module,
                out,
                inp,
                packed,
                scales,
            } => {
                entries.push((
                    format!("{module}.qweight"),
                    Dtype::U8,
                    vec![*out, inp / 2],
                    packed.clone(),
                ));
                entries.push((
                    format!("{module}.scales"),
                    Dtype::F32,
                    scales.shape.clone(),
                    StorageDtype::F32.encode(&scales.data),
                ));
                modules.push(module.clone());
            }
        }
    }
    write_mixed(&dir.join(SINGLE_FILE), &entries)?;
    let mut config = config_json.clone();
    if let Some(obj) = config.as_object_mut() {
        let key = if obj.contains_key("dtype") {
            "dtype"
        } else {
            "torch_dtype"
        };
        obj.insert(key.into(), float_dtype.torch_name().into());
        obj.insert(
            "quantization_config".into(),
            quantization_config(scheme, group_size, &modules),
        );
    }
    let path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&config).unwrap_or_default();
    std::fs::write(&path, text + "\n").map_err(CheckpointError::io(&path))?;
    let mut files = vec![SINGLE_FILE.to_string(), "config.json".to_string()];
    if let Some(src) = source_dir {
        files.extend(copy_companions(src, dir)?);
    }
    Ok(files)
}

/// Quantizes `model` (LoRA adapters merged in first) and writes its export to `dir`.
pub fn save_quantized<B: Backend>(
    model: &mut CausalLm<B>,
    scheme: QuantScheme,
    dir: &Path,
    float_dtype: StorageDtype,
    source_dir: Option<&Path>,
) -> Result<Vec<String>, CheckpointError> {
    let group_size = scheme.group_size().ok_or_else(|| CheckpointError::Invalid {
        path: dir.to_path_buf(),
        message: "this model's weights are already quantized; export the original QAT checkpoint instead".into(),
    })?;
    let state = model.merged_hf_state_dict();
    let tensors = quantize_state::<B>(&state, group_size, &model.device())?;
    write_quantized(
        dir,
        &tensors,
        &model.args.raw,
        scheme,
        group_size,
        float_dtype,
        source_dir,
    )
}

/// What `quantization_config` says, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportInfo {
    pub scheme: QuantScheme,
    pub group_size: usize,
}

fn bad(path: &Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError::Invalid {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Whether a parsed config.json is a tune int4 export's (it names tune's quant method).
pub fn is_quantized_config(config: &Value) -> bool {
    config
        .get("quantization_config")
        .and_then(|q| q.get("quant_method"))
        .and_then(Value::as_str)
        == Some(QUANT_METHOD)
}

/// An export's config.json as the float model it loads as: its `quantization_config` checked
/// and taken out (a checkpoint saved from the loaded model must not claim to be quantized).
pub fn float_args(
    mut raw: Value,
    config_path: &Path,
) -> Result<(ModelArgs, ExportInfo), ModelError> {
    let info = read_quantization_config(&raw, config_path)?;
    if let Some(obj) = raw.as_object_mut() {
        obj.remove("quantization_config");
    }
    let args = ModelArgs::from_json(raw).map_err(|message| ModelError::BadConfig {
        path: config_path.to_path_buf(),
        message,
    })?;
    Ok((args, info))
}

/// Reads and checks `quantization_config` from a parsed config.json.
pub fn read_quantization_config(
    config: &Value,
    path: &Path,
) -> Result<ExportInfo, CheckpointError> {
    let q = config.get("quantization_config").ok_or_else(|| {
        bad(
            path,
            "no \"quantization_config\": not a tune quantized export",
        )
    })?;
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
    if method != QUANT_METHOD {
        return Err(bad(
            path,
            format!(
                "quantization_config.quant_method is \"{method}\"; tune reads \"{QUANT_METHOD}\""
            ),
        ));
    }
    let version = q.get("format_version").and_then(Value::as_u64).unwrap_or(0);
    if version != FORMAT_VERSION {
        return Err(bad(
            path,
            format!(
                "quantization_config.format_version {version} is not supported (expected {FORMAT_VERSION})"
            ),
        ));
    }
    let group_size = q
        .pointer("/weight/group_size")
        .and_then(Value::as_u64)
        .filter(|&g| g >= 2)
        .ok_or_else(|| {
            bad(
                path,
                "quantization_config.weight.group_size: missing or less than 2",
            )
        })? as usize;
    let scheme = match q.get("scheme").and_then(Value::as_str) {
        Some("int8_dynamic_activation_int4_weight") => {
            QuantScheme::Int8DynActInt4Weight { group_size }
        }
        Some("int4_weight_only") => QuantScheme::Int4WeightOnly { group_size },
        other => {
            return Err(bad(
                path,
                format!("quantization_config.scheme {other:?} is not one tune writes"),
            ));
        }
    };
    Ok(ExportInfo { scheme, group_size })
}

/// Reads tensors from the export, dequantizing `P.weight` from `P.qweight` + `P.scales`.
struct QuantizedSource {
    file: SafetensorsFile,
    group_size: usize,
    names: BTreeSet<String>,
    quantized_modules: Vec<String>,
}

impl QuantizedSource {
    fn dequantize(
        &mut self,
        module: &str,
        expected: &[usize],
    ) -> Result<HostTensor, CheckpointError> {
        let path = self.file.path.clone();
        let (qname, sname) = (format!("{module}.qweight"), format!("{module}.scales"));
        let [out, inp] = expected else {
            return Err(bad(
                &path,
                format!("{qname}: the model expects a {}-D weight", expected.len()),
            ));
        };
        let (out, inp, g) = (*out, *inp, self.group_size);
        if inp % g != 0 || inp % 2 != 0 {
            return Err(bad(
                &path,
                format!("{qname}: in_features {inp} is not a multiple of group_size {g}"),
            ));
        }
        let (dtype, shape, bytes) = self.file.raw(&qname)?;
        if dtype != Dtype::U8 || shape != [out, inp / 2] {
            return Err(bad(
                &path,
                format!(
                    "{qname}: expected U8 [{out}, {}], found {dtype:?} {shape:?}",
                    inp / 2
                ),
            ));
        }
        let q = unpack_int4(bytes, out * inp);
        let scales = self.file.read(&sname)?;
        if scales.shape != [out, inp / g] {
            return Err(bad(
                &path,
                format!(
                    "{sname}: expected shape [{out}, {}], found {:?}",
                    inp / g,
                    scales.shape
                ),
            ));
        }
        let data = q
            .iter()
            .enumerate()
            .map(|(i, v)| v * scales.data[i / g])
            .collect();
        self.names.remove(&qname);
        self.names.remove(&sname);
        self.quantized_modules.push(module.to_string());
        Ok(HostTensor::new(vec![out, inp], data))
    }
}

impl ParamSource for QuantizedSource {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<HostTensor, CheckpointError> {
        if let Some(module) = name.strip_suffix(".weight")
            && self.names.contains(&format!("{module}.qweight"))
        {
            return self.dequantize(module, shape);
        }
        let value = self.file.read(name)?;
        if value.shape != shape {
            return Err(CheckpointError::ShapeMismatch {
                name: name.to_string(),
                file: self.file.path.clone(),
                expected: shape.to_vec(),
                found: value.shape,
            });
        }
        self.names.remove(name);
        Ok(value)
    }
}

/// Loads a quantized export as a float model whose linear weights are the dequantized int4
/// values. For an int8-activation export the decoder's linears keep simulating the dynamic
/// int8 activation quantization (weights are not re-quantized), so its forward pass equals
/// the fake-quantized model's that produced it.
pub fn load_quantized_model<B: Backend>(
    dir: &Path,
    device: &B::Device,
) -> Result<CausalLm<B>, ModelError> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|source| ModelError::Io {
        path: config_path.clone(),
        source,
    })?;
    let raw: Value = serde_json::from_str(&text).map_err(|e| ModelError::BadConfig {
        path: config_path.clone(),
        message: e.to_string(),
    })?;
    let (args, info) = float_args(raw, &config_path)?;
    build_export(dir, &args, info, device)
}

/// The float model of the export in `dir`, whose config `args` and `info` are.
pub fn build_export<B: Backend>(
    dir: &Path,
    args: &ModelArgs,
    info: ExportInfo,
    device: &B::Device,
) -> Result<CausalLm<B>, ModelError> {
    let file = SafetensorsFile::open(&dir.join(SINGLE_FILE))?;
    let names = file.names().into_iter().collect();
    let mut source = QuantizedSource {
        file,
        group_size: info.group_size,
        names,
        quantized_modules: Vec::new(),
    };
    let mut model = build::<B>(args, &mut source, device)?;
    let leftover: Vec<String> = source
        .names
        .iter()
        .filter(|n| !ignorable_tensor(args, n))
        .cloned()
        .collect();
    if !leftover.is_empty() {
        return Err(CheckpointError::UnexpectedTensors {
            dir: dir.to_path_buf(),
            names: leftover.join(", "),
        }
        .into());
    }
    // Every decoder linear weight is quantized in an export (Phi-3's fused projections are
    // stored fused, so match by layer rather than by module name).
    if let Some(scheme) = info.scheme.after_weight_export()
        && !source.quantized_modules.is_empty()
    {
        for (path, linear) in model.linears_mut() {
            if path.starts_with("model.layers.") {
                linear.quant = Some(scheme);
            }
        }
    }
    Ok(model)
}
