use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tune::data::*;
use tune::tokenizer::{Message, Tokenizer};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn tok(name: &str) -> Tokenizer {
    Tokenizer::from_path(fixtures().join(name)).expect("tokenizer")
}

/// A `dataset` entry as a config writes it; [`Entry::of`] reads it as a run does (the
/// config's reader, then setup's spec) with the builder of a kind.
struct Entry(serde_yaml::Value);

fn spec(yaml: &str) -> Entry {
    Entry(serde_yaml::from_str(yaml).expect("spec yaml"))
}

impl Entry {
    fn of(&self, kind: DatasetKind) -> DatasetSpec {
        let builder = match kind {
            DatasetKind::Alpaca => "alpaca_dataset",
            DatasetKind::Instruct => "instruct_dataset",
            DatasetKind::Chat => "chat_dataset",
            DatasetKind::MultimodalChat => "multimodal_chat_dataset",
            DatasetKind::TextCompletion => "text_completion_dataset",
            DatasetKind::Preference => "preference_dataset",
            DatasetKind::StackExchangePaired => "stack_exchange_paired_dataset",
            DatasetKind::Gsm8k => "gsm8k_dataset",
            DatasetKind::Gsm8kSft => "gsm8k_sft",
            DatasetKind::Prompt => "prompt_dataset",
        };
        let mut entry = match &self.0 {
            serde_yaml::Value::Mapping(m) => m.clone(),
            _ => serde_yaml::Mapping::new(),
        };
        entry.insert(
            "_component_".into(),
            format!("tune.datasets.{builder}").into(),
        );
        // Rows given in memory need no source; the builder must still have one.
        if !entry.contains_key("source") {
            entry.insert("source".into(), "json".into());
        }
        let cfg: tune::config::schema::DatasetConfig =
            serde_yaml::from_value(serde_yaml::Value::Mapping(entry)).expect("dataset entry");
        tune::setup::data::spec(&cfg)
    }
}

fn sft(ds: &Dataset) -> &[SftSample] {
    match ds.samples() {
        Samples::Sft(v) => v,
        other => panic!("expected sft samples, got {other:?}"),
    }
}

/// The trained tokens decoded (special tokens kept).
fn trained_text(t: &Tokenizer, s: &SftSample) -> String {
    let ids: Vec<u32> = s
        .labels
        .iter()
        .filter(|&&l| l != IGNORE_INDEX)
        .map(|&l| l as u32)
        .collect();
    t.decode(&ids, false).expect("decode")
}

fn alpaca_rows() -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(fixtures().join("alpaca_tiny.json")).expect("read");
    serde_json::from_str(&text).expect("json")
}

/// Scratch files live in cargo's per-target temporary folder (`target/tmp`), under fixed names
/// that each run overwrites, so nothing accumulates in `/tmp`.
fn temp_file(name: &str, text: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tune-data");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write");
    p
}

fn rows_of(values: Vec<serde_json::Value>) -> Vec<Row> {
    Row::inline("inline.json", values)
}

#[test]
fn alpaca_with_llama_template_masks_prompt() {
    let t = tok("tiny-llama");
    let s = spec(
        "_component_: torchtune.datasets.alpaca_dataset\nsource: json\ndata_files: alpaca_tiny.json\ntrain_on_input: false\n",
    );
    let ds = Dataset::build(&s.of(DatasetKind::Alpaca), &t, None, &fixtures()).expect("build");
    assert_eq!(ds.len(), 100);
    let row = &alpaca_rows()[0];
    let sample = &sft(&ds)[0];
    // the ids are exactly the rendered template tokenized once; BOS not doubled
    let prompt =
        ALPACA_PROMPT_NO_INPUT.replace("{instruction}", row["instruction"].as_str().expect("s"));
    let output = row["output"].as_str().expect("s");
    let rendered = t
        .apply_chat_template(
            &[Message::user(prompt.clone()), Message::assistant(output)],
            false,
        )
        .expect("render");
    assert_eq!(sample.tokens, t.encode(&rendered, false).expect("enc"));
    assert_eq!(sample.tokens[0], 2000);
    assert_ne!(sample.tokens[1], 2000);
    assert_eq!(sample.labels.len(), sample.tokens.len());
    // only the response and its <|eot_id|> are trained; the header is masked
    assert_eq!(
        trained_text(&t, sample),
        format!("{}<|eot_id|>", output.trim())
    );
    let header = t
        .apply_chat_template(&[Message::user(prompt)], true)
        .expect("render");
    let n_prompt = t.encode(&header, false).expect("enc").len();
    assert!(sample.labels[..n_prompt].iter().all(|&l| l == IGNORE_INDEX));
    assert!(sample.labels[n_prompt..].iter().all(|&l| l != IGNORE_INDEX));

    // a row with an input uses the "paired with an input" prompt
    let with_input = alpaca_rows()
        .iter()
        .position(|r| !r["input"].as_str().expect("s").is_empty())
        .expect("a row with input");
    let text = t.decode(&sft(&ds)[with_input].tokens, false).expect("dec");
    assert!(
        text.contains("paired with an input") && text.contains("### Input:\n"),
        "{text}"
    );

    // alpaca default: train_on_input = true -> everything trained
    let s = spec("source: json\ndata_files: [alpaca_tiny.json]\n");
    let ds = Dataset::build(&s.of(DatasetKind::Alpaca), &t, None, &fixtures()).expect("build");
    for sample in sft(&ds) {
        assert_eq!(
            sample.labels,
            sample
                .tokens
                .iter()
                .map(|&x| i64::from(x))
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn plain_format_without_template() {
    let mut t = tok("tiny-llama");
    t.set_chat_template(None).expect("unset");
    let s = spec("source: alpaca_tiny.json\ntrain_on_input: false\nsplit: train[:2]\n");
    let ds = Dataset::build(&s.of(DatasetKind::Alpaca), &t, None, &fixtures()).expect("build");
    assert_eq!(ds.len(), 2);
    let row = &alpaca_rows()[0];
    let prompt =
        ALPACA_PROMPT_NO_INPUT.replace("{instruction}", row["instruction"].as_str().expect("s"));
    let output = row["output"].as_str().expect("s");
    let p = t.encode(&prompt, false).expect("enc");
    let o = t.encode(output, false).expect("enc");
    let sample = &sft(&ds)[0];
    let expected: Vec<u32> = [vec![2000], p.clone(), o.clone(), vec![2004]].concat();
    assert_eq!(sample.tokens, expected);
    assert!(
        sample.labels[..1 + p.len()]
            .iter()
            .all(|&l| l == IGNORE_INDEX)
    );
    assert_eq!(trained_text(&t, sample), format!("{output}<|eot_id|>"));
}

#[test]
fn sharegpt_chat_both_templates() {
    let s = spec(
        "_component_: torchtune.datasets.chat_dataset\nsource: json\ndata_files: chat_tiny.json\nconversation_column: conversations\nconversation_style: sharegpt\n",
    );
    let t = tok("tiny-llama");
    let ds = Dataset::build(&s.of(DatasetKind::Chat), &t, None, &fixtures()).expect("build");
    let sample = &sft(&ds)[0];
    assert_eq!(
        trained_text(&t, sample),
        "The meaning of life is 42.<|eot_id|>I agree.<|eot_id|>"
    );
    let q = tok("tiny-qwen2");
    let ds = Dataset::build(&s.of(DatasetKind::Chat), &q, None, &fixtures()).expect("build");
    let sample = &sft(&ds)[0];
    assert_eq!(
        trained_text(&q, sample),
        "The meaning of life is 42.<|im_end|>\nI agree.<|im_end|>\n"
    );
    assert_eq!(sample.tokens[0], 2001, "no BOS for qwen");
    // the full ids equal the rendered conversation tokenized once
    let msgs = vec![
        Message::system("You are an AI assistant."),
        Message::user("What is the meaning of life?"),
        Message::assistant("The meaning of life is 42."),
        Message::user("That's ridiculous."),
        Message::assistant("I agree."),
    ];
    let full = q.apply_chat_template(&msgs, false).expect("render");
    assert_eq!(sample.tokens, q.encode(&full, false).expect("enc"));

    // new_system_prompt replaces the system message
    let s2 = spec("source: chat_tiny.json\nnew_system_prompt: Be terse.\ntrain_on_input: true\n");
    let ds = Dataset::build(&s2.of(DatasetKind::Chat), &q, None, &fixtures()).expect("build");
    let sample = &sft(&ds)[0];
    let text = q.decode(&sample.tokens, false).expect("dec");
    assert!(
        text.starts_with("<|im_start|>system\nBe terse.<|im_end|>")
            && !text.contains("AI assistant")
    );
    // system from new_system_prompt stays masked even with train_on_input (torchtune)
    assert_eq!(sample.labels[0], IGNORE_INDEX);
    assert!(trained_text(&q, sample).starts_with("<|im_start|>user\nWhat is"));
}

#[test]
fn openai_chat_from_rows() {
    let q = tok("tiny-qwen2");
    let rows = rows_of(vec![json!({"msgs": [
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello!"}
    ]})]);
    let s = spec("conversation_style: openai\ncolumn_map: {messages: msgs}\n");
    let ds = Dataset::from_rows(&rows, &s.of(DatasetKind::Chat), &q, None).expect("build");
    let sample = &sft(&ds)[0];
    assert_eq!(trained_text(&q, sample), "Hello!<|im_end|>\n");
    assert!(
        q.decode(&sample.tokens, false)
            .expect("dec")
            .contains("Hi there")
    );

    // A part of a type tune does not read (images are read: tests/suite/vision_data.rs).
    let bad = rows_of(vec![
        json!({"msgs": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]}),
    ]);
    let err = Dataset::from_rows(&bad, &s.of(DatasetKind::Chat), &q, None).expect_err("audio");
    assert!(
        err.to_string().contains("input_audio") && err.to_string().contains("row 0"),
        "{err}"
    );
}

/// A message's other keys reach the chat template: gpt-oss's renders an assistant's `thinking`
/// as its analysis channel, trained with the answer (the OpenAI cookbook's fine-tuning data,
/// HuggingFaceH4/Multilingual-Thinking, holds its reasoning there).
#[test]
fn openai_messages_keep_their_other_keys_for_the_template() {
    let harmony = tok("harmony");
    let rows = rows_of(vec![json!({"messages": [
        {"role": "developer", "content": "reasoning language: French"},
        {"role": "user", "content": "Capital of Australia?"},
        {"role": "assistant", "thinking": "Il demande la capitale.", "content": "Canberra."}
    ]})]);
    let s = spec("conversation_style: openai\n");
    let ds = Dataset::from_rows(&rows, &s.of(DatasetKind::Chat), &harmony, None).expect("build");
    assert_eq!(
        trained_text(&harmony, &sft(&ds)[0]),
        "<|channel|>analysis<|message|>Il demande la capitale.<|end|><|start|>assistant<|channel|>final<|message|>Canberra.<|return|>"
    );

    // A tool call comes without text (`content: null`) and trains as the call the template
    // writes; any other empty assistant message is still refused.
    let rows = rows_of(vec![json!({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ]},
        {"role": "tool", "content": "22 degrees"},
        {"role": "assistant", "content": "It is 22 degrees."}
    ]})]);
    let ds = Dataset::from_rows(&rows, &s.of(DatasetKind::Chat), &harmony, None).expect("build");
    assert_eq!(
        trained_text(&harmony, &sft(&ds)[0]),
        " to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|><|channel|>final<|message|>It is 22 degrees.<|return|>"
    );
    let rows = rows_of(vec![json!({"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": null}
    ]})]);
    let err =
        Dataset::from_rows(&rows, &s.of(DatasetKind::Chat), &harmony, None).expect_err("no text");
    assert!(
        err.to_string().contains("needs a string `content`"),
        "{err}"
    );
}

/// A chat row's `tools` and `chat_template_kwargs` columns reach the chat template, as TRL
/// passes them to `apply_chat_template` (gpt-oss: the tool's namespace in the developer
/// message, `Reasoning: high`); a tokenizer that formats without a template refuses them by
/// column.
#[test]
fn chat_rows_give_the_template_their_tools_and_keyword_arguments() {
    let harmony = tok("harmony");
    let rows = rows_of(vec![json!({
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Sunny."}
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather",
            "description": "The weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "chat_template_kwargs": {"reasoning_effort": "high"}
    })]);
    let s = spec("conversation_style: openai\n");
    let ds = Dataset::from_rows(&rows, &s.of(DatasetKind::Chat), &harmony, None).expect("build");
    let sample = &sft(&ds)[0];
    let text = harmony.decode(&sample.tokens, false).expect("decode");
    assert!(
        text.contains("Reasoning: high")
            && text.contains("type get_weather = (_: {\ncity?: string,\n}) => any;"),
        "{text}"
    );
    assert_eq!(
        trained_text(&harmony, sample),
        "<|channel|>final<|message|>Sunny.<|return|>"
    );

    let mut plain = tok("tiny-llama");
    plain.set_chat_template(None).expect("unset");
    let err =
        Dataset::from_rows(&rows, &s.of(DatasetKind::Chat), &plain, None).expect_err("no template");
    assert!(err.to_string().contains("`tools`"), "{err}");
    let bad = rows_of(vec![json!({
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        "chat_template_kwargs": "high"
    })]);
    let err = Dataset::from_rows(&bad, &s.of(DatasetKind::Chat), &harmony, None).expect_err("type");
    assert!(err.to_string().contains("chat_template_kwargs"), "{err}");
}

#[test]
fn instruct_with_column_map() {
    let q = tok("tiny-qwen2");
    let s = spec(
        "_component_: torchtune.datasets.instruct_dataset\nsource: json\ndata_files: instruct_tiny.json\ncolumn_map:\n  input: instruction\n  output: response\n",
    );
    let ds = Dataset::build(&s.of(DatasetKind::Instruct), &q, None, &fixtures()).expect("build");
    assert_eq!(ds.len(), 2);
    assert_eq!(
        trained_text(&q, &sft(&ds)[0]),
        "It is 10:00 AM in London<|im_end|>\n"
    );
    let text = q.decode(&sft(&ds)[0].tokens, false).expect("dec");
    assert_eq!(
        text,
        "<|im_start|>user\nWhat time is it in London?<|im_end|>\n<|im_start|>assistant\nIt is 10:00 AM in London<|im_end|>\n"
    );
    // without the column_map the error names the file, row, column and the fix
    let s = spec("source: json\ndata_files: instruct_tiny.json\n");
    let err =
        Dataset::build(&s.of(DatasetKind::Instruct), &q, None, &fixtures()).expect_err("missing");
    let msg = err.to_string();
    assert!(
        matches!(err, DataError::MissingColumn { row: 0, .. }),
        "{msg}"
    );
    assert!(
        msg.contains("instruct_tiny.json") && msg.contains("`input`") && msg.contains("column_map"),
        "{msg}"
    );
    assert!(msg.contains("instruction, response"), "{msg}");
}

#[test]
fn truncation_keeps_eos() {
    let t = tok("tiny-llama");
    let s = spec("source: alpaca_tiny.json\nsplit: train[:5]\n");
    let ds = Dataset::build(&s.of(DatasetKind::Alpaca), &t, Some(32), &fixtures()).expect("build");
    for sample in sft(&ds) {
        assert_eq!(sample.tokens.len(), 32);
        assert_eq!(sample.tokens[31], 2004);
        assert_eq!(sample.labels[31], IGNORE_INDEX);
        assert_eq!(sample.tokens[0], 2000);
    }
}

#[test]
fn packing_alpaca() {
    let t = tok("tiny-llama");
    let unpacked = Dataset::build(
        &spec("source: alpaca_tiny.json\n").of(DatasetKind::Alpaca),
        &t,
        Some(512),
        &fixtures(),
    )
    .expect("build");
    let ds = Dataset::build(
        &spec("source: alpaca_tiny.json\npacked: true\n").of(DatasetKind::Alpaca),
        &t,
        Some(512),
        &fixtures(),
    )
    .expect("build");
    let Samples::Packed(packs) = ds.samples() else {
        panic!("packed")
    };
    let total: usize = sft(&unpacked).iter().map(|s| s.len()).sum();
    assert!(
        packs.len() >= total.div_ceil(512) && packs.len() < 100,
        "{} packs",
        packs.len()
    );
    let samples = sft(&unpacked);
    let mut next = 0;
    for p in packs {
        assert_eq!(
            (
                p.tokens.len(),
                p.labels.len(),
                p.position_ids.len(),
                p.document_ids.len()
            ),
            (512, 512, 512, 512)
        );
        let lens = p.seq_lens();
        let mut off = 0;
        for (d, &len) in lens.iter().enumerate() {
            assert!(
                p.document_ids[off..off + len]
                    .iter()
                    .all(|&x| x == d as u32)
            );
            let is_sample = next < samples.len() && p.tokens[off] == 2000;
            if is_sample {
                let s = &samples[next];
                assert_eq!(&p.tokens[off..off + len], &s.tokens[..]);
                assert_eq!(&p.labels[off..off + len], &s.labels[..]);
                let pos: Vec<u32> = (0..len as u32).collect();
                assert_eq!(
                    &p.position_ids[off..off + len],
                    &pos[..],
                    "positions restart per sample"
                );
                next += 1;
            } else {
                assert_eq!(d, lens.len() - 1, "padding is the last document");
                // torchtune's PackedDataset pads with id 0 whatever the tokenizer
                assert!(p.tokens[off..].iter().all(|&x| x == 0));
                assert!(p.labels[off..].iter().all(|&x| x == IGNORE_INDEX));
                let last = p.position_ids[off - 1];
                assert_eq!(
                    p.position_ids[off],
                    (last + 1).min(511),
                    "padding positions continue"
                );
            }
            off += len;
        }
    }
    assert_eq!(next, 100, "every sample packed once, in order");
    // collate: packed batch carries document ids
    let b = ds.collate(&[0, 1]).expect("collate");
    assert_eq!((b.batch_size, b.seq_len), (2, 512));
    assert_eq!(b.document_ids.as_ref().map(Vec::len), Some(1024));
    assert_eq!(&b.position_ids[..512], &packs[0].position_ids[..]);
}

#[test]
fn preference_hh_rlhf() {
    let t = tok("tiny-llama");
    let s = spec(
        "_component_: torchtune.datasets.preference_dataset\nsource: json\ndata_files: hh_rlhf_tiny.json\n",
    );
    let ds = Dataset::build(&s.of(DatasetKind::Preference), &t, None, &fixtures()).expect("build");
    let Samples::Preference(pairs) = ds.samples() else {
        panic!("preference")
    };
    let p = &pairs[0];
    assert_eq!(trained_text(&t, &p.chosen), "Fix the hole.<|eot_id|>");
    assert_eq!(trained_text(&t, &p.rejected), "Take them off.<|eot_id|>");
    let n_prompt = p
        .chosen
        .labels
        .iter()
        .position(|&l| l != IGNORE_INDEX)
        .expect("trained");
    assert_eq!(
        p.chosen.tokens[..n_prompt],
        p.rejected.tokens[..n_prompt],
        "same masked prompt"
    );
    let b = ds.collate(&[0]).expect("collate");
    assert_eq!(b.batch_size, 2);
    let len = p.chosen.len().max(p.rejected.len());
    assert_eq!(b.seq_len, len);
    assert_eq!(&b.row_tokens(0)[..p.chosen.len()], &p.chosen.tokens[..]);
    assert_eq!(&b.row_tokens(1)[..p.rejected.len()], &p.rejected.tokens[..]);
    assert!(
        b.row_tokens(1)[p.rejected.len()..]
            .iter()
            .all(|&x| x == 2005)
    );
    assert!(
        b.row_labels(1)[p.rejected.len()..]
            .iter()
            .all(|&x| x == IGNORE_INDEX)
    );
    assert_eq!(
        b.num_trained_tokens,
        p.chosen.num_trained() + p.rejected.num_trained()
    );
    assert!(matches!(
        Dataset::build(
            &spec("source: hh_rlhf_tiny.json\npacked: true\n").of(DatasetKind::Preference),
            &t,
            Some(64),
            &fixtures()
        ),
        Err(DataError::Spec { .. })
    ));
}

#[test]
fn preference_stack_exchange_paired() {
    let q = tok("tiny-qwen2");
    let s = spec(
        "_component_: torchtune.datasets.stack_exchange_paired_dataset\nsource: json\ndata_files: stack_exchange_paired_tiny.json\n",
    );
    let ds = Dataset::build(
        &s.of(DatasetKind::StackExchangePaired),
        &q,
        Some(256),
        &fixtures(),
    )
    .expect("build");
    let Samples::Preference(pairs) = ds.samples() else {
        panic!("preference")
    };
    assert_eq!(pairs.len(), 25);
    let text =
        std::fs::read_to_string(fixtures().join("stack_exchange_paired_tiny.json")).expect("r");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&text).expect("json");
    for (p, row) in pairs.iter().zip(&rows) {
        for (side, col) in [(&p.chosen, "response_j"), (&p.rejected, "response_k")] {
            assert!(side.len() <= 256);
            let header = q
                .apply_chat_template(&[Message::user(row["question"].as_str().expect("q"))], true)
                .expect("render");
            let n_prompt = q.encode(&header, false).expect("enc").len().min(side.len());
            assert!(
                side.labels[..n_prompt].iter().all(|&l| l == IGNORE_INDEX),
                "prompt masked"
            );
            if n_prompt < 250 {
                let trained = trained_text(&q, side);
                let answer: String = row[col].as_str().expect("a").chars().take(8).collect();
                assert!(trained.starts_with(&answer), "{trained:?} vs {answer:?}");
            }
        }
    }
}

#[test]
fn text_completion_and_other_formats() {
    let t = tok("tiny-llama");
    let s = spec(
        "_component_: torchtune.datasets.text_completion_dataset\nsource: json\ndata_files: alpaca_tiny.json\ncolumn: output\nsplit: train[:3]\n",
    );
    let ds =
        Dataset::build(&s.of(DatasetKind::TextCompletion), &t, None, &fixtures()).expect("build");
    let out = alpaca_rows()[0]["output"].as_str().expect("s").to_string();
    let sample = &sft(&ds)[0];
    let expected: Vec<u32> = [t.encode(&out, true).expect("enc"), vec![2004]].concat();
    assert_eq!(sample.tokens, expected);
    assert_eq!(
        sample.labels,
        expected.iter().map(|&x| i64::from(x)).collect::<Vec<_>>()
    );
    // add_eos: false, truncation to max_seq_len - 1 (torchtune)
    let s = spec(
        "source: json\ndata_files: alpaca_tiny.json\ncolumn: output\nadd_eos: false\nsplit: train[:3]\n",
    );
    let ds = Dataset::build(
        &s.of(DatasetKind::TextCompletion),
        &t,
        Some(10),
        &fixtures(),
    )
    .expect("build");
    assert_eq!(
        sft(&ds)[0].tokens,
        t.encode(&out, true).expect("enc")[..9].to_vec()
    );

    // .txt and .jsonl and .csv sources
    let txt = temp_file("lines.txt", "first line\n\nsecond line\n");
    let ds = Dataset::build(
        &spec(&format!("source: {}\n", txt.display())).of(DatasetKind::TextCompletion),
        &t,
        None,
        Path::new("/"),
    )
    .expect("txt");
    assert_eq!(ds.len(), 2);
    let jsonl = temp_file(
        "rows.jsonl",
        "{\"input\": \"a\", \"output\": \"b\"}\n{\"input\": \"c\", \"output\": \"d\"}\n",
    );
    let ds = Dataset::build(
        &spec(&format!("source: json\ndata_files: {}\n", jsonl.display()))
            .of(DatasetKind::Instruct),
        &t,
        None,
        Path::new("/"),
    )
    .expect("jsonl");
    assert_eq!(ds.len(), 2);
    let csv = temp_file(
        "rows.csv",
        "question,answer\n\"What, really?\",Yes\nWhy,Because\n",
    );
    let s = spec(&format!(
        "source: csv\ndata_files: {}\ncolumn_map: {{input: question, output: answer}}\n",
        csv.display()
    ));
    let ds = Dataset::build(&s.of(DatasetKind::Instruct), &t, None, Path::new("/")).expect("csv");
    assert_eq!(trained_text(&t, &sft(&ds)[0]), "Yes<|eot_id|>");
    assert!(
        t.decode(&sft(&ds)[0].tokens, false)
            .expect("d")
            .contains("What, really?")
    );
}

#[test]
fn bad_rows_name_file_row_column() {
    let t = tok("tiny-llama");
    let build = |name: &str, text: &str, kind: DatasetKind| {
        let p = temp_file(name, text);
        Dataset::build(
            &spec(&format!("source: {}\n", p.display())).of(kind),
            &t,
            None,
            Path::new("/"),
        )
        .expect_err("bad row")
        .to_string()
    };
    let msg = build(
        "missing.json",
        r#"[{"instruction": "a", "output": "b"}, {"instruction": "c"}]"#,
        DatasetKind::Alpaca,
    );
    assert!(
        msg.contains("missing.json")
            && msg.contains("row 1")
            && msg.contains("`output`")
            && msg.contains("column_map"),
        "{msg}"
    );
    let msg = build(
        "type.json",
        r#"[{"instruction": "a", "output": 3}]"#,
        DatasetKind::Alpaca,
    );
    assert!(
        msg.contains("type.json")
            && msg.contains("row 0")
            && msg.contains("`output`")
            && msg.contains("expected a string, found a number"),
        "{msg}"
    );
    let msg = build(
        "empty.json",
        r#"[{"instruction": "a", "output": "  "}]"#,
        DatasetKind::Alpaca,
    );
    assert!(
        msg.contains("row 0") && msg.contains("`output` is empty"),
        "{msg}"
    );
    let msg = build(
        "sharegpt.json",
        r#"[{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]}]"#,
        DatasetKind::Chat,
    );
    assert!(
        msg.contains("row 0") && msg.contains("message 1") && msg.contains("\"bot\""),
        "{msg}"
    );
    let msg = build(
        "noanswer.json",
        r#"[{"conversations": [{"from": "human", "value": "hi"}]}]"#,
        DatasetKind::Chat,
    );
    assert!(msg.contains("no assistant message"), "{msg}");
    let msg = build(
        "pref.json",
        r#"[{"chosen": "text", "rejected": []}]"#,
        DatasetKind::Preference,
    );
    assert!(
        msg.contains("`chosen`") && msg.contains("a list of"),
        "{msg}"
    );
    let msg = build(
        "broken.jsonl",
        "{\"text\": \"a\"}\n{\"text\": \n",
        DatasetKind::TextCompletion,
    );
    assert!(
        msg.contains("broken.jsonl") && msg.contains("line 2"),
        "{msg}"
    );
    let msg = build(
        "notobj.json",
        r#"["just text"]"#,
        DatasetKind::TextCompletion,
    );
    assert!(msg.contains("row 0 is not a JSON object"), "{msg}");

    let err = Dataset::build(
        &spec("source: tatsu-lab/alpaca\n").of(DatasetKind::Alpaca),
        &t,
        None,
        &fixtures(),
    )
    .expect_err("hub");
    assert!(
        matches!(&err, DataError::HubDatasetNotAvailable { repo } if repo == "tatsu-lab/alpaca"),
        "{err}"
    );
    let err = Dataset::build(
        &spec("source: json\n").of(DatasetKind::Alpaca),
        &t,
        None,
        &fixtures(),
    )
    .expect_err("no files");
    assert!(err.to_string().contains("data_files"), "{err}");
    let err = Dataset::build(
        &spec("source: alpaca_tiny.json\nsplit: test\n").of(DatasetKind::Alpaca),
        &t,
        None,
        &fixtures(),
    )
    .expect_err("split");
    assert!(err.to_string().contains("split: test"), "{err}");
    let err = Dataset::build(
        &spec("source: alpaca_tiny.json\npacked: true\n").of(DatasetKind::Alpaca),
        &t,
        None,
        &fixtures(),
    )
    .expect_err("pack len");
    assert!(err.to_string().contains("max_seq_len"), "{err}");
}

/// A config's `dataset` entry becomes the data layer's spec with the builder's kind and
/// torchtune's defaults for what it leaves out.
#[test]
fn a_dataset_entry_becomes_the_data_layers_spec() {
    let s = spec(
        "source: json\ndata_files: [a.json, b.json]\nsplit: train\nconversation_column: messages\nconversation_style: openai\ncolumn_map: {messages: conv}\ntrain_on_input: False\npacked: False\nnew_system_prompt: null\nfilter_fn: null\n",
    )
    .of(DatasetKind::Chat);
    assert_eq!(s.kind, DatasetKind::Chat);
    assert_eq!(
        s.data_files,
        vec!["a.json".to_string(), "b.json".to_string()]
    );
    assert_eq!(s.conversation_style, ConversationStyle::Openai);
    assert_eq!(
        s.column_map,
        BTreeMap::from([("messages".to_string(), "conv".to_string())])
    );
    assert!(!s.train_on_input);
    // Left out: each builder's defaults (alpaca trains on its prompt, text completion splits
    // across packs) and the builder's own Hub source.
    let alpaca = spec("{}").of(DatasetKind::Alpaca);
    assert!(alpaca.train_on_input && !alpaca.split_across_pack && alpaca.add_eos);
    assert!(spec("{}").of(DatasetKind::TextCompletion).split_across_pack);
    let cfg: tune::config::schema::DatasetConfig =
        serde_yaml::from_str("_component_: torchtune.datasets.hh_rlhf_helpful_dataset").unwrap();
    let hh = tune::setup::data::spec(&cfg);
    assert_eq!(hh.kind, DatasetKind::Preference);
    assert_eq!(
        hh.source.as_deref(),
        Some("RLHFlow/HH-RLHF-Helpful-standard")
    );
}

#[test]
fn loader_is_deterministic_and_resumable() {
    let cfg = LoaderConfig {
        batch_size: 8,
        shuffle: true,
        seed: 42,
        drop_last: true,
    };
    let dl = DataLoader::new(100, cfg).expect("loader");
    assert_eq!(dl.num_batches(), 12);
    let e0 = dl.batches_for_epoch(0);
    assert_eq!(
        e0,
        DataLoader::new(100, cfg).expect("l").batches_for_epoch(0)
    );
    assert_eq!(e0.len(), 12);
    assert!(e0.iter().all(|b| b.len() == 8));
    let e1 = dl.batches_for_epoch(1);
    assert_ne!(e0, e1);
    // epoch e uses seed + e
    let other = DataLoader::new(100, LoaderConfig { seed: 43, ..cfg }).expect("l");
    assert_eq!(other.batches_for_epoch(0), e1);
    let mut order = dl.epoch_order(3);
    order.sort_unstable();
    assert_eq!(order, (0..100).collect::<Vec<_>>());
    // resume at batch 5 of epoch 1 without replaying: the tail is the same lists
    assert_eq!(&dl.batches_for_epoch(1)[5..], &e1[5..]);
    let keep = DataLoader::new(
        10,
        LoaderConfig {
            batch_size: 4,
            shuffle: false,
            seed: 0,
            drop_last: false,
        },
    )
    .expect("l");
    assert_eq!(
        keep.batches_for_epoch(0),
        vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]
    );
    assert!(
        DataLoader::new(
            10,
            LoaderConfig {
                batch_size: 0,
                ..cfg
            }
        )
        .is_err()
    );

    // collate right-pads with pad id / -100 and counts shifted trained tokens
    let t = tok("tiny-llama");
    let ds = Dataset::build(
        &spec("source: instruct_tiny.json\ncolumn_map: {input: instruction, output: response}\n")
            .of(DatasetKind::Instruct),
        &t,
        None,
        &fixtures(),
    )
    .expect("build");
    let b = ds.collate(&[0, 1]).expect("collate");
    let s = sft(&ds);
    assert_eq!(b.seq_len, s[0].len().max(s[1].len()));
    assert_eq!(b.tokens.len(), 2 * b.seq_len);
    let short = if s[0].len() < s[1].len() { 0 } else { 1 };
    assert!(
        b.row_tokens(short)[s[short].len()..]
            .iter()
            .all(|&x| x == 2005)
    );
    assert!(
        b.row_labels(short)[s[short].len()..]
            .iter()
            .all(|&x| x == IGNORE_INDEX)
    );
    assert_eq!(
        b.num_trained_tokens,
        s[0].num_trained() + s[1].num_trained()
    );
    assert_eq!(&b.position_ids[..3], &[0, 1, 2]);
    assert!(b.document_ids.is_none());
    assert!(ds.collate(&[5]).is_err());
}

/// A checkpoint folder with the tiny-llama tokenizer and a custom chat template.
fn llama_with_template(name: &str, template: &str) -> Tokenizer {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("tune-data-tpl-{name}"));
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::copy(
        fixtures().join("tiny-llama/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .expect("copy");
    let cfg = json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|pad|>", "chat_template": template});
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).expect("write");
    Tokenizer::from_path(&dir).expect("tokenizer")
}

#[test]
fn template_without_bos_or_eos_gets_them_added() {
    let t = llama_with_template(
        "plain",
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    );
    let rows = rows_of(vec![json!({"input": "Hi", "output": "Yo there"})]);
    let ds = Dataset::from_rows(&rows, &DatasetSpec::new(DatasetKind::Instruct), &t, None)
        .expect("build");
    let s = &sft(&ds)[0];
    assert_eq!(s.tokens[0], 2000, "BOS prepended");
    assert_eq!(s.labels[0], IGNORE_INDEX);
    assert_eq!(*s.tokens.last().expect("last"), 2004, "EOS appended");
    assert_eq!(trained_text(&t, s), " Yo there\n<|eot_id|>");
}

#[test]
fn non_prefix_stable_template_falls_back_to_search() {
    // the marker moves with the last message, so prefixes do not render as prefixes
    let t = llama_with_template(
        "unstable",
        "{{ bos_token }}{% for m in messages %}{% if loop.last %}[LAST]{% endif %}{{ m.role }}: {{ m.content | trim }}<|eot_id|>{% endfor %}",
    );
    let rows = rows_of(vec![json!({"conversations": [
        {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo there"},
        {"from": "human", "value": "More"}, {"from": "gpt", "value": " Fine. "}
    ]})]);
    let ds =
        Dataset::from_rows(&rows, &DatasetSpec::new(DatasetKind::Chat), &t, None).expect("build");
    let s = &sft(&ds)[0];
    assert_eq!(s.tokens[0], 2000);
    assert_ne!(s.tokens[1], 2000, "BOS not doubled");
    assert_eq!(trained_text(&t, s), " Yo there<|eot_id|> Fine.<|eot_id|>");
}

#[test]
fn parquet_sources_give_the_same_samples_as_json() {
    let t = tok("tiny-llama");
    // Snappy-compressed, three row groups, as `datasets`/pyarrow write them.
    let from_json = spec(
        "_component_: torchtune.datasets.alpaca_dataset\nsource: json\ndata_files: alpaca_tiny.json\n",
    );
    let from_parquet = spec(
        "_component_: torchtune.datasets.alpaca_dataset\nsource: parquet\ndata_files: alpaca_tiny.parquet\n",
    );
    let by_path =
        spec("_component_: torchtune.datasets.alpaca_dataset\nsource: alpaca_tiny.parquet\n");
    let want =
        Dataset::build(&from_json.of(DatasetKind::Alpaca), &t, None, &fixtures()).expect("json");
    for s in [from_parquet, by_path] {
        let got =
            Dataset::build(&s.of(DatasetKind::Alpaca), &t, None, &fixtures()).expect("parquet");
        assert_eq!(got.len(), 100);
        assert_eq!(sft(&got), sft(&want));
    }

    // A zstd-compressed chat file whose column is a list of {from, value} structs.
    let chat = |file: &str| {
        spec(&format!(
            "_component_: torchtune.datasets.chat_dataset\nsource: {file}\nconversation_column: conversations\nconversation_style: sharegpt\n"
        ))
    };
    let want = Dataset::build(
        &chat("chat_tiny.json").of(DatasetKind::Chat),
        &t,
        None,
        &fixtures(),
    )
    .expect("json");
    let got = Dataset::build(
        &chat("chat_tiny.parquet").of(DatasetKind::Chat),
        &t,
        None,
        &fixtures(),
    )
    .expect("parquet");
    assert_eq!(sft(&got), sft(&want));
}

#[test]
fn a_corrupt_parquet_file_is_named() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tune-data-parquet");
    std::fs::create_dir_all(&dir).unwrap();
    let bytes = std::fs::read(fixtures().join("alpaca_tiny.parquet")).unwrap();
    std::fs::write(dir.join("broken.parquet"), &bytes[..bytes.len() / 2]).unwrap();
    let t = tok("tiny-llama");
    let s = spec("_component_: torchtune.datasets.alpaca_dataset\nsource: broken.parquet\n");
    let err = match Dataset::build(&s.of(DatasetKind::Alpaca), &t, None, &dir) {
        Ok(_) => panic!("a truncated file fails"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("broken.parquet") && err.contains("Parquet"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
