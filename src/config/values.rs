//! How each Rust type a key can have reads from YAML ([`ConfigValue`] for the scalars and
//! containers; sections get theirs from `keys!`, enums from [`choices!`]).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_yaml::Value;

use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{Checker, ConfigValue, Fingerprint, FingerprintEntries, Ty, join};
use crate::config::yaml;

impl ConfigValue for bool {
    const TY: &'static Ty = &Ty::Bool;
    fn read(value: &Value, _: &str, _: &mut Checker) -> Option<Self> {
        value.as_bool()
    }
}

/// Non-negative integers that fit the Rust type.
macro_rules! unsigned {
    ($($t:ty),*) => {$(
        impl ConfigValue for $t {
            const TY: &'static Ty = &Ty::UInt;
            fn read(value: &Value, path: &str, cx: &mut Checker) -> Option<Self> {
                let n = value.as_u64()?;
                match <$t>::try_from(n) {
                    Ok(v) => Some(v),
                    Err(_) => {
                        cx.problem(Problem::new(
                            ProblemKind::InvalidValue,
                            path,
                            format!("{n} is out of range: it must be at most {}", <$t>::MAX),
                        ));
                        None
                    }
                }
            }
            fn number(&self) -> Option<f64> {
                Some(*self as f64)
            }
        }
    )*};
}
unsigned!(u32, u64, usize);

impl ConfigValue for f64 {
    const TY: &'static Ty = &Ty::Float;
    fn read(value: &Value, _: &str, _: &mut Checker) -> Option<Self> {
        value.as_f64()
    }
    fn number(&self) -> Option<f64> {
        Some(*self)
    }
}

impl ConfigValue for String {
    const TY: &'static Ty = &Ty::Str;
    fn read(value: &Value, _: &str, _: &mut Checker) -> Option<Self> {
        value.as_str().map(String::from)
    }
}

impl ConfigValue for PathBuf {
    const TY: &'static Ty = &Ty::Str;
    fn read(value: &Value, _: &str, _: &mut Checker) -> Option<Self> {
        value.as_str().map(PathBuf::from)
    }
}

/// Any YAML value, kept as written (torchtune's `tensor_parallel_plan`).
impl ConfigValue for Value {
    const TY: &'static Ty = &Ty::Any;
    fn read(value: &Value, _: &str, _: &mut Checker) -> Option<Self> {
        Some(value.clone())
    }
}

impl<T: ConfigValue> ConfigValue for Option<T> {
    const TY: &'static Ty = &Ty::Nullable(T::TY);
    fn read(value: &Value, path: &str, cx: &mut Checker) -> Option<Self> {
        if value.is_null() {
            return Some(None);
        }
        cx.value::<T>(value, path).map(Some)
    }
    fn number(&self) -> Option<f64> {
        self.as_ref().and_then(T::number)
    }
    fn fingerprint(&self, path: &str, mode: Fingerprint, out: &mut FingerprintEntries) {
        match self {
            Some(v) => v.fingerprint(path, mode, out),
            None if mode != Fingerprint::Inherit => {
                out.insert(path, mode, serde_json::Value::Null);
            }
            None => {}
        }
    }
    fn defaults(&self, path: &str, out: &mut FingerprintEntries) {
        if let Some(v) = self {
            v.defaults(path, out);
        }
    }
}

impl<T: ConfigValue> ConfigValue for Vec<T> {
    const TY: &'static Ty = &Ty::List(T::TY);
    fn read(value: &Value, path: &str, cx: &mut Checker) -> Option<Self> {
        let items = value.as_sequence()?;
        // Every item is read, so each bad one is reported.
        let read: Vec<Option<T>> = items
            .iter()
            .enumerate()
            .map(|(i, item)| cx.value::<T>(item, &join(path, &i.to_string())))
            .collect();
        read.into_iter().collect()
    }
    /// The whole list, and its items' declared defaults under `path.*` (a fingerprint compares
    /// lists of sections item by item).
    fn fingerprint(&self, path: &str, mode: Fingerprint, out: &mut FingerprintEntries) {
        if mode != Fingerprint::Inherit {
            out.insert(path, mode, serde_json::to_value(self).unwrap_or_default());
            self.defaults(path, out);
        }
    }
    fn defaults(&self, path: &str, out: &mut FingerprintEntries) {
        for item in self {
            item.defaults(&join(path, "*"), out);
        }
    }
}

impl<T: ConfigValue> ConfigValue for BTreeMap<String, T> {
    const TY: &'static Ty = &Ty::Map(T::TY);
    fn read(value: &Value, path: &str, cx: &mut Checker) -> Option<Self> {
        let map = value.as_mapping()?;
        let read: Vec<Option<(String, T)>> = map
            .iter()
            .map(|(k, v)| {
                let key = yaml::key_str(k);
                let v = cx.value::<T>(v, &join(path, &key))?;
                Some((key, v))
            })
            .collect();
        read.into_iter().collect()
    }
}

/// A pair of numbers, written as a two-item list (`betas: [0.9, 0.999]`).
impl ConfigValue for (f64, f64) {
    const TY: &'static Ty = &Ty::List(&Ty::Float);
    fn read(value: &Value, path: &str, cx: &mut Checker) -> Option<Self> {
        let numbers = Vec::<f64>::read(value, path, cx)?;
        match numbers[..] {
            [a, b] => Some((a, b)),
            _ => {
                cx.problem(
                    Problem::new(
                        ProblemKind::InvalidValue,
                        path,
                        format!("expected 2 numbers, found {}", numbers.len()),
                    )
                    .with_fix("e.g. `betas: [0.9, 0.999]`"),
                );
                None
            }
        }
    }
}

/// A string-valued enum: the strings a config may write for each variant (aliases too), in
/// the order "expected one of ..." lists them.
macro_rules! choices {
    ($t:ty { $($text:literal => $variant:expr),* $(,)? }) => {
        impl $t {
            /// The strings a config may write, in the order messages list them.
            pub const CHOICES: &'static [&'static str] = &[$($text),*];
        }

        impl $crate::config::keys::ConfigValue for $t {
            const TY: &'static $crate::config::keys::Ty =
                &$crate::config::keys::Ty::Enum(<$t>::CHOICES);
            fn read(
                value: &serde_yaml::Value,
                path: &str,
                cx: &mut $crate::config::keys::Checker,
            ) -> Option<Self> {
                let text = value.as_str()?;
                match text {
                    $($text => Some($variant),)*
                    _ => {
                        let hint = $crate::config::suggest::did_you_mean(
                            &$crate::config::suggest::similar(text, <$t>::CHOICES.iter().copied()),
                        );
                        cx.problem(
                            $crate::config::error::Problem::new(
                                $crate::config::error::ProblemKind::InvalidValue,
                                path,
                                format!(
                                    "expected one of {}, found `{text}`",
                                    <$t>::CHOICES.join(", ")
                                ),
                            )
                            .with_fix(hint),
                        );
                        None
                    }
                }
            }
        }
    };
}
pub(crate) use choices;
