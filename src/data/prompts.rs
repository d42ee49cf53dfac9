//! Prompt datasets of the RL recipes (GRPO): each row becomes the prompt's token ids, the prompt
//! text and the row's other columns, which the reward functions read (a gsm8k row's `answer`).
//! Nothing is trained on these tokens; the recipe generates the completions.
//!
//! - `gsm8k_dataset` (torchtune's `torchtune.dev.grpo.gsm8k.gsm8k_dataset`): torchtune's R1
//!   preamble around the question, encoded as plain text (BOS, no EOS, no chat format), the
//!   answer after `#### ` in the `answer` column, and `partition` to keep a share of the rows.
//! - `prompt_dataset`: the `prompt` column (or the one `column_map: {prompt: ...}` names) as a
//!   user turn in the tokenizer component's chat format, ending at the assistant's header; with
//!   `apply_chat_template: False` the text as it is (BOS, no EOS).

use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

use super::error::{DataError, Result, TokenizeError};
use super::gsm8k::{GSM8K_PROMPT_AFTER, GSM8K_PROMPT_BEFORE, column_text as text, gsm8k_parts};
use super::source::{Row, kind_name, load_rows};
use super::spec::{DatasetKind, DatasetSpec};
use super::tokenize::{
    check_template_inputs, encode_rendered_prompt, tokenize_prompt, tokenize_text,
};
use super::transform::{LabeledMessage, template_inputs};
use crate::tokenizer::{Message, Role, TemplateInputs, Tokenizer};

/// One prompt of an RL dataset.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptSample {
    /// The prompt's token ids, as the policy is given them.
    pub tokens: Vec<u32>,
    /// The prompt text before the chat format (for gsm8k, the question inside torchtune's
    /// preamble, as torchtune's sample holds it): what reward functions see as `prompt`.
    pub prompt: String,
    /// The row's other columns (for gsm8k: `question`, and `answer` and `cot` parsed from the
    /// solution).
    pub columns: Map<String, Value>,
}

/// torchtune's gsm8k `partition: "start-end/total"`: row `i` (of the split) is kept when
/// `start <= i % total <= end`, so `1-9/10` keeps 9 rows in 10 and `0-0/10` the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partition {
    pub start: usize,
    pub end: usize,
    pub total: usize,
}

impl Partition {
    /// Parses `start-end/total` (decimal digits, as torchtune's `^(\d+)-(\d+)/(\d+)$`); the
    /// error says what is wrong.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        let bad = || format!("`partition: {s}` is not `start-end/total` (e.g. `1-9/10`)");
        let (range, total) = s.split_once('/').ok_or_else(bad)?;
        let (start, end) = range.split_once('-').ok_or_else(bad)?;
        let num = |t: &str| {
            if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            t.parse::<usize>().map_err(|_| bad())
        };
        let p = Partition {
            start: num(start)?,
            end: num(end)?,
            total: num(total)?,
        };
        if p.total == 0 {
            return Err(format!(
                "`partition: {s}` divides the rows into 0 parts; `total` must be at least 1"
            ));
        }
        Ok(p)
    }

    pub fn keeps(&self, index: usize) -> bool {
        (self.start..=self.end).contains(&(index % self.total))
    }
}

/// The prompts of one dataset, held in memory.
#[derive(Debug, Clone, Default)]
pub struct PromptDataset {
    samples: Vec<PromptSample>,
}

impl PromptDataset {
    /// Loads the files `spec` names (relative paths from `base_dir`) and builds the prompts.
    /// `max_seq_len` (the tokenizer component's) truncates `text_completion_dataset`'s
    /// prompts, as torchtune's text completion dataset truncates its tokens.
    pub fn build(
        spec: &DatasetSpec,
        tokenizer: &Tokenizer,
        max_seq_len: Option<usize>,
        base_dir: &Path,
    ) -> Result<Self> {
        let rows = load_rows(spec, base_dir)?;
        Self::from_rows(&rows, spec, tokenizer, max_seq_len)
    }

    /// As [`PromptDataset::build`], from rows already loaded (after `split`).
    pub fn from_rows(
        rows: &[Row],
        spec: &DatasetSpec,
        tokenizer: &Tokenizer,
        max_seq_len: Option<usize>,
    ) -> Result<Self> {
        let partition = match &spec.partition {
            Some(p) if spec.kind == DatasetKind::Gsm8k => {
                Some(Partition::parse(p).map_err(|message| DataError::Spec { message })?)
            }
            Some(_) => {
                return Err(DataError::Spec {
                    message: "`partition` is a gsm8k_dataset setting; select rows of other datasets with `split: train[a:b]`".into(),
                });
            }
            None => None,
        };
        let mut samples = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            if partition.is_some_and(|p| !p.keeps(i)) {
                continue;
            }
            let sample = match spec.kind {
                DatasetKind::Gsm8k => gsm8k(row, &spec.column_map, tokenizer)?,
                DatasetKind::Prompt => prompt(row, spec, tokenizer)?,
                DatasetKind::TextCompletion => text_completion(row, spec, tokenizer, max_seq_len)?,
                other => {
                    return Err(DataError::Spec {
                        message: format!(
                            "{other:?} datasets hold responses to train on, not prompts to generate from; use gsm8k_dataset, prompt_dataset or text_completion_dataset"
                        ),
                    });
                }
            };
            samples.push(sample);
        }
        Ok(Self { samples })
    }

    /// The prompts of every part, in order (torchtune concatenates a list of datasets).
    pub fn concat(parts: Vec<PromptDataset>) -> Self {
        Self {
            samples: parts.into_iter().flat_map(|p| p.samples).collect(),
        }
    }

    pub fn samples(&self) -> &[PromptSample] {
        &self.samples
    }

    pub fn get(&self, index: usize) -> Option<&PromptSample> {
        self.samples.get(index)
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}

/// The token ids of a generation prompt: with `chat`, a user turn (after the system message,
/// if any) ending at the assistant's header, in the tokenizer component's torchtune format or
/// else the checkpoint's chat template (rendered with the generation prompt, encoded as
/// [`encode_rendered_prompt`]: BOS first, as in training); without `chat`, the text with BOS
/// and no EOS (torchtune's `encode(text, add_eos=False)`). The generate recipe's prompt too.
pub fn prompt_tokens(
    tok: &Tokenizer,
    system: Option<&str>,
    user: &str,
    chat: bool,
) -> std::result::Result<Vec<u32>, TokenizeError> {
    prompt_tokens_with(tok, system, user, chat, &TemplateInputs::default())
}

/// [`prompt_tokens`] with a row's tools and template keyword arguments, which only the
/// checkpoint's chat template reads (refused otherwise, naming the column).
fn prompt_tokens_with(
    tok: &Tokenizer,
    system: Option<&str>,
    user: &str,
    chat: bool,
    inputs: &TemplateInputs,
) -> std::result::Result<Vec<u32>, TokenizeError> {
    check_template_inputs(inputs, chat && !tok.format().format.is_torchtune())?;
    if !chat {
        return Ok(tokenize_text(tok, user, false, None)?.tokens);
    }
    if tok.format().format.is_torchtune() {
        let mut messages: Vec<LabeledMessage> = system
            .map(|s| LabeledMessage::new(Role::System, s, true))
            .into_iter()
            .collect();
        messages.push(LabeledMessage::new(Role::User, user, true));
        messages.push(LabeledMessage::new(Role::Assistant, "", false));
        return tokenize_prompt(tok, &messages);
    }
    let mut messages: Vec<Message> = system.map(Message::system).into_iter().collect();
    messages.push(Message::user(user));
    let text = tok.apply_chat_template_with(&messages, true, inputs)?;
    encode_rendered_prompt(tok, &text)
}

/// A row's object, or the error naming the row.
fn object(row: &Row) -> Result<&Map<String, Value>> {
    row.value
        .as_object()
        .ok_or_else(|| DataError::RowNotObject {
            path: (*row.file).clone(),
            row: row.index,
            found: kind_name(&row.value).to_string(),
        })
}

fn tokenize_err(row: &Row) -> impl FnOnce(TokenizeError) -> DataError + '_ {
    move |source| DataError::Tokenize {
        path: (*row.file).clone(),
        row: row.index,
        source,
    }
}

/// torchtune's `normalize_gsm` then `RLDataset._prepare_sample`: the solution splits at its one
/// `#### ` into the chain of thought and the answer; the prompt is `BASE_PROMPT % question`.
fn gsm8k(row: &Row, map: &BTreeMap<String, String>, tok: &Tokenizer) -> Result<PromptSample> {
    let obj = object(row)?;
    let (question, cot, answer) = gsm8k_parts(row, obj, map)?;
    let prompt = format!("{GSM8K_PROMPT_BEFORE}{question}{GSM8K_PROMPT_AFTER}");
    let tokens = prompt_tokens(tok, None, &prompt, false).map_err(tokenize_err(row))?;
    let mut columns = obj.clone();
    columns.insert("question".into(), Value::String(question.to_string()));
    columns.insert("cot".into(), Value::String(cot.to_string()));
    columns.insert("answer".into(), Value::String(answer.to_string()));
    Ok(PromptSample {
        tokens,
        prompt,
        columns,
    })
}

/// `prompt_dataset`: the prompt column, formatted unless `apply_chat_template: False`.
fn prompt(row: &Row, spec: &DatasetSpec, tok: &Tokenizer) -> Result<PromptSample> {
    let obj = object(row)?;
    let (prompt, column) = text(row, obj, &spec.column_map, "prompt")?;
    if prompt.trim().is_empty() {
        return Err(DataError::EmptyValue {
            path: (*row.file).clone(),
            row: row.index,
            column,
        });
    }
    let system = spec.new_system_prompt.as_deref();
    let inputs = template_inputs(row, obj)?;
    let tokens = prompt_tokens_with(tok, system, prompt, spec.apply_chat_template, &inputs)
        .map_err(tokenize_err(row))?;
    let mut columns = obj.clone();
    columns.remove(&column);
    Ok(PromptSample {
        tokens,
        prompt: prompt.to_string(),
        columns,
    })
}

/// `text_completion_dataset` as PPO's prompts (torchtune's PPO configs): the `column` (default
/// `text`) encoded as plain text with BOS, EOS only with `add_eos` (torchtune's configs set it
/// False), cut to `max_seq_len`, exactly as the SFT recipes tokenize it.
fn text_completion(
    row: &Row,
    spec: &DatasetSpec,
    tok: &Tokenizer,
    max_seq_len: Option<usize>,
) -> Result<PromptSample> {
    let obj = object(row)?;
    let key = spec.column.as_deref().unwrap_or("text");
    let map = BTreeMap::from([("text".to_string(), key.to_string())]);
    let (prompt, column) = text(row, obj, &map, "text")?;
    if prompt.trim().is_empty() {
        return Err(DataError::EmptyValue {
            path: (*row.file).clone(),
            row: row.index,
            column,
        });
    }
    let tokens = tokenize_text(tok, prompt, spec.add_eos, max_seq_len)
        .map_err(tokenize_err(row))?
        .tokens;
    let mut columns = obj.clone();
    columns.remove(&column);
    Ok(PromptSample {
        tokens,
        prompt: prompt.to_string(),
        columns,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::{MessageFormat, ModelFormat, Truncation};
    use serde_json::json;
    use std::path::PathBuf;

    fn root() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }

    fn tiny() -> Tokenizer {
        Tokenizer::from_path(root().join("assets/tiny-llama/tokenizer.json")).expect("tokenizer")
    }

    fn llama3(tok: &mut Tokenizer) {
        tok.set_format(ModelFormat {
            format: MessageFormat::Llama3,
            prompt_template: None,
            truncation: Truncation::Right,
        })
        .expect("llama3 format");
    }

    fn fixture() -> Value {
        let path = root().join("tests/fixtures/grpo_rewards.json");
        serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("json")
    }

    fn gsm8k_spec(partition: Option<&str>) -> DatasetSpec {
        DatasetSpec {
            source: Some("json".into()),
            data_files: vec!["tests/fixtures/gsm8k_tiny.jsonl".into()],
            partition: partition.map(String::from),
            ..DatasetSpec::new(DatasetKind::Gsm8k)
        }
    }

    fn rows(values: Vec<Value>) -> Vec<Row> {
        Row::inline("rows.json", values)
    }

    #[test]
    fn gsm8k_prompts_answers_and_partitions_are_torchtunes() {
        let tok = tiny();
        let fx = fixture();
        for case in fx["gsm8k_dataset"]["cases"].as_array().expect("cases") {
            let partition = case["partition"].as_str();
            let ds =
                PromptDataset::build(&gsm8k_spec(partition), &tok, None, &root()).expect("dataset");
            let expected = case["samples"].as_array().expect("samples");
            assert_eq!(ds.len(), expected.len(), "partition {partition:?}");
            for (got, want) in ds.samples().iter().zip(expected) {
                assert_eq!(Some(got.prompt.as_str()), want["question"].as_str());
                assert_eq!(got.columns["answer"], want["answer"]);
            }
            let encoded: Vec<&str> = case["encoded"]
                .as_array()
                .expect("encoded")
                .iter()
                .filter_map(Value::as_str)
                .collect();
            let prompts: Vec<&str> = ds.samples().iter().map(|s| s.prompt.as_str()).collect();
            assert_eq!(prompts, encoded, "the text torchtune encodes");
        }
    }

    #[test]
    fn gsm8k_tokens_are_bos_and_the_prompt_without_eos() {
        let mut tok = tiny();
        llama3(&mut tok);
        let ds = PromptDataset::build(&gsm8k_spec(None), &tok, None, &root()).expect("dataset");
        let s = &ds.samples()[0];
        let mut want: Vec<u32> = tok.format_bos_id().into_iter().collect();
        want.extend(tok.encode(&s.prompt, false).expect("encode"));
        assert_eq!(s.tokens, want);
        assert_ne!(s.tokens.last().copied(), tok.format_eos_id());
        assert!(s.prompt.ends_with(
            "How many clips did Natalia sell altogether in April and May?. Assistant: <think>"
        ));
        assert_eq!(s.columns["answer"], json!("72"));
        assert!(
            s.columns["cot"]
                .as_str()
                .is_some_and(|c| c.ends_with("April and May.\n"))
        );
    }

    /// torchtune main's `gsm8k_sft` (recorded by make_reward_fixtures.py): per partition the
    /// rows it keeps, and per row the texts it encodes (the preamble with BOS and no EOS, masked;
    /// then the chain of thought and answer in R1's tags without BOS and with EOS, trained).
    #[test]
    fn gsm8k_sft_samples_are_torchtunes() {
        let mut tok = tiny();
        llama3(&mut tok);
        let fx = fixture();
        for case in fx["gsm8k_sft"]["cases"].as_array().expect("cases") {
            let partition = case["partition"].as_str();
            let spec = DatasetSpec {
                kind: DatasetKind::Gsm8kSft,
                ..gsm8k_spec(partition)
            };
            let ds = crate::data::Dataset::build(&spec, &tok, None, &root()).expect("dataset");
            let crate::data::Samples::Sft(samples) = ds.samples() else {
                panic!("gsm8k_sft gives SFT samples");
            };
            let expected = case["samples"].as_array().expect("samples");
            assert_eq!(samples.len(), expected.len(), "partition {partition:?}");
            for (got, want) in samples.iter().zip(expected) {
                let (mut tokens, mut labels) = (Vec::new(), Vec::new());
                let calls = want["calls"].as_array().expect("calls");
                for (j, call) in calls.iter().enumerate() {
                    let mut ids: Vec<u32> = Vec::new();
                    if call["add_bos"] == json!(true) {
                        ids.extend(tok.format_bos_id());
                    }
                    ids.extend(
                        tok.encode(call["text"].as_str().expect("text"), false)
                            .expect("encode"),
                    );
                    if call["add_eos"] == json!(true) {
                        ids.extend(tok.format_eos_id());
                    }
                    let masked = want["labels"][j] == json!(-100);
                    labels.extend(
                        ids.iter()
                            .map(|&t| if masked { -100 } else { i64::from(t) }),
                    );
                    tokens.extend(ids);
                }
                assert_eq!(got.tokens, tokens, "row {}", want["row"]);
                assert_eq!(got.labels, labels, "row {}", want["row"]);
            }
        }
    }

    #[test]
    fn a_gsm8k_solution_without_exactly_one_answer_marker_is_refused() {
        let tok = tiny();
        let spec = DatasetSpec::new(DatasetKind::Gsm8k);
        for solution in ["no marker", "#### 1 #### 2"] {
            let r = rows(vec![json!({"question": "q", "answer": solution})]);
            let err = PromptDataset::from_rows(&r, &spec, &tok, None).expect_err(solution);
            assert!(err.to_string().contains("`#### `"), "{err}");
        }
    }

    #[test]
    fn partitions_parse_as_torchtune_and_refuse_anything_else() {
        let p = Partition::parse("1-9/10").expect("partition");
        assert_eq!((0..20).filter(|&i| p.keeps(i)).count(), 18);
        assert!(!p.keeps(0) && !p.keeps(10) && p.keeps(19));
        for bad in [
            "1-9", "a-9/10", "1-9/0", "-1-9/10", " 1-9/10", "1-9/10/2", "",
        ] {
            assert!(Partition::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_prompt_row_becomes_a_user_turn_ending_at_the_assistant_header() {
        let mut tok = tiny();
        llama3(&mut tok);
        let spec = DatasetSpec {
            column_map: [("prompt".to_string(), "question".to_string())].into(),
            ..DatasetSpec::new(DatasetKind::Prompt)
        };
        let r = rows(vec![
            json!({"question": "What is 6 x 12?", "answer": "72", "id": 3}),
        ]);
        let ds = PromptDataset::from_rows(&r, &spec, &tok, None).expect("dataset");
        let s = &ds.samples()[0];
        let want = tokenize_prompt(
            &tok,
            &[
                LabeledMessage::new(Role::User, "What is 6 x 12?", true),
                LabeledMessage::new(Role::Assistant, "", false),
            ],
        )
        .expect("prompt");
        assert_eq!(s.tokens, want);
        let text = tok.decode(&s.tokens, false).expect("decode");
        assert!(
            text.ends_with("<|start_header_id|>assistant<|end_header_id|>\n\n"),
            "{text:?}"
        );
        assert_eq!(s.prompt, "What is 6 x 12?");
        assert_eq!(
            s.columns,
            *json!({"answer": "72", "id": 3}).as_object().expect("obj")
        );
    }

    #[test]
    fn without_the_chat_template_a_prompt_is_its_text_after_bos() {
        let mut tok = tiny();
        llama3(&mut tok);
        let spec = DatasetSpec {
            apply_chat_template: false,
            ..DatasetSpec::new(DatasetKind::Prompt)
        };
        let r = rows(vec![json!({"prompt": "Count to three:"})]);
        let ds = PromptDataset::from_rows(&r, &spec, &tok, None).expect("dataset");
        let mut want: Vec<u32> = tok.format_bos_id().into_iter().collect();
        want.extend(tok.encode("Count to three:", false).expect("encode"));
        assert_eq!(ds.samples()[0].tokens, want);
        assert!(ds.samples()[0].columns.is_empty());
    }

    /// A prompt row's `chat_template_kwargs` reaches the checkpoint's template, as TRL's
    /// GRPOTrainer passes it (and the row's other columns still go to the rewards); without a
    /// template it is refused by column.
    #[test]
    fn a_prompt_rows_template_keyword_arguments_reach_the_template() {
        let mut tok = tiny();
        tok.set_chat_template(Some(
            "{% for m in messages %}{{ m.content }}{% endfor %}|{{ effort | default('medium') }}",
        ))
        .expect("template");
        let spec = DatasetSpec::new(DatasetKind::Prompt);
        let r = rows(vec![
            json!({"prompt": "Think.", "chat_template_kwargs": {"effort": "high"}, "id": 1}),
        ]);
        let ds = PromptDataset::from_rows(&r, &spec, &tok, None).expect("dataset");
        let text = tok.decode(&ds.samples()[0].tokens, false).expect("decode");
        assert_eq!(text, "<|begin_of_text|>Think.|high");

        let plain = DatasetSpec {
            apply_chat_template: false,
            ..DatasetSpec::new(DatasetKind::Prompt)
        };
        let err = PromptDataset::from_rows(&r, &plain, &tok, None).expect_err("no template");
        assert!(err.to_string().contains("chat_template_kwargs"), "{err}");
    }

    /// A chat template's generation prompt starts with the tokenizer's BOS where the template
    /// does not write it, and holds it once where it does: the same tokens training gives the
    /// same turn (torchtune's HuggingFaceModelTokenizer encodes both with `add_bos`), so GRPO's
    /// policy and `tune run generate` are prompted as SFT trained the model.
    #[test]
    fn a_rendered_prompt_starts_with_bos_once_as_training_tokenizes_it() {
        let mut tok = tiny();
        let bos = tok.bos_id().expect("the tiny tokenizer has a BOS");
        let templates = [
            "{% for m in messages %}{{ m.content }}{% endfor %}",
            "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
        ];
        for template in templates {
            tok.set_chat_template(Some(template)).expect("template");
            let ids = prompt_tokens(&tok, None, "Hello there", true).expect("prompt");
            assert_eq!(ids[0], bos, "{template}");
            assert_ne!(ids[1], bos, "{template}");
            let user = LabeledMessage::new(Role::User, "Hello there", true);
            let trained = super::super::tokenize_messages(&tok, &[user], None).expect("sample");
            assert_eq!(trained.tokens, ids, "{template}");
        }
    }

    #[test]
    fn a_missing_prompt_column_names_the_row_and_the_columns_it_has() {
        let tok = tiny();
        let spec = DatasetSpec::new(DatasetKind::Prompt);
        let r = rows(vec![json!({"prompt": "ok"}), json!({"question": "q"})]);
        let err = PromptDataset::from_rows(&r, &spec, &tok, None).expect_err("missing");
        assert!(
            matches!(&err, DataError::MissingColumn { row: 1, column, available, .. } if column == "prompt" && available == "question"),
            "{err}"
        );
    }

    #[test]
    fn partition_on_another_dataset_and_training_datasets_are_refused() {
        let tok = tiny();
        let r = rows(vec![json!({"prompt": "p"})]);
        let spec = DatasetSpec {
            partition: Some("0-0/2".into()),
            ..DatasetSpec::new(DatasetKind::Prompt)
        };
        assert!(PromptDataset::from_rows(&r, &spec, &tok, None).is_err());
        let sft = DatasetSpec::new(DatasetKind::Instruct);
        assert!(PromptDataset::from_rows(&r, &sft, &tok, None).is_err());
    }
}
