//! Configuration system: YAML configs (built-in or from disk), torchtune-style CLI
//! overrides, `${...}` interpolation, a component registry, typed recipe configs
//! and a validator that reports every problem at once.
//!
//! Flow: [`load::load_config`] -> [`load::ResolvedConfig`] -> [`validate::validate`]
//! -> [`schema::RecipeConfig`] + warnings. Every key is declared once, in [`schema`], with
//! the machinery of [`keys`]: its type, default, range, rule, fingerprint and doc line.

pub mod builtin;
pub mod components;
pub mod error;
pub mod interpolate;
pub mod keys;
pub mod load;
pub mod overrides;
pub mod paths;
pub mod recipes;
pub mod reference;
pub mod schema;
pub mod shipped;
pub mod suggest;
pub mod validate;
mod values;
pub mod yaml;

pub use error::{ConfigError, Problem, ProblemKind, ValidationErrors, Warning};
pub use load::{ResolvedConfig, load_config};
pub use schema::RecipeConfig;
pub use validate::{ValidateOptions, validate, validate_with};
