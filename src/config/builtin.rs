//! Built-in configs: every YAML file under `configs/`, embedded at build time (`build.rs`).
//! A config's recipe is the torchtune script its first line names, as in torchtune's own
//! configs (`# Config for ... in lora_finetune_single_device.py`); `recipes::builtin_recipe`
//! resolves it.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuiltinConfig {
    /// `<family>/<name>` without `.yaml`, e.g. `llama3_2/1B_lora_single_device`.
    pub name: &'static str,
    pub yaml: &'static str,
}

static BUILTINS: &[(&str, &str)] = include!(concat!(env!("OUT_DIR"), "/builtin_configs.rs"));

impl BuiltinConfig {
    /// The words of its first line (`# Config for ... in lora_finetune_single_device.py`),
    /// among which is the script it is for.
    pub fn header_words(&self) -> impl Iterator<Item = &'static str> {
        self.yaml
            .lines()
            .next()
            .filter(|l| l.starts_with('#'))
            .into_iter()
            .flat_map(str::split_whitespace)
            .map(|w| w.trim_end_matches([',', ':', ')']))
    }
}

/// Every built-in config, sorted by name.
pub fn list() -> Vec<BuiltinConfig> {
    BUILTINS
        .iter()
        .map(|&(name, yaml)| BuiltinConfig { name, yaml })
        .collect()
}

/// A built-in config by name; a trailing `.yaml` is ignored.
pub fn get(name: &str) -> Option<BuiltinConfig> {
    let bare = name.trim().trim_end_matches(".yaml");
    list().into_iter().find(|b| b.name == bare)
}
