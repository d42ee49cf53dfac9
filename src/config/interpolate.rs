//! `${a.b}` interpolation, resolved against the config root as OmegaConf does.
//!
//! A value that is exactly one `${ref}` takes the referenced value with its type
//! (int stays int, a mapping stays a mapping); references embedded in text
//! (`${output_dir}/logs`) are rendered into the string. References may chain;
//! cycles and dangling references are errors naming the key that holds them.

use std::collections::{BTreeSet, HashMap};

use serde_yaml::{Mapping, Value};

use crate::config::error::ConfigError;
use crate::config::yaml;

/// How deep resolution may recurse (nested values plus chained references). A config tree
/// alone stays far below it (YAML nests at most 128 levels, an override key and its value 256);
/// only a chain of hundreds of references reaches it, which would otherwise overflow the stack.
const MAX_DEPTH: usize = 512;

/// Returns a copy of `root` with every interpolation resolved.
pub fn resolve(root: &Value) -> Result<Value, ConfigError> {
    resolve_noting_sources(root).map(|(value, _)| value)
}

/// [`resolve`], and the top-level keys some `${...}` read: a config's variables (torchtune's
/// GRPO configs write `base_model_path: ...` once and `${base_model_path}` in both
/// checkpointers), whose values are used through the keys that reference them.
pub fn resolve_noting_sources(root: &Value) -> Result<(Value, BTreeSet<String>), ConfigError> {
    let mut resolver = Resolver {
        root,
        stack: Vec::new(),
        cache: HashMap::new(),
        depth: 0,
        sources: BTreeSet::new(),
    };
    let value = resolver.node(root, "")?;
    Ok((value, resolver.sources))
}

enum Part<'s> {
    Text(&'s str),
    Ref(&'s str),
}

struct Resolver<'a> {
    root: &'a Value,
    /// Keys whose value is being resolved right now, outermost first (cycle detection).
    stack: Vec<String>,
    cache: HashMap<String, Value>,
    /// `node` calls in progress.
    depth: usize,
    /// The top-level key of every reference resolved.
    sources: BTreeSet<String>,
}

fn join(parent: &str, child: &str) -> String {
    if parent.is_empty() {
        child.to_string()
    } else {
        format!("{parent}.{child}")
    }
}

impl Resolver<'_> {
    fn node(&mut self, node: &Value, path: &str) -> Result<Value, ConfigError> {
        self.depth += 1;
        let result = self.node_inner(node, path);
        self.depth -= 1;
        result
    }

    fn node_inner(&mut self, node: &Value, path: &str) -> Result<Value, ConfigError> {
        Ok(match node {
            Value::String(s) if s.contains("${") => self.string(s, path)?,
            Value::Mapping(m) => {
                let mut out = Mapping::with_capacity(m.len());
                for (k, v) in m {
                    out.insert(k.clone(), self.node(v, &join(path, &yaml::key_str(k)))?);
                }
                Value::Mapping(out)
            }
            Value::Sequence(items) => Value::Sequence(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| self.node(v, &join(path, &i.to_string())))
                    .collect::<Result<_, _>>()?,
            ),
            other => other.clone(),
        })
    }

    fn string(&mut self, text: &str, path: &str) -> Result<Value, ConfigError> {
        let parts = split(text).map_err(|reason| ConfigError::BadInterpolation {
            key: path.to_string(),
            text: text.to_string(),
            reason,
        })?;
        let pushed = !self.stack.iter().any(|k| k == path);
        if pushed {
            self.stack.push(path.to_string());
        }
        let result = self.render(&parts, text, path);
        if pushed {
            self.stack.pop();
        }
        result
    }

    fn render(&mut self, parts: &[Part<'_>], text: &str, path: &str) -> Result<Value, ConfigError> {
        if let [Part::Ref(r)] = parts {
            return self.reference(r, path);
        }
        let mut out = String::new();
        for part in parts {
            match part {
                Part::Text(t) => out.push_str(t),
                Part::Ref(r) => match self.reference(r, path)? {
                    Value::String(s) => out.push_str(&s),
                    Value::Number(n) => out.push_str(&n.to_string()),
                    // Python's str() of a bool/None, which is what torchtune users see.
                    Value::Bool(b) => out.push_str(if b { "True" } else { "False" }),
                    Value::Null => out.push_str("None"),
                    other => {
                        return Err(ConfigError::BadInterpolation {
                            key: path.to_string(),
                            text: text.to_string(),
                            reason: format!(
                                "`{r}` is {}, which cannot be embedded in a string",
                                yaml::type_name(&other)
                            ),
                        });
                    }
                },
            }
        }
        Ok(Value::String(out))
    }

    fn reference(&mut self, reference: &str, from: &str) -> Result<Value, ConfigError> {
        let top = reference.split('.').next().unwrap_or(reference);
        self.sources.insert(top.to_string());
        if let Some(v) = self.cache.get(reference) {
            return Ok(v.clone());
        }
        if let Some(pos) = self.stack.iter().position(|k| k == reference) {
            let mut chain = self.stack[pos..].to_vec();
            chain.push(reference.to_string());
            return Err(ConfigError::InterpolationCycle {
                key: from.to_string(),
                chain,
            });
        }
        if self.depth >= MAX_DEPTH {
            return Err(ConfigError::BadInterpolation {
                key: from.to_string(),
                text: format!("${{{reference}}}"),
                reason: format!(
                    "references nest more than {MAX_DEPTH} levels deep (starting at `{}`); give the keys values instead of chaining them",
                    self.stack.first().map_or(from, String::as_str)
                ),
            });
        }
        let raw = yaml::get(self.root, reference).ok_or_else(|| ConfigError::MissingReference {
            key: from.to_string(),
            reference: reference.to_string(),
        })?;
        self.stack.push(reference.to_string());
        let resolved = self.node(raw, reference);
        self.stack.pop();
        let resolved = resolved?;
        self.cache.insert(reference.to_string(), resolved.clone());
        Ok(resolved)
    }
}

/// Splits text into literal parts and `${ref}` parts.
fn split(text: &str) -> Result<Vec<Part<'_>>, String> {
    let mut parts = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        if start > 0 {
            parts.push(Part::Text(&rest[..start]));
        }
        let after = &rest[start + 2..];
        let end = after.find('}').ok_or("unclosed `${`")?;
        let reference = after[..end].trim();
        if reference.is_empty() {
            return Err("empty reference `${}`".into());
        }
        if reference.contains("${") {
            return Err("nested interpolation inside a reference is not supported".into());
        }
        if reference.contains(':') {
            return Err("resolvers such as `${oc.env:VAR}` are not supported".into());
        }
        if reference.starts_with('.') {
            return Err(
                "relative references (`${..key}`) are not supported; use the full path".into(),
            );
        }
        parts.push(Part::Ref(reference));
        rest = &after[end + 1..];
    }
    if !rest.is_empty() {
        parts.push(Part::Text(rest));
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(src: &str) -> Result<Value, ConfigError> {
        resolve(&serde_yaml::from_str(src).unwrap())
    }

    #[test]
    fn full_value_keeps_type() {
        let v = run("a: 8\nb: ${a}\nc: {x: [1, 2]}\nd: ${c}").unwrap();
        assert_eq!(yaml::get(&v, "b"), Some(&Value::from(8)));
        assert_eq!(yaml::get(&v, "d.x.1"), Some(&Value::from(2)));
    }

    #[test]
    fn embedded_and_nested() {
        let v = run(
            "root: /tmp\nout: ${root}/run\nlogger: {log_dir: '${out}/logs', n: 'step_${steps}'}\nsteps: 3",
        )
        .unwrap();
        assert_eq!(
            yaml::get(&v, "logger.log_dir"),
            Some(&Value::from("/tmp/run/logs"))
        );
        assert_eq!(yaml::get(&v, "logger.n"), Some(&Value::from("step_3")));
        let v = run("a: {b: {c: deep}}\nx: ${a.b.c}-${a.b.c}").unwrap();
        assert_eq!(yaml::get(&v, "x"), Some(&Value::from("deep-deep")));
    }

    #[test]
    fn list_elements() {
        let v = run("files: [a, b]\nfirst: ${files.0}\nlist: ['${first}']").unwrap();
        assert_eq!(yaml::get(&v, "list.0"), Some(&Value::from("a")));
    }

    #[test]
    fn missing_reference_names_key() {
        let err = run("m: {log_dir: '${nope}/logs'}").unwrap_err().to_string();
        assert_eq!(
            err,
            "`m.log_dir`: interpolation `${nope}` refers to a key that does not exist"
        );
    }

    #[test]
    fn cycles() {
        let err = run("a: ${b}\nb: ${a}").unwrap_err().to_string();
        assert!(err.contains("interpolation cycle: a -> b -> a"), "{err}");
        let err = run("a: x${a}").unwrap_err().to_string();
        assert!(err.contains("`a`: interpolation cycle: a -> a"), "{err}");
    }

    #[test]
    fn malformed() {
        let err = run("a: ${b").unwrap_err().to_string();
        assert!(err.contains("unclosed"), "{err}");
        let err = run("a: ${oc.env:HOME}").unwrap_err().to_string();
        assert!(err.contains("not supported"), "{err}");
    }
}
