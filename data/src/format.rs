//! The jsonl formats of spec section 6, one record per line: OpenAI `messages` (with optional
//! `tools`), ShareGPT `conversations` (`from`/`value`), preformatted `text`, and pre-tokenized
//! `input_ids` + `loss_mask`. Chat messages become template values with their keys in input
//! order (as Python's `json.loads` keeps them), `null` keys dropped, and the reasoning fields
//! aliased as transformers does.

use std::fmt;

use minijinja::Value;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use crate::error::{Skip, SkipReason};

/// One line of a data file.
#[derive(Clone, Debug)]
pub enum Record {
    /// A conversation: messages (maps with a known `role`) and the optional `tools` list.
    Chat { messages: Vec<Value>, tools: Option<Value> },
    /// Preformatted text, encoded as it is and supervised everywhere.
    Text(String),
    /// Pre-tokenized ids and their loss mask (same length).
    Tokens { ids: Vec<u32>, loss_mask: Vec<bool> },
}

/// Roles a chat message may have (`developer`: the system message of newer OpenAI exports,
/// [`prepare_messages`]).
pub const ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];

/// Names of a message's reasoning (thinking) text, as transformers reads them.
pub const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// A JSON value parsed into a template value, maps in input order.
struct Ordered(Value);

impl<'de> de::Deserialize<'de> for Ordered {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(OrderedVisitor).map(Ordered)
    }
}

struct OrderedVisitor;

impl<'de> Visitor<'de> for OrderedVisitor {
    type Value = Value;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::from(()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Ordered(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::from(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut pairs: Vec<(String, Value)> = Vec::new();
        while let Some((k, Ordered(v))) = map.next_entry::<String, Ordered>()? {
            match pairs.iter_mut().find(|(key, _)| *key == k) {
                Some(pair) => pair.1 = v,
                None => pairs.push((k, v)),
            }
        }
        Ok(Value::from_iter(pairs))
    }
}

impl<'de> DeserializeSeed<'de> for OrderedVisitor {
    type Value = Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

/// Parses one JSON value with maps in input order.
pub fn parse_json(text: &str) -> Result<Value, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(text);
    let value = OrderedVisitor.deserialize(&mut de)?;
    de.end()?;
    Ok(value)
}

/// A map's entries in order.
pub fn entries(map: &Value) -> Vec<(String, Value)> {
    map.try_iter()
        .map(|keys| keys.filter_map(|k| Some((k.as_str()?.to_owned(), map.get_item(&k).ok()?))).collect())
        .unwrap_or_default()
}

fn malformed(message: impl Into<String>) -> Skip {
    Skip::new(SkipReason::MalformedLine, message)
}

/// The field `name` of a map, if present and not undefined.
fn field(map: &Value, name: &str) -> Option<Value> {
    map.get_attr(name).ok().filter(|v| !v.is_undefined())
}

/// Parses one line (already stripped of its newline) into a [`Record`].
pub fn parse_record(line: &str) -> Result<Record, Skip> {
    parse_line(line, true)
}

/// [`parse_record`] for a prompt: pre-tokenized `input_ids` may come without `loss_mask` (then
/// the mask is all false: nothing supervised, the ids a prompt as given). Training data
/// ([`parse_record`]) still needs the mask.
pub fn parse_prompt_record(line: &str) -> Result<Record, Skip> {
    parse_line(line, false)
}

fn parse_line(line: &str, mask_required: bool) -> Result<Record, Skip> {
    let value = parse_json(line).map_err(|e| malformed(format!("invalid JSON at column {}: {e}", e.column())))?;
    if value.kind() != minijinja::value::ValueKind::Map {
        return Err(malformed("not a JSON object"));
    }
    if let Some(messages) = field(&value, "messages") {
        return Ok(Record::Chat { messages: openai_messages(&messages, "messages")?, tools: tools(&value)? });
    }
    if let Some(turns) = field(&value, "conversations") {
        // `conversations` of OpenAI messages (`role`/`content`), as SpecForge's data scripts write.
        let first = list(&turns, "conversations")?.into_iter().next();
        if first.is_some_and(|t| field(&t, "role").is_some() && field(&t, "from").is_none()) {
            return Ok(Record::Chat { messages: openai_messages(&turns, "conversations")?, tools: tools(&value)? });
        }
        return Ok(Record::Chat { messages: sharegpt_messages(&turns)?, tools: None });
    }
    if let Some(text) = field(&value, "text") {
        let text = text.as_str().ok_or_else(|| malformed("field `text`: not a string"))?;
        return Ok(Record::Text(text.to_owned()));
    }
    if let Some(ids) = field(&value, "input_ids") {
        return tokens_record(&ids, field(&value, "loss_mask"), mask_required);
    }
    Err(Skip::new(SkipReason::UnknownFormat, "no `messages`, `conversations`, `text` or `input_ids` field"))
}

/// The optional `tools` list; a JSON string holding the list (as function-calling sets store it)
/// is parsed, and an empty one is no tools.
fn tools(record: &Value) -> Result<Option<Value>, Skip> {
    let Some(tools) = field(record, "tools").filter(|t| !t.is_none()) else { return Ok(None) };
    let tools = match tools.as_str() {
        Some(text) if text.trim().is_empty() => return Ok(None),
        Some(text) => {
            parse_json(text).map_err(|e| malformed(format!("field `tools`: a string that is not JSON: {e}")))?
        }
        None => tools,
    };
    list(&tools, "tools")?;
    Ok(Some(tools))
}

/// A message's `content` given as a list of parts: text parts alone are joined with newlines
/// into one string (what vLLM and SGLang serve to a template of string contents); any other
/// part (an image, audio) is refused naming it.
fn flatten_content(content: &Value, what: &str) -> Result<Value, Skip> {
    let parts = list(content, what)?;
    let texts = parts
        .iter()
        .enumerate()
        .map(|(j, part)| {
            let (kind, text) = (field(part, "type"), field(part, "text"));
            match (kind.as_ref().and_then(Value::as_str), text.as_ref().and_then(Value::as_str)) {
                (Some("text"), Some(text)) => Ok(text.to_owned()),
                (kind, _) => Err(malformed(format!(
                    "field `{what}[{j}]`: a part of type `{}`; only text parts (type `text`, a string `text`) are trained on",
                    kind.unwrap_or("?")
                ))),
            }
        })
        .collect::<Result<Vec<String>, Skip>>()?;
    Ok(Value::from(texts.join("\n")))
}

fn list(value: &Value, what: &str) -> Result<Vec<Value>, Skip> {
    if value.kind() != minijinja::value::ValueKind::Seq {
        return Err(malformed(format!("field `{what}`: not a list")));
    }
    Ok(value.try_iter().map(|it| it.collect()).unwrap_or_default())
}

fn tokens_record(ids: &Value, mask: Option<Value>, mask_required: bool) -> Result<Record, Skip> {
    let ids = list(ids, "input_ids")?
        .iter()
        .enumerate()
        .map(|(i, v)| {
            i64::try_from(v.clone())
                .ok()
                .filter(|&id| id >= 0 && id <= u32::MAX as i64)
                .map(|id| id as u32)
                .ok_or_else(|| malformed(format!("field `input_ids[{i}]`: `{v}` is not a token id")))
        })
        .collect::<Result<Vec<u32>, Skip>>()?;
    let mask = match mask {
        Some(mask) => mask,
        None if !mask_required => return Ok(Record::Tokens { loss_mask: vec![false; ids.len()], ids }),
        None => return Err(malformed("field `loss_mask`: missing next to `input_ids`")),
    };
    let loss_mask = list(&mask, "loss_mask")?
        .iter()
        .enumerate()
        .map(|(i, v)| match i64::try_from(v.clone()) {
            Ok(0) => Ok(false),
            Ok(1) => Ok(true),
            _ if v.kind() == minijinja::value::ValueKind::Bool => Ok(v.is_true()),
            _ => Err(malformed(format!("field `loss_mask[{i}]`: `{v}` is not 0, 1, true or false"))),
        })
        .collect::<Result<Vec<bool>, Skip>>()?;
    if ids.len() != loss_mask.len() {
        return Err(malformed(format!("field `loss_mask`: {} entries for {} input_ids", loss_mask.len(), ids.len())));
    }
    Ok(Record::Tokens { ids, loss_mask })
}

/// OpenAI messages (the list in field `name`): maps with a known `role`; `null` keys dropped;
/// text-part contents flattened; reasoning aliased (`thinking` first, `reasoning_content` kept
/// or appended) as transformers does.
fn openai_messages(messages: &Value, name: &str) -> Result<Vec<Value>, Skip> {
    list(messages, name)?
        .iter()
        .enumerate()
        .map(|(i, m)| {
            if m.kind() != minijinja::value::ValueKind::Map {
                return Err(malformed(format!("field `{name}[{i}]`: not an object")));
            }
            let mut pairs: Vec<(String, Value)> = entries(m).into_iter().filter(|(_, v)| !v.is_none()).collect();
            let role = pairs.iter().find(|(k, _)| k == "role").and_then(|(_, v)| v.as_str().map(str::to_owned));
            match role {
                None => return Err(malformed(format!("field `{name}[{i}].role`: missing or not a string"))),
                Some(r) if !ROLES.contains(&r.as_str()) => {
                    return Err(Skip::new(SkipReason::UnknownRole, format!("field `{name}[{i}].role`: `{r}`")))
                }
                Some(_) => {}
            }
            if let Some(pair) =
                pairs.iter_mut().find(|(k, v)| k == "content" && v.kind() == minijinja::value::ValueKind::Seq)
            {
                pair.1 = flatten_content(&pair.1, &format!("{name}[{i}].content"))?;
            }
            let reasoning =
                REASONING_FIELDS.iter().find_map(|f| pairs.iter().find(|(k, _)| k == f).map(|(_, v)| v.clone()));
            if let Some(r) = reasoning {
                if !pairs.iter().any(|(k, _)| k == "thinking") {
                    pairs.insert(0, ("thinking".into(), r.clone()));
                }
                match pairs.iter_mut().find(|(k, _)| k == "reasoning_content") {
                    Some(pair) => pair.1 = r,
                    None => pairs.push(("reasoning_content".into(), r)),
                }
            }
            Ok(Value::from_iter(pairs))
        })
        .collect()
}

/// ShareGPT turns: `from` human / gpt (chatgpt, bing, bard) / system / tool (or the OpenAI role
/// names), `value`.
fn sharegpt_messages(turns: &Value) -> Result<Vec<Value>, Skip> {
    list(turns, "conversations")?
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let text = |name: &str| {
                field(t, name)
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .ok_or_else(|| malformed(format!("field `conversations[{i}].{name}`: missing or not a string")))
            };
            let from = text("from")?;
            let role = match from.as_str() {
                "human" | "user" => "user",
                "gpt" | "assistant" | "chatgpt" | "bing" | "bard" => "assistant",
                "system" => "system",
                "tool" => "tool",
                other => {
                    return Err(Skip::new(
                        SkipReason::UnknownRole,
                        format!("field `conversations[{i}].from`: `{other}`"),
                    ))
                }
            };
            Ok(Value::from_iter([("role", Value::from(role)), ("content", Value::from(text("value")?))]))
        })
        .collect()
}

/// The messages a template renders: `developer` messages as `system` ones unless the template
/// names a developer role (`developer_role`; Qwen's templates drop a role they do not know,
/// Llama's write it as a header of its own); the system prompt (if given and the conversation
/// has none) first; with thinking off, the reasoning removed (the drafter is served without it):
/// the reasoning fields, and reasoning written inline in an assistant's `content` (what comes
/// before its last `</think>`, as the Qwen3 templates split it).
pub fn prepare_messages(
    messages: &[Value],
    system_prompt: Option<&str>,
    thinking: bool,
    developer_role: bool,
) -> Vec<Value> {
    let as_system = |m: &Value| {
        if developer_role || role(m) != Some("developer") {
            return m.clone();
        }
        Value::from_iter(entries(m).into_iter().map(|(k, v)| match k.as_str() {
            "role" => (k, Value::from("system")),
            _ => (k, v),
        }))
    };
    let messages: Vec<Value> = messages.iter().map(as_system).collect();
    let has_system = messages.first().is_some_and(|m| role(m) == Some("system"));
    let system = system_prompt
        .filter(|_| !has_system)
        .map(|s| Value::from_iter([("role", Value::from("system")), ("content", Value::from(s))]));
    let strip = |m: &Value| {
        if thinking {
            return m.clone();
        }
        let assistant = role(m) == Some("assistant");
        Value::from_iter(entries(m).into_iter().filter(|(k, _)| !REASONING_FIELDS.contains(&k.as_str())).map(
            |(k, v)| match (assistant && k == "content", v.as_str().and_then(|c| c.rsplit_once("</think>"))) {
                (true, Some((_, answer))) => (k, Value::from(answer.trim_start_matches('\n'))),
                _ => (k, v),
            },
        ))
    };
    system.into_iter().chain(messages.iter().map(strip)).collect()
}

/// A message's role, if it is one of [`ROLES`].
pub fn role(message: &Value) -> Option<&'static str> {
    let r = message.get_attr("role").ok()?;
    ROLES.iter().copied().find(|known| r.as_str() == Some(known))
}
