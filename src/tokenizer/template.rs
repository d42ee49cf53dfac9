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

/// What one conversation gives its template besides the messages, as TRL takes them from a
/// dataset row: `tools` (its `tools` column) and the keyword arguments of `apply_chat_template`
/// (its `chat_template_kwargs` column: gpt-oss's `reasoning_effort`, Qwen3's
/// `enable_thinking`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TemplateInputs {
    pub tools: Option<serde_json::Value>,
    pub kwargs: serde_json::Map<String, serde_json::Value>,
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
        env.add_filter("tojson", tojson);
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
    /// (what transformers >= 4.43 saves), then a processor's `chat_template.json` (the Hub's
    /// vision-language repos: what `AutoProcessor.apply_chat_template`, and TRL with it, renders),
    /// then `chat_template` in tokenizer_config.json (a string, or a list of `{name, template}`
    /// of which "default" is taken).
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
        // The processor's file, read as tokenizer_config.json's `chat_template` key is.
        let processor = dir.join("chat_template.json");
        let processor = if processor.is_file() {
            Some(JsonFile::read(&processor)?)
        } else {
            None
        };
        let stated = |cfg: &&JsonFile| cfg.value.get("chat_template").is_some_and(|t| !t.is_null());
        let Some(cfg) = processor.as_ref().filter(stated).or(tokenizer_config) else {
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

    /// Renders `messages` with a conversation's `inputs` (no tools and no keyword arguments by
    /// default).
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        vars: &TemplateVars,
        inputs: &TemplateInputs,
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
            tools => inputs.tools.as_ref().map_or(Value::from(()), Value::from_serialize),
            documents => Value::from(()),
            // As transformers' `**kwargs`; the names above stay what they are.
            ..Value::from_serialize(&inputs.kwargs)
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

/// `tojson` as transformers defines it for chat templates, `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)` with those keyword arguments: `", "` and
/// `": "` between items (`","` and newlines with `indent`), keys in the message's order, nothing
/// escaped for HTML. minijinja's own writes compact JSON with `<`, `>` and `&` escaped, so a tool
/// call's arguments (gpt-oss, Qwen3, Llama 3.1) rendered into other text and tokens.
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let invalid = |message: String| Error::new(ErrorKind::InvalidOperation, message);
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            (None, Some(text)) => Some(text.to_string()),
            _ => {
                return Err(invalid(format!(
                    "tojson: indent must be a number or a string, not {v}"
                )));
            }
        },
    };
    let (item, key) = match separators.as_deref() {
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
        Some([item, key]) => (item.clone(), key.clone()),
        Some(other) => {
            return Err(invalid(format!(
                "tojson: separators must be two strings, not {other:?}"
            )));
        }
    };
    let to_json = |e: serde_json::Error| invalid(format!("tojson: {e}"));
    let mut out = Vec::new();
    let mut writer = serde_json::Serializer::with_formatter(
        &mut out,
        PyJson {
            indent,
            item,
            key,
            level: 0,
            has_items: false,
        },
    );
    if sort_keys == Some(true) {
        // serde_json's own maps are sorted by key.
        let sorted = serde_json::to_value(&value).map_err(to_json)?;
        serde::Serialize::serialize(&sorted, &mut writer).map_err(to_json)?;
    } else {
        serde::Serialize::serialize(&value, &mut writer).map_err(to_json)?;
    }
    let text = String::from_utf8(out).map_err(|e| invalid(format!("tojson: {e}")))?;
    if ensure_ascii == Some(true) {
        let mut ascii = String::with_capacity(text.len());
        for c in text.chars() {
            if c.is_ascii() {
                ascii.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    ascii.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
        return Ok(Value::from(ascii));
    }
    Ok(Value::from(text))
}

/// Python's `json.dumps` layout: `item` between items, `key` after keys, and with an `indent`
/// each item on its own line (empty containers stay `[]` and `{}`).
struct PyJson {
    indent: Option<String>,
    item: String,
    key: String,
    level: usize,
    has_items: bool,
}

impl PyJson {
    fn open<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        bracket: &[u8],
    ) -> std::io::Result<()> {
        self.level += 1;
        self.has_items = false;
        w.write_all(bracket)
    }

    fn close<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        bracket: &[u8],
    ) -> std::io::Result<()> {
        self.level -= 1;
        if let Some(indent) = &self.indent
            && self.has_items
        {
            w.write_all(b"\n")?;
            w.write_all(indent.repeat(self.level).as_bytes())?;
        }
        self.has_items = true;
        w.write_all(bracket)
    }

    fn item<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            w.write_all(self.item.as_bytes())?;
        }
        if let Some(indent) = &self.indent {
            w.write_all(b"\n")?;
            w.write_all(indent.repeat(self.level).as_bytes())?;
        }
        Ok(())
    }
}

impl serde_json::ser::Formatter for PyJson {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.item(w, first)
    }
    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_items = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.item(w, first)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(self.key.as_bytes())
    }
    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_items = true;
        Ok(())
    }
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

    /// `tojson` writes what Python's `json.dumps` writes for transformers (the expected texts
    /// are its output): separators, indentation, key order, `sort_keys`, `ensure_ascii`, and no
    /// HTML escaping.
    #[test]
    fn tojson_writes_pythons_json() {
        let render = |expr: &str| {
            let source = format!(
                "{{% set v = {{\"b\": 1, \"a\": [1, 2.5, \"x<y&z é\"], \"c\": {{}}, \"d\": none, \"e\": true}} %}}{{{{ {expr} }}}}"
            );
            ChatTemplate::new(source, "test".into())
                .expect("compiles")
                .render(
                    &[],
                    false,
                    &TemplateVars::default(),
                    &TemplateInputs::default(),
                )
                .expect("renders")
        };
        assert_eq!(
            render("v | tojson"),
            r#"{"b": 1, "a": [1, 2.5, "x<y&z é"], "c": {}, "d": null, "e": true}"#
        );
        assert_eq!(
            render("v | tojson(indent=2)"),
            "{\n  \"b\": 1,\n  \"a\": [\n    1,\n    2.5,\n    \"x<y&z é\"\n  ],\n  \"c\": {},\n  \"d\": null,\n  \"e\": true\n}"
        );
        assert_eq!(
            render("v | tojson(sort_keys=true)"),
            r#"{"a": [1, 2.5, "x<y&z é"], "b": 1, "c": {}, "d": null, "e": true}"#
        );
        assert_eq!(
            render("v | tojson(separators=[\",\", \":\"])"),
            r#"{"b":1,"a":[1,2.5,"x<y&z é"],"c":{},"d":null,"e":true}"#
        );
        let bad = ChatTemplate::new("{{ 1 | tojson(indent=[1]) }}".into(), "test".into())
            .expect("compiles")
            .render(
                &[],
                false,
                &TemplateVars::default(),
                &TemplateInputs::default(),
            )
            .expect_err("indent");
        assert!(bad.to_string().contains("indent must be a number"), "{bad}");
        assert_eq!(
            render("v | tojson(ensure_ascii=true)"),
            r#"{"b": 1, "a": [1, 2.5, "x<y&z \u00e9"], "c": {}, "d": null, "e": true}"#
        );
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
                &TemplateInputs::default(),
            )
            .expect("renders");
        assert!(
            out.starts_with("hi|[{\"role\": \"system\", \"content\": \"  hi  \"}]|4"),
            "{out}"
        );
        let err = t
            .render(
                &[Message::user("x")],
                false,
                &TemplateVars::default(),
                &TemplateInputs::default(),
            )
            .expect_err("raises");
        assert!(err.to_string().contains("need system"), "{err}");
    }
}
