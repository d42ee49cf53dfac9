//! torchtune-style command-line overrides, applied to the raw YAML tree before
//! interpolation (so `output_dir=/x` also moves `${output_dir}/logs`).
//!
//! Forms: `a.b=value` (value parsed as YAML), `~a.b` (delete), and the component
//! shorthand `model=pkg.builder`, which sets `model._component_` when `model`
//! is a mapping holding a `_component_`.

use serde_yaml::Value;

use crate::config::error::ConfigError;
use crate::config::yaml;

/// One parsed override.
#[derive(Debug, Clone, PartialEq)]
pub enum Override {
    Set { key: String, value: Value },
    Delete { key: String },
}

impl Override {
    /// Parses `key=value` or `~key`.
    pub fn parse(arg: &str) -> Result<Self, ConfigError> {
        let bad = |reason: &str| ConfigError::BadOverride {
            arg: arg.to_string(),
            reason: reason.to_string(),
        };
        if let Some(key) = arg.strip_prefix('~') {
            let key = key.split_once('=').map_or(key, |(k, _)| k).trim();
            check_key(key).map_err(|r| bad(&r))?;
            return Ok(Self::Delete { key: key.into() });
        }
        let Some((key, raw)) = arg.split_once('=') else {
            return Err(bad(
                "expected `key=value` (or `~key` to delete a key), e.g. `batch_size=8`",
            ));
        };
        let key = key.trim();
        check_key(key).map_err(|r| bad(&r))?;
        Ok(Self::Set {
            key: key.into(),
            value: parse_value(raw),
        })
    }

    /// Applies this override to `root`.
    pub fn apply(&self, root: &mut Value, arg: &str) -> Result<(), ConfigError> {
        let bad = |reason: String| ConfigError::BadOverride {
            arg: arg.to_string(),
            reason,
        };
        match self {
            Self::Delete { key } => yaml::remove(root, key)
                .map(|_| ())
                .ok_or_else(|| bad(format!("cannot delete `{key}`: no such key in the config"))),
            Self::Set { key, value } => {
                // torchtune shorthand: `model=torchtune.models.x.y` replaces only the
                // builder of a component section, keeping its other arguments.
                let is_component_section = yaml::get(root, key)
                    .and_then(Value::as_mapping)
                    .is_some_and(|m| m.contains_key("_component_"));
                let target = if is_component_section && value.is_string() {
                    format!("{key}._component_")
                } else {
                    key.clone()
                };
                yaml::set(root, &target, value.clone()).map_err(bad)
            }
        }
    }
}

/// Applies every override in order.
pub fn apply_all(root: &mut Value, args: &[String]) -> Result<(), ConfigError> {
    for arg in args {
        Override::parse(arg)?.apply(root, arg)?;
    }
    Ok(())
}

/// As deep as YAML itself nests; deeper keys would only overflow the stack of every walk
/// over the tree.
const MAX_KEY_SEGMENTS: usize = 128;

fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(format!(
            "`{key}` is not a valid dotted key such as `model.lora_rank`"
        ));
    }
    let segments = key.split('.').count();
    if segments > MAX_KEY_SEGMENTS {
        return Err(format!(
            "the key has {segments} dotted parts; config keys nest at most {MAX_KEY_SEGMENTS} levels deep"
        ));
    }
    Ok(())
}

/// Parses an override value as YAML like OmegaConf does: `16` is an int, `3e-4` a
/// float, `[q_proj,v_proj]` a list, `null`/empty is null. Text that YAML would
/// read as an implicit mapping (`Tell me: a joke`) or cannot parse stays a string.
pub fn parse_value(raw: &str) -> Value {
    let trimmed = raw.trim();
    let mut value = match serde_yaml::from_str::<Value>(trimmed) {
        Ok(Value::Mapping(_)) if !trimmed.starts_with('{') => Value::String(raw.to_string()),
        Ok(v) => v,
        Err(_) => Value::String(raw.to_string()),
    };
    yaml::normalise_numbers(&mut value);
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(src: &str) -> Value {
        serde_yaml::from_str(src).unwrap()
    }

    fn run(src: &str, args: &[&str]) -> Result<Value, ConfigError> {
        let mut v = tree(src);
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        apply_all(&mut v, &args).map(|_| v)
    }

    #[test]
    fn value_types() {
        assert_eq!(parse_value("16"), Value::from(16));
        assert_eq!(parse_value("3e-4").as_f64(), Some(3e-4));
        assert_eq!(parse_value("True"), Value::Bool(true));
        assert_eq!(parse_value("null"), Value::Null);
        assert_eq!(parse_value(""), Value::Null);
        assert_eq!(parse_value("[q_proj,v_proj]"), tree("[q_proj, v_proj]"));
        assert_eq!(parse_value("{a: 1}"), tree("{a: 1}"));
        assert_eq!(
            parse_value("Tell me: a joke"),
            Value::from("Tell me: a joke")
        );
        assert_eq!(parse_value("/tmp/x y"), Value::from("/tmp/x y"));
        assert_eq!(
            parse_value("${output_dir}/x"),
            Value::from("${output_dir}/x")
        );
    }

    #[test]
    fn set_nested_and_new_keys() {
        let v = run(
            "model: {lora_rank: 8}",
            &["model.lora_rank=16", "new.key=1"],
        )
        .unwrap();
        assert_eq!(yaml::get(&v, "model.lora_rank"), Some(&Value::from(16)));
        assert_eq!(yaml::get(&v, "new.key"), Some(&Value::from(1)));
    }

    #[test]
    fn list_and_float_values() {
        let v = run(
            "model: {lora_attn_modules: [q_proj]}\noptimizer: {lr: 1}",
            &[
                "model.lora_attn_modules=[q_proj,v_proj]",
                "optimizer.lr=3e-4",
            ],
        )
        .unwrap();
        assert_eq!(
            yaml::get(&v, "model.lora_attn_modules"),
            Some(&tree("[q_proj, v_proj]"))
        );
        assert_eq!(
            yaml::get(&v, "optimizer.lr").and_then(Value::as_f64),
            Some(3e-4)
        );
    }

    #[test]
    fn delete() {
        let v = run("a: 1\nb: {c: 2, d: 3}", &["~a", "~b.c"]).unwrap();
        assert_eq!(v, tree("b: {d: 3}"));
        let err = run("a: 1", &["~zz"]).unwrap_err().to_string();
        assert!(err.contains("cannot delete `zz`: no such key"), "{err}");
    }

    #[test]
    fn component_shorthand() {
        let v = run(
            "model: {_component_: a.b, lora_rank: 8}",
            &["model=torchtune.models.llama3_2.lora_llama3_2_1b"],
        )
        .unwrap();
        assert_eq!(
            v,
            tree("model: {_component_: torchtune.models.llama3_2.lora_llama3_2_1b, lora_rank: 8}")
        );
        let v = run("model: {_component_: a.b}", &["model._component_=x.y"]).unwrap();
        assert_eq!(v, tree("model: {_component_: x.y}"));
    }

    #[test]
    fn malformed() {
        for (arg, needle) in [
            ("batch_size", "expected `key=value`"),
            ("=3", "not a valid dotted key"),
            ("a..b=3", "not a valid dotted key"),
            ("a.b=3", "`a` is not a mapping"),
        ] {
            let err = run("a: 1", &[arg]).unwrap_err().to_string();
            assert!(err.contains(needle), "{arg}: {err}");
        }
    }
}
