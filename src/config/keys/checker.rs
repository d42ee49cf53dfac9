//! The walk's state ([`Checker`]): reading one key as its declaration says, a section's
//! `_component_`, and the keys no declaration has.

use std::collections::HashMap;

use serde_yaml::{Mapping, Value};

use super::{ConfigValue, Key, KeyInfo, Note, Ty, asks_for_something, expected, join, truthy};
use crate::config::components::{self, ComponentOf, LookupError};
use crate::config::error::{Problem, ProblemKind, Warning};
use crate::config::recipes::RecipeSpec;
use crate::config::{suggest, yaml};

/// The walk's state: the problems and warnings so far, and what rules may ask of the run.
#[derive(Debug)]
pub struct Checker {
    pub problems: Vec<Problem>,
    pub warnings: Vec<Warning>,
    /// The recipe the config is validated for (`None`: a section read on its own).
    pub recipe: Option<&'static RecipeSpec>,
    /// Check that checkpoint directories, checkpoint files, tokenizer and data files exist.
    pub check_paths: bool,
    /// The config's top level, where keys' aliases are looked up.
    root: Value,
    /// Alias paths a key reads: the sections they sit in do not report them as unknown.
    claimed: Vec<String>,
    /// Keys read from an alias: key path -> the alias path the config wrote.
    written_at: HashMap<String, String>,
}

impl Checker {
    pub fn new(recipe: Option<&'static RecipeSpec>, check_paths: bool) -> Self {
        Self {
            problems: Vec::new(),
            warnings: Vec::new(),
            recipe,
            check_paths,
            root: Value::Null,
            claimed: Vec::new(),
            written_at: HashMap::new(),
        }
    }

    /// The top level aliases are looked up in.
    pub fn with_root(mut self, root: &Mapping) -> Self {
        self.root = Value::Mapping(root.clone());
        self
    }

    pub fn problem(&mut self, p: Problem) {
        self.problems.push(p);
    }

    pub fn warn(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.warnings.push(Warning::new(key, message));
    }

    /// Where the config wrote the key at `path`: an alias's path when it was read from one.
    pub fn written_at(&self, path: &str) -> String {
        self.written_at
            .get(path)
            .cloned()
            .unwrap_or_else(|| path.to_string())
    }

    /// Marks the aliases of `keys` as read by their keys (before any section is read, so that
    /// the sections they sit in do not call them unknown).
    pub fn claim_aliases(&mut self, keys: &[KeyInfo]) {
        for key in keys {
            self.claimed
                .extend(key.spec.aliases.iter().map(|a| a.to_string()));
        }
    }

    /// Whether `path` is an alias some key reads.
    pub fn is_claimed(&self, path: &str) -> bool {
        self.claimed.iter().any(|c| c == path)
    }

    /// Reads one value of type `T` at `path`, reporting a wrong shape.
    pub fn value<T: ConfigValue>(&mut self, v: &Value, path: &str) -> Option<T> {
        if !super::shape_ok(v, T::TY) {
            self.wrong_type(v, &expected(T::TY), path);
            return None;
        }
        T::read(v, path, self)
    }

    /// Reads key `name` of the mapping at `prefix` as `key` declares it (from one of its
    /// aliases when the config wrote it there).
    pub fn key<T: ConfigValue>(
        &mut self,
        map: &Mapping,
        prefix: &str,
        name: &'static str,
        key: Key<T>,
    ) -> Option<T> {
        if matches!(T::TY, Ty::Group(_)) {
            return T::read_group(map, prefix, self);
        }
        let path = join(prefix, name);
        // `key: null` is the key left out, for a key with a default that takes no null: what
        // torchtune's `cfg.get(key, default)` habits write.
        let unset = |raw: &Value| {
            raw.is_null() && key.default.is_some() && !matches!(T::TY, Ty::Nullable(_))
        };
        let own = map
            .get(name)
            .filter(|raw| !unset(raw))
            .map(|raw| (path.clone(), raw.clone()));
        let alias = key.aliases.iter().find_map(|alias| {
            let value = yaml::get(&self.root, alias).filter(|raw| !unset(raw))?;
            Some((alias.to_string(), value.clone()))
        });
        let (at, raw) = match (own, alias) {
            (None, None) => {
                return match key.default {
                    Some(value) => Some(value()),
                    None => {
                        self.missing::<T>(name, &path);
                        None
                    }
                };
            }
            (Some(own), None) => own,
            (None, Some(alias)) => {
                self.written_at.insert(path.clone(), alias.0.clone());
                alias
            }
            (Some(own), Some(alias)) => {
                let ours = self.read_as::<T>(&own.1, &own.0, key)?;
                let theirs = self.read_as::<T>(&alias.1, &alias.0, key)?;
                if serde_json::to_value(&ours).ok() != serde_json::to_value(&theirs).ok() {
                    self.problem(
                        Problem::new(
                            ProblemKind::InvalidValue,
                            &alias.0,
                            format!(
                                "is {}, but `{}` is {}: the two are one key",
                                yaml::short(&alias.1),
                                own.0,
                                yaml::short(&own.1)
                            ),
                        )
                        .with_fix(format!("keep `{}` and remove `{}`", own.0, alias.0)),
                    );
                    return None;
                }
                return Some(ours);
            }
        };
        self.read_as(&raw, &at, key)
    }

    fn missing<T: ConfigValue>(&mut self, name: &str, path: &str) {
        self.problem(
            Problem::new(
                ProblemKind::MissingKey,
                path,
                format!("missing required key `{name}` ({})", expected(T::TY)),
            )
            .with_fix(format!("add it to the config or pass `{path}=...`")),
        );
    }

    /// Reads `raw`, written at `path`, as `key` declares it: its type, note, range and rule.
    fn read_as<T: ConfigValue>(&mut self, raw: &Value, path: &str, key: Key<T>) -> Option<T> {
        let value = self.value::<T>(raw, path)?;
        match key.note {
            Note::None => {}
            Note::Warn(message) => {
                if truthy(raw) {
                    self.warn(path, message);
                }
            }
            Note::Refuse(message) => {
                if asks_for_something(raw) {
                    self.problem(Problem::new(ProblemKind::InvalidValue, path, message));
                    return None;
                }
            }
        }
        if let (Some((ok, allowed)), Some(number)) = (key.range, value.number())
            && !ok(number)
        {
            self.problem(Problem::new(
                ProblemKind::InvalidValue,
                path,
                format!("{number} is out of range: it must be {allowed}"),
            ));
            return None;
        }
        if let Some(rule) = key.rule {
            rule(&value, path, self);
        }
        Some(value)
    }

    /// The section's `_component_`, resolved and of the section's kind.
    pub fn component<C: ComponentOf>(&mut self, map: &Mapping, prefix: &str) -> Option<C> {
        let path = join(prefix, "_component_");
        let Some(v) = map.get("_component_") else {
            let examples = components::known_names(Some(C::KIND));
            let example = examples.first().map(String::as_str).unwrap_or("...");
            self.problem(
                Problem::new(
                    ProblemKind::MissingKey,
                    &path,
                    format!(
                        "missing required key `_component_` (which {} to use)",
                        C::KIND
                    ),
                )
                .with_fix(format!("e.g. `_component_: {example}`")),
            );
            return None;
        };
        let Some(name) = v.as_str() else {
            self.wrong_type(v, "a dotted component name (string)", &path);
            return None;
        };
        let kind = C::KIND;
        match components::lookup(name, Some(kind)) {
            Ok(found) => {
                let found_kind = found.component.kind();
                match C::from_component(found.component) {
                    Some(component) => {
                        if let Some(w) = found.warning {
                            self.warn(&path, w);
                        }
                        Some(component)
                    }
                    None => {
                        let others = suggest::did_you_mean(&suggest::similar(
                            name,
                            components::known_names(Some(kind))
                                .iter()
                                .map(String::as_str),
                        ));
                        self.problem(
                            Problem::new(
                                ProblemKind::WrongComponentKind,
                                &path,
                                format!(
                                    "`{name}` is a {found_kind}, but this section needs a {kind}"
                                ),
                            )
                            .with_fix(others),
                        );
                        None
                    }
                }
            }
            Err(e) => {
                let kind = match e {
                    LookupError::Unknown { .. } => ProblemKind::UnknownComponent,
                    LookupError::Unsupported { .. } => ProblemKind::UnsupportedComponent,
                };
                self.problem(Problem::new(kind, &path, e.to_string()));
                None
            }
        }
    }

    /// Reports every key of `map` that none of `groups` declares, with the closest names.
    pub fn unknown_keys(
        &mut self,
        map: &Mapping,
        prefix: &str,
        groups: &[&'static [KeyInfo]],
        component: bool,
    ) {
        let names: Vec<&str> = groups
            .iter()
            .flat_map(|g| super::names_of(g))
            .chain(component.then_some("_component_"))
            .collect();
        for k in map.keys() {
            let key = yaml::key_str(k);
            let path = join(prefix, &key);
            if names.contains(&key.as_str()) || self.is_claimed(&path) {
                continue;
            }
            let hint = suggest::did_you_mean(&suggest::similar(&key, names.iter().copied()));
            let where_ = if prefix.is_empty() {
                "this recipe".to_string()
            } else {
                format!("`{prefix}`")
            };
            self.problem(
                Problem::new(
                    ProblemKind::UnknownKey,
                    &path,
                    format!("unknown key `{key}` for {where_}"),
                )
                .with_fix(if hint.is_empty() {
                    format!("remove it (`~{path}`)")
                } else {
                    hint
                }),
            );
        }
    }

    pub fn wrong_type(&mut self, v: &Value, expected: &str, path: &str) {
        self.problem(Problem::new(
            ProblemKind::WrongType,
            path,
            format!(
                "expected {expected}, found {} `{}`",
                yaml::type_name(v),
                yaml::short(v)
            ),
        ));
    }
}
