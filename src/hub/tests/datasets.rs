use super::fake_hub::{self, FakeRepo};
use super::support::temp_dir;
use crate::hub::datasets::{DatasetFetchOptions, fetch_dataset_files_with_env, is_hub_source};
use crate::hub::env::HubEnv;
use crate::hub::error::HubError;

fn dataset_repo() -> FakeRepo {
    FakeRepo {
        files: vec![
            ("README.md".into(), b"# data".to_vec()),
            ("dataset_info.json".into(), b"{}".to_vec()),
            ("data/train.jsonl".into(), b"{\"text\":\"a\"}\n".to_vec()),
            ("data/test.jsonl".into(), b"{\"text\":\"b\"}\n".to_vec()),
        ],
        ..FakeRepo::default()
    }
}

#[test]
fn dataset_files_come_from_the_dataset_repo() {
    let (server, _state) = fake_hub::start(vec![("datasets/org/data", dataset_repo())]);
    let tmp = temp_dir("datasets");
    let env = HubEnv::isolated(tmp.path().join("home"));
    let opts = DatasetFetchOptions {
        endpoint: Some(server.url()),
        cache_dir: Some(tmp.path().join("hub")),
        offline: Some(false),
        ..DatasetFetchOptions::default()
    };
    let files = fetch_dataset_files_with_env("org/data", None, &[], &opts, &env).expect("fetch");
    let names: Vec<String> = files
        .iter()
        .map(|p| {
            p.strip_prefix(tmp.path())
                .expect("under tmp")
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert_eq!(
        names,
        vec![
            format!(
                "hub/datasets--org--data/snapshots/{}/data/test.jsonl",
                fake_hub::COMMIT
            ),
            format!(
                "hub/datasets--org--data/snapshots/{}/data/train.jsonl",
                fake_hub::COMMIT
            ),
        ]
    );
    assert_eq!(
        std::fs::read(&files[1]).expect("read"),
        b"{\"text\":\"a\"}\n"
    );
    assert!(
        server
            .requests()
            .iter()
            .any(|r| r.path() == "/api/datasets/org/data/revision/main")
    );
    assert!(
        server
            .requests()
            .iter()
            .any(|r| r.path().starts_with("/datasets/org/data/resolve/"))
    );

    let only = fetch_dataset_files_with_env(
        "org/data",
        Some("main"),
        &["data/train.jsonl".into()],
        &opts,
        &env,
    )
    .expect("data_files");
    assert_eq!(only.len(), 1);
    assert!(only[0].ends_with("data/train.jsonl"));

    let err =
        fetch_dataset_files_with_env("org/data", None, &["data/valid.jsonl".into()], &opts, &env)
            .expect_err("missing");
    assert!(matches!(err, HubError::EntryNotFound { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        "file data/valid.jsonl not found in repo org/data at revision main"
    );
    let err = fetch_dataset_files_with_env("org/data", None, &["*.parquet".into()], &opts, &env)
        .expect_err("no parquet");
    assert_eq!(
        err.to_string(),
        "no data files in dataset org/data match [\"*.parquet\"]; pass data_files naming the files to use"
    );
}

#[test]
fn hub_sources_are_recognised() {
    assert!(is_hub_source("tatsu-lab/alpaca"));
    assert!(!is_hub_source("json"));
    assert!(!is_hub_source("alpaca"));
    assert!(!is_hub_source("./data/x.jsonl"));
}
