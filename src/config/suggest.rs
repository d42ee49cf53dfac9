//! "Did you mean ...?" suggestions, ranked by Jaro-Winkler similarity (strsim).

/// Up to three candidates similar to `input`, best first.
pub fn similar<'a, I>(input: &str, candidates: I) -> Vec<String>
where
    I: IntoIterator<Item = &'a str>,
{
    let lower = input.to_ascii_lowercase();
    let mut scored: Vec<(f64, &str)> = candidates
        .into_iter()
        .map(|c| (strsim::jaro_winkler(&lower, &c.to_ascii_lowercase()), c))
        .filter(|(score, _)| *score >= 0.75)
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    // Only offer names about as close as the best one: one clear match beats a list.
    let best = scored.first().map_or(0.0, |s| s.0);
    scored.retain(|(score, _)| *score >= best - 0.05);
    let mut out: Vec<String> = Vec::new();
    for (_, c) in scored {
        if !out.iter().any(|o| o == c) {
            out.push(c.to_string());
        }
        if out.len() == 3 {
            break;
        }
    }
    out
}

/// `" (did you mean `a` or `b`?)"`, or an empty string when nothing is close.
pub fn did_you_mean(suggestions: &[String]) -> String {
    match suggestions {
        [] => String::new(),
        [one] => format!("did you mean `{one}`?"),
        many => {
            let quoted: Vec<String> = many.iter().map(|s| format!("`{s}`")).collect();
            format!("did you mean one of {}?", quoted.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_close_names_first() {
        let s = similar("lora_rnak", ["lora_rank", "lora_alpha", "epochs"]);
        assert_eq!(s.first().map(String::as_str), Some("lora_rank"));
        assert_eq!(did_you_mean(&s[..1]), "did you mean `lora_rank`?");
        assert!(similar("zzzz", ["lora_rank"]).is_empty());
    }
}
