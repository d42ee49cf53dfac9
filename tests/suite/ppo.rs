//! PPO (torchtune's `ppo_full_finetune_single_device`): the reward and value models, which are
//! `*ForSequenceClassification` checkpoints, and the recipe.

use crate::support;

use support::*;
use tune::model_io::hf::{load_model, save_hf_dir};
use tune::modules::ForwardMode;

/// A reward model loads with its `score` head (one class, never tied to the embeddings, even
/// where config.json says `tie_word_embeddings: true`) and scores every position as
/// transformers does; saved, it is the same checkpoint.
#[test]
fn a_reward_model_scores_every_position_as_transformers_and_saves_as_it_loaded() {
    let device = Default::default();
    let dir = fixture("tiny-llama-reward");
    let model = load_model::<Cpu>(&dir, None, &device).unwrap().model;
    assert_eq!(model.args.num_labels, Some(1));
    assert!(!model.args.tie_word_embeddings);
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    for row in expected["rows"].as_array().unwrap() {
        let tokens: Vec<u32> = row["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let scores = forward_rows(&model, &tokens, 1, ForwardMode::default());
        assert_eq!(scores.dims(), [1, tokens.len(), 1]);
        let got: Vec<f32> = scores.into_data().to_vec().unwrap();
        let want: Vec<f32> = row["per_position"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() < 1e-4 * (1.0 + w.abs()),
                "{g} against transformers' {w}"
            );
        }
    }
    let state = model.hf_state_dict();
    let names: Vec<&str> = state.iter().map(|(n, _)| n.as_str()).collect();
    assert!(
        names.contains(&"score.weight") && !names.contains(&"lm_head.weight"),
        "{names:?}"
    );
    let out = tempfile::tempdir().unwrap();
    save_hf_dir(
        out.path(),
        &state,
        &model.args.raw,
        tune::checkpoint::StorageDtype::F32,
        tune::model_io::hf::DEFAULT_MAX_SHARD_BYTES,
        Some(&dir),
    )
    .unwrap();
    let again = load_model::<Cpu>(out.path(), None, &device).unwrap().model;
    assert_eq!(again.hf_state_dict(), state);
}
