//! Allow/ignore filtering of repo paths, with the globs hf-hub 1.0 uses (`globset`, where `*`
//! also matches `/`, as Python's `fnmatch` in `huggingface_hub`), plus huggingface_hub's rule
//! that a pattern ending in `/` selects everything under that folder (hf-hub lacks it, so
//! patterns are normalised before they are handed over).

/// `original/` -> `original/*`; other patterns unchanged.
pub fn normalize(pattern: &str) -> String {
    if pattern.ends_with('/') {
        format!("{pattern}*")
    } else {
        pattern.to_string()
    }
}

/// Whether `path` matches `pattern`; a pattern globset cannot parse (`a[b`) matches itself.
pub fn glob_match(pattern: &str, path: &str) -> bool {
    match globset::Glob::new(&normalize(pattern)) {
        Ok(glob) => glob.compile_matcher().is_match(path),
        Err(_) => pattern == path,
    }
}

/// True when `path` passes the filters: it matches one allow pattern (or there
/// are none) and no ignore pattern.
pub fn is_selected(path: &str, allow: &[String], ignore: &[String]) -> bool {
    let allowed = allow.is_empty() || allow.iter().any(|p| glob_match(p, path));
    allowed && !ignore.iter().any(|p| glob_match(p, path))
}

/// True when the pattern has no wildcard, i.e. names one file.
pub fn is_literal(pattern: &str) -> bool {
    !pattern.contains(['*', '?', '[']) && !pattern.ends_with('/')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_like_huggingface_hub() {
        assert!(glob_match("*.pth", "consolidated.00.pth"));
        assert!(glob_match("*.pth", "original/consolidated.00.pth"));
        assert!(glob_match("original/*", "original/params.json"));
        assert!(glob_match("original/", "original/sub/params.json"));
        assert!(!glob_match("original/*", "config.json"));
        assert!(glob_match(
            "model-0000?-of-00002.safetensors",
            "model-00001-of-00002.safetensors"
        ));
        assert!(glob_match("[!a]*.json", "config.json"));
        assert!(!glob_match("[!c]*.json", "config.json"));
        assert!(glob_match("[a-d]onfig.json", "config.json"));
        assert!(glob_match("a[b", "a[b"));
        assert!(!glob_match("*.json", "config.jsonl"));
    }

    #[test]
    fn allow_and_ignore() {
        let ignore = vec!["*.pth".to_string(), "original/".to_string()];
        assert!(is_selected("config.json", &[], &ignore));
        assert!(!is_selected("original/tokenizer.model", &[], &ignore));
        assert!(!is_selected("x.pth", &[], &ignore));
        let allow = vec!["*.json".to_string()];
        assert!(!is_selected("model.safetensors", &allow, &[]));
        assert!(is_literal("data/train.jsonl"));
        assert!(!is_literal("data/*.jsonl"));
    }
}
