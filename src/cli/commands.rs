//! `tune ls`, `cp`, `cat`, `validate`, `checkpoints`, and config resolution for `run`.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, anyhow};

use super::exit::CliError;
use crate::checkpoint_client::{format_report, list_checkpoints, list_checkpoints_verified};
use crate::config::recipes::RecipeSpec;
use crate::config::{RecipeConfig, ResolvedConfig, Warning, builtin, load_config, validate};
use crate::recipes::{self, RECIPES};

pub fn ls(out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(out, "{:<40} CONFIG", "RECIPE")?;
    // torchtune's listing: each script with its configs, single-device then distributed.
    for &info in RECIPES {
        for distributed in [false, true] {
            if distributed && info.distributed.is_none() {
                continue;
            }
            let configs: Vec<&str> = builtin::list()
                .into_iter()
                .filter(|c| recipes::builtin_recipe(c) == Some((info, distributed)))
                .map(|c| c.name)
                .collect();
            let name = info.script_name(distributed);
            if configs.is_empty() {
                writeln!(out, "{name:<40}")?;
            }
            for (i, c) in configs.iter().enumerate() {
                writeln!(out, "{:<40} {c}", if i == 0 { name } else { "" })?;
            }
        }
    }
    Ok(())
}

fn builtin_or_err(name: &str) -> Result<builtin::BuiltinConfig, CliError> {
    let bare = name.trim_end_matches(".yaml");
    builtin::get(bare).ok_or_else(|| {
        let names: Vec<&str> = builtin::list().into_iter().map(|c| c.name).collect();
        let suggestion = crate::config::suggest::did_you_mean(&crate::config::suggest::similar(
            bare,
            names.iter().copied(),
        ));
        let hint = if suggestion.is_empty() {
            String::new()
        } else {
            format!(" ({suggestion})")
        };
        CliError::bad(anyhow!(
            "no built-in config named `{name}`{hint}; `tune ls` lists them"
        ))
    })
}

pub fn cat(name: &str, out: &mut dyn Write) -> Result<(), CliError> {
    let cfg = builtin_or_err(name)?;
    out.write_all(cfg.yaml.as_bytes()).map_err(CliError::failed)
}

pub fn cp(
    name: &str,
    dest: &Path,
    no_clobber: bool,
    make_parents: bool,
) -> Result<std::path::PathBuf, CliError> {
    if recipes::find(name).is_ok() {
        return Err(CliError::bad(anyhow!(
            "`{name}` is a recipe; recipes are built into tune. Copy one of its configs instead (`tune ls`)"
        )));
    }
    let cfg = builtin_or_err(name)?;
    let file_name = format!("{}.yaml", cfg.name.rsplit('/').next().unwrap_or(cfg.name));
    let target = if dest.is_dir() || dest.to_string_lossy().ends_with('/') {
        dest.join(file_name)
    } else {
        dest.to_path_buf()
    };
    if let Some(parent) = target.parent().filter(|p| !p.as_os_str().is_empty())
        && !parent.exists()
    {
        if !make_parents {
            return Err(CliError::bad(anyhow!(
                "the directory {} does not exist; create it or pass --make-parents",
                parent.display()
            )));
        }
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))
            .map_err(CliError::failed)?;
    }
    if target.exists() && no_clobber {
        eprintln!(
            "not copying: {} exists and --no-clobber was given",
            target.display()
        );
        return Ok(target);
    }
    std::fs::write(&target, cfg.yaml)
        .with_context(|| format!("writing {}", target.display()))
        .map_err(CliError::failed)?;
    Ok(target)
}

/// The recipe a config is for: its built-in entry, else the header comment torchtune's
/// configs start with ("... in lora_finetune_single_device.py", "tune run <recipe> ...").
pub fn infer_recipe(config: &str) -> Option<&'static RecipeSpec> {
    infer_script(config).map(|(recipe, _)| recipe)
}

/// The recipe a config is for and torchtune's script name for it (`lora_finetune_distributed`
/// for a multi-device config).
pub fn infer_script(config: &str) -> Option<(&'static RecipeSpec, &'static str)> {
    if let Some(b) = builtin::get(config.trim_end_matches(".yaml")) {
        return recipes::builtin_recipe(&b).map(|(r, distributed)| (r, r.script_name(distributed)));
    }
    let text = std::fs::read_to_string(config).ok()?;
    for line in text
        .lines()
        .take_while(|l| l.starts_with('#') || l.trim().is_empty())
    {
        for word in line.split_whitespace() {
            let word = word.trim_end_matches(['.', ',', ':']);
            if let Ok(r) = recipes::find(word) {
                return Some((r, r.script_name(recipes::is_distributed_name(word))));
            }
        }
    }
    None
}

/// The recipe a config's header runs (`tune run <recipe> ...`), whether or not tune has it.
fn header_recipe(config: &str) -> Option<String> {
    let text = std::fs::read_to_string(config).ok()?;
    text.lines()
        .take_while(|l| l.starts_with('#') || l.trim().is_empty())
        .find_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let at = words.windows(2).position(|w| w == ["tune", "run"])?;
            // `tune run --nproc_per_node 2 <recipe>`: the first word that is not an option
            // or its value
            words[at + 2..]
                .iter()
                .find(|w| {
                    w.contains('_') && w.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                })
                .map(|w| w.to_string())
        })
}

/// Loads and validates a config for `recipe`, printing warnings to stderr.
pub fn resolve(
    recipe: &str,
    config: &str,
    overrides: &[String],
) -> Result<(RecipeConfig, ResolvedConfig), CliError> {
    let recipe = recipes::find(recipe).map_err(CliError::bad)?;
    let resolved = load_config(config, overrides).map_err(CliError::bad)?;
    let (typed, warnings) = validate(recipe, &resolved).map_err(CliError::bad)?;
    print_warnings(&warnings);
    Ok((typed, resolved))
}

pub fn print_warnings(warnings: &[Warning]) {
    for w in warnings {
        crate::say_warn!("{}: {}", w.key, w.message);
    }
}

pub fn validate_cmd(
    config: &str,
    overrides: &[String],
    recipe: Option<&str>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let (recipe, script) = match recipe {
        Some(r) => {
            let recipe = recipes::find(r).map_err(CliError::bad)?;
            (recipe, recipe.script_name(recipes::is_distributed_name(r)))
        }
        None => infer_script(config).ok_or_else(|| {
            CliError::bad(match header_recipe(config) {
                Some(name) => anyhow!(
                    "{config} is for torchtune's `{name}` recipe, which tune does not have (`tune ls` lists tune's recipes)"
                ),
                None => anyhow!(
                    "cannot tell which recipe {config} is for: pass --recipe <name> (`tune ls` lists recipes)"
                ),
            })
        })?,
    };
    resolve(recipe.name, config, overrides)?;
    writeln!(out, "Config is well-formed for {script}!").map_err(CliError::failed)
}

/// `tune validate --explain KEY`: the key's declaration in each recipe that reads it (only
/// `recipe`'s with `--recipe`).
pub fn explain(key: &str, recipe: Option<&str>, out: &mut dyn Write) -> Result<(), CliError> {
    use crate::config::reference;
    let registry: Vec<&'static RecipeSpec> = match recipe {
        Some(name) => vec![recipes::find(name).map_err(CliError::bad)?],
        None => RECIPES.to_vec(),
    };
    let found = reference::explain(&registry, key.trim());
    if found.is_empty() {
        let paths = reference::all_paths(&registry);
        let hint = crate::config::suggest::did_you_mean(&crate::config::suggest::similar(
            key,
            paths.iter().map(String::as_str),
        ));
        let hint = if hint.is_empty() {
            String::new()
        } else {
            format!(" ({hint})")
        };
        return Err(CliError::bad(anyhow!(
            "no recipe reads a key `{key}`{hint}; keys are dotted as a config writes them (`model.lora_rank`), and docs/config-reference.md lists them all"
        )));
    }
    for (i, explained) in found.iter().enumerate() {
        if i > 0 {
            writeln!(out).map_err(CliError::failed)?;
        }
        write!(out, "{}", reference::describe(explained)).map_err(CliError::failed)?;
    }
    Ok(())
}

pub fn checkpoints(output_dir: &Path, verify: bool, out: &mut dyn Write) -> Result<(), CliError> {
    if !output_dir.is_dir() {
        return Err(CliError::bad(anyhow!(
            "{} is not a directory",
            output_dir.display()
        )));
    }
    let entries = if verify {
        list_checkpoints_verified(output_dir, true)
    } else {
        list_checkpoints(output_dir)
    }
    .map_err(CliError::failed)?;
    write!(out, "{}", format_report(&entries)).map_err(CliError::failed)?;
    // A damaged checkpoint is a failure to report, not a listing detail.
    let corrupt: Vec<&str> = entries
        .iter()
        .filter(|e| {
            matches!(
                e.status,
                crate::checkpoint_client::CheckpointStatus::Corrupt { .. }
            )
        })
        .map(|e| e.name.as_str())
        .collect();
    if corrupt.is_empty() {
        Ok(())
    } else {
        Err(CliError::failed(anyhow!(
            "{} corrupt: {} (its files no longer match the checksums recorded when it was saved; resume skips it)",
            if corrupt.len() == 1 {
                "1 checkpoint is"
            } else {
                "checkpoints are"
            },
            corrupt.join(", ")
        )))
    }
}

/// `tune checkpoints consolidate DIR`: DIR/sharded/'s DCP shard files into DIR, all or nothing
/// (see `checkpoint::dcp::consolidate_dir`).
pub fn consolidate(dir: &Path, out: &mut dyn Write) -> Result<(), CliError> {
    if !dir.is_dir() {
        return Err(CliError::bad(anyhow!(
            "{} is not a directory",
            dir.display()
        )));
    }
    let written = crate::checkpoint::dcp::consolidate_dir(dir).map_err(CliError::failed)?;
    for name in &written {
        writeln!(out, "{}", dir.join(name).display()).map_err(CliError::failed)?;
    }
    Ok(())
}

pub fn download(
    repo_id: String,
    output_dir: Option<std::path::PathBuf>,
    ignore_patterns: Vec<String>,
    revision: Option<String>,
    token: Option<String>,
    repo_type: super::args::RepoTypeArg,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    use crate::hub::{DownloadOptions, HubError, RepoType, download};
    let opts = DownloadOptions {
        repo_type: match repo_type {
            super::args::RepoTypeArg::Model => RepoType::Model,
            super::args::RepoTypeArg::Dataset => RepoType::Dataset,
        },
        output_dir,
        ignore_patterns,
        revision,
        token,
        progress: true,
        ..DownloadOptions::new(repo_id)
    };
    let report = download(opts).map_err(|e| match e {
        HubError::InvalidRepoId { .. } => CliError::bad(e),
        other => CliError::failed(other),
    })?;
    writeln!(out, "{}", report.root.display()).map_err(CliError::failed)?;
    eprintln!(
        "Downloaded {} files of {} ({} fetched, {} from the cache) at commit {}",
        report.files.len(),
        report.repo_id,
        crate::checkpoint_client::human_size(report.downloaded_bytes),
        report.cached_files,
        report.commit
    );
    Ok(())
}

/// `tune push --dry-run`: one line per file that would go (size and repo path).
pub fn push_dry_run(opts: &crate::hub::PushOptions, out: &mut dyn Write) -> Result<(), CliError> {
    use crate::hub::HubError;
    let files = crate::hub::plan_push(opts).map_err(|e| match e {
        HubError::InvalidPushDir { .. } | HubError::InvalidRepoId { .. } => CliError::bad(e),
        other => CliError::failed(other),
    })?;
    for f in &files {
        writeln!(
            out,
            "{:>10}  {}",
            crate::checkpoint_client::human_size(f.size),
            f.path
        )
        .map_err(CliError::failed)?;
    }
    let skipped = if opts.include_training_state {
        String::new()
    } else {
        format!(
            " (training state not included: {}; --include-training-state adds it)",
            crate::hub::TRAINING_STATE.join(", ")
        )
    };
    eprintln!(
        "Would upload {} files to {}{skipped}",
        files.len(),
        opts.repo_id
    );
    Ok(())
}

pub fn push(opts: crate::hub::PushOptions, out: &mut dyn Write) -> Result<(), CliError> {
    use crate::hub::HubError;
    let report = crate::hub::push(opts).map_err(|e| match e {
        HubError::InvalidPushDir { .. } | HubError::InvalidRepoId { .. } => CliError::bad(e),
        other => CliError::failed(other),
    })?;
    writeln!(
        out,
        "{}",
        report
            .pull_request_url
            .as_deref()
            .unwrap_or(&report.repo_url)
    )
    .map_err(CliError::failed)?;
    eprintln!(
        "Uploaded {} files to {}",
        report.files.len(),
        report.repo_id
    );
    Ok(())
}
