//! The run loop: the data order, the anchors' RNG, the schedule, a [`StepEngine`] per step,
//! non-finite steps skipped and counted, metrics, evaluation and checkpoints; exact resumption
//! from a checkpoint.
//!
//! The data order and the anchors come from one ChaCha8 generator seeded by `seed`, used as
//! the reference loop (`dflash_reference::train::train_with`) uses it: when an epoch's order is
//! used up it is shuffled in place, then each row of a step draws its anchors. A checkpoint
//! stores the permutation, the cursor and the generator's exact position, so a resumed run
//! draws the same rows and anchors as an uninterrupted one.

use std::path::PathBuf;

use dflash_reference::config::DraftConfig;
use dflash_reference::optim::lr_at;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::checkpoint::{self, sha256_hex, Found, RngState, TrainState};
use crate::config::RunConfig;
use crate::engine::{StepBatch, StepEngine};
use crate::error::{Error, Result};
use crate::metrics::{self, Reporter};
use crate::rows::{ReadAhead, RowSource};

/// Where the loop is: the next step, the data order and the generator, the non-finite counters.
#[derive(Clone, Debug)]
pub struct LoopState {
    pub step: usize,
    pub epoch: usize,
    pub cursor: usize,
    pub order: Vec<usize>,
    pub rng: ChaCha8Rng,
    pub nonfinite_in_a_row: usize,
    pub nonfinite_total: usize,
}

impl LoopState {
    /// The start of a run over `rows` training rows.
    pub fn new(rows: usize, seed: u64) -> Self {
        LoopState {
            step: 0,
            epoch: 0,
            cursor: rows,
            order: (0..rows).collect(),
            rng: ChaCha8Rng::seed_from_u64(seed),
            nonfinite_in_a_row: 0,
            nonfinite_total: 0,
        }
    }

    /// The next `n` row ids, shuffling the order when an epoch is used up.
    pub fn next_rows(&mut self, n: usize) -> Vec<usize> {
        let mut ids = Vec::with_capacity(n);
        while ids.len() < n {
            if self.cursor == self.order.len() {
                self.order.shuffle(&mut self.rng);
                self.cursor = 0;
                self.epoch += 1;
            }
            ids.push(self.order[self.cursor]);
            self.cursor += 1;
        }
        ids
    }

    /// The ids of the next `steps` x `n` rows [`LoopState::next_rows`] will give, when the
    /// current order holds them (no shuffle, so no draw from the generator, comes before them).
    pub fn peek_rows(&self, steps: usize, n: usize) -> Option<Vec<Vec<usize>>> {
        let end = self.cursor.checked_add(steps.checked_mul(n)?)?;
        let ahead = self.order.get(self.cursor..end)?;
        Some(ahead.chunks(n.max(1)).map(<[usize]>::to_vec).collect())
    }

    fn to_state(&self, adam_t: i32, (config_sha256, data_sha256): (String, String), processes: usize) -> TrainState {
        TrainState {
            format: checkpoint::FORMAT,
            step: self.step,
            adam_t,
            epoch: self.epoch,
            cursor: self.cursor,
            order: self.order.clone(),
            rng: RngState::of(&self.rng),
            nonfinite_in_a_row: self.nonfinite_in_a_row,
            nonfinite_total: self.nonfinite_total,
            config_sha256,
            data_sha256,
            files: Default::default(),
            processes: Some(processes),
        }
    }
}

/// Measures a drafter's real tau (speculative decoding on held-out prompts).
pub type TauProbe<'a> = &'a dyn Fn(&dflash_reference::drafter::Drafter) -> Result<f64>;

/// What a run trains on and with.
pub struct RunInputs<'a> {
    /// The resolved config ([`RunConfig::resolved`]).
    pub config: &'a RunConfig,
    pub draft_config: &'a DraftConfig,
    pub data: &'a dyn RowSource,
    pub held_out: &'a dyn RowSource,
    /// The real tau of a drafter (speculative decoding on held-out prompts), measured at each
    /// evaluation when given.
    pub tau: Option<TauProbe<'a>>,
    /// Print nothing (tests); metrics.jsonl is written all the same.
    pub quiet: bool,
    /// The GPUs the step's model FLOPs ran on (every process's), for the MFU; 0 for a CPU
    /// engine (no MFU: the peak is the H200's).
    pub devices: usize,
    /// Read the next step's rows on another thread while a step runs: for the GPU step, which
    /// leaves the host's cores idle (a CPU engine's step uses them all; reading ahead slowed a
    /// real CPU run by 13%).
    pub read_ahead: bool,
    /// The run's processes (the launch's world size: from options or torchrun's variables),
    /// which its checkpoints keep.
    pub processes: usize,
}

/// The options whose change forbids resuming `saved` with `current`, as an error naming the
/// first; otherwise notes on the allowed changes.
pub fn check_resume_config(current: &RunConfig, saved: &RunConfig) -> Result<Vec<String>> {
    let mut notes = Vec::new();
    for (name, now, then, allowed) in current.differences(saved) {
        if !allowed {
            return Err(Error::option(
                name,
                format!("{now} differs from the checkpoint's {then}: resuming would change the run (start a new run in another --out)"),
            ));
        }
        let regrouped = match name.as_str() {
            // The step's rows are summed in other groups.
            "drafter_workers" => ": the next losses equal the uninterrupted run's within f32 rounding, not bitwise",
            _ => "",
        };
        notes.push(format!("`{name}` changed from {then} to {now}{regrouped}"));
    }
    Ok(notes)
}

/// Which run a fresh run may replace in its `--out` (one with nothing to resume in any case).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replace {
    /// None: the folder must hold no run.
    Never,
    /// A finished run of the built-in default (the built-in default replaces its own), not a
    /// real one (its drafter is not lost to a forgotten `--target`); `own_drafter`: the
    /// folder's `drafter/` is one of this built-in default's (its config), so a lone one is its.
    BuiltIn { own_drafter: bool },
    /// Any finished run (`--overwrite`).
    Any,
}

/// Takes the run folder `out`'s lock for the rest of this process ([`dflash_data::lock`]), so
/// that two runs never write one folder at once (a run resumed while the one before still runs).
pub fn lock_out(out: &std::path::Path) -> Result<()> {
    dflash_data::lock::lock_folder(out, "out").map_err(|e| match e {
        dflash_data::Error::Option { message, .. } => {
            Error::option("out", format!("{message}, or choose another --out"))
        }
        other => Error::option("out", other.to_string()),
    })
}

/// Whether `out` may take a fresh run, without touching it: `Ok(None)` when it holds no run,
/// `Ok(Some(what))` when it holds a run that `replace` allows replacing: a finished run, or the
/// remains of one with no complete checkpoint (nothing there can be resumed). A folder holding an
/// unfinished run with a complete checkpoint is refused (`--resume` continues it), so no
/// unfinished run is ever lost; the others are refused unless `replace` allows them. A final
/// drafter (`drafter/`) with no complete checkpoint of the run that made it (its checkpoints
/// deleted to free the disk) is replaced only with [`Replace::Any`].
pub fn check_fresh_out(out: &std::path::Path, replace: Replace) -> Result<Option<String>> {
    let checkpoints = checkpoint::list_checkpoints(out)?;
    let drafter = out.join("drafter").join("config.json").is_file();
    if !out.join("latest").exists() && checkpoints.is_empty() && !drafter {
        return Ok(None);
    }
    checkpoint::check_latest(out)?;
    let (held, real) = match checkpoint::find_resumable(out) {
        // A drafter whose run is not known: kept, as a real run's, unless it is the built-in's.
        Err(_) if drafter && replace != (Replace::BuiltIn { own_drafter: true }) => {
            (format!("a drafter ({}) with no complete checkpoint", out.join("drafter").display()), true)
        }
        Err(e) => (format!("the remains of a run with no complete checkpoint ({e})"), false),
        Ok(found) => {
            let saved = checkpoint::load_config(&found.dir)?;
            let total = saved.steps.unwrap_or(usize::MAX);
            if found.state.step < total {
                return Err(Error::option(
                    "out",
                    format!(
                        "{} holds an unfinished run (its newest complete checkpoint is at step {} of {total}): \
                         `--resume {}` continues it, or choose another --out",
                        out.display(),
                        found.state.step,
                        out.display()
                    ),
                ));
            }
            match &saved.target {
                Some(target) => (format!("a finished run of {total} steps of the target {}", target.display()), true),
                None => (format!("a finished run of {total} steps"), false),
            }
        }
    };
    match (replace, real) {
        (Replace::Any, _) | (Replace::BuiltIn { .. }, false) => Ok(Some(held)),
        (Replace::BuiltIn { .. }, true) => Err(Error::option(
            "out",
            format!(
                "{} holds {held}: the built-in default replaces only its own runs (`--target` for a real run, `--overwrite` to replace it anyway, or another --out)",
                out.display()
            ),
        )),
        (Replace::Never, _) => Err(Error::option(
            "out",
            format!("{} holds {held}: `--overwrite` replaces it, or choose another --out", out.display()),
        )),
    }
}

/// Makes `out` ready for a fresh run ([`check_fresh_out`] first): a run there that may be
/// replaced is cleared of its files (checkpoints, `latest`, `metrics.jsonl`, `training.svg`,
/// `drafter/`), and a note says so.
pub fn prepare_fresh_out(out: &std::path::Path, replace: Replace) -> Result<Vec<String>> {
    let Some(held) = check_fresh_out(out, replace)? else {
        // A run killed while writing its first checkpoint left only that temporary (the run
        // lock says no live run is writing it).
        for tmp in checkpoint::leftover_temporaries(out) {
            std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
        }
        return Ok(Vec::new());
    };
    // Oldest first: killed midway, the folder still holds the run's newest checkpoint (a run
    // that may be replaced), never an older one alone (an unfinished run, refused).
    let mut checkpoints = checkpoint::list_checkpoints(out)?;
    checkpoints.sort_by_key(|c| c.0);
    for (_, dir) in checkpoints {
        std::fs::remove_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    }
    for tmp in checkpoint::leftover_temporaries(out) {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    for file in ["latest", "metrics.jsonl", "training.svg"] {
        let path = out.join(file);
        if path.is_dir() {
            std::fs::remove_dir_all(&path).map_err(|e| Error::io(&path, e))?;
        } else if path.exists() {
            std::fs::remove_file(&path).map_err(|e| Error::io(&path, e))?;
        }
    }
    let drafter = out.join("drafter");
    if drafter.is_dir() {
        std::fs::remove_dir_all(&drafter).map_err(|e| Error::io(&drafter, e))?;
    }
    Ok(vec![format!("{} held {held}: replaced by this one", out.display())])
}

/// Whether the checkpoint `found` can continue the run of `config` over `data` (checked before
/// any target is loaded or step made): its rows hash as `data`'s, its data order is an order of
/// them and at the epoch and cursor its steps leave, and its step is within the run's steps.
pub fn check_resumable(found: &Found, data: &dyn RowSource, config: &RunConfig) -> Result<()> {
    check_resumable_rows(found, &data.sha256()?, data.len(), config)
}

/// [`check_resumable`] over `rows` rows hashing as `data_sha256`.
fn check_resumable_rows(found: &Found, data_sha256: &str, rows: usize, config: &RunConfig) -> Result<()> {
    let total_steps = config.total_steps(rows);
    let s = &found.state;
    if s.data_sha256 != data_sha256 {
        return Err(Error::checkpoint(
                &found.dir,
                format!(
                    "its training rows (sha256 {}) are not this run's ({}): the data files' contents, their tokenization (tokenizer, template, special tokens, end-of-turn ids, options, or this trainer's data pipeline version), or the target whose features they carry (its config or weights) changed; the run cannot continue on other rows (start a new run in another --out)",
                    s.data_sha256, data_sha256
                ),
            ));
    }
    let mut seen = vec![false; rows];
    let permutation = s.order.len() == seen.len()
        && s.order.iter().all(|&i| i < seen.len() && !std::mem::replace(&mut seen[i], true));
    if !permutation || s.cursor > s.order.len() {
        return Err(Error::checkpoint(
            &found.dir,
            format!("state.json: its data order is not an order of this run's {} rows", seen.len()),
        ));
    }
    // Where `step` steps of the run's rows leave the order: a shuffle when an epoch's rows
    // are used up, so after `used` rows the epoch is ceil(used / rows), the cursor the rest.
    let (rows, used) = (seen.len(), s.step.checked_mul(config.rows_per_update()));
    let expected = used.map(|used| match used {
        0 => (0, rows),
        _ => ((used - 1) / rows + 1, (used - 1) % rows + 1),
    });
    if expected != Some((s.epoch, s.cursor)) {
        return Err(Error::checkpoint(
            &found.dir,
            format!(
                "state.json: epoch {} at row {} of its order is not where {} steps of {} rows end{}",
                s.epoch,
                s.cursor,
                s.step,
                config.rows_per_update(),
                expected.map_or(String::new(), |(e, c)| format!(" (epoch {e}, row {c})"))
            ),
        ));
    }
    if s.step > total_steps {
        return Err(Error::checkpoint(
            &found.dir,
            format!("it is at step {}, past this run's {} steps (extend with --steps)", s.step, total_steps),
        ));
    }
    Ok(())
}

/// The training loop of one run.
pub struct Trainer<'a> {
    inputs: RunInputs<'a>,
    pub state: LoopState,
    total_steps: usize,
    config_sha256: String,
    data_sha256: String,
    /// Whether this process writes the run folder and evaluates (false: a rank other than 0).
    writes: bool,
}

/// What [`Trainer::run`] did.
#[derive(Clone, Debug, Default)]
pub struct RunSummary {
    /// Steps taken by this process (a resumed run starts after its checkpoint).
    pub steps_run: usize,
    pub first_step: usize,
    pub skipped_total: usize,
    /// The checkpoints written.
    pub checkpoints: Vec<PathBuf>,
    /// Seconds inside the engine's steps, and with target workers the pipeline's waits over
    /// them (`StepOutcome::waits`, summed).
    pub step_seconds: f64,
    pub waits: Option<(f64, f64)>,
    /// The held-out evaluation (and real tau) the loop made after the last step, when it made
    /// one: the run's final figures, not measured twice.
    pub final_eval: Option<(dflash_reference::eval::EvalReport, Option<f64>)>,
}

impl<'a> Trainer<'a> {
    pub fn new(inputs: RunInputs<'a>) -> Result<Self> {
        let c = inputs.config;
        if inputs.data.is_empty() {
            return Err(Error::option("rows", "no training rows"));
        }
        let total_steps = c.total_steps(inputs.data.len());
        let data_sha256 = inputs.data.sha256()?;
        let config_sha256 = sha256_hex(c.without_launch().to_toml().as_bytes());
        let state = LoopState::new(inputs.data.len(), c.seed);
        Ok(Trainer { inputs, state, total_steps, config_sha256, data_sha256, writes: true })
    }

    /// The same steps, but nothing written under `out` (metrics, checkpoints) and no evaluation:
    /// a rank other than 0 of several processes (rank 0 writes and evaluates).
    pub fn without_writing(mut self) -> Self {
        self.writes = false;
        self
    }

    pub fn total_steps(&self) -> usize {
        self.total_steps
    }

    /// Restores `engine` and the loop from the checkpoint `found` ([`check_resumable`] first),
    /// removes leftover temporary checkpoint folders and truncates `metrics.jsonl` back to the
    /// checkpoint's step. Returns what it did, for the terminal.
    pub fn resume(&mut self, engine: &mut dyn StepEngine, found: &Found) -> Result<Vec<String>> {
        check_resumable_rows(found, &self.data_sha256, self.inputs.data.len(), self.inputs.config)?;
        let s = &found.state;
        let names: Vec<String> = engine.drafter()?.named_params().iter().map(|(n, _)| n.clone()).collect();
        let engine_state = checkpoint::load_engine_state(found, &names)?;
        engine.restore(&engine_state)?;
        let rng = s.rng.restore().map_err(|m| Error::checkpoint(&found.dir, m))?;
        self.state = LoopState {
            step: s.step,
            epoch: s.epoch,
            cursor: s.cursor,
            order: s.order.clone(),
            rng,
            nonfinite_in_a_row: s.nonfinite_in_a_row,
            nonfinite_total: s.nonfinite_total,
        };
        let out = &self.inputs.config.out;
        let mut notes = Vec::new();
        // A run extended (or shortened) on resumption: its schedule is the new length's from here.
        let saved_total = checkpoint::load_config(&found.dir)?.steps;
        if let Some(then) = saved_total.filter(|&then| then != self.total_steps) {
            let c = self.inputs.config;
            let (before, after) =
                (lr_at(s.step, then, c.lr, c.warmup_frac), lr_at(s.step, self.total_steps, c.lr, c.warmup_frac));
            notes.push(format!(
                "the schedule is now that of {} steps (was {then}): step {}'s lr {after:.3e}, {before:.3e} under the old length",
                self.total_steps, s.step
            ));
        }
        let processes = self.inputs.processes;
        if let Some(then) = s.processes.filter(|&then| then != processes) {
            notes.push(format!(
                "`world_size` changed from {then} to {processes}: the next losses equal the uninterrupted run's within f32 rounding, not bitwise"
            ));
        }
        if !self.writes {
            notes.push(format!("resumed from {} at step {}", found.dir.display(), s.step));
            return Ok(notes);
        }
        for tmp in checkpoint::leftover_temporaries(out) {
            std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
            notes.push(format!("removed {}, a checkpoint that was never completed", tmp.display()));
        }
        let dropped = metrics::truncate_to_step(&metrics::metrics_file(out), s.step)?;
        notes.push(format!(
            "resumed from {} at step {} (epoch {}, row {} of its order); metrics.jsonl cut back to it ({dropped} later lines dropped)",
            found.dir.display(),
            s.step,
            s.epoch,
            s.cursor
        ));
        Ok(notes)
    }

    /// Runs the remaining steps with `engine`; checkpoints every `checkpoint_every` steps and at
    /// the end; stops with an error after `max_nonfinite_in_a_row` skipped steps in a row.
    pub fn run(&mut self, engine: &mut dyn StepEngine) -> Result<RunSummary> {
        self.run_steps(engine, usize::MAX)
    }

    /// [`Trainer::run`] for at most `max_steps` more steps (a run stopped early, as a killed one
    /// would be; the end-of-run evaluation and checkpoint come only at the last step).
    pub fn run_steps(&mut self, engine: &mut dyn StepEngine, max_steps: usize) -> Result<RunSummary> {
        let c = self.inputs.config;
        let out = c.out.clone();
        if self.state.step == 0 && self.writes {
            let file = metrics::metrics_file(&out);
            if file.exists() {
                std::fs::remove_file(&file).map_err(|e| Error::io(&file, e))?;
            }
        }
        let total = self.total_steps;
        let mut reporter = match self.writes {
            true => Reporter::new(&out, self.state.step, total, self.inputs.quiet)?.with_devices(self.inputs.devices),
            false => Reporter::silent(total),
        };
        let b = self.inputs.draft_config.block_size;
        let gamma = c.gamma_for(b);
        let mut summary = RunSummary { first_step: self.state.step, ..RunSummary::default() };
        let data: &'a dyn RowSource = self.inputs.data;
        let n_rows = data.len();
        let read_ahead = self.inputs.read_ahead;
        // The rows this process steps with their features (all but with several processes).
        let own = engine.own_rows(c.rows_per_update());
        std::thread::scope(|scope| -> Result<()> {
            let mut ahead = ReadAhead::default();
            while self.state.step < total && summary.steps_run < max_steps {
                let step = self.state.step;
                let ids: Vec<Vec<usize>> = (0..c.grad_accum).map(|_| self.state.next_rows(c.rows_per_step)).collect();
                let rows = ahead.rows(data, &ids, &own)?;
                // Ahead only when the order gives the next step's ids without the generator (which
                // this step's anchors draw from first), so the rows and anchors are as without it.
                if read_ahead && step + 1 < total && summary.steps_run + 1 < max_steps {
                    if let Some(next) = self.state.peek_rows(c.grad_accum, c.rows_per_step) {
                        ahead.start(scope, data, next, own.clone());
                    }
                }
                let micro_batches = rows.iter().map(|m| m.iter().collect()).collect();
                let log_now = (step + 1).is_multiple_of(c.log_every) || step == 0 || step + 1 == total;
                let lr = lr_at(step, total, c.lr, c.warmup_frac);
                let batch = StepBatch {
                    step,
                    micro_batches,
                    anchors: c.anchors,
                    gamma,
                    lr,
                    clip_norm: c.clip_norm,
                    want_stats: log_now,
                };
                let started = std::time::Instant::now();
                let outcome = engine
                    .step(&batch, &mut self.state.rng)
                    .map_err(|e| Error::Step { step, message: e.to_string() })?;
                summary.step_seconds += started.elapsed().as_secs_f64();
                if let Some((d, t)) = outcome.waits {
                    let (a, b) = summary.waits.unwrap_or((0.0, 0.0));
                    summary.waits = Some((a + d, b + t));
                }
                // Document tokens: a row's padding is not throughput.
                let tokens: usize = batch.micro_batches.iter().flatten().map(|r| r.document_tokens()).sum();
                reporter.count(step, tokens as u64, (c.rows_per_update()) as u64, outcome.flops, outcome.waits);
                // The step's rows (a cached row's features: 126 MB at S=3072 for the 8B) are not
                // held through the evaluation and checkpoint, next to the rows read ahead.
                drop(batch);
                drop(rows);
                self.state.step += 1;
                summary.steps_run += 1;
                if let Some(tensor) = &outcome.non_finite {
                    self.state.nonfinite_in_a_row += 1;
                    self.state.nonfinite_total += 1;
                    let rows: Vec<usize> = ids.iter().flatten().copied().collect();
                    reporter.skipped(step, tensor, &rows, self.state.nonfinite_in_a_row, self.state.nonfinite_total)?;
                    if self.state.nonfinite_in_a_row >= c.max_nonfinite_in_a_row {
                        reporter.finish();
                        return Err(Error::NonFinite(format!(
                        "stopped at step {step}: {} steps in a row had a non-finite loss or gradient (max_nonfinite_in_a_row = {}); the last: {tensor} (rows {rows:?})",
                        self.state.nonfinite_in_a_row, c.max_nonfinite_in_a_row
                    )));
                    }
                } else {
                    self.state.nonfinite_in_a_row = 0;
                    if log_now {
                        let epoch = (self.state.step * c.rows_per_update()) as f64 / n_rows as f64;
                        reporter.train(
                            step,
                            epoch,
                            outcome.loss,
                            outcome.stats.as_ref(),
                            lr,
                            outcome.grad_norm,
                            self.state.nonfinite_total,
                            outcome.device_bytes,
                        )?;
                    }
                }
                let done = self.state.step;
                let outside = std::time::Instant::now();
                let eval_now = c.eval_every > 0 && done.is_multiple_of(c.eval_every);
                if (eval_now || done == total) && !self.inputs.held_out.is_empty() && self.writes {
                    let e = engine.evaluate(self.inputs.held_out, c.anchors, gamma, c.seed)?;
                    let tau = match self.inputs.tau {
                        Some(tau) => Some(tau(engine.drafter()?)?),
                        None => None,
                    };
                    reporter.eval(step, e.loss, &e.accuracy, e.tau_hat, tau)?;
                    if done == total {
                        summary.final_eval = Some((e, tau));
                    }
                }
                let checkpoint_now =
                    (c.checkpoint_every > 0 && done.is_multiple_of(c.checkpoint_every)) || done == total;
                if checkpoint_now && self.writes {
                    reporter.sync()?;
                    let started = std::time::Instant::now();
                    let engine_state = engine.state()?;
                    let fetched = started.elapsed().as_secs_f64();
                    let hashes = (self.config_sha256.clone(), self.data_sha256.clone());
                    let state = self.state.to_state(engine_state.t, hashes, self.inputs.processes);
                    let dir = checkpoint::write_checkpoint(
                        &out,
                        self.inputs.draft_config,
                        &engine_state,
                        state,
                        &c.without_launch(),
                        c.keep_checkpoints,
                    )?;
                    let bytes: u64 = ["model.safetensors", checkpoint::training_file(checkpoint::FORMAT)]
                        .iter()
                        .filter_map(|f| std::fs::metadata(dir.join(f)).ok())
                        .map(|m| m.len())
                        .sum();
                    reporter.say(&format!(
                        "  checkpoint {} ({}: state fetched in {fetched:.1}s, written and synced in {:.1}s)",
                        dir.display(),
                        crate::metrics::size_text(bytes),
                        started.elapsed().as_secs_f64() - fetched
                    ));
                    summary.checkpoints.push(dir);
                }
                reporter.exclude(outside.elapsed());
            }
            Ok(())
        })?;
        reporter.finish();
        summary.skipped_total = self.state.nonfinite_total;
        Ok(summary)
    }
}
