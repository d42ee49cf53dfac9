use std::path::Path;

use super::fake_hub::{self, FakeRepo};
use super::support::{TempDir, refused_endpoint, temp_dir};
use crate::hub::env::HubEnv;
use crate::hub::error::HubError;
use crate::hub::push::{PushOptions, ReadmeSource, push_with_env};
use crate::hub::validate::CheckpointKind;

fn weights(len: usize, seed: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 7 + seed) % 256) as u8).collect()
}

const ADAPTER_CONFIG: &str = r#"{"base_model_name_or_path":"meta-llama/Llama-3.2-1B","peft_type":"LORA","r":8,"lora_alpha":16,"lora_dropout":0.0,"target_modules":["q_proj","v_proj"]}"#;

fn adapter_dir(root: &Path) -> std::path::PathBuf {
    let dir = root.join("adapter");
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("adapter_config.json"), ADAPTER_CONFIG).expect("config");
    std::fs::write(dir.join("adapter_model.safetensors"), weights(1200, 1)).expect("weights");
    std::fs::write(dir.join(".hidden"), "skip me").expect("hidden");
    dir
}

fn options(dir: &Path, endpoint: &str) -> PushOptions {
    PushOptions {
        dir: dir.to_path_buf(),
        repo_id: "me/llama-lora".into(),
        token: Some(fake_hub::GOOD_TOKEN.into()),
        endpoint: Some(endpoint.to_string()),
        ..PushOptions::default()
    }
}

fn env(tmp: &TempDir) -> HubEnv {
    HubEnv::isolated(tmp.path().join("home"))
}

#[test]
fn push_uploads_every_adapter_file_with_identical_bytes_and_a_card() {
    let (server, state) = fake_hub::start(vec![]);
    let tmp = temp_dir("push");
    let dir = adapter_dir(tmp.path());
    let mut opts = options(&dir, &server.url());
    opts.private = true;
    opts.create_pr = true;
    opts.commit_message = Some("Add adapter".into());
    let report = push_with_env(opts, &env(&tmp)).expect("push");

    assert_eq!(report.kind, CheckpointKind::PeftAdapter);
    assert!(report.created_repo);
    assert_eq!(report.readme, ReadmeSource::Generated);
    assert_eq!(report.commit_oid.as_deref(), Some(fake_hub::COMMIT));
    // The Hub answers `pullRequestUrl`, which hf-hub 1.0 does not read (it reads `prUrl`), so
    // the PR is opened (create_pr=1 below) but its URL is not reported.
    let paths: Vec<&str> = report.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "README.md",
            "adapter_config.json",
            "adapter_model.safetensors"
        ]
    );

    let state = state.lock().expect("state");
    assert_eq!(
        state.created,
        vec![
            serde_json::json!({"name": "llama-lora", "organization": "me", "private": true, "type": "model"})
        ]
    );
    assert_eq!(state.committed.len(), 3);
    assert_eq!(
        state.committed["adapter_config.json"],
        ADAPTER_CONFIG.as_bytes()
    );
    assert_eq!(
        state.committed["adapter_model.safetensors"],
        weights(1200, 1)
    );
    let readme = String::from_utf8(state.committed["README.md"].clone()).expect("utf8");
    assert!(
        readme.starts_with("---\nbase_model: meta-llama/Llama-3.2-1B\nlibrary_name: peft\n"),
        "{readme}"
    );
    assert!(readme.contains("| LoRA rank (r) | 8 |"));
    assert!(readme.contains("| LoRA target modules | q_proj, v_proj |"));

    // One commit, with the message, opened as a pull request (the wire format is hf-hub's).
    assert_eq!(
        state.commit_lines[0]["value"]["summary"],
        serde_json::json!("Add adapter")
    );
    assert_eq!(
        state.commit_targets,
        vec!["/api/models/me/llama-lora/commit/main?create_pr=1".to_string()]
    );
    drop(state);
    let requests = server.requests();
    assert!(
        requests
            .iter()
            .filter(|r| r.path().starts_with("/api/"))
            .all(|r| r.header("authorization") == Some("Bearer hf_good"))
    );
    assert!(
        !requests
            .iter()
            .any(|r| String::from_utf8_lossy(&r.body).contains(".hidden"))
    );
}

#[test]
fn push_full_checkpoint_keeps_readme_and_commits_to_the_revision() {
    let (server, state) = fake_hub::start(vec![("models/me/full", FakeRepo::default())]);
    let tmp = temp_dir("push-full");
    let dir = tmp.path().join("ckpt");
    std::fs::create_dir_all(dir.join("sub")).expect("dir");
    std::fs::write(dir.join("config.json"), "{}").expect("config");
    std::fs::write(dir.join("model.safetensors"), weights(2500, 3)).expect("weights");
    std::fs::write(dir.join("README.md"), "# my own card\n").expect("readme");
    std::fs::write(dir.join("sub/notes.txt"), "n").expect("notes");
    std::fs::write(dir.join("optimizer.pt"), "big").expect("optimizer");
    let mut opts = options(&dir, &server.url());
    opts.repo_id = "me/full".into();
    opts.revision = Some("refs/pr/3".into());
    opts.ignore_patterns = vec!["*.pt".into()];
    let report = push_with_env(opts, &env(&tmp)).expect("push");

    assert!(!report.created_repo, "409 means it exists");
    assert_eq!(report.readme, ReadmeSource::Kept);
    assert_eq!(report.pull_request_url, None);
    let state = state.lock().expect("state");
    assert_eq!(state.created[0]["private"], false);
    assert_eq!(state.committed["README.md"], b"# my own card\n");
    assert_eq!(state.committed["model.safetensors"], weights(2500, 3));
    assert_eq!(state.committed["sub/notes.txt"], b"n");
    assert!(!state.committed.contains_key("optimizer.pt"));
    assert_eq!(
        state.commit_targets,
        vec!["/api/models/me/full/commit/refs%2Fpr%2F3".to_string()]
    );
}

#[test]
fn supplied_card_replaces_the_folder_readme() {
    let (server, state) = fake_hub::start(vec![]);
    let tmp = temp_dir("push-card");
    let dir = adapter_dir(tmp.path());
    std::fs::write(dir.join("README.md"), "old").expect("readme");
    let mut opts = options(&dir, &server.url());
    opts.model_card = Some("---\nlibrary_name: peft\n---\nnew".into());
    let report = push_with_env(opts, &env(&tmp)).expect("push");
    assert_eq!(report.readme, ReadmeSource::Supplied);
    assert_eq!(
        state.lock().expect("state").committed["README.md"],
        b"---\nlibrary_name: peft\n---\nnew"
    );
}

fn refused(dir: &Path, tmp: &TempDir) -> HubError {
    push_with_env(options(dir, &refused_endpoint()), &env(tmp)).expect_err("must refuse")
}

#[test]
fn push_refuses_folders_that_are_not_adapters_or_checkpoints() {
    let tmp = temp_dir("push-invalid");
    let dir = tmp.path().join("junk");
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("notes.txt"), "x").expect("notes");
    let err = refused(&dir, &tmp);
    assert!(matches!(err, HubError::InvalidPushDir { .. }));
    assert_eq!(
        err.to_string(),
        format!(
            "{} cannot be pushed: it is neither a PEFT adapter (missing adapter_config.json, adapter_model.safetensors) nor a Hugging Face checkpoint (missing config.json and model.safetensors or model.safetensors.index.json)",
            dir.display()
        )
    );

    std::fs::write(dir.join("adapter_config.json"), ADAPTER_CONFIG).expect("config");
    assert_eq!(
        refused(&dir, &tmp).to_string(),
        format!(
            "{} cannot be pushed: it has adapter_config.json but adapter_model.safetensors is missing",
            dir.display()
        )
    );

    let sharded = tmp.path().join("sharded");
    std::fs::create_dir_all(&sharded).expect("dir");
    std::fs::write(sharded.join("config.json"), "{}").expect("config");
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        r#"{"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}}"#,
    )
    .expect("index");
    std::fs::write(sharded.join("model-00001-of-00002.safetensors"), "x").expect("shard");
    assert_eq!(
        refused(&sharded, &tmp).to_string(),
        format!(
            "{} cannot be pushed: shards listed in model.safetensors.index.json are missing: model-00002-of-00002.safetensors",
            sharded.display()
        )
    );

    let missing = tmp.path().join("does-not-exist");
    assert!(
        refused(&missing, &tmp)
            .to_string()
            .ends_with("cannot be pushed: it is not a directory")
    );
}

#[test]
fn push_without_any_token_says_how_to_get_one() {
    let tmp = temp_dir("push-token");
    let dir = adapter_dir(tmp.path());
    let mut opts = options(&dir, &refused_endpoint());
    opts.token = None;
    let err = push_with_env(opts, &env(&tmp)).expect_err("no token");
    assert_eq!(
        err.to_string(),
        "pushing to me/llama-lora needs a token with write access: set HF_TOKEN, run `hf auth login`, or pass --hf-token"
    );
}

#[test]
fn push_to_an_unreachable_hub_is_reported() {
    let tmp = temp_dir("push-refused");
    let dir = adapter_dir(tmp.path());
    let err = refused(&dir, &tmp);
    assert!(matches!(err, HubError::Unreachable { .. }), "{err}");
}

/// A tune checkpoint holds what resuming needs beside what a Hub user loads: the optimizer
/// state (one file or per-rank shards) and the manifest stay home unless asked for.
#[test]
fn training_state_is_not_pushed_unless_asked() {
    let tmp = temp_dir("push-state");
    let dir = adapter_dir(tmp.path());
    for name in [
        "optimizer.safetensors",
        "optimizer-00001-of-00002.safetensors",
        "tune_checkpoint.json",
    ] {
        std::fs::write(dir.join(name), "state").expect("state file");
    }
    let uploaded = |include_training_state: bool| {
        let (server, state) = fake_hub::start(vec![]);
        let mut opts = options(&dir, &server.url());
        opts.include_training_state = include_training_state;
        let report = push_with_env(opts, &env(&tmp)).expect("push");
        let mut committed: Vec<String> = state
            .lock()
            .expect("state")
            .committed
            .keys()
            .cloned()
            .collect();
        committed.sort();
        let reported: Vec<String> = report.files.iter().map(|f| f.path.clone()).collect();
        assert_eq!(committed, reported);
        committed
    };
    assert_eq!(
        uploaded(false),
        [
            "README.md",
            "adapter_config.json",
            "adapter_model.safetensors"
        ]
    );
    assert_eq!(
        uploaded(true),
        [
            "README.md",
            "adapter_config.json",
            "adapter_model.safetensors",
            "optimizer-00001-of-00002.safetensors",
            "optimizer.safetensors",
            "tune_checkpoint.json"
        ]
    );
    // The dry run lists the same files, with no token and no server.
    let mut opts = options(&dir, &refused_endpoint());
    opts.token = None;
    let planned: Vec<String> = crate::hub::push::plan(&opts)
        .expect("plan")
        .into_iter()
        .map(|f| f.path)
        .collect();
    assert_eq!(
        planned,
        [
            "README.md",
            "adapter_config.json",
            "adapter_model.safetensors"
        ]
    );
}

/// HF_HUB_OFFLINE is honoured: a push is refused before any request, saying why.
#[test]
fn push_in_offline_mode_is_refused_before_any_request() {
    let (server, state) = fake_hub::start(vec![]);
    let tmp = temp_dir("push-offline");
    let dir = adapter_dir(tmp.path());
    let home = tmp.path().join("home");
    let env = HubEnv::from_lookup(|name| match name {
        "HF_HOME" => Some(home.to_string_lossy().into_owned()),
        "HF_HUB_OFFLINE" => Some("1".into()),
        _ => None,
    });
    let err = push_with_env(options(&dir, &server.url()), &env).unwrap_err();
    assert!(matches!(err, HubError::OfflinePush { .. }), "{err}");
    assert!(err.to_string().contains("unset HF_HUB_OFFLINE"), "{err}");
    let state = state.lock().expect("state");
    assert!(state.created.is_empty() && state.committed.is_empty());
}
