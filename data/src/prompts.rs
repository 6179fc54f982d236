//! Prompts for evaluation by speculative decoding (spec section 4), from jsonl files in the data
//! formats: a conversation up to its first assistant turn, rendered with the chat template and
//! the generation prompt (thinking on or off); `text` encoded as it is; `input_ids` as given.
//! Every line is a prompt: a line that cannot be one is an error naming the file and line.

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::{parse_record, prepare_messages, role, Record};
use crate::mask::RenderOptions;
use crate::source::Lines;
use crate::target::TargetTokenizer;

/// One prompt and where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Prompt {
    pub file: PathBuf,
    /// 1-based line number.
    pub line: usize,
    pub tokens: Vec<u32>,
}

/// Every line of `files` as a prompt (at most `max` of them in all); an error when there is none.
pub fn read_prompts(tok: &TargetTokenizer, files: &[PathBuf], opts: &RenderOptions, max: usize) -> Result<Vec<Prompt>> {
    let mut prompts = Vec::new();
    for file in files {
        let mut lines = Lines::open(file, Arc::new(AtomicU64::new(0)))?;
        'file: loop {
            let chunk = lines.chunk(256)?;
            if chunk.is_empty() {
                break;
            }
            for line in chunk {
                if prompts.len() == max {
                    break 'file;
                }
                let field = format!("line {}", line.number);
                let text = line.text.map_err(|e| Error::field(file, &field, e))?;
                if text.trim().is_empty() {
                    continue;
                }
                let tokens = prompt_tokens(tok, &text, opts).map_err(|e| Error::field(file, &field, e))?;
                if tokens.is_empty() {
                    return Err(Error::field(file, &field, "the prompt has no tokens"));
                }
                prompts.push(Prompt { file: file.clone(), line: line.number, tokens });
            }
        }
    }
    if prompts.is_empty() {
        let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
        return Err(Error::option("prompts", format!("no prompt in {}", names.join(", "))));
    }
    Ok(prompts)
}

/// The tokens of one record as a prompt.
fn prompt_tokens(tok: &TargetTokenizer, text: &str, opts: &RenderOptions) -> std::result::Result<Vec<u32>, String> {
    match parse_record(text).map_err(|s| s.message)? {
        Record::Text(text) => tok.encode(&text),
        Record::Tokens { ids, .. } => {
            if let Some(&bad) = ids.iter().find(|&&id| id as usize >= tok.vocab_size) {
                return Err(format!("field `input_ids`: {bad} >= vocab size {}", tok.vocab_size));
            }
            Ok(ids)
        }
        Record::Chat { messages, tools } => {
            let template = tok.template.as_ref().ok_or("the target folder has no chat template for a conversation")?;
            let messages = prepare_messages(&messages, opts.system_prompt.as_deref(), opts.thinking);
            let upto = messages.iter().position(|m| role(m) == Some("assistant")).unwrap_or(messages.len());
            if upto == 0 {
                return Err("field `messages`: no message before the first assistant turn".into());
            }
            let text = template.render(&messages[..upto], tools.as_ref(), true, opts.thinking)?;
            tok.encode(&text)
        }
    }
}
