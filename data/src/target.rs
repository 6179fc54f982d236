//! The target folder's tokenizer side: `tokenizer.json` (through the `tokenizers` crate, pure
//! Rust), the special tokens and chat template of `tokenizer_config.json` (the template of
//! `chat_template.jinja` next to it first, as transformers does), and the vocabulary size of
//! `config.json` when present (else the tokenizer's).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use serde_json::Value as Json;
use tokenizers::Tokenizer;

use crate::error::{Error, Result};
use crate::template::ChatTemplate;

/// Special-token names of `tokenizer_config.json` the template sees.
const SPECIAL_TOKEN_NAMES: [&str; 4] = ["bos_token", "eos_token", "pad_token", "unk_token"];

/// What the pipeline needs from the target folder.
pub struct TargetTokenizer {
    pub tokenizer: Tokenizer,
    /// `None` when the folder has no chat template (only `text` and `input_ids` data then).
    pub template: Option<ChatTemplate>,
    /// Ids must be below this (the target's embedding rows).
    pub vocab_size: usize,
    /// One past the largest id the tokenizer has (its base and added tokens).
    pub ids_end: usize,
    /// The id padding tokens get in packed rows: `pad_token`, else `eos_token`, else 0.
    pub pad_id: u32,
    /// The end-of-turn ids a supervised assistant turn ends with: `eos_token`'s and those of
    /// `generation_config.json`'s `eos_token_id` (an id or a list; Gemma's `<end_of_turn>`, Llama
    /// 3.1's `<|eom_id|>`), when the folder has them.
    pub end_ids: Vec<u32>,
    /// `tokenizer_config.json`'s special tokens as `(name, text)`: the template renders them and
    /// they give `pad_id` (part of the cache key, with `end_ids`).
    pub special_tokens: Vec<(String, String)>,
    /// `tokenizer.json`'s bytes hash (part of the cache key).
    pub tokenizer_hash: [u8; 32],
    splitter: Option<Splitter>,
}

/// The added tokens the tokenizer matches before normalizing, found leftmost-longest as it finds
/// them. The tokenizer encodes the pieces between them independently of each other, so
/// `encode(text)` is the concatenation of the pieces' ids and those tokens' ids; a piece that
/// recurs (a message in each prefix render of a conversation) is encoded once.
struct Splitter {
    matcher: AhoCorasick,
    ids: Vec<u32>,
}

impl Splitter {
    /// `None` when a piece-wise encoding could differ: an added token that strips spaces or must
    /// be a single word, special tokens encoded as text, or a pre-tokenizer that treats the
    /// text's first piece alone (Metaspace with `prepend_scheme: first`, in `tokenizer_json`).
    fn new(tokenizer: &Tokenizer, tokenizer_json: &Json) -> Option<Self> {
        if tokenizer.get_encode_special_tokens() || tokenizer_json.get("pre_tokenizer").is_some_and(prepends_first) {
            return None;
        }
        let tokens: Vec<(u32, tokenizers::AddedToken)> =
            tokenizer.get_added_tokens_decoder().into_iter().filter(|(_, t)| !t.normalized).collect();
        if tokens.is_empty() || tokens.iter().any(|(_, t)| t.lstrip || t.rstrip || t.single_word) {
            return None;
        }
        let matcher = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|(_, t)| t.content.as_str()))
            .ok()?;
        Some(Splitter { matcher, ids: tokens.iter().map(|(id, _)| *id).collect() })
    }
}

fn read(file: &Path) -> Result<Vec<u8>> {
    std::fs::read(file).map_err(|e| Error::io(file, e))
}

/// The ids of `generation_config.json`'s `eos_token_id` (absent: none), each inside the vocab.
fn generation_eos_ids(file: &Path, config: &Json, vocab_size: usize) -> Result<Vec<u32>> {
    let ids = match config.get("eos_token_id") {
        None | Some(Json::Null) => return Ok(Vec::new()),
        Some(Json::Array(ids)) => ids.iter().collect(),
        Some(one) => vec![one],
    };
    ids.into_iter()
        .map(|id| match id.as_u64().and_then(|id| u32::try_from(id).ok()) {
            Some(id) if (id as usize) < vocab_size => Ok(id),
            _ => Err(Error::field(
                file,
                "eos_token_id",
                format!("{id}: not a token id below the vocab size {vocab_size}"),
            )),
        })
        .collect()
}

fn read_json(file: &Path) -> Result<Json> {
    let bytes = read(file)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| Error::field(file, "JSON", format!("invalid at line {}, column {}: {e}", e.line(), e.column())))
}

/// A special token's text: a string, or an added-token object with `content`.
fn token_text(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

/// Whether a pre-tokenizer config holds a Metaspace that prepends to the first piece only.
fn prepends_first(config: &Json) -> bool {
    match config {
        Json::Object(o) => {
            (o.get("type").and_then(Json::as_str) == Some("Metaspace")
                && o.get("prepend_scheme").and_then(Json::as_str) == Some("first"))
                || o.values().any(prepends_first)
        }
        Json::Array(a) => a.iter().any(prepends_first),
        _ => false,
    }
}

impl TargetTokenizer {
    /// Loads `dir`; every missing or corrupt file is an error naming it.
    pub fn load(dir: &Path) -> Result<Self> {
        let tok_file = dir.join("tokenizer.json");
        let bytes = read(&tok_file)?;
        let mut tokenizer =
            Tokenizer::from_bytes(&bytes).map_err(|e| Error::field(&tok_file, "tokenizer", e.to_string()))?;
        // As transformers encodes text: the file's truncation and padding (if any) do not apply.
        tokenizer
            .with_truncation(None)
            .map_err(|e| Error::field(&tok_file, "truncation", e.to_string()))?
            .with_padding(None);
        let cfg_file = dir.join("tokenizer_config.json");
        let cfg = read_json(&cfg_file)?;
        let special_tokens: Vec<(String, String)> = SPECIAL_TOKEN_NAMES
            .iter()
            .filter_map(|&name| cfg.get(name).and_then(token_text).map(|t| (name.to_owned(), t)))
            .collect();
        let template = Self::template(dir, &cfg_file, &cfg)?
            .map(|(source, file)| ChatTemplate::new(source, &file, special_tokens.clone()))
            .transpose()?;
        let config_file = dir.join("config.json");
        // One past the largest id (the count of tokens falls short of it where ids have gaps).
        let tokenizer_vocab = tokenizer.get_vocab(true).values().max().map_or(0, |&id| id as usize + 1);
        let vocab_size = if config_file.exists() {
            let config = read_json(&config_file)?;
            let v = config
                .get("vocab_size")
                .or_else(|| config.pointer("/text_config/vocab_size"))
                .and_then(Json::as_u64)
                .ok_or_else(|| Error::field(&config_file, "vocab_size", "missing or not an integer"))?
                as usize;
            if tokenizer_vocab > v {
                return Err(Error::field(
                    &tok_file,
                    "vocab",
                    format!(
                        "ids up to {}, beyond the target's vocab_size {v} ({})",
                        tokenizer_vocab - 1,
                        config_file.display()
                    ),
                ));
            }
            v
        } else {
            tokenizer_vocab
        };
        let id_of =
            |name: &str| special_tokens.iter().find(|(n, _)| n == name).and_then(|(_, t)| tokenizer.token_to_id(t));
        let pad_id = id_of("pad_token").or_else(|| id_of("eos_token")).unwrap_or(0);
        let mut end_ids: Vec<u32> = id_of("eos_token").into_iter().collect();
        let gen_file = dir.join("generation_config.json");
        if gen_file.exists() {
            for id in generation_eos_ids(&gen_file, &read_json(&gen_file)?, vocab_size)? {
                if !end_ids.contains(&id) {
                    end_ids.push(id);
                }
            }
        }
        let json: Json = serde_json::from_slice(&bytes).map_err(|e| Error::field(&tok_file, "JSON", e.to_string()))?;
        let splitter = Splitter::new(&tokenizer, &json);
        Ok(TargetTokenizer {
            tokenizer,
            template,
            vocab_size,
            ids_end: tokenizer_vocab,
            pad_id,
            end_ids,
            special_tokens,
            tokenizer_hash: crate::cache::sha256(&bytes),
            splitter,
        })
    }

    /// The chat template as transformers loads it: `chat_template.jinja` when the folder has one
    /// (it takes priority over the config's), else `chat_template` of the config (a string, or a
    /// list of named templates of which `default` is taken).
    fn template(dir: &Path, cfg_file: &Path, cfg: &Json) -> Result<Option<(String, PathBuf)>> {
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            let source = String::from_utf8(read(&jinja)?).map_err(|e| Error::field(&jinja, "text", e.to_string()))?;
            return Ok(Some((source, jinja)));
        }
        match cfg.get("chat_template") {
            Some(Json::String(s)) => Ok(Some((s.clone(), cfg_file.to_owned()))),
            Some(Json::Array(named)) => {
                let default = named.iter().find(|t| t.get("name").and_then(Json::as_str) == Some("default"));
                let source = default.and_then(|t| t.get("template")).and_then(Json::as_str).ok_or_else(|| {
                    Error::field(cfg_file, "chat_template", "a list of templates without a `default` one")
                })?;
                Ok(Some((source.to_owned(), cfg_file.to_owned())))
            }
            Some(Json::Null) | None => Ok(None),
            Some(_) => Err(Error::field(cfg_file, "chat_template", "neither a string nor a list")),
        }
    }

    /// The ids of `text`, special-token text included, without adding special tokens.
    pub fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, String> {
        self.tokenizer.encode_fast(text, false).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string())
    }

    /// [`TargetTokenizer::encode`], reusing the ids of pieces (between added tokens) already in
    /// `memo`; equal to it token for token.
    pub fn encode_with(
        &self,
        text: &str,
        memo: &mut HashMap<String, Vec<u32>>,
    ) -> std::result::Result<Vec<u32>, String> {
        let Some(splitter) = &self.splitter else { return self.encode(text) };
        let mut ids = Vec::new();
        let mut piece = |piece: &str, ids: &mut Vec<u32>| -> std::result::Result<(), String> {
            match memo.get(piece) {
                Some(known) => ids.extend(known),
                None => {
                    let new = self.encode(piece)?;
                    ids.extend(&new);
                    memo.insert(piece.to_owned(), new);
                }
            }
            Ok(())
        };
        let mut start = 0;
        for m in splitter.matcher.find_iter(text) {
            if m.start() > start {
                piece(&text[start..m.start()], &mut ids)?;
            }
            ids.push(splitter.ids[m.pattern().as_usize()]);
            start = m.end();
        }
        if start < text.len() {
            piece(&text[start..], &mut ids)?;
        }
        Ok(ids)
    }

    /// The text of `ids` (special tokens shown).
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, false).unwrap_or_else(|e| format!("<undecodable: {e}>"))
    }
}
