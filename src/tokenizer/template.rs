//! Chat templates rendered with minijinja configured like transformers' Jinja environment:
//! `trim_blocks` and `lstrip_blocks` on, no trailing newline kept, `raise_exception`,
//! `strftime_now`, `tojson`, Python string/dict methods (`.strip()`, `.items()`, ...).
use super::error::{Result, TokenizerError};
use super::message::Message;
use super::special::JsonFile;
use minijinja::{Environment, Error, ErrorKind, Value, context};
use std::path::Path;

const NAME: &str = "chat_template";

/// A compiled chat template.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    origin: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .finish()
    }
}

/// Values the template sees besides `messages` and `add_generation_prompt`.
#[derive(Debug, Clone, Default)]
pub struct TemplateVars {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
    pub unk_token: Option<String>,
    /// The Unix time `strftime_now` renders, in place of the clock.
    pub render_time: Option<i64>,
}

impl ChatTemplate {
    /// Compiles `source`; `origin` names where it came from for error messages.
    pub fn new(source: String, origin: String) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, source.clone()).map_err(|e| {
            TokenizerError::TemplateSyntax {
                origin: origin.clone(),
                message: describe(&e),
            }
        })?;
        Ok(ChatTemplate {
            env,
            source,
            origin,
        })
    }

    /// Finds the template of a checkpoint folder: `chat_template.jinja` beside the tokenizer
    /// (what transformers >= 4.43 saves) wins over `chat_template` in tokenizer_config.json
    /// (a string, or a list of `{name, template}` of which "default" is taken).
    pub(crate) fn discover(
        dir: &Path,
        tokenizer_config: Option<&JsonFile>,
    ) -> Result<Option<Self>> {
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let source = std::fs::read_to_string(&jinja).map_err(|source| TokenizerError::Io {
                path: jinja.clone(),
                source,
            })?;
            return Self::new(source, jinja.display().to_string()).map(Some);
        }
        let Some(cfg) = tokenizer_config else {
            return Ok(None);
        };
        let origin = format!("{} (key chat_template)", cfg.path.display());
        match cfg.value.get("chat_template") {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Self::new(s.clone(), origin).map(Some),
            Some(serde_json::Value::Array(list)) => {
                let mut names = Vec::new();
                for item in list {
                    let name = item.get("name").and_then(|v| v.as_str()).unwrap_or("");
                    if name == "default"
                        && let Some(t) = item.get("template").and_then(|v| v.as_str())
                    {
                        return Self::new(t.to_string(), format!("{origin}, \"default\""))
                            .map(Some);
                    }
                    names.push(name.to_string());
                }
                Err(TokenizerError::NoDefaultTemplate {
                    path: cfg.path.clone(),
                    names: names.join(", "),
                })
            }
            Some(other) => Err(TokenizerError::BadConfigValue {
                path: cfg.path.clone(),
                key: "chat_template".into(),
                expected: "a string or a list of {name, template}",
                found: other.to_string().chars().take(80).collect(),
            }),
        }
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Renders `messages`; `tools` is none.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        vars: &TemplateVars,
    ) -> Result<String> {
        let err = |e: Error| TokenizerError::TemplateRender {
            origin: self.origin.clone(),
            message: describe(&e),
        };
        let tmpl = self.env.get_template(NAME).map_err(err)?;
        let base = context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => vars.bos_token.clone().unwrap_or_default(),
            eos_token => vars.eos_token.clone().unwrap_or_default(),
            pad_token => vars.pad_token.clone(),
            unk_token => vars.unk_token.clone(),
            tools => Value::from(()),
            documents => Value::from(()),
        };
        // A context value shadows the environment's function of the same name.
        let ctx = match vars.render_time {
            Some(time) => context! {
                strftime_now => Value::from_function(move |format: String| format_time(time, &format)),
                ..base
            },
            None => base,
        };
        tmpl.render(ctx).map_err(err)
    }
}

/// The error with its chain of causes on one line.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC time, formatted with the common strftime codes
/// (%Y %m %d %e %H %M %S %y %B %b %A %a %j %p %I %%); a render with
/// `TemplateVars::render_time` writes that time instead.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    format_time(secs, &format)
}

pub(crate) fn format_time(unix_secs: i64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let sod = unix_secs.rem_euclid(86_400);
    let (h, mi, s) = (sod / 3600, (sod % 3600) / 60, sod % 60);
    // civil_from_days (Howard Hinnant)
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let wd = days.rem_euclid(7) as usize;
    let month = MONTHS[(m - 1) as usize];
    let day = DAYS[wd];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('I') => out.push_str(&format!("{:02}", if h % 12 == 0 { 12 } else { h % 12 })),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{mi:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('A') => out.push_str(day),
            Some('a') => out.push_str(&day[..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_dates() {
        // 2024-07-26 13:05:09 UTC was a Friday
        assert_eq!(
            format_time(1_722_000_309, "%d %B %Y %H:%M:%S %a %j"),
            "26 July 2024 13:25:09 Fri 208"
        );
        assert_eq!(format_time(0, "%Y-%m-%d %A"), "1970-01-01 Thursday");
    }

    #[test]
    fn transformers_features() {
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] != 'system' %}{{ raise_exception('need system') }}{% endif %}\
             {{ messages[0].content.strip() }}|{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
                .to_string(),
            "test".into(),
        )
        .expect("compiles");
        let out = t
            .render(
                &[Message::system("  hi  ")],
                false,
                &TemplateVars::default(),
            )
            .expect("renders");
        assert!(
            out.starts_with("hi|[{\"role\":\"system\",\"content\":\"  hi  \"}]|4"),
            "{out}"
        );
        let err = t
            .render(&[Message::user("x")], false, &TemplateVars::default())
            .expect_err("raises");
        assert!(err.to_string().contains("need system"), "{err}");
    }
}
