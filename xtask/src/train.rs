//! `cargo xtask train`: the reference training loop on the tiny built-in default.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::DType;
use dflash_optimized::memory::step::Checkpointing;
use dflash_optimized::train::gradients::HostGradients;
use dflash_reference::builtin::{generate_rows, random_prompt, target_entropy, tiny_draft_config, tiny_target};
use dflash_reference::drafter::Drafter;
use dflash_reference::eval::evaluate;
use dflash_reference::loss::default_gamma;
use dflash_reference::optim::AdamWConfig;
use dflash_reference::speculative::{greedy_decode, speculative_decode};
use dflash_reference::target::TargetModel;
use dflash_reference::train::{train_with, Autograd, StepReport, TrainOptions};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::args::Options;

const HELP: &str = "usage: cargo xtask train [options]

Trains a tiny DFlash drafter against a tiny random Qwen3 target built in code, on data sampled
from that target, with the reference (CPU, f32, autograd) path. Prints the loss as it falls,
then the acceptance length tau of greedy speculative decoding before and after training.

options:
  --steps N          training steps                        (default 600)
  --rows-per-step N  rows per step                         (default 4)
  --anchors N        anchors drawn per row (N_max)         (default 16)
  --lr X             peak learning rate                    (default 3e-3)
  --rows N           training rows generated               (default 64)
  --temperature X    sampling temperature of the data      (default 0.5)
  --step NAME        gradients: `reference` (candle autograd) or `host` (the GPU
                     step's driver and layout on the CPU twins, f32)  (default reference)
  --seed N           seed of everything                    (default 0)
  --out DIR          where the trained drafter is saved    (default runs/tiny-drafter)";

const OPTIONS: &[&str] = &["steps", "rows-per-step", "anchors", "lr", "rows", "temperature", "step", "seed", "out"];

/// Tokens of each generated row: a prompt (loss mask 0) and the target's continuation.
const PROMPT_LEN: usize = 16;
const CONTINUATION_LEN: usize = 80;
/// Held-out rows for the evaluation loss and per-offset accuracy.
const EVAL_ROWS: usize = 8;
/// Held-out prompts and tokens generated per prompt for tau.
const EVAL_PROMPTS: usize = 4;
const EVAL_NEW_TOKENS: usize = 48;

pub fn run(args: Vec<String>) -> Result<(), String> {
    let Some(opts) = Options::parse(args, OPTIONS)? else {
        println!("{HELP}");
        return Ok(());
    };
    let steps: usize = opts.get("steps", 600)?;
    let rows_per_step: usize = opts.get("rows-per-step", 4)?;
    let max_anchors: usize = opts.get("anchors", 16)?;
    let lr: f64 = opts.get("lr", 3e-3)?;
    let n_rows: usize = opts.get("rows", 64)?;
    let temperature: f64 = opts.get("temperature", 0.5)?;
    let step_kind: String = opts.get("step", "reference".to_string())?;
    if !["reference", "host"].contains(&step_kind.as_str()) {
        return Err(format!("option `--step`: unknown step `{step_kind}` (reference or host)"));
    }
    let seed: u64 = opts.get("seed", 0)?;
    let out: PathBuf = opts.get("out", PathBuf::from("runs/tiny-drafter"))?;
    if steps == 0 || rows_per_step == 0 || max_anchors == 0 || n_rows == 0 {
        return Err("--steps, --rows-per-step, --anchors and --rows must be at least 1".into());
    }
    let err = |e: dflash_reference::Error| e.to_string();
    let started = Instant::now();

    let target = tiny_target(seed, DType::F32).map_err(err)?;
    let config = tiny_draft_config(&target.config);
    let drafter = Drafter::init(config.clone(), seed + 1, DType::F32).map_err(err)?;
    let t = &target.config.dims;
    println!(
        "target: Qwen3 (random, built in) hidden {} x {} layers, vocab {}; drafter: {} layers, block {}, features from target layers {:?}, {} trainable parameters",
        t.hidden_size,
        t.num_layers(),
        t.vocab_size,
        config.dims.num_layers(),
        config.block_size,
        config.target_layer_ids,
        drafter.num_params()
    );

    let mut rng = ChaCha8Rng::seed_from_u64(seed + 2);
    print!("data: sampling {n_rows} rows of {PROMPT_LEN}+{CONTINUATION_LEN} tokens from the target ... ");
    let data =
        generate_rows(&target, &config, n_rows, PROMPT_LEN, CONTINUATION_LEN, temperature, &mut rng).map_err(err)?;
    let held_out =
        generate_rows(&target, &config, EVAL_ROWS, PROMPT_LEN, CONTINUATION_LEN, temperature, &mut rng).map_err(err)?;
    let floor = target_entropy(&target, &data, temperature).map_err(err)?;
    println!("done in {:.1}s (target's next-token entropy: {floor:.3} nats)", started.elapsed().as_secs_f64());

    let prompts: Vec<Vec<u32>> =
        (0..EVAL_PROMPTS).map(|_| random_prompt(PROMPT_LEN, t.vocab_size, config.mask_token_id, &mut rng)).collect();
    let tau_before = mean_tau(&target, &drafter, &prompts).map_err(err)?;
    let gamma = default_gamma(config.block_size);
    let eval_before = evaluate(&drafter, &target.frozen_head(), &held_out, max_anchors, gamma, seed).map_err(err)?;

    let train_opts = TrainOptions {
        steps,
        rows_per_step,
        max_anchors,
        optimizer: AdamWConfig { lr, ..AdamWConfig::default() },
        gamma,
        seed,
        ..TrainOptions::default()
    };
    println!("training ({step_kind} step) {steps} steps of {rows_per_step} rows x {max_anchors} anchors, AdamW peak lr {lr:e}, warmup {:.0}% + cosine, clip {}", train_opts.warmup_frac * 100.0, train_opts.clip_norm);
    println!("{:>6} {:>9} {:>10} {:>10} {:>9}", "step", "loss", "lr", "grad norm", "elapsed");
    let train_started = Instant::now();
    let every = (steps / 20).max(1);
    let on_step = |r: &StepReport| {
        if r.step.is_multiple_of(every) || r.step + 1 == steps {
            println!(
                "{:>6} {:>9.4} {:>10.3e} {:>10.3} {:>8.1}s",
                r.step,
                r.loss,
                r.lr,
                r.grad_norm,
                train_started.elapsed().as_secs_f64()
            );
        }
    };
    let head = target.frozen_head();
    let reports = match step_kind.as_str() {
        "reference" => train_with(&drafter, &head, &data, &train_opts, &mut Autograd, on_step),
        _ => {
            let mut host = HostGradients::<f32>::new(Checkpointing::PerLayer, 256);
            train_with(&drafter, &head, &data, &train_opts, &mut host, on_step)
        }
    }
    .map_err(err)?;

    let window = (steps / 10).max(1);
    let mean = |rs: &[StepReport]| rs.iter().map(|r| r.loss).sum::<f64>() / rs.len() as f64;
    let (first, last) = (mean(&reports[..window]), mean(&reports[steps - window..]));
    let tau_after = mean_tau(&target, &drafter, &prompts).map_err(err)?;
    let eval_after = evaluate(&drafter, &target.frozen_head(), &held_out, max_anchors, gamma, seed).map_err(err)?;
    drafter.save(&out).map_err(err)?;
    println!();
    println!("loss: {first:.4} (mean of the first {window} steps) -> {last:.4} (mean of the last {window})");
    println!("held-out loss ({EVAL_ROWS} rows): {:.4} before -> {:.4} after", eval_before.loss, eval_after.loss);
    let percent = |acc: &[f64]| acc[1..].iter().map(|a| format!("{:.0}", a * 100.0)).collect::<Vec<_>>().join(" ");
    println!(
        "held-out top-1 accuracy % at offsets 1..{}: [{}] before -> [{}] after",
        config.block_size - 1,
        percent(&eval_before.accuracy),
        percent(&eval_after.accuracy)
    );
    println!("tau (greedy speculative decoding, {EVAL_PROMPTS} held-out prompts x {EVAL_NEW_TOKENS} tokens, block {}): {tau_before:.2} before -> {tau_after:.2} after; output identical to plain greedy decoding", config.block_size);
    println!("saved the drafter (HF format: config.json + model.safetensors) to {}", out.display());
    println!("total {:.1}s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Mean tau over `prompts`; also checks that speculative decoding reproduces greedy decoding.
fn mean_tau(target: &TargetModel, drafter: &Drafter, prompts: &[Vec<u32>]) -> dflash_reference::Result<f64> {
    let mut sum = 0.0;
    for prompt in prompts {
        let spec = speculative_decode(target, drafter, prompt, EVAL_NEW_TOKENS)?;
        let greedy = greedy_decode(target, prompt, EVAL_NEW_TOKENS)?;
        if spec.tokens != greedy {
            return Err(dflash_reference::Error::invalid(
                "speculative decoding",
                "output differs from plain greedy decoding",
            ));
        }
        sum += spec.tau();
    }
    Ok(sum / prompts.len() as f64)
}
