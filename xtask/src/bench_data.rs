//! `cargo xtask bench data`: the data pipeline (render + tokenize + mask + pack) on this
//! machine's CPU against Python transformers doing the same work on the same file in the same
//! command, the peak resident memory of preparing a ~1 GB jsonl, and the time extrapolated to an
//! 800K-conversation data set. Writes `results/data-cpu.json`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use dflash_data::target::TargetTokenizer;
use dflash_data::{DataOptions, Dataset, HeldOut};
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

use crate::args::Options;
use crate::gpu_bundle::{commit, repo_root};
use crate::gpu_conformance::{utc_now, write_json};

const HELP: &str = "usage: cargo xtask bench data [options]

Generates chat conversations (system prompts, 1-4 turns, reasoning, non-ASCII text) as jsonl,
prepares them with our pipeline and with Python transformers (xtask/bench/data_python.py, the
same work, on as many processes as we have cores), prints rows/s and tokens/s of both, prepares
a ~1 GB jsonl in a child process to measure its peak resident memory, and extrapolates the time
of an 800K-conversation data set. Writes the results as JSON.

options:
  --target DIR         tokenizer folder             (default fixtures/data/tokenizer-qwen)
  --conversations N    conversations timed           (default 4000)
  --memory-mb N        size of the memory test's file in MB, 0 = skip (default 1000)
  --python yes|no      run the Python baseline       (default yes)
  --work DIR           generated files and caches    (default runs/bench-data)
  --out FILE           results                       (default results/data-cpu.json)";

const OPTIONS: &[&str] = &["target", "conversations", "memory-mb", "python", "work", "out", "memory-child"];

/// Conversations of the data sets the spec talks about.
const FULL_DATA_SET: f64 = 800_000.0;

const WORDS: &[&str] = &[
    "the",
    "model",
    "answer",
    "because",
    "first",
    "then",
    "we",
    "compute",
    "value",
    "of",
    "function",
    "returns",
    "list",
    "number",
    "prime",
    "sum",
    "is",
    "equal",
    "to",
    "and",
    "a",
    "in",
    "for",
    "each",
    "step",
    "check",
    "python",
    "code",
    "error",
    "fix",
    "test",
    "data",
    "time",
    "city",
    "weather",
    "tokyo",
    "paris",
    "rain",
    "sunny",
    "example",
    "def",
    "return",
    "x",
    "y",
    "=",
    "+",
    "(",
    ")",
    ":",
    "42",
    "3.14",
    "2026",
    "résumé",
    "déjà",
    "naïve",
    "über",
    "東京",
    "天気",
    "数据",
    "模型",
    "Привет",
    "данные",
    "🙂",
    "→",
    "λ",
    "∑",
    "hello",
    "world",
    "please",
    "explain",
    "why",
    "how",
    "what",
    "recursion",
    "matrix",
    "vector",
    "gradient",
    "loss",
    "train",
    "drafter",
    "token",
    "block",
];

fn sentence(rng: &mut ChaCha8Rng, words: usize) -> String {
    let mut s: Vec<&str> = (0..words).map(|_| *WORDS.choose(rng).expect("words")).collect();
    if let Some(first) = s.first_mut() {
        *first = "The";
    }
    s.join(" ") + "."
}

fn paragraph(rng: &mut ChaCha8Rng, sentences: usize) -> String {
    (0..sentences)
        .map(|_| {
            let words = rng.random_range(5..18);
            sentence(rng, words)
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// One generated conversation, OpenAI format.
fn conversation(rng: &mut ChaCha8Rng) -> Value {
    let mut messages = vec![];
    if rng.random_bool(0.4) {
        messages.push(json!({"role": "system", "content": paragraph(rng, 2)}));
    }
    for _ in 0..rng.random_range(1..=4) {
        let user_sentences = rng.random_range(1..5);
        messages.push(json!({"role": "user", "content": paragraph(rng, user_sentences)}));
        let answer_sentences = rng.random_range(3..25);
        let mut answer = json!({"role": "assistant", "content": paragraph(rng, answer_sentences)});
        if rng.random_bool(0.3) {
            let reasoning_sentences = rng.random_range(2..10);
            answer["reasoning_content"] = json!(paragraph(rng, reasoning_sentences));
        }
        messages.push(answer);
    }
    json!({ "messages": messages })
}

/// Writes conversations to `file` until `n` of them or `bytes` bytes, whichever comes first.
fn generate(file: &Path, n: usize, bytes: u64, seed: u64) -> Result<usize, String> {
    let f = std::fs::File::create(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let mut out = std::io::BufWriter::new(f);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (mut written, mut count) = (0u64, 0);
    while count < n && written < bytes {
        let line = conversation(&mut rng).to_string();
        writeln!(out, "{line}").map_err(|e| format!("{}: {e}", file.display()))?;
        written += line.len() as u64 + 1;
        count += 1;
    }
    out.flush().map_err(|e| format!("{}: {e}", file.display()))?;
    Ok(count)
}

/// Peak resident memory of this process (VmHWM), MB.
fn peak_rss_mb() -> Result<f64, String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| format!("/proc/self/status: {e}"))?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or("/proc/self/status has no VmHWM")?;
    Ok(kb / 1024.0)
}

/// What one preparation did.
struct Measured {
    seconds: f64,
    conversations: usize,
    documents: usize,
    tokens: usize,
    rows: usize,
}

/// Tokenizes `file` from scratch (a fresh cache) and packs the rows of one epoch.
fn prepare(target: &TargetTokenizer, file: &Path, cache: &Path) -> Result<Measured, String> {
    let _ = std::fs::remove_dir_all(cache);
    let opts = DataOptions { held_out: HeldOut::Fraction(0.0), progress: true, ..DataOptions::new(cache) };
    let started = Instant::now();
    let data = Dataset::prepare(target, &[file.to_owned()], &opts).map_err(|e| e.to_string())?;
    let rows = Dataset::count(data.epoch(0)).map_err(|e| e.to_string())?;
    let stats = data.stats();
    Ok(Measured {
        seconds: started.elapsed().as_secs_f64(),
        conversations: stats.conversations,
        documents: stats.documents,
        tokens: stats.tokens,
        rows: rows.rows,
    })
}

fn throughput(m: &Measured) -> (f64, f64) {
    (m.rows as f64 / m.seconds, m.tokens as f64 / m.seconds)
}

pub fn run(args: Vec<String>) -> Result<(), String> {
    let Some(opts) = Options::parse(args, OPTIONS)? else {
        println!("{HELP}");
        return Ok(());
    };
    let root = repo_root();
    let target_dir: PathBuf = opts.get("target", root.join("fixtures/data/tokenizer-qwen"))?;
    let work: PathBuf = opts.get("work", root.join("runs/bench-data"))?;
    let target = TargetTokenizer::load(&target_dir).map_err(|e| e.to_string())?;
    let child: String = opts.get("memory-child", String::new())?;
    if !child.is_empty() {
        let m = prepare(&target, Path::new(&child), &work.join("cache-memory"))?;
        println!(
            "{}",
            json!({"peak_rss_mb": peak_rss_mb()?, "seconds": m.seconds, "conversations": m.conversations, "tokens": m.tokens, "bytes": std::fs::metadata(&child).map_or(0, |m| m.len())})
        );
        return Ok(());
    }
    let n: usize = opts.get("conversations", 4000)?;
    let memory_mb: u64 = opts.get("memory-mb", 1000)?;
    let python = opts.yes_no("python", true)?;
    let out: PathBuf = opts.get("out", root.join("results/data-cpu.json"))?;
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;

    let file = work.join("conversations.jsonl");
    generate(&file, n, u64::MAX, 1)?;
    let size = std::fs::metadata(&file).map_or(0, |m| m.len());
    println!("{n} conversations ({:.1} MB) on {}", size as f64 / 1e6, crate::bench::host_machine());
    let ours = prepare(&target, &file, &work.join("cache"))?;
    let (our_rows, our_tokens) = throughput(&ours);
    println!(
        "ours:   {:.2}s, {} documents, {} tokens, {} rows: {our_rows:.1} rows/s, {our_tokens:.0} tokens/s",
        ours.seconds, ours.documents, ours.tokens, ours.rows
    );
    let python_result = if python { Some(run_python(&target_dir, &file)?) } else { None };
    if let Some(p) = &python_result {
        println!(
            "python: {:.2}s, {} documents, {} tokens, {} rows: {:.1} rows/s, {:.0} tokens/s ({:.1}x ours faster)",
            p.seconds,
            p.documents,
            p.tokens,
            p.rows,
            p.rows as f64 / p.seconds,
            p.tokens as f64 / p.seconds,
            our_tokens / (p.tokens as f64 / p.seconds)
        );
        if (p.documents, p.tokens) != (ours.documents, ours.tokens) {
            return Err(format!(
                "python made {} documents of {} tokens, ours {} of {}: not the same work",
                p.documents, p.tokens, ours.documents, ours.tokens
            ));
        }
    }
    let per_conversation = ours.seconds / ours.conversations.max(1) as f64;
    let full_s = per_conversation * FULL_DATA_SET;
    println!("800K conversations like these: about {:.0} min (ours)", full_s / 60.0);

    let memory = if memory_mb > 0 {
        let big = work.join("memory.jsonl");
        let count = generate(&big, usize::MAX, memory_mb * 1_000_000, 2)?;
        println!("memory: preparing {count} conversations ({memory_mb} MB) in a child process ...");
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let output = Command::new(exe)
            .args(["bench", "data", "--target"])
            .arg(&target_dir)
            .arg("--work")
            .arg(&work)
            .arg("--memory-child")
            .arg(&big)
            .output()
            .map_err(|e| format!("memory child: {e}"))?;
        let _ = std::fs::remove_file(&big);
        let _ = std::fs::remove_dir_all(work.join("cache-memory"));
        if !output.status.success() {
            return Err(format!("memory child failed: {}", String::from_utf8_lossy(&output.stderr)));
        }
        let v: Value =
            serde_json::from_slice(output.stdout.trim_ascii()).map_err(|e| format!("memory child output: {e}"))?;
        println!(
            "memory: peak resident {:.0} MB, {:.0}s, {} tokens",
            v["peak_rss_mb"].as_f64().unwrap_or(0.0),
            v["seconds"].as_f64().unwrap_or(0.0),
            v["tokens"]
        );
        Some(v)
    } else {
        None
    };

    let results = json!({
        "benchmark": "data pipeline: render + tokenize + mask + pack, from a jsonl of generated conversations",
        "date": utc_now(),
        "machine": crate::bench::host_machine(),
        "commit": commit(None)?,
        "tokenizer": target_dir.strip_prefix(&root).unwrap_or(&target_dir).display().to_string(),
        "conversations": ours.conversations,
        "file_mb": size as f64 / 1e6,
        "documents": ours.documents,
        "tokens": ours.tokens,
        "ours_seconds": ours.seconds,
        "ours_rows_per_s": our_rows,
        "ours_tokens_per_s": our_tokens,
        "python_seconds": python_result.as_ref().map(|p| p.seconds),
        "python_rows_per_s": python_result.as_ref().map(|p| p.rows as f64 / p.seconds),
        "python_tokens_per_s": python_result.as_ref().map(|p| p.tokens as f64 / p.seconds),
        "speedup_tokens_per_s": python_result.as_ref().map(|p| our_tokens / (p.tokens as f64 / p.seconds)),
        "extrapolated_800k_conversations_s": full_s,
        "peak_rss_mb": memory.as_ref().map(|m| m["peak_rss_mb"].clone()),
        "memory_test": memory,
    });
    write_json(&out, &results)?;
    println!("wrote {}", out.display());
    Ok(())
}

/// The Python baseline on `file`, on as many processes as we have cores.
fn run_python(target: &Path, file: &Path) -> Result<Measured, String> {
    let script = repo_root().join("xtask/bench/data_python.py");
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let output = Command::new("python3")
        .arg(&script)
        .arg("--target")
        .arg(target)
        .arg("--data")
        .arg(file)
        .args(["--workers", &workers.to_string()])
        .output()
        .map_err(|e| format!("python3 {}: {e}", script.display()))?;
    if !output.status.success() {
        return Err(format!("{} failed: {}", script.display(), String::from_utf8_lossy(&output.stderr)));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let v: Value =
        serde_json::from_str(text.lines().last().unwrap_or("")).map_err(|e| format!("python output `{text}`: {e}"))?;
    let n = |k: &str| v[k].as_u64().unwrap_or(0) as usize;
    Ok(Measured {
        seconds: v["seconds"].as_f64().unwrap_or(f64::NAN),
        conversations: n("conversations"),
        documents: n("documents"),
        tokens: n("tokens"),
        rows: n("rows"),
    })
}
