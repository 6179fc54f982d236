//! `cargo xtask train`: a training run through the trainer crate (`dflash-trainer`): config
//! (preset, `--config FILE`, `--key value`), validation, the loop with a step engine,
//! checkpoints, exact `--resume`, metrics and the plot. Two kinds of run: the built-in default
//! (a random target built in code, data sampled from it) and a real run (`--target DIR --data
//! FILE...`: the target's features online on the device, or from a feature cache).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::DType;
use dflash_optimized::backend::cuda::Cuda;
use dflash_optimized::backend::host::Host;
use dflash_optimized::device::gpu::Gpu;
use dflash_optimized::device::nccl::{self, Rank};
use dflash_optimized::flops::PEAK_FLOPS;
use dflash_optimized::memory::step::{Checkpointing, StepShape};
use dflash_optimized::model::TargetFeatures;
use dflash_reference::config::DraftConfig;
use dflash_reference::drafter::{Drafter, FrozenHead};
use dflash_reference::eval::{evaluate, EvalReport};
use dflash_reference::io::WeightSet;
use dflash_reference::speculative::{Acceptance, Sampling};
use dflash_reference::target::TargetKind;
use dflash_trainer::builtin::{self, mean_tau};
use dflash_trainer::checkpoint::{self, find_resumable, load_config, Found};
use dflash_trainer::config::{known_flags, options_help, RunConfig, StepKind, FIELDS};
use dflash_trainer::dist::feed::{FeedEnd, FeedPool, MakeSlotFill, SlotFill, TargetSlots};
use dflash_trainer::dist::group::{self, Launch, ProcessGroup};
use dflash_trainer::dist::reduce::{GradReduce, HostGroup};
use dflash_trainer::dist::{DataParallel, MakeReplica, Replica};
use dflash_trainer::engine::{CpuEngine, DeviceEngine, Frozen, StepEngine};
use dflash_trainer::metrics;
use dflash_trainer::plan::Plan;
use dflash_trainer::real::{self, RealSetup};
use dflash_trainer::rows::{RowFeatures, RowSource};
use dflash_trainer::run::{
    check_fresh_out, check_resumable, check_resume_config, lock_out, prepare_fresh_out, Replace, RunInputs, RunSummary,
    TauProbe, Trainer,
};

use crate::eval::{cached_decoders, CachedDecoder};

const HELP_HEAD: &str = "usage: cargo xtask train [--target DIR --data FILE... [--features CACHE]] [--config FILE] [--plan] [--resume OUT] [--overwrite] [--key value ...]

Without --target: trains a tiny DFlash drafter against a tiny random Qwen3 target built in code,
on data sampled from that target, on the CPU (`--step gpu --builtin-target gpu`: on the GPU).
Prints the loss as it falls, then the acceptance length tau of greedy speculative decoding
before and after training.

With --target DIR --data FILE...: a real run. The target's HF folder (config.json, safetensors
weights, tokenizer, chat template: a Qwen3 or Llama, or a Qwen3.5/3.6 GatedDeltaNet hybrid, text
or multimodal wrapper) and jsonl conversations (as `cargo xtask data` reads them); the drafter is
derived from the target (dims, RoPE, vocab; a hybrid's: heads of 128, sliding layers then a full
one, RoPE theta 1e7) with the spec's recipe (5 layers, block 16, 5 feature layers, AdamW lr 6e-4,
warmup 4% + cosine, clip 1, 6 epochs, S 3072, 512 anchors). The target runs on the GPU in the same process (online features; `--step host`: the
CPU twins, for small targets), or `--features CACHE` reads the features `cargo xtask features`
wrote. Everything (options, files, the drafter against the target, the mask token, the cache's
provenance, the least memory the run needs on its drafter device) is checked before the target
is loaded or the step laid out.

Several processes (one per node, or per GPU) train as one: `--world-size N --rank R
--master-addr A --master-port P` on each, or the torchrun variables (WORLD_SIZE, RANK,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK). They meet at rank 0 (the same config and data, checked),
split each step's rows and sum their gradients (`host` step: through rank 0; `gpu`: NCCL). Rank
0 alone writes the run folder; `--resume OUT` on every rank continues.

The options come from a preset (the built-in one, or the recipe with --target), then the keys of
`--config FILE` (TOML, the names below with `_`), then `--key value` on the command line.
Unknown keys are errors.

  --config FILE              a TOML file of options
  --plan                     print the resolved config, the memory plan (real runs), steps,
                             epochs, tokens and an estimated time, then exit without training
  --resume OUT               continue the run in OUT from its latest complete checkpoint, with
                             losses identical to an uninterrupted run (its config is loaded;
                             only options that do not change the run may differ, e.g. --steps;
                             with another count of drafter workers or processes, the losses
                             are equal within f32 rounding: the gradients are summed in other
                             groups)
  --overwrite                replace the finished run in --out, or the remains
                             of one with no complete checkpoint (the built-in default replaces
                             its own runs without it, never a real run's or a lone drafter/)

The run folder (--out) gets checkpoint-<step>/ (the servable drafter: config.json and
model.safetensors in bf16; training/training.safetensors, run.toml, state.json), latest,
metrics.jsonl (one JSON object per line), training.svg, and drafter/ (the final servable
drafter). A fresh
run refuses a folder holding an unfinished run (--resume continues it), and one holding a
finished real run (or one with no complete checkpoint) unless --overwrite; the built-in default
replaces its own finished runs and such remains, never a finished real run. The input paths (target, data, features, data cache, a held-out file) are saved
absolute, so a run resumes from any folder.

options (the built-in default's values, and the recipe's where a real run starts elsewhere):";

/// The MFU `--plan` estimates a GPU run's time with (the planned step measured 57% on the H200).
const PLANNED_MFU: f64 = 0.5;

pub fn run(args: Vec<String>) -> Result<(), String> {
    let Some(cli) = Cli::parse(args)? else {
        println!("{HELP_HEAD}\n{}", options_help());
        return Ok(());
    };
    let mut launch = None;
    let outcome = run_cli(&cli, &mut launch);
    let Err(e) = outcome else { return Ok(()) };
    let launch = match launch {
        Some(resolved) => resolved,
        // The run failed before its config was whole (a missing checkpoint, an unreadable config
        // file): the command line and the torchrun variables say how it was launched, when no
        // config file could say otherwise.
        None if cli.config.is_none() => {
            let preset = match cli.resume.is_some() || cli.real_preset().unwrap_or(true) {
                true => RunConfig::default(),
                false => RunConfig::builtin(),
            };
            let env = |name: &str| std::env::var(name).ok();
            preset.with_overrides(&cli.overrides).ok().and_then(|c| Launch::resolve(&c, &env).ok())
        }
        None => None,
    };
    let Some(launch) = launch else { return Err(e) };
    tell_the_others(&cli, launch, e)
}

/// The run `cli` asks for; `launch` is set once its config is whole: the launch it resolves to,
/// `None` when it resolves to none.
fn run_cli(cli: &Cli, launch: &mut Option<Option<Launch>>) -> Result<(), String> {
    let err = |e: dflash_trainer::Error| e.to_string();
    // The config: preset (or the checkpoint's), file, command line; then validation.
    let mut resume_notes = Vec::new();
    let (mut config, resume) = match &cli.resume {
        Some(dir) => {
            let found = find_resumable(dir).map_err(err)?;
            resume_notes.extend(found.notes.iter().cloned());
            // Relative paths of a checkpoint saved before they were made absolute: as from here.
            let mut saved = load_config(&found.dir).and_then(|c| c.with_absolute_paths()).map_err(err)?;
            let base = RunConfig { out: dir.clone(), ..saved.clone() };
            saved.out = dir.clone();
            (base, Some((found, saved)))
        }
        None if cli.real_preset()? => (RunConfig::default(), None),
        None => (RunConfig::builtin(), None),
    };
    if let Some(file) = &cli.config {
        config = RunConfig::from_file(&config, file).map_err(err)?;
    }
    config = config.with_overrides(&cli.overrides).and_then(|c| c.with_absolute_paths()).map_err(err)?;
    let resolved = Launch::resolve(&config, &|name| std::env::var(name).ok());
    *launch = Some(resolved.as_ref().ok().cloned());
    if let Some(dir) = &cli.resume {
        if &config.out != dir {
            return Err(format!(
                "option `out`: {} with `--resume {}`: a resumed run stays in its folder",
                config.out.display(),
                dir.display()
            ));
        }
    }
    config.validate().and_then(|()| config.check_given(&cli.given())).map_err(err)?;
    // An option that would change a resumed run, before the data is read (checked again, with
    // the notes, once `epochs` is resolved to steps).
    if let Some((_, saved)) = &resume {
        check_resume_config(&config, saved).map_err(err)?;
    }
    let launch = resolved.map_err(err)?;
    // A resumed run keeps its rows per update on any number of workers: some then sit idle.
    match (&resume, config.workers_without_rows(launch.world_size)) {
        (Some(_), Some(why)) => resume_notes.push(format!("{why}: some sit idle at every step")),
        _ => config.check_rows_for_workers(launch.world_size).map_err(err)?,
    }
    match config.target.is_some() {
        true => real_run(config, &launch, (cli.plan, cli.overwrite), resume, resume_notes),
        false => builtin_run(config, &launch, (cli.plan, cli.overwrite), resume, resume_notes),
    }
}

/// After this process stopped with `e`: when it did so before joining the others, tells them,
/// so that none waits out the rendezvous timeout. Under torchrun (which sets
/// TORCHELASTIC_RUN_ID) the agent stops the others at once when a process fails. Returns `e`.
fn tell_the_others(cli: &Cli, launch: Launch, e: String) -> Result<(), String> {
    let tell = launch.world_size > 1 && !cli.plan && std::env::var_os("TORCHELASTIC_RUN_ID").is_none();
    let joining = JOINING.load(Ordering::SeqCst);
    if tell && launch.rank == 0 && joining != JOINED {
        // Each rank is told why as it arrives, until the rendezvous's deadline (none after it
        // timed out).
        let others = launch.world_size - 1;
        let spent = RENDEZVOUS_BEGAN.get().map_or(Duration::ZERO, Instant::elapsed);
        let rendezvous = group::RENDEZVOUS_TIMEOUT.saturating_sub(spent);
        let told_before = TOLD_AT_RENDEZVOUS.get().cloned().unwrap_or_default();
        eprintln!("error: {e}");
        if told_before.len() < others {
            eprintln!(
                "rank 0 stopped before the rendezvous: telling the other {} ranks as they arrive (up to {} s) ...",
                others - told_before.len(),
                rendezvous.as_secs()
            );
        }
        let timeouts = group::Timeouts { rendezvous, ..group::Timeouts::default() };
        let told = ProcessGroup::refuse_joiners(&launch, &e, timeouts, &told_before);
        return Err(format!("rank 0 stopped before the rendezvous (the error above); {told} of {others} ranks told"));
    }
    if tell && launch.rank > 0 && joining == NOT_JOINING {
        eprintln!("error: {e}");
        eprintln!(
            "rank {} stopped before the rendezvous: telling rank 0 (up to {} s) ...",
            launch.rank,
            group::RENDEZVOUS_TIMEOUT.as_secs()
        );
        let told = match ProcessGroup::report_failure(&launch, &e, group::Timeouts::default()) {
            true => "rank 0 told",
            false => "rank 0 could not be reached",
        };
        return Err(format!("rank {} stopped before the rendezvous (the error above); {told}", launch.rank));
    }
    Err(e)
}

/// How far this process got in joining the others: [`NOT_JOINING`], [`IN_RENDEZVOUS`] (a failure of
/// the rendezvous itself is told by the group) or [`JOINED`] (a failure reaches the others
/// through the group).
static JOINING: AtomicU8 = AtomicU8::new(NOT_JOINING);
const NOT_JOINING: u8 = 0;
const IN_RENDEZVOUS: u8 = 1;
const JOINED: u8 = 2;
/// When this process began the rendezvous (rank 0 stopped in it tells latecomers until its end).
static RENDEZVOUS_BEGAN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
/// The ranks rank 0's failed rendezvous told why (refused, or stopped themselves).
static TOLD_AT_RENDEZVOUS: std::sync::OnceLock<std::collections::BTreeSet<usize>> = std::sync::OnceLock::new();

/// The checkpoint to resume from and the config it was saved with.
type Resume = Option<(Found, RunConfig)>;

/// The resolved config's resume notes (an error when it may not resume the checkpoint).
fn check_resume(config: &RunConfig, resume: &Resume, notes: &mut Vec<String>) -> Result<(), String> {
    if let Some((_, saved)) = resume {
        notes.extend(check_resume_config(config, saved).map_err(|e| e.to_string())?);
    }
    Ok(())
}

/// What a real run's fresh `--out` may replace: any finished run with `--overwrite`.
fn replace(overwrite: bool) -> Replace {
    match overwrite {
        true => Replace::Any,
        false => Replace::Never,
    }
}

/// `--out` checked writable, locked for this run ([`lock_out`]) and free for a fresh run
/// ([`check_fresh_out`]: a finished run there may be replaced only when `replace`), touching
/// nothing but a probe file and the lock; by rank 0 alone (the other ranks write nothing there).
fn check_out(config: &RunConfig, launch: &Launch, resume: &Resume, replace: Replace) -> Result<(), String> {
    if launch.rank > 0 {
        return Ok(());
    }
    config.check_out().map_err(|e| e.to_string())?;
    lock_out(&config.out).map_err(|e| e.to_string())?;
    if resume.is_none() {
        check_fresh_out(&config.out, replace).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// `--out` checked again ([`check_out`]) and made ready for a fresh run: a finished run there is
/// replaced when `replace`.
fn prepare_out(config: &RunConfig, launch: &Launch, resume: &Resume, replace: Replace) -> Result<(), String> {
    check_out(config, launch, resume, replace)?;
    if launch.rank == 0 && resume.is_none() {
        for note in prepare_fresh_out(&config.out, replace).map_err(|e| e.to_string())? {
            println!("{note}");
        }
    }
    Ok(())
}

/// The loop: resume when asked, then every remaining step (written by rank 0 alone).
fn train_loop(
    inputs: RunInputs,
    engine: &mut dyn StepEngine,
    launch: &Launch,
    resume: &Resume,
    mut notes: Vec<String>,
) -> Result<RunSummary, String> {
    let err = |e: dflash_trainer::Error| e.to_string();
    let config = inputs.config;
    let mut trainer = Trainer::new(inputs).map_err(err)?;
    if launch.rank > 0 {
        trainer = trainer.without_writing();
    }
    if let Some((found, _)) = resume {
        notes.extend(trainer.resume(engine, found).map_err(err)?);
    }
    for note in &notes {
        println!("resume: {note}");
    }
    println!(
        "training ({} step) {} of {} x {}{}, AdamW peak lr {:e}, warmup {:.0}% + cosine, clip {}",
        engine.name(),
        counted(trainer.total_steps(), "step"),
        counted(config.rows_per_step, "row"),
        counted(config.anchors, "anchor"),
        if config.grad_accum > 1 { format!(" x {} accumulated", config.grad_accum) } else { String::new() },
        config.lr,
        config.warmup_frac * 100.0,
        config.clip_norm
    );
    trainer.run(engine).map_err(err)
}

/// `n` and `noun`, plural unless `n` is 1 ("1 row", "4 rows").
fn counted(n: usize, noun: &str) -> String {
    format!("{n} {noun}{}", if n == 1 { "" } else { "s" })
}

/// The end of a run: the final servable drafter, the plot, the loss and held-out summary.
fn report_end(
    config: &RunConfig,
    draft_config: &DraftConfig,
    engine: &mut dyn StepEngine,
    summary: &RunSummary,
    held_out: Option<(usize, &EvalReport, &EvalReport)>,
) -> Result<(PathBuf, PathBuf), String> {
    let err = |e: dflash_trainer::Error| e.to_string();
    let final_dir = config.out.join("drafter");
    checkpoint::save_servable_folder(&final_dir, draft_config, &engine.state().map_err(err)?).map_err(err)?;
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
    if !losses.is_empty() {
        let (first, last) = match window {
            1 => ("the first logged step".to_string(), "the last".to_string()),
            _ => (format!("mean of the first {window} logged steps"), format!("mean of the last {window}")),
        };
        println!(
            "loss: {:.4} ({first}) -> {:.4} ({last})",
            mean(&losses[..window]),
            mean(&losses[losses.len() - window..])
        );
    }
    if let Some(policy) = engine.checkpointing() {
        println!("checkpointing: {} (the step's activations)", policy.name());
    }
    let balance = summary.waits.and_then(|w| {
        dflash_trainer::dist::feed::balance(w, summary.step_seconds, config.target_workers, config.drafter_workers)
    });
    if let Some((_, line)) = balance {
        println!("{line}");
    }
    if summary.skipped_total > 0 {
        println!("skipped steps (non-finite loss or gradient): {}", summary.skipped_total);
    }
    if let Some((n, before, after)) = held_out {
        println!("held-out loss ({n} rows): {:.4} before -> {:.4} after", before.loss, after.loss);
        let percent = |acc: &[f64]| acc[1..].iter().map(|a| format!("{:.0}", a * 100.0)).collect::<Vec<_>>().join(" ");
        println!(
            "held-out top-1 accuracy % at offsets 1..{}: [{}] before -> [{}] after",
            draft_config.block_size - 1,
            percent(&before.accuracy),
            percent(&after.accuracy)
        );
        println!("held-out tau_hat: {:.2} before -> {:.2} after", before.tau_hat, after.tau_hat);
    }
    Ok((final_dir, svg))
}

/// The last lines: where the drafter and the run's files are.
fn report_files(config: &RunConfig, summary: &RunSummary, final_dir: &Path, svg: &Path, started: Instant) {
    println!("saved the drafter (HF format: config.json + model.safetensors, bf16) to {}", final_dir.display());
    // A resumed run that was already at its last step writes no checkpoint: `latest` names its.
    let latest = match summary.checkpoints.last() {
        Some(dir) => dir.display().to_string(),
        None => std::fs::read_to_string(config.out.join("latest"))
            .map_or("none".into(), |name| config.out.join(name.trim()).display().to_string()),
    };
    println!(
        "run folder {}: {} checkpoint(s) written by this run (latest: {latest}), metrics.jsonl, {}",
        config.out.display(),
        summary.checkpoints.len(),
        svg.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    );
    println!("total {:.1}s", started.elapsed().as_secs_f64());
}

/// Joins the other processes of the run (none alone) before any engine is made: their config,
/// `rows` and resumed checkpoint's step must be this one's.
fn join_processes(
    launch: &Launch,
    config: &RunConfig,
    rows: &dyn RowSource,
    resume: &Resume,
) -> Result<Option<Arc<ProcessGroup>>, String> {
    if launch.world_size == 1 {
        return Ok(None);
    }
    let err = |e: dflash_trainer::Error| e.to_string();
    let first_step = resume.as_ref().map_or(0, |(found, _)| found.state.step);
    let fingerprint = group::fingerprint(config, &rows.sha256().map_err(err)?, first_step).map_err(err)?;
    let (rank, world, addr, port) = (launch.rank, launch.world_size, &launch.master_addr, launch.master_port);
    println!(
        "process rank {rank} of {world}: joining the others through rank 0 at {addr}:{port} (waiting up to {} s) ...",
        group::RENDEZVOUS_TIMEOUT.as_secs()
    );
    let _ = RENDEZVOUS_BEGAN.set(Instant::now());
    JOINING.store(IN_RENDEZVOUS, Ordering::SeqCst);
    let mut told = std::collections::BTreeSet::new();
    let joined = ProcessGroup::join(launch, &fingerprint, &mut told);
    let _ = TOLD_AT_RENDEZVOUS.set(told);
    let joined = joined.map_err(err)?;
    JOINING.store(JOINED, Ordering::SeqCst);
    println!("process rank {rank} of {world}: joined");
    Ok(Some(Arc::new(joined)))
}

/// A rank other than 0 at the end of its run (rank 0 wrote the run folder and the drafter).
fn follower_end(launch: &Launch, summary: &RunSummary, started: Instant) -> Result<(), String> {
    println!(
        "process rank {} of {}: {} steps trained with the others in {:.1}s; rank 0 wrote the run folder",
        launch.rank,
        launch.world_size,
        summary.steps_run,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The built-in default: a random target built in code, rows sampled from it.
fn builtin_run(
    config: RunConfig,
    launch: &Launch,
    (plan, overwrite): (bool, bool),
    resume: Resume,
    mut resume_notes: Vec<String>,
) -> Result<(), String> {
    let err = |e: dflash_trainer::Error| e.to_string();
    let draft_config = builtin::draft_config(&config);
    config.check_total_steps(config.rows).map_err(err)?;
    let config = config.resolved(draft_config.block_size, config.rows);
    check_resume(&config, &resume, &mut resume_notes)?;
    if plan {
        let plan = Plan::new(&config, &draft_config, builtin::target_summary(&config).1, config.rows);
        println!("# resolved config\n{}", config.to_toml());
        println!("{}", plan.describe());
        return Ok(());
    }
    gpus_present(&config, launch, plan).map_err(err)?;
    // A lone drafter/ there is this default's when its config is this default's drafter's.
    let drafter_file = config.out.join("drafter").join("config.json");
    let own_drafter = DraftConfig::from_file(&drafter_file).is_ok_and(|d| d == draft_config);
    let replace = if overwrite { Replace::Any } else { Replace::BuiltIn { own_drafter } };
    prepare_out(&config, launch, &resume, replace)?;

    let started = Instant::now();
    print!(
        "data: sampling {} rows of {}+{} tokens from the target ... ",
        config.rows, config.prompt_len, config.continuation_len
    );
    std::io::stdout().flush().ok();
    let setup = builtin::setup(&config).map_err(err)?;
    println!(
        "done in {:.1}s (target's next-token entropy: {:.3} nats)",
        started.elapsed().as_secs_f64(),
        setup.entropy
    );
    if let Some((found, _)) = &resume {
        check_resumable(found, &setup.data, &config).map_err(err)?;
    }
    let drafter = builtin::init_drafter(&config, &setup.draft_config).map_err(err)?;
    let d = &setup.draft_config;
    println!(
        "target: {}; drafter: {} layers, block {}, features from target layers {:?}, {} trainable parameters",
        builtin::target_summary(&config).0,
        d.dims.num_layers(),
        d.block_size,
        d.target_layer_ids,
        drafter.num_params()
    );
    let head = setup.target.frozen_head();
    let gamma = config.gamma_for(d.block_size);
    // The real tau before and after (none with `--tau-prompts 0`).
    let with_tau = !setup.prompts.is_empty();
    let tau_before = match with_tau {
        true => Some(mean_tau(setup.target.as_ref(), &drafter, &setup.prompts, config.tau_tokens, &[]).map_err(err)?),
        false => None,
    };
    let eval_before =
        evaluate(&drafter, &head, &setup.held_out, config.anchors, gamma, config.seed).map_err(|e| e.to_string())?;
    let processes = join_processes(launch, &config, &setup.data, &resume)?;
    let mut engine: Box<dyn StepEngine> = match config.step {
        StepKind::Gpu if config.drafter_workers == 1 && processes.is_none() => {
            let gpu = crate::gpu_conformance::open_gpu_at(config.topology().1[0])?;
            println!("step on {}", gpu.name());
            let d = setup.draft_config.dims.head_dim;
            let make = move || Cuda::new(&gpu, d);
            let adamw = builtin::adamw_config(&config);
            let rows = config.rows_per_update();
            let frozen = Frozen::Host(head.clone());
            Box::new(
                DeviceEngine::new(make, drafter, frozen, adamw, &config.checkpointing.policies())
                    .with_rows_per_update(rows),
            )
        }
        StepKind::Gpu => {
            let (c, draft, frozen_head) = (config.clone(), setup.draft_config.clone(), head.clone());
            let engine: Arc<GpuEngine> = Arc::new(move |_, gpu| {
                let (drafter, d) = (builtin::init_drafter(&c, &draft)?, draft.dims.head_dim);
                let frozen = Frozen::Host(frozen_head.clone());
                Ok(DeviceEngine::new(
                    move || Cuda::new(&gpu, d),
                    drafter,
                    frozen,
                    builtin::adamw_config(&c),
                    &c.checkpointing.policies(),
                )
                .with_rows_per_update(c.rows_per_update()))
            });
            Box::new(gpu_workers(
                &launch.topology(&config).1,
                &setup.draft_config,
                engine,
                processes.as_ref(),
                config.shard_optimizer,
            )?)
        }
        StepKind::Host if config.drafter_workers > 1 || processes.is_some() => {
            let (c, draft, frozen_head) = (config.clone(), setup.draft_config.clone(), head.clone());
            let engine: Arc<HostEngine> = Arc::new(move |_| {
                let drafter = builtin::init_drafter(&c, &draft)?;
                let frozen = Frozen::Host(frozen_head.clone());
                let adamw = builtin::adamw_config(&c);
                let e = DeviceEngine::new(
                    || Ok(Host::<f32>::default()),
                    drafter,
                    frozen,
                    adamw,
                    &c.checkpointing.policies(),
                );
                Ok(e.with_rows_per_update(c.rows_per_update()))
            });
            Box::new(host_workers(
                config.drafter_workers,
                &setup.draft_config,
                engine,
                processes.as_ref(),
                config.shard_optimizer,
            )?)
        }
        // The CPU has the memory: the fastest of the run's policies.
        kind => Box::new(
            CpuEngine::new(drafter, head.clone(), builtin::adamw_config(&config), kind)
                .map_err(err)?
                .with_checkpointing(config.checkpointing.policies()[0]),
        ),
    };
    let tau = |d: &Drafter| mean_tau(setup.target.as_ref(), d, &setup.prompts, config.tau_tokens, &[]);
    let inputs = RunInputs {
        config: &config,
        draft_config: &setup.draft_config,
        data: &setup.data,
        held_out: &setup.held_out,
        tau: with_tau.then_some(&tau),
        quiet: false,
        devices: devices(&config, launch),
        read_ahead: config.step == StepKind::Gpu,
        processes: launch.world_size,
    };
    let summary = train_loop(inputs, engine.as_mut(), launch, &resume, resume_notes)?;
    if launch.rank > 0 {
        return follower_end(launch, &summary, started);
    }

    let drafter = engine.drafter().map_err(err)?;
    let tau_after = match with_tau {
        true => Some(mean_tau(setup.target.as_ref(), drafter, &setup.prompts, config.tau_tokens, &[]).map_err(err)?),
        false => None,
    };
    let eval_after =
        evaluate(drafter, &head, &setup.held_out, config.anchors, gamma, config.seed).map_err(|e| e.to_string())?;
    let held = Some((setup.held_out.len(), &eval_before, &eval_after));
    let (final_dir, svg) = report_end(&config, &setup.draft_config, engine.as_mut(), &summary, held)?;
    if let (Some(tau_before), Some(tau_after)) = (tau_before, tau_after) {
        println!(
            "tau (greedy speculative decoding, {} held-out prompts x {} tokens, block {}): {tau_before:.2} before -> {tau_after:.2} after; output identical to plain greedy decoding",
            setup.prompts.len(),
            config.tau_tokens,
            d.block_size
        );
    }
    report_files(&config, &summary, &final_dir, &svg, started);
    Ok(())
}

/// A real run: the user's target and data (features online or from a cache).
/// A real run; `(plan, overwrite)`: `--plan` and `--overwrite`.
fn real_run(
    config: RunConfig,
    launch: &Launch,
    (plan, overwrite): (bool, bool),
    resume: Resume,
    mut resume_notes: Vec<String>,
) -> Result<(), String> {
    let err = |e: dflash_trainer::Error| e.to_string();
    let started = Instant::now();
    // The run folder before the data is read (tokenizing a large data set takes minutes).
    if !plan {
        check_out(&config, launch, &resume, replace(overwrite))?;
    }
    let setup = real::prepare(&config, || gpus_present(&config, launch, plan)).map_err(err)?;
    let (t, d) = (&setup.target_config, &setup.draft_config);
    for note in &setup.notes {
        println!("{note}");
    }
    let stats = setup.dataset.stats();
    println!(
        "data: {} documents ({} tokens, {} supervised) from {} conversations; {} documents held out",
        stats.documents,
        stats.tokens,
        stats.supervised_tokens,
        stats.conversations,
        setup.dataset.held_out.len()
    );
    if stats.total_skipped() > 0 {
        println!("data: {} skipped or filtered ({})", stats.total_skipped(), stats.skip_summary());
        for example in &stats.examples {
            println!("  e.g. {example}");
        }
    }
    if let Some(warning) = stats.unended_warning() {
        println!("data: {warning}");
    }
    if setup.dataset.held_out_duplicates > 0 {
        println!(
            "data: {} documents of the data files are also in the held-out file: left out of training",
            setup.dataset.held_out_duplicates
        );
    }
    let dtype = if config.step == StepKind::Gpu { DType::BF16 } else { DType::F32 };
    // The reference target on the CPU: the reference engine's features, and its real tau (not
    // for `--plan`, which reads no features: the rows are lazy).
    let reference_features = config.step == StepKind::Reference && setup.cache.is_none();
    let reference_tau = config.step == StepKind::Reference && config.tau_prompts > 0;
    let reference_target = match (reference_features || reference_tau) && !plan {
        true => Some(t.load_model(&setup.target_dir, DType::F32).map_err(|e| e.to_string())?),
        false => None,
    };
    let features = || match reference_target.as_ref().filter(|_| reference_features) {
        Some(target) => setup.features(dtype, RowFeatures::Reference(target.as_ref(), d.target_layer_ids.clone())),
        None => setup.features(dtype, RowFeatures::Online),
    };
    let (train_rows, held_rows) = setup.rows(&config, features).map_err(err)?;
    config.check_total_steps(train_rows.len()).map_err(err)?;
    let config = config.resolved(d.block_size, train_rows.len());
    check_resume(&config, &resume, &mut resume_notes)?;
    // The checkpoint against these rows, before the target is loaded or evaluated (not for
    // `--plan`, whose rows name no reference target's features).
    if let (Some((found, _)), false) = (&resume, plan) {
        check_resumable(found, &train_rows, &config).map_err(err)?;
    }
    let prompts = match config.tau_prompts {
        0 => Vec::new(),
        n => {
            let prompts = setup.tau_prompts(n, config.tau_tokens).map_err(err)?;
            if prompts.len() < n {
                println!(
                    "real tau: {} of the {n} prompts asked for (the held-out documents with a prompt)",
                    prompts.len()
                );
            }
            prompts
        }
    };
    let source = match &config.features {
        Some(cache) => format!("features from the cache {}", cache.display()),
        None => format!("features online from target layers {:?}", d.target_layer_ids),
    };
    println!(
        "target: {}, {}; drafter: {} layers, block {}, mask token {}, {source}; rows: {} of {} tokens for training, {} held out",
        setup.target_dir.display(),
        t.describe(),
        d.dims.num_layers(),
        d.block_size,
        d.mask_token_id,
        train_rows.len(),
        config.max_len,
        held_rows.as_ref().map_or(0, |h| h.len())
    );
    let shape = StepShape { context_len: config.max_len, num_anchors: config.anchors, lm_chunk_rows: 1024 };
    if plan {
        println!("# resolved config\n{}", config.to_toml());
        let name = setup.target_dir.display().to_string();
        let h200 = (crate::plan::H200_GIB * (1u64 << 30) as f64) as u64;
        // The real tau's cached decoders sit beside the step, with their own copy of the target.
        let mut decoders = 0;
        if config.tau_prompts > 0 && config.step != StepKind::Reference {
            let context = tau_context(&prompts, config.tau_tokens);
            // In the GPU step's storage, as the plan below (the note after it says so for others).
            let widths = storage_widths(StepKind::Gpu);
            decoders = dflash_optimized::model::speculative::decoders_bytes(t, d, context, widths)
                .map_err(|e| e.to_string())?;
            println!(
                "real tau decoders ({} prompts, a context of {context}; their own copy of the target): {:.2} GB, in the totals below",
                prompts.len(),
                decoders as f64 / 1e9
            );
        }
        let policies = config.checkpointing.policies();
        let run = crate::plan::PlanFor {
            shape,
            device_bytes: h200,
            beside: decoders,
            policies: &policies,
            accumulate: config.accumulates_gradients(launch.world_size),
            shards: if config.shard_optimizer { config.drafter_workers } else { 1 },
        };
        let chosen = match t {
            _ if config.features.is_some() => crate::plan::print_offline_plan(d, &run)?,
            _ if config.target_workers > 0 => {
                let (target_gpus, drafter_gpus) = config.topology();
                let slots = dflash_trainer::dist::feed::slots_per_target(config.drafter_workers);
                crate::plan::print_workers_plan(&name, t, d, &run, (&target_gpus, &drafter_gpus), slots)?
            }
            TargetKind::Dense(t) => crate::plan::print_target_plan(&name, t, d, &run)?,
            TargetKind::Hybrid(t) => crate::plan::print_hybrid_plan(&name, t, d, &run)?,
        };
        match chosen {
            Some(p) if policies.len() > 1 => println!(
                "checkpointing: {} (the fastest policy whose step fits one H200 with {} to spare)",
                p.name(),
                metrics::size_text(dflash_optimized::memory::step::POLICY_HEADROOM)
            ),
            Some(p) => println!("checkpointing: {}", p.name()),
            None => println!(
                "the run does not fit one H200 with {} to spare: lower --max-len or --anchors (or --tau-prompts 0){}",
                metrics::size_text(dflash_optimized::memory::step::POLICY_HEADROOM),
                if policies != [Checkpointing::PerLayer] { ", or --checkpointing per-layer" } else { "" }
            ),
        }
        match config.step {
            StepKind::Gpu => {}
            StepKind::Host => println!(
                "(the plan above is the GPU step's, bf16 storage on one H200; `--step host` lays the same step out with f32 storage, more bytes, in this machine's free memory, which the run checks before it loads the target)"
            ),
            StepKind::Reference => println!(
                "(the plan above is the GPU step's, bf16 storage on one H200; `--step reference` runs candle's autograd on the CPU, which it does not describe)"
            ),
        }
        if config.shard_optimizer {
            print_sharded_optimizer(d, shape, config.drafter_workers)?;
        }
        let steps = config.total_steps(train_rows.len());
        let rows = (steps * config.rows_per_update()) as f64;
        let per_row = real_flops_per_row(&config, &setup);
        let (epochs, tokens, flop) = (rows / train_rows.len() as f64, rows * config.max_len as f64, rows * per_row);
        let estimate = match config.step {
            StepKind::Gpu => format!(
                "on one H200: {:.0}s ({flop:.1e} model FLOP at {:.0}% MFU)",
                flop / (PEAK_FLOPS * PLANNED_MFU),
                PLANNED_MFU * 100.0
            ),
            _ => format!(
                "on the CPU: {:.0}s ({flop:.1e} model FLOP at the {:.0e} FLOP/s of the CPU engines measured on 2 cores)",
                flop / dflash_trainer::plan::CPU_TRAIN_FLOPS,
                dflash_trainer::plan::CPU_TRAIN_FLOPS
            ),
        };
        println!("steps: {steps}\nepochs: {epochs:.2}\ntokens: {tokens:.0}\nestimated time {estimate}");
        return Ok(());
    }
    let tau_decoders =
        (config.tau_prompts > 0 && !prompts.is_empty()).then(|| tau_context(&prompts, config.tau_tokens));
    check_fits(&config, launch, &setup, shape, tau_decoders)?;
    prepare_out(&config, launch, &resume, replace(overwrite))?;
    let processes = join_processes(launch, &config, &train_rows, &resume)?;

    let drafter_started = Instant::now();
    let drafter = Drafter::init(d.clone(), config.seed + 1, DType::F32).map_err(|e| e.to_string())?;
    println!(
        "drafter: {} trainable parameters (initialized in {:.1}s)",
        drafter.num_params(),
        drafter_started.elapsed().as_secs_f64()
    );
    let adamw = builtin::adamw_config(&config);
    let (policies, rows) = (config.checkpointing.policies(), config.rows_per_update());
    let host_head = |dtype: DType| -> Result<FrozenHead, String> {
        let w = WeightSet::load_dir(&setup.target_dir).map_err(|e| e.to_string())?;
        t.frozen_head(&w, dtype).map_err(|e| e.to_string())
    };
    let ids = d.target_layer_ids.clone();
    let online = setup.cache.is_none();
    let (dir, max_len) = (setup.target_dir.clone(), config.max_len);
    let targets = config.target_workers;
    let mut engine: Box<dyn StepEngine> = match config.step {
        StepKind::Gpu => {
            let (target_gpus, drafter_gpus) = launch.topology(&config);
            let head_dim = d.dims.head_dim;
            // The target's forward on `gpu`, bf16 (with the LM head when the step shares it), on
            // kernels for its own heads (a hybrid's differ from its drafter's).
            let (target, ids) = (t.clone(), ids.clone());
            let forward = move |gpu: &Gpu,
                                with_lm_head: bool|
                  -> dflash_trainer::Result<Box<dyn TargetFeatures<Backend = Cuda>>> {
                let started = Instant::now();
                let last = ids.iter().max().copied().unwrap_or(0);
                println!("target forward: loading layers 0..={last} from {} ...", dir.display());
                let cuda = Cuda::new(gpu, target.head_dim())?;
                let f = real::load_forward(cuda, &target, &dir, &ids, max_len, (with_lm_head, DType::BF16))?;
                println!(
                    "target forward: layers 0..={last} on {} in bf16, loaded in {:.1}s",
                    dflash_optimized::backend::Backend::name(f.backend()),
                    started.elapsed().as_secs_f64()
                );
                Ok(f)
            };
            if targets == 0 && drafter_gpus.len() == 1 && processes.is_none() {
                let gpu = crate::gpu_conformance::open_gpu_at(drafter_gpus[0])?;
                let frozen = match online {
                    true => Frozen::Target(forward(&gpu, true).map_err(err)?),
                    false => Frozen::Host(host_head(DType::F32)?),
                };
                println!("step on {}", gpu.name());
                let e = DeviceEngine::new(move || Cuda::new(&gpu, head_dim), drafter, frozen, adamw, &policies);
                Box::new(e.with_rows_per_update(rows))
            } else {
                // Target workers on their GPUs (a stream of their own beside a drafter's), their
                // slots readable by the drafter workers' GPUs.
                let forward_for_fill = forward.clone();
                let (places, readers) = (target_gpus.clone(), drafter_gpus.clone());
                let fill: Arc<MakeSlotFill> = Arc::new(move |k, slots| {
                    let gpu = Gpu::open_own_stream(places[k])?
                        .ok_or_else(|| dflash_trainer::Error::option("gpus", format!("no GPU {}", places[k])))?;
                    gpu.share_pool_with(&readers)?;
                    let f = forward_for_fill(&gpu, false)?;
                    Ok(Box::new(TargetSlots::new(f, slots)?) as Box<dyn SlotFill>)
                });
                let (feed, ends) = feed((&target_gpus, &drafter_gpus), fill)?;
                let head = match online && targets == 0 {
                    true => None,
                    false => Some(host_head(DType::F32)?),
                };
                let (draft, seed) = (d.clone(), config.seed);
                let engine: Arc<GpuEngine> = Arc::new(move |k, gpu| {
                    let frozen = match &head {
                        None => Frozen::Target(forward(&gpu, true)?),
                        Some(head) => Frozen::Host(head.clone()),
                    };
                    let drafter = Drafter::init(draft.clone(), seed + 1, DType::F32)?;
                    let e =
                        DeviceEngine::new(move || Cuda::new(&gpu, head_dim), drafter, frozen, adamw.clone(), &policies);
                    Ok(fed(e.with_rows_per_update(rows), &ends, k))
                });
                let workers = gpu_workers(&drafter_gpus, d, engine, processes.as_ref(), config.shard_optimizer)?;
                Box::new(match feed {
                    Some(feed) => workers.with_feed(feed),
                    None => workers,
                })
            }
        }
        StepKind::Host => {
            // One engine per worker, made in its thread: its own target forward (online, without
            // target workers), or the tables on the host (offline, or fed by target workers).
            let target = t.clone();
            let forward =
                move |with_lm_head: bool| -> dflash_trainer::Result<Box<dyn TargetFeatures<Backend = Host<f32>>>> {
                    real::load_forward(Host::<f32>::default(), &target, &dir, &ids, max_len, (with_lm_head, DType::F32))
                };
            let head = match online && targets == 0 {
                true => None,
                false => Some(host_head(DType::F32)?),
            };
            let forward_for_fill = forward.clone();
            let fill: Arc<MakeSlotFill> = Arc::new(move |_, slots| {
                Ok(Box::new(TargetSlots::new(forward_for_fill(false)?, slots)?) as Box<dyn SlotFill>)
            });
            let (feed, ends) = feed((&vec![0; targets], &vec![0; config.drafter_workers]), fill)?;
            let (draft, seed) = (d.clone(), config.seed);
            let engine: Arc<HostEngine> = Arc::new(move |k| {
                let frozen = match &head {
                    None => Frozen::Target(forward(true)?),
                    Some(head) => Frozen::Host(head.clone()),
                };
                let drafter = Drafter::init(draft.clone(), seed + 1, DType::F32)?;
                let e = DeviceEngine::new(|| Ok(Host::<f32>::default()), drafter, frozen, adamw.clone(), &policies);
                Ok(fed(e.with_rows_per_update(rows), &ends, k))
            });
            match (config.drafter_workers, feed, &processes) {
                (1, None, None) => Box::new(engine(0).map_err(err)?),
                (n, feed, _) => {
                    let workers = host_workers(n, d, engine, processes.as_ref(), config.shard_optimizer)?;
                    Box::new(match feed {
                        Some(feed) => workers.with_feed(feed),
                        None => workers,
                    })
                }
            }
        }
        StepKind::Reference => {
            let head = host_head(DType::F32)?;
            Box::new(CpuEngine::new(drafter, head, adamw, StepKind::Reference).map_err(err)?)
        }
    };
    let gamma = config.gamma_for(d.block_size);
    let no_rows: Vec<dflash_reference::data::TrainRow> = Vec::new();
    let held: &dyn RowSource = match &held_rows {
        Some(rows) => rows,
        None => &no_rows,
    };
    // Rank 0 alone evaluates (and reports).
    let eval = |engine: &mut dyn StepEngine| -> Result<Option<EvalReport>, String> {
        match held.is_empty() || launch.rank > 0 {
            true => Ok(None),
            false => engine.evaluate(held, config.anchors, gamma, config.seed).map(Some).map_err(err),
        }
    };
    let with_tau = config.tau_prompts > 0 && !prompts.is_empty() && launch.rank == 0;
    // The real tau: the reference decoders with the reference step, else the step's own cached
    // decoders (on its first GPU in bf16, or the CPU twins in f32), built before the first step.
    let context = tau_context(&prompts, config.tau_tokens);
    let tau_started = Instant::now();
    if with_tau && config.step != StepKind::Reference {
        println!("real tau: loading the target again for its cached decoders ({} held-out prompts) ...", prompts.len());
    }
    let cached = match (with_tau, config.step) {
        (false, _) | (true, StepKind::Reference) => None,
        (true, StepKind::Host) => {
            let host = |_| Ok(Host::<f32>::default());
            Some(cached_decoders(host, (&setup.target_dir, t), d, context, DType::F32)?)
        }
        (true, StepKind::Gpu) => {
            let gpu = crate::gpu_conformance::open_gpu_at(launch.topology(&config).1[0])?;
            let make = |head_dim| Cuda::new(&gpu, head_dim);
            let decoders = cached_decoders(make, (&setup.target_dir, t), d, context, DType::BF16).map_err(|e| {
                format!("option `tau_prompts`: the real tau's decoders (a second, bf16 copy of the target beside the step) cannot be made: {e}; `--tau-prompts 0` trains without them")
            })?;
            Some(decoders)
        }
    };
    let tau_decoders = match (&cached, config.step) {
        (Some(c), StepKind::Gpu) => format!("the cached decoders on {} in bf16", c.device()),
        (Some(c), _) => format!("the cached decoders on {} in f32", c.device()),
        (None, _) => "the reference decoders".to_string(),
    };
    if cached.is_some() {
        println!("real tau: {tau_decoders} ready in {:.1}s", tau_started.elapsed().as_secs_f64());
    }
    // The first evaluation lays the step out: after the decoders, so that the step's
    // checkpointing policy is chosen in the memory they leave.
    let eval_before = eval(engine.as_mut())?;
    let cached = cached.map(std::cell::RefCell::new);
    let parted = std::cell::Cell::new(0usize);
    // The target's answers end at its end-of-turn ids, as served.
    let stop: &[u32] = &setup.tokenizer.end_ids;
    let measure_tau = |drafter: &Drafter| match &cached {
        Some(decoder) => {
            let (tau, parts) = cached_tau(&mut **decoder.borrow_mut(), drafter, &prompts, config.tau_tokens, stop)?;
            parted.set(parted.get() + parts);
            Ok(tau)
        }
        None => {
            let target = reference_target.as_ref().expect("loaded for the reference step's tau");
            mean_tau(target.as_ref(), drafter, &prompts, config.tau_tokens, stop)
        }
    };
    let tau: Option<TauProbe> = with_tau.then_some(&measure_tau);
    let tau_before = tau.map(|t| t(engine.drafter()?)).transpose().map_err(err)?;
    let devices = devices(&config, launch);
    let inputs = RunInputs {
        config: &config,
        draft_config: d,
        data: &train_rows,
        held_out: held,
        tau,
        quiet: false,
        devices,
        read_ahead: config.step == StepKind::Gpu,
        processes: launch.world_size,
    };
    let summary = train_loop(inputs, engine.as_mut(), launch, &resume, resume_notes)?;
    if launch.rank > 0 {
        return follower_end(launch, &summary, started);
    }
    // The loop's evaluation after the last step when it made one (the same evaluator and probe).
    let (eval_after, tau_after) = match summary.final_eval.clone() {
        Some((report, tau_after)) => (Some(report), tau_after),
        None => (eval(engine.as_mut())?, tau.map(|t| t(engine.drafter()?)).transpose().map_err(err)?),
    };
    let held_summary = eval_before.as_ref().zip(eval_after.as_ref()).map(|(b, a)| (held.len(), b, a));
    let (final_dir, svg) = report_end(&config, d, engine.as_mut(), &summary, held_summary)?;
    if let (Some(before), Some(after)) = (tau_before, tau_after) {
        let identical = match parted.get() {
            0 => "output identical to plain greedy decoding".to_string(),
            n => format!("{n} decodes parted from plain greedy decoding at a near-tie (bf16)"),
        };
        println!(
            "tau (greedy speculative decoding, {} held-out prompts x {} tokens, block {}, {tau_decoders}): {before:.2} before -> {after:.2} after; {identical}",
            prompts.len(),
            config.tau_tokens,
            d.block_size
        );
    }
    report_files(&config, &summary, &final_dir, &svg, started);
    Ok(())
}

/// The `gpu` step's GPUs exist (unless only planning): checked before the data is read or
/// anything is loaded.
fn gpus_present(config: &RunConfig, launch: &Launch, plan: bool) -> dflash_trainer::Result<()> {
    if config.step != StepKind::Gpu || plan {
        return Ok(());
    }
    let (targets, drafters) = launch.topology(config);
    crate::gpu_conformance::check_gpus("step", &[targets, drafters].concat())
}

/// Makes drafter worker `k`'s engine on its GPU, in the worker's thread.
type GpuEngine = dyn Fn(usize, Gpu) -> dflash_trainer::Result<DeviceEngine<Cuda>> + Send + Sync;
/// Makes drafter worker `k`'s engine on the CPU twins, in the worker's thread.
type HostEngine = dyn Fn(usize) -> dflash_trainer::Result<DeviceEngine<Host<f32>>> + Send + Sync;
/// Each drafter worker's end of the feed, taken once by the worker that owns it.
type FeedEnds = std::sync::Mutex<Vec<Option<FeedEnd>>>;

/// Data-parallel drafter workers on `gpus` (one each), their gradients summed through NCCL
/// (one rank per worker, even alone: the same path at every count). With several processes,
/// one communicator over every process's workers (NCCL rank `rank * local + k`), its id made by
/// rank 0 and sent through the process group. (That path needs GPUs on several processes: it is
/// not tested here.)
fn gpu_workers(
    gpus: &[usize],
    d: &DraftConfig,
    engine: Arc<GpuEngine>,
    processes: Option<&Arc<ProcessGroup>>,
    shard: bool,
) -> Result<DataParallel, String> {
    let local = gpus.len();
    let (id, first, world) = match processes {
        None => (nccl::unique_id().map_err(|e| e.to_string())?, 0, local),
        Some(g) => (g.share_nccl_id().map_err(|e| e.to_string())?, g.rank() * local, g.world() * local),
    };
    let listed = gpus.to_vec();
    let make: Arc<MakeReplica> = Arc::new(move |k| {
        let gpus = &listed;
        let gpu =
            Gpu::open(gpus[k])?.ok_or_else(|| dflash_trainer::Error::option("gpus", format!("no GPU {}", gpus[k])))?;
        let rank = Rank::join(&gpu, first + k, world, &id)?;
        Ok(Box::new(sharded(engine(k, gpu)?.with_reduce(Box::new(rank)), shard, k, local)) as Box<dyn Replica>)
    });
    let workers = start_workers(local, d, make, processes)?;
    println!("drafter workers on GPUs {gpus:?}, gradients all-reduced through NCCL");
    Ok(if shard { workers.with_sharded_optimizer() } else { workers })
}

/// `count` data-parallel drafter workers on the CPU twins, their gradients summed through the
/// in-process group (NCCL's twin), and across the processes through their group when several.
fn host_workers(
    count: usize,
    d: &DraftConfig,
    engine: Arc<HostEngine>,
    processes: Option<&Arc<ProcessGroup>>,
    shard: bool,
) -> Result<DataParallel, String> {
    type Ranks = Vec<Box<dyn GradReduce + Send>>;
    let ranks: Ranks = match processes {
        None => HostGroup::ranks(count).into_iter().map(|r| Box::new(r) as _).collect(),
        Some(g) => group::worker_ranks(g, count).into_iter().map(|r| Box::new(r) as _).collect(),
    };
    let ranks = std::sync::Mutex::new(ranks.into_iter().map(Some).collect::<Vec<_>>());
    let make: Arc<MakeReplica> = Arc::new(move |k| {
        let rank = ranks.lock().ok().and_then(|mut r| r[k].take());
        let rank =
            rank.ok_or_else(|| dflash_trainer::Error::option("drafter_workers", format!("worker {k} made twice")))?;
        Ok(Box::new(sharded(engine(k)?.with_reduce(rank), shard, k, count)) as Box<dyn Replica>)
    });
    let workers = start_workers(count, d, make, processes)?;
    Ok(if shard { workers.with_sharded_optimizer() } else { workers })
}

/// The optimizer state per drafter worker when sharded over `workers` (the largest shard's),
/// against the whole state the plan above counts.
fn print_sharded_optimizer(d: &DraftConfig, shape: StepShape, workers: usize) -> Result<(), String> {
    use dflash_optimized::memory::{Lifetime, BF16, F32};
    let optimizer = |shard: (usize, usize)| -> Result<u64, String> {
        use dflash_optimized::memory::step::{OptimizerShape, StepLayout};
        let l = StepLayout::with_head(
            d,
            shape,
            Checkpointing::PerLayer,
            Some(OptimizerShape { shard, ..OptimizerShape::whole(0, true) }),
            (BF16, F32),
            true,
        )
        .map_err(|e| e.to_string())?;
        Ok(l.items.iter().filter(|i| i.lifetime == Lifetime::Optimizer).map(|i| i.bytes).sum())
    };
    let shards = dflash_trainer::engine::optimizer_shards(d, workers);
    let whole = optimizer((0, shards.last().map_or(0, |s| s.1)))?;
    let largest = optimizer(shards[0])?;
    println!(
        "optimizer state sharded over {workers} drafter workers: {} per worker instead of {} (the accumulated gradients stay whole)",
        metrics::size_text(largest),
        metrics::size_text(whole)
    );
    Ok(())
}

/// `engine` holding worker `k`'s shard of the optimizer state over `workers`, when `shard`.
fn sharded<B: dflash_optimized::backend::Backend>(
    engine: DeviceEngine<B>,
    shard: bool,
    k: usize,
    workers: usize,
) -> DeviceEngine<B> {
    match shard {
        true => engine.with_sharded_optimizer(k, workers),
        false => engine,
    }
}

/// `count` drafter workers made by `make`: this process's part of the processes' run when several.
fn start_workers(
    count: usize,
    d: &DraftConfig,
    make: Arc<MakeReplica>,
    processes: Option<&Arc<ProcessGroup>>,
) -> Result<DataParallel, String> {
    match processes {
        None => DataParallel::new(count, d.clone(), make),
        Some(g) => DataParallel::joined(count, d.clone(), make, g.clone()),
    }
    .map_err(|e| e.to_string())
}

/// Target workers on the devices of `targets` feeding drafter workers on the devices of
/// `drafters` through `fill` (none without target workers), and the drafter workers' ends.
fn feed(
    (targets, drafters): (&[usize], &[usize]),
    fill: Arc<MakeSlotFill>,
) -> Result<(Option<FeedPool>, Arc<FeedEnds>), String> {
    if targets.is_empty() {
        return Ok((None, Arc::new(std::sync::Mutex::new(Vec::new()))));
    }
    let (pool, ends) = FeedPool::new(targets, drafters, fill).map_err(|e| e.to_string())?;
    let how = match ends.iter().filter(|e| e.copies()).count() {
        0 => "features copied on their GPU".to_string(),
        n => format!("features copied peer to peer to {n} of them, from target workers on other GPUs"),
    };
    println!("{} target workers feeding {} drafter workers ({how})", targets.len(), drafters.len());
    Ok((Some(pool), Arc::new(std::sync::Mutex::new(ends.into_iter().map(Some).collect()))))
}

/// `engine` with drafter worker `k`'s end of the feed, when fed.
fn fed<B: dflash_optimized::backend::Backend>(engine: DeviceEngine<B>, ends: &FeedEnds, k: usize) -> DeviceEngine<B> {
    match ends.lock().ok().and_then(|mut e| e.get_mut(k).and_then(Option::take)) {
        Some(end) => engine.with_feed(end),
        None => engine,
    }
}

/// Model FLOPs of one real row at `S` (the target's forward over one document of `S` tokens, the
/// drafter's step with every block row weighted and every context key allowed: an upper bound).
fn real_flops_per_row(c: &RunConfig, setup: &RealSetup) -> f64 {
    let d = &setup.draft_config;
    let layers = d.target_layer_ids.iter().max().map_or(0, |&l| l + 1);
    let target = match setup.cache {
        Some(_) => 0.0,
        None => match &setup.target_config {
            TargetKind::Dense(t) => dflash_optimized::flops::target_forward_flops(t, layers, c.max_len, false),
            TargetKind::Hybrid(t) => dflash_optimized::flops::hybrid_forward_flops(t, layers, c.max_len),
        },
    };
    let q = c.anchors * d.block_size;
    let shape = StepShape { context_len: c.max_len, num_anchors: c.anchors, lm_chunk_rows: 1 };
    let pairs = vec![(q * (c.max_len + q)) as u64 / 2; d.dims.num_layers()];
    target + dflash_optimized::flops::step_model_flops(d, shape, q, &pairs)
}

/// The command line of `train`.
struct Cli {
    config: Option<PathBuf>,
    resume: Option<PathBuf>,
    plan: bool,
    overwrite: bool,
    overrides: Vec<(String, String)>,
}

impl Cli {
    /// `Ok(None)` for `--help`.
    fn parse(args: Vec<String>) -> Result<Option<Self>, String> {
        let mut cli = Cli { config: None, resume: None, plan: false, overwrite: false, overrides: Vec::new() };
        let mut it = args.into_iter().peekable();
        while let Some(arg) = it.next() {
            if arg == "--help" || arg == "-h" {
                return Ok(None);
            }
            let name = arg.strip_prefix("--").ok_or_else(|| format!("unexpected argument `{arg}`"))?.to_string();
            if name == "plan" || name == "overwrite" {
                match name.as_str() {
                    "plan" => cli.plan = true,
                    _ => cli.overwrite = true,
                }
                continue;
            }
            let is_option = FIELDS.iter().any(|(f, _, _)| *f == name.replace('-', "_"));
            if !is_option && !["config", "resume"].contains(&name.as_str()) {
                return Err(format!(
                    "unknown option `--{name}` (known: --config, --plan, --resume, --overwrite, {})",
                    known_flags().join(", ")
                ));
            }
            let mut value =
                it.next_if(|v| !v.starts_with("--")).ok_or_else(|| format!("option `--{name}` needs a value"))?;
            // Each option once (`--max-len` and `--max_len` are one), but `--data`, which adds files.
            let key = name.replace('-', "_");
            let given = match key.as_str() {
                "config" => cli.config.is_some(),
                "resume" => cli.resume.is_some(),
                "data" => false,
                _ => cli.overrides.iter().any(|(k, _)| k.replace('-', "_") == key),
            };
            if given {
                return Err(format!("option `--{name}` given twice"));
            }
            match name.as_str() {
                "config" => cli.config = Some(PathBuf::from(value)),
                "resume" => cli.resume = Some(PathBuf::from(value)),
                "data" => {
                    while let Some(more) = it.next_if(|a| !a.starts_with("--")) {
                        value = format!("{value}\n{more}");
                    }
                    // `--data A --data B` is `--data A B`, as for `data` and `features`.
                    match cli.overrides.iter_mut().find(|(k, _)| k == "data") {
                        Some((_, earlier)) => *earlier = format!("{earlier}\n{value}"),
                        None => cli.overrides.push((name, value)),
                    }
                }
                _ => cli.overrides.push((name, value)),
            }
        }
        Ok(Some(cli))
    }

    /// Whether the run is a real one (the recipe's preset): `--target` on the command line or
    /// `target` in the config file.
    fn real_preset(&self) -> Result<bool, String> {
        if self.overrides.iter().any(|(k, _)| k == "target") {
            return Ok(true);
        }
        let Some(file) = &self.config else { return Ok(false) };
        let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
        let table: toml::Table = toml::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))?;
        Ok(table.contains_key("target"))
    }

    /// The options given on the command line (`_` spelt; a config file's are not: a
    /// checkpoint's `run.toml` holds every option, those of the other kind of run at their
    /// defaults).
    fn given(&self) -> Vec<String> {
        self.overrides.iter().map(|(k, _)| k.replace('-', "_")).collect()
    }
}

/// Bytes per value (stored, arithmetic) of a step of `step`'s kind: bf16 and fp32 on the GPU,
/// f32 on the CPU twins.
pub(crate) fn storage_widths(step: StepKind) -> (u64, u64) {
    match step {
        StepKind::Gpu => (2, 4),
        _ => (4, 4),
    }
}

/// The device memory of the target's feature forward (dense or hybrid) for launches of `tokens`
/// tokens tapping `ids`, of values of `widths` (a dense forward holds the LM head only
/// `with_lm_head`; a hybrid's always holds it).
pub(crate) fn forward_bytes(
    t: &TargetKind,
    ids: &[usize],
    tokens: usize,
    widths: (u64, u64),
    with_lm_head: bool,
) -> Result<u64, String> {
    use dflash_optimized::memory::{hybrid::HybridTargetPlan, target::TargetLayout};
    match t {
        TargetKind::Dense(t) => {
            TargetLayout::new(t, ids, tokens, widths, with_lm_head, true).and_then(|l| l.total_bytes())
        }
        TargetKind::Hybrid(t) => HybridTargetPlan::new(t, ids, tokens, widths).map(|p| p.bytes),
    }
    .map_err(|e| e.to_string())
}

/// Refuses, before the target is loaded or anything allocated, a run whose least memory on one
/// of its devices exceeds what that device has free. Each worker counts on its device: a drafter
/// worker its step under its most frugal policy (its optimizer shard when sharded) and the
/// target's forward (online, unfed) or the embedding table (offline, or fed by target workers);
/// a target worker its forward without the LM head and its feature slots; rank 0's first drafter
/// worker also the real tau's decoders. A host step's workers all count in this machine's
/// memory, with the tables read from the target (f32) that its offline or fed workers share. A lower bound of what the engines then lay out (each picks the fastest policy that
/// fits).
fn check_fits(
    config: &RunConfig,
    launch: &Launch,
    setup: &RealSetup,
    shape: StepShape,
    tau_context: Option<usize>,
) -> Result<(), String> {
    use dflash_optimized::memory::step::{optimizer_shard, OptimizerShape, StepDims, StepLayout};
    if config.step == StepKind::Reference {
        return Ok(());
    }
    let err = |e: dflash_optimized::Error| e.to_string();
    let (t, d) = (&setup.target_config, &setup.draft_config);
    let widths = storage_widths(config.step);
    let online = setup.cache.is_none();
    let fed = online && config.target_workers > 0;
    let (s, ids) = (shape.context_len, &d.target_layer_ids);
    let (fixed_name, fixed) = match online && !fed {
        true => ("the target's forward", forward_bytes(t, ids, s, widths, true)?),
        false => ("the embedding table", dflash_optimized::memory::table_bytes(&d.dims, widths.0)),
    };
    let policy = *config.checkpointing.policies().last().expect("a policy");
    let accumulate = config.accumulates_gradients(launch.world_size);
    let params = StepDims::new(d, shape).map_err(err)?.params;
    let shards = if config.shard_optimizer { config.drafter_workers.max(1) } else { 1 };
    let optimizer = OptimizerShape { shard: optimizer_shard(params, 0, shards), accumulate };
    let step =
        StepLayout::with_head(d, shape, policy, Some(optimizer), widths, !online || fed).map_err(err)?.total_bytes();
    let decoders = match tau_context.filter(|_| launch.rank == 0) {
        Some(context) => dflash_optimized::model::speculative::decoders_bytes(t, d, context, widths).map_err(err)?,
        None => 0,
    };
    let (target_gpus, drafter_gpus) = launch.topology(config);
    // A target worker's forward (no LM head) and its feature slots.
    let (worker_forward, target_worker) = match fed {
        true => {
            let forward = forward_bytes(t, ids, s, widths, false)?;
            let slot = (s as u64).saturating_mul((ids.len() * t.hidden_size()) as u64).saturating_mul(widths.0);
            let slots = dflash_trainer::dist::feed::slots_per_target(drafter_gpus.len()) as u64;
            (forward, forward.saturating_add(slot.saturating_mul(slots)))
        }
        false => (0, 0),
    };
    // What each device holds; the host step's devices are one memory.
    let host = config.step == StepKind::Host;
    let mut devices: Vec<DeviceHold> = Vec::new();
    let mut hold = |device: usize, what: Held, name: String, bytes: u64| {
        let device = if host { 0 } else { device };
        let at = match devices.iter().position(|d| d.device == device) {
            Some(at) => at,
            None => {
                devices.push(DeviceHold { device, items: Vec::new(), kinds: Vec::new() });
                devices.len() - 1
            }
        };
        let d = &mut devices[at];
        d.items.push((name, bytes));
        d.kinds.push(what);
    };
    for (k, &g) in drafter_gpus.iter().enumerate() {
        hold(g, Held::DrafterFixed, format!("drafter worker {k}: {fixed_name}"), fixed);
        let name = format!("drafter worker {k}: the step under its most frugal policy ({})", policy.name());
        hold(g, Held::DrafterStep, name, step);
        if k == 0 && decoders > 0 {
            hold(g, Held::Decoders, "the real tau's decoders".to_string(), decoders);
        }
    }
    if fed {
        for (k, &g) in target_gpus.iter().enumerate() {
            let name = format!("target worker {k}: the target's forward and its feature slots");
            hold(g, Held::TargetWorker, name, target_worker);
        }
    }
    // The host step's workers share the tables read from the target (f32) beside their steps.
    if host && (!online || fed) {
        let tables = dflash_optimized::memory::table_bytes(&d.dims, 4);
        let copies = if t.tie_word_embeddings() { 1 } else { 2 };
        hold(0, Held::Tables, "the tables read from the target (f32)".to_string(), tables.saturating_mul(copies));
    }
    // On a GPU, room for what no plan item holds (cuBLAS's workspaces, NCCL's buffers, the
    // driver's rounding), as the policy choice leaves it.
    let headroom = if config.step == StepKind::Gpu { dflash_optimized::memory::step::POLICY_HEADROOM } else { 0 };
    let size = metrics::size_text;
    for d in devices {
        let need = d.items.iter().fold(headroom, |a, i| a.saturating_add(i.1));
        let (name, free) = match host {
            false => {
                let gpu = crate::gpu_conformance::open_gpu_at(d.device)?;
                (format!("GPU {} ({})", d.device, gpu.name()), gpu.available_bytes().map_err(err)?)
            }
            true => {
                ("the CPU".to_string(), dflash_optimized::backend::host::host_available_bytes().unwrap_or(u64::MAX))
            }
        };
        if need <= free {
            continue;
        }
        // A forward that alone cannot fit: the online step's own, or a target worker's.
        let forward = match (online && !fed, d.kinds.contains(&Held::TargetWorker)) {
            (true, _) => Some((fixed, "or target workers on GPUs of their own (`--target-workers`, `--gpus`)")),
            (false, true) if !host => {
                Some((worker_forward, "or a GPU of more memory for each target worker (`--gpus`)"))
            }
            (false, true) => Some((worker_forward, "")),
            (false, false) => None,
        };
        if let Some((forward, or)) = forward.filter(|f| f.0 > free) {
            return Err(format!(
                "memory: the target's forward alone needs {} on {name}, which has {} free: its features cached offline first (`cargo xtask features`, then `--features CACHE`){}",
                size(forward),
                size(free),
                if or.is_empty() { String::new() } else { format!(", {or}") }
            ));
        }
        let has = |kind: Held| d.kinds.contains(&kind);
        let mut hints = vec!["lower --max-len"];
        if has(Held::DrafterStep) {
            hints.push("or --anchors");
            if policy != Checkpointing::PerLayer {
                hints.push("or --checkpointing per-layer");
            }
        }
        if has(Held::Decoders) {
            hints.push("or --tau-prompts 0");
        }
        // A worker: a drafter's fixed part (one per drafter worker) or a target worker.
        let workers = d.kinds.iter().filter(|k| matches!(k, Held::DrafterFixed | Held::TargetWorker)).count();
        if !host && workers > 1 {
            hints.push("or fewer workers on it (`--gpus`)");
        }
        let listed: Vec<String> = d.items.iter().map(|(what, bytes)| format!("{what} {}", size(*bytes))).collect();
        return Err(format!(
            "memory: the run needs at least {} on {name}, which has {} free: {}{}; {}",
            size(need),
            size(free),
            listed.join(", "),
            if headroom > 0 {
                format!(", {} to spare for cuBLAS, NCCL and the driver", size(headroom))
            } else {
                String::new()
            },
            hints.join(", "),
        ));
    }
    Ok(())
}

/// What [`check_fits`] counts on a device.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Held {
    /// A drafter worker's target forward or embedding table (one per drafter worker).
    DrafterFixed,
    DrafterStep,
    Decoders,
    /// A target worker's forward and feature slots.
    TargetWorker,
    /// The host step's frozen tables, shared by its workers.
    Tables,
}

/// One device's share of a run in [`check_fits`]: its items `(what, bytes)` and their kinds.
struct DeviceHold {
    device: usize,
    items: Vec<(String, u64)>,
    kinds: Vec<Held>,
}

/// The GPUs a run's model FLOPs run on, for the MFU: every process's distinct GPUs with the
/// `gpu` step, none otherwise.
fn devices(config: &RunConfig, launch: &Launch) -> usize {
    let (targets, drafters) = config.topology();
    let gpus: std::collections::BTreeSet<usize> = targets.into_iter().chain(drafters).collect();
    match config.step {
        StepKind::Gpu => gpus.len().max(1) * launch.world_size,
        // The CPU's steps have no MFU (its peak is the H200's).
        _ => 0,
    }
}

/// The positions the real tau's decoders hold: the longest prompt and `new_tokens` after it.
fn tau_context(prompts: &[Vec<u32>], new_tokens: usize) -> usize {
    prompts.iter().map(Vec::len).max().unwrap_or(0).saturating_add(new_tokens)
}

/// The tau of `drafter` over `prompts` (up to `new_tokens` each, ending after an id of `stop`)
/// with the cached decoders (its weights loaded first), the mean of `A + 1` over all verify steps
/// as `mean_tau`; and how many speculative decodes parted from plain greedy decoding (none in
/// exact arithmetic; in bf16 a verify step and a plain step may round a near-tie apart).
fn cached_tau(
    decoder: &mut dyn CachedDecoder,
    drafter: &Drafter,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    stop: &[u32],
) -> dflash_trainer::Result<(f64, usize)> {
    decoder.load_drafter(&|name, _| Ok(drafter.param(name).clone()))?;
    let (mut acceptance, mut parted) = (Acceptance::new(drafter.config.block_size), 0);
    for prompt in prompts {
        let spec = decoder.speculative_until(prompt, new_tokens, &Sampling::Greedy, stop)?;
        parted += usize::from(spec.tokens != decoder.plain_until(prompt, new_tokens, &Sampling::Greedy, stop)?.0);
        acceptance.add(&spec);
    }
    Ok((acceptance.tau_over_steps(), parted))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_conformance::decode_cases::{builtin_pair, hybrid_pairs, random_prompt};
    use rand::{Rng, SeedableRng};

    /// The real tau a run measures with the step's cached decoders (here on the f64 twins) is
    /// exactly the reference decoders' (`mean_tau`) on the same target folder, drafter and
    /// prompts, with no decode parting from plain greedy decoding: for the trained built-in pair
    /// (drafts accepted several at a time) and a hybrid target.
    #[test]
    fn the_cached_tau_is_the_reference_tau() {
        let check = |save: &dyn Fn(&Path), drafter: &Drafter| -> f64 {
            let dir = tempfile::tempdir().unwrap();
            save(dir.path());
            let kind = TargetKind::from_file(&dir.path().join("config.json")).unwrap();
            let target = kind.load_model(dir.path(), DType::F64).unwrap();
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
            let mask = drafter.config.mask_token_id as usize;
            let prompts: Vec<Vec<u32>> = (0..3).map(|_| random_prompt(16, mask + 1, &mut rng)).collect();
            let host = |_| Ok(Host::<f64>::default());
            let mut decoders = cached_decoders(host, (dir.path(), &kind), &drafter.config, 40, DType::F64).unwrap();
            let (tau, parted) = cached_tau(&mut *decoders, drafter, &prompts, 24, &[]).unwrap();
            let want = mean_tau(target.as_ref(), drafter, &prompts, 24, &[]).unwrap();
            assert_eq!((tau, parted), (want, 0));
            // Spec section 4's tau: A + 1 (`accept_lengths`) summed over every verify step of every prompt, over the
            // steps' count (not the mean of the prompts' taus).
            let outs: Vec<_> = prompts
                .iter()
                .map(|p| dflash_reference::speculative::speculative_decode(target.as_ref(), drafter, p, 24).unwrap())
                .collect();
            let accepted: usize = outs.iter().flat_map(|o| o.accept_lengths.iter()).sum();
            let steps: usize = outs.iter().map(|o| o.accept_lengths.len()).sum();
            assert_eq!(tau, accepted as f64 / steps as f64);
            // Ending at a stop id (one the first decode emits, so the cut happens): the same.
            let stop = [outs[0].tokens[rng.random_range(1..outs[0].tokens.len())]];
            let (stopped, parted) = cached_tau(&mut *decoders, drafter, &prompts, 24, &stop).unwrap();
            assert_eq!((stopped, parted), (mean_tau(target.as_ref(), drafter, &prompts, 24, &stop).unwrap(), 0));
            tau
        };
        let dense = builtin_pair(DType::F64);
        let tau = check(&|dir| dense.target.save(dir).unwrap(), &dense.drafter);
        assert!(tau > 1.5, "the trained pair's tau {tau}: the multi-token path barely ran");
        let hybrid = hybrid_pairs(1, 4, DType::F64).remove(0);
        check(&|dir| hybrid.target.save(dir).unwrap(), &hybrid.drafter);
    }
}
