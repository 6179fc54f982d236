//! `cargo xtask train`: a training run through the trainer crate (`dflash-trainer`): config
//! (preset, `--config FILE`, `--key value`), validation, the loop with a CPU step engine,
//! checkpoints, exact `--resume`, metrics and the plot. Today the built-in tiny default only.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use dflash_optimized::backend::cuda::Cuda;
use dflash_optimized::memory::step::Checkpointing;
use dflash_reference::eval::evaluate;
use dflash_trainer::builtin::{self, mean_tau};
use dflash_trainer::checkpoint::{self, find_resumable, load_config};
use dflash_trainer::config::StepKind;
use dflash_trainer::config::{known_flags, options_help, RunConfig, FIELDS};
use dflash_trainer::engine::{CpuEngine, DeviceEngine, StepEngine};
use dflash_trainer::metrics;
use dflash_trainer::plan::Plan;
use dflash_trainer::run::{check_resume_config, prepare_fresh_out, RunInputs, Trainer};

const HELP_HEAD: &str = "usage: cargo xtask train [--config FILE] [--plan] [--resume OUT] [--key value ...]

Trains a tiny DFlash drafter against a tiny random Qwen3 target built in code, on data sampled
from that target, on the CPU. Prints the loss as it falls, then the acceptance length tau of
greedy speculative decoding before and after training.

The options come from the built-in preset, then the keys of `--config FILE` (TOML, the names
below with `_`), then `--key value` on the command line. Unknown keys are errors.

  --config FILE              a TOML file of options
  --plan                     print the resolved config, steps, epochs, tokens and an estimated
                             time, then exit without training
  --resume OUT               continue the run in OUT from its latest complete checkpoint, with
                             losses identical to an uninterrupted run (its config is loaded;
                             only options that do not change the run may differ, e.g. --steps)
  --target DIR --data FILE   real targets and data (not built yet: they need the GPU loop)

The run folder (--out) gets checkpoint-<step>/ (the servable drafter: config.json and
model.safetensors in bf16; training.safetensors, run.toml, state.json), latest, metrics.jsonl
(one JSON object per line), training.svg, and drafter/ (the final servable drafter). A fresh
run replaces a finished run in its folder and refuses an unfinished one (--resume continues it).

options (built-in defaults):";

pub fn run(args: Vec<String>) -> Result<(), String> {
    let err = |e: dflash_trainer::Error| e.to_string();
    let Some(cli) = Cli::parse(args)? else {
        println!("{HELP_HEAD}\n{}", options_help());
        return Ok(());
    };
    if cli.real_data {
        return Err("`--target` / `--data`: real targets need the GPU loop, not built yet (today `cargo xtask train` trains the built-in tiny default; `cargo xtask data` prepares real data)".into());
    }

    // The config: preset (or the checkpoint's), file, command line; then validation.
    let mut resume_notes = Vec::new();
    let (mut config, resume) = match &cli.resume {
        Some(dir) => {
            let found = find_resumable(dir).map_err(err)?;
            resume_notes.extend(found.notes.iter().cloned());
            let mut saved = load_config(&found.dir).map_err(err)?;
            let base = RunConfig { out: dir.clone(), ..saved.clone() };
            saved.out = dir.clone();
            (base, Some((found, saved)))
        }
        None => (RunConfig::builtin(), None),
    };
    if let Some(file) = &cli.config {
        config = RunConfig::from_file(&config, file).map_err(err)?;
    }
    config = config.with_overrides(&cli.overrides).map_err(err)?;
    if let Some(dir) = &cli.resume {
        if &config.out != dir {
            return Err(format!(
                "option `out`: {} with `--resume {}`: a resumed run stays in its folder",
                config.out.display(),
                dir.display()
            ));
        }
    }
    config.validate().map_err(err)?;
    let draft_config = builtin::draft_config(&config);
    let config = config.resolved(draft_config.block_size, config.rows);
    if let Some((_, saved)) = &resume {
        resume_notes.extend(check_resume_config(&config, saved).map_err(err)?);
    }
    if cli.plan {
        let target_config = builtin::target_config(&config);
        let plan = Plan::new(&config, &draft_config, &target_config, config.rows);
        println!("# resolved config\n{}", config.to_toml());
        println!("{}", plan.describe());
        return Ok(());
    }
    config.check_out().map_err(err)?;
    if resume.is_none() {
        for note in prepare_fresh_out(&config.out).map_err(err)? {
            println!("{note}");
        }
    }

    let started = Instant::now();
    let setup_started = Instant::now();
    print!(
        "data: sampling {} rows of {}+{} tokens from the target ... ",
        config.rows, config.prompt_len, config.continuation_len
    );
    std::io::stdout().flush().ok();
    let setup = builtin::setup(&config).map_err(err)?;
    println!(
        "done in {:.1}s (target's next-token entropy: {:.3} nats)",
        setup_started.elapsed().as_secs_f64(),
        setup.entropy
    );
    let drafter = builtin::init_drafter(&config, &setup.draft_config).map_err(err)?;
    let t = &setup.target.config.dims;
    let d = &setup.draft_config;
    println!(
        "target: Qwen3 (random, built in) hidden {} x {} layers, vocab {}; drafter: {} layers, block {}, features from target layers {:?}, {} trainable parameters",
        t.hidden_size,
        t.num_layers(),
        t.vocab_size,
        d.dims.num_layers(),
        d.block_size,
        d.target_layer_ids,
        drafter.num_params()
    );
    let head = setup.target.frozen_head();
    let gamma = config.gamma_for(d.block_size);
    let tau_before = mean_tau(&setup.target, &drafter, &setup.prompts, config.tau_tokens).map_err(err)?;
    let eval_before =
        evaluate(&drafter, &head, &setup.held_out, config.anchors, gamma, config.seed).map_err(|e| e.to_string())?;
    let mut engine: Box<dyn StepEngine> = match config.step {
        StepKind::Gpu => {
            let gpu = crate::gpu_conformance::open_gpu()?;
            println!("step on {}", gpu.name());
            let d = setup.draft_config.dims.head_dim;
            let make = move || Cuda::new(&gpu, d);
            Box::new(DeviceEngine::new(
                make,
                drafter,
                head.clone(),
                builtin::adamw_config(&config),
                Checkpointing::PerLayer,
            ))
        }
        kind => Box::new(CpuEngine::new(drafter, head.clone(), builtin::adamw_config(&config), kind).map_err(err)?),
    };

    let inputs = RunInputs {
        config: &config,
        draft_config: &setup.draft_config,
        data: &setup.data,
        held_out: &setup.held_out,
        head: &head,
        quiet: false,
    };
    let mut trainer = Trainer::new(inputs).map_err(err)?;
    if let Some((found, _)) = &resume {
        resume_notes.extend(trainer.resume(engine.as_mut(), found).map_err(err)?);
    }
    for note in &resume_notes {
        println!("resume: {note}");
    }
    let steps = trainer.total_steps();
    println!(
        "training ({} step) {steps} steps of {} rows x {} anchors{}, AdamW peak lr {:e}, warmup {:.0}% + cosine, clip {}",
        engine.name(),
        config.rows_per_step,
        config.anchors,
        if config.grad_accum > 1 { format!(" x {} accumulated", config.grad_accum) } else { String::new() },
        config.lr,
        config.warmup_frac * 100.0,
        config.clip_norm
    );
    let summary = trainer.run(engine.as_mut()).map_err(err)?;

    let drafter = engine.drafter().map_err(err)?;
    let tau_after = mean_tau(&setup.target, drafter, &setup.prompts, config.tau_tokens).map_err(err)?;
    let eval_after =
        evaluate(drafter, &head, &setup.held_out, config.anchors, gamma, config.seed).map_err(|e| e.to_string())?;
    let final_dir = config.out.join("drafter");
    checkpoint::save_servable_folder(&final_dir, &setup.draft_config, &engine.state().map_err(err)?).map_err(err)?;
    let svg = metrics::plot(&config.out).map_err(err)?;

    let lines = metrics::read_lines(&metrics::metrics_file(&config.out)).map_err(err)?;
    let losses: Vec<f64> = lines
        .iter()
        .filter(|v| v.get("kind").and_then(|k| k.as_str()) == Some("train"))
        .filter_map(|v| v.get("loss")?.as_f64())
        .collect();
    let window = (losses.len() / 10).max(1).min(losses.len());
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len().max(1) as f64;
    println!();
    println!(
        "loss: {:.4} (mean of the first {window} logged steps) -> {:.4} (mean of the last {window})",
        mean(&losses[..window]),
        mean(&losses[losses.len() - window..])
    );
    if summary.skipped_total > 0 {
        println!("skipped steps (non-finite loss or gradient): {}", summary.skipped_total);
    }
    let n_eval = setup.held_out.len();
    println!("held-out loss ({n_eval} rows): {:.4} before -> {:.4} after", eval_before.loss, eval_after.loss);
    let percent = |acc: &[f64]| acc[1..].iter().map(|a| format!("{:.0}", a * 100.0)).collect::<Vec<_>>().join(" ");
    println!(
        "held-out top-1 accuracy % at offsets 1..{}: [{}] before -> [{}] after",
        d.block_size - 1,
        percent(&eval_before.accuracy),
        percent(&eval_after.accuracy)
    );
    println!("held-out tau_hat: {:.2} before -> {:.2} after", eval_before.tau_hat, eval_after.tau_hat);
    println!(
        "tau (greedy speculative decoding, {} held-out prompts x {} tokens, block {}): {tau_before:.2} before -> {tau_after:.2} after; output identical to plain greedy decoding",
        setup.prompts.len(),
        config.tau_tokens,
        d.block_size
    );
    println!("saved the drafter (HF format: config.json + model.safetensors, bf16) to {}", final_dir.display());
    println!(
        "run folder {}: {} checkpoint(s) written by this run (latest: {}), metrics.jsonl, {}",
        config.out.display(),
        summary.checkpoints.len(),
        summary.checkpoints.last().map_or("-".into(), |p| p.display().to_string()),
        svg.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    );
    println!("total {:.1}s", started.elapsed().as_secs_f64());
    Ok(())
}

/// The command line of `train`.
struct Cli {
    config: Option<PathBuf>,
    resume: Option<PathBuf>,
    plan: bool,
    real_data: bool,
    overrides: Vec<(String, String)>,
}

impl Cli {
    /// `Ok(None)` for `--help`.
    fn parse(args: Vec<String>) -> Result<Option<Self>, String> {
        let mut cli = Cli { config: None, resume: None, plan: false, real_data: false, overrides: Vec::new() };
        let mut it = args.into_iter().peekable();
        while let Some(arg) = it.next() {
            if arg == "--help" || arg == "-h" {
                return Ok(None);
            }
            let name = arg.strip_prefix("--").ok_or_else(|| format!("unexpected argument `{arg}`"))?.to_string();
            if name == "plan" {
                cli.plan = true;
                continue;
            }
            let is_option = FIELDS.iter().any(|(f, _, _)| *f == name.replace('-', "_"));
            if !is_option && !["config", "resume", "target", "data"].contains(&name.as_str()) {
                return Err(format!(
                    "unknown option `--{name}` (known: --config, --plan, --resume, {})",
                    known_flags().join(", ")
                ));
            }
            let value =
                it.next_if(|v| !v.starts_with("--")).ok_or_else(|| format!("option `--{name}` needs a value"))?;
            match name.as_str() {
                "config" => cli.config = Some(PathBuf::from(value)),
                "resume" => cli.resume = Some(PathBuf::from(value)),
                "target" => cli.real_data = true,
                "data" => {
                    cli.real_data = true;
                    while it.peek().is_some_and(|a| !a.starts_with("--")) {
                        it.next();
                    }
                }
                _ => cli.overrides.push((name, value)),
            }
        }
        Ok(Some(cli))
    }
}
