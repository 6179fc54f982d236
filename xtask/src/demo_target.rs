//! `cargo xtask demo-target`: a small random Qwen3 target folder with a real tokenizer and chat
//! template, to try the real-run commands (`data`, `train --target`, `features`, `eval`) on the
//! CPU without downloading a model. Random weights: a drafter learns its features' structure,
//! not language.

use std::path::PathBuf;

use crate::args::Options;

const HELP: &str = "usage: cargo xtask demo-target --out DIR [--seed N]

Writes a random Qwen3 target in HF format (3 layers, hidden 32, heads of 8, vocab 768;
config.json, model.safetensors) with the fixture Qwen tokenizer and chat template into DIR, a new
or empty folder. Then, for example (the CPU twins of the GPU step, seconds):

  cargo xtask train --target DIR --data fixtures/data/conversations.jsonl --step host \\
      --max-len 256 --anchors 8 --steps 40 --out runs/demo
  cargo xtask eval --device cpu --target DIR --drafter runs/demo/drafter \\
      --prompts fixtures/data/conversations.jsonl --max-prompts 4 --max-new-tokens 32

  --out DIR    the target folder to write
  --seed N     the weights' seed  (default 0)";

const OPTIONS: &[&str] = &["out", "seed"];

pub fn run(args: Vec<String>) -> Result<(), String> {
    let Some(opts) = Options::parse(args, OPTIONS)? else {
        println!("{HELP}");
        return Ok(());
    };
    let out: PathBuf = opts.get("out", PathBuf::new())?;
    if out.as_os_str().is_empty() {
        return Err("--out DIR is required".into());
    }
    let seed: u64 = opts.get("seed", 0)?;
    if out.exists() && (!out.is_dir() || std::fs::read_dir(&out).map_err(|e| e.to_string())?.next().is_some()) {
        return Err(format!("option `--out`: {} exists and is not an empty folder", out.display()));
    }
    let model = dflash_conformance::target_cases::write_target_folder(&out, seed).map_err(|e| e.to_string())?;
    let described = dflash_reference::target::TargetKind::Dense(model.config).describe();
    println!("wrote a random {described} target with the fixture Qwen tokenizer to {}", out.display());
    Ok(())
}
