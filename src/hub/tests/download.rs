use std::path::Path;

use super::fake_hub::{self, COMMIT, FakeRepo, sha256_hex};
use super::support::{TempDir, refused_endpoint, temp_dir};
use crate::hub::download::{DownloadOptions, download_with_env};
use crate::hub::env::HubEnv;
use crate::hub::error::HubError;

fn weights(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

fn model_repo() -> FakeRepo {
    FakeRepo {
        files: vec![
            ("config.json".into(), br#"{"model_type":"llama"}"#.to_vec()),
            ("model.safetensors".into(), weights(1400)),
            ("tokenizer.json".into(), b"{\"version\":\"1.0\"}".to_vec()),
            ("original/consolidated.00.pth".into(), weights(300)),
            ("extra.pth".into(), weights(10)),
        ],
        ..FakeRepo::default()
    }
}

fn opts(endpoint: &str, cache: &Path) -> DownloadOptions {
    DownloadOptions {
        repo_id: "org/model".into(),
        endpoint: Some(endpoint.to_string()),
        cache_dir: Some(cache.to_path_buf()),
        offline: Some(false),
        ignore_patterns: vec!["*.pth".into(), "original/*".into()],
        ..DownloadOptions::default()
    }
}

fn env(home: &TempDir) -> HubEnv {
    HubEnv::isolated(home.path().join("hf-home"))
}

#[test]
fn download_writes_the_standard_cache_layout_and_output_dir() {
    let (server, _state) = fake_hub::start(vec![("models/org/model", model_repo())]);
    let tmp = temp_dir("layout");
    let cache = tmp.path().join("hub");
    let out = tmp.path().join("out");
    let mut options = opts(&server.url(), &cache);
    options.output_dir = Some(out.clone());
    let report = download_with_env(options, &env(&tmp)).expect("download");

    assert_eq!(report.commit, COMMIT);
    assert_eq!(
        report.files,
        vec!["config.json", "model.safetensors", "tokenizer.json"]
    );
    assert_eq!(report.root, out);
    let repo_dir = cache.join("models--org--model");
    assert_eq!(
        std::fs::read_to_string(repo_dir.join("refs/main")).expect("ref"),
        COMMIT
    );
    // LFS file: blob named by its sha256 (X-Linked-Etag), snapshot entry a relative symlink.
    let oid = sha256_hex(&weights(1400));
    assert_eq!(
        std::fs::read(repo_dir.join("blobs").join(&oid)).expect("blob"),
        weights(1400)
    );
    let pointer = repo_dir
        .join("snapshots")
        .join(COMMIT)
        .join("model.safetensors");
    #[cfg(unix)]
    assert_eq!(
        std::fs::read_link(&pointer).expect("symlink"),
        Path::new("../../blobs").join(&oid)
    );
    assert_eq!(std::fs::read(&pointer).expect("pointer"), weights(1400));
    // Ignored files were neither fetched nor exported.
    assert!(
        !repo_dir
            .join("snapshots")
            .join(COMMIT)
            .join("original")
            .exists()
    );
    assert!(
        !repo_dir
            .join("snapshots")
            .join(COMMIT)
            .join("extra.pth")
            .exists()
    );
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).expect("out"),
        weights(1400)
    );
    assert_eq!(
        std::fs::read(out.join("config.json")).expect("out"),
        br#"{"model_type":"llama"}"#
    );
    assert!(!out.join("original").exists());
    assert!(
        !server.requests().iter().any(|r| r.target.contains(".pth")),
        "ignored files must not be requested"
    );

    // Again online: everything is in the snapshot, only the listing is asked.
    let before = server.requests().len();
    let again = download_with_env(opts(&server.url(), &cache), &env(&tmp)).expect("again");
    assert_eq!(again.downloaded_bytes, 0);
    assert_eq!(again.cached_files, 3);
    assert!(
        server.requests()[before..]
            .iter()
            .all(|r| !r.path().contains("/resolve/") && !r.path().starts_with("/cdn/")),
        "nothing is fetched again"
    );

    // Offline: served from the cache with no server at all.
    drop(server);
    let mut offline = opts(&refused_endpoint(), &cache);
    offline.offline = Some(true);
    let report = download_with_env(offline.clone(), &env(&tmp)).expect("offline");
    assert!(report.offline);
    assert_eq!(report.commit, COMMIT);
    assert_eq!(
        report.files,
        vec!["config.json", "model.safetensors", "tokenizer.json"]
    );
    assert_eq!(
        std::fs::read(&report.paths()[1]).expect("read"),
        weights(1400)
    );

    // Offline, asking for a file never downloaded: the error names it.
    offline.allow_patterns = vec!["original/consolidated.00.pth".into()];
    offline.ignore_patterns.clear();
    let err = download_with_env(offline, &env(&tmp)).expect_err("not cached");
    assert!(matches!(err, HubError::NotCached { .. }));
    assert_eq!(
        err.to_string(),
        format!(
            "HF_HUB_OFFLINE=1 but original/consolidated.00.pth of org/model@main is not in the cache {}; run once without HF_HUB_OFFLINE to download it",
            cache.display()
        )
    );
}

#[test]
fn offline_without_any_snapshot_says_so() {
    let tmp = temp_dir("offline-empty");
    let mut options = opts(&refused_endpoint(), &tmp.path().join("hub"));
    options.offline = Some(true);
    let err = download_with_env(options, &env(&tmp)).expect_err("empty cache");
    assert!(
        err.to_string()
            .starts_with("HF_HUB_OFFLINE=1 but the snapshot of org/model@main is not in the cache")
    );
}

#[test]
fn unreachable_hub_falls_back_to_a_cached_snapshot() {
    let (server, _state) = fake_hub::start(vec![("models/org/model", model_repo())]);
    let tmp = temp_dir("fallback");
    let cache = tmp.path().join("hub");
    download_with_env(opts(&server.url(), &cache), &env(&tmp)).expect("download");
    drop(server);
    let report =
        download_with_env(opts(&refused_endpoint(), &cache), &env(&tmp)).expect("fallback");
    assert!(report.offline);
    assert_eq!(report.files.len(), 3);
}

/// A transfer cut short is an error, and leaves no partial file in the cache: nothing in the
/// snapshot, no blob, no `.incomplete`; the next download fetches the file whole.
#[test]
fn an_interrupted_download_leaves_no_partial_file() {
    let repo = FakeRepo {
        cut_lfs_after: Some(700),
        ..model_repo()
    };
    let (server, _state) = fake_hub::start(vec![("models/org/model", repo)]);
    let tmp = temp_dir("interrupted");
    let cache = tmp.path().join("hub");
    let mut options = opts(&server.url(), &cache);
    options.allow_patterns = vec!["model.safetensors".into()];
    let err = download_with_env(options.clone(), &env(&tmp)).expect_err("cut short");
    assert!(!err.to_string().is_empty());
    let repo_dir = cache.join("models--org--model");
    let leftovers: Vec<String> = walk(&repo_dir)
        .into_iter()
        .filter(|p| p.contains("blobs/") || p.contains("snapshots/"))
        .collect();
    assert!(leftovers.is_empty(), "{err}: {leftovers:?}");

    let report = download_with_env(options, &env(&tmp)).expect("rerun");
    assert_eq!(
        std::fs::read(report.snapshot_dir.join("model.safetensors")).expect("file"),
        weights(1400)
    );
}

/// Bytes that do not hash to the file's SHA-256 are refused and deleted, not cached.
#[test]
fn a_corrupted_download_is_detected_by_sha256_and_removed() {
    let repo = FakeRepo {
        corrupt_lfs: true,
        ..model_repo()
    };
    let (server, state) = fake_hub::start(vec![("models/org/model", repo)]);
    let tmp = temp_dir("corrupt");
    let cache = tmp.path().join("hub");
    let mut options = opts(&server.url(), &cache);
    options.allow_patterns = vec!["model.safetensors".into()];
    let err = download_with_env(options.clone(), &env(&tmp)).expect_err("corrupt");
    assert!(matches!(err, HubError::Corrupted { .. }), "{err}");
    let oid = sha256_hex(&weights(1400));
    let blobs = cache.join("models--org--model").join("blobs");
    assert!(!blobs.join(&oid).exists());
    // Whole bytes again: the rerun succeeds.
    state
        .lock()
        .expect("state")
        .repos
        .get_mut("models/org/model")
        .expect("repo")
        .corrupt_lfs = false;
    download_with_env(options, &env(&tmp)).expect("rerun");
    assert_eq!(
        std::fs::read(blobs.join(&oid)).expect("blob"),
        weights(1400)
    );
}

/// Every file under `dir`, as paths relative to it.
fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                pending.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap_or(&p).display().to_string());
            }
        }
    }
    out
}

#[test]
fn token_is_sent_as_bearer() {
    let repo = FakeRepo {
        token: Some(fake_hub::GOOD_TOKEN.into()),
        ..model_repo()
    };
    let (server, _state) = fake_hub::start(vec![("models/org/model", repo)]);
    let tmp = temp_dir("token");
    let mut options = opts(&server.url(), &tmp.path().join("hub"));
    options.token = Some(fake_hub::GOOD_TOKEN.into());
    options.allow_patterns = vec!["config.json".into()];
    download_with_env(options, &env(&tmp)).expect("with token");
    assert!(
        server
            .requests()
            .iter()
            .all(|r| r.header("authorization") == Some("Bearer hf_good"))
    );
}
