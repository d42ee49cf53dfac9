use std::collections::HashMap;
use std::path::PathBuf;

use super::support::temp_dir;
use crate::hub::env::{DEFAULT_ENDPOINT, HubEnv};

fn env(vars: &[(&str, &str)]) -> HubEnv {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    HubEnv::from_lookup(|name| map.get(name).cloned())
}

#[test]
fn defaults_follow_huggingface_hub() {
    let e = env(&[("HOME", "/home/u")]);
    assert_eq!(e.endpoint, DEFAULT_ENDPOINT);
    assert_eq!(e.cache_dir, PathBuf::from("/home/u/.cache/huggingface/hub"));
    assert_eq!(
        e.token_path,
        PathBuf::from("/home/u/.cache/huggingface/token")
    );
    assert_eq!(e.token, None);
    assert!(!e.offline);
    let e = env(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/xdg")]);
    assert_eq!(e.cache_dir, PathBuf::from("/xdg/huggingface/hub"));
}

#[test]
fn variables_override_defaults() {
    let e = env(&[
        ("HOME", "/home/u"),
        ("HF_HOME", "/hf"),
        ("HF_ENDPOINT", "http://mirror.local/"),
        ("HF_TOKEN", " hf_x "),
        ("HF_HUB_OFFLINE", "1"),
        ("HF_HUB_DISABLE_PROGRESS_BARS", "true"),
    ]);
    assert_eq!(e.endpoint, "http://mirror.local");
    assert_eq!(e.cache_dir, PathBuf::from("/hf/hub"));
    assert_eq!(e.token_path, PathBuf::from("/hf/token"));
    assert_eq!(e.token.as_deref(), Some("hf_x"));
    assert!(e.offline && e.disable_progress);
    let e = env(&[
        ("HF_HOME", "/hf"),
        ("HF_HUB_CACHE", "/cache"),
        ("HF_HUB_OFFLINE", "0"),
    ]);
    assert_eq!(e.cache_dir, PathBuf::from("/cache"));
    assert!(!e.offline);
    let e = env(&[
        ("HUGGINGFACE_HUB_CACHE", "/legacy"),
        ("HUGGING_FACE_HUB_TOKEN", "hf_old"),
    ]);
    assert_eq!(e.cache_dir, PathBuf::from("/legacy"));
    assert_eq!(e.token.as_deref(), Some("hf_old"));
}

#[test]
fn token_priority_is_option_then_env_then_file() {
    let tmp = temp_dir("token-file");
    std::fs::write(tmp.path().join("token"), "hf_file\n").expect("token file");
    let home = tmp.path().to_string_lossy().into_owned();
    let with_env = env(&[("HF_HOME", &home), ("HF_TOKEN", "hf_env")]);
    assert_eq!(
        with_env.resolve_token(Some("hf_opt")).as_deref(),
        Some("hf_opt")
    );
    assert_eq!(with_env.resolve_token(None).as_deref(), Some("hf_env"));
    let file_only = env(&[("HF_HOME", &home)]);
    assert_eq!(file_only.resolve_token(None).as_deref(), Some("hf_file"));
    assert_eq!(
        file_only.resolve_token(Some("  ")).as_deref(),
        Some("hf_file")
    );
    let nothing = HubEnv::isolated(tmp.path().join("elsewhere"));
    assert_eq!(nothing.resolve_token(None), None);
    assert_eq!(
        nothing.resolve_endpoint(Some("http://127.0.0.1:9/")),
        "http://127.0.0.1:9"
    );
}
