//! [`choice!`]: a section whose `_component_` picks which keys it has. Each choice (a loss, a
//! reward function, a LoRA or full model builder) owns its keys with their defaults, and a
//! setting of another choice is refused by name, saying whose setting it is.

use serde_yaml::Mapping;

use super::{Checker, KeyInfo, join};
use crate::config::components::{Component, ComponentKind};
use crate::config::error::{Problem, ProblemKind};
use crate::config::{suggest, yaml};

/// One choice of a [`ChoiceInfo`]: the components it is (in words) and its keys.
#[derive(Debug)]
pub struct ChoiceVariant {
    /// The components that pick it, as messages and the reference name them.
    pub label: &'static str,
    pub keys: &'static [KeyInfo],
}

/// A section whose `_component_` picks its keys, as the walk, the reference and tests see it.
#[derive(Debug)]
pub struct ChoiceInfo {
    pub name: &'static str,
    pub doc: &'static str,
    pub kind: ComponentKind,
    pub variants: &'static [ChoiceVariant],
    /// Which variant a component picks (`None`: this section does not take it).
    pub variant_of: fn(&Component) -> Option<usize>,
}

/// What a `choice!` type is: its [`ChoiceInfo`].
pub trait Choice {
    const INFO: &'static ChoiceInfo;
}

impl ChoiceInfo {
    /// The components this section takes, in words.
    pub fn takes(&self) -> String {
        self.variants
            .iter()
            .map(|v| v.label)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Reports every key of `map` that variant `index` does not declare: a key of another
    /// variant says whose it is (and `hint` may add what to write instead), any other gets the
    /// closest name.
    pub fn unknown_settings(
        &'static self,
        cx: &mut Checker,
        map: &Mapping,
        path: &str,
        (index, component): (usize, &str),
        hint: fn(&str, &str) -> Option<String>,
    ) {
        let own = super::names_of(self.variants[index].keys);
        for key in map.keys().map(yaml::key_str) {
            let at = join(path, &key);
            if key == "_component_" || own.contains(&key.as_str()) || cx.is_claimed(&at) {
                continue;
            }
            let owners: Vec<&str> = self
                .variants
                .iter()
                .filter(|v| super::names_of(v.keys).contains(&key.as_str()))
                .map(|v| v.label)
                .collect();
            let whose = match (owners.is_empty(), hint(component, &key)) {
                (_, Some(hint)) => Some(hint),
                (false, None) => Some(format!("it is a setting of {}", owners.join(", "))),
                (true, None) => None,
            };
            let Some(whose) = whose else {
                let similar = suggest::similar(&key, own.iter().copied());
                let fix = match suggest::did_you_mean(&similar) {
                    h if h.is_empty() => format!("remove it (`~{at}`)"),
                    h => h,
                };
                cx.problem(
                    Problem::new(
                        ProblemKind::UnknownKey,
                        &at,
                        format!("unknown key `{key}` for `{path}` (`{component}`)"),
                    )
                    .with_fix(fix),
                );
                continue;
            };
            cx.problem(
                Problem::new(
                    ProblemKind::UnknownKey,
                    &at,
                    format!("`{key}` is not a setting of `{component}`: {whose}"),
                )
                .with_fix(format!("remove it (`~{at}`)")),
            );
        }
    }
}

/// Declares a choice: the section type (its `_component_` and the chosen variant's keys) and
/// the enum of variants, each a `keys!` struct. Arms read `"label": pattern => Variant(Keys)`,
/// the pattern over the component type (with an optional `if` guard); a component no arm
/// takes is refused as this section's. `hint: path` names a `fn(component, key) ->
/// Option<String>` that says whose setting a key it does not take is, or what to write
/// instead (default: the variants that declare it); `rule: path` runs
/// over the section once it read cleanly.
macro_rules! choice {
    (
        $(#[doc = $sdoc:literal])*
        $vis:vis struct $name:ident {
            section: $section:literal,
            component: $kind:ty,
            settings: $settings:ident,
            $(hint: $hint:path,)?
            $(rule: $rule:path,)?
        }
        $(
            $(#[doc = $vdoc:literal])*
            $label:literal: $pat:pat $(if $guard:expr)? => $variant:ident($keys:ty)
        ),+ $(,)?
    ) => {
        $(#[doc = $sdoc])*
        #[derive(Debug, Clone, PartialEq, serde::Serialize)]
        $vis struct $name {
            /// The section's `_component_`, resolved.
            #[serde(rename = "_component_")]
            pub component: $kind,
            /// The chosen component's own settings.
            #[serde(flatten)]
            pub settings: $settings,
        }

        /// The settings of each component a
        #[doc = concat!("`", $section, "`")]
        /// section may name.
        #[derive(Debug, Clone, PartialEq, serde::Serialize)]
        #[serde(untagged)]
        $vis enum $settings {
            $(
                $(#[doc = $vdoc])*
                $variant($keys),
            )+
        }

        impl $name {
            /// Which variant `kind` picks, in declaration order.
            #[allow(unused_assignments)]
            fn variant_index(kind: &$kind) -> Option<usize> {
                let mut index = 0usize;
                $(
                    if matches!(kind, $pat $(if $guard)?) {
                        return Some(index);
                    }
                    index += 1;
                )+
                None
            }

            fn variant_of_component(c: &$crate::config::components::Component) -> Option<usize> {
                <$kind as $crate::config::components::ComponentOf>::from_component(c.clone())
                    .and_then(|k| Self::variant_index(&k))
            }

            #[allow(unused_variables)]
            fn hint(component: &str, key: &str) -> Option<String> {
                $( return $hint(component, key); )?
                #[allow(unreachable_code)]
                None
            }
        }

        impl $crate::config::keys::Choice for $name {
            const INFO: &'static $crate::config::keys::ChoiceInfo =
                &$crate::config::keys::ChoiceInfo {
                    name: $section,
                    doc: concat!($($sdoc, "\n",)*),
                    kind: <$kind as $crate::config::components::ComponentOf>::KIND,
                    variants: &[$(
                        $crate::config::keys::choice::ChoiceVariant {
                            label: $label,
                            keys: <$keys>::KEYS,
                        },
                    )+],
                    variant_of: $name::variant_of_component,
                };
        }

        impl $crate::config::keys::ConfigValue for $name {
            const TY: &'static $crate::config::keys::Ty = &$crate::config::keys::Ty::Choice(
                <$name as $crate::config::keys::Choice>::INFO,
            );

            fn read(
                value: &serde_yaml::Value,
                path: &str,
                cx: &mut $crate::config::keys::Checker,
            ) -> Option<Self> {
                use $crate::config::keys::Choice as _;
                let map = value.as_mapping()?;
                let component: $kind = cx.component(map, path)?;
                let name = $crate::config::keys::component_name(
                    <$kind as $crate::config::components::ComponentOf>::into_component(
                        component.clone(),
                    ),
                );
                let Some(index) = Self::variant_index(&component) else {
                    cx.problem(
                        $crate::config::error::Problem::new(
                            $crate::config::error::ProblemKind::WrongComponentKind,
                            $crate::config::keys::join(path, "_component_"),
                            format!(
                                "`{name}` cannot be `{path}` for this recipe: it takes {}",
                                Self::INFO.takes()
                            ),
                        ),
                    );
                    return None;
                };
                Self::INFO.unknown_settings(cx, map, path, (index, &name), Self::hint);
                #[allow(unreachable_patterns)]
                let settings = match &component {
                    $(
                        $pat $(if $guard)? => $settings::$variant(
                            <$keys>::read_keys(map, path, cx)?,
                        ),
                    )+
                    _ => return None,
                };
                let read = Self {
                    component,
                    settings,
                };
                $( $rule(&read, path, cx); )?
                Some(read)
            }

            fn fingerprint(
                &self,
                path: &str,
                mode: $crate::config::keys::Fingerprint,
                out: &mut $crate::config::keys::FingerprintEntries,
            ) {
                if mode != $crate::config::keys::Fingerprint::Inherit {
                    out.insert(
                        &$crate::config::keys::join(path, "_component_"),
                        mode,
                        serde_json::to_value(&self.component).unwrap_or_default(),
                    );
                }
                match &self.settings {
                    $( $settings::$variant(keys) => keys.fingerprint_keys(path, mode, out), )+
                }
            }

            fn defaults(&self, path: &str, out: &mut $crate::config::keys::FingerprintEntries) {
                match &self.settings {
                    $( $settings::$variant(keys) => keys.record_defaults(path, out), )+
                }
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
    };
}
pub(crate) use choice;
