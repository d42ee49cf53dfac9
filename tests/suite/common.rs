//! Shared test helpers: temp dirs that mimic the repository's `assets/`.

use std::path::{Path, PathBuf};

use serde_yaml::Value;

/// A unique temp dir removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tune-config-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Self(dir)
    }

    pub fn touch(&self, rel: &str) -> PathBuf {
        let p = self.0.join(rel);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).expect("mkdir");
        }
        std::fs::write(&p, "{}").expect("write");
        p
    }

    pub fn path(&self, rel: &str) -> String {
        self.0.join(rel).display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A temp root holding the files the tiny configs name under `assets/`.
pub fn tiny_assets() -> TempDir {
    let t = TempDir::new("assets");
    for model in ["tiny-llama", "tiny-llama-teacher"] {
        for f in [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            t.touch(&format!("assets/{model}/{f}"));
        }
    }
    for f in [
        "alpaca_tiny.json",
        "hh_rlhf_tiny.json",
        "stack_exchange_paired_tiny.json",
        "alpaca_pairs_tiny.json",
    ] {
        t.touch(&format!("assets/data/{f}"));
    }
    t
}

/// Rewrites every string starting with `assets/` to live under `root`, so
/// relative asset paths resolve without changing the process's cwd.
pub fn rebase_assets(value: &mut Value, root: &Path) {
    match value {
        Value::String(s) if s.starts_with("assets/") => {
            *s = root.join(&*s).display().to_string();
        }
        Value::Mapping(m) => m.values_mut().for_each(|v| rebase_assets(v, root)),
        Value::Sequence(items) => items.iter_mut().for_each(|v| rebase_assets(v, root)),
        _ => {}
    }
}

pub fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}
