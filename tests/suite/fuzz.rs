//! Property tests ("fuzzing", issue #19) of the parsers that user files and arguments reach: the
//! config loader (YAML, overrides, `${...}` interpolation, validation), the safetensors reader and
//! the dataset row parsers. Each property runs a bounded number of random cases, near-valid ones
//! included, and asserts only that nothing panics: bad input must come back as an `Err` (proptest
//! reports a panic as a failed case and shrinks it). The regression tests at the end hold the
//! minimal inputs of the panics these properties found.
//!
//! Scratch files live under cargo's `target/tmp/tune-fuzz`, in a folder per case that is removed
//! after it.

use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use proptest::prelude::*;
use proptest::sample::{Index, select};
use serde_json::{Value as Json, json};

use tune::checkpoint::safetensors_io::SafetensorsFile;
use tune::checkpoint::weights::{Weights, checkpoint_files};
use tune::config::{ValidateOptions, builtin, load_config};
use tune::recipes::{validate, validate_with};

use tune::data::{Dataset, DatasetKind, DatasetSpec, load_rows};
use tune::tokenizer::Tokenizer;

use crate::support::{Cpu, fixture};

/// A bounded run: `cases` random inputs (`PROPTEST_CASES` overrides it for a longer local
/// search), a short shrink, no regression files written into the source tree.
fn bounded(cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(cases);
    ProptestConfig {
        cases,
        max_shrink_iters: 200,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// An empty scratch folder for one case, removed when dropped. Named `<name>-<random>`, so two
/// runs of the suite at once do not write over each other's files.
fn scratch(name: &str) -> tempfile::TempDir {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tune-fuzz");
    std::fs::create_dir_all(&root).expect("create scratch root");
    tempfile::Builder::new()
        .prefix(&format!("{name}-"))
        .tempdir_in(root)
        .expect("create scratch dir")
}

fn write(path: &Path, bytes: impl AsRef<[u8]>) {
    std::fs::write(path, bytes).expect("write scratch file");
}

// ---------------------------------------------------------------------------------------------
// Config loader: YAML text, overrides, interpolation, validation.
// ---------------------------------------------------------------------------------------------

/// Every recipe's name, from the registry.
static RECIPES: LazyLock<Vec<&'static str>> =
    LazyLock::new(|| tune::recipes::RECIPES.iter().map(|r| r.name).collect());

/// Every declared key's dotted path, in every recipe (a list's items as `.0`), so generated
/// configs reach each key's own checks.
static PATHS: LazyLock<Vec<String>> = LazyLock::new(|| {
    let mut paths: Vec<String> = tune::recipes::RECIPES
        .iter()
        .flat_map(|r| tune::config::reference::entries(r))
        .map(|e| e.path.replace("[]", ".0"))
        .collect();
    paths.sort();
    paths.dedup();
    paths
});

/// The names the declared keys' paths are made of, and a few no declaration has.
static KEYS: LazyLock<Vec<String>> = LazyLock::new(|| {
    let mut keys: Vec<String> = ["a", "b", "c", "0", "1", "_component_", "<<"]
        .map(String::from)
        .to_vec();
    for path in PATHS.iter() {
        for segment in path.split('.') {
            if !keys.iter().any(|k| k == segment) {
                keys.push(segment.to_string());
            }
        }
    }
    keys
});

/// Every component name a config may write (tune's and torchtune's).
static COMPONENTS: LazyLock<Vec<String>> =
    LazyLock::new(|| tune::config::components::known_names(None));

/// Scalars that parse as plain YAML values in block context.
const SCALARS: &[&str] = &[
    "",
    "~",
    "null",
    "None",
    "True",
    "false",
    "0",
    "-1",
    "8",
    "3e-4",
    "1e999",
    "-1e-999",
    ".5e2",
    "1_000",
    "0x1F",
    "0o17",
    ".nan",
    "-.inf",
    "99999999999999999999999999",
    "-9223372036854775809",
    "18446744073709551616",
    "[q_proj, v_proj]",
    "{a: 1}",
    "${}",
    "${ }",
    "$}",
    "${a",
    "${a}",
    "${a}${b}",
    "x${a}y",
    "${a.b}",
    "${a.0}",
    "${a.b.c.d.e}",
    "${model}",
    "${output_dir}/logs",
    "${.a}",
    "${..a}",
    "${oc.env:HOME}",
    "${${a}}",
    "${0}",
    "${_component_}",
    "torchtune.models.llama3_2.lora_llama3_2_1b",
    "torchtune.models.llama3_2.llama3_2_1b",
    "tune.models.llama3_2.lora_llama3_2_1b",
    "torchtune.datasets.alpaca_dataset",
    "torchtune.datasets.chat_dataset",
    "torchtune.datasets.stack_exchange_paired_dataset",
    "torchtune.modules.loss.CEWithChunkedOutputLoss",
    "torchtune.rlhf.loss.DPOLoss",
    "torch.optim.AdamW",
    "torchtune.training.FullModelHFCheckpointer",
    "torchtune.training.metric_logging.DiskLogger",
    "torchtune.",
    ".",
    "..",
    "/",
    "/nonexistent/dir",
    "assets/tiny-llama",
    "bf16",
    "fp32",
    "cpu",
    "cuda",
    "train[:10%]",
    "ünïcødé ✓ 🦀",
];

/// Scalars that are YAML syntax of their own: anchors, aliases, tags, indicators, controls.
const RISKY: &[&str] = &[
    "[1, 2",
    "{",
    "}",
    "'",
    "\"",
    "&anchor x",
    "*anchor",
    "*nope",
    "!!str 5",
    "!!int x",
    "!!binary aGk=",
    "!custom {a: 1}",
    "? complex",
    "- item",
    "|",
    ">-",
    "#",
    "%",
    "@",
    "`",
    "${",
    "\u{0}",
    "\u{feff}",
    "\t",
];

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => select(KEYS.clone()),
        1 => "[a-z_0-9]{1,6}",
        1 => "\\PC{1,6}",
    ]
}

/// A dotted key path, mostly over the known keys.
fn key_path() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => select(PATHS.clone()),
        2 => prop::collection::vec(select(KEYS.clone()), 1..4).prop_map(|k| k.join(".")),
        1 => "[a-z_.0-9]{0,12}",
    ]
}

fn scalar() -> impl Strategy<Value = String> {
    prop_oneof![
        12 => select(SCALARS).prop_map(String::from),
        2 => select(COMPONENTS.clone()),
        3 => key_path().prop_map(|k| format!("${{{k}}}")),
        1 => (key_path(), "[a-z/ ]{0,4}").prop_map(|(k, t)| format!("'{t}${{{k}}}{t}'")),
        1 => any::<i64>().prop_map(|i| i.to_string()),
        1 => any::<f64>().prop_map(|f| f.to_string()),
        1 => "[a-z_./-]{0,10}",
        1 => select(RISKY).prop_map(String::from),
        1 => "\\PC{0,10}",
        1 => select(RISKY).prop_map(|s| format!("{s:?}")),
        1 => select(SCALARS).prop_map(|s| format!("'{s}'")),
    ]
}

/// A YAML document tree, rendered in block or flow style.
#[derive(Debug, Clone)]
enum Node {
    Scalar(String),
    Map(Vec<(String, Node)>, bool),
    Seq(Vec<Node>, bool),
}

fn node() -> impl Strategy<Value = Node> {
    scalar()
        .prop_map(Node::Scalar)
        .prop_recursive(6, 48, 6, |inner| {
            prop_oneof![
                (
                    prop::collection::vec((key(), inner.clone()), 0..6),
                    prop::bool::weighted(0.2)
                )
                    .prop_map(|(m, flow)| Node::Map(m, flow)),
                (
                    prop::collection::vec(inner, 0..5),
                    prop::bool::weighted(0.3)
                )
                    .prop_map(|(s, flow)| Node::Seq(s, flow)),
            ]
        })
}

/// A map's entries with duplicate keys dropped (YAML refuses them; the edited built-ins test
/// duplicates).
fn unique(m: &[(String, Node)]) -> Vec<&(String, Node)> {
    let mut seen = std::collections::HashSet::new();
    m.iter().filter(|(k, _)| seen.insert(k.as_str())).collect()
}

fn flow(node: &Node) -> String {
    match node {
        // `${...}` is flow syntax; quoted, it is an interpolation again.
        Node::Scalar(s) if s.contains("${") && !s.starts_with(['\'', '"']) => format!("'{s}'"),
        Node::Scalar(s) => s.clone(),
        Node::Map(m, _) => {
            let items: Vec<String> = unique(m)
                .iter()
                .map(|(k, v)| format!("{k}: {}", flow(v)))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        Node::Seq(s, _) => format!("[{}]", s.iter().map(flow).collect::<Vec<_>>().join(", ")),
    }
}

/// Appends `node` as the value after `key:` or `-` (same line for scalars and flow style).
fn block(node: &Node, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match node {
        Node::Map(m, false) if !m.is_empty() => {
            out.push('\n');
            for (k, v) in unique(m) {
                out.push_str(&format!("{pad}{k}:"));
                block(v, indent + 2, out);
            }
        }
        Node::Seq(s, false) if !s.is_empty() => {
            out.push('\n');
            for v in s {
                out.push_str(&format!("{pad}-"));
                block(v, indent + 2, out);
            }
        }
        other => out.push_str(&format!(" {}\n", flow(other))),
    }
}

fn render(top: &[(String, Node)]) -> String {
    let mut out = String::new();
    for (k, v) in unique(top) {
        out.push_str(&format!("{k}:"));
        block(v, 2, &mut out);
    }
    out
}

/// A line-level edit of a built-in config.
#[derive(Debug, Clone)]
enum Edit {
    Delete,
    Duplicate,
    Indent(usize),
    Dedent,
    Insert(String),
    ReplaceValue(String),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        Just(Edit::Delete),
        Just(Edit::Duplicate),
        (1usize..5).prop_map(Edit::Indent),
        Just(Edit::Dedent),
        (key(), scalar()).prop_map(|(k, v)| Edit::Insert(format!("{k}: {v}"))),
        scalar().prop_map(Edit::ReplaceValue),
    ]
}

fn edited_builtin() -> impl Strategy<Value = String> {
    let names: Vec<&'static str> = builtin::list().iter().map(|b| b.name).collect();
    (
        select(names),
        prop::collection::vec((any::<Index>(), edit()), 0..5),
    )
        .prop_map(|(name, edits)| {
            let text = builtin::get(name).expect("built-in").yaml;
            let mut lines: Vec<String> = text.lines().map(String::from).collect();
            for (at, e) in edits {
                if lines.is_empty() {
                    break;
                }
                let i = at.index(lines.len());
                match e {
                    Edit::Delete => {
                        lines.remove(i);
                    }
                    Edit::Duplicate => lines.insert(i, lines[i].clone()),
                    Edit::Indent(n) => lines[i] = format!("{}{}", " ".repeat(n), lines[i]),
                    Edit::Dedent => lines[i] = lines[i].trim_start().to_string(),
                    Edit::Insert(l) => lines.insert(i, l),
                    Edit::ReplaceValue(v) => {
                        if let Some((k, _)) = lines[i].split_once(':') {
                            lines[i] = format!("{k}: {v}");
                        }
                    }
                }
            }
            lines.join("\n")
        })
}

/// `key: value` lines over a few keys referring to each other: chains, cycles, self-references,
/// dangling and malformed references.
fn interpolation_web() -> impl Strategy<Value = String> {
    let value = select(vec![
        "${a}",
        "${b}",
        "${c}",
        "${d.e}",
        "${d}",
        "${a.0}",
        "x${a}",
        "${b}/${c}",
        "[${a}, ${b}]",
        "{e: ${a}, f: '${c}/x'}",
        "{e: 1}",
        "[1, 2]",
        "1",
        "text",
        "null",
        "${missing}",
        "'${a'",
        "${a}}",
    ]);
    prop::collection::btree_map(select(vec!["a", "b", "c", "d"]), value, 1..5).prop_map(|kv| {
        kv.iter()
            .map(|(k, v)| format!("{k}: {v}\n"))
            .collect::<String>()
    })
}

/// `a0: ${a1}`, `a1: ${a2}`, ... `a<n>: 1`: a chain of `n` references.
fn chain(n: usize) -> String {
    (0..n)
        .map(|i| format!("a{i}: ${{a{}}}\n", i + 1))
        .chain([format!("a{n}: 1\n")])
        .collect()
}

fn config_text() -> impl Strategy<Value = String> {
    prop_oneof![
        1 => "\\PC{0,200}",
        1 => "[ -~\n\t]{0,200}",
        4 => prop::collection::vec((key(), node()), 0..8).prop_map(|top| render(&top)),
        3 => edited_builtin(),
        2 => interpolation_web(),
        1 => (1usize..3000).prop_map(chain),
    ]
}

const OVERRIDES: &[&str] = &[
    "",
    "=",
    "=x",
    "key=",
    "~",
    "~key",
    "~a.b",
    "~=1",
    "+key=1",
    "++key=1",
    "a..b=1",
    ".a=1",
    "a.=1",
    "key=[1,2",
    "key={",
    "key=${key}",
    "a=${a}",
    "a.b=${a}",
    "model=x",
    "model=",
    "model=[1]",
    "model._component_=torchtune.models.llama3_2.llama3_2_1b",
    "dataset=[]",
    "dataset.0.source=json",
    "tokenizer=null",
    "optimizer.lr=-1",
    "ünï=cødé",
    "a b=c d",
    "a=b=c",
    "0=1",
    "a.0=1",
    "k=&x 1",
    "k=*x",
    "k=!!binary aGk=",
];

fn override_arg() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => select(OVERRIDES).prop_map(String::from),
        8 => (key_path(), scalar()).prop_map(|(k, v)| format!("{k}={v}")),
        1 => (select(vec!["~", "+", "++", " "]), key_path()).prop_map(|(p, k)| format!("{p}{k}")),
        1 => "\\PC{0,16}",
        // `a.a.a...=1`: nesting far deeper than YAML allows.
        1 => (1usize..5000).prop_map(|n| format!("{}=1", vec!["a"; n].join("."))),
    ]
}

/// Loads `source` with `overrides` and validates whatever loads for every recipe. Errors are
/// fine; the property is that none of it panics.
fn load_and_validate(source: &str, overrides: &[String]) {
    let Ok(cfg) = load_config(source, overrides) else {
        return;
    };
    let _ = cfg.to_yaml_string();
    let no_paths = ValidateOptions { check_paths: false };
    for recipe in RECIPES.iter() {
        let _ = validate_with(recipe, &cfg, &no_paths);
    }
    let _ = validate("lora_finetune", &cfg);
}

proptest! {
    #![proptest_config(bounded(512))]

    #[test]
    fn config_text_and_overrides_never_panic(
        text in config_text(),
        overrides in prop::collection::vec(override_arg(), 0..4),
    ) {
        let dir = scratch("config_text");
        let path = dir.path().join("config.yaml");
        write(&path, &text);
        load_and_validate(path.to_str().expect("utf-8 path"), &overrides);
    }

    #[test]
    fn config_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let dir = scratch("config_bytes");
        let path = dir.path().join("config.yaml");
        write(&path, &bytes);
        load_and_validate(path.to_str().expect("utf-8 path"), &[]);
    }

    #[test]
    fn builtin_overrides_never_panic(
        index in any::<Index>(),
        overrides in prop::collection::vec(override_arg(), 0..6),
    ) {
        let all = builtin::list();
        let b = &all[index.index(all.len())];
        load_and_validate(b.name, &overrides);
    }
}

// ---------------------------------------------------------------------------------------------
// Safetensors: header length, header JSON, data section.
// ---------------------------------------------------------------------------------------------

const DTYPES: &[&str] = &[
    "F32", "BF16", "F16", "F64", "I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64", "BOOL",
    "F8_E4M3", "F8_E5M2", "F4", "F6_E2M3", "E8M0", "C64", "X", "", "f32",
];

/// A small valid file: floats, integers, packed bytes and an empty tensor.
fn valid_safetensors() -> Vec<u8> {
    use safetensors::tensor::{Dtype, TensorView};
    let f32s: Vec<u8> = [1.0f32, -2.0, 3.5, 0.0, f32::MAX, f32::NAN]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let bf16s: Vec<u8> = [1.0f32, 2.0, -3.0, 0.5]
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    let i64s: Vec<u8> = [1i64, -1, i64::MAX]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let i32s: Vec<u8> = [7i32, -7].iter().flat_map(|v| v.to_le_bytes()).collect();
    let u8s = vec![0x12u8, 0x34, 0x56, 0x78];
    let views = vec![
        (
            "w",
            TensorView::new(Dtype::F32, vec![2, 3], &f32s).expect("view"),
        ),
        (
            "h",
            TensorView::new(Dtype::BF16, vec![4], &bf16s).expect("view"),
        ),
        (
            "ids",
            TensorView::new(Dtype::I64, vec![3], &i64s).expect("view"),
        ),
        (
            "i32",
            TensorView::new(Dtype::I32, vec![1, 2], &i32s).expect("view"),
        ),
        (
            "q",
            TensorView::new(Dtype::U8, vec![2, 2], &u8s).expect("view"),
        ),
        (
            "e",
            TensorView::new(Dtype::F32, vec![0, 5], &[]).expect("view"),
        ),
    ];
    safetensors::serialize(views, None).expect("serialize")
}

fn header_len(bytes: &[u8]) -> usize {
    u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize
}

/// Splits a valid file into its header JSON and data section.
fn split_safetensors(bytes: &[u8]) -> (Json, Vec<u8>) {
    let n = header_len(bytes);
    let header = serde_json::from_slice(&bytes[8..8 + n]).expect("header json");
    (header, bytes[8 + n..].to_vec())
}

fn assemble(header: &Json, data: &[u8]) -> Vec<u8> {
    let text = header.to_string();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(data);
    out
}

const SIZES: &[u64] = &[
    0,
    1,
    2,
    3,
    7,
    8,
    255,
    4096,
    1 << 31,
    1 << 32,
    (1 << 61) - 1,
    1 << 61,
    1 << 62,
    1 << 63,
    u64::MAX - 1,
    u64::MAX,
];

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![8 => 0u64..16, 1 => select(SIZES), 1 => any::<u64>()]
}

/// One header entry: name, dtype, shape, data offsets, all possibly inconsistent.
#[derive(Debug, Clone)]
struct Entry {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    offsets: Option<(u64, u64)>,
}

fn entry() -> impl Strategy<Value = Entry> {
    (
        prop_oneof![
            6 => "[a-z]{1,3}(\\.[a-z0-9]{1,3}){0,2}",
            1 => select(vec!["__metadata__", "", "w"]).prop_map(String::from),
            1 => "\\PC{0,6}",
        ],
        prop_oneof![
            4 => select(&DTYPES[..18]).prop_map(String::from),
            1 => select(DTYPES).prop_map(String::from),
        ],
        prop::collection::vec(prop_oneof![6 => 0u64..6, 1 => size()], 0..5),
        prop::option::weighted(0.05, (size(), size())),
    )
        .prop_map(|(name, dtype, shape, offsets)| Entry {
            name,
            dtype,
            shape,
            offsets,
        })
}

/// How many bytes a dtype takes per element times 8 (bits), for consistent offsets.
fn bits(dtype: &str) -> u64 {
    match dtype {
        "F64" | "I64" | "U64" | "C64" => 64,
        "F32" | "I32" | "U32" => 32,
        "BF16" | "F16" | "I16" | "U16" => 16,
        "F6_E2M3" => 6,
        "F4" => 4,
        _ => 8,
    }
}

/// Builds a header from entries: without explicit offsets an entry gets the next consistent
/// ones, so many generated files pass validation and reach the readers.
fn header_of(entries: &[Entry], metadata: Option<Json>) -> (Json, u64) {
    let mut map = serde_json::Map::new();
    let mut at = 0u64;
    for e in entries {
        let (s, end) = e.offsets.unwrap_or_else(|| {
            let n = e
                .shape
                .iter()
                .try_fold(bits(&e.dtype), |a, &d| a.checked_mul(d))
                .unwrap_or(u64::MAX)
                / 8;
            (at, at.saturating_add(n))
        });
        at = end;
        map.insert(
            e.name.clone(),
            json!({ "dtype": e.dtype, "shape": e.shape, "data_offsets": [s, end] }),
        );
    }
    if let Some(m) = metadata {
        map.insert("__metadata__".into(), m);
    }
    (Json::Object(map), at)
}

#[derive(Debug, Clone)]
enum StFile {
    /// Arbitrary bytes.
    Bytes(Vec<u8>),
    /// A generated header with (up to 256 bytes of) data.
    Header {
        entries: Vec<Entry>,
        metadata: Option<Json>,
        data: Option<Vec<u8>>,
    },
    /// `count` tensors of the largest size their dtype allows (the last `short` elements
    /// shorter), with consistent offsets: the end of the data approaches `u64::MAX`.
    Huge {
        dtype: &'static str,
        count: usize,
        short: u64,
    },
    /// The valid file with bytes xor-ed, then cut or extended.
    Flipped {
        flips: Vec<(Index, u8)>,
        cut: Option<Index>,
        extra: Vec<u8>,
    },
    /// The valid file with another header length.
    Length(u64),
    /// The valid file's header with one entry's field replaced.
    Field {
        tensor: Index,
        field: &'static str,
        value: Json,
    },
}

fn json_leaf() -> impl Strategy<Value = Json> {
    prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::from),
        any::<i64>().prop_map(Json::from),
        select(SIZES).prop_map(Json::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Json::Null, Json::Number)),
        "\\PC{0,8}".prop_map(Json::from),
        select(DTYPES).prop_map(Json::from),
    ]
}

fn json_small() -> impl Strategy<Value = Json> {
    json_leaf().prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Json::Array),
            prop::collection::vec(("[a-z_]{0,6}", inner), 0..4)
                .prop_map(|kv| Json::Object(kv.into_iter().collect())),
        ]
    })
}

fn st_file() -> impl Strategy<Value = StFile> {
    prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..300).prop_map(StFile::Bytes),
        4 => (
            prop::collection::vec(entry(), 0..6),
            prop::option::weighted(0.2, json_small()),
            prop::option::weighted(0.3, prop::collection::vec(any::<u8>(), 0..256)),
        )
            .prop_map(|(entries, metadata, data)| StFile::Header { entries, metadata, data }),
        2 => (
            prop::collection::vec((any::<Index>(), 1u8..=255), 0..6),
            prop::option::weighted(0.3, any::<Index>()),
            prop::collection::vec(any::<u8>(), 0..4),
        )
            .prop_map(|(flips, cut, extra)| StFile::Flipped { flips, cut, extra }),
        1 => prop_oneof![select(SIZES), 0u64..400].prop_map(StFile::Length),
        1 => (select(vec!["U8", "I8", "BOOL", "F8_E4M3", "F4", "F32"]), 1usize..10, 0u64..600)
            .prop_map(|(dtype, count, short)| StFile::Huge { dtype, count, short }),
        2 => (
            any::<Index>(),
            select(vec!["dtype", "shape", "data_offsets"]),
            prop_oneof![
                json_small(),
                prop::collection::vec(size(), 0..4).prop_map(Json::from),
            ],
        )
            .prop_map(|(tensor, field, value)| StFile::Field { tensor, field, value }),
    ]
}

fn st_bytes(file: &StFile) -> Vec<u8> {
    let valid = valid_safetensors();
    match file {
        StFile::Bytes(b) => b.clone(),
        StFile::Header {
            entries,
            metadata,
            data,
        } => {
            let (header, end) = header_of(entries, metadata.clone());
            // The data the header describes when it is small, else whatever was generated.
            let data = data
                .clone()
                .unwrap_or_else(|| vec![0x3c; end.min(4096) as usize]);
            assemble(&header, &data)
        }
        StFile::Huge {
            dtype,
            count,
            short,
        } => {
            // nelements * bits must fit in a u64: the largest count of this dtype's elements.
            let max = u64::MAX / bits(dtype);
            let entries: Vec<Entry> = (0..*count)
                .map(|i| Entry {
                    name: format!("t{i}"),
                    dtype: dtype.to_string(),
                    shape: vec![if i + 1 == *count { max - short } else { max }],
                    offsets: None,
                })
                .collect();
            assemble(&header_of(&entries, None).0, &[])
        }
        StFile::Flipped { flips, cut, extra } => {
            let mut b = valid;
            for (at, x) in flips {
                let i = at.index(b.len());
                b[i] ^= x;
            }
            if let Some(cut) = cut {
                b.truncate(cut.index(b.len()));
            }
            b.extend_from_slice(extra);
            b
        }
        StFile::Length(n) => {
            let mut b = valid;
            b[..8].copy_from_slice(&n.to_le_bytes());
            b
        }
        StFile::Field {
            tensor,
            field,
            value,
        } => {
            let (mut header, data) = split_safetensors(&valid);
            let obj = header.as_object_mut().expect("header object");
            let names: Vec<String> = obj.keys().cloned().collect();
            let name = &names[tensor.index(names.len())];
            obj[name][*field] = value.clone();
            assemble(&header, &data)
        }
    }
}

/// Opens a file and reads every tensor every way tune reads them.
fn read_everything(path: &Path) {
    let Ok(file) = SafetensorsFile::open(path) else {
        return;
    };
    for name in file.names() {
        let _ = file.shape(&name);
        let _ = file.dtype(&name);
        let _ = file.read(&name);
        let _ = file.read_i64(&name);
        let _ = file.raw(&name);
    }
    let _ = file.read("no such tensor");
}

proptest! {
    #![proptest_config(bounded(512))]

    #[test]
    fn safetensors_never_panics(file in st_file()) {
        let dir = scratch("safetensors");
        let path = dir.path().join("model.safetensors");
        write(&path, st_bytes(&file));
        read_everything(&path);
        if let Ok(mut w) = Weights::open(dir.path(), None) {
            let names: Vec<String> = w.names().cloned().collect();
            for name in names {
                let _ = w.take(&name, &[2, 3]);
            }
            let _ = w.finish(|_| false);
        }
    }

    #[test]
    fn safetensors_index_never_panics(
        index in prop_oneof![
            json_small(),
            prop::collection::vec(
                (select(vec!["w", "h", "x"]), prop_oneof![
                    select(vec![
                        "model.safetensors", "", ".", "..", "/", "missing.safetensors",
                        "../model.safetensors", "model.safetensors/",
                    ]).prop_map(Json::from),
                    json_leaf(),
                ]),
                0..4,
            )
            .prop_map(|m| json!({ "weight_map": m.into_iter().map(|(k, v)| (k.to_string(), v)).collect::<serde_json::Map<_, _>>() })),
        ],
        files in prop::option::weighted(0.2, prop::collection::vec(
            select(vec!["model.safetensors", "", ".", "..", "nope", "/"]).prop_map(String::from), 0..3)),
    ) {
        let dir = scratch("safetensors_index");
        write(&dir.path().join("model.safetensors"), valid_safetensors());
        write(&dir.path().join("model.safetensors.index.json"), index.to_string());
        let _ = checkpoint_files(dir.path(), files.as_deref());
        let _ = Weights::open(dir.path(), files.as_deref());
    }
}

/// The tiny Llama checkpoint with its header mutated, loaded as a model: reaches the shape
/// checks and the model builder. Fewer cases: each one builds a model.
fn mutated_model(field: &str, tensor: Index, value: &Json, cut: Option<Index>) -> Vec<u8> {
    let valid = std::fs::read(fixture("tiny-llama/model.safetensors")).expect("fixture");
    let (mut header, data) = split_safetensors(&valid);
    let obj = header.as_object_mut().expect("header object");
    let names: Vec<String> = obj
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    let name = &names[tensor.index(names.len())];
    if field == "name" {
        if let Some(v) = obj.remove(name) {
            obj.insert(value.as_str().unwrap_or("renamed").to_string(), v);
        }
    } else {
        obj[name][field] = value.clone();
    }
    let mut bytes = assemble(&header, &data);
    if let Some(cut) = cut {
        bytes.truncate(cut.index(bytes.len()));
    }
    bytes
}

proptest! {
    #![proptest_config(bounded(64))]

    #[test]
    fn model_load_never_panics(
        field in select(vec!["dtype", "shape", "data_offsets", "name"]),
        tensor in any::<Index>(),
        value in prop_oneof![
            json_small(),
            prop::collection::vec(prop_oneof![0u64..300, select(SIZES)], 0..4).prop_map(Json::from),
            select(vec!["F32", "BF16", "F16", "I64", "U8"]).prop_map(Json::from),
        ],
        cut in prop::option::weighted(0.1, any::<Index>()),
    ) {
        let dir = scratch("model_load");
        std::fs::copy(fixture("tiny-llama/config.json"), dir.path().join("config.json")).expect("copy");
        write(&dir.path().join("model.safetensors"), mutated_model(field, tensor, &value, cut));
        let _ = tune::model_io::hf::load_model::<Cpu>(dir.path(), None, &Default::default());
    }
}

// ---------------------------------------------------------------------------------------------
// Dataset files: JSON, JSON Lines, CSV, text, Parquet -> rows -> messages -> tokens.
// ---------------------------------------------------------------------------------------------

/// The tiny Llama tokenizer with its chat template, the same without one (the plain format),
/// and the tiny Qwen2 one (another chat template).
static TOKENIZERS: LazyLock<Vec<Tokenizer>> = LazyLock::new(|| {
    let llama = Tokenizer::from_path(fixture("tiny-llama")).expect("tokenizer");
    let mut plain = Tokenizer::from_path(fixture("tiny-llama")).expect("tokenizer");
    plain.set_chat_template(None).expect("no template");
    let qwen = Tokenizer::from_path(fixture("tiny-qwen2")).expect("tokenizer");
    vec![llama, plain, qwen]
});

const KINDS: &[DatasetKind] = &[
    DatasetKind::Alpaca,
    DatasetKind::Instruct,
    DatasetKind::Chat,
    DatasetKind::TextCompletion,
    DatasetKind::Preference,
    DatasetKind::StackExchangePaired,
];

const COLUMNS: &[&str] = &[
    "instruction",
    "input",
    "output",
    "text",
    "conversations",
    "messages",
    "chosen",
    "rejected",
    "question",
    "response_j",
    "response_k",
    "prompt",
    "",
];

const TEXTS: &[&str] = &[
    "",
    " ",
    "\n",
    "hello",
    "Tell me a joke.",
    "human",
    "gpt",
    "system",
    "user",
    "assistant",
    "tool",
    "text",
    "image",
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<|start_header_id|>assistant<|end_header_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "{instruction}",
    "{input}",
    "{{ messages }}",
    "{% for %}",
    "ünïcødé ✓ 🦀",
    "\u{0}",
    "\u{feff}",
    "a,b,\"c\"",
];

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => select(TEXTS).prop_map(String::from),
        1 => "\\PC{0,24}",
        1 => "[a-z ]{0,40}",
    ]
}

fn json_value() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        1 => Just(Json::Null),
        1 => any::<bool>().prop_map(Json::from),
        1 => any::<i64>().prop_map(Json::from),
        1 => any::<u64>().prop_map(Json::from),
        1 => any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Json::Null, Json::Number)),
        6 => text().prop_map(Json::from),
    ];
    leaf.prop_recursive(4, 32, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Json::Array),
            prop::collection::vec(
                (
                    select(vec![
                        "from", "value", "role", "content", "type", "text", "x"
                    ]),
                    inner,
                ),
                0..4,
            )
            .prop_map(|kv| Json::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        ]
    })
}

/// A conversation message, ShareGPT or OpenAI style, with odd roles and content parts.
fn message() -> impl Strategy<Value = Json> {
    let role = prop_oneof![
        4 => select(vec!["system", "human", "gpt", "user", "assistant", "tool", "ipython", ""])
            .prop_map(Json::from),
        1 => json_value(),
    ];
    let part = prop_oneof![
        3 => text().prop_map(|t| json!({ "type": "text", "text": t })),
        1 => json_value().prop_map(|t| json!({ "type": "text", "text": t })),
        1 => (select(vec!["image", "", "TEXT"]), text()).prop_map(|(ty, t)| json!({ "type": ty, "text": t })),
        1 => json_value(),
    ];
    let content = prop_oneof![
        4 => text().prop_map(Json::from),
        1 => prop::collection::vec(part, 0..3).prop_map(Json::Array),
        1 => json_value(),
    ];
    (
        any::<bool>(),
        role,
        content,
        prop::option::weighted(0.1, json_value()),
    )
        .prop_map(|(sharegpt, role, content, extra)| {
            let (r, c) = if sharegpt {
                ("from", "value")
            } else {
                ("role", "content")
            };
            let mut m = serde_json::Map::new();
            m.insert(r.into(), role);
            m.insert(c.into(), content);
            if let Some(x) = extra {
                m.insert("weight".into(), x);
            }
            Json::Object(m)
        })
}

fn cell() -> impl Strategy<Value = Json> {
    prop_oneof![
        5 => text().prop_map(Json::from),
        3 => prop::collection::vec(message(), 0..4).prop_map(Json::Array),
        2 => json_value(),
    ]
}

/// A conversation that is valid more often than not: `sharegpt` or OpenAI roles, mostly
/// alternating user and assistant turns, some odd messages.
fn conversation(sharegpt: bool) -> impl Strategy<Value = Json> {
    let turn = prop_oneof![
        6 => (any::<bool>(), text()).prop_map(move |(user, t)| {
            let role = match (sharegpt, user) {
                (true, true) => "human",
                (true, false) => "gpt",
                (false, true) => "user",
                (false, false) => "assistant",
            };
            if sharegpt {
                json!({ "from": role, "value": t })
            } else {
                json!({ "role": role, "content": t })
            }
        }),
        1 => text().prop_map(move |t| {
            if sharegpt {
                json!({ "from": "system", "value": t })
            } else {
                json!({ "role": "system", "content": t })
            }
        }),
        2 => message(),
    ];
    prop_oneof![
        8 => prop::collection::vec(turn, 0..5).prop_map(Json::Array),
        1 => cell(),
    ]
}

/// Sometimes the right value for a column, sometimes anything.
fn column(good: impl Strategy<Value = Json>) -> impl Strategy<Value = Option<Json>> {
    prop::option::weighted(0.97, prop_oneof![12 => good, 1 => cell()])
}

/// A row with (most of) the columns of every dataset kind, mostly well typed, so that many
/// rows get through the transforms into tokenization whatever the kind.
fn row() -> impl Strategy<Value = Json> {
    let string = || text().prop_map(Json::from);
    prop_oneof![
        8 => (
            (column(string()), column(string()), column(string()), column(string())),
            (column(conversation(true)), column(conversation(false))),
            (column(conversation(false)), column(conversation(false))),
            (column(string()), column(string()), column(string())),
        )
            .prop_map(|(a, b, c, d)| {
                let cols = [
                    ("instruction", a.0), ("input", a.1), ("output", a.2), ("text", a.3),
                    ("conversations", b.0), ("messages", b.1),
                    ("chosen", c.0), ("rejected", c.1),
                    ("question", d.0), ("response_j", d.1), ("response_k", d.2),
                ];
                Json::Object(
                    cols.into_iter()
                        .filter_map(|(k, v)| Some((k.to_string(), v?)))
                        .collect(),
                )
            }),
        1 => prop::collection::vec((select(COLUMNS), cell()), 0..6)
            .prop_map(|kv| Json::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        1 => json_value(),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Layout {
    JsonArray,
    JsonLines,
    Csv,
    Text,
    Raw,
    Parquet,
}

fn render_rows(layout: Layout, rows: &[Json], raw: &[u8]) -> Vec<u8> {
    match layout {
        Layout::JsonArray => Json::Array(rows.to_vec()).to_string().into_bytes(),
        Layout::JsonLines => rows
            .iter()
            .map(|r| r.to_string() + "\n")
            .collect::<String>()
            .into_bytes(),
        Layout::Csv => {
            let mut header: Vec<String> = Vec::new();
            for r in rows {
                for k in r.as_object().into_iter().flat_map(|o| o.keys()) {
                    if !header.contains(k) {
                        header.push(k.clone());
                    }
                }
            }
            let mut w = csv::WriterBuilder::new()
                .flexible(true)
                .from_writer(Vec::new());
            w.write_record(&header).expect("csv");
            for r in rows {
                let cells: Vec<String> = header
                    .iter()
                    .map(|h| match r.get(h) {
                        Some(Json::String(s)) => s.clone(),
                        Some(v) => v.to_string(),
                        None => String::new(),
                    })
                    .collect();
                w.write_record(&cells).expect("csv");
            }
            w.into_inner().expect("csv")
        }
        Layout::Text => rows
            .iter()
            .map(|r| r.as_str().map_or_else(|| r.to_string(), String::from) + "\n")
            .collect::<String>()
            .into_bytes(),
        Layout::Raw => raw.to_vec(),
        Layout::Parquet => {
            // A fixture with its footer's row count replaced, cut, or with bytes flipped (raw
            // drives which and where).
            let name = if raw.len().is_multiple_of(2) {
                "alpaca_tiny.parquet"
            } else {
                "chat_tiny.parquet"
            };
            let mut b = std::fs::read(fixture(name)).expect("parquet fixture");
            let len = b.len();
            match raw.first().map(|m| m % 4) {
                Some(0) => b.truncate(len / 2),
                Some(1) => {
                    let mut n = [0u8; 8];
                    for (d, s) in n.iter_mut().zip(&raw[1..]) {
                        *d = *s;
                    }
                    let alpaca = std::fs::read(fixture("alpaca_tiny.parquet")).expect("fixture");
                    b = parquet_with_num_rows(&alpaca, i64::from_le_bytes(n));
                }
                _ => {
                    for pair in raw.chunks_exact(3) {
                        // Mostly the footer (metadata), sometimes anywhere.
                        let back = usize::from(u16::from_le_bytes([pair[0], pair[1]]));
                        let i = if pair[2] & 1 == 0 {
                            len - 1 - back % 300.min(len)
                        } else {
                            back * 7 % len
                        };
                        b[i] ^= pair[2] | 1;
                    }
                }
            }
            b
        }
    }
}

/// `alpaca_tiny.parquet` (100 rows) with the row count in its footer (`FileMetaData.num_rows`,
/// a zigzag varint after the thrift compact field header 0x16) replaced by `rows`.
fn parquet_with_num_rows(file: &[u8], rows: i64) -> Vec<u8> {
    fn varint(v: i64) -> Vec<u8> {
        let mut z = ((v << 1) ^ (v >> 63)) as u64;
        let mut out = Vec::new();
        while z >= 0x80 {
            out.push((z as u8 & 0x7f) | 0x80);
            z >>= 7;
        }
        out.push(z as u8);
        out
    }
    let tail = file.len() - 8;
    let n = u32::from_le_bytes(file[tail..tail + 4].try_into().expect("4 bytes")) as usize;
    let footer = &file[tail - n..tail];
    let field = [&[0x16][..], &varint(100)].concat();
    let at = footer
        .windows(field.len())
        .position(|w| w == field)
        .expect("num_rows in the footer");
    let mut new_footer = footer[..at + 1].to_vec();
    new_footer.extend(varint(rows));
    new_footer.extend(&footer[at + field.len()..]);
    let mut out = file[..tail - n].to_vec();
    out.extend(&new_footer);
    out.extend((new_footer.len() as u32).to_le_bytes());
    out.extend(b"PAR1");
    out
}

const SPLITS: &[&str] = &[
    "train",
    "train[:2]",
    "train[:0]",
    "train[5:1]",
    "train[1:]",
    "train[-1:]",
    "train[:50%]",
    "train[-200%:]",
    "train[9223372036854775807%:]",
    "train[-9223372036854775808:]",
    "train[a:b]",
    "train[",
    "train[]",
    "validation",
    "",
];

#[derive(Debug, Clone)]
struct SpecCase {
    kind: DatasetKind,
    source_is_path: bool,
    split: Option<&'static str>,
    column_map: Option<Vec<(&'static str, &'static str)>>,
    train_on_input: Option<bool>,
    packed: Option<bool>,
    split_across_pack: Option<bool>,
    new_system_prompt: Option<String>,
    conversation_column: Option<&'static str>,
    openai: Option<bool>,
    column: Option<&'static str>,
    add_eos: Option<bool>,
    max_seq_len: Option<usize>,
    tokenizer: usize,
}

fn spec_case() -> impl Strategy<Value = SpecCase> {
    let opt = |p| prop::option::weighted(p, any::<bool>());
    (
        (
            select(KINDS),
            prop::bool::weighted(0.2),
            prop::option::weighted(0.2, select(SPLITS)),
            prop::option::weighted(
                0.1,
                prop::collection::vec((select(COLUMNS), select(COLUMNS)), 0..3),
            ),
            opt(0.5),
            opt(0.4),
            opt(0.3),
        ),
        (
            prop::option::weighted(0.2, text()),
            prop::option::weighted(0.1, select(COLUMNS)),
            opt(0.6),
            prop::option::weighted(0.1, select(COLUMNS)),
            opt(0.3),
            prop::option::weighted(0.6, select(vec![0usize, 1, 2, 3, 5, 8, 16, 64])),
            0usize..3,
        ),
    )
        .prop_map(
            |(
                (
                    kind,
                    source_is_path,
                    split,
                    column_map,
                    train_on_input,
                    packed,
                    split_across_pack,
                ),
                (
                    new_system_prompt,
                    conversation_column,
                    openai,
                    column,
                    add_eos,
                    max_seq_len,
                    tokenizer,
                ),
            )| SpecCase {
                kind,
                source_is_path,
                split,
                column_map,
                train_on_input,
                packed,
                split_across_pack,
                new_system_prompt,
                conversation_column,
                openai,
                column,
                add_eos,
                max_seq_len,
                tokenizer,
            },
        )
}

fn dataset_spec(case: &SpecCase, file: &str, layout: Layout) -> DatasetSpec {
    let builder = match layout {
        Layout::JsonArray | Layout::JsonLines | Layout::Raw => "json",
        Layout::Csv => "csv",
        Layout::Text => "text",
        Layout::Parquet => "parquet",
    };
    let (source, data_files) = if case.source_is_path {
        (file.to_string(), Vec::new())
    } else {
        (builder.to_string(), vec![file.to_string()])
    };
    let defaults = DatasetSpec::new(case.kind);
    DatasetSpec {
        source: Some(source),
        data_files,
        split: case.split.map_or(defaults.split.clone(), String::from),
        column_map: case.column_map.as_ref().map_or_else(Default::default, |m| {
            m.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        }),
        train_on_input: case.train_on_input.unwrap_or(defaults.train_on_input),
        packed: case.packed.unwrap_or(defaults.packed),
        split_across_pack: case.split_across_pack.unwrap_or(defaults.split_across_pack),
        new_system_prompt: case.new_system_prompt.clone(),
        conversation_column: case.conversation_column.map(String::from),
        conversation_style: match case.openai {
            Some(true) => tune::data::ConversationStyle::Openai,
            _ => tune::data::ConversationStyle::Sharegpt,
        },
        column: case.column.map(String::from),
        add_eos: case.add_eos.unwrap_or(defaults.add_eos),
        ..defaults
    }
}

/// Builds the dataset as `tune run` would and, when it builds, collates its first samples.
fn build_dataset(dir: &Path, case: &SpecCase, layout: Layout, bytes: &[u8]) {
    let ext = match layout {
        Layout::JsonArray | Layout::Raw => "json",
        Layout::JsonLines => "jsonl",
        Layout::Csv => "csv",
        Layout::Text => "txt",
        Layout::Parquet => "parquet",
    };
    let file = format!("data.{ext}");
    write(&dir.join(&file), bytes);
    let spec = dataset_spec(case, &file, layout);
    let tok = &TOKENIZERS[case.tokenizer];
    if let Ok(ds) = Dataset::build(&spec, tok, case.max_seq_len, dir) {
        let n = ds.len().min(4);
        let _ = ds.collate(&(0..n).collect::<Vec<_>>());
        let _ = ds.collate(&[n + 10]);
    }
    // One row at a time too, so a bad row does not hide the rows after it.
    for row in load_rows(&spec, dir).unwrap_or_default() {
        let _ = Dataset::from_rows(&[row], &spec, tok, case.max_seq_len);
    }
}

proptest! {
    #![proptest_config(bounded(512))]

    #[test]
    fn dataset_rows_never_panic(
        case in spec_case(),
        layout in select(vec![
            Layout::JsonArray, Layout::JsonLines, Layout::Csv, Layout::Text, Layout::Raw,
            Layout::Parquet,
        ]),
        rows in prop::collection::vec(row(), 0..6),
        raw in prop::collection::vec(any::<u8>(), 0..96),
    ) {
        let dir = scratch("dataset_rows");
        build_dataset(dir.path(), &case, layout, &render_rows(layout, &rows, &raw));
    }
}

// ---------------------------------------------------------------------------------------------
// Regressions: the minimal inputs of panics the properties above found.
// ---------------------------------------------------------------------------------------------

/// Eight U8 tensors of 2^61 - 1 bytes each, offsets consistent: the data ends at byte
/// 2^64 - 8, and safetensors' `read_metadata` overflowed adding the header length to it.
#[test]
fn safetensors_data_end_near_u64_max_is_an_error() {
    let entries: Vec<Entry> = (0..8)
        .map(|i| Entry {
            name: format!("t{i}"),
            dtype: "U8".into(),
            shape: vec![(1 << 61) - 1],
            offsets: None,
        })
        .collect();
    let dir = scratch("regression_data_end");
    let path = dir.path().join("model.safetensors");
    write(&path, assemble(&header_of(&entries, None).0, &[]));
    let err = SafetensorsFile::open(&path)
        .err()
        .expect("a header past the end of the file is an error")
        .to_string();
    assert!(err.contains("model.safetensors"), "{err}");
    assert!(err.contains("tensor `t"), "{err}");
    assert!(err.contains("0 bytes of tensor data"), "{err}");
}

/// A Parquet footer claiming i64::MAX rows: the reader reserved room for them up front and
/// panicked with "capacity overflow" (2^62 rows aborted the whole process, failing to allocate
/// 2^62 bytes, which is how the property first found it).
#[test]
fn parquet_huge_row_count_is_not_reserved() {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let fixture = std::fs::read(fixture("alpaca_tiny.parquet")).expect("fixture");
    let dir = scratch("regression_parquet_rows");
    for rows in [i64::MAX, 1 << 20, -5] {
        let path = dir.path().join("data.parquet");
        write(&path, parquet_with_num_rows(&fixture, rows));
        let reader = SerializedFileReader::new(std::fs::File::open(&path).expect("open"))
            .expect("footer still parses");
        assert_eq!(reader.metadata().file_metadata().num_rows(), rows);
        // The rows themselves are intact, so they load: the count was only a hint.
        let loaded =
            tune::data::read_file(&path, tune::data::FileFormat::Parquet).expect("rows load");
        assert_eq!(loaded.len(), 100, "{rows}");
    }
}

/// `a.a.a....=1` with 4000 parts: every walk over the tree recursed 4000 levels deep and
/// overflowed the stack (an abort, not even a panic).
#[test]
fn deep_override_key_is_an_error() {
    let key = vec!["a"; 4000].join(".");
    let err = load_config("tiny/lora_single_device", &[format!("{key}=1")])
        .expect_err("a key deeper than YAML nests is an error")
        .to_string();
    assert!(err.starts_with("bad override `a.a.a."), "{err}");
    assert!(
        err.contains("the key has 4000 dotted parts; config keys nest at most 128 levels deep"),
        "{err}"
    );
    // 128 parts are still fine.
    let key = vec!["a"; 128].join(".");
    load_config("tiny/lora_single_device", &[format!("{key}=1")]).expect("128 parts");
}

/// `a0: ${a1}`, `a1: ${a2}`, ... 2000 deep: resolving recursed once per link and overflowed
/// the stack.
#[test]
fn long_interpolation_chain_is_an_error() {
    let dir = scratch("regression_chain");
    let path = dir.path().join("chain.yaml");
    write(&path, chain(2000));
    let err = load_config(path.to_str().expect("utf-8"), &[])
        .expect_err("a 2000-link chain is an error")
        .to_string();
    assert!(
        err.contains("references nest more than 512 levels deep (starting at `a0`)"),
        "{err}"
    );
    // A chain of a few hundred links still resolves.
    write(&path, chain(300));
    let cfg = load_config(path.to_str().expect("utf-8"), &[]).expect("300 links");
    assert_eq!(
        tune::config::yaml::get(&cfg.value, "a0"),
        Some(&serde_yaml::Value::from(1))
    );
}
