//! One definition per config key.
//!
//! A key is declared once, in a [`keys!`] block beside the other keys of its section
//! (`config::schema`): its name is the field's, its type the field's Rust type, its doc line
//! the field's doc comment, and a [`Key`] says the rest: required or its default, the range
//! its value must lie in, a rule over the typed value, whether a value is refused or warned
//! about, the older spellings it is also read from ([`Key::aliases`]), and whether the key is
//! part of the run's fingerprint. From that one declaration come:
//!
//! - the typed struct setup reads (nothing downstream parses or defaults a key again);
//! - `tune validate`'s walk: the YAML type the key takes ([`ConfigValue::TY`]), "did you
//!   mean" among the section's names, the range, the rule, the warning or refusal;
//! - the resume fingerprint ([`Fingerprint`]);
//! - [`KeyInfo`]: name, doc, type, default, range, aliases; `tune validate --explain KEY`
//!   and the generated config reference (`config::reference`) print it, and tests walk it.
//!
//! Keys compose three ways: a section is a mapping of keys (`model:`); a group
//! (`keys! { group: true }`) is keys read from its parent's mapping, declared once for every
//! section that has them (the sampling keys of GRPO, PPO and generation); and a choice
//! ([`choice!`]) is a section whose `_component_` picks which keys it has (each loss and each
//! reward function owns its settings).
//!
//! The walk reports every problem it finds, not the first: each key is read on its own, a
//! section's rule runs when the section read cleanly, and a run starts only when no key
//! reported anything.

mod checker;
pub mod choice;
mod macros;

use std::marker::PhantomData;

use serde_yaml::{Mapping, Value};

use crate::config::components::{self, Component, ComponentKind, LookupError};

pub use checker::Checker;
pub(crate) use choice::choice;
pub use choice::{Choice, ChoiceInfo, ChoiceVariant};
pub(crate) use macros::{component_kind, flag, keys};

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
    /// Keys read from the parent's own mapping (a key group): the key's name never appears
    /// in a config.
    Group(&'static SectionInfo),
    /// A section whose `_component_` picks its keys ([`choice!`]).
    Choice(&'static ChoiceInfo),
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

/// What reads a key's value: setup (the default), or validation alone, which is then its whole
/// effect (a value tune cannot honour refused, or one that cannot change the result said so).
/// The test that every key is read checks the first kind against the code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Setup or training reads the typed value.
    Read,
    /// Validation is all there is to it, for the reason given.
    ValidationOnly(&'static str),
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
    aliases: &'static [&'static str],
    effect: Effect,
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
        aliases: &[],
        effect: Effect::Read,
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

/// A key group's place in its parent (`keys! { group: true }`): its keys are the parent's.
pub const fn group<T>() -> Key<T> {
    required()
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
        self.effect = Effect::ValidationOnly(message);
        self
    }

    /// Any value but null, false, zero or empty is refused with this message.
    pub const fn refuse(mut self, message: &'static str) -> Self {
        self.note = Note::Refuse(message);
        self.effect = Effect::ValidationOnly(message);
        self
    }

    /// Validation is the key's whole effect, for the reason given (its rule refuses what tune
    /// cannot honour; what it accepts cannot change the result).
    pub const fn validation_only(mut self, why: &'static str) -> Self {
        self.effect = Effect::ValidationOnly(why);
        self
    }

    /// Also read from these dotted paths (from the top of the config): torchtune's older or
    /// other spellings of the same key. Setting two of them to different values is refused.
    pub const fn aliases(mut self, paths: &'static [&'static str]) -> Self {
        self.aliases = paths;
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

    /// What [`KeyInfo`] says of it, `default_json` being its default as JSON.
    pub const fn spec(self, default_json: fn() -> Option<serde_json::Value>) -> KeySpec {
        KeySpec {
            default: if self.default.is_some() {
                Some(default_json)
            } else {
                None
            },
            range: match self.range {
                Some((_, allowed)) => Some(allowed),
                None => None,
            },
            note: self.note,
            fingerprint: self.fingerprint,
            aliases: self.aliases,
            effect: self.effect,
        }
    }
}

impl<T: serde::Serialize> Key<T> {
    /// The default as JSON, as the reference prints it (`None`: required).
    pub fn default_json(self) -> Option<serde_json::Value> {
        self.default
            .map(|value| serde_json::to_value(value()).unwrap_or_default())
    }
}

/// A key's declaration as the reference, `--explain` and tests see it, whatever its type.
#[derive(Debug, Clone, Copy)]
pub struct KeySpec {
    /// Its default as JSON (null: unset means none); `None`: the config must set it.
    pub default: Option<fn() -> Option<serde_json::Value>>,
    /// The range its number must lie in, in words.
    pub range: Option<&'static str>,
    pub note: Note,
    pub fingerprint: Fingerprint,
    /// Other dotted paths it is read from.
    pub aliases: &'static [&'static str],
    pub effect: Effect,
}

impl KeySpec {
    /// The default, when the key has one.
    pub fn default_value(&self) -> Option<serde_json::Value> {
        self.default.and_then(|f| f())
    }

    pub fn is_required(&self) -> bool {
        self.default.is_none()
    }
}

/// One key as the walk ("did you mean", the sections a type enters), the reference and tests
/// see it.
#[derive(Debug)]
pub struct KeyInfo {
    pub name: &'static str,
    /// The doc comment of its declaration.
    pub doc: &'static str,
    pub ty: &'static Ty,
    pub spec: KeySpec,
}

/// A section: a mapping of keys, usually picked by a `_component_`.
#[derive(Debug)]
pub struct SectionInfo {
    pub name: &'static str,
    /// The doc comment of its declaration.
    pub doc: &'static str,
    /// Sections built from a `_component_` of this kind (the key is then required).
    pub component: Option<ComponentKind>,
    pub keys: &'static [KeyInfo],
    /// Unknown keys are accepted silently (profiler options tune never reads).
    pub open: bool,
}

impl SectionInfo {
    /// The names a config may write in the section: its keys, a group's keys in its place.
    pub fn names(&self) -> Vec<&'static str> {
        names_of(self.keys)
    }
}

/// The names `keys` stand for in a mapping: each key's, a group's keys in its place.
pub fn names_of(keys: &'static [KeyInfo]) -> Vec<&'static str> {
    let mut out = Vec::new();
    for key in keys {
        match key.ty {
            Ty::Group(group) => out.extend(names_of(group.keys)),
            _ => out.push(key.name),
        }
    }
    out
}

/// The keys `keys` stand for, a group's keys in its place.
pub fn flatten(keys: &'static [KeyInfo]) -> Vec<&'static KeyInfo> {
    let mut out = Vec::new();
    for key in keys {
        match key.ty {
            Ty::Group(group) => out.extend(flatten(group.keys)),
            _ => out.push(key),
        }
    }
    out
}

/// A Rust type a key can have: the YAML type it takes and how a value of that type is read.
pub trait ConfigValue: Sized + serde::Serialize {
    const TY: &'static Ty;

    /// Reads `value`, whose outer shape already matched [`Self::TY`]; `None` after reporting
    /// a problem at `path`.
    fn read(value: &Value, path: &str, cx: &mut Checker) -> Option<Self>;

    /// A key group's reader: its keys from the parent's mapping `map` at `prefix`.
    fn read_group(_map: &Mapping, _prefix: &str, _cx: &mut Checker) -> Option<Self> {
        None
    }

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

    /// Records the declared defaults of the keys inside this value (a section's, a choice's)
    /// at `path`, for a fingerprint that holds it whole (an item of a list).
    fn defaults(&self, _path: &str, _out: &mut FingerprintEntries) {}
}

/// A struct of keys `keys!` declared: what a recipe's own keys and a choice's variants are.
pub trait KeyGroup: Sized + Clone + PartialEq + std::fmt::Debug + 'static {
    /// Every key it declares.
    const KEYS: &'static [KeyInfo];

    /// Reads every key from `map` (at `prefix`); unknown keys are the caller's to report.
    fn read_keys(map: &Mapping, prefix: &str, cx: &mut Checker) -> Option<Self>;

    /// Adds the fingerprint entries of its keys (`inherited`: the section's mode).
    fn fingerprint_keys(&self, prefix: &str, inherited: Fingerprint, out: &mut FingerprintEntries);
}

/// The fingerprint's entries, one per key (dotted path to JSON), which of them a resume may
/// change, and the declared defaults of the keys that have one (a checkpoint written before a
/// key existed, or while it was optional, holds none: its default is then what it had).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FingerprintEntries {
    pub entries: serde_json::Map<String, serde_json::Value>,
    pub resume_may_change: Vec<String>,
    pub defaults: serde_json::Map<String, serde_json::Value>,
}

impl FingerprintEntries {
    pub fn insert(&mut self, path: &str, mode: Fingerprint, value: serde_json::Value) {
        if mode == Fingerprint::ResumeMayChange {
            self.resume_may_change.push(path.to_string());
        }
        self.entries.insert(path.to_string(), value);
    }

    /// A key's entries: its own mode, or its section's when it has none. A group's keys are
    /// its parent's: they go in at `prefix`.
    pub fn key<T: ConfigValue>(
        &mut self,
        value: &T,
        prefix: &str,
        name: &str,
        inherited: Fingerprint,
        key: Key<T>,
    ) {
        let mode = match key.fingerprint {
            Fingerprint::Inherit => inherited,
            own => own,
        };
        if matches!(T::TY, Ty::Group(_)) {
            value.fingerprint(prefix, mode, self);
            return;
        }
        let path = join(prefix, name);
        if mode != Fingerprint::Inherit
            && let Some(default) = key.default_json().filter(|d| !d.is_null())
        {
            self.defaults.insert(path.clone(), default);
        }
        value.fingerprint(&path, mode, self);
    }

    /// A key's declared default at `prefix.name`, and those of the keys inside its value.
    pub fn default_of<T: ConfigValue>(&mut self, value: &T, prefix: &str, name: &str, key: Key<T>) {
        if matches!(T::TY, Ty::Group(_)) {
            value.defaults(prefix, self);
            return;
        }
        let path = join(prefix, name);
        if let Some(default) = key.default_json().filter(|d| !d.is_null()) {
            self.defaults.insert(path.clone(), default);
        }
        value.defaults(&path, self);
    }
}

pub(crate) fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
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

/// The canonical name of a resolved component, for messages.
pub fn component_name(component: Component) -> String {
    component.canonical_name()
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
        Ty::Map(_) | Ty::Section(_) | Ty::Group(_) | Ty::Choice(_) => v.is_mapping(),
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
        Ty::Section(s) | Ty::Group(s) => format!("a mapping (the `{}` section)", s.name),
        Ty::Choice(c) => format!("a mapping (the `{}` section)", c.name),
        Ty::OneOrMany(s) => format!("a mapping or a list of mappings (`{}` entries)", s.name),
        Ty::Either(a, b) => format!("{} or {}", expected(a), expected(b)),
        Ty::Any => "any value".into(),
    }
}
