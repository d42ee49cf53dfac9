//! Messages -> tokens + labels with per-message masking.
//!
//! With a chat template, the whole conversation is rendered once and tokenized once (so the ids
//! are exactly what `apply_chat_template` + `encode(.., false)` give). Which tokens are trained is
//! decided from byte spans found by rendering message prefixes: message `i` spans
//! `render(msgs[..i])..render(msgs[..=i])`; an assistant message whose prompt is masked starts
//! after `render(msgs[..i], add_generation_prompt=true)`, so its header stays masked and only its
//! content and the end-of-turn text the template writes after it are trained (when the template
//! has no generation prompt, the span starts at the last occurrence of the content in it). A token is trained
//! when its bytes overlap a trained span. If a template is not prefix-stable, spans fall back
//! to searching each message's content in the rendered text (content + up to the next stop token).
use super::error::TokenizeError;
use super::formats;
use super::sample::{IGNORE_INDEX, SftSample};
use super::transform::LabeledMessage;
use crate::tokenizer::{Message, Role, TemplateInputs, Tokenizer, Truncation};

type Result<T> = std::result::Result<T, TokenizeError>;

fn check_len(max_seq_len: Option<usize>) -> Result<()> {
    match max_seq_len {
        Some(n) if n < 2 => Err(TokenizeError::MaxSeqLen(n)),
        _ => Ok(()),
    }
}

/// Tokenizes a conversation. With a torchtune tokenizer component (`llama3_tokenizer`, ...)
/// exactly as that component does (see `data::formats`). Otherwise with the tokenizer's chat
/// template when it has one, else the plain format (BOS, each message's text, EOS after each
/// assistant message). BOS is prepended when the tokenizer has one and the template did not
/// write it; EOS is appended after a final assistant message when the template wrote no stop
/// token for it (torchtune adds both). Truncated to `max_seq_len` as torchtune does (see
/// [`truncate`]).
pub fn tokenize_messages(
    tok: &Tokenizer,
    messages: &[LabeledMessage],
    max_seq_len: Option<usize>,
) -> Result<SftSample> {
    tokenize_conversation(tok, messages, &TemplateInputs::default(), max_seq_len)
}

/// [`tokenize_messages`] with the conversation's tools and template keyword arguments, which
/// only a chat template reads (refused otherwise, naming the dataset's column).
pub fn tokenize_conversation(
    tok: &Tokenizer,
    messages: &[LabeledMessage],
    inputs: &TemplateInputs,
    max_seq_len: Option<usize>,
) -> Result<SftSample> {
    check_len(max_seq_len)?;
    check_template_inputs(
        inputs,
        !tok.format().format.is_torchtune() && tok.has_chat_template(),
    )?;
    if tok.format().format.is_torchtune() {
        return formats::tokenize(tok, messages, max_seq_len, true);
    }
    let mut sample = if tok.has_chat_template() {
        with_template(&Rendering { tok, inputs }, messages)?
    } else {
        plain(tok, messages)?
    };
    if let Some(max) = max_seq_len {
        truncate(&mut sample, max, tok.eos_id(), tok.format().truncation);
    }
    Ok(sample)
}

/// torchtune's `truncate` for SFT: keep the first `max_seq_len` tokens (the last ones with
/// `truncation_type: left`, torchtune main); when something was cut, the last token becomes EOS
/// and its label is masked (torchtune truncates the mask with `True`).
pub fn truncate(sample: &mut SftSample, max_seq_len: usize, eos: Option<u32>, side: Truncation) {
    if sample.tokens.len() <= max_seq_len || max_seq_len == 0 {
        return;
    }
    match side {
        Truncation::Right => {
            sample.tokens.truncate(max_seq_len);
            sample.labels.truncate(max_seq_len);
        }
        Truncation::Left => {
            let cut = sample.tokens.len() - max_seq_len;
            sample.tokens.drain(..cut);
            sample.labels.drain(..cut);
        }
    }
    let last = max_seq_len - 1;
    if let Some(eos) = eos {
        sample.tokens[last] = eos;
    }
    sample.labels[last] = IGNORE_INDEX;
}

/// The token ids of a generation prompt (a final empty assistant message) in the tokenizer
/// component's torchtune format: the last message gets its header and no end tokens.
pub fn tokenize_prompt(tok: &Tokenizer, messages: &[LabeledMessage]) -> Result<Vec<u32>> {
    Ok(formats::tokenize(tok, messages, None, false)?.tokens)
}

/// Text completion (torchtune `TextCompletionDataset`): `encode(text)` with BOS (a torchtune
/// component's own; otherwise the post-processor's special tokens), EOS appended when `add_eos`,
/// truncated to `max_seq_len - 1` without forcing EOS, every token trained.
/// A prompt that is not trained, then a response and EOS that are, each encoded as plain text:
/// torchtune's `encode(prompt, add_eos=False) + encode(response, add_bos=False)` with the prompt
/// masked (its `gsm8k_sft`). Cut at `max_seq_len` when one is set (torchtune's gsm8k_sft never
/// cuts).
pub fn tokenize_prompt_response(
    tok: &Tokenizer,
    prompt: &str,
    response: &str,
    max_seq_len: Option<usize>,
) -> Result<SftSample> {
    check_len(max_seq_len)?;
    let mut tokens = tokenize_text(tok, prompt, false, None)?.tokens;
    let masked = tokens.len();
    tokens.extend(tok.encode(response, false)?);
    let eos = if tok.format().format.is_torchtune() {
        tok.format_eos_id()
    } else {
        tok.eos_id()
    };
    tokens.extend(eos);
    if let Some(max) = max_seq_len {
        tokens.truncate(max);
    }
    let labels = tokens
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            if i < masked {
                IGNORE_INDEX
            } else {
                i64::from(t)
            }
        })
        .collect();
    Ok(SftSample {
        tokens,
        labels,
        images: Vec::new(),
    })
}

pub fn tokenize_text(
    tok: &Tokenizer,
    text: &str,
    add_eos: bool,
    max_seq_len: Option<usize>,
) -> Result<SftSample> {
    check_len(max_seq_len)?;
    if tok.format().format.is_torchtune() {
        let mut tokens: Vec<u32> = tok.format_bos_id().into_iter().collect();
        tokens.extend(tok.encode(text, false)?);
        if add_eos && let Some(eos) = tok.format_eos_id() {
            tokens.push(eos);
        }
        if let Some(max) = max_seq_len {
            tokens.truncate(max - 1);
        }
        let labels = tokens.iter().map(|&t| i64::from(t)).collect();
        return Ok(SftSample {
            tokens,
            labels,
            images: Vec::new(),
        });
    }
    let mut tokens = tok.encode(text, true)?;
    if let (true, Some(eos)) = (add_eos, tok.eos_id())
        && tokens.last() != Some(&eos)
    {
        tokens.push(eos);
    }
    if let Some(max) = max_seq_len {
        tokens.truncate(max - 1);
    }
    let labels = tokens.iter().map(|&t| i64::from(t)).collect();
    Ok(SftSample {
        tokens,
        labels,
        images: Vec::new(),
    })
}

fn plain(tok: &Tokenizer, messages: &[LabeledMessage]) -> Result<SftSample> {
    let mut s = SftSample::default();
    if let Some(bos) = tok.bos_id() {
        s.push(bos, messages.first().is_some_and(|m| !m.masked));
    }
    for m in messages {
        for id in tok.encode(&m.message.content, false)? {
            s.push(id, !m.masked);
        }
        if m.message.role == Role::Assistant
            && let Some(eos) = tok.eos_id()
        {
            s.push(eos, !m.masked);
        }
    }
    Ok(s)
}

/// Refuses a row's template inputs (by column) when the row is not formatted with the
/// checkpoint's chat template (`templated`), which is all that reads them.
pub(super) fn check_template_inputs(inputs: &TemplateInputs, templated: bool) -> Result<()> {
    if templated || *inputs == TemplateInputs::default() {
        return Ok(());
    }
    let column = if inputs.tools.is_some() {
        "tools"
    } else {
        "chat_template_kwargs"
    };
    Err(TokenizeError::TemplateInputWithoutTemplate { column })
}

/// A tokenizer rendering one conversation's chat template with its [`TemplateInputs`]: every
/// rendering below sees the same tools and keyword arguments; the rest is the tokenizer's.
struct Rendering<'a> {
    tok: &'a Tokenizer,
    inputs: &'a TemplateInputs,
}

impl Rendering<'_> {
    fn apply_chat_template(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> crate::tokenizer::Result<String> {
        self.tok
            .apply_chat_template_with(messages, add_generation_prompt, self.inputs)
    }
}

impl std::ops::Deref for Rendering<'_> {
    type Target = Tokenizer;
    fn deref(&self) -> &Tokenizer {
        self.tok
    }
}

/// The tokenizer's BOS when a chat template's rendering, encoded without special tokens
/// (`ids`), does not start with it. torchtune's `HuggingFaceModelTokenizer` encodes every
/// rendering with `add_bos=True`, for training and for its generate recipe alike, so tune puts
/// it first wherever it renders a template: conversations ([`tokenize_conversation`]) and
/// generation prompts ([`encode_rendered_prompt`]), and a model is prompted as it was trained.
/// Never twice: torchtune adds a second where the template writes BOS and the tokenizer's
/// post-processor adds one too (Llama 3's, Gemma's), which transformers warns against.
fn missing_bos(tok: &Tokenizer, ids: &[u32]) -> Option<u32> {
    tok.bos_id().filter(|bos| ids.first() != Some(bos))
}

/// A chat template's rendering of a generation prompt as token ids: the text without special
/// tokens (templates write their own), after [`missing_bos`]'s BOS, as training's.
pub fn encode_rendered_prompt(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let ids = tok.encode(text, false)?;
    Ok(missing_bos(tok, &ids).into_iter().chain(ids).collect())
}

fn with_template(tok: &Rendering<'_>, messages: &[LabeledMessage]) -> Result<SftSample> {
    let msgs: Vec<Message> = messages.iter().map(|m| m.message.clone()).collect();
    let full = tok.apply_chat_template(&msgs, false)?;
    let (ids, offsets) = tok.encode_with_offsets(&full, false)?;
    let (regions, last_start) = if messages.iter().all(|m| !m.masked) {
        let last = prefix_bounds(tok, &msgs, &full)
            .and_then(|b| b.get(msgs.len().saturating_sub(1)).copied())
            .unwrap_or(0);
        (vec![(0, full.len())], last)
    } else if let Some(r) = prefix_regions(tok, messages, &msgs, &full) {
        r
    } else {
        search_regions(tok, messages, &msgs, &full)?
    };
    let mut s = SftSample::default();
    let first_trained = messages.first().is_some_and(|m| !m.masked);
    if let Some(bos) = missing_bos(tok, &ids) {
        s.push(bos, first_trained);
    }
    for (&id, &(start, end)) in ids.iter().zip(&offsets) {
        let end = end.max(start + 1);
        s.push(id, regions.iter().any(|&(a, b)| start < b && end > a));
    }
    if let Some(last) = messages.last()
        && last.message.role == Role::Assistant
        && let Some(eos) = tok.eos_id()
    {
        let stops = tok.stop_ids();
        let has_stop = ids
            .iter()
            .zip(&offsets)
            .any(|(id, &(start, _))| start >= last_start && stops.contains(id));
        if !has_stop {
            s.push(eos, !last.masked);
        }
    }
    Ok(s)
}

/// `b[i]` = byte length of `render(msgs[..i])` for i in 1..n (b[0] = 0, b[n] = full.len()),
/// or None when some prefix rendering fails or is not a prefix of `full`.
fn prefix_bounds(tok: &Rendering<'_>, msgs: &[Message], full: &str) -> Option<Vec<usize>> {
    let mut bounds = vec![0];
    for i in 1..msgs.len() {
        let r = tok.apply_chat_template(&msgs[..i], false).ok()?;
        if !full.starts_with(&r) || r.len() < *bounds.last()? {
            return None;
        }
        bounds.push(r.len());
    }
    bounds.push(full.len());
    Some(bounds)
}

/// Trained byte spans from prefix renderings, and where the last message starts.
fn prefix_regions(
    tok: &Rendering<'_>,
    messages: &[LabeledMessage],
    msgs: &[Message],
    full: &str,
) -> Option<(Vec<(usize, usize)>, usize)> {
    let bounds = prefix_bounds(tok, msgs, full)?;
    let mut regions = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if m.masked {
            continue;
        }
        let (mut start, end) = (bounds[i], bounds[i + 1]);
        let prompt_masked = i == 0 || messages[i - 1].masked;
        if m.message.role == Role::Assistant && prompt_masked {
            // skip the assistant header: render(..i, add_generation_prompt = true)
            if let Ok(g) = tok.apply_chat_template(&msgs[..i], true)
                && g.len() >= start
                && g.len() <= end
                && full.starts_with(&g)
            {
                start = g.len();
            }
            // a template without a generation prompt: skip to the content itself
            let needle = m.message.content.trim();
            if start == bounds[i]
                && !needle.is_empty()
                && let Some(p) = full[start..end].rfind(needle)
            {
                start += p;
            }
        }
        regions.push((start, end));
    }
    let last_start = bounds[msgs.len().saturating_sub(1)];
    Some((regions, last_start))
}

/// Where assistant message `i`'s text begins after its header, between `earliest` (the end of
/// the message before it) and `content` (where its content was found, or for a message without
/// text where the next one's was), for [`search_regions`]:
/// the end of its generation prompt when that renders as a prefix of `full`; else the header
/// (what the generation prompt adds, gpt-oss's `<|start|>assistant`) where it follows the
/// previous message's turn end. The second serves a prompt whose own rendering changes once the
/// answer follows it: gpt-oss drops a tool call's reasoning once a final answer comes.
fn turn_start(
    tok: &Rendering<'_>,
    msgs: &[Message],
    i: usize,
    full: &str,
    (earliest, content): (usize, usize),
    turn_ends: &[String],
) -> Option<usize> {
    let with_prompt = tok.apply_chat_template(&msgs[..i], true).ok()?;
    if (earliest..=content).contains(&with_prompt.len()) && full.starts_with(&with_prompt) {
        return Some(with_prompt.len());
    }
    let without = tok.apply_chat_template(&msgs[..i], false).ok()?;
    let header = with_prompt
        .strip_prefix(&without)
        .filter(|h| !h.is_empty())?;
    let between = &full[earliest..content];
    let turn_end = turn_ends
        .iter()
        .filter_map(|s| between.find(s.as_str()).map(|p| p + s.len()))
        .min()?;
    between[turn_end..]
        .starts_with(header)
        .then_some(earliest + turn_end + header.len())
}

/// Fallback, for a template that renders a message differently once others follow it (gpt-oss
/// and Qwen3 drop an earlier turn's reasoning, and gpt-oss ends the last turn with `<|return|>`,
/// the others with `<|end|>`): find each message's content in `full`, in order. A trained
/// message spans its content up to the end of the first special token after it (the end of
/// its turn: `<|end|>`, `<|im_end|>`, a stop token) before the next message's content. An
/// assistant message after a masked prompt starts where the generation prompt ends when the
/// prompt renders as a prefix of `full` (its header masked, as in [`prefix_regions`]), so what
/// the template writes before its content (gpt-oss's analysis channel from `thinking`, Qwen3's
/// `<think>` block from `reasoning_content`) is trained with it. An assistant message without
/// text (a tool call) spans from there to the first stop token.
fn search_regions(
    tok: &Rendering<'_>,
    messages: &[LabeledMessage],
    msgs: &[Message],
    full: &str,
) -> Result<(Vec<(usize, usize)>, usize)> {
    let mut found: Vec<Option<(usize, usize)>> = Vec::with_capacity(messages.len());
    let mut cursor = 0;
    for m in messages {
        let needle = m.message.content.trim();
        let hit = if needle.is_empty() {
            None
        } else {
            full[cursor..]
                .find(needle)
                .map(|p| (cursor + p, cursor + p + needle.len()))
        };
        if let Some((_, end)) = hit {
            cursor = end;
        }
        found.push(hit);
    }
    let stop_strings: Vec<String> = tok
        .stop_ids()
        .iter()
        .filter_map(|&id| tok.id_to_token(id))
        .collect();
    let mut turn_ends = stop_strings.clone();
    turn_ends.extend(tok.special_token_strings());
    let mut regions = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if m.masked {
            continue;
        }
        let not_found = || TokenizeError::MessageNotInTemplate {
            index: i,
            role: m.message.role.to_string(),
        };
        let earliest = found[..i].iter().flatten().last().map_or(0, |&(_, e)| e);
        let limit = found[i + 1..]
            .iter()
            .flatten()
            .map(|&(s, _)| s)
            .next()
            .unwrap_or(full.len());
        let Some((mut start, mut end)) = found[i] else {
            // A message without text (a tool call): from where its generation prompt ends to
            // the first stop token after it (`<|call|>`, `<|im_end|>`); the special tokens
            // inside a call (gpt-oss's `<|channel|>`) do not end it.
            if m.message.role != Role::Assistant || !m.message.content.trim().is_empty() {
                return Err(not_found());
            }
            let start = turn_start(tok, msgs, i, full, (earliest, limit), &turn_ends)
                .ok_or_else(not_found)?;
            let end = stop_strings
                .iter()
                .filter_map(|s| {
                    full[start..limit]
                        .find(s.as_str())
                        .map(|p| start + p + s.len())
                })
                .min()
                .ok_or_else(not_found)?;
            regions.push((start, end));
            continue;
        };
        if m.message.role == Role::Assistant
            && (i == 0 || messages[i - 1].masked)
            && let Some(turn) = turn_start(tok, msgs, i, full, (earliest, start), &turn_ends)
        {
            start = turn;
        }
        let stop_end = turn_ends
            .iter()
            .filter_map(|s| full[end..limit].find(s.as_str()).map(|p| end + p + s.len()))
            .min();
        if let Some(e) = stop_end {
            end = e;
        }
        regions.push((start, end));
    }
    let last_start = found.last().copied().flatten().map_or(0, |(s, _)| s);
    Ok((regions, last_start))
}
