//! Small helpers over `serde_yaml::Value`: dotted-path access, number normalisation,
//! and human-readable descriptions of values for error messages.

use serde_yaml::{Mapping, Value};

/// Walks a dotted path (`a.b.0.c`); numeric segments index into sequences.
pub fn get<'a>(root: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(root, |node, seg| match node {
        Value::Mapping(m) => m.get(seg),
        Value::Sequence(s) => seg.parse::<usize>().ok().and_then(|i| s.get(i)),
        _ => None,
    })
}

/// Sets `path` to `value`, creating missing intermediate mappings.
/// Fails (with the offending prefix) when an intermediate node is a scalar or list.
pub fn set(root: &mut Value, path: &str, value: Value) -> Result<(), String> {
    let segs: Vec<&str> = path.split('.').collect();
    let mut node = root;
    for (i, seg) in segs.iter().enumerate() {
        let last = i + 1 == segs.len();
        let Value::Mapping(map) = node else {
            return Err(format!(
                "`{}` is not a mapping, so it has no key `{seg}`",
                segs[..i].join(".")
            ));
        };
        let key = Value::String((*seg).to_string());
        if last {
            map.insert(key, value);
            return Ok(());
        }
        node = map
            .entry(key)
            .or_insert_with(|| Value::Mapping(Mapping::new()));
        if node.is_null() {
            *node = Value::Mapping(Mapping::new());
        }
    }
    Ok(())
}

/// Removes the key at `path`, returning its old value (None when absent).
pub fn remove(root: &mut Value, path: &str) -> Option<Value> {
    let (parent, leaf) = match path.rsplit_once('.') {
        Some((p, l)) => (get_mut(root, p)?, l),
        None => (root, path),
    };
    parent.as_mapping_mut()?.remove(leaf)
}

fn get_mut<'a>(root: &'a mut Value, path: &str) -> Option<&'a mut Value> {
    path.split('.').try_fold(root, |node, seg| match node {
        Value::Mapping(m) => m.get_mut(seg),
        Value::Sequence(s) => seg.parse::<usize>().ok().and_then(|i| s.get_mut(i)),
        _ => None,
    })
}

/// True for strings such as `3e-4`, `1.5E+3`, `.5e2`: scientific notation that
/// OmegaConf (YAML 1.1 + torchtune's float resolver) reads as a float.
pub fn is_scientific(s: &str) -> bool {
    let body = s.strip_prefix(['+', '-']).unwrap_or(s);
    let Some((mantissa, exp)) = body.split_once(['e', 'E']) else {
        return false;
    };
    let exp = exp.strip_prefix(['+', '-']).unwrap_or(exp);
    let mantissa_ok = {
        let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        (!int.is_empty() || !frac.is_empty())
            && int.bytes().all(|b| b.is_ascii_digit())
            && frac.bytes().all(|b| b.is_ascii_digit())
    };
    mantissa_ok && !exp.is_empty() && exp.bytes().all(|b| b.is_ascii_digit())
}

/// Converts scientific-notation strings to floats everywhere in the tree, so
/// `lr: "3e-4"` behaves as in torchtune whatever the YAML reader decided.
pub fn normalise_numbers(value: &mut Value) {
    match value {
        Value::String(s) if is_scientific(s) => {
            if let Ok(f) = s.parse::<f64>() {
                *value = Value::Number(f.into());
            }
        }
        Value::Mapping(m) => m.values_mut().for_each(normalise_numbers),
        Value::Sequence(s) => s.iter_mut().for_each(normalise_numbers),
        Value::Tagged(t) => normalise_numbers(&mut t.value),
        _ => {}
    }
}

/// The YAML type of a value, as used in "expected X, found Y" messages.
pub fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a float",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a mapping",
        Value::Tagged(_) => "a tagged value",
    }
}

/// A short, one-line rendering of a value for messages (`"abc"`, `12`, `[...]`).
pub fn short(value: &Value) -> String {
    let text = match value {
        Value::String(s) => format!("{s:?}"),
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        other => serde_json::to_string(other).unwrap_or_else(|_| "<value>".into()),
    };
    if text.chars().count() > 60 {
        let cut: String = text.chars().take(57).collect();
        format!("{cut}...")
    } else {
        text
    }
}

/// Mapping keys as strings (non-string keys are rendered as YAML scalars).
pub fn key_str(key: &Value) -> String {
    match key {
        Value::String(s) => s.clone(),
        other => short(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scientific_detection() {
        for s in ["3e-4", "3E-4", "1.5e+3", ".5e2", "-2e5", "5.e-1"] {
            assert!(is_scientific(s), "{s}");
        }
        for s in ["e5", "3e", "abc", "3.0", "1e-", "q_proj", "3e-4x"] {
            assert!(!is_scientific(s), "{s}");
        }
    }

    #[test]
    fn normalises_nested_strings() {
        let mut v: Value = serde_yaml::from_str("a: {lr: '3e-4'}\nb: ['1e-3', x]").unwrap();
        normalise_numbers(&mut v);
        assert_eq!(get(&v, "a.lr").and_then(Value::as_f64), Some(3e-4));
        assert_eq!(get(&v, "b.0").and_then(Value::as_f64), Some(1e-3));
        assert_eq!(get(&v, "b.1").and_then(Value::as_str), Some("x"));
    }

    #[test]
    fn set_get_remove() {
        let mut v = Value::Mapping(Mapping::new());
        set(&mut v, "a.b.c", Value::from(1)).unwrap();
        assert_eq!(get(&v, "a.b.c"), Some(&Value::from(1)));
        assert!(set(&mut v, "a.b.c.d", Value::from(2)).is_err());
        assert_eq!(remove(&mut v, "a.b.c"), Some(Value::from(1)));
        assert_eq!(remove(&mut v, "a.zz"), None);
    }
}
