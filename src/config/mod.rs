//! Configuration system: YAML configs (built-in or from disk), torchtune-style CLI
//! overrides, `${...}` interpolation, a component registry, typed recipe configs
//! and a validator that reports every problem at once.
//!
//! Flow: [`load::load_config`] -> [`load::ResolvedConfig`] -> [`validate::validate`]
//! -> [`schema::RecipeConfig`] + warnings.

pub mod builtin;
pub mod checks;
pub mod components;
pub mod error;
pub mod interpolate;
pub mod load;
pub mod overrides;
pub mod paths;
pub mod recipes;
pub mod schema;
pub mod shipped;
pub mod spec;
pub mod suggest;
pub mod validate;
pub mod yaml;

pub use error::{ConfigError, Problem, ProblemKind, ValidationErrors, Warning};
pub use load::{ResolvedConfig, load_config};
pub use schema::RecipeConfig;
pub use validate::{ValidateOptions, validate, validate_with};
