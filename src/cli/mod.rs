//! The command-line interface: argument parsing and the commands that need no recipe.
//! `tune run` dispatches to the recipes, which live beside the binary.

pub mod args;
pub mod commands;
pub mod exit;
pub mod quantize;

pub use args::{CheckpointsAction, Cli, Command};
pub use exit::CliError;
