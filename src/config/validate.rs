//! Validation: walk the resolved tree against `spec` collecting every problem and
//! warning, run recipe-level and filesystem checks, then build the typed config.

use serde_yaml::{Mapping, Value};

use crate::config::components::{self, ComponentKind, LookupError};
use crate::config::error::{Problem, ProblemKind, ValidationErrors, Warning};
use crate::config::load::ResolvedConfig;
use crate::config::recipes::{self, Recipe};
use crate::config::schema::{GenerateConfig, RecipeConfig, TrainConfig};
use crate::config::spec::{self, Field, Note, Section, Ty};
use crate::config::{checks, suggest, yaml};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValidateOptions {
    /// Check that checkpoint dirs, checkpoint files, tokenizer and data files exist.
    pub check_paths: bool,
}

impl Default for ValidateOptions {
    fn default() -> Self {
        Self { check_paths: true }
    }
}

/// Validates `cfg` for `recipe` (canonical name or torchtune alias) with every check on.
pub fn validate(
    recipe: &str,
    cfg: &ResolvedConfig,
) -> Result<(RecipeConfig, Vec<Warning>), ValidationErrors> {
    validate_with(recipe, cfg, &ValidateOptions::default())
}

pub fn validate_with(
    recipe: &str,
    cfg: &ResolvedConfig,
    opts: &ValidateOptions,
) -> Result<(RecipeConfig, Vec<Warning>), ValidationErrors> {
    let fail = |problems| ValidationErrors {
        source_name: cfg.source.clone(),
        problems,
    };
    let recipe = recipes::find(recipe).map_err(|e| {
        fail(vec![Problem::new(
            ProblemKind::UnknownRecipe,
            "recipe",
            e.to_string(),
        )])
    })?;
    let Some(root) = cfg.value.as_mapping() else {
        return Err(fail(vec![Problem::new(
            ProblemKind::WrongType,
            "<root>",
            "the config must be a mapping of keys to values",
        )]));
    };

    let mut cx = Checker::default();
    let top = spec::top_level(recipe);
    cx.fields(root, &top, "", None, false);
    checks::recipe_rules(recipe, &cfg.value, &mut cx);
    if opts.check_paths {
        checks::paths(recipe, &cfg.value, &mut cx);
    }
    if !cx.problems.is_empty() {
        return Err(fail(cx.problems));
    }
    build(recipe, &cfg.value)
        .map(|c| (c, cx.warnings))
        .map_err(|e| {
            fail(vec![Problem::new(
                ProblemKind::InvalidValue,
                "<root>",
                e.to_string(),
            )])
        })
}

fn build(recipe: Recipe, value: &Value) -> Result<RecipeConfig, serde_yaml::Error> {
    Ok(match recipe {
        Recipe::Generate => RecipeConfig::Generate(Box::new(serde_yaml::from_value::<
            GenerateConfig,
        >(value.clone())?)),
        r => RecipeConfig::Train(
            r,
            Box::new(serde_yaml::from_value::<TrainConfig>(value.clone())?),
        ),
    })
}

/// Accumulates problems and warnings during a walk.
#[derive(Debug, Default)]
pub struct Checker {
    pub problems: Vec<Problem>,
    pub warnings: Vec<Warning>,
}

pub(crate) fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

impl Checker {
    pub fn problem(&mut self, p: Problem) {
        self.problems.push(p);
    }

    pub fn warn(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.warnings.push(Warning::new(key, message));
    }

    fn fields(
        &mut self,
        map: &Mapping,
        fields: &[&Field],
        prefix: &str,
        component: Option<ComponentKind>,
        open: bool,
    ) {
        for (k, v) in map {
            let key = yaml::key_str(k);
            let path = join(prefix, &key);
            if key == "_component_" && component.is_some() {
                if let Some(kind) = component {
                    self.component(v, kind, &path);
                }
                continue;
            }
            match fields.iter().find(|f| f.key == key) {
                Some(field) => {
                    self.value(v, &field.ty, &path);
                    self.note(v, field.note, &path);
                }
                None if open => {}
                None => {
                    let mut names: Vec<&str> = fields.iter().map(|f| f.key).collect();
                    if component.is_some() {
                        names.push("_component_");
                    }
                    let hint =
                        suggest::did_you_mean(&suggest::similar(&key, names.iter().copied()));
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
        }
        if let Some(kind) = component
            && !map.contains_key("_component_")
        {
            let examples = components::known_names(Some(kind));
            let example = examples.first().map(String::as_str).unwrap_or("...");
            self.problem(
                Problem::new(
                    ProblemKind::MissingKey,
                    join(prefix, "_component_"),
                    format!("missing required key `_component_` (which {kind} to use)"),
                )
                .with_fix(format!("e.g. `_component_: {example}`")),
            );
        }
        for field in fields.iter().filter(|f| f.required) {
            if !map.contains_key(field.key) {
                self.problem(
                    Problem::new(
                        ProblemKind::MissingKey,
                        join(prefix, field.key),
                        format!(
                            "missing required key `{}` ({})",
                            field.key,
                            expected(&field.ty)
                        ),
                    )
                    .with_fix(format!(
                        "add it to the config or pass `{}=...`",
                        join(prefix, field.key)
                    )),
                );
            }
        }
    }

    fn section(&mut self, map: &Mapping, section: &Section, path: &str) {
        let fields: Vec<&Field> = section.fields.iter().collect();
        self.fields(map, &fields, path, section.component, section.open);
    }

    fn component(&mut self, v: &Value, kind: ComponentKind, path: &str) {
        let Some(name) = v.as_str() else {
            self.wrong_type(v, "a dotted component name (string)", path);
            return;
        };
        match components::lookup(name, Some(kind)) {
            Ok(found) if found.component.kind() != kind => {
                let others = suggest::did_you_mean(&suggest::similar(
                    name,
                    components::known_names(Some(kind))
                        .iter()
                        .map(String::as_str),
                ));
                self.problem(
                    Problem::new(
                        ProblemKind::WrongComponentKind,
                        path,
                        format!(
                            "`{name}` is a {}, but this section needs a {kind}",
                            found.component.kind()
                        ),
                    )
                    .with_fix(others),
                );
            }
            Ok(found) => {
                if let Some(w) = found.warning {
                    self.warn(path, w);
                }
            }
            Err(e @ LookupError::Unknown { .. }) => {
                self.problem(Problem::new(
                    ProblemKind::UnknownComponent,
                    path,
                    e.to_string(),
                ));
            }
            Err(e @ LookupError::Unsupported { .. }) => {
                self.problem(Problem::new(
                    ProblemKind::UnsupportedComponent,
                    path,
                    e.to_string(),
                ));
            }
        }
    }

    fn wrong_type(&mut self, v: &Value, expected: &str, path: &str) {
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

    fn value(&mut self, v: &Value, ty: &Ty, path: &str) {
        if !shape_ok(v, ty) {
            self.wrong_type(v, &expected(ty), path);
            return;
        }
        match ty {
            Ty::Enum(options) => {
                let s = v.as_str().unwrap_or_default();
                if !options.contains(&s) {
                    let hint = suggest::did_you_mean(&suggest::similar(s, options.iter().copied()));
                    self.problem(
                        Problem::new(
                            ProblemKind::InvalidValue,
                            path,
                            format!("expected one of {}, found `{s}`", options.join(", ")),
                        )
                        .with_fix(hint),
                    );
                }
            }
            Ty::List(inner) => {
                for (i, item) in v.as_sequence().into_iter().flatten().enumerate() {
                    self.value(item, inner, &join(path, &i.to_string()));
                }
            }
            Ty::Map(inner) => {
                for (k, item) in v.as_mapping().into_iter().flatten() {
                    self.value(item, inner, &join(path, &yaml::key_str(k)));
                }
            }
            Ty::Nullable(inner) if !v.is_null() => self.value(v, inner, path),
            Ty::Section(s) => {
                if let Some(m) = v.as_mapping() {
                    self.section(m, s, path);
                }
            }
            Ty::OneOrMany(s) => match v {
                Value::Mapping(m) => self.section(m, s, path),
                Value::Sequence(items) => {
                    for (i, item) in items.iter().enumerate() {
                        let p = join(path, &i.to_string());
                        match item.as_mapping() {
                            Some(m) => self.section(m, s, &p),
                            None => self.wrong_type(
                                item,
                                &format!("a mapping (a `{}` entry)", s.name),
                                &p,
                            ),
                        }
                    }
                }
                _ => {}
            },
            Ty::Either(a, b) => {
                let chosen = if shape_ok(v, a) { a } else { b };
                self.value(v, chosen, path);
            }
            _ => {}
        }
    }

    fn note(&mut self, v: &Value, note: Note, path: &str) {
        match note {
            Note::None => {}
            Note::Warn(msg) if truthy(v) => self.warn(path, msg),
            Note::Refuse(msg) if asks_for_something(v) => {
                self.problem(Problem::new(ProblemKind::InvalidValue, path, msg));
            }
            _ => {}
        }
    }
}

/// Whether a refused key's value asks for the behaviour tune lacks: anything but null, false,
/// zero and empty.
fn asks_for_something(v: &Value) -> bool {
    match v {
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::Mapping(m) => !m.is_empty(),
        other => truthy(other),
    }
}

fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Sequence(s) => !s.is_empty(),
        Value::Mapping(m) => m
            .get("enabled")
            .map_or(!m.is_empty(), |e| e.as_bool() != Some(false)),
        Value::String(s) => !s.is_empty(),
        _ => true,
    }
}

/// Whether the value has the right outer shape for `ty` (contents checked separately).
fn shape_ok(v: &Value, ty: &Ty) -> bool {
    match ty {
        Ty::Bool => v.is_bool(),
        Ty::UInt => v.is_u64(),
        Ty::Float => v.is_number(),
        Ty::Str | Ty::Enum(_) => v.is_string(),
        Ty::List(_) => v.is_sequence(),
        Ty::Map(_) | Ty::Section(_) => v.is_mapping(),
        Ty::OneOrMany(_) => v.is_mapping() || v.is_sequence(),
        Ty::Nullable(inner) => v.is_null() || shape_ok(v, inner),
        Ty::Either(a, b) => shape_ok(v, a) || shape_ok(v, b),
        Ty::Any => true,
    }
}

/// Human description of a type for "expected ..." messages.
pub fn expected(ty: &Ty) -> String {
    match ty {
        Ty::Bool => "a boolean (True/False)".into(),
        Ty::UInt => "a non-negative integer".into(),
        Ty::Float => "a number".into(),
        Ty::Str => "a string".into(),
        Ty::Enum(o) => format!("one of {}", o.join(", ")),
        Ty::List(inner) => format!("a list (each {})", expected(inner)),
        Ty::Map(inner) => format!("a mapping (values: {})", expected(inner)),
        Ty::Nullable(inner) => format!("{} or null", expected(inner)),
        Ty::Section(s) => format!("a mapping (the `{}` section)", s.name),
        Ty::OneOrMany(s) => format!("a mapping or a list of mappings (`{}` entries)", s.name),
        Ty::Either(a, b) => format!("{} or {}", expected(a), expected(b)),
        Ty::Any => "any value".into(),
    }
}
