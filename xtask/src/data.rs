//! `cargo xtask data`: a user's conversations and the target's tokenizer to packed training
//! rows; prints the statistics and a few rows with the supervised tokens highlighted.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use dflash_data::mask::RenderOptions;
use dflash_data::target::TargetTokenizer;
use dflash_data::{DataOptions, Dataset, HeldOut};
use dflash_reference::data::Row;

use crate::args::Options;

const HELP: &str = "usage: cargo xtask data --target DIR --data FILE... [options]

Reads jsonl conversations (plain or gzip; OpenAI `messages`, ShareGPT `conversations`, `text`,
or `input_ids` + `loss_mask`), renders them with the target's chat template, tokenizes them
with its tokenizer.json, masks the assistant turns (through their end-of-turn token:
eos_token or an id of generation_config.json's eos_token_id), packs rows, and prints the
statistics and sample rows. The tokenized form is cached (reused while the tokenizer, template,
special tokens, end-of-turn ids, options and files are unchanged).

options:
  --target DIR         target folder: tokenizer.json, tokenizer_config.json, chat template
                       (and generation_config.json when there is one)
  --data FILE...       one or several jsonl files
  --show N             sample rows to print                           (default 2)
  --max-len N          tokens per document and per packed row          (default 3072)
  --packing yes|no     pack documents into rows (no: one per row)      (default yes)
  --thinking yes|no    enable_thinking (no also drops reasoning)       (default no)
  --system-prompt T    system message for conversations without one   (default none)
  --held-out X         a fraction of the conversations, or a jsonl file (default 0.05)
  --seed N             seed of the split and the epoch order           (default 0)
  --cache DIR          where the tokenized cache is kept               (default runs/data-cache)";

const OPTIONS: &[&str] =
    &["target", "show", "max-len", "packing", "thinking", "system-prompt", "held-out", "seed", "cache"];

/// `FLAG FILE...` (e.g. `--data`): the files after `flag` up to the next option, and the other
/// arguments.
pub fn take_files(args: Vec<String>, flag: &str) -> (Vec<PathBuf>, Vec<String>) {
    let (mut files, mut rest) = (vec![], vec![]);
    let mut in_data = false;
    for arg in args {
        if arg == flag {
            in_data = true;
        } else if in_data && !arg.starts_with("--") {
            files.push(PathBuf::from(arg));
        } else {
            in_data = false;
            rest.push(arg);
        }
    }
    (files, rest)
}

/// `--data FILE...` and the other options of a command reading data (`data`, `features`):
/// `None` after printing `help` for `--help`; an error when no file is given.
pub fn parse_data_args(
    args: Vec<String>,
    known: &[&str],
    help: &str,
) -> Result<Option<(Vec<PathBuf>, Options)>, String> {
    let (files, rest) = take_files(args, "--data");
    let Some(opts) = Options::parse(rest, known)? else {
        println!("{help}");
        return Ok(None);
    };
    if files.is_empty() {
        return Err("--data FILE... is required".into());
    }
    Ok(Some((files, opts)))
}

/// The pipeline's options from the command line (shared with `bench data`).
pub fn data_options(opts: &Options) -> Result<(PathBuf, DataOptions), String> {
    let target: PathBuf = opts.get("target", PathBuf::new())?;
    if target.as_os_str().is_empty() {
        return Err("--target DIR is required".into());
    }
    let held: String = opts.get("held-out", "0.05".to_string())?;
    let held_out = match held.parse::<f64>() {
        Ok(f) => HeldOut::Fraction(f),
        Err(_) => HeldOut::Files(vec![PathBuf::from(held)]),
    };
    let system: String = opts.get("system-prompt", String::new())?;
    let data = DataOptions {
        render: RenderOptions {
            thinking: opts.yes_no("thinking", false)?,
            system_prompt: Some(system).filter(|s| !s.is_empty()),
        },
        max_len: opts.get("max-len", 3072)?,
        packing: opts.yes_no("packing", true)?,
        held_out,
        seed: opts.get("seed", 0)?,
        progress: true,
        ..DataOptions::new(opts.get("cache", PathBuf::from("runs/data-cache"))?)
    };
    Ok((target, data))
}

pub fn run(args: Vec<String>) -> Result<(), String> {
    let Some((files, opts)) = parse_data_args(args, OPTIONS, HELP)? else { return Ok(()) };
    let show: usize = opts.get("show", 2)?;
    let (target_dir, data_opts) = data_options(&opts)?;
    let err = |e: dflash_data::Error| e.to_string();
    let started = Instant::now();
    let target = TargetTokenizer::load(&target_dir).map_err(err)?;
    // Rows longer than the target's positions, as `train` refuses them (when the config is one
    // this project reads: `data` also serves targets only transformers runs).
    let config = target_dir.join("config.json");
    if let Ok(kind) = dflash_reference::target::TargetKind::from_file(&config) {
        kind.check_row_len(data_opts.max_len, &config).map_err(|why| format!("option `--max-len`: {why}"))?;
    }
    let data = Dataset::prepare(&target, &files, &data_opts).map_err(err)?;
    let how = if data.tokenized { "tokenized" } else { "opened the cache" };
    println!(
        "{how} in {:.1}s ({})",
        started.elapsed().as_secs_f64(),
        data_opts.cache_dir.join("tokenized.bin").display()
    );
    println!("{}", data.stats());
    let train = Dataset::count(data.epoch(0)).map_err(err)?;
    let held = Dataset::count(data.held_out_rows()).map_err(err)?;
    let layout =
        if data_opts.packing { format!("packed into rows of {}", data_opts.max_len) } else { "one per row".into() };
    println!(
        "rows ({layout}): {} training ({} documents, {} tokens, {} supervised), {} held out ({} documents)",
        train.rows,
        data.train.len(),
        train.tokens,
        train.supervised_tokens,
        held.rows,
        data.held_out.len()
    );
    println!(
        "packing efficiency: {:.1}% of the token slots of rows padded to {} hold document tokens",
        100.0 * train.efficiency(data_opts.max_len),
        data_opts.max_len
    );
    let colour = std::io::stdout().is_terminal();
    for (i, row) in data.epoch(0).take(show).enumerate() {
        println!("\n{}", render_row(&target, &row.map_err(err)?, i, colour));
    }
    Ok(())
}

/// A row as text: each document on its own, supervised tokens green on a terminal or between
/// `«` and `»` otherwise, padding summarised.
fn render_row(target: &TargetTokenizer, row: &Row, index: usize, colour: bool) -> String {
    let docs = row.doc_ids.iter().filter(|&&d| d >= 0).max().map_or(0, |&d| d + 1);
    let supervised = row.loss_mask.iter().filter(|&&m| m).count();
    let mut out = format!("── row {index}: {} tokens, {docs} documents, {supervised} supervised ──", row.tokens.len());
    let mut start = 0;
    while start < row.tokens.len() {
        let (doc, mask) = (row.doc_ids[start], row.loss_mask[start]);
        let end = (start..row.tokens.len())
            .find(|&i| row.doc_ids[i] != doc || row.loss_mask[i] != mask)
            .unwrap_or(row.tokens.len());
        if start == 0 || row.doc_ids[start - 1] != doc {
            out += &if doc < 0 {
                format!("\n[padding: {} tokens]", row.tokens.len() - start)
            } else {
                format!("\n[document {doc}]\n")
            };
        }
        if doc >= 0 {
            let text = target.decode(&row.tokens[start..end]);
            out += &match (mask, colour) {
                (false, _) => text,
                (true, true) => format!("\x1b[1;32m{text}\x1b[0m"),
                (true, false) => format!("«{text}»"),
            };
        }
        start = end;
    }
    out
}
