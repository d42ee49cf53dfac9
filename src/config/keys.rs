//! One definition per config key.
//!
//! A key is declared once, in a [`keys!`] block beside the other keys of its section
//! (`config::schema`): its name is the field's, its type the field's Rust type, its doc line
//! the field's doc comment, and a [`Key`] says the rest: required or its default, the range
//! its value must lie in, a rule over the typed value, whether a value is refused or warned
//! about, and whether the key is part of the run's fingerprint. From that one declaration
//! come:
//!
//! - the typed struct setup reads (nothing downstream parses or defaults a key again);
//! - `tune validate`'s walk: the YAML type the key takes ([`ConfigValue::TY`]), "did you
//!   mean" among the section's names, the range, the rule, the warning or refusal;
//! - the resume fingerprint ([`Fingerprint`]), and [`KeyInfo`], the table a test walks.
//!
//! The walk reports every problem it finds, not the first: each key is read on its own, a
//! section's rule runs when the section read cleanly, and a run starts only when no key
//! reported anything.

use std::marker::PhantomData;

use serde_yaml::{Mapping, Value};

use crate::config::components::{self, ComponentKind, ComponentOf, LookupError};
use crate::config::error::{Problem, ProblemKind, Warning};
use crate::config::recipes::Recipe;
use crate::config::{suggest, yaml};

/// A key's YAML type, as the walk checks it and "expected ..." messages name it.
#[derive(Debug)]
pub enum Ty {
    Bool,
    /// Non-negative integer.
    UInt,
    /// Float; integers are accepted.
    Float,
    Str,
    Enum(&'static [&'static str]),
    List(&'static Ty),
    /// Mapping of string keys to values of one type.
    Map(&'static Ty),
    Nullable(&'static Ty),
    Section(&'static SectionInfo),
    /// One section or a list of them (concatenated datasets).
    OneOrMany(&'static SectionInfo),
    Either(&'static Ty, &'static Ty),
    Any,
}

/// What a value of a key asks for that tune does not do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Note {
    None,
    /// Accepted, but a truthy value is not honoured: warn with this text.
    Warn(&'static str),
    /// Accepted only when unset, null, false, zero or empty: anything else would change the
    /// result in a way tune cannot honour, so it is an error with this text.
    Refuse(&'static str),
}

/// Whether a key is part of the run's fingerprint: what a resumed run must share with the
/// checkpoint it resumes, and what a fresh run must share with the checkpoints already in its
/// directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fingerprint {
    /// In it when its section is (a section's keys follow the section); else not.
    Inherit,
    /// In it, with every key inside it.
    Yes,
    /// In it, but a resume may change it (lowering the learning rate is how a diverged run
    /// continues from its last healthy checkpoint).
    ResumeMayChange,
}

/// A range a key's number must lie in, and the range in words for the message.
pub type Range = (fn(f64) -> bool, &'static str);

/// A rule over a key's typed value (or a section's), given the key's dotted path; it reports
/// through the checker.
pub type Rule<T> = fn(&T, &str, &mut Checker);

/// Everything a key's declaration says besides its name, type and doc line. Built with
/// [`required`], [`optional`] or [`default`], then the methods below.
pub struct Key<T> {
    default: Option<fn() -> T>,
    range: Option<Range>,
    rule: Option<Rule<T>>,
    note: Note,
    fingerprint: Fingerprint,
    _value: PhantomData<fn() -> T>,
}

impl<T> Clone for Key<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Key<T> {}

/// A key the config must set.
pub const fn required<T>() -> Key<T> {
    Key {
        default: None,
        range: None,
        rule: None,
        note: Note::None,
        fingerprint: Fingerprint::Inherit,
        _value: PhantomData,
    }
}

/// A key that takes `value()` when the config leaves it out.
pub const fn default<T>(value: fn() -> T) -> Key<T> {
    Key {
        default: Some(value),
        ..required()
    }
}

fn none<T>() -> Option<T> {
    None
}

/// An optional key without a default: `None` when the config leaves it out.
pub const fn optional<T>() -> Key<Option<T>> {
    default(none::<T>)
}

fn no() -> bool {
    false
}

fn yes() -> bool {
    true
}

/// A boolean that is false unless the config says otherwise.
pub const fn off() -> Key<bool> {
    default(no)
}

/// A boolean that is true unless the config says otherwise.
pub const fn on() -> Key<bool> {
    default(yes)
}

impl<T> Key<T> {
    /// The key's number (a set optional one's) must pass `ok`; `allowed` says the range.
    pub const fn range(mut self, ok: fn(f64) -> bool, allowed: &'static str) -> Self {
        self.range = Some((ok, allowed));
        self
    }

    /// A rule over the typed value, run once it has read.
    pub const fn rule(mut self, rule: Rule<T>) -> Self {
        self.rule = Some(rule);
        self
    }

    /// A truthy value is accepted with this warning: tune does not do what it asks, and the
    /// result does not depend on it.
    pub const fn warn(mut self, message: &'static str) -> Self {
        self.note = Note::Warn(message);
        self
    }

    /// Any value but null, false, zero or empty is refused with this message.
    pub const fn refuse(mut self, message: &'static str) -> Self {
        self.note = Note::Refuse(message);
        self
    }

    /// Part of the run's fingerprint, with every key inside it.
    pub const fn fingerprint(mut self) -> Self {
        self.fingerprint = Fingerprint::Yes;
        self
    }

    /// Part of the run's fingerprint, but a resume may change it.
    pub const fn resume_may_change(mut self) -> Self {
        self.fingerprint = Fingerprint::ResumeMayChange;
        self
    }

    pub const fn fingerprint_mode(&self) -> Fingerprint {
        self.fingerprint
    }
}

/// One key as the walk ("did you mean", the sections a type enters) and tests see it,
/// whatever its Rust type.
#[derive(Debug)]
pub struct KeyInfo {
    pub name: &'static str,
    /// The doc comment of its declaration.
    pub doc: &'static str,
    pub ty: &'static Ty,
}

/// A section: a mapping of keys, usually picked by a `_component_`.
#[derive(Debug)]
pub struct SectionInfo {
    pub name: &'static str,
    /// Sections built from a `_component_` of this kind (the key is then required).
    pub component: Option<ComponentKind>,
    pub keys: &'static [KeyInfo],
    /// Unknown keys are accepted silently (profiler options tune never reads).
    pub open: bool,
}

/// A Rust type a key can have: the YAML type it takes and how a value of that type is read.
pub trait ConfigValue: Sized + serde::Serialize {
    const TY: &'static Ty;

    /// Reads `value`, whose outer shape already matched [`Self::TY`]; `None` after reporting
    /// a problem at `path`.
    fn read(value: &Value, path: &str, cx: &mut Checker) -> Option<Self>;

    /// The number a range tests (a set optional key's); `None` for non-numbers.
    fn number(&self) -> Option<f64> {
        None
    }

    /// Adds this value's fingerprint entries at `path`: its JSON when `mode` puts it in (a
    /// section adds one entry per key instead).
    fn fingerprint(&self, path: &str, mode: Fingerprint, out: &mut FingerprintEntries) {
        if mode != Fingerprint::Inherit {
            out.insert(path, mode, serde_json::to_value(self).unwrap_or_default());
        }
    }
}

/// The fingerprint's entries, one per key (dotted path to JSON), and which of them a resume
/// may change.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FingerprintEntries {
    pub entries: serde_json::Map<String, serde_json::Value>,
    pub resume_may_change: Vec<String>,
}

impl FingerprintEntries {
    pub fn insert(&mut self, path: &str, mode: Fingerprint, value: serde_json::Value) {
        if mode == Fingerprint::ResumeMayChange {
            self.resume_may_change.push(path.to_string());
        }
        self.entries.insert(path.to_string(), value);
    }

    /// A key's entries: its own mode, or its section's when it has none.
    pub fn key<T: ConfigValue>(
        &mut self,
        value: &T,
        prefix: &str,
        name: &str,
        inherited: Fingerprint,
        own: Fingerprint,
    ) {
        let mode = match own {
            Fingerprint::Inherit => inherited,
            own => own,
        };
        value.fingerprint(&join(prefix, name), mode, self);
    }
}

pub(crate) fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// A component's settings: the ones its section `set` that the component (`name`) does not
/// `read` are refused by name, since a setting of another component would otherwise be
/// silently ignored. `hint(key)` may add what to write instead.
pub(crate) fn refuse_unread_settings(
    cx: &mut Checker,
    path: &str,
    name: &str,
    (set, reads): (&[&str], &[&str]),
    hint: impl Fn(&str) -> Option<&'static str>,
) {
    for &key in set.iter().filter(|key| !reads.contains(key)) {
        let instead = hint(key).map(|h| format!(" ({h})")).unwrap_or_default();
        let fix = if reads.is_empty() {
            format!("remove it: `{name}` has no settings of its own here")
        } else {
            format!("remove it: `{name}` reads {}", reads.join(", "))
        };
        cx.problem(
            Problem::new(
                ProblemKind::UnknownKey,
                join(path, key),
                format!("`{key}` is not a setting of `{name}`{instead}"),
            )
            .with_fix(fix),
        );
    }
}

/// The walk's state: the problems and warnings so far, and what rules may ask of the run.
#[derive(Debug)]
pub struct Checker {
    pub problems: Vec<Problem>,
    pub warnings: Vec<Warning>,
    /// The recipe the config is validated for (`None`: a section read on its own).
    pub recipe: Option<Recipe>,
    /// Check that checkpoint directories, checkpoint files, tokenizer and data files exist.
    pub check_paths: bool,
    /// `resume_from_checkpoint: True`, read before the walk: the checkpointer's
    /// `recipe_checkpoint` must then exist.
    pub resuming: bool,
}

impl Checker {
    pub fn new(recipe: Option<Recipe>, check_paths: bool, resuming: bool) -> Self {
        Self {
            problems: Vec::new(),
            warnings: Vec::new(),
            recipe,
            check_paths,
            resuming,
        }
    }

    pub fn problem(&mut self, p: Problem) {
        self.problems.push(p);
    }

    pub fn warn(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.warnings.push(Warning::new(key, message));
    }

    /// Reads one value of type `T` at `path`, reporting a wrong shape.
    pub fn value<T: ConfigValue>(&mut self, v: &Value, path: &str) -> Option<T> {
        if !shape_ok(v, T::TY) {
            self.wrong_type(v, &expected(T::TY), path);
            return None;
        }
        T::read(v, path, self)
    }

    /// Reads key `name` of the mapping at `prefix` as `key` declares it.
    pub fn key<T: ConfigValue>(
        &mut self,
        map: &Mapping,
        prefix: &str,
        name: &'static str,
        key: Key<T>,
    ) -> Option<T> {
        let path = join(prefix, name);
        let Some(raw) = map.get(name) else {
            return match key.default {
                Some(value) => Some(value()),
                None => {
                    self.problem(
                        Problem::new(
                            ProblemKind::MissingKey,
                            &path,
                            format!("missing required key `{name}` ({})", expected(T::TY)),
                        )
                        .with_fix(format!("add it to the config or pass `{path}=...`")),
                    );
                    None
                }
            };
        };
        let value = self.value::<T>(raw, &path)?;
        match key.note {
            Note::None => {}
            Note::Warn(message) => {
                if truthy(raw) {
                    self.warn(&path, message);
                }
            }
            Note::Refuse(message) => {
                if asks_for_something(raw) {
                    self.problem(Problem::new(ProblemKind::InvalidValue, &path, message));
                    return None;
                }
            }
        }
        if let (Some((ok, allowed)), Some(number)) = (key.range, value.number())
            && !ok(number)
        {
            self.problem(Problem::new(
                ProblemKind::InvalidValue,
                &path,
                format!("{number} is out of range: it must be {allowed}"),
            ));
            return None;
        }
        if let Some(rule) = key.rule {
            rule(&value, &path, self);
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
        groups: &[&[KeyInfo]],
        component: bool,
    ) {
        let names = || {
            groups
                .iter()
                .flat_map(|g| g.iter().map(|k| k.name))
                .chain(component.then_some("_component_"))
        };
        for k in map.keys() {
            let key = yaml::key_str(k);
            if names().any(|n| n == key) {
                continue;
            }
            let hint = suggest::did_you_mean(&suggest::similar(&key, names()));
            let where_ = if prefix.is_empty() {
                "this recipe".to_string()
            } else {
                format!("`{prefix}`")
            };
            let path = join(prefix, &key);
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

/// Whether the section's `_component_` names a component tune refuses by name
/// ([`LookupError::Unsupported`]; the walk reports it at `_component_`).
pub fn refused_component(map: &Mapping) -> bool {
    map.get("_component_")
        .and_then(Value::as_str)
        .is_some_and(|name| {
            matches!(
                components::lookup(name, None),
                Err(LookupError::Unsupported { .. })
            )
        })
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

/// Whether the value has the right outer shape for `ty` (contents are read separately).
pub fn shape_ok(v: &Value, ty: &Ty) -> bool {
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

/// Declares a section's (or a group of top-level keys') keys once: the typed struct, its
/// [`KeyInfo`] table, the reader the walk calls and the fingerprint entries. With `section:`
/// the struct is also a [`ConfigValue`] (a mapping other keys can hold); with `component:`
/// it reads a `_component_` of that type first; `rule:` runs over the section once it read
/// cleanly; `open: true` accepts unknown keys silently.
macro_rules! keys {
    (
        $(#[doc = $sdoc:literal])*
        $vis:vis struct $name:ident {
            $(section: $section:literal,)?
            $(component: $component:ty,)?
            $(rule: $rule:path,)?
            $(open: $open:literal,)?
        }
        $(
            $(#[doc = $doc:literal])*
            $field:ident: $ty:ty = $key:expr
        ),* $(,)?
    ) => {
        $(#[doc = $sdoc])*
        #[derive(Debug, Clone, PartialEq, serde::Serialize)]
        $vis struct $name {
            $(
                /// The section's `_component_`, resolved.
                #[serde(rename = "_component_")]
                pub component: $component,
            )?
            $(
                $(#[doc = $doc])*
                pub $field: $ty,
            )*
        }

        impl $name {
            /// The kind of its `_component_`, when it has one.
            #[allow(dead_code)]
            const COMPONENT: Option<$crate::config::components::ComponentKind> =
                $crate::config::keys::component_kind!($($component)?);
            /// Whether unknown keys are accepted silently.
            #[allow(dead_code)]
            const OPEN: bool = $crate::config::keys::flag!($($open)?);

            /// Every key this struct declares, as `tune validate` and tests see them.
            pub const KEYS: &'static [$crate::config::keys::KeyInfo] = &[
                $(
                    $crate::config::keys::KeyInfo {
                        name: stringify!($field),
                        doc: concat!($($doc, "\n",)*),
                        ty: <$ty as $crate::config::keys::ConfigValue>::TY,
                    },
                )*
            ];

            /// Reads every key from `map` (at `prefix`), reporting each problem; `None` when
            /// any key could not be read. Unknown keys are the caller's to report.
            pub fn read_keys(
                map: &serde_yaml::Mapping,
                prefix: &str,
                cx: &mut $crate::config::keys::Checker,
            ) -> Option<Self> {
                $( let component: Option<$component> = cx.component(map, prefix); )?
                $( let $field = cx.key::<$ty>(map, prefix, stringify!($field), $key); )*
                let read = Self {
                    $( component: { let c: Option<$component> = component; c? }, )?
                    $( $field: $field?, )*
                };
                $( $rule(&read, prefix, cx); )?
                Some(read)
            }

            /// Adds the fingerprint entries of the keys in it (`inherited`: the section's mode).
            pub fn fingerprint_keys(
                &self,
                prefix: &str,
                inherited: $crate::config::keys::Fingerprint,
                out: &mut $crate::config::keys::FingerprintEntries,
            ) {
                $(
                    let _: Option<&$component> = Some(&self.component);
                    if inherited != $crate::config::keys::Fingerprint::Inherit {
                        out.insert(
                            &$crate::config::keys::join(prefix, "_component_"),
                            inherited,
                            serde_json::to_value(&self.component).unwrap_or_default(),
                        );
                    }
                )?
                $(
                    out.key(
                        &self.$field,
                        prefix,
                        stringify!($field),
                        inherited,
                        $crate::config::keys::Key::<$ty>::fingerprint_mode(&$key),
                    );
                )*
            }
        }

        $(
            impl $name {
                /// The section as `tune validate` sees it.
                pub const SECTION: $crate::config::keys::SectionInfo =
                    $crate::config::keys::SectionInfo {
                        name: $section,
                        component: Self::COMPONENT,
                        keys: Self::KEYS,
                        open: Self::OPEN,
                    };
            }

            impl $crate::config::keys::ConfigValue for $name {
                const TY: &'static $crate::config::keys::Ty =
                    &$crate::config::keys::Ty::Section(&Self::SECTION);

                fn read(
                    value: &serde_yaml::Value,
                    path: &str,
                    cx: &mut $crate::config::keys::Checker,
                ) -> Option<Self> {
                    let map = value.as_mapping()?;
                    // A component tune refuses (Llama 4, a vision model) takes arguments of its
                    // own: reporting each as unknown would bury the one problem that matters.
                    let refused = Self::SECTION.component.is_some()
                        && $crate::config::keys::refused_component(map);
                    if !Self::SECTION.open && !refused {
                        cx.unknown_keys(map, path, &[Self::KEYS], Self::SECTION.component.is_some());
                    }
                    Self::read_keys(map, path, cx)
                }

                fn fingerprint(
                    &self,
                    path: &str,
                    mode: $crate::config::keys::Fingerprint,
                    out: &mut $crate::config::keys::FingerprintEntries,
                ) {
                    self.fingerprint_keys(path, mode, out);
                }
            }

            /// Through the same reader as `tune validate` (no recipe, no file checks).
            impl<'de> serde::Deserialize<'de> for $name {
                fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                    let value = <serde_yaml::Value as serde::Deserialize>::deserialize(d)?;
                    $crate::config::validate::read_section::<Self>($section, &value)
                        .map_err(serde::de::Error::custom)
                }
            }
        )?
    };
}
pub(crate) use keys;

macro_rules! component_kind {
    () => {
        None
    };
    ($component:ty) => {
        Some(<$component as $crate::config::components::ComponentOf>::KIND)
    };
}
pub(crate) use component_kind;

macro_rules! flag {
    () => {
        false
    };
    ($flag:literal) => {
        $flag
    };
}
pub(crate) use flag;
