use crate::support::{TempDir, temp_dir};

use std::path::{Path, PathBuf};
use tune::tokenizer::{Message, Role, TemplateInputs, Tokenizer, TokenizerError};

fn fixture(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(p)
}

fn reference() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture("tokenization.json")).expect("reference");
    serde_json::from_str(&text).expect("json")
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("int") as u32)
        .collect()
}

/// A fresh temp folder with the tiny-llama tokenizer.json and the given extra files.
fn temp_checkpoint(name: &str, files: &[(&str, &str)]) -> TempDir {
    let dir = temp_dir(&format!("tok-{name}"));
    std::fs::copy(
        fixture("tiny-llama/tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .expect("copy");
    for (f, text) in files {
        std::fs::write(dir.path().join(f), text).expect("write");
    }
    dir
}

#[test]
fn golden_tokenization_for_both_tokenizers() {
    let r = reference();
    for name in ["tiny-llama", "tiny-qwen2"] {
        let case = &r[name];
        let tok = Tokenizer::from_path(fixture(name)).expect("load");
        let text = case["text"].as_str().expect("text");
        assert_eq!(
            tok.encode(text, true).expect("encode"),
            ids(&case["text_ids"]),
            "{name} text ids"
        );
        assert_eq!(
            tok.decode(&tok.encode(text, false).expect("enc"), false)
                .expect("dec"),
            text
        );
        let messages: Vec<Message> =
            serde_json::from_value(case["messages"].clone()).expect("messages");
        assert_eq!(messages[0].role, Role::System);
        assert!(tok.has_chat_template());
        let rendered = tok.apply_chat_template(&messages, false).expect("render");
        assert_eq!(
            rendered,
            case["chat_template_rendered"].as_str().expect("str"),
            "{name} render"
        );
        assert_eq!(
            tok.encode(&rendered, false).expect("encode"),
            ids(&case["chat_template_ids"]),
            "{name} chat ids"
        );
    }
}

#[test]
fn special_tokens() {
    let llama = Tokenizer::from_path(fixture("tiny-llama")).expect("load");
    assert_eq!(llama.bos_id(), Some(2000));
    assert_eq!(llama.eos_id(), Some(2004));
    assert_eq!(llama.pad_id(), Some(2005));
    assert_eq!(llama.stop_ids(), &[2004]);
    assert_eq!(llama.vocab_size(), 2006);
    assert_eq!(llama.decode(&[2000, 72], true).expect("decode"), "H");
    let qwen = Tokenizer::from_path(fixture("tiny-qwen2/tokenizer.json")).expect("load file path");
    assert_eq!(qwen.bos_id(), None);
    assert_eq!(qwen.eos_id(), Some(2002));
    assert_eq!(qwen.pad_id(), Some(2000));
    assert_eq!(qwen.stop_ids(), &[2002]);
    let gen_prompt = qwen
        .apply_chat_template(&[Message::user("hi")], true)
        .expect("render");
    assert_eq!(
        gen_prompt,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn config_variants() {
    // AddedToken objects, eos list in generation_config, no pad (falls back to eos),
    // named template list, chat_template.json and chat_template.jinja taking precedence.
    let dir = temp_checkpoint(
        "variants",
        &[
            (
                "tokenizer_config.json",
                r#"{"bos_token": {"content": "<|begin_of_text|>", "special": true},
                    "eos_token": {"content": "<|end_of_text|>"},
                    "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}"}]}"#,
            ),
            (
                "generation_config.json",
                r#"{"eos_token_id": [2001, 2004]}"#,
            ),
        ],
    );
    let tok = Tokenizer::from_path(dir.path()).expect("load");
    assert_eq!(tok.bos_id(), Some(2000));
    assert_eq!(tok.eos_id(), Some(2001));
    assert_eq!(tok.stop_ids(), &[2001, 2004]);
    assert_eq!(tok.pad_id(), Some(2001), "pad falls back to eos");
    let out = tok
        .apply_chat_template(&[Message::user("x")], false)
        .expect("render");
    assert_eq!(out, "<|begin_of_text|>user:x");
    // A processor's chat_template.json (the Hub's vision-language repos) wins over
    // tokenizer_config.json's key; chat_template.jinja wins over both.
    std::fs::write(
        dir.path().join("chat_template.json"),
        r#"{"chat_template": "P{{ messages | length }}"}"#,
    )
    .expect("write");
    let tok = Tokenizer::from_path(dir.path()).expect("load");
    assert_eq!(
        tok.apply_chat_template(&[Message::user("x")], false)
            .expect("render"),
        "P1"
    );
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "J{{ messages | length }}\n",
    )
    .expect("write");
    let tok = Tokenizer::from_path(dir.path()).expect("load");
    assert_eq!(
        tok.apply_chat_template(&[Message::user("x")], false)
            .expect("render"),
        "J1"
    );
}

#[test]
fn config_errors_are_specific() {
    let dir = temp_checkpoint(
        "errors",
        &[("tokenizer_config.json", r#"{"eos_token": "<nope>"}"#)],
    );
    let err = Tokenizer::from_path(dir.path()).expect_err("unknown token");
    assert!(
        matches!(err, TokenizerError::UnknownSpecialToken { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("tokenizer_config.json") && err.to_string().contains("<nope>")
    );
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": [{"name": "rag", "template": "x"}]}"#,
    )
    .expect("write");
    let err = Tokenizer::from_path(dir.path()).expect_err("no default");
    assert!(err.to_string().contains("rag"), "{err}");
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": "{% for %}"}"#,
    )
    .expect("write");
    assert!(matches!(
        Tokenizer::from_path(dir.path()),
        Err(TokenizerError::TemplateSyntax { .. })
    ));
    std::fs::write(dir.path().join("tokenizer_config.json"), "{}").expect("write");
    let tok = Tokenizer::from_path(dir.path()).expect("load");
    assert!(!tok.has_chat_template());
    assert!(matches!(
        tok.apply_chat_template(&[Message::user("x")], false),
        Err(TokenizerError::NoChatTemplate)
    ));
    let err = Tokenizer::from_path(fixture("tiny-llama/..")).expect_err("no tokenizer.json");
    assert!(matches!(err, TokenizerError::NotFound { .. }), "{err}");
}

#[test]
fn tokenizer_and_dataset_are_send_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<tune::data::Dataset>();
}

/// torchtune's `HuggingFaceModelTokenizer` names its files: `tokenizer_json_path`, and a
/// tokenizer_config.json (chat template, special tokens) and generation_config.json (stop ids)
/// from elsewhere than beside it. Each is honoured, and the config validates.
#[test]
fn huggingface_model_tokenizer_arguments_name_the_files_used() {
    let dir = temp_checkpoint("hfmt", &[]);
    let config = dir.path().join("elsewhere_tokenizer_config.json");
    std::fs::write(
        &config,
        r#"{"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"}"#,
    )
    .unwrap();
    let generation = dir.path().join("elsewhere_generation_config.json");
    std::fs::write(&generation, r#"{"eos_token_id": [2004, 7]}"#).unwrap();
    let yaml = format!(
        "_component_: torchtune.modules.transforms.tokenizers.HuggingFaceModelTokenizer\ntokenizer_json_path: {}\ntokenizer_config_json_path: {}\ngeneration_config_path: {}\nmax_seq_len: 64\n",
        fixture("tiny-llama/tokenizer.json").display(),
        config.display(),
        generation.display()
    );
    let cfg: tune::config::schema::TokenizerConfig = serde_yaml::from_str(&yaml).unwrap();
    let tok = tune::setup::data::tokenizer(&cfg).unwrap();
    let text = tok
        .apply_chat_template(&[Message::new(Role::User, "hi")], false)
        .unwrap();
    assert_eq!(text, "<<hi>>");
    assert_eq!(tok.eos_id(), tok.token_to_id("<|eot_id|>"));
    assert!(tok.stop_ids().contains(&7), "{:?}", tok.stop_ids());
    // A named file that is missing is an error naming it.
    let yaml = yaml.replace("elsewhere_generation_config.json", "missing.json");
    let cfg: tune::config::schema::TokenizerConfig = serde_yaml::from_str(&yaml).unwrap();
    let err = tune::setup::data::tokenizer(&cfg).unwrap_err().to_string();
    assert!(err.contains("missing.json"), "{err}");
}

/// torchtune's `special_tokens_path` gives the special tokens' ids; tune reads them from the
/// model's tokenizer.json, so a file that agrees is accepted and one that does not is refused.
#[test]
fn special_tokens_path_must_agree_with_the_vocabulary() {
    let json = fixture("tiny-llama/tokenizer.json");
    let yaml = |special: &std::path::Path| {
        format!(
            "_component_: torchtune.models.llama3.llama3_tokenizer\npath: {}\nspecial_tokens_path: {}\n",
            json.display(),
            special.display()
        )
    };
    let cfg: tune::config::schema::TokenizerConfig = serde_yaml::from_str(&yaml(&json)).unwrap();
    tune::setup::data::tokenizer(&cfg).unwrap();
    let dir = temp_checkpoint("special", &[]);
    let other = dir.path().join("special.json");
    std::fs::write(
        &other,
        r#"{"added_tokens": [{"id": 7, "content": "<|eot_id|>"}]}"#,
    )
    .unwrap();
    let cfg: tune::config::schema::TokenizerConfig = serde_yaml::from_str(&yaml(&other)).unwrap();
    let err = tune::setup::data::tokenizer(&cfg).unwrap_err().to_string();
    assert!(
        err.contains("special_tokens_path") && err.contains("<|eot_id|>") && err.contains("id 7"),
        "{err}"
    );
}

/// A fixture case's messages and row inputs (`tools`, `chat_template_kwargs`), checked to
/// render as transformers rendered them (`rendered`), and tokenized for training with the
/// assistant messages trained.
fn rendered_and_tokenized(
    tok: &Tokenizer,
    name: &str,
    case: &serde_json::Value,
) -> (Vec<Message>, TemplateInputs, tune::data::SftSample) {
    let messages: Vec<Message> =
        serde_json::from_value(case["messages"].clone()).expect("messages");
    let inputs = TemplateInputs {
        tools: case.get("tools").cloned(),
        kwargs: case
            .get("chat_template_kwargs")
            .and_then(|k| k.as_object().cloned())
            .unwrap_or_default(),
    };
    let rendered = tok
        .apply_chat_template_with(&messages, false, &inputs)
        .expect("render");
    assert_eq!(rendered, case["rendered"].as_str().expect("str"), "{name}");
    let labeled: Vec<tune::data::LabeledMessage> = messages
        .iter()
        .map(|m| tune::data::LabeledMessage {
            masked: m.role != Role::Assistant,
            message: m.clone(),
            images: Vec::new(),
        })
        .collect();
    let sample = tune::data::tokenize_conversation(tok, &labeled, &inputs, None).expect("tokenize");
    (messages, inputs, sample)
}

/// gpt-oss's harmony chat template (gpt-oss's own, as TRL 1.16 ships it) on conversations in
/// the shape of the OpenAI cookbook's fine-tuning data, and a tool call with its result, the
/// row's tool definitions and `reasoning_effort: high` (tests/fixtures/make_harmony_fixture.py):
/// tune renders transformers' text, prompt and ids (the tools' TypeScript namespace, the call's
/// arguments and the result through `tojson`); an assistant's `thinking` and `tool_calls` reach
/// the template; and the trained tokens are those TRL's `assistant_only_loss`
/// trains, less each assistant turn's opening `<|start|>assistant`: tune masks a template's
/// assistant header as it does for every template (and, as torchtune's HuggingFaceModelTokenizer,
/// puts the tokenizer's BOS first).
#[test]
fn gpt_oss_harmony_template_renders_and_trains_as_transformers_and_trl() {
    let text = std::fs::read_to_string(fixture("harmony.json")).expect("harmony.json");
    let r: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(r["date"], "2025-01-01");
    let tok = Tokenizer::from_path(fixture("harmony"))
        .expect("load")
        .with_render_time(1_735_689_600);
    let bos = tok.bos_id().expect("gpt-oss names <|startoftext|>");
    let header = [
        tok.encode("<|start|>", false).expect("enc"),
        tok.encode("assistant", false).expect("enc"),
    ]
    .concat();
    let cases = r["cases"].as_object().expect("cases");
    assert_eq!(cases.len(), 4);
    for (name, case) in cases {
        let (messages, inputs, sample) = rendered_and_tokenized(&tok, name, case);
        let prompt = tok
            .apply_chat_template_with(&messages[..messages.len() - 1], true, &inputs)
            .expect("prompt");
        assert_eq!(prompt, case["prompt"].as_str().expect("str"), "{name}");
        let ids = ids(&case["ids"]);
        assert_eq!(sample.tokens[0], bos, "{name}");
        assert_eq!(sample.tokens[1..], ids[..], "{name}");
        // TRL's mask, less the header opening each trained run.
        let mut want: Vec<bool> = case["assistant_masks"]
            .as_array()
            .expect("mask")
            .iter()
            .map(|m| m.as_u64() == Some(1))
            .collect();
        let mut i = 0;
        while i < want.len() {
            if want[i] && (i == 0 || !want[i - 1]) {
                assert_eq!(
                    ids[i..i + header.len()],
                    header[..],
                    "{name}: a run opens with the header"
                );
                for w in &mut want[i..i + header.len()] {
                    *w = false;
                }
                i += header.len();
            }
            i += 1;
        }
        let trained: Vec<bool> = sample.labels[1..]
            .iter()
            .map(|&l| l != tune::data::IGNORE_INDEX)
            .collect();
        let show = |mask: &[bool]| {
            let kept: Vec<u32> = ids
                .iter()
                .zip(mask)
                .filter(|(_, m)| **m)
                .map(|(t, _)| *t)
                .collect();
            tok.decode(&kept, false).expect("decode")
        };
        assert_eq!(
            trained,
            want,
            "{name}: tune trains {:?}\nTRL less headers {:?}",
            show(&trained),
            show(&want)
        );
    }
}

/// Qwen3's own template (as TRL 1.16 ships it) with `reasoning_content` and a tool call: tune
/// renders transformers' text and ids, and trains each answer with the `<think>` block the
/// template writes before it (the last turn's; the template drops earlier turns' reasoning),
/// and the tool call (no text, `content: null`), each from after the assistant header through
/// `<|im_end|>` (tests/fixtures/make_harmony_fixture.py).
#[test]
fn qwen3_reasoning_content_renders_and_trains_with_its_answer() {
    let text = std::fs::read_to_string(fixture("qwen3_template.json")).expect("fixture");
    let r: serde_json::Value = serde_json::from_str(&text).expect("json");
    let tok = Tokenizer::from_path(fixture("qwen3-template")).expect("load");
    assert_eq!(tok.bos_id(), None);
    for (name, want_trained) in [
        (
            "reasoning_content_in_one_turn",
            "<think>\nTwo and two make four.\n</think>\n\n4<|im_end|>\n",
        ),
        (
            "two_turns_the_first_ones_reasoning_dropped",
            "Blue.<|im_end|><think>\nNot blue.\n</think>\n\nGreen.<|im_end|>",
        ),
        (
            "a_tool_call_its_result_and_the_answer",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"C\"}}\n</tool_call><|im_end|><think>\n\n</think>\n\nIt is 22 degrees in Paris.<|im_end|>",
        ),
    ] {
        let case = &r["cases"][name];
        let (_, _, sample) = rendered_and_tokenized(&tok, name, case);
        assert_eq!(sample.tokens, ids(&case["ids"]), "{name}");
        let trained: Vec<u32> = sample
            .tokens
            .iter()
            .zip(&sample.labels)
            .filter(|(_, l)| **l != tune::data::IGNORE_INDEX)
            .map(|(t, _)| *t)
            .collect();
        assert_eq!(
            tok.decode(&trained, false).expect("decode"),
            want_trained,
            "{name}"
        );
    }
}
