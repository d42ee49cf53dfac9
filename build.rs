//! Embeds every built-in config: each YAML file under `configs/` (its path less `.yaml` is its
//! name), so a new config is a new file and nothing else. Which recipe a config is for is its
//! first line's (`# Config for ... in lora_finetune_single_device.py`, torchtune's header).

use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=configs");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut configs = Vec::new();
    collect(&root, &root, &mut configs);
    configs.sort();
    let mut out = String::from("&[\n");
    for (name, path) in &configs {
        out.push_str(&format!("    ({name:?}, include_str!({path:?})),\n"));
    }
    out.push_str("]\n");
    let dest = Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join("builtin_configs.rs");
    std::fs::write(dest, out).expect("write the built-in config table");
}

fn collect(root: &Path, dir: &Path, out: &mut Vec<(String, String)>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "yaml") {
            let relative = path
                .strip_prefix(root)
                .expect("below configs/")
                .with_extension("");
            let name = relative
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            out.push((name, path.display().to_string()));
        }
    }
}
