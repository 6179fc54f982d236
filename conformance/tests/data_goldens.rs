//! The data pipeline against HF transformers + tokenizers (fixtures/scripts/make_data_goldens.py):
//! for 50 conversations under a Qwen3-style template (thinking off and on) and a Llama-3-style
//! one, the rendered text, the token ids, the loss mask and the row layout (one row, or one row
//! per assistant turn when the template rewrites earlier turns) are equal, token for token.

use std::path::PathBuf;

use dflash_conformance::fixtures_dir;
use dflash_data::format::{parse_record, prepare_messages, role, Record};
use dflash_data::mask::{documents, Layout, RenderOptions, Rendered};
use dflash_data::target::TargetTokenizer;
use dflash_data::template::ChatTemplate;
use serde_json::Value;

fn data_dir() -> PathBuf {
    fixtures_dir().join("data")
}

struct Golden {
    template: String,
    thinking: bool,
    conversation: usize,
    layout: Layout,
    /// Per row: rendered text, ids, mask.
    rows: Vec<(String, Vec<u32>, Vec<bool>)>,
}

fn goldens() -> Vec<Golden> {
    let text = std::fs::read_to_string(data_dir().join("goldens.json")).expect("goldens.json");
    let json: Value = serde_json::from_str(&text).expect("goldens JSON");
    json["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Golden {
            template: c["template"].as_str().unwrap().to_owned(),
            thinking: c["thinking"].as_bool().unwrap(),
            conversation: c["conversation"].as_u64().unwrap() as usize,
            layout: match c["layout"].as_str().unwrap() {
                "whole" => Layout::Whole,
                "per_turn" => Layout::PerTurn,
                other => panic!("layout {other}"),
            },
            rows: c["rows"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| {
                    let ids = r["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
                    let mask = r["loss_mask"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() == 1).collect();
                    (r["text"].as_str().unwrap().to_owned(), ids, mask)
                })
                .collect(),
        })
        .collect()
}

fn conversations() -> Vec<String> {
    std::fs::read_to_string(data_dir().join("conversations.jsonl"))
        .expect("conversations")
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The texts the goldens' rows were encoded from: the whole render, or each turn's render.
fn rendered(tok: &TargetTokenizer, record: &Record, layout: Layout, thinking: bool) -> Vec<String> {
    let Record::Chat { messages, tools } = record else { panic!("golden conversations are chats") };
    let template = tok.template.as_ref().expect("template");
    let messages = prepare_messages(messages, None, thinking, template.names_role("developer"));
    let render = |n: usize| template.render(&messages[..n], tools.as_ref(), false, thinking).expect("render");
    match layout {
        Layout::Whole => vec![render(messages.len())],
        Layout::PerTurn => {
            (0..messages.len()).filter(|&i| role(&messages[i]) == Some("assistant")).map(|i| render(i + 1)).collect()
        }
    }
}

#[test]
fn pipeline_equals_transformers_token_for_token() {
    let qwen = TargetTokenizer::load(&data_dir().join("tokenizer-qwen")).expect("qwen tokenizer");
    let llama = TargetTokenizer::load(&data_dir().join("tokenizer-llama")).expect("llama tokenizer");
    assert!(
        qwen.template.as_ref().unwrap().file.ends_with("tokenizer_config.json"),
        "qwen: template inside the config"
    );
    assert!(llama.template.as_ref().unwrap().file.ends_with("chat_template.jinja"), "llama: template in its own file");
    let lines = conversations();
    let cases = goldens();
    assert_eq!(cases.len(), 150, "50 conversations x (qwen off, qwen on, llama)");
    let (mut rows, mut tokens) = (0, 0);
    let mut layouts = std::collections::HashSet::new();
    for g in &cases {
        let name = format!("{} thinking={} conversation {}", g.template, g.thinking, g.conversation);
        let tok = if g.template == "qwen" { &qwen } else { &llama };
        let record = parse_record(&lines[g.conversation]).expect("golden line parses");
        let texts = rendered(tok, &record, g.layout, g.thinking);
        let opts = RenderOptions { thinking: g.thinking, system_prompt: None };
        let Rendered { layout, docs, unended_turns } =
            documents(tok, record, &opts).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(unended_turns, 0, "{name}: every assistant turn ends with an end-of-turn token");
        assert_eq!(layout, g.layout, "{name}: layout");
        assert_eq!(docs.len(), g.rows.len(), "{name}: rows");
        for (k, ((text, ids, mask), doc)) in g.rows.iter().zip(&docs).enumerate() {
            assert_eq!(&texts[k], text, "{name} row {k}: rendered text");
            assert_eq!(&doc.tokens, ids, "{name} row {k}: token ids");
            assert_eq!(&doc.loss_mask, mask, "{name} row {k}: loss mask");
            tokens += ids.len();
        }
        rows += docs.len();
        layouts.insert((g.template.clone(), g.layout));
    }
    assert!(layouts.contains(&("qwen".into(), Layout::PerTurn)), "the Qwen3-style template rewrites earlier turns");
    assert!(layouts.contains(&("qwen".into(), Layout::Whole)), "single-turn Qwen3-style conversations are one row");
    assert!(layouts.contains(&("llama".into(), Layout::Whole)));
    println!("{} cases, {rows} rows, {tokens} tokens equal to transformers", cases.len());
}

/// Literal special-token text inside user content encodes to the special token's id, as the
/// HF tokenizer does (conversation 13 asks for `<|im_end|>` literally).
#[test]
fn special_token_text_in_content_is_the_special_token() {
    let qwen = TargetTokenizer::load(&data_dir().join("tokenizer-qwen")).expect("qwen tokenizer");
    let im_end = qwen.tokenizer.token_to_id("<|im_end|>").expect("<|im_end|> id");
    let ids = qwen.encode("say <|im_end|> now").unwrap();
    assert!(ids.contains(&im_end), "{ids:?}");
    let found = goldens().iter().any(|g| {
        g.rows.iter().any(|(text, ids, _)| {
            text.contains("Write <|im_end|> literally") && ids.iter().filter(|&&t| t == im_end).count() >= 3
        })
    });
    assert!(found, "a golden conversation carries <|im_end|> inside its user content");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]

    /// Encoding piece by piece between the added tokens (with reuse) equals encoding the whole
    /// text, on texts mixing special tokens, their fragments, whitespace runs, combining marks
    /// and non-ASCII text.
    #[test]
    fn piecewise_encoding_equals_whole_encoding(parts in proptest::collection::vec(0usize..FRAGMENTS.len(), 0..40)) {
        let text: String = parts.iter().map(|&i| FRAGMENTS[i]).collect();
        for tok in tokenizers() {
            let mut memo = std::collections::HashMap::new();
            let want = tok.encode(&text).unwrap();
            proptest::prop_assert_eq!(tok.encode_with(&text, &mut memo).unwrap(), want.clone(), "{:?}", text);
            proptest::prop_assert_eq!(tok.encode_with(&text, &mut memo).unwrap(), want, "again, from the memo");
        }
    }
}

const FRAGMENTS: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|eot_id|>",
    "<|begin_of_text|>",
    "<|im_",
    "end|>",
    "<",
    ">",
    "\n",
    "\n\n",
    " ",
    "   ",
    "\t",
    "user",
    "assistant",
    "Hello",
    " world",
    "é",
    "e\u{301}",
    "\u{301}",
    "東京",
    "🙂",
    "12",
    "3.5",
    "'s",
    "don't",
];

fn tokenizers() -> [TargetTokenizer; 2] {
    ["tokenizer-qwen", "tokenizer-llama"].map(|n| TargetTokenizer::load(&data_dir().join(n)).expect("tokenizer"))
}

/// `tojson` is Python's `json.dumps(x, ensure_ascii=False, indent=...)` (the expected strings are
/// Python 3's output for the same JSON), keys in input order; booleans and none print as Python
/// prints them; Python string methods work.
#[test]
fn tojson_and_printing_follow_python() {
    use dflash_data::format::parse_json;
    use dflash_data::template::ChatTemplate;
    let source = "{{ messages[0].x | tojson }}|{{ messages[0].x | tojson(indent=2) }}|{{ true }} {{ none }} \
                  {{ '  a b '.strip().split(' ') | tojson }}";
    let template = ChatTemplate::new(source.into(), std::path::Path::new("test"), vec![]).expect("template");
    let message = parse_json(
        r#"{"x": {"z": 1.5e-07, "b": [1, 2.0, "é<&>'\"\n\u0001"], "c": {}, "d": [], "e": null, "f": true, "g": 1e16, "h": 123456789012, "i": 0.1, "j": 12345678901234567890, "k": -9223372036854775808}}"#,
    )
    .expect("JSON");
    let got = template.render(&[message], None, false, false).expect("render");
    let compact = r#"{"z": 1.5e-07, "b": [1, 2.0, "é<&>'\"\n\u0001"], "c": {}, "d": [], "e": null, "f": true, "g": 1e+16, "h": 123456789012, "i": 0.1, "j": 12345678901234567890, "k": -9223372036854775808}"#;
    let indented = "{\n  \"z\": 1.5e-07,\n  \"b\": [\n    1,\n    2.0,\n    \"é<&>'\\\"\\n\\u0001\"\n  ],\n  \"c\": {},\n  \"d\": [],\n  \
                    \"e\": null,\n  \"f\": true,\n  \"g\": 1e+16,\n  \"h\": 123456789012,\n  \"i\": 0.1,\n  \"j\": 12345678901234567890,\n  \"k\": -9223372036854775808\n}";
    assert_eq!(got, format!("{compact}|{indented}|True None [\"a\", \"b\"]"));
}

/// A Metaspace pre-tokenizer that prepends `▁` to the text's first piece only would encode a
/// piece after an added token differently on its own: such tokenizers are encoded whole.
#[test]
fn piecewise_encoding_is_off_for_a_first_piece_pre_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = r#"{"version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<s>": 0, "▁a": 1, "a": 2, "▁b": 3, "b": 4, "<unk>": 5}, "unk_token": "<unk>"}}"#;
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer).unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), "{}").unwrap();
    let tok = TargetTokenizer::load(dir.path()).expect("tokenizer");
    let want = tok.encode("a<s>b").unwrap();
    assert_eq!(want, vec![1, 0, 4], "only the first piece gets the prefix");
    assert_eq!(tok.encode_with("a<s>b", &mut std::collections::HashMap::new()).unwrap(), want);
}

/// The other spellings of a conversation users bring give the documents of its `messages` form,
/// token for token: SpecForge's `conversations` of `role`/`content`, ShareGPT's other assistant
/// names, contents as lists of text parts (joined with newlines, as vLLM and SGLang serve them),
/// `tools` as a JSON string (an empty one: no tools), and a `developer` message as the `system`
/// one (for templates, as the fixtures' Qwen and Llama, that name no developer role).
#[test]
fn other_spellings_of_a_conversation_give_its_documents() {
    let qwen = TargetTokenizer::load(&data_dir().join("tokenizer-qwen")).expect("qwen tokenizer");
    let tool = r#"{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}"#;
    let pairs = [
        (
            r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}]}"#.to_string(),
            r#"{"id": "0", "conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}]}"#.to_string(),
        ),
        (
            r#"{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there!"}]}"#.to_string(),
            r#"{"conversations": [{"from": "human", "value": "Hi"}, {"from": "chatgpt", "value": "Hello there!"}]}"#.to_string(),
        ),
        (
            r#"{"messages": [{"role": "user", "content": "What is 2+2?\nAnswer briefly."}, {"role": "assistant", "content": "4, of course."}]}"#.to_string(),
            r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}, {"type": "text", "text": "Answer briefly."}]}, {"role": "assistant", "content": [{"type": "text", "text": "4, of course."}]}]}"#.to_string(),
        ),
        (
            format!(r#"{{"messages": [{{"role": "user", "content": "Weather?"}}, {{"role": "assistant", "content": "Sunny."}}], "tools": [{tool}]}}"#),
            format!(
                r#"{{"messages": [{{"role": "user", "content": "Weather?"}}, {{"role": "assistant", "content": "Sunny."}}], "tools": {}}}"#,
                serde_json::to_string(&format!("[{tool}]")).unwrap()
            ),
        ),
        (
            r#"{"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}]}"#.to_string(),
            r#"{"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}], "tools": " "}"#.to_string(),
        ),
    ];
    let developer = (
        r#"{"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}"#.to_string(),
        r#"{"messages": [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}"#.to_string(),
    );
    let llama = TargetTokenizer::load(&data_dir().join("tokenizer-llama")).expect("llama tokenizer");
    let opts = RenderOptions { thinking: false, system_prompt: None };
    let cases = pairs.iter().map(|p| (&qwen, p)).chain([(&qwen, &developer), (&llama, &developer)]);
    for (tok, (canonical, other)) in cases {
        assert!(!tok.template.as_ref().unwrap().names_role("developer"));
        let docs = |line: &str| {
            let record = parse_record(line).unwrap_or_else(|e| panic!("{line}: {e:?}"));
            documents(tok, record, &opts).unwrap_or_else(|e| panic!("{line}: {e:?}")).docs
        };
        let (want, got) = (docs(canonical), docs(other));
        assert!(!want.is_empty() && want[0].loss_mask.iter().any(|&m| m), "{canonical}: a supervised document");
        assert_eq!(got.len(), want.len(), "{other}");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!((&g.tokens, &g.loss_mask), (&w.tokens, &w.loss_mask), "{other} against {canonical}");
        }
    }
    // A template that names a developer role renders it itself: the role is kept.
    let source = "{% for m in messages %}{% if m.role == 'developer' %}D{% else %}{{ m.role }}{% endif %}{% endfor %}";
    let knows = ChatTemplate::new(source.into(), std::path::Path::new("inline"), Vec::new()).unwrap();
    assert!(knows.names_role("developer"));
    let Record::Chat { messages, .. } = parse_record(&developer.1).unwrap() else { panic!("a chat") };
    let first_role = |developer_role| role(&prepare_messages(&messages, None, false, developer_role)[0]);
    assert_eq!((first_role(true), first_role(false)), (Some("developer"), Some("system")));
}
