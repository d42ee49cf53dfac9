//! torchtune's message formats: messages -> tokens and mask exactly as the model tokenizers of
//! torchtune 0.6.1 build them (`Llama3Tokenizer.tokenize_messages`, `Qwen2Tokenizer`,
//! `Qwen2_5Tokenizer`, `tokenize_messages_no_special_tokens`, `Phi3MiniTokenizer`), prompt
//! templates included. tests/fixtures/torchtune_tokens holds their outputs on real vocabularies,
//! made by torchtune itself; the suite checks these functions reproduce them token for token.
//!
//! Like torchtune, each message's content is a list of text pieces (the prompt template adds its
//! tags as pieces of their own) and each piece is encoded separately; the mask marks tokens left
//! out of the loss. BOS/EOS and headers take their message's mask unless noted.
use super::error::TokenizeError;
use super::sample::{IGNORE_INDEX, SftSample};
use super::transform::LabeledMessage;
use crate::tokenizer::{MessageFormat, PromptTemplate, Role, Tokenizer, Truncation};

type Result<T> = std::result::Result<T, TokenizeError>;

/// A message as torchtune's tokenizers see it: a role, text pieces and a mask flag.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Turn {
    role: Role,
    pieces: Vec<String>,
    masked: bool,
}

/// torchtune's role names (`tool` is `ipython` there).
fn role_name(role: &Role) -> &str {
    match role {
        Role::Tool => "ipython",
        other => other.as_str(),
    }
}

/// Tokens and mask of `messages` in the tokenizer's torchtune format. `add_end_tokens: false`
/// is generation: the last message (an empty assistant turn) gets its header and nothing after.
pub fn tokenize(
    tok: &Tokenizer,
    messages: &[LabeledMessage],
    max_seq_len: Option<usize>,
    add_end_tokens: bool,
) -> Result<SftSample> {
    let turns: Vec<Turn> = messages
        .iter()
        .map(|m| Turn {
            role: m.message.role.clone(),
            pieces: vec![m.message.content.clone()],
            masked: m.masked,
        })
        .collect();
    let format = tok.format();
    let templated = match &format.prompt_template {
        Some(t) => apply_template(t, format.format, turns.clone())?,
        None => turns.clone(),
    };
    let enc = Encoder::new(tok, format.format);
    let (tokens, mask) = match format.format {
        MessageFormat::Llama3 => llama3(&enc, &templated, max_seq_len, add_end_tokens)?,
        MessageFormat::Qwen2 | MessageFormat::Qwen2_5 => {
            // Qwen2 decides "last message" on the list before templating, Qwen2.5 after.
            let last = if format.format == MessageFormat::Qwen2 {
                turns.len()
            } else {
                templated.len()
            };
            chatml(&enc, &templated, last, max_seq_len, add_end_tokens)?
        }
        MessageFormat::SentencePiece => {
            sentencepiece(&enc, &templated, max_seq_len, add_end_tokens)?
        }
        MessageFormat::Phi3 => phi3(&enc, &templated, max_seq_len, add_end_tokens)?,
        MessageFormat::Phi4 => phi4(&enc, &templated, max_seq_len, add_end_tokens)?,
        MessageFormat::ChatTemplate => {
            return Err(TokenizeError::Template(
                "the chat-template format is tokenized by data::tokenize_messages, not by torchtune's formats".into(),
            ));
        }
    };
    Ok(to_sample(tokens, mask))
}

fn to_sample(tokens: Vec<u32>, mask: Vec<bool>) -> SftSample {
    let labels = tokens
        .iter()
        .zip(&mask)
        .map(|(&t, &m)| if m { IGNORE_INDEX } else { i64::from(t) })
        .collect();
    SftSample {
        tokens,
        labels,
        images: Vec::new(),
    }
}

/// torchtune's `truncate`: keep the first `max` items (the last ones with `Truncation::Left`);
/// when `last` is given and the final item differs from it, it becomes `last` (applied whether
/// or not anything was cut).
fn truncate<T: PartialEq + Copy>(v: &mut Vec<T>, max: usize, last: Option<T>, side: Truncation) {
    match side {
        Truncation::Right => v.truncate(max),
        Truncation::Left => {
            let cut = v.len().saturating_sub(max);
            v.drain(..cut);
        }
    }
    if let (Some(l), Some(end)) = (last, v.last_mut())
        && *end != l
    {
        *end = l;
    }
}

/// Encoding as torchtune's base tokenizers do it, on the model's tokenizer.json.
struct Encoder<'a> {
    tok: &'a Tokenizer,
    /// Which end a too-long conversation keeps.
    side: Truncation,
    /// SentencePiece vocabularies that encode whitespace get their dummy-prefix space trimmed
    /// inside a turn by encoding `"\n" + text` and dropping the tokens of `"\n"`.
    trim_prefix: Option<usize>,
}

impl<'a> Encoder<'a> {
    fn new(tok: &'a Tokenizer, format: MessageFormat) -> Self {
        let trim_prefix = matches!(format, MessageFormat::SentencePiece | MessageFormat::Phi3)
            .then(|| {
                tok.encodes_whitespace()
                    .then(|| tok.encode("\n", false).ok().map(|v| v.len()))
            })
            .flatten()
            .flatten();
        Encoder {
            tok,
            side: tok.format().truncation,
            trim_prefix,
        }
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tok.encode(text, false)?)
    }

    /// `SentencePieceBaseTokenizer.encode(text, trim_leading_whitespace=trim)`.
    fn encode_sp(&self, text: &str, trim: bool) -> Result<Vec<u32>> {
        match (trim, self.trim_prefix) {
            (true, Some(n)) => {
                let ids = self.encode(&format!("\n{text}"))?;
                Ok(ids.get(n..).map(<[u32]>::to_vec).unwrap_or_default())
            }
            _ => self.encode(text),
        }
    }

    fn special(&self, token: &str) -> Result<u32> {
        self.tok
            .token_to_id(token)
            .ok_or_else(|| TokenizeError::MissingSpecialToken(token.to_string()))
    }

    fn eos(&self) -> Result<u32> {
        self.tok
            .format_eos_id()
            .ok_or_else(|| TokenizeError::MissingSpecialToken("eos_token".into()))
    }
}

fn apply_template(
    template: &PromptTemplate,
    format: MessageFormat,
    turns: Vec<Turn>,
) -> Result<Vec<Turn>> {
    let wrap = |mut t: Turn, pre: &str, post: &str, keep_empty: bool| {
        if keep_empty || !pre.is_empty() {
            t.pieces.insert(0, pre.to_string());
        }
        if keep_empty || !post.is_empty() {
            t.pieces.push(post.to_string());
        }
        t
    };
    let n = turns.len();
    Ok(match template {
        PromptTemplate::Tags(tags) => turns
            .into_iter()
            .map(|t| match tags.iter().find(|(r, _, _)| *r == t.role) {
                Some((_, pre, post)) => wrap(t, pre, post, false),
                None => t,
            })
            .collect(),
        PromptTemplate::ChatMl => {
            if matches!(format, MessageFormat::Qwen2 | MessageFormat::Qwen2_5) {
                return Err(TokenizeError::Template(
                    "ChatMLTemplate with a Qwen tokenizer would wrap every message in <|im_*|> twice (torchtune refuses it too); set `tokenizer.prompt_template: null`".into(),
                ));
            }
            turns
                .into_iter()
                .enumerate()
                .map(|(i, t)| {
                    let (pre, post) = match t.role {
                        Role::System => ("<|im_start|>system\n", "<|im_end|>\n"),
                        Role::User => ("<|im_start|>user\n", "<|im_end|>\n"),
                        Role::Assistant => ("<|im_start|>assistant\n", "<|im_end|>\n"),
                        _ => ("", ""),
                    };
                    let empty_last = t.role == Role::Assistant
                        && i + 1 == n
                        && t.pieces.iter().all(String::is_empty);
                    wrap(t, pre, if empty_last { "" } else { post }, false)
                })
                .collect()
        }
        PromptTemplate::Llama2Chat => {
            // The system message is folded into every later user message, as torchtune does.
            let mut system: Vec<String> = Vec::new();
            let mut out = Vec::new();
            for t in turns {
                match t.role {
                    Role::System => {
                        system = std::iter::once("<<SYS>>\n".to_string())
                            .chain(t.pieces)
                            .chain(std::iter::once("\n<</SYS>>\n\n".to_string()))
                            .collect();
                    }
                    Role::User => {
                        let pieces = std::iter::once("[INST] ".to_string())
                            .chain(system.iter().cloned())
                            .chain(t.pieces)
                            .chain(std::iter::once(" [/INST] ".to_string()))
                            .collect();
                        out.push(Turn { pieces, ..t });
                    }
                    _ => out.push(t),
                }
            }
            out
        }
        PromptTemplate::MistralChat => turns
            .into_iter()
            .map(|t| match t.role {
                Role::System => Err(TokenizeError::Template(
                    "MistralChatTemplate does not support system prompts (torchtune refuses them too); drop the system message, or set `tokenizer.prompt_template` to another template or null".into(),
                )),
                Role::User => Ok(wrap(t, "[INST] ", " [/INST] ", true)),
                _ => Ok(wrap(t, "", "", true)),
            })
            .collect::<Result<_>>()?,
    })
}

type Tokens = (Vec<u32>, Vec<bool>);

fn push(tokens: &mut Vec<u32>, mask: &mut Vec<bool>, ids: &[u32], masked: bool) {
    tokens.extend_from_slice(ids);
    mask.extend(std::iter::repeat_n(masked, ids.len()));
}

/// `Llama3Tokenizer.tokenize_messages`: BOS and the final EOS are always masked.
fn llama3(enc: &Encoder, turns: &[Turn], max: Option<usize>, add_end: bool) -> Result<Tokens> {
    let (start, end_header, eot) = (
        enc.special("<|start_header_id|>")?,
        enc.special("<|end_header_id|>")?,
        enc.special("<|eot_id|>")?,
    );
    let bos = enc.special("<|begin_of_text|>")?;
    let eos = enc.eos()?;
    let (mut tokens, mut mask) = (vec![bos], vec![true]);
    for (i, t) in turns.iter().enumerate() {
        let mut ids = vec![start];
        ids.extend(enc.encode(role_name(&t.role).trim())?);
        ids.push(end_header);
        ids.extend(enc.encode("\n\n")?);
        for p in &t.pieces {
            ids.extend(enc.encode(p.trim())?);
        }
        if add_end || i + 1 < turns.len() {
            ids.push(eot);
        }
        push(&mut tokens, &mut mask, &ids, t.masked);
        if max.is_some_and(|m| tokens.len() >= m) {
            break;
        }
    }
    let eos = add_end.then_some((eos, true));
    Ok(end_and_truncate(enc, (tokens, mask), eos, max))
}

/// Appends EOS with the given mask when the sequence ends, then truncates as the Llama 3 and
/// Qwen tokenizers do: a forced EOS in the last kept place, its label masked.
fn end_and_truncate(
    enc: &Encoder,
    (mut tokens, mut mask): Tokens,
    eos: Option<(u32, bool)>,
    max: Option<usize>,
) -> Tokens {
    if let Some((id, masked)) = eos {
        tokens.push(id);
        mask.push(masked);
    }
    if let Some(m) = max {
        truncate(&mut tokens, m, eos.map(|e| e.0), enc.side);
        truncate(&mut mask, m, eos.map(|_| true), enc.side);
    }
    (tokens, mask)
}

/// `Qwen2Tokenizer` / `Qwen2_5Tokenizer.tokenize_messages`: ChatML; the last assistant message
/// (index `last_of - 1`) has no `<|im_end|>\n`, and the EOS after everything takes the mask of
/// the token before it.
fn chatml(
    enc: &Encoder,
    turns: &[Turn],
    last_of: usize,
    max: Option<usize>,
    add_end: bool,
) -> Result<Tokens> {
    let (im_start, im_end) = (enc.special("<|im_start|>")?, enc.special("<|im_end|>")?);
    let eos = enc.eos()?;
    let newline = enc.encode("\n")?;
    let (mut tokens, mut mask) = (Vec::new(), Vec::new());
    let is_tool = |i: usize| turns.get(i).is_some_and(|t| t.role == Role::Tool);
    for (i, t) in turns.iter().enumerate() {
        let mut ids = Vec::new();
        let tool = t.role == Role::Tool;
        if !tool {
            ids.push(im_start);
            ids.extend(enc.encode(&format!("{}\n", role_name(&t.role)))?);
        } else if enc.tok.format().format == MessageFormat::Qwen2_5 {
            // Qwen2.5 wraps tool results in a user turn of <tool_response> blocks.
            if i == 0 || !is_tool(i - 1) {
                ids.push(im_start);
                ids.extend(enc.encode("user\n")?);
                ids.extend(enc.encode("<tool_response>\n")?);
            } else {
                ids.extend(enc.encode("\n<tool_response>\n")?);
            }
        }
        for p in &t.pieces {
            ids.extend(enc.encode(p)?);
        }
        let last = i + 1 == last_of;
        if !tool && (t.role != Role::Assistant || !last) {
            ids.push(im_end);
            ids.extend_from_slice(&newline);
        } else if tool && enc.tok.format().format == MessageFormat::Qwen2_5 {
            ids.extend(enc.encode("\n</tool_response>")?);
            if i + 1 == turns.len() || !is_tool(i + 1) {
                ids.push(im_end);
                ids.extend_from_slice(&newline);
            }
        }
        push(&mut tokens, &mut mask, &ids, t.masked);
        if max.is_some_and(|m| tokens.len() >= m) {
            break;
        }
    }
    let eos = add_end.then(|| (eos, mask.last().copied().unwrap_or(true)));
    Ok(end_and_truncate(enc, (tokens, mask), eos, max))
}

/// `tokenize_messages_no_special_tokens` (Llama 2, Mistral, Gemma): BOS at each turn's start,
/// EOS after each assistant message, both with that message's mask; after truncation the last
/// token's mask is the last message's.
fn sentencepiece(
    enc: &Encoder,
    turns: &[Turn],
    max: Option<usize>,
    add_end: bool,
) -> Result<Tokens> {
    let bos = enc.tok.format_bos_id();
    let eos = if add_end { Some(enc.eos()?) } else { None };
    let (mut tokens, mut mask) = (Vec::new(), Vec::new());
    let (mut start_of_turn, mut prev_ends_with_space) = (true, false);
    let mut last_masked = None;
    for (i, t) in turns.iter().enumerate() {
        let end_of_turn = t.role == Role::Assistant;
        if start_of_turn && let Some(b) = bos {
            push(&mut tokens, &mut mask, &[b], t.masked);
        }
        let trim = !start_of_turn && !prev_ends_with_space;
        for p in &t.pieces {
            let ids = enc.encode_sp(p.trim_end_matches(' '), trim)?;
            push(&mut tokens, &mut mask, &ids, t.masked);
        }
        if let Some(p) = t.pieces.last() {
            prev_ends_with_space = p.ends_with(' ');
        }
        // generation: the final empty assistant turn gets no EOS
        let generating = !add_end && i + 1 == turns.len();
        if end_of_turn && !generating {
            if let Some(e) = eos {
                push(&mut tokens, &mut mask, &[e], t.masked);
            }
            start_of_turn = true;
        } else {
            start_of_turn = false;
        }
        last_masked = Some(t.masked);
        if max.is_some_and(|m| tokens.len() >= m) {
            break;
        }
    }
    if let Some(m) = max {
        truncate(&mut tokens, m, eos, enc.side);
        truncate(&mut mask, m, eos.and(last_masked), enc.side);
    }
    Ok((tokens, mask))
}

/// `Phi3MiniTokenizer.tokenize_messages` as its dataset path calls it (`add_eos` left at its
/// default, False): `<s>` once at the start, per message a role token and `\n`, the content
/// (leading space always trimmed), `<|end|>\n`; no `<|endoftext|>`, and a too-long sample is
/// cut without forcing an end token. (With `add_eos`, torchtune would start every turn with
/// `<s>` and end each answer with `<|endoftext|>`, but nothing in its recipes passes it.)
/// Generating, the final empty assistant turn gets its role token and `\n` only.
fn phi3(enc: &Encoder, turns: &[Turn], max: Option<usize>, add_end: bool) -> Result<Tokens> {
    let bos = enc.tok.format_bos_id();
    let newline = enc.encode("\n")?;
    let end = enc.special("<|end|>")?;
    let (mut tokens, mut mask) = (Vec::new(), Vec::new());
    for (i, t) in turns.iter().enumerate() {
        if i == 0
            && let Some(b) = bos
        {
            push(&mut tokens, &mut mask, &[b], t.masked);
        }
        let role = match t.role {
            Role::User => "<|user|>",
            Role::Assistant => "<|assistant|>",
            Role::System => "<|system|>",
            ref other => {
                return Err(TokenizeError::Template(format!(
                    "Phi3MiniTokenizer has no role `{other}` (only system, user, assistant)"
                )));
            }
        };
        push(&mut tokens, &mut mask, &[enc.special(role)?], t.masked);
        push(&mut tokens, &mut mask, &newline, t.masked);
        let generating = !add_end && i + 1 == turns.len();
        let mut ids = Vec::new();
        for p in &t.pieces {
            ids.extend(enc.encode_sp(p.trim_end_matches(' '), true)?);
        }
        if !generating {
            ids.push(end);
            ids.extend_from_slice(&newline);
        }
        push(&mut tokens, &mut mask, &ids, t.masked);
        if max.is_some_and(|m| tokens.len() >= m) {
            break;
        }
    }
    Ok(cut(enc, (tokens, mask), max))
}

/// The Phi tokenizers' truncation: only a sequence that reached `max` is cut, and nothing
/// replaces its last token.
fn cut(enc: &Encoder, (mut tokens, mut mask): Tokens, max: Option<usize>) -> Tokens {
    if let Some(m) = max
        && tokens.len() >= m
    {
        truncate(&mut tokens, m, None, enc.side);
        truncate(&mut mask, m, None, enc.side);
    }
    (tokens, mask)
}

/// `Phi4Tokenizer.tokenize_messages` as its dataset path calls it: `<|im_start|>role<|im_sep|>`,
/// the content pieces (trailing spaces stripped), `<|im_end|>` after every message but the
/// assistant's; no BOS or EOS; truncated without forcing an end token. (torchtune's `add_eos`
/// would close the assistant turn, but its `__call__` never passes it.)
fn phi4(enc: &Encoder, turns: &[Turn], max: Option<usize>, _add_end: bool) -> Result<Tokens> {
    let (start, sep, end) = (
        enc.special("<|im_start|>")?,
        enc.special("<|im_sep|>")?,
        enc.special("<|im_end|>")?,
    );
    let (mut tokens, mut mask) = (Vec::new(), Vec::new());
    for t in turns {
        let mut ids = vec![start];
        ids.extend(enc.encode(role_name(&t.role))?);
        ids.push(sep);
        for p in &t.pieces {
            ids.extend(enc.encode(p.trim_end_matches(' '))?);
        }
        if t.role != Role::Assistant {
            ids.push(end);
        }
        push(&mut tokens, &mut mask, &ids, t.masked);
        if max.is_some_and(|m| tokens.len() >= m) {
            break;
        }
    }
    Ok(cut(enc, (tokens, mask), max))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncate_replaces_the_last_item_even_when_nothing_was_cut() {
        let mut v = vec![1, 2, 3];
        truncate(&mut v, 5, Some(9), Truncation::Right);
        assert_eq!(v, [1, 2, 9]);
        let mut v = vec![1, 2, 3, 4];
        truncate(&mut v, 2, None, Truncation::Right);
        assert_eq!(v, [1, 2]);
    }

    /// torchtune main's `truncation_type: left` keeps the last `max_seq_len` tokens, then
    /// forces the end token as on the right.
    #[test]
    fn left_truncation_keeps_the_end() {
        let mut v = vec![1, 2, 3, 4, 5];
        truncate(&mut v, 3, Some(9), Truncation::Left);
        assert_eq!(v, [3, 4, 9]);
        let mut v = vec![1, 2, 3, 4, 5];
        truncate(&mut v, 3, None, Truncation::Left);
        assert_eq!(v, [3, 4, 5]);
    }

    fn turn(role: Role, text: &str) -> Turn {
        Turn {
            role,
            pieces: vec![text.into()],
            masked: false,
        }
    }

    #[test]
    fn llama2_chat_folds_the_system_prompt_into_every_user_message() {
        let out = apply_template(
            &PromptTemplate::Llama2Chat,
            MessageFormat::SentencePiece,
            vec![
                turn(Role::System, "sys"),
                turn(Role::User, "u1"),
                turn(Role::Assistant, "a1"),
                turn(Role::User, "u2"),
            ],
        )
        .unwrap();
        assert_eq!(out.len(), 3);
        assert_eq!(
            out[0].pieces,
            [
                "[INST] ",
                "<<SYS>>\n",
                "sys",
                "\n<</SYS>>\n\n",
                "u1",
                " [/INST] "
            ]
        );
        assert_eq!(out[1].pieces, ["a1"]);
        assert_eq!(out[2].pieces[..2], ["[INST] ", "<<SYS>>\n"]);
    }

    #[test]
    fn mistral_chat_refuses_system_messages_and_keeps_empty_assistant_tags() {
        let err = apply_template(
            &PromptTemplate::MistralChat,
            MessageFormat::SentencePiece,
            vec![turn(Role::System, "s")],
        )
        .unwrap_err();
        assert!(err.to_string().contains("system"), "{err}");
        let out = apply_template(
            &PromptTemplate::MistralChat,
            MessageFormat::SentencePiece,
            vec![turn(Role::Assistant, "a")],
        )
        .unwrap();
        assert_eq!(out[0].pieces, ["", "a", ""]);
    }
}
