//! Records to documents with their loss mask (spec section 6). A conversation is rendered up to
//! each assistant turn with the generation prompt, then with the turn; the turn's tokens after
//! the generation prompt's, through its last end-of-turn token (`TargetTokenizer::end_ids`), are
//! supervised (a conversation with a turn whose render does not start with the prompt's tokens
//! is skipped, counted; a turn with no end-of-turn token is supervised through its render's end,
//! counted).
//! When each such render is a token prefix of the whole conversation's render, the
//! conversation is one document supervised on all its assistant turns ([`Layout::Whole`]).
//! Templates that rewrite earlier turns (Qwen3 drops earlier reasoning and adds a `<think>`
//! block to the last turn only) break that; the conversation then gives one document per
//! assistant turn, each the render up to and including that turn, supervised on that turn only
//! ([`Layout::PerTurn`]).

use std::collections::HashMap;

use minijinja::Value;

use crate::error::{Skip, SkipReason};
use crate::format::{prepare_messages, role, Record};
use crate::target::TargetTokenizer;

/// One tokenized conversation (or one of its turns): tokens and loss mask of the same length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Document {
    pub tokens: Vec<u32>,
    pub loss_mask: Vec<bool>,
}

/// How a conversation became documents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// One document; every assistant turn supervised. Also `text` and `input_ids` records.
    Whole,
    /// One document per assistant turn (the template rewrites earlier turns).
    PerTurn,
}

/// What one record became.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    pub layout: Layout,
    pub docs: Vec<Document>,
    /// Assistant turns with no end-of-turn token, supervised through the end of their render.
    pub unended_turns: usize,
}

impl Rendered {
    fn whole(doc: Document) -> Self {
        Rendered { layout: Layout::Whole, docs: vec![doc], unended_turns: 0 }
    }
}

/// How records are rendered.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct RenderOptions {
    /// `enable_thinking`; off also drops the messages' reasoning fields.
    pub thinking: bool,
    /// Put first when a conversation has no system message.
    pub system_prompt: Option<String>,
}

fn template_error(message: String) -> Skip {
    Skip::new(SkipReason::TemplateError, message)
}

/// The documents of one record.
pub fn documents(tok: &TargetTokenizer, record: Record, opts: &RenderOptions) -> Result<Rendered, Skip> {
    match record {
        Record::Text(text) => {
            let tokens = tok.encode(&text).map_err(template_error)?;
            let loss_mask = vec![true; tokens.len()];
            Ok(Rendered::whole(Document { tokens, loss_mask }))
        }
        Record::Tokens { ids, loss_mask } => {
            if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= tok.vocab_size) {
                return Err(Skip::new(
                    SkipReason::TokenOutOfVocab,
                    format!("field `input_ids[{i}]`: {id} >= vocab size {}", tok.vocab_size),
                ));
            }
            Ok(Rendered::whole(Document { tokens: ids, loss_mask }))
        }
        Record::Chat { messages, tools } => chat_documents(tok, &messages, tools.as_ref(), opts),
    }
}

/// Length of the common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn chat_documents(
    tok: &TargetTokenizer,
    messages: &[Value],
    tools: Option<&Value>,
    opts: &RenderOptions,
) -> Result<Rendered, Skip> {
    if messages.is_empty() {
        return Err(Skip::new(SkipReason::EmptyConversation, "field `messages`: no messages"));
    }
    let template = tok
        .template
        .as_ref()
        .ok_or_else(|| template_error("the target folder has no chat template for a conversation".into()))?;
    if !opts.thinking {
        let unclosed = |m: &Value| {
            let content = m.get_attr("content").ok();
            role(m) == Some("assistant")
                && content
                    .as_ref()
                    .and_then(Value::as_str)
                    .is_some_and(|c| c.contains("<think>") && !c.contains("</think>"))
        };
        if let Some(i) = messages.iter().position(unclosed) {
            return Err(Skip::new(SkipReason::UnclosedThinking, format!("message {i}'s content")));
        }
    }
    let given = messages.len();
    let developer_role = template.names_role("developer");
    let messages = prepare_messages(messages, opts.system_prompt.as_deref(), opts.thinking, developer_role);
    // Messages put before the given ones (the system prompt), for the given index in errors.
    let injected = messages.len() - given;
    let turns: Vec<usize> = (0..messages.len()).filter(|&i| role(&messages[i]) == Some("assistant")).collect();
    if turns.is_empty() {
        return Err(Skip::new(SkipReason::NoAssistantTurn, "no message with role `assistant`"));
    }
    let mut memo = HashMap::new();
    let mut encode_render = |upto: usize, generation: bool| {
        let text = template.render(&messages[..upto], tools, generation, opts.thinking).map_err(template_error)?;
        tok.encode_with(&text, &mut memo).map_err(template_error)
    };
    let whole = encode_render(messages.len(), false)?;
    let mut per_turn = Vec::with_capacity(turns.len());
    let (mut is_prefix, mut unended_turns) = (true, 0);
    for (n, &i) in turns.iter().enumerate() {
        let prompt = encode_render(i, true)?;
        let full = encode_render(i + 1, false)?;
        // The turn is what its render adds after the generation prompt; a render that does not
        // start with the prompt (the template writes the turns before it differently once it
        // follows them) has no such boundary.
        if full.len() < prompt.len() || full[..prompt.len()] != prompt[..] {
            return Err(Skip::new(
                SkipReason::PromptNotPrefix,
                format!(
                    "assistant turn {n} (message {}): its render departs from the generation prompt's at token {}",
                    i - injected,
                    common_prefix(&prompt, &full)
                ),
            ));
        }
        let start = prompt.len();
        // Through the turn's end-of-turn token: what the template writes after it is never drafted.
        let end = match full[start..].iter().rposition(|t| tok.end_ids.contains(t)) {
            Some(p) => start + p + 1,
            None => {
                unended_turns += 1;
                full.len()
            }
        };
        is_prefix &= whole.len() >= full.len() && whole[..full.len()] == full[..];
        per_turn.push((full, start, end));
    }
    if is_prefix {
        let mut loss_mask = vec![false; whole.len()];
        for (_, start, end) in &per_turn {
            loss_mask[*start..*end].fill(true);
        }
        return Ok(Rendered {
            layout: Layout::Whole,
            docs: vec![Document { tokens: whole, loss_mask }],
            unended_turns,
        });
    }
    let docs = per_turn
        .into_iter()
        .map(|(tokens, start, end)| {
            let loss_mask = (0..tokens.len()).map(|k| (start..end).contains(&k)).collect();
            Document { tokens, loss_mask }
        })
        .collect();
    Ok(Rendered { layout: Layout::PerTurn, docs, unended_turns })
}
