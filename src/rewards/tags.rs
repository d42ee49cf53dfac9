//! The string operations torchtune's rewards are written with, with Python's semantics: the
//! first `<tag>(.*?)</tag>` match (`re.search` with `re.DOTALL`) and `str.strip()`.

/// The text between the first `<tag>` and the first `</tag>` after it, as
/// `re.search(r"<tag>(.*?)</tag>", text, re.DOTALL).group(1)`: the leftmost `<tag>` that has a
/// `</tag>` after it is the first `<tag>` (any later one would have the same `</tag>`), and the
/// lazy group ends at the first `</tag>` after it. `None` when there is no match.
pub fn first_tag<'a>(text: &'a str, tag: &str) -> Option<&'a str> {
    let open = format!("<{tag}>");
    let close = format!("</{tag}>");
    let start = text.find(&open)? + open.len();
    let len = text[start..].find(&close)?;
    Some(&text[start..start + len])
}

/// Python's `str.strip()`: removes leading and trailing characters that `str.isspace()` calls
/// whitespace. That is Rust's `char::is_whitespace` plus the four information separators
/// U+001C..U+001F, which Python counts as whitespace and Unicode does not.
pub fn py_strip(text: &str) -> &str {
    text.trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_tag_ends_at_the_first_closing_tag() {
        assert_eq!(first_tag("<a>1</a><a>2</a>", "a"), Some("1"));
        assert_eq!(first_tag("<a><a>1</a></a>", "a"), Some("<a>1"));
        assert_eq!(first_tag("</a><a>x", "a"), None);
        assert_eq!(
            first_tag("<a>\nmulti\nline</a>", "a"),
            Some("\nmulti\nline")
        );
    }

    #[test]
    fn strip_removes_what_python_calls_whitespace() {
        assert_eq!(py_strip("\u{1f} 72\u{a0}\u{3000}\n"), "72");
        assert_eq!(py_strip("\u{200b}72"), "\u{200b}72"); // zero-width space: not whitespace
    }
}
