//! [`keys!`]: a section's (or a group's, or a recipe's own top-level) keys, declared once.

/// Declares a section's (or a group of top-level keys') keys once: the typed struct, its
/// [`KeyInfo`](super::KeyInfo) table, the reader the walk calls and the fingerprint entries.
///
/// Header options, in this order, each optional:
/// - `section: "name"`: the struct is also a [`ConfigValue`](super::ConfigValue), a mapping
///   other keys can hold;
/// - `group: "name"`: the struct is a key group, its keys read from the mapping of the
///   section that holds it (declared there as `#[serde(flatten)] field: Group = group()`);
/// - `component: Type`: it reads a `_component_` of that type first;
/// - `rule: path`: runs over the struct once it read cleanly;
/// - `open: true`: unknown keys are accepted silently.
macro_rules! keys {
    (
        $(#[doc = $sdoc:literal])*
        $vis:vis struct $name:ident {
            $(section: $section:literal,)?
            $(group: $group:literal,)?
            $(component: $component:ty,)?
            $(rule: $rule:path,)?
            $(open: $open:literal,)?
        }
        $(
            $(#[doc = $doc:literal])*
            $(#[serde($serde:meta)])?
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
                $(#[serde($serde)])?
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
            /// The doc comment of its declaration.
            #[allow(dead_code)]
            const DOC: &'static str = concat!($($sdoc, "\n",)*);

            /// Every key this struct declares, as `tune validate` and tests see them.
            pub const KEYS: &'static [$crate::config::keys::KeyInfo] = &[
                $(
                    $crate::config::keys::KeyInfo {
                        name: stringify!($field),
                        doc: concat!($($doc, "\n",)*),
                        ty: <$ty as $crate::config::keys::ConfigValue>::TY,
                        spec: $crate::config::keys::Key::<$ty>::spec(
                            $key,
                            || $crate::config::keys::Key::<$ty>::default_json($key),
                        ),
                    },
                )*
            ];

            /// Reads every key from `map` (at `prefix`), reporting each problem; `None` when
            /// any key could not be read. Unknown keys are the caller's to report.
            #[allow(unused_variables)]
            pub fn read_keys(
                map: &serde_yaml::Mapping,
                prefix: &str,
                cx: &mut $crate::config::keys::Checker,
            ) -> Option<Self> {
                cx.claim_aliases(Self::KEYS);
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
            #[allow(unused_variables)]
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
                    out.key(&self.$field, prefix, stringify!($field), inherited, $key);
                )*
            }

            /// Records the declared defaults of its keys at `prefix` (see
            /// `ConfigValue::defaults`).
            #[allow(unused_variables)]
            pub fn record_defaults(
                &self,
                prefix: &str,
                out: &mut $crate::config::keys::FingerprintEntries,
            ) {
                $(
                    out.default_of(&self.$field, prefix, stringify!($field), $key);
                )*
            }
        }

        impl $crate::config::keys::KeyGroup for $name {
            const KEYS: &'static [$crate::config::keys::KeyInfo] = $name::KEYS;

            fn read_keys(
                map: &serde_yaml::Mapping,
                prefix: &str,
                cx: &mut $crate::config::keys::Checker,
            ) -> Option<Self> {
                $name::read_keys(map, prefix, cx)
            }


            fn fingerprint_keys(
                &self,
                prefix: &str,
                inherited: $crate::config::keys::Fingerprint,
                out: &mut $crate::config::keys::FingerprintEntries,
            ) {
                $name::fingerprint_keys(self, prefix, inherited, out)
            }
        }

        $(
            impl $name {
                /// The section as `tune validate` sees it.
                pub const SECTION: $crate::config::keys::SectionInfo =
                    $crate::config::keys::SectionInfo {
                        name: $section,
                        doc: Self::DOC,
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

                fn defaults(&self, path: &str, out: &mut $crate::config::keys::FingerprintEntries) {
                    self.record_defaults(path, out);
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

        $(
            impl $name {
                /// The group as `tune validate` sees it.
                pub const SECTION: $crate::config::keys::SectionInfo =
                    $crate::config::keys::SectionInfo {
                        name: $group,
                        doc: Self::DOC,
                        component: None,
                        keys: Self::KEYS,
                        open: false,
                    };
            }

            impl $crate::config::keys::ConfigValue for $name {
                const TY: &'static $crate::config::keys::Ty =
                    &$crate::config::keys::Ty::Group(&Self::SECTION);

                /// A group has no value of its own: the checker reads it with `read_group`.
                fn read(
                    _: &serde_yaml::Value,
                    _: &str,
                    _: &mut $crate::config::keys::Checker,
                ) -> Option<Self> {
                    None
                }

                fn read_group(
                    map: &serde_yaml::Mapping,
                    prefix: &str,
                    cx: &mut $crate::config::keys::Checker,
                ) -> Option<Self> {
                    Self::read_keys(map, prefix, cx)
                }

                fn fingerprint(
                    &self,
                    prefix: &str,
                    mode: $crate::config::keys::Fingerprint,
                    out: &mut $crate::config::keys::FingerprintEntries,
                ) {
                    self.fingerprint_keys(prefix, mode, out);
                }

                fn defaults(&self, prefix: &str, out: &mut $crate::config::keys::FingerprintEntries) {
                    self.record_defaults(prefix, out);
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
