//! Prompts for evaluation by speculative decoding (spec section 4), from jsonl files in the data
//! formats: a conversation up to its first assistant turn, rendered with the chat template and
//! the generation prompt (thinking on or off); `text` encoded as it is; `input_ids` as given, or,
//! with a `loss_mask` (a training row), up to its first supervised token (the answer left out, as
//! a conversation's). Every line is a prompt: a line that cannot be one is an error naming the
//! file and line.

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::{parse_prompt_record, prepare_messages, role, Record};
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

/// Every line of `files` as a prompt (at most `max` of them in all: the files after the one that
/// gives the last are not opened); an error naming a file that gives none.
pub fn read_prompts(tok: &TargetTokenizer, files: &[PathBuf], opts: &RenderOptions, max: usize) -> Result<Vec<Prompt>> {
    let mut prompts = Vec::new();
    for file in files {
        if prompts.len() >= max {
            break;
        }
        let before = prompts.len();
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
        if prompts.len() == before {
            return Err(Error::option(
                "prompts",
                format!("no prompt in {} (empty, or only blank lines)", file.display()),
            ));
        }
    }
    Ok(prompts)
}

/// The tokens of one record as a prompt.
fn prompt_tokens(tok: &TargetTokenizer, text: &str, opts: &RenderOptions) -> std::result::Result<Vec<u32>, String> {
    match parse_prompt_record(text).map_err(|s| s.message)? {
        Record::Text(text) => tok.encode(&text),
        Record::Tokens { mut ids, loss_mask } => {
            if let Some(&bad) = ids.iter().find(|&&id| id as usize >= tok.vocab_size) {
                return Err(format!("field `input_ids`: {bad} >= vocab size {}", tok.vocab_size));
            }
            // A training row: the prompt is what comes before its first supervised token.
            match loss_mask.iter().position(|&m| m) {
                Some(0) => Err("field `loss_mask`: the first token is supervised, no prompt before the answer".into()),
                first => {
                    ids.truncate(first.unwrap_or(ids.len()));
                    Ok(ids)
                }
            }
        }
        Record::Chat { messages, tools } => {
            let template = tok.template.as_ref().ok_or("the target folder has no chat template for a conversation")?;
            let developer_role = template.names_role("developer");
            let messages = prepare_messages(&messages, opts.system_prompt.as_deref(), opts.thinking, developer_role);
            let upto = messages.iter().position(|m| role(m) == Some("assistant")).unwrap_or(messages.len());
            if upto == 0 {
                return Err("field `messages`: no message before the first assistant turn".into());
            }
            let text = template.render(&messages[..upto], tools.as_ref(), true, opts.thinking)?;
            tok.encode(&text)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    fn tokenizer() -> TargetTokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/data/tokenizer-qwen");
        TargetTokenizer::load(&dir).expect("fixture tokenizer")
    }

    /// `input_ids` without a `loss_mask` is a prompt as given; with one (a training row), the
    /// prompt is the ids before the first supervised token; a row supervised from its first token
    /// leaves no prompt and is refused, naming the mask; training data still needs the mask.
    #[test]
    fn pre_tokenized_prompts_are_cut_at_their_first_supervised_token() {
        let tok = tokenizer();
        let mut rng = rand::rng();
        let len = rng.random_range(4..40);
        let ids: Vec<u32> = (0..len).map(|_| rng.random_range(0..tok.vocab_size as u32)).collect();
        let first = rng.random_range(1..len);
        let mask: Vec<u8> = (0..len).map(|i| u8::from(i == first || (i > first && rng.random_bool(0.8)))).collect();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("p.jsonl");
        let lines = [
            serde_json::json!({"input_ids": ids}),
            serde_json::json!({"input_ids": ids, "loss_mask": mask}),
            serde_json::json!({"input_ids": ids, "loss_mask": vec![0; len]}),
        ];
        let text: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
        std::fs::write(&file, text.join("\n")).unwrap();
        let prompts = read_prompts(&tok, std::slice::from_ref(&file), &RenderOptions::default(), usize::MAX).unwrap();
        let got: Vec<&[u32]> = prompts.iter().map(|p| &p.tokens[..]).collect();
        assert_eq!(got, vec![&ids[..], &ids[..first], &ids[..]]);
        assert_eq!(prompts.iter().map(|p| p.line).collect::<Vec<_>>(), vec![1, 2, 3]);

        let mut supervised = mask.clone();
        supervised[0] = 1;
        std::fs::write(&file, serde_json::json!({"input_ids": ids, "loss_mask": supervised}).to_string()).unwrap();
        let err = read_prompts(&tok, std::slice::from_ref(&file), &RenderOptions::default(), 9).unwrap_err();
        assert!(err.to_string().contains("loss_mask") && err.to_string().contains("line 1"), "{err}");
        let training = crate::format::parse_record(&lines[0].to_string()).expect_err("no mask in training data");
        assert!(training.message.contains("loss_mask"), "{}", training.message);
    }

    /// Once `max` prompts are read, the later files are not opened: a missing later file is no
    /// error then, and is one when its prompts are wanted.
    #[test]
    fn files_after_the_last_prompt_wanted_are_not_opened() {
        let tok = tokenizer();
        let dir = tempfile::tempdir().unwrap();
        let n = rand::rng().random_range(1..6);
        let file = dir.path().join("p.jsonl");
        let lines: Vec<String> =
            (0..n).map(|i| serde_json::json!({"text": format!("prompt {i}")}).to_string()).collect();
        std::fs::write(&file, lines.join("\n")).unwrap();
        let missing = dir.path().join("missing.jsonl");
        let files = [file, missing];
        let prompts = read_prompts(&tok, &files, &RenderOptions::default(), n).expect("the missing file is not opened");
        assert_eq!(prompts.len(), n);
        let err = read_prompts(&tok, &files, &RenderOptions::default(), n + 1).expect_err("the missing file is read");
        assert!(err.to_string().contains("missing.jsonl"), "{err}");
    }
}
