//! The target's chat template, rendered as transformers renders it: `trim_blocks`,
//! `lstrip_blocks`, no trailing newline kept, loop controls, Python string and dict methods
//! (pycompat), `raise_exception`, `tojson` as Python's `json.dumps`, the special tokens
//! (`bos_token`, ...) and `enable_thinking` in the context. `True`/`False`/`None` print as Python
//! prints them. `strftime_now` is not provided, so templates fall back to their fixed date.

use std::fmt::Write;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, ErrorKind, Value};

use crate::error::{Error, Result};

/// A compiled chat template and the special tokens it sees.
pub struct ChatTemplate {
    env: Environment<'static>,
    special_tokens: Vec<(String, String)>,
    /// Where the template came from (`tokenizer_config.json` or `chat_template.jinja`).
    pub file: PathBuf,
    /// The template's text (part of the cache key).
    pub source: String,
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source` (read from `file`); `special_tokens` are `(name, text)` pairs such as
    /// `("bos_token", "<|begin_of_text|>")`.
    pub fn new(source: String, file: &Path, special_tokens: Vec<(String, String)>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        });
        env.add_filter("tojson", tojson);
        env.set_formatter(|out, state, value| match value.kind() {
            ValueKind::Bool => out.write_str(if value.is_true() { "True" } else { "False" }).map_err(Into::into),
            ValueKind::None => out.write_str("None").map_err(Into::into),
            _ => minijinja::escape_formatter(out, state, value),
        });
        env.add_template_owned(NAME, source.clone())
            .map_err(|e| Error::Template { file: file.to_owned(), message: describe(&e) })?;
        Ok(ChatTemplate { env, special_tokens, file: file.to_owned(), source })
    }

    /// Renders `messages` (with `tools` if any) and, when asked, the generation prompt. An error
    /// is the template's own message (`raise_exception`) or minijinja's.
    pub fn render(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> std::result::Result<String, String> {
        let mut ctx: Vec<(String, Value)> = vec![
            ("messages".into(), Value::from(messages.to_vec())),
            ("tools".into(), tools.cloned().unwrap_or(Value::from(()))),
            ("add_generation_prompt".into(), Value::from(add_generation_prompt)),
            ("enable_thinking".into(), Value::from(enable_thinking)),
        ];
        ctx.extend(self.special_tokens.iter().map(|(k, v)| (k.clone(), Value::from(v.as_str()))));
        let template = self.env.get_template(NAME).map_err(|e| describe(&e))?;
        template.render(Value::from_iter(ctx)).map_err(|e| describe(&e))
    }

    /// Whether the template names `role` as a string literal (it renders that role itself).
    pub fn names_role(&self, role: &str) -> bool {
        self.source.contains(&format!("\"{role}\"")) || self.source.contains(&format!("'{role}'"))
    }
}

/// The error's message with its cause and line, without minijinja's debug dump.
fn describe(e: &minijinja::Error) -> String {
    let mut text = match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(detail)) => detail.to_owned(),
        _ => e.to_string(),
    };
    if let Some(line) = e.line() {
        let _ = write!(text, " (template line {line})");
    }
    text
}

/// `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=indent)`: separators `, ` and
/// `: ` (`,` and newlines with an indent), keys in input order, non-ASCII and `<>&'` unescaped.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    dumps(&value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn dumps(
    v: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        // Integers of any JSON size (u64 above i64::MAX too) as integers, as Python's.
        ValueKind::Number => match i128::try_from(v.clone()) {
            Ok(i) if v.is_integer() => {
                write!(out, "{i}").map_err(|e| minijinja::Error::new(ErrorKind::WriteFailure, e.to_string()))?
            }
            _ => out.push_str(&python_float(f64::try_from(v.clone())?)),
        },
        ValueKind::String => quote(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Map => {
            let is_map = v.kind() == ValueKind::Map;
            let (open, close) = if is_map { ('{', '}') } else { ('[', ']') };
            let items: Vec<Value> = v.try_iter()?.collect();
            out.push(open);
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                if is_map {
                    quote(&item.to_string(), out);
                    out.push_str(": ");
                    dumps(&v.get_item(item)?, indent, depth + 1, out)?;
                } else {
                    dumps(item, indent, depth + 1, out)?;
                }
            }
            if !items.is_empty() {
                newline(out, depth);
            }
            out.push(close);
        }
        _ => quote(&v.to_string(), out),
    }
    Ok(())
}

/// A JSON string as Python writes it with `ensure_ascii=False`.
fn quote(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest round-trip digits, positional for exponents -4..16
/// (with `.0` when integral), else `d.ddde+XX`.
pub fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').expect("LowerExp has an exponent");
    let exp: i32 = exp.parse().expect("LowerExp exponent is an integer");
    if (-4..16).contains(&exp) {
        let s = format!("{x}");
        if s.contains('.') {
            s
        } else {
            s + ".0"
        }
    } else {
        format!("{mantissa}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    }
}
