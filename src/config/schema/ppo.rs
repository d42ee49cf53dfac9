//! The PPO recipe's own keys (torchtune's `ppo_full_finetune_single_device` and its configs):
//! the reward and value model, the reference, value and reward checkpointers, the rollouts,
//! the reward shaping and the PPO passes. Names, and which keys are required, are torchtune's.
//!
//! The policy is `policy_model` where every other recipe has `model`, and PPO runs `num_steps`
//! samples instead of `epochs`: [`train_view`] reads the keys every recipe shares from a view
//! of the config with `policy_model` as `model` (problems are reported under
//! `policy_model`), and [`ppo_rules`] refuses the shared keys PPO has no use for.

use serde_yaml::{Mapping, Value};

use super::{CheckpointerConfig, ModelConfig, PpoLoss, Rollout, TrainConfig};
use crate::config::error::{Problem, ProblemKind};
use crate::config::keys::{Checker, KeyInfo, group, keys, on, optional, required};

keys! {
    /// PPO's own keys.
    pub struct PpoKeys {}
    /// The clipped policy and value losses.
    loss: PpoLoss = required().fingerprint(),
    /// The reward model's architecture, which the value model shares: a classifier builder
    /// (`torchtune.models.llama2.llama2_classifier` with `num_classes: 1`, or a
    /// `*_reward_7b`).
    reward_and_value_model: ModelConfig = required().fingerprint(),
    /// The frozen reference of the KL penalty: the policy's starting checkpoint.
    ref_policy_checkpointer: CheckpointerConfig = required(),
    /// The value model's starting checkpoint (usually the reward model) and where its
    /// checkpoints go (`output_dir`, default `<output_dir>/value`).
    value_checkpointer: CheckpointerConfig = required(),
    /// The frozen reward model (a `*ForSequenceClassification` checkpoint, one label).
    reward_checkpointer: CheckpointerConfig = required(),
    /// Samples to train on over the run: `num_steps // batch_size` steps of `batch_size`
    /// prompts each (torchtune's count).
    num_steps: usize = required().range(|v| v >= 1.0, "at least 1").fingerprint(),
    /// Optimisation passes over each batch of trajectories.
    ppo_epochs: usize = required().range(|v| v >= 1.0, "at least 1").fingerprint(),
    /// Trajectories per optimizer step within a pass (`batch_size` must be a multiple).
    ppo_batch_size: usize = required().range(|v| v >= 1.0, "at least 1").fingerprint(),
    /// Trajectories generated and scored in one forward pass (`batch_size` must be a
    /// multiple).
    forward_batch_size: usize = required().range(|v| v >= 1.0, "at least 1"),
    /// The responses' length, temperature and sampling.
    #[serde(flatten)]
    rollout: Rollout = group(),
    /// Responses shorter than this (their last token's index below it, as torchtune counts)
    /// get `reward_penalty` as their score (null: no minimum).
    min_response_length: Option<usize> = optional().fingerprint(),
    /// Responses without a stop token get `reward_penalty` as their score.
    penalise_no_eos: bool = required().fingerprint(),
    /// The score of a penalised response.
    reward_penalty: f64 = required().range(|v| v.is_finite(), "a finite number").fingerprint(),
    /// The tokens that end a response (null: the tokenizer's stop tokens).
    stop_token_ids: Option<Vec<u32>> = optional().fingerprint(),
    /// Whiten the per-token rewards before the advantages (TRL's PPO does this; torchtune's
    /// recipe reads the key and ignores it).
    whiten_rewards: bool = required().fingerprint(),
    /// GAE's discount.
    gamma: f64 = required().range(|v| (0.0..=1.0).contains(&v), "from 0 to 1").fingerprint(),
    /// GAE's lambda.
    lmbda: f64 = required().range(|v| (0.0..=1.0).contains(&v), "from 0 to 1").fingerprint(),
    /// The weight of the per-token KL penalty against the reference in the rewards.
    kl_coeff: f64 = required().range(|v| v.is_finite() && v >= 0.0, "0 or a positive number").fingerprint(),
    /// torchtune decodes with a KV cache or without; the responses are the same, and tune
    /// always keeps one.
    enable_kv_cache: bool = on().validation_only(
        "the responses are the same with or without a KV cache; tune always decodes with one",
    ),
}

/// The key PPO's policy has: every other recipe's `model`.
pub const POLICY_KEY: &str = "policy_model";

/// The keys every training recipe reads as a PPO config writes them: `policy_model` for
/// `model`, and no `epochs`.
pub static SHARED_KEYS: std::sync::LazyLock<Vec<KeyInfo>> = std::sync::LazyLock::new(|| {
    TrainConfig::KEYS
        .iter()
        .filter(|k| k.name != "epochs")
        .map(|k| KeyInfo {
            name: if k.name == "model" {
                POLICY_KEY
            } else {
                k.name
            },
            doc: k.doc,
            ty: k.ty,
            spec: k.spec,
        })
        .collect()
});

/// The top-level keys every recipe reads, as PPO's config writes them: `policy_model` read as
/// `model`, and `epochs` (which PPO does not count: the recipe derives it from `num_steps`)
/// set to 1. A `model` or `epochs` of the config itself is refused.
pub fn train_view(root: &Mapping, cx: &mut Checker) -> Mapping {
    let mut view = root.clone();
    for (key, fix) in [
        (
            "model",
            "PPO's policy is `policy_model` (torchtune's name): rename the section",
        ),
        (
            "epochs",
            "PPO runs `num_steps // batch_size` steps, as torchtune's recipe: remove `epochs`",
        ),
    ] {
        if view.remove(key).is_some() {
            cx.problem(
                Problem::new(
                    ProblemKind::UnknownKey,
                    key,
                    "is not a key of the PPO recipe",
                )
                .with_fix(fix),
            );
        }
    }
    if let Some(policy) = view.remove(POLICY_KEY) {
        view.insert(Value::from("model"), policy);
    }
    view.insert(Value::from("epochs"), Value::from(1));
    view
}

/// torchtune's `torchtune.modules.classifier_model` (its Mistral PPO config's reward and value
/// model): the model `base_model_path` names with its output replaced by a `num_classes`
/// projection, which is that family's `*_classifier` builder. PPO's own keys are read from a
/// view with the section written so; a missing or unusable `base_model_path` is refused by
/// name.
pub fn own_view(root: &Mapping, cx: &mut Checker) -> Mapping {
    let mut view = root.clone();
    let section = "reward_and_value_model";
    let Some(Value::Mapping(model)) = view.get_mut(section) else {
        return view;
    };
    let component = model.get("_component_").and_then(Value::as_str);
    if !matches!(
        component,
        Some("torchtune.modules.classifier_model" | "tune.modules.classifier_model")
    ) {
        return view;
    }
    let key = format!("{section}.base_model_path");
    let base = model.remove("base_model_path");
    let Some(base) = base.as_ref().and_then(Value::as_str) else {
        cx.problem(
            Problem::new(
                ProblemKind::MissingKey,
                &key,
                "`torchtune.modules.classifier_model` needs the builder of the model it classifies with",
            )
            .with_fix("e.g. `base_model_path: torchtune.models.mistral.mistral_7b`"),
        );
        return view;
    };
    use crate::config::components::{Component, ComponentKind, lookup};
    match lookup(base, Some(ComponentKind::Model)).map(|l| l.component) {
        Ok(Component::Model(builder)) if !builder.is_lora() => {
            let module = builder.family.module();
            model.insert(
                Value::from("_component_"),
                Value::from(format!("torchtune.models.{module}.{module}_classifier")),
            );
        }
        Ok(_) => cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                &key,
                format!("`{base}` is a LoRA builder; PPO trains every weight of its value model"),
            )
            .with_fix("name the family's full builder, e.g. `torchtune.models.mistral.mistral_7b`"),
        ),
        Err(e) => cx.problem(
            Problem::new(ProblemKind::InvalidValue, &key, e.to_string())
                .with_fix("name a model builder, e.g. `torchtune.models.mistral.mistral_7b`"),
        ),
    }
    view
}

/// Problems of [`train_view`]'s `model` are the config's `policy_model`'s: those from the
/// `problems`-th and `warnings`-th on (what reading the view reported).
pub fn rename_policy_paths(cx: &mut Checker, problems: usize, warnings: usize) {
    let rename = |key: &mut String| {
        if key == "model" {
            *key = POLICY_KEY.to_string();
        } else if let Some(rest) = key.strip_prefix("model.") {
            *key = format!("{POLICY_KEY}.{rest}");
        }
    };
    for p in cx.problems.iter_mut().skip(problems) {
        rename(&mut p.key);
    }
    for w in cx.warnings.iter_mut().skip(warnings) {
        rename(&mut w.key);
    }
}

/// What only makes sense together with the shared keys: torchtune's divisibility checks, and
/// the shared keys PPO has no use for, refused by name.
pub fn ppo_rules(c: &TrainConfig, k: &PpoKeys, cx: &mut Checker) {
    let divides = [
        (
            "forward_batch_size",
            c.batch_size,
            k.forward_batch_size,
            "batch_size",
        ),
        (
            "ppo_batch_size",
            c.batch_size,
            k.ppo_batch_size,
            "batch_size",
        ),
        (
            "gradient_accumulation_steps",
            k.ppo_batch_size,
            c.gradient_accumulation_steps,
            "ppo_batch_size",
        ),
    ];
    for (key, whole, part, of) in divides {
        if part == 0 || whole % part != 0 {
            cx.problem(
                Problem::new(
                    ProblemKind::InvalidValue,
                    key,
                    format!("is {part}, which does not divide {of} ({whole})"),
                )
                .with_fix(format!(
                    "set `{key}` to a divisor of `{of}`, as torchtune requires"
                )),
            );
        }
    }
    if k.num_steps < c.batch_size {
        cx.problem(
            Problem::new(
                ProblemKind::InvalidValue,
                "num_steps",
                format!(
                    "is {}, fewer than one batch ({} prompts): PPO runs num_steps // batch_size steps",
                    k.num_steps, c.batch_size
                ),
            )
            .with_fix("set `num_steps` to at least `batch_size` (torchtune counts samples)"),
        );
    }
    let unused = [
        (
            "clip_grad_norm",
            c.clip_grad_norm.is_some(),
            "torchtune's PPO recipe does not clip; remove `clip_grad_norm`",
        ),
        (
            "max_steps_per_epoch",
            c.max_steps_per_epoch.is_some(),
            "PPO's length is `num_steps`; remove `max_steps_per_epoch`",
        ),
        (
            "dataset_val",
            c.dataset_val.is_some(),
            "PPO has no validation loss; remove `dataset_val`",
        ),
        (
            "run_val_every_n_steps",
            c.run_val_every_n_steps.is_some(),
            "PPO has no validation loss; remove `run_val_every_n_steps`",
        ),
    ];
    for (key, set, fix) in unused {
        if set {
            cx.problem(
                Problem::new(
                    ProblemKind::InvalidValue,
                    key,
                    "is not read by the PPO recipe",
                )
                .with_fix(fix),
            );
        }
    }
}
