//! A config's model keys held against the checkpoint's config.json: a generic builder's
//! architecture arguments, a classifier builder's head, and the checkpointer's `model_type`.

use super::SetupError;
use super::model_error::ModelConfigError;
use crate::config::schema::{CheckpointModelType, ModelConfig};
use crate::models::ModelArgs;

/// A generic builder's architecture arguments must describe the checkpoint: tune builds the
/// model from config.json, so a disagreement means the config is for another model.
pub fn check_architecture(
    section: &str,
    arch: &ModelConfig,
    args: &crate::models::ModelArgs,
) -> Result<(), SetupError> {
    let mismatch = |key, ours: String, theirs: String, hf| {
        SetupError::from(ModelConfigError::Architecture {
            section: section.to_string(),
            key,
            ours,
            theirs,
            hf,
        })
    };
    let keys = arch.arch();
    let whole = [
        ("vocab_size", keys.vocab_size, args.vocab_size, "vocab_size"),
        (
            "num_layers",
            keys.num_layers,
            args.num_layers,
            "num_hidden_layers",
        ),
        (
            "num_heads",
            keys.num_heads,
            args.num_heads,
            "num_attention_heads",
        ),
        (
            "num_kv_heads",
            keys.num_kv_heads,
            args.num_kv_heads,
            "num_key_value_heads",
        ),
        ("embed_dim", keys.embed_dim, args.hidden_size, "hidden_size"),
        (
            "intermediate_dim",
            keys.intermediate_dim,
            args.intermediate_size,
            "intermediate_size",
        ),
        ("head_dim", keys.head_dim, args.head_dim, "head_dim"),
        (
            "max_seq_len",
            keys.max_seq_len,
            args.max_position_embeddings,
            "max_position_embeddings",
        ),
    ];
    for (key, ours, theirs, hf) in whole {
        if let Some(v) = ours
            && v != theirs
        {
            return Err(mismatch(key, v.to_string(), theirs.to_string(), hf));
        }
    }
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs());
    for (key, ours, theirs, hf) in [
        ("norm_eps", keys.norm_eps, args.rms_norm_eps, "rms_norm_eps"),
        ("rope_base", keys.rope_base, args.rope_theta, "rope_theta"),
    ] {
        if let Some(v) = ours
            && !close(v, theirs)
        {
            return Err(mismatch(key, v.to_string(), theirs.to_string(), hf));
        }
    }
    let architecture = args
        .raw
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(serde_json::Value::as_str)
        .unwrap_or("no `architectures` in config.json")
        .to_string();
    let head = |wants, holds, fix| {
        SetupError::from(ModelConfigError::Head {
            section: section.to_string(),
            builder: arch.component.canonical_name(),
            wants,
            holds,
            architecture: architecture.clone(),
            fix,
        })
    };
    match (arch.is_classifier(), args.num_labels) {
        (true, Some(theirs)) if arch.classes().is_some_and(|ours| ours != theirs) => {
            return Err(mismatch(
                "num_classes",
                arch.classes().map_or_else(String::new, |n| n.to_string()),
                theirs.to_string(),
                "num_labels (the size of id2label)",
            ));
        }
        (true, None) => {
            return Err(head(
                "scores sequences (a reward or value model)",
                "language model",
                "point its checkpointer at a `*ForSequenceClassification` checkpoint with a `score` head (a reward model), as torchtune's `model_type: REWARD` checkpoints are",
            ));
        }
        (false, Some(_)) => {
            return Err(head(
                "is a language model",
                "sequence classifier",
                "point the checkpointer at a `*ForCausalLM` checkpoint",
            ));
        }
        _ => {}
    }
    if let Some(tied) = keys.tie_word_embeddings
        && tied != args.tie_word_embeddings
    {
        return Err(mismatch(
            "tie_word_embeddings",
            tied.to_string(),
            args.tie_word_embeddings.to_string(),
            "tie_word_embeddings",
        ));
    }
    Ok(())
}

/// The checkpointer's `model_type` (torchtune's name for the architecture, with which its
/// checkpointer converts the weights) must name the checkpoint's family: another means the
/// checkpointer points at another model than the config was written for.
pub fn check_model_type(
    key: &'static str,
    named: Option<CheckpointModelType>,
    args: &ModelArgs,
) -> Result<(), SetupError> {
    let Some(named) = named else {
        return Ok(());
    };
    let found = args.family.model_type();
    let name = serde_json::to_value(named)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default();
    let fits = match named.families() {
        // A reward model of any family: a sequence classifier.
        None => args.num_labels.is_some(),
        Some(families) => families.contains(&found),
    };
    if fits {
        return Ok(());
    }
    Err(ModelConfigError::ModelType {
        key,
        named: name,
        found: if named.families().is_none() {
            format!("{found} language model (no `score` head)")
        } else {
            found.to_string()
        },
    }
    .into())
}
