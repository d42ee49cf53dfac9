//! Download -> train -> push -> download against the local fake Hub the library's own Hub
//! tests use (no network): what tune saves names the repo the base model came from, a push
//! holds what a Hub user loads and no training state, and the pushed files come back byte for
//! byte.

// The library's fake Hub and its test server, shared with the suite (`fake_hub` reaches the
// server as `super::support`).
#[allow(dead_code)]
#[path = "../../src/hub/tests/fake_hub.rs"]
mod fake_hub;
#[allow(dead_code)]
#[path = "../../src/hub/tests/support.rs"]
mod support;

use std::path::Path;

use crate::support::{temp_dir, tune_command};
use fake_hub::FakeRepo;

fn tune_with_hub(args: &[&str], endpoint: &str, home: &Path) -> std::process::Output {
    tune_command(args)
        .env("HF_ENDPOINT", endpoint)
        .env("HF_HOME", home)
        .env("HF_TOKEN", fake_hub::GOOD_TOKEN)
        .env("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        .env_remove("HF_HUB_OFFLINE")
        .output()
        .expect("run tune")
}

fn ok(out: std::process::Output, what: &str) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{what}: {err}");
    err
}

#[test]
fn download_train_push_keeps_the_base_models_repo_id_and_no_training_state() {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-llama");
    let files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&tiny)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(e.path()).unwrap())
        })
        .collect();
    let (server, state) = fake_hub::start(vec![(
        "models/me/tiny-base",
        FakeRepo {
            files,
            ..FakeRepo::default()
        },
    )]);
    let tmp = temp_dir("hub-roundtrip");
    let home = tmp.path().join("hf-home");
    let base = tmp.path().join("base");
    let run = tmp.path().join("run");
    let url = server.url();

    ok(
        tune_with_hub(
            &[
                "download",
                "me/tiny-base",
                "--output-dir",
                &base.display().to_string(),
            ],
            &url,
            &home,
        ),
        "download",
    );
    ok(
        tune_with_hub(
            &[
                "run",
                "lora_finetune_single_device",
                "--config",
                "tiny/lora_single_device",
                &format!("checkpointer.checkpoint_dir={}", base.display()),
                &format!("tokenizer.path={}/tokenizer.json", base.display()),
                &format!("output_dir={}", run.display()),
                "max_steps_per_epoch=2",
            ],
            &url,
            &home,
        ),
        "train",
    );
    let checkpoint = run.join("epoch_0");
    let adapter_config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(checkpoint.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(adapter_config["base_model_name_or_path"], "me/tiny-base");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(checkpoint.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["_name_or_path"], "me/tiny-base");

    ok(
        tune_with_hub(
            &["push", &checkpoint.display().to_string(), "me/tiny-adapter"],
            &url,
            &home,
        ),
        "push",
    );
    let committed = state.lock().unwrap().committed.clone();
    let card = String::from_utf8_lossy(&committed["README.md"]).into_owned();
    assert!(card.contains("base_model: me/tiny-base"), "{card}");
    assert!(!card.contains(&tmp.path().display().to_string()), "{card}");
    for state_file in ["optimizer.safetensors", "tune_checkpoint.json"] {
        assert!(checkpoint.join(state_file).is_file());
        assert!(
            !committed.contains_key(state_file),
            "{state_file} was pushed"
        );
    }
    assert!(committed.contains_key("adapter_model.safetensors"));

    // The pushed repo, downloaded again: every file byte for byte.
    state.lock().unwrap().repos.insert(
        "models/me/tiny-adapter".into(),
        FakeRepo {
            files: committed.clone().into_iter().collect(),
            ..FakeRepo::default()
        },
    );
    let again = tmp.path().join("again");
    ok(
        tune_with_hub(
            &[
                "download",
                "me/tiny-adapter",
                "--output-dir",
                &again.display().to_string(),
            ],
            &url,
            &home,
        ),
        "download the push",
    );
    for (name, bytes) in &committed {
        assert_eq!(&std::fs::read(again.join(name)).unwrap(), bytes, "{name}");
        if name != "README.md" {
            assert_eq!(
                &std::fs::read(checkpoint.join(name)).unwrap(),
                bytes,
                "{name}"
            );
        }
    }
}

/// Both DPO recipes end like every other recipe (their own copy of the epilogue used to skip
/// it): `push_to_hub` uploads the final checkpoint, adapter or model, with no training state.
#[test]
fn dpo_recipes_push_their_final_checkpoint() {
    let (server, state) = fake_hub::start(vec![]);
    let tmp = temp_dir("dpo-push");
    for (recipe, repo, pushed) in [
        (
            "lora_dpo_single_device",
            "me/tiny-dpo-lora",
            "adapter_model.safetensors",
        ),
        (
            "full_dpo_single_device",
            "me/tiny-dpo-full",
            "model.safetensors",
        ),
    ] {
        let out = tmp.path().join(recipe);
        let err = ok(
            tune_with_hub(
                &[
                    "run",
                    recipe,
                    "--config",
                    &format!("tiny/{recipe}"),
                    &format!("output_dir={}", out.display()),
                    "max_steps_per_epoch=1",
                    "epochs=1",
                    &format!("push_to_hub={{repo_id: {repo}, private: True}}"),
                ],
                &server.url(),
                &tmp.path().join("hf-home"),
            ),
            recipe,
        );
        assert!(
            err.contains(&format!("to {}/{repo}", server.url())),
            "{recipe}: {err}"
        );
        let state = state.lock().unwrap();
        let created: Vec<&str> = state
            .created
            .iter()
            .filter_map(|c| c["name"].as_str())
            .collect();
        assert!(
            created.contains(&repo.split('/').nth(1).unwrap()),
            "{created:?}"
        );
        assert_eq!(
            state.committed[pushed],
            std::fs::read(out.join("epoch_0").join(pushed)).unwrap(),
            "{recipe}"
        );
        assert!(!state.committed.contains_key("optimizer.safetensors"));
    }
}

/// PPO pushes its policy's final checkpoint (the model it trains for), as the other recipes
/// push theirs; the value model stays in its own directory.
#[test]
fn ppo_pushes_its_policys_final_checkpoint() {
    let (server, state) = fake_hub::start(vec![]);
    let tmp = temp_dir("ppo-push");
    let out = tmp.path().join("run");
    let repo = "me/tiny-ppo";
    let err = ok(
        tune_with_hub(
            &[
                "run",
                "ppo_full_finetune_single_device",
                "--config",
                "tiny/ppo_full_single_device",
                &format!("output_dir={}", out.display()),
                "num_steps=8",
                &format!("push_to_hub={{repo_id: {repo}, private: True}}"),
            ],
            &server.url(),
            &tmp.path().join("hf-home"),
        ),
        "ppo",
    );
    assert!(
        err.contains(&format!("to {}/{repo}", server.url())),
        "{err}"
    );
    let state = state.lock().unwrap();
    let policy = out.join("policy/epoch_0");
    assert_eq!(
        state.committed["model.safetensors"],
        std::fs::read(policy.join("model.safetensors")).unwrap()
    );
    assert!(!state.committed.contains_key("optimizer.safetensors"));
}
