//! The `README.md` model card: YAML front matter the Hub indexes, and a body
//! summarising the run with a "How to load" snippet.

use std::fmt::Write as _;
use std::path::Path;

use crate::hub::error::HubError;

/// LoRA hyper-parameters, as in `adapter_config.json`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoraInfo {
    pub r: Option<u64>,
    pub alpha: Option<f64>,
    pub dropout: Option<f64>,
    pub target_modules: Vec<String>,
}

impl LoraInfo {
    /// Reads `r`, `lora_alpha`, `lora_dropout`, `target_modules` (a list or a string).
    pub fn from_adapter_config(config: &serde_json::Value) -> Self {
        let target_modules = match config.get("target_modules") {
            Some(serde_json::Value::Array(items)) => items
                .iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect(),
            Some(serde_json::Value::String(s)) => vec![s.clone()],
            _ => Vec::new(),
        };
        LoraInfo {
            r: config.get("r").and_then(|v| v.as_u64()),
            alpha: config.get("lora_alpha").and_then(|v| v.as_f64()),
            dropout: config.get("lora_dropout").and_then(|v| v.as_f64()),
            target_modules,
        }
    }
}

/// Everything the card can say about a run; unknown fields are left out.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelCardInfo {
    /// Where the card is published (used in the loading snippet).
    pub repo_id: String,
    pub base_model: Option<String>,
    /// True for a PEFT adapter, false for a full checkpoint.
    pub adapter: bool,
    /// Recipe name, e.g. `lora_finetune_single_device`.
    pub recipe: Option<String>,
    pub datasets: Vec<String>,
    pub license: Option<String>,
    pub lora: Option<LoraInfo>,
    pub steps: Option<u64>,
    pub epochs: Option<u64>,
    pub final_loss: Option<f64>,
    /// Further metrics, in order (name, formatted value).
    pub metrics: Vec<(String, String)>,
    /// The command that reproduces the run.
    pub command: Option<String>,
    /// Extra tags after the defaults.
    pub tags: Vec<String>,
    /// The folder holds tune's int4 export under `quantized/` (QAT recipes).
    pub quantized: bool,
}

impl ModelCardInfo {
    /// What can be read from a pushable folder: the base model and LoRA
    /// settings from `adapter_config.json` (or `_name_or_path` from `config.json`).
    pub fn from_dir(dir: &Path, repo_id: &str) -> Result<Self, HubError> {
        let mut info = ModelCardInfo {
            repo_id: repo_id.to_string(),
            ..Self::default()
        };
        let adapter_config = dir.join("adapter_config.json");
        if adapter_config.is_file() && dir.join("adapter_model.safetensors").is_file() {
            let config = read_json(&adapter_config)?;
            info.adapter = true;
            info.base_model = hub_id_field(&config, "base_model_name_or_path");
            info.lora = Some(LoraInfo::from_adapter_config(&config));
        } else if dir.join("config.json").is_file() {
            let config = read_json(&dir.join("config.json"))?;
            info.base_model = hub_id_field(&config, "_name_or_path");
        }
        info.quantized = dir.join("quantized/config.json").is_file();
        Ok(info)
    }
}

/// A base model the card may name: a Hub repo id, never a local path (the Hub rejects such
/// metadata, and nobody else can load from it).
fn hub_id_field(config: &serde_json::Value, key: &str) -> Option<String> {
    str_field(config, key).filter(|name| crate::hub::provenance::is_hub_id(name))
}

fn read_json(path: &Path) -> Result<serde_json::Value, HubError> {
    let text = std::fs::read_to_string(path).map_err(HubError::io("read", path))?;
    serde_json::from_str(&text).map_err(|e| HubError::InvalidPushDir {
        dir: path.to_path_buf(),
        reason: format!("it is not valid JSON: {e}"),
    })
}

fn str_field(config: &serde_json::Value, key: &str) -> Option<String> {
    config
        .get(key)
        .and_then(|v| v.as_str())
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
}

/// A YAML scalar: plain when unambiguous, else a JSON (= YAML) double-quoted string.
fn yaml_scalar(value: &str) -> String {
    let plain = value
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric())
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '/' | '-'))
        && !matches!(
            value.to_ascii_lowercase().as_str(),
            "true" | "false" | "yes" | "no" | "on" | "off" | "null" | "y" | "n"
        )
        && value.parse::<f64>().is_err();
    if plain {
        value.to_string()
    } else {
        serde_json::Value::String(value.to_string()).to_string()
    }
}

fn yaml_list(out: &mut String, key: &str, items: &[String]) {
    if items.is_empty() {
        return;
    }
    let _ = writeln!(out, "{key}:");
    for item in items {
        let _ = writeln!(out, "- {}", yaml_scalar(item));
    }
}

fn cell(value: &str) -> String {
    value.replace('|', "\\|").replace('\n', " ")
}

fn python_str(value: &str) -> String {
    serde_json::Value::String(value.to_string()).to_string()
}

fn fmt_float(value: f64) -> String {
    if value.fract() == 0.0 && value.abs() < 1e15 {
        format!("{value:.0}")
    } else {
        format!("{value:.4}")
    }
}

/// Renders the card.
pub fn render(info: ModelCardInfo) -> String {
    let mut tags = vec!["tune".to_string()];
    if info.adapter {
        tags.push("lora".into());
        tags.push("peft".into());
    }
    tags.extend(info.recipe.iter().cloned());
    tags.extend(info.tags.iter().cloned());
    let mut seen = std::collections::HashSet::new();
    tags.retain(|t| !t.trim().is_empty() && seen.insert(t.clone()));

    let mut out = String::from("---\n");
    if let Some(base) = &info.base_model {
        let _ = writeln!(out, "base_model: {}", yaml_scalar(base));
    }
    let library = if info.adapter { "peft" } else { "transformers" };
    let _ = writeln!(out, "library_name: {library}");
    if let Some(license) = &info.license {
        let _ = writeln!(out, "license: {}", yaml_scalar(license));
    }
    yaml_list(&mut out, "datasets", &info.datasets);
    yaml_list(&mut out, "tags", &tags);
    out.push_str("pipeline_tag: text-generation\n---\n\n");

    let name = info.repo_id.rsplit('/').next().unwrap_or(&info.repo_id);
    let _ = writeln!(out, "# {name}\n");
    let what = if info.adapter {
        "LoRA adapter"
    } else {
        "model"
    };
    match &info.base_model {
        Some(base) => {
            let _ = writeln!(
                out,
                "This {what} was fine-tuned from [{base}](https://huggingface.co/{base}) with tune, a Rust re-implementation of torchtune.\n"
            );
        }
        None => {
            let _ = writeln!(
                out,
                "This {what} was fine-tuned with tune, a Rust re-implementation of torchtune.\n"
            );
        }
    }

    let mut rows: Vec<(String, String)> = Vec::new();
    if let Some(recipe) = &info.recipe {
        rows.push(("Recipe".into(), format!("`{recipe}`")));
    }
    if let Some(base) = &info.base_model {
        rows.push(("Base model".into(), base.clone()));
    }
    if !info.datasets.is_empty() {
        rows.push(("Datasets".into(), info.datasets.join(", ")));
    }
    if let Some(lora) = &info.lora {
        if let Some(r) = lora.r {
            rows.push(("LoRA rank (r)".into(), r.to_string()));
        }
        if let Some(alpha) = lora.alpha {
            rows.push(("LoRA alpha".into(), fmt_float(alpha)));
        }
        if let Some(dropout) = lora.dropout {
            rows.push(("LoRA dropout".into(), fmt_float(dropout)));
        }
        if !lora.target_modules.is_empty() {
            rows.push(("LoRA target modules".into(), lora.target_modules.join(", ")));
        }
    }
    if let Some(epochs) = info.epochs {
        rows.push(("Epochs".into(), epochs.to_string()));
    }
    if let Some(steps) = info.steps {
        rows.push(("Steps".into(), steps.to_string()));
    }
    if let Some(loss) = info.final_loss {
        rows.push(("Final loss".into(), fmt_float(loss)));
    }
    rows.extend(info.metrics.iter().cloned());
    if !rows.is_empty() {
        out.push_str("## Training\n\n| | |\n|---|---|\n");
        for (key, value) in &rows {
            let _ = writeln!(out, "| {} | {} |", cell(key), cell(value));
        }
        out.push('\n');
    }
    if let Some(command) = &info.command {
        let _ = writeln!(out, "## Reproduce\n\n```bash\n{command}\n```\n");
    }

    out.push_str("## How to load\n\n```python\n");
    let repo = python_str(&info.repo_id);
    if info.adapter {
        let base = python_str(info.base_model.as_deref().unwrap_or("<base model>"));
        let _ = writeln!(
            out,
            "from peft import PeftModel\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\nmodel = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base}), {repo})\ntokenizer = AutoTokenizer.from_pretrained({base})"
        );
    } else {
        let _ = writeln!(
            out,
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\nmodel = AutoModelForCausalLM.from_pretrained({repo})\ntokenizer = AutoTokenizer.from_pretrained({repo})"
        );
    }
    out.push_str("```\n");
    if info.quantized {
        let _ = writeln!(
            out,
            "\n## The int4 export in `quantized/`\n\n`quantized/` holds the quantization-aware-trained model with its decoder linear weights stored as int4 values and per-group scales (`quant_method: tune_int4_groupwise` in its config.json). transformers has no loader for that format: load the files above, or run the export with tune, which dequantizes it on load:\n\n```bash\ntune download {} --output-dir model\ntune run generate --config <your generation config> checkpointer.checkpoint_dir=model/quantized\n```",
            info.repo_id
        );
    }
    out
}
