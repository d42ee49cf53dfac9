//! Loading: built-in name or file -> YAML tree -> overrides -> interpolation.

use std::path::Path;

use serde_yaml::{Mapping, Value};

use crate::config::error::ConfigError;
use crate::config::{builtin, interpolate, overrides, shipped, suggest, yaml};

/// A config after overrides and interpolation, not yet validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedConfig {
    /// The file path, or the built-in config name.
    pub source: String,
    /// The resolved top-level mapping.
    pub value: Value,
    /// Top-level keys some `${...}` read: the config's variables, used through the keys that
    /// reference them (validation does not call them unknown).
    pub variables: std::collections::BTreeSet<String>,
}

impl ResolvedConfig {
    /// The resolved config as YAML (what `tune cat`/`--dry-run` style output shows).
    pub fn to_yaml_string(&self) -> String {
        serde_yaml::to_string(&self.value)
            .unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }
}

/// Loads `name_or_path` (built-in name, with or without `.yaml`, or a file path),
/// applies `overrides` (`a.b=v`, `~a.b`, `model=builder`), resolves `${...}` and points
/// shipped `assets/` paths missing here at tune's embedded copy ([`shipped`]).
pub fn load_config(
    name_or_path: &str,
    overrides: &[String],
) -> Result<ResolvedConfig, ConfigError> {
    let (source, text) = read_source(name_or_path)?;
    let mut value = parse_yaml(&source, &text)?;
    yaml::normalise_numbers(&mut value);
    overrides::apply_all(&mut value, overrides)?;
    let (mut value, variables) = interpolate::resolve_noting_sources(&value)?;
    shipped::resolve_paths(&mut value)?;
    Ok(ResolvedConfig {
        source,
        value,
        variables,
    })
}

/// Parses YAML text into a mapping; syntax errors carry line and column.
pub fn parse_yaml(source: &str, text: &str) -> Result<Value, ConfigError> {
    let value: Value = serde_yaml::from_str(text).map_err(|e| {
        let (line, column) = e.location().map_or((0, 0), |l| (l.line(), l.column()));
        // serde_yaml appends " at line L column C"; we print the location ourselves.
        let message = e.to_string();
        let message = message
            .split(" at line ")
            .next()
            .unwrap_or(&message)
            .to_string();
        ConfigError::Syntax {
            source_name: source.to_string(),
            line,
            column,
            message,
        }
    })?;
    match value {
        Value::Mapping(_) => Ok(value),
        // An empty file is an empty config; overrides may fill it.
        Value::Null => Ok(Value::Mapping(Mapping::new())),
        _ => Err(ConfigError::NotAMapping {
            source_name: source.to_string(),
        }),
    }
}

fn read_source(name_or_path: &str) -> Result<(String, String), ConfigError> {
    // Built-ins win, as in torchtune, so `tune run ... --config llama3_2/1B_lora_single_device`
    // works from any directory.
    if let Some(b) = builtin::get(name_or_path) {
        return Ok((b.name.to_string(), b.yaml.to_string()));
    }
    let path = Path::new(name_or_path);
    if path.is_file() {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        return Ok((name_or_path.to_string(), text));
    }
    let names: Vec<&str> = builtin::list().iter().map(|b| b.name).collect();
    let hint = suggest::did_you_mean(&suggest::similar(
        name_or_path.trim_end_matches(".yaml"),
        names.iter().copied(),
    ));
    Err(ConfigError::NotFound {
        name: name_or_path.to_string(),
        hint: if hint.is_empty() {
            "; `tune ls` lists the built-in configs".into()
        } else {
            format!("; {hint}")
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn builtin_with_and_without_yaml_suffix() {
        let a = load_config("llama3_2/1B_lora_single_device", &[]).unwrap();
        let b = load_config("llama3_2/1B_lora_single_device.yaml", &[]).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.source, "llama3_2/1B_lora_single_device");
    }

    #[test]
    fn overrides_apply_before_interpolation() {
        let c = load_config(
            "tiny/lora_single_device",
            &args(&[
                "output_dir=/tmp/elsewhere",
                "optimizer.lr=3e-4",
                "~log_peak_memory_stats",
            ]),
        )
        .unwrap();
        assert_eq!(
            yaml::get(&c.value, "metric_logger.log_dir").and_then(Value::as_str),
            Some("/tmp/elsewhere/logs")
        );
        assert_eq!(
            yaml::get(&c.value, "optimizer.lr").and_then(Value::as_f64),
            Some(3e-4)
        );
        assert!(c.to_yaml_string().contains("output_dir: /tmp/elsewhere"));
    }

    #[test]
    fn syntax_error_has_line_and_column() {
        let err = parse_yaml("bad.yaml", "a: 1\nb: [1,\nc: 2\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("YAML syntax error in bad.yaml at line 4, column 1: "),
            "{err}"
        );
        let err = parse_yaml("bad.yaml", "a: 1\n  b: 2\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("at line 2, column"), "{err}");
    }

    #[test]
    fn syntax_error_from_file() {
        let dir = tempfile::Builder::new()
            .prefix("tune-bad-")
            .tempdir()
            .unwrap();
        let path = dir.path().join("bad.yaml");
        std::fs::write(&path, "model:\n  _component_: x\n   lora_rank: 8\n").unwrap();
        let err = load_config(path.to_str().unwrap(), &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains(path.to_str().unwrap()), "{err}");
        assert!(err.contains("at line 3, column"), "{err}");
    }

    #[test]
    fn missing_config() {
        let err = load_config("llama3_2/1B_lora_single_devic", &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("neither a built-in config nor an existing file"),
            "{err}"
        );
        assert!(
            err.contains("did you mean") && err.contains("`llama3_2/1B_lora_single_device`"),
            "{err}"
        );
        let err = load_config("/nonexistent/x.yaml", &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("`/nonexistent/x.yaml` is neither"), "{err}");
    }

    #[test]
    fn non_mapping_rejected() {
        let err = parse_yaml("x", "- a\n- b\n").unwrap_err().to_string();
        assert!(err.contains("must be a mapping"), "{err}");
    }
}
