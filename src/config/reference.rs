//! The config reference, derived from the key declarations: every key a recipe reads, by
//! dotted path, with its type, default, range, aliases and doc line. `tune validate --explain
//! KEY` prints one key's entries, and `docs/config-reference.md` is [`markdown`]'s output
//! (a test regenerates it and fails when the committed file differs, as ripgrep's man page is
//! made from its flags).

use std::fmt::Write;

use serde_yaml::Value;

use crate::config::components;
use crate::config::keys::{Effect, Fingerprint, KeyInfo, Note, Ty, expected, join};
use crate::config::recipes::RecipeSpec;

/// One key at one path: its declaration, and the components whose section has it when the
/// section is a choice (`loss.beta` is `tune.loss.DPOLoss`'s).
#[derive(Debug, Clone)]
pub struct Entry {
    pub path: String,
    pub key: &'static KeyInfo,
    /// The choice's variant the key belongs to, in words.
    pub under: Option<&'static str>,
}

/// Every key `recipe` reads, sections entered (a list of sections as its items' keys, a group
/// in its parent's place, every variant of a choice).
pub fn entries(recipe: &RecipeSpec) -> Vec<Entry> {
    let mut out = Vec::new();
    for key in recipe.top_keys() {
        walk("", key, None, &mut Walk::All, &mut out);
    }
    out
}

/// The keys `recipe` reads as the config `root` writes them: a choice's keys are its chosen
/// component's, and a choice the config leaves out is not entered.
pub fn entries_for(recipe: &RecipeSpec, root: &Value) -> Vec<Entry> {
    let mut out = Vec::new();
    for key in recipe.top_keys() {
        walk("", key, None, &mut Walk::Config(root), &mut out);
    }
    out
}

/// Which variants of a choice a walk enters.
enum Walk<'a> {
    All,
    /// The one the config's `_component_` picks.
    Config(&'a Value),
}

fn walk(
    prefix: &str,
    key: &'static KeyInfo,
    under: Option<&'static str>,
    how: &mut Walk,
    out: &mut Vec<Entry>,
) {
    if let Ty::Group(group) = key.ty {
        for inner in group.keys {
            walk(prefix, inner, under, how, out);
        }
        return;
    }
    let path = join(prefix, key.name);
    out.push(Entry {
        path: path.clone(),
        key,
        under,
    });
    enter(&path, key.ty, under, how, out);
}

fn enter(
    path: &str,
    ty: &'static Ty,
    under: Option<&'static str>,
    how: &mut Walk,
    out: &mut Vec<Entry>,
) {
    match ty {
        Ty::Section(s) | Ty::OneOrMany(s) => {
            for inner in s.keys {
                walk(path, inner, under, how, out);
            }
        }
        Ty::Nullable(inner) => enter(path, inner, under, how, out),
        Ty::Either(a, b) => {
            enter(path, a, under, how, out);
            enter(path, b, under, how, out);
        }
        Ty::Choice(choice) => {
            let picked = match how {
                Walk::All => None,
                Walk::Config(root) => {
                    let component = crate::config::yaml::get(root, &join(path, "_component_"))
                        .and_then(Value::as_str)
                        .and_then(|name| components::lookup(name, Some(choice.kind)).ok())
                        .and_then(|found| (choice.variant_of)(&found.component));
                    match component {
                        Some(index) => Some(index),
                        None => return,
                    }
                }
            };
            for (index, variant) in choice.variants.iter().enumerate() {
                if picked.is_some_and(|p| p != index) {
                    continue;
                }
                for inner in variant.keys {
                    walk(path, inner, Some(variant.label), how, out);
                }
            }
        }
        _ => {}
    }
}

/// The entries of `path` (dotted, as a config writes it) in every recipe of `registry`, each
/// with the recipes that read it; several when a choice's components or recipes declare it
/// differently.
pub fn explain(registry: &[&'static RecipeSpec], path: &str) -> Vec<(Entry, Vec<&'static str>)> {
    let mut found: Vec<(Entry, Vec<&'static str>)> = Vec::new();
    for recipe in registry {
        for entry in entries(recipe).into_iter().filter(|e| e.path == path) {
            match found
                .iter_mut()
                .find(|(e, _)| std::ptr::eq(e.key, entry.key) && e.under == entry.under)
            {
                Some((_, recipes)) => recipes.push(recipe.name),
                None => found.push((entry, vec![recipe.name])),
            }
        }
    }
    found
}

/// The paths of every key of every recipe, for "did you mean" when `--explain` finds none.
pub fn all_paths(registry: &[&'static RecipeSpec]) -> Vec<String> {
    let mut paths: Vec<String> = registry
        .iter()
        .flat_map(|r| entries(r).into_iter().map(|e| e.path))
        .collect();
    paths.sort();
    paths.dedup();
    paths
}

/// One entry as `--explain` prints it.
pub fn describe(entry: &Entry, recipes: &[&str]) -> String {
    let key = entry.key;
    let mut s = String::new();
    let _ = writeln!(s, "{}", entry.path);
    if let Some(under) = entry.under {
        let _ = writeln!(s, "  of:        {under}");
    }
    let _ = writeln!(s, "  type:      {}", type_name(key.ty));
    let _ = writeln!(s, "  default:   {}", default_text(key));
    if let Some(range) = key.spec.range {
        let _ = writeln!(s, "  range:     {range}");
    }
    if !key.spec.aliases.is_empty() {
        let _ = writeln!(s, "  also read: {}", key.spec.aliases.join(", "));
    }
    if let Some(note) = note_text(key) {
        let _ = writeln!(s, "  note:      {note}");
    }
    let _ = writeln!(s, "  recipes:   {}", recipes.join(", "));
    let _ = writeln!(
        s,
        "  fingerprint: {}",
        fingerprint_text(key.spec.fingerprint)
    );
    for line in key.doc.lines() {
        let _ = writeln!(s, "  {}", line.trim());
    }
    s
}

/// The type in words (a section names its component kind).
pub fn type_name(ty: &Ty) -> String {
    match ty {
        Ty::Section(s) => match s.component {
            Some(kind) => format!("section: a {kind} (`_component_`) and its keys"),
            None => format!("section `{}`", s.name),
        },
        Ty::Choice(c) => format!("section: a {} (`_component_`: {})", c.kind, c.takes()),
        Ty::Nullable(inner) => format!("{} or null", type_name(inner)),
        other => expected(other),
    }
}

fn default_text(key: &KeyInfo) -> String {
    if matches!(key.ty, Ty::Section(_) | Ty::Choice(_) | Ty::OneOrMany(_)) && key.spec.is_required()
    {
        return "required".into();
    }
    match key.spec.default {
        None => "required".into(),
        Some(_) => match key.spec.default_value() {
            None | Some(serde_json::Value::Null) => "null (unset)".into(),
            Some(v) => v.to_string(),
        },
    }
}

fn note_text(key: &KeyInfo) -> Option<String> {
    match (key.spec.note, key.spec.effect) {
        (Note::Warn(w), _) => Some(format!("warned about when set: {w}")),
        (Note::Refuse(r), _) => Some(format!("only null, false, 0 or empty: {r}")),
        (Note::None, Effect::ValidationOnly(why)) => Some(format!("checked, not read: {why}")),
        (Note::None, Effect::Read) => None,
    }
}

fn fingerprint_text(f: Fingerprint) -> &'static str {
    match f {
        Fingerprint::Inherit => "as its section",
        Fingerprint::Yes => "yes (a resume must keep it)",
        Fingerprint::ResumeMayChange => "yes, but a resume may change it",
    }
}

/// The whole reference as Markdown: per recipe, its keys in declaration order.
pub fn markdown(registry: &[&'static RecipeSpec]) -> String {
    let mut s = String::new();
    s.push_str("# Config reference\n\n");
    s.push_str(
        "Every key each recipe reads, made from the key declarations in `src/config/schema` and\n",
    );
    s.push_str("the recipes' files (`recipes/`). Do not edit: `TUNE_UPDATE_DOCS=1 cargo test --test suite\n");
    s.push_str(
        "docs::` regenerates it, and the suite fails when it is out of date. `tune validate\n",
    );
    s.push_str("--explain KEY` prints one key.\n\n");
    s.push_str(
        "A section picked by a `_component_` lists the keys of each component it takes; a key\n",
    );
    s.push_str("of another component is refused by name.\n\n");
    for recipe in registry {
        let _ = writeln!(s, "- [{}](#{})", recipe.name, recipe.name.replace('_', "-"));
    }
    s.push('\n');
    for recipe in registry {
        let names: Vec<&str> = std::iter::once(recipe.name)
            .chain(recipe.aliases.iter().copied())
            .chain(recipe.distributed)
            .collect();
        let _ = writeln!(s, "## {}\n", recipe.name);
        let _ = writeln!(s, "{}. Run as: {}.\n", recipe.description, names.join(", "));
        s.push_str("| key | type | default | doc |\n| --- | --- | --- | --- |\n");
        for entry in entries(recipe) {
            let key = entry.key;
            let mut doc = key.doc.split_whitespace().collect::<Vec<_>>().join(" ");
            if let Some(under) = entry.under {
                doc = format!("({under}) {doc}");
            }
            if let Some(range) = key.spec.range {
                doc.push_str(&format!(" Range: {range}."));
            }
            if !key.spec.aliases.is_empty() {
                doc.push_str(&format!(
                    " Also read from: {}.",
                    key.spec.aliases.join(", ")
                ));
            }
            if let Some(note) = note_text(key) {
                doc.push_str(&format!(" Note: {note}."));
            }
            let _ = writeln!(
                s,
                "| `{}` | {} | {} | {} |",
                entry.path,
                cell(&type_name(key.ty)),
                cell(&default_text(key)),
                cell(&doc)
            );
        }
        s.push('\n');
    }
    s
}

/// Text in a Markdown table cell.
fn cell(text: &str) -> String {
    text.replace('|', "\\|")
}
