//! Allow/ignore filtering with Python `fnmatch` semantics, as
//! `huggingface_hub.utils.filter_repo_objects` applies them: `*` also matches
//! `/`, and a pattern ending in `/` matches everything under that folder.

/// Matches `name` against one fnmatch pattern (`*`, `?`, `[abc]`, `[!abc]`).
pub fn fnmatch(pattern: &str, name: &str) -> bool {
    let pattern: Vec<char> = pattern.chars().collect();
    let name: Vec<char> = name.chars().collect();
    matches_at(&pattern, &name)
}

fn matches_at(pattern: &[char], name: &[char]) -> bool {
    // Iterative matcher with backtracking on the last `*`.
    let (mut p, mut n) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while n < name.len() {
        if p < pattern.len() {
            match pattern[p] {
                '*' => {
                    star = Some((p, n));
                    p += 1;
                    continue;
                }
                '?' => {
                    p += 1;
                    n += 1;
                    continue;
                }
                '[' => {
                    if let Some((matched, next)) = match_class(pattern, p, name[n]) {
                        if matched {
                            p = next;
                            n += 1;
                            continue;
                        }
                    } else if name[n] == '[' {
                        // Unclosed '[' is a literal.
                        p += 1;
                        n += 1;
                        continue;
                    }
                }
                c if c == name[n] => {
                    p += 1;
                    n += 1;
                    continue;
                }
                _ => {}
            }
        }
        match star {
            Some((star_p, star_n)) => {
                p = star_p + 1;
                n = star_n + 1;
                star = Some((star_p, star_n + 1));
            }
            None => return false,
        }
    }
    pattern[p..].iter().all(|&c| c == '*')
}

/// Matches `c` against the class starting at `pattern[start] == '['`;
/// returns (matched, index after `]`), or None when the class is unclosed.
fn match_class(pattern: &[char], start: usize, c: char) -> Option<(bool, usize)> {
    let mut i = start + 1;
    let negate = matches!(pattern.get(i), Some('!'));
    if negate {
        i += 1;
    }
    let first = i;
    let mut matched = false;
    while i < pattern.len() {
        if pattern[i] == ']' && i > first {
            return Some((matched != negate, i + 1));
        }
        if i + 2 < pattern.len() && pattern[i + 1] == '-' && pattern[i + 2] != ']' {
            if pattern[i] <= c && c <= pattern[i + 2] {
                matched = true;
            }
            i += 3;
        } else {
            if pattern[i] == c {
                matched = true;
            }
            i += 1;
        }
    }
    None
}

fn normalize(pattern: &str) -> String {
    if pattern.ends_with('/') {
        format!("{pattern}*")
    } else {
        pattern.to_string()
    }
}

/// True when `path` passes the filters: it matches one allow pattern (or there
/// are none) and no ignore pattern.
pub fn is_selected(path: &str, allow: &[String], ignore: &[String]) -> bool {
    let allowed = allow.is_empty() || allow.iter().any(|p| fnmatch(&normalize(p), path));
    allowed && !ignore.iter().any(|p| fnmatch(&normalize(p), path))
}

/// True when the pattern has no wildcard, i.e. names one file.
pub fn is_literal(pattern: &str) -> bool {
    !pattern.contains(['*', '?', '[']) && !pattern.ends_with('/')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnmatch_like_python() {
        assert!(fnmatch("*.pth", "consolidated.00.pth"));
        assert!(fnmatch("*.pth", "original/consolidated.00.pth"));
        assert!(fnmatch("original/*", "original/params.json"));
        assert!(!fnmatch("original/*", "config.json"));
        assert!(fnmatch(
            "model-0000?-of-00002.safetensors",
            "model-00001-of-00002.safetensors"
        ));
        assert!(fnmatch("[!a]*.json", "config.json"));
        assert!(!fnmatch("[!c]*.json", "config.json"));
        assert!(fnmatch("[a-d]onfig.json", "config.json"));
        assert!(fnmatch("a[b", "a[b"));
        assert!(!fnmatch("*.json", "config.jsonl"));
        assert!(fnmatch("**", ""));
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
