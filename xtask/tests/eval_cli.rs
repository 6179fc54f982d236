//! `cargo xtask eval` through the binary on the CPU (the reference decoders) with a small random
//! target folder and a random drafter: the stop at the target's end-of-sequence ids and
//! `--ignore-eos`, the generated counts, `identical_to_plain`, the context check at its exact
//! boundary, and pre-tokenized prompts (with and without a loss mask).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::DType;
use dflash_conformance::target_cases::write_target_folder;
use dflash_reference::config::DraftConfig;
use dflash_reference::drafter::Drafter;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A random target folder (the fixture Qwen tokenizer, `<|im_end|>` its eos_token) and a random
/// drafter of block 4 for it in `dir`.
fn setup(dir: &Path, seed: u64) -> (PathBuf, PathBuf) {
    let target = dir.join("target");
    let model = write_target_folder(&target, seed).unwrap();
    let config = DraftConfig::for_target(&model.config, 1, 4, model.config.dims.vocab_size as u32 - 1, 2);
    let drafter = dir.join("drafter");
    Drafter::init(config, seed + 1, DType::F32).unwrap().save(&drafter).unwrap();
    (target, drafter)
}

fn eval(target: &Path, drafter: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["eval", "--device", "cpu", "--target", target.to_str().unwrap()])
        .args(["--drafter", drafter.to_str().unwrap()])
        .args(args)
        .output()
        .unwrap()
}

/// Runs eval with `args`, expecting success; the JSON report.
fn report(target: &Path, drafter: &Path, out: &Path, args: &[&str]) -> Value {
    let result = eval(target, drafter, &[args, &["--out", out.to_str().unwrap()]].concat());
    assert!(result.status.success(), "{args:?}: {}\n{}", text(&result.stdout), text(&result.stderr));
    serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

/// Writes prompts: two texts, pre-tokenized ids without a mask, and a training row (ids with a
/// loss mask whose first supervised token is `first`). Returns the file and the row's ids.
fn write_prompts(dir: &Path, rng: &mut impl Rng) -> (PathBuf, Vec<u32>, usize) {
    let row: Vec<u32> = (0..12).map(|_| rng.random_range(0..700)).collect();
    let first = rng.random_range(1..12);
    let mask: Vec<u8> = (0..12).map(|i| u8::from(i >= first)).collect();
    let lines = [
        json!({"text": "The quick brown fox"}),
        json!({"text": "Once upon a time, in a land far away"}),
        json!({"input_ids": row}),
        json!({"input_ids": row, "loss_mask": mask}),
    ];
    let file = dir.join("prompts.jsonl");
    std::fs::write(&file, lines.iter().map(Value::to_string).collect::<Vec<_>>().join("\n")).unwrap();
    (file, row, first)
}

/// Without `--ignore-eos`, speculative and plain decoding end after the first of the target's
/// end ids (the tokenizer's eos_token and generation_config.json's eos_token_id, here an id taken
/// from an unstopped decode so that the stop happens): each prompt's tokens are its fixed-length
/// tokens through the first end id, the generated counts say so, and the decodes stay identical.
/// With `--ignore-eos yes` every prompt generates `--max-new-tokens`. Pre-tokenized prompts are
/// used as given without a mask and cut at the first supervised token with one.
#[test]
fn eval_stops_at_the_end_ids_unless_told_not_to() {
    let seed = rand::rng().random_range(0..1u64 << 30);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let tmp = tempfile::tempdir().unwrap();
    let (target, drafter) = setup(tmp.path(), seed);
    let (prompts, row, first) = write_prompts(tmp.path(), &mut rng);
    let p = prompts.to_str().unwrap();
    let fixed = report(
        &target,
        &drafter,
        &tmp.path().join("fixed.json"),
        &["--prompts", p, "--max-new-tokens", "24", "--ignore-eos", "yes"],
    );
    assert_eq!((fixed["ignore_eos"].clone(), fixed["stop_ids"].clone()), (json!(true), json!([])), "seed {seed}");
    assert_eq!(fixed["all_identical_to_plain"], true, "seed {seed}");
    let per_prompt = fixed["per_prompt"].as_array().unwrap().clone();
    assert_eq!(per_prompt.len(), 4);
    for prompt in &per_prompt {
        assert_eq!((prompt["generated_tokens"].as_u64(), ids(&prompt["tokens"]).len()), (Some(24), 24), "{prompt}");
        assert_eq!(prompt["plain_generated_tokens"], 24);
        assert!(prompt.get("identical_to_greedy").is_none() && prompt["identical_to_plain"] == true, "{prompt}");
    }
    assert_eq!(fixed["generated_tokens"], 4 * 24);
    assert_eq!(per_prompt[2]["prompt_tokens"], row.len(), "input_ids without a mask: as given");
    assert_eq!(per_prompt[3]["prompt_tokens"], first, "a training row: up to its first supervised token");

    // An end id that the fixed-length decode of prompt 0 emits, at a random index.
    let tokens: Vec<Vec<u32>> = per_prompt.iter().map(|p| ids(&p["tokens"])).collect();
    let end = tokens[0][rng.random_range(0..24)];
    std::fs::write(target.join("generation_config.json"), json!({"eos_token_id": end}).to_string()).unwrap();
    let stopped =
        report(&target, &drafter, &tmp.path().join("stopped.json"), &["--prompts", p, "--max-new-tokens", "24"]);
    let stop = ids(&stopped["stop_ids"]);
    assert!(stop.contains(&end) && stop.len() == 2, "seed {seed}: stop ids {stop:?}: <|im_end|> and {end}");
    assert_eq!((stopped["ignore_eos"].clone(), stopped["all_identical_to_plain"].clone()), (json!(false), json!(true)));
    let mut generated = 0;
    for (prompt, fixed) in stopped["per_prompt"].as_array().unwrap().iter().zip(&tokens) {
        let upto = fixed.iter().position(|t| stop.contains(t)).map_or(fixed.len(), |i| i + 1);
        let got = ids(&prompt["tokens"]);
        assert_eq!(got, fixed[..upto], "seed {seed}: stop {stop:?}");
        assert_eq!(prompt["generated_tokens"], upto);
        assert_eq!(prompt["plain_generated_tokens"], upto);
        // The prefill's token, then the steps' A + 1 each (the last one's cut): no step after.
        let lengths = ids(&prompt["accept_lengths"]);
        let (sum, last) = (lengths.iter().sum::<u32>() as usize, lengths.last().copied().unwrap_or(0) as usize);
        assert!(1 + sum >= upto && (lengths.is_empty() || 1 + sum - last < upto), "{prompt}");
        generated += upto;
    }
    assert!(ids(&stopped["per_prompt"][0]["tokens"]).len() <= tokens[0].iter().position(|t| *t == end).unwrap() + 1);
    assert_eq!(stopped["generated_tokens"], generated);
}

/// `identical_to_plain` under seeded sampling compares with plain sampling (the same seed): true
/// for every prompt, and the report has no `identical_to_greedy`. The help names `--ignore-eos`.
#[test]
fn eval_compares_with_the_plain_decode_of_the_same_sampling() {
    let seed = rand::rng().random_range(0..1u64 << 30);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let tmp = tempfile::tempdir().unwrap();
    let (target, drafter) = setup(tmp.path(), seed);
    let (prompts, _, _) = write_prompts(tmp.path(), &mut rng);
    let args = ["--prompts", prompts.to_str().unwrap(), "--max-new-tokens", "16", "--temperature", "1.5"];
    let v = report(&target, &drafter, &tmp.path().join("sampled.json"), &[&args[..], &["--seed", "5"]].concat());
    assert_eq!((v["all_identical_to_plain"].clone(), v.get("all_identical_to_greedy")), (json!(true), None));
    assert!(v["per_prompt"].as_array().unwrap().iter().all(|p| p["identical_to_plain"] == true), "{v}");
    let help = Command::new(env!("CARGO_BIN_EXE_xtask")).args(["eval", "--help"]).output().unwrap();
    assert!(text(&help.stdout).contains("--ignore-eos yes|no"), "{}", text(&help.stdout));
    let bad = eval(&target, &drafter, &[&args[..], &["--ignore-eos", "maybe"]].concat());
    assert!(!bad.status.success() && text(&bad.stderr).contains("--ignore-eos"), "{}", text(&bad.stderr));
}

/// The context check at its exact boundary: the last verify step starts at most at
/// `P + max_new - 1` and its block of B reaches `P + max_new + B - 2`, so a target of
/// `P + max_new + B - 1` positions takes the prompt (and decodes it), one new token more is refused.
#[test]
fn eval_takes_prompts_that_fill_the_context_exactly() {
    let seed = rand::rng().random_range(0..1u64 << 30);
    let tmp = tempfile::tempdir().unwrap();
    let (target, drafter) = setup(tmp.path(), seed);
    let prompts = tmp.path().join("p.jsonl");
    let len = rand::rng().random_range(1..20);
    std::fs::write(&prompts, json!({"input_ids": vec![5; len]}).to_string()).unwrap();
    // eval takes at least 2 new tokens (a verify step follows the prefill's token).
    let max_new = rand::rng().random_range(2..30);
    let config_file = target.join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&config_file).unwrap()).unwrap();
    config["max_position_embeddings"] = json!(len + max_new + 4 - 1);
    std::fs::write(&config_file, config.to_string()).unwrap();
    let p = prompts.to_str().unwrap();
    let n = max_new.to_string();
    let args = ["--prompts", p, "--max-new-tokens", &n, "--ignore-eos", "yes"];
    let v = report(&target, &drafter, &tmp.path().join("exact.json"), &args);
    assert_eq!(v["per_prompt"][0]["generated_tokens"], max_new, "{v}");
    let more = (max_new + 1).to_string();
    let over = eval(&target, &drafter, &["--prompts", p, "--max-new-tokens", &more]);
    let stderr = text(&over.stderr);
    assert!(!over.status.success() && stderr.contains("line 1") && stderr.contains("positions"), "{stderr}");
}
