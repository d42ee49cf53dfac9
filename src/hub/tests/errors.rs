use super::fake_hub::{self, FakeRepo};
use super::support::{refused_endpoint, temp_dir};
use crate::hub::download::{DownloadOptions, download_with_env};
use crate::hub::env::HubEnv;
use crate::hub::error::HubError;

fn run(endpoint: &str, repo_id: &str, token: Option<&str>, revision: Option<&str>) -> HubError {
    let tmp = temp_dir("errors");
    let options = DownloadOptions {
        repo_id: repo_id.into(),
        endpoint: Some(endpoint.into()),
        cache_dir: Some(tmp.path().join("hub")),
        token: token.map(str::to_string),
        revision: revision.map(str::to_string),
        offline: Some(false),
        ..DownloadOptions::default()
    };
    download_with_env(options, &HubEnv::isolated(tmp.path().join("home"))).expect_err("must fail")
}

fn repos() -> Vec<(&'static str, FakeRepo)> {
    let file = vec![("config.json".to_string(), b"{}".to_vec())];
    vec![
        (
            "models/org/private",
            FakeRepo {
                files: file.clone(),
                token: Some(fake_hub::GOOD_TOKEN.into()),
                ..FakeRepo::default()
            },
        ),
        (
            "models/meta/gated",
            FakeRepo {
                files: file.clone(),
                gated: true,
                ..FakeRepo::default()
            },
        ),
        (
            "models/org/model",
            FakeRepo {
                files: file,
                ..FakeRepo::default()
            },
        ),
    ]
}

#[test]
fn unauthorized_says_the_token_is_invalid() {
    let (server, _state) = fake_hub::start(repos());
    let err = run(&server.url(), "org/private", Some("hf_expired"), None);
    assert!(matches!(err, HubError::AuthFailed));
    assert_eq!(
        err.to_string(),
        "authentication failed: the token is invalid or expired; set HF_TOKEN or pass --hf-token"
    );
}

#[test]
fn missing_repo_is_not_found() {
    let (server, _state) = fake_hub::start(repos());
    let err = run(&server.url(), "org/nope", None, None);
    assert_eq!(
        err.to_string(),
        "repo org/nope not found (or private: pass a token)"
    );
}

#[test]
fn missing_revision_is_named() {
    let (server, _state) = fake_hub::start(repos());
    let err = run(&server.url(), "org/model", None, Some("v9"));
    assert_eq!(
        err.to_string(),
        "revision v9 not found in repo org/model: check the branch, tag or commit name"
    );
}

#[test]
fn gated_repo_points_at_the_license_page() {
    let (server, _state) = fake_hub::start(repos());
    let err = run(&server.url(), "meta/gated", None, None);
    assert_eq!(
        err.to_string(),
        format!(
            "repo meta/gated is gated: accept its license at {}/meta/gated and use a token with access",
            server.url()
        )
    );
}

#[test]
fn refused_connection_suggests_offline_mode() {
    let endpoint = refused_endpoint();
    let err = run(&endpoint, "org/model", None, None);
    let message = err.to_string();
    assert!(matches!(err, HubError::Unreachable { .. }));
    assert!(
        message.starts_with(&format!("cannot reach {endpoint}: ")),
        "{message}"
    );
    assert!(
        message.ends_with("; check your network or set HF_HUB_OFFLINE=1 to use cached files"),
        "{message}"
    );
    assert!(message.to_lowercase().contains("refused"), "{message}");
}

#[test]
fn bad_inputs_fail_before_any_request() {
    let err = run("ftp://example", "org/model", None, None);
    assert!(matches!(err, HubError::InvalidEndpoint { .. }), "{err}");
    let err = run(&refused_endpoint(), "org/../x", None, None);
    assert!(matches!(err, HubError::InvalidRepoId { .. }), "{err}");
}
