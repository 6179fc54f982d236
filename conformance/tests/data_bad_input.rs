//! Bad data gives a clear outcome, never a panic: a line that cannot become a document is a
//! counted skip whose example in the summary names the file, the line and the field (or the
//! template's own message); a missing or corrupt file, a broken template or a data set with
//! nothing left is a `dflash_data::Error` naming the file or the filter.

use std::io::Write;
use std::path::{Path, PathBuf};

use dflash_conformance::fixtures_dir;
use dflash_data::target::TargetTokenizer;
use dflash_data::{DataOptions, Dataset, Error, SkipReason};
use rand::Rng;
use rstest::rstest;
use tempfile::TempDir;

const GOOD: &str = r#"{"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help you today?"}]}"#;

fn tokenizer(name: &str) -> TargetTokenizer {
    TargetTokenizer::load(&fixtures_dir().join("data").join(name)).expect("fixture tokenizer")
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::File::create(&path).and_then(|mut f| f.write_all(bytes)).expect("write");
    path
}

/// A copy of a fixture tokenizer folder.
fn copy_tokenizer(name: &str) -> TempDir {
    let tmp = tempfile::tempdir().expect("temporary folder");
    for entry in std::fs::read_dir(fixtures_dir().join("data").join(name)).expect("fixture") {
        let path = entry.expect("entry").path();
        std::fs::copy(&path, tmp.path().join(path.file_name().unwrap())).expect("copy");
    }
    tmp
}

fn options(dir: &Path) -> DataOptions {
    DataOptions { held_out: dflash_data::HeldOut::Fraction(0.0), ..DataOptions::new(dir.join("cache")) }
}

/// One bad line between two good ones is skipped and counted under its reason; the summary's
/// example names the file, line 2 and each of `names`.
#[rstest]
#[case::malformed_json("tokenizer-qwen", br#"{"messages": [{"role": "user""#.to_vec(), SkipReason::MalformedLine, &["invalid JSON", "column"]) ]
#[case::not_an_object("tokenizer-qwen", b"[1, 2]".to_vec(), SkipReason::MalformedLine, &["not a JSON object"])]
#[case::not_utf8("tokenizer-qwen", b"{\"text\": \"\xff\xfe\"}".to_vec(), SkipReason::MalformedLine, &["not UTF-8"])]
#[case::unknown_role("tokenizer-qwen", br#"{"messages": [{"role": "wizard", "content": "x"}]}"#.to_vec(), SkipReason::UnknownRole, &["messages[0].role", "wizard"])]
#[case::unknown_sharegpt_from("tokenizer-qwen", br#"{"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]}"#.to_vec(), SkipReason::UnknownRole, &["conversations[1].from", "bot"])]
#[case::missing_role("tokenizer-qwen", br#"{"messages": [{"content": "x"}]}"#.to_vec(), SkipReason::MalformedLine, &["messages[0].role"])]
#[case::empty_conversation("tokenizer-qwen", br#"{"messages": []}"#.to_vec(), SkipReason::EmptyConversation, &["messages"])]
#[case::no_assistant_turn("tokenizer-qwen", br#"{"messages": [{"role": "user", "content": "anyone?"}]}"#.to_vec(), SkipReason::NoAssistantTurn, &["assistant"])]
#[case::template_raises("tokenizer-llama", br#"{"messages": [{"role": "assistant", "content": "I start"}, {"role": "user", "content": "ok"}]}"#.to_vec(), SkipReason::TemplateError, &["must not start with an assistant turn"])]
#[case::token_out_of_vocab("tokenizer-qwen", br#"{"input_ids": [5, 6, 99999], "loss_mask": [1, 1, 1]}"#.to_vec(), SkipReason::TokenOutOfVocab, &["input_ids[2]", "99999"])]
#[case::mask_length("tokenizer-qwen", br#"{"input_ids": [5, 6, 7], "loss_mask": [1, 1]}"#.to_vec(), SkipReason::MalformedLine, &["loss_mask", "2 entries for 3"])]
#[case::bad_mask_value("tokenizer-qwen", br#"{"input_ids": [5, 6], "loss_mask": [1, 7]}"#.to_vec(), SkipReason::MalformedLine, &["loss_mask[1]"])]
#[case::negative_id("tokenizer-qwen", br#"{"input_ids": [5, -6], "loss_mask": [1, 1]}"#.to_vec(), SkipReason::MalformedLine, &["input_ids[1]"])]
#[case::unknown_format("tokenizer-qwen", br#"{"prompt": "x", "completion": "y"}"#.to_vec(), SkipReason::UnknownFormat, &["messages"])]
#[case::no_anchor_candidate("tokenizer-qwen", br#"{"input_ids": [5, 6, 7, 8], "loss_mask": [1, 0, 1, 0]}"#.to_vec(), SkipReason::NoAnchorCandidate, &["2 consecutive supervised"])]
#[case::prompt_not_a_prefix("tokenizer-qwen", br#"{"messages": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "Part one."}, {"role": "assistant", "content": "Part two."}]}"#.to_vec(), SkipReason::PromptNotPrefix, &["assistant turn 1", "generation prompt"])]
#[case::unclosed_thinking("tokenizer-qwen", br#"{"messages": [{"role": "user", "content": "Prove it"}, {"role": "assistant", "content": "<think>\nLet me see, first"}]}"#.to_vec(), SkipReason::UnclosedThinking, &["message 1's content"])]
#[case::image_part("tokenizer-qwen", br#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x.png"}}]}, {"role": "assistant", "content": "A cat."}]}"#.to_vec(), SkipReason::MalformedLine, &["messages[0].content[1]", "image_url"])]
#[case::tools_string_not_json("tokenizer-qwen", br#"{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "tools": "[{oops"}"#.to_vec(), SkipReason::MalformedLine, &["tools", "not JSON"])]
#[case::longer_than_the_limit("tokenizer-qwen", long_line(), SkipReason::MalformedLine, &["bytes, over the 16 MiB limit"])]
fn a_bad_line_is_a_counted_skip_naming_file_and_line(
    #[case] tok: &str,
    #[case] line: Vec<u8>,
    #[case] reason: SkipReason,
    #[case] names: &[&str],
) {
    let tmp = tempfile::tempdir().unwrap();
    let mut bytes = format!("{GOOD}\n").into_bytes();
    bytes.extend(&line);
    bytes.extend(format!("\n{GOOD}\n").as_bytes());
    let file = write(tmp.path(), "data.jsonl", &bytes);
    let data =
        Dataset::prepare(&tokenizer(tok), std::slice::from_ref(&file), &options(tmp.path())).expect("two good lines");
    let stats = data.stats();
    assert_eq!(stats.skipped.get(&reason), Some(&1), "{reason:?} counted once: {stats}");
    assert_eq!(stats.total_skipped(), 1, "{stats}");
    assert_eq!(stats.documents, 2);
    let example = &stats.examples[0];
    assert!(example.starts_with(&format!("{}:2: ", file.display())), "`{example}` names the file and line 2");
    for name in names {
        assert!(example.contains(name), "`{example}` does not name {name}");
    }
    assert!(stats.to_string().contains(example.as_str()), "the summary lists the example");
}

/// A `{"text"}` line just over `MAX_LINE_BYTES`: skipped without being read into memory.
fn long_line() -> Vec<u8> {
    let pad = dflash_data::source::MAX_LINE_BYTES as usize + rand::rng().random_range(1..4096);
    [&br#"{"text": ""#[..], &vec![b'a'; pad], &br#""}"#[..]].concat()
}

fn expect_error(result: dflash_data::Result<impl Sized>) -> Error {
    match result {
        Ok(_) => panic!("bad input accepted"),
        Err(e) => e,
    }
}

fn assert_names(err: &Error, names: &[&str]) {
    let text = err.to_string();
    for name in names {
        assert!(text.contains(name), "`{text}` does not name {name}");
    }
}

#[test]
fn a_missing_data_file_is_an_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("nope.jsonl");
    let err = expect_error(Dataset::prepare(&tokenizer("tokenizer-qwen"), &[missing], &options(tmp.path())));
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert_names(&err, &["nope.jsonl"]);
}

/// A data file given twice (by another path to the same file) is an error naming both; a byte
/// order mark before the first line and CRLF line ends read as the plain file does.
#[test]
fn a_file_given_twice_is_refused_and_a_bom_is_not_a_bad_line() {
    let tmp = tempfile::tempdir().unwrap();
    let plain = write(tmp.path(), "plain.jsonl", format!("{GOOD}\n{GOOD}\n").as_bytes());
    let again = tmp.path().join(".").join("plain.jsonl");
    let err =
        expect_error(Dataset::prepare(&tokenizer("tokenizer-qwen"), &[plain.clone(), again], &options(tmp.path())));
    assert_names(&err, &["given twice", "plain.jsonl"]);
    let windows = write(tmp.path(), "windows.jsonl", format!("\u{feff}{GOOD}\r\n{GOOD}\r\n").as_bytes());
    let stats = |file: &PathBuf, cache: &str| {
        let opts =
            DataOptions { held_out: dflash_data::HeldOut::Fraction(0.0), ..DataOptions::new(tmp.path().join(cache)) };
        let data = Dataset::prepare(&tokenizer("tokenizer-qwen"), std::slice::from_ref(file), &opts).expect("prepared");
        (data.stats().documents, data.stats().tokens, data.stats().total_skipped())
    };
    assert_eq!(stats(&windows, "cache-windows"), stats(&plain, "cache-plain"));
    assert_eq!(stats(&windows, "cache-windows").2, 0, "no line skipped");
}

/// Every line skipped or filtered: an error naming each reason and its count.
#[test]
fn a_data_set_with_every_row_filtered_is_an_error_naming_the_filter() {
    let tmp = tempfile::tempdir().unwrap();
    let lines = "{\"input_ids\": [1, 2, 3], \"loss_mask\": [0, 1, 0]}\n{\"messages\": []}\n";
    let file = write(tmp.path(), "data.jsonl", lines.as_bytes());
    let err = expect_error(Dataset::prepare(&tokenizer("tokenizer-qwen"), &[file], &options(tmp.path())));
    assert!(matches!(err, Error::NoRows(_)), "{err:?}");
    assert_names(&err, &["fewer than 2 consecutive supervised tokens: 1", "empty conversation: 1"]);
}

/// Breaks one file of a copied tokenizer folder; loading names that file.
#[rstest]
#[case::missing_tokenizer("tokenizer.json", None, &["tokenizer.json", "No such file"])]
#[case::corrupt_tokenizer("tokenizer.json", Some(&b"{\"version\": \"1.0\", \"model\": "[..]), &["tokenizer.json", "tokenizer"])]
#[case::missing_config("tokenizer_config.json", None, &["tokenizer_config.json"])]
#[case::corrupt_config("tokenizer_config.json", Some(&b"{\"bos_token\": "[..]), &["tokenizer_config.json", "invalid at line 1"])]
#[case::template_syntax("chat_template.jinja", Some(&b"{% for m in messages %}{{ m.content }"[..]), &["chat_template.jinja", "chat template"])]
#[case::vocab_smaller_than_tokenizer("config.json", Some(&b"{\"vocab_size\": 100}"[..]), &["tokenizer.json", "vocab_size 100", "config.json"])]
#[case::config_without_vocab("config.json", Some(&b"{\"hidden_size\": 8}"[..]), &["config.json", "vocab_size"])]
fn a_broken_target_folder_is_an_error_naming_the_file(
    #[case] file: &str,
    #[case] content: Option<&[u8]>,
    #[case] names: &[&str],
) {
    let dir = copy_tokenizer("tokenizer-llama");
    match content {
        Some(bytes) => {
            write(dir.path(), file, bytes);
        }
        None => std::fs::remove_file(dir.path().join(file)).expect("remove"),
    }
    let err = expect_error(TargetTokenizer::load(dir.path()));
    assert_names(&err, names);
}

/// A tokenizer whose ids have a gap (a vocabulary entry past the others): its ids end one past
/// the largest id, not at its count of tokens, and a `vocab_size` below that largest id is
/// refused.
#[test]
fn the_tokenizers_ids_end_past_its_largest_id() {
    let dir = copy_tokenizer("tokenizer-qwen");
    let file = dir.path().join("tokenizer.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let before = TargetTokenizer::load(dir.path()).expect("loads").ids_end as u64;
    let gap = before + rand::random_range(2..20);
    json["model"]["vocab"]["zzgap"] = gap.into();
    std::fs::write(&file, json.to_string()).unwrap();
    let loaded = TargetTokenizer::load(dir.path()).expect("loads");
    assert!((loaded.tokenizer.get_vocab_size(true) as u64) < gap, "a count below the largest id");
    assert_eq!(loaded.ids_end as u64, gap + 1);
    write(dir.path(), "config.json", format!("{{\"vocab_size\": {gap}}}").as_bytes());
    let err = expect_error(TargetTokenizer::load(dir.path()));
    assert_names(&err, &["tokenizer.json", &format!("ids up to {gap}"), &format!("vocab_size {gap}")]);
}

/// `chat_template.jinja` takes priority over the config's `chat_template`, as transformers loads
/// them: its template is the one rendered, and a broken one is an error naming it (never quietly
/// replaced by the config's).
#[test]
fn the_template_file_takes_priority_over_the_config() {
    let dir = copy_tokenizer("tokenizer-qwen");
    let config = std::fs::read_to_string(dir.path().join("tokenizer_config.json")).unwrap();
    assert!(config.contains("\"chat_template\""), "the fixture's config holds a template");
    let own = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}";
    write(dir.path(), "chat_template.jinja", own.as_bytes());
    let loaded = TargetTokenizer::load(dir.path()).expect("loads");
    let template = loaded.template.as_ref().expect("a template");
    assert!(template.file.ends_with("chat_template.jinja") && template.source == own, "{:?}", template.file);
    write(dir.path(), "chat_template.jinja", b"{% for m in messages %}{{ m.content }");
    let err = expect_error(TargetTokenizer::load(dir.path()));
    assert_names(&err, &["chat_template.jinja", "chat template"]);
}

/// A `tokenizer.json` saved with truncation or padding encodes as without them (transformers
/// turns both off for a plain encode): a piece longer than the truncation keeps every token, and
/// no padding is added.
#[test]
fn the_tokenizer_files_truncation_and_padding_do_not_apply() {
    let text = "A sentence long enough to be cut by a truncation to four tokens, and padded otherwise.";
    let plain = TargetTokenizer::load(&fixtures_dir().join("data/tokenizer-qwen")).unwrap().encode(text).unwrap();
    assert!(plain.len() > 8);
    for setting in [
        (
            "truncation",
            serde_json::json!({"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}),
        ),
        (
            "padding",
            serde_json::json!({"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}),
        ),
    ] {
        let dir = copy_tokenizer("tokenizer-qwen");
        let file = dir.path().join("tokenizer.json");
        let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        json[setting.0] = setting.1;
        std::fs::write(&file, serde_json::to_string(&json).unwrap()).unwrap();
        let ids = TargetTokenizer::load(dir.path()).expect("loads").encode(text).unwrap();
        assert_eq!(ids, plain, "with the file's {}", setting.0);
    }
}

#[rstest]
#[case::held_out_fraction(DataOptions { held_out: dflash_data::HeldOut::Fraction(1.5), ..DataOptions::new("unused") }, &["held_out", "1.5"])]
#[case::max_len(DataOptions { max_len: 1, ..DataOptions::new("unused") }, &["max_len"])]
fn a_bad_option_is_an_error_naming_it(#[case] opts: DataOptions, #[case] names: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let file = write(tmp.path(), "data.jsonl", GOOD.as_bytes());
    let err = expect_error(Dataset::prepare(&tokenizer("tokenizer-qwen"), &[file], &opts));
    assert!(matches!(err, Error::Option { .. }), "{err:?}");
    assert_names(&err, names);
}

/// A cache whose end was cut off (not a file this crate wrote: it writes atomically) is an
/// error naming it, never a panic or a silent partial data set.
#[test]
fn a_cut_cache_is_an_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let file = write(tmp.path(), "data.jsonl", format!("{GOOD}\n{GOOD}\n").as_bytes());
    let opts = options(tmp.path());
    let tok = tokenizer("tokenizer-qwen");
    Dataset::prepare(&tok, std::slice::from_ref(&file), &opts).expect("first run");
    let cache = opts.cache_dir.join("tokenized.bin");
    let len = std::fs::metadata(&cache).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&cache).unwrap().set_len(len - 5).unwrap();
    let err = expect_error(Dataset::prepare(&tok, &[file], &opts));
    assert_names(&err, &["tokenized.bin", "cache"]);
}

/// A folder whose `eos_token` is not the turn's end (a base model's `<|endoftext|>`): each turn is
/// supervised through its render's end (the newline after `<|im_end|>` too) and counted; with
/// `generation_config.json` naming `<|im_end|>` in its `eos_token_id` list (as real checkpoints
/// do) the mask is the one `eos_token = <|im_end|>` gives. Each change of the special tokens or
/// the end ids is a new cache key: the cache is tokenized again, never reused.
#[test]
fn turns_end_at_the_end_ids_and_those_key_the_cache() {
    let dir = copy_tokenizer("tokenizer-qwen");
    let data = write(dir.path(), "d.jsonl", format!("{GOOD}\n").as_bytes());
    let config_file = dir.path().join("tokenizer_config.json");
    let config = std::fs::read_to_string(&config_file).unwrap();
    let prepare = || {
        let tok = TargetTokenizer::load(dir.path()).expect("loads");
        let data = Dataset::prepare(&tok, std::slice::from_ref(&data), &options(dir.path())).expect("prepares");
        let doc = data.cache.document(0).expect("a document");
        let unended = data.cache.stats.unended_turns;
        assert_eq!(data.stats().unended_warning().is_some(), unended > 0, "the summary warns of unended turns");
        (tok.end_ids.clone(), doc.tokens, doc.loss_mask, unended, data.tokenized)
    };
    let (ids, tokens, mask, unended, tokenized) = prepare();
    assert_eq!((ids, unended, tokenized), (vec![2], 0, true), "eos_token <|im_end|> (id 2)");
    let last = mask.iter().rposition(|&m| m).unwrap();
    assert_eq!(tokens[last], 2, "the supervised span ends at <|im_end|>");
    assert!(last + 1 < tokens.len(), "the template writes a newline after the turn");
    assert!(!prepare().4, "the same folder reuses its cache");

    std::fs::write(&config_file, config.replace(r#""eos_token": "<|im_end|>""#, r#""eos_token": "<|endoftext|>""#))
        .unwrap();
    let (ids, _, unended_mask, unended, tokenized) = prepare();
    assert_eq!((ids, unended, tokenized), (vec![0], 1, true), "eos_token <|endoftext|>: a new key, one unended turn");
    assert!(unended_mask[last + 1..].iter().all(|&m| m), "supervised through the render's end");

    write(dir.path(), "generation_config.json", br#"{"eos_token_id": [2, 0]}"#);
    let (ids, _, end_mask, unended, tokenized) = prepare();
    assert_eq!((ids, unended, tokenized), (vec![0, 2], 0, true), "generation_config's ids: a new key");
    assert_eq!(end_mask, mask, "the mask of eos_token <|im_end|>");

    for (content, names) in [
        (&br#"{"eos_token_id": "<|im_end|>"}"#[..], &["generation_config.json", "eos_token_id"][..]),
        (br#"{"eos_token_id": [2, 99999]}"#, &["generation_config.json", "eos_token_id", "99999"]),
    ] {
        write(dir.path(), "generation_config.json", content);
        assert_names(&expect_error(TargetTokenizer::load(dir.path())), names);
    }
}
