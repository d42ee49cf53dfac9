//! The losses' settings, from the recipes' typed `loss` sections (each component's keys carry
//! their defaults: `config::schema::loss`).

use crate::config::schema::{
    DpoLoss, DpoSettings as DpoKeysOf, GrpoLoss, GrpoSettings, PpoLoss, TorchtuneGrpoKeys,
};
use crate::training::dpo::DpoSettings;
use crate::training::grpo_loss::{
    GrpoObjective, TorchtuneGrpoLoss, TorchtuneGrpoSettings, TrlGrpoSettings,
};
use crate::training::ppo::PpoLossSettings;

/// `DPOLoss(beta, label_smoothing)`.
pub fn dpo(loss: &DpoLoss) -> DpoSettings {
    let DpoKeysOf::Dpo(keys) = &loss.settings;
    DpoSettings {
        beta: keys.beta,
        label_smoothing: keys.label_smoothing,
    }
}

/// The GRPO policy loss `loss._component_` names, with its settings; TRL's `dr_grpo`
/// divides by the longest completion, `max_generated_tokens` (TRL's `max_completion_length`).
pub fn grpo(loss: &GrpoLoss, max_generated_tokens: usize) -> GrpoObjective {
    let torchtune = |loss, k: &TorchtuneGrpoKeys| {
        GrpoObjective::Torchtune(TorchtuneGrpoSettings {
            loss,
            epsilon: k.epsilon,
            kl_coeff: k.kl_coeff,
        })
    };
    match &loss.settings {
        GrpoSettings::Token(k) => torchtune(TorchtuneGrpoLoss::Token, k),
        GrpoSettings::Completion(k) => torchtune(TorchtuneGrpoLoss::Completion, k),
        GrpoSettings::Simple(k) => torchtune(TorchtuneGrpoLoss::Simple, k),
        GrpoSettings::Trl(k) => GrpoObjective::Trl(TrlGrpoSettings {
            loss_type: k.loss_type,
            importance_sampling_level: k.importance_sampling_level,
            epsilon_low: k.epsilon,
            epsilon_high: k.epsilon_high.unwrap_or(k.epsilon),
            beta: k.beta,
            use_bias_correction_kl: k.use_bias_correction_kl,
            max_completion_length: max_generated_tokens,
        }),
    }
}

/// `PPOLoss(epsilon, value_clip_range, value_coeff)`.
pub fn ppo(loss: &PpoLoss) -> PpoLossSettings {
    let crate::config::schema::PpoSettings::Ppo(k) = &loss.settings;
    PpoLossSettings {
        epsilon: k.epsilon,
        value_clip_range: k.value_clip_range,
        value_coeff: k.value_coeff,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;
    use crate::config::schema::{GrpoKeys, PpoKeys};
    use crate::config::{ValidateOptions, load_config};
    use crate::recipes::full_dpo_single_device::FullDpoKeys;
    use crate::recipes::validate_with;
    use crate::training::grpo_loss::{ImportanceSamplingLevel, TrlLossType};

    /// The defaults of torchtune's and TRL's losses, read from their sources by
    /// tests/fixtures/make_loss_defaults_fixture.py.
    fn reference(component: &str) -> Value {
        let all: Value =
            serde_json::from_str(include_str!("../../tests/fixtures/loss_defaults.json"))
                .expect("tests/fixtures/loss_defaults.json parses");
        all[component].clone()
    }

    fn num(v: &Value) -> f64 {
        v.as_f64().expect("a number")
    }

    /// The own keys of `recipe` read from tiny `config` with its `loss` section only naming
    /// `component`: every setting at its declared default.
    fn keys_with_only<K: Clone + 'static>(config: &str, recipe: &str, component: &str) -> K {
        let cfg =
            load_config(config, &[format!("loss={{_component_: {component}}}")]).expect("loads");
        let (typed, _) = validate_with(recipe, &cfg, &ValidateOptions { check_paths: false })
            .unwrap_or_else(|e| panic!("{component}: {e}"));
        typed.own::<K>().expect("the recipe's own keys").clone()
    }

    #[test]
    fn dpo_and_ppo_defaults_are_torchtunes() {
        let name = "torchtune.rlhf.loss.DPOLoss";
        let keys: FullDpoKeys = keys_with_only("tiny/full_dpo_single_device", "full_dpo", name);
        let want = reference(name);
        let got = dpo(&keys.loss);
        assert_eq!(got.beta, num(&want["beta"]));
        assert_eq!(got.label_smoothing, num(&want["label_smoothing"]));

        let name = "torchtune.rlhf.loss.PPOLoss";
        let keys: PpoKeys =
            keys_with_only("tiny/ppo_full_single_device", "ppo_full_finetune", name);
        let want = reference(name);
        let got = ppo(&keys.loss);
        assert_eq!(got.epsilon, num(&want["epsilon"]));
        assert_eq!(got.value_clip_range, num(&want["value_clip_range"]));
        assert_eq!(got.value_coeff, num(&want["value_coeff"]));
    }

    #[test]
    fn grpo_defaults_are_torchtunes_and_trls() {
        let config = "tiny/grpo_full_single_device";
        for (name, kind) in [
            ("torchtune.dev.grpo.loss.GRPOLoss", TorchtuneGrpoLoss::Token),
            (
                "torchtune.dev.grpo.loss.GRPOCompletionLoss",
                TorchtuneGrpoLoss::Completion,
            ),
            (
                "torchtune.dev.grpo.loss.GRPOSimpleLoss",
                TorchtuneGrpoLoss::Simple,
            ),
        ] {
            let keys: GrpoKeys = keys_with_only(config, "grpo_full_finetune", name);
            let want = reference(name);
            let GrpoObjective::Torchtune(got) = grpo(&keys.loss, 7) else {
                panic!("{name} is torchtune's loss");
            };
            assert_eq!(got.loss, kind, "{name}");
            assert_eq!(got.epsilon, num(&want["epsilon"]), "{name}");
            assert_eq!(got.kl_coeff, num(&want["kl_coeff"]), "{name}");
        }

        let keys: GrpoKeys = keys_with_only(config, "grpo_full_finetune", "tune.loss.TRLGRPOLoss");
        let want = reference("trl.GRPOConfig");
        let GrpoObjective::Trl(got) = grpo(&keys.loss, 7) else {
            panic!("TRLGRPOLoss is TRL's loss");
        };
        let loss_type = want["loss_type"].as_str().expect("a string");
        assert_eq!(Some(got.loss_type), TrlLossType::parse(loss_type));
        assert_eq!(got.loss_type, TrlLossType::Dapo);
        let level = match want["importance_sampling_level"].as_str() {
            Some("token") => ImportanceSamplingLevel::Token,
            Some("sequence") => ImportanceSamplingLevel::Sequence,
            other => panic!("importance_sampling_level {other:?}"),
        };
        assert_eq!(got.importance_sampling_level, level);
        assert_eq!(got.beta, num(&want["beta"]));
        assert_eq!(got.epsilon_low, num(&want["epsilon"]));
        // TRL's epsilon_high None is epsilon.
        assert!(want["epsilon_high"].is_null());
        assert_eq!(got.epsilon_high, got.epsilon_low);
        assert_eq!(
            got.use_bias_correction_kl,
            want["use_bias_correction_kl"].as_bool().expect("a bool")
        );
        // dr_grpo's normaliser is the recipe's completion length, TRL's max_completion_length.
        assert_eq!(got.max_completion_length, 7);
    }
}
