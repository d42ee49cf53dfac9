//! `tune quantize`: the int4 export of a model without training it, from a QAT config
//! (`checkpointer` says which model, `quantizer` how; the export goes to
//! `<output_dir>/quantized/`). Typical use: point `checkpointer.checkpoint_dir` at a finished
//! run's float checkpoint.

use std::path::PathBuf;

use anyhow::anyhow;

use super::commands::{infer_recipe, resolve};
use super::exit::CliError;
use crate::config::schema::QatKeys;
use crate::model_io::quantized::{QUANTIZED_DIR, save_quantized};
use crate::recipes;
use crate::setup::{model, quant};

/// Returns the export directory.
pub fn quantize(
    config: &str,
    overrides: &[String],
    recipe: Option<&str>,
) -> Result<PathBuf, CliError> {
    let recipe = match recipe {
        Some(r) => recipes::find(r).map_err(CliError::bad)?,
        None => infer_recipe(config).ok_or_else(|| {
            CliError::bad(anyhow!(
                "cannot tell which recipe {config} is for: pass --recipe qat_single_device"
            ))
        })?,
    };
    let (typed, _) = resolve(recipe.name, config, overrides)?;
    let (Some(cfg), Some(qat)) = (typed.as_train(), typed.own::<QatKeys>()) else {
        return Err(not_qat(config));
    };
    let scheme = quant::scheme(&qat.quantizer);
    type B = burn::backend::Flex;
    let device = Default::default();
    let loaded = model::open(&cfg.checkpointer, "checkpointer")
        .and_then(|c| model::load::<B>(&c, crate::models::BaseWeights::Float, None, &device))
        .map_err(CliError::bad)?;
    let mut m = loaded.model;
    model::refuse_quantized_export(&m.args).map_err(|refused| CliError::bad(anyhow!(refused)))?;
    quant::prepare(&mut m, scheme).map_err(CliError::bad)?;
    let dir = cfg.output_dir.join(QUANTIZED_DIR);
    save_quantized(
        &mut m,
        scheme,
        &dir,
        loaded.storage_dtype,
        Some(&cfg.checkpointer.checkpoint_dir),
    )
    .map_err(CliError::failed)?;
    Ok(dir)
}

fn not_qat(config: &str) -> CliError {
    CliError::bad(anyhow!(
        "{config}: `tune quantize` needs a QAT training config (with `quantizer`)"
    ))
}
