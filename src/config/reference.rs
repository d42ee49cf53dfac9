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
    /// How many variants that choice has (0 outside a choice).
    pub variants: usize,
    /// Whether it is in the run's fingerprint (its own declaration's, or its section's).
    pub fingerprint: Fingerprint,
}

/// Every key `recipe` reads, sections entered (a list of sections as its items' keys, a group
/// in its parent's place, every variant of a choice).
pub fn entries(recipe: &RecipeSpec) -> Vec<Entry> {
    let mut out = Vec::new();
    for key in recipe.top_keys() {
        walk(
            "",
            key,
            (None, 0, Fingerprint::Inherit),
            &mut Walk::All,
            &mut out,
        );
    }
    out
}

/// The keys `recipe` reads as the config `root` writes them: a choice's keys are its chosen
/// component's, and a choice the config leaves out is not entered.
pub fn entries_for(recipe: &RecipeSpec, root: &Value) -> Vec<Entry> {
    let mut out = Vec::new();
    for key in recipe.top_keys() {
        walk(
            "",
            key,
            (None, 0, Fingerprint::Inherit),
            &mut Walk::Config(root),
            &mut out,
        );
    }
    out
}

/// Which variants of a choice a walk enters.
enum Walk<'a> {
    All,
    /// The one the config's `_component_` picks.
    Config(&'a Value),
}

/// A variant of a choice, how many the choice has, and the section's fingerprint mode.
type Under = (Option<&'static str>, usize, Fingerprint);

fn walk(prefix: &str, key: &'static KeyInfo, under: Under, how: &mut Walk, out: &mut Vec<Entry>) {
    let fingerprint = match key.spec.fingerprint {
        Fingerprint::Inherit => under.2,
        own => own,
    };
    if let Ty::Group(group) = key.ty {
        for inner in group.keys {
            walk(prefix, inner, (under.0, under.1, fingerprint), how, out);
        }
        return;
    }
    let path = join(prefix, key.name);
    out.push(Entry {
        path: path.clone(),
        key,
        under: under.0,
        variants: under.1,
        fingerprint,
    });
    enter(&path, key.ty, (under.0, under.1, fingerprint), how, out);
}

/// Whether two declarations are the same key (a group's keys reached by two paths, PPO's copy
/// of the shared ones).
fn same_key(a: &KeyInfo, b: &KeyInfo) -> bool {
    a.name == b.name
        && a.doc == b.doc
        && a.spec.range == b.spec.range
        && a.spec.note == b.spec.note
        && a.spec.default_value() == b.spec.default_value()
        && expected(a.ty) == expected(b.ty)
}

fn enter(path: &str, ty: &'static Ty, under: Under, how: &mut Walk, out: &mut Vec<Entry>) {
    match ty {
        Ty::Section(s) | Ty::OneOrMany(s) => {
            for inner in s.keys {
                walk(path, inner, under, how, out);
            }
        }
        Ty::Nullable(inner) => enter(path, inner, under, how, out),
        // A list of sections (`reward_functions`): its items' keys, as `key[].item_key`. A
        // config walk does not enter it (the items are the config's own to name).
        Ty::List(inner @ (Ty::Section(_) | Ty::Choice(_))) if matches!(how, Walk::All) => {
            enter(&format!("{path}[]"), inner, under, how, out)
        }
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
                    let under = (Some(variant.label), choice.variants.len(), under.2);
                    walk(path, inner, under, how, out);
                }
            }
        }
        _ => {}
    }
}

/// One key at one path as `--explain` shows it: the components of a choice that have it, and
/// the recipes that read it.
#[derive(Debug, Clone)]
pub struct Explained {
    pub entry: Entry,
    pub under: Vec<&'static str>,
    pub recipes: Vec<&'static str>,
}

/// The entries of `path` (dotted, as a config writes it) in every recipe of `registry`; several
/// when recipes or components declare it differently.
pub fn explain(registry: &[&'static RecipeSpec], path: &str) -> Vec<Explained> {
    let mut found: Vec<Explained> = Vec::new();
    for recipe in registry {
        for entry in entries(recipe).into_iter().filter(|e| e.path == path) {
            match found.iter_mut().find(|e| same_key(e.entry.key, entry.key)) {
                Some(known) => {
                    known
                        .under
                        .extend(entry.under.filter(|u| !known.under.contains(u)));
                    if !known.recipes.contains(&recipe.name) {
                        known.recipes.push(recipe.name);
                    }
                }
                None => found.push(Explained {
                    under: entry.under.into_iter().collect(),
                    recipes: vec![recipe.name],
                    entry,
                }),
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
pub fn describe(explained: &Explained) -> String {
    let (entry, recipes) = (&explained.entry, &explained.recipes);
    let key = entry.key;
    let mut s = String::new();
    let _ = writeln!(s, "{}", entry.path);
    if !explained.under.is_empty() && !all_variants(entry, &explained.under) {
        let _ = writeln!(s, "  of:        {}", explained.under.join("; "));
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
        Fingerprint::Inherit => "no (a resume may change it)",
        Fingerprint::Yes => "yes (a resume must keep it)",
        Fingerprint::ResumeMayChange => "yes, but a resume may change it",
    }
}

/// The whole reference as Markdown: the keys every training recipe reads, once, then each
/// recipe's own.
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
        "A section picked by a `_component_` lists the keys of each component it takes (in\n",
    );
    s.push_str(
        "parentheses where not all of them have it); a key of another component is refused by\n",
    );
    s.push_str("name. `null` for a key with a default is the key left out.\n\n");
    s.push_str("- [Keys every training recipe reads](#keys-every-training-recipe-reads)\n");
    for recipe in registry {
        let _ = writeln!(s, "- [{}](#{})", recipe.name, recipe.name.replace('_', "-"));
    }
    s.push_str("\n## Keys every training recipe reads\n\n");
    s.push_str("PPO's configs write `policy_model` for `model`, and have no `epochs`.\n\n");
    let shared = every_entry(crate::config::schema::TrainConfig::KEYS);
    table(&mut s, &shared);
    for recipe in registry {
        let names: Vec<&str> = std::iter::once(recipe.name)
            .chain(recipe.aliases.iter().copied())
            .chain(recipe.distributed)
            .collect();
        let _ = writeln!(s, "## {}\n", recipe.name);
        let _ = writeln!(s, "{}. Run as: {}.\n", recipe.description, names.join(", "));
        if recipe.is_training() {
            s.push_str("It reads the [keys every training recipe reads](#keys-every-training-recipe-reads), and its own:\n\n");
        }
        let own = every_entry(recipe.own.keys);
        table(&mut s, &own);
    }
    s
}

/// Every key below `keys`, nested sections' included, as the reference's rows.
fn every_entry(keys: &'static [KeyInfo]) -> Vec<Entry> {
    let mut out = Vec::new();
    for key in keys {
        walk(
            "",
            key,
            (None, 0, Fingerprint::Inherit),
            &mut Walk::All,
            &mut out,
        );
    }
    out
}

/// A table of entries, one row per key and path (a key several components of a choice share
/// is one row naming them).
fn table(s: &mut String, entries: &[Entry]) {
    s.push_str("| key | type | default | doc |\n| --- | --- | --- | --- |\n");
    let mut rows: Vec<(&Entry, Vec<&'static str>)> = Vec::new();
    for entry in entries {
        match rows
            .iter_mut()
            .find(|(e, _)| e.path == entry.path && same_key(e.key, entry.key))
        {
            Some((_, under)) => under.extend(entry.under),
            None => rows.push((entry, entry.under.into_iter().collect())),
        }
    }
    for (entry, under) in rows {
        let key = entry.key;
        let mut doc = key.doc.split_whitespace().collect::<Vec<_>>().join(" ");
        if !under.is_empty() && !all_variants(entry, &under) {
            doc = format!("({}) {doc}", under.join("; "));
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

/// Whether `under` names every variant of the choice `entry` sits in (its key is then the
/// section's, whichever component).
fn all_variants(entry: &Entry, under: &[&str]) -> bool {
    let mut names = under.to_vec();
    names.sort_unstable();
    names.dedup();
    names.len() == entry.variants
}

/// Text in a Markdown table cell.
fn cell(text: &str) -> String {
    text.replace('|', "\\|")
}
