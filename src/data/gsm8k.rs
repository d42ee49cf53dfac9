//! gsm8k's rows as torchtune reads them (`torchtune/dev/grpo/gsm8k.py`): the question, and the
//! solution split into its chain of thought and its answer; the R1 preamble its prompts use.
//! Shared by the GRPO prompts (`prompts.rs`, `gsm8k_dataset`) and the SFT stage before them
//! (`transform.rs`, `gsm8k_sft`).

use serde_json::{Map, Value};
use std::collections::BTreeMap;

use super::error::{DataError, Result};
use super::source::{Row, kind_name};

/// torchtune's `BASE_PROMPT` (`torchtune/dev/grpo/data.py`) up to its `%s`.
pub const GSM8K_PROMPT_BEFORE: &str = "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The assistant first thinks about the reasoning process in the mind and then provides the user with the answer. The reasoning process and answer are enclosed within <think></think> and <answer></answer> tags, respectively, i.e., <think>reasoning process here</think> <answer>answer here</answer>. User: ";
/// torchtune's `BASE_PROMPT` after its `%s`: the completion starts inside the think block.
pub const GSM8K_PROMPT_AFTER: &str = ". Assistant: <think>";

/// torchtune's `normalize_gsm`: a gsm8k row's question, and its solution split at its one
/// `#### ` into the chain of thought and the answer.
pub(super) fn gsm8k_parts<'a>(
    row: &Row,
    obj: &'a Map<String, Value>,
    map: &BTreeMap<String, String>,
) -> Result<(&'a str, &'a str, &'a str)> {
    let (question, _) = column_text(row, obj, map, "question")?;
    let (solution, answer_column) = column_text(row, obj, map, "answer")?;
    let parts: Vec<&str> = solution.split("#### ").collect();
    let [cot, answer] = parts.as_slice() else {
        return Err(DataError::BadMessage {
            path: (*row.file).clone(),
            row: row.index,
            column: answer_column,
            index: 0,
            problem: format!(
                "a gsm8k solution ends with `#### <answer>` exactly once; this one has {} `#### `",
                parts.len() - 1
            ),
        });
    };
    Ok((question, cot, answer))
}

/// The string in the column `key` maps to (`key` itself when unmapped), and that column's name.
pub(super) fn column_text<'a>(
    row: &Row,
    obj: &'a Map<String, Value>,
    map: &BTreeMap<String, String>,
    key: &str,
) -> Result<(&'a str, String)> {
    let column = map.get(key).cloned().unwrap_or_else(|| key.to_string());
    let value = obj.get(&column).ok_or_else(|| DataError::MissingColumn {
        path: (*row.file).clone(),
        row: row.index,
        column: column.clone(),
        key: key.to_string(),
        available: obj.keys().cloned().collect::<Vec<_>>().join(", "),
    })?;
    let s = value.as_str().ok_or_else(|| DataError::WrongType {
        path: (*row.file).clone(),
        row: row.index,
        column: column.clone(),
        expected: "a string",
        found: kind_name(value).to_string(),
    })?;
    Ok((s, column))
}
