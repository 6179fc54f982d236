//! Metrics while training (spec section 7): every `log_every` steps a line on the terminal (a
//! progress bar with ETA when stdout is a terminal, plain lines otherwise) and one JSON object
//! per line in `OUT/metrics.jsonl`; at the end `OUT/training.svg` (loss and tau_hat over steps).
//!
//! `metrics.jsonl` lines, by `kind`:
//! - `train`: `step` (0-based), `epoch` (rows consumed / training rows), `loss`, `acc` (top-1
//!   accuracy at offsets 1..B-1: `acc[o-1]` is `acc_o`), `tau_hat`, `lr`, `grad_norm`,
//!   `tokens_per_s` (document tokens, padding left out), `samples_per_s` (rows) and `mfu` (per
//!   device) over the steps since the previous train line (evaluations and checkpoints left out),
//!   `skipped_total`;
//! - `eval`: `step`, `loss`, `acc`, `tau_hat` on the held-out rows, and `tau`: the real tau of
//!   greedy speculative decoding of held-out prompts (the mean of `A + 1` over all verify steps,
//!   spec section 4), when measured;
//! - `skipped`: a step whose loss or a gradient was NaN or Inf: `step`, `tensor`, `rows`,
//!   `in_a_row`, `skipped_total`.
//!
//! Floats are written by serde_json, with the shortest digits that read back to the same f64.

use std::fs::File;
use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dflash_optimized::flops::PEAK_FLOPS;
use dflash_reference::eval::BlockStats;
use dflash_reference::io::write_atomically;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};

use crate::error::{Error, Result};

/// The `metrics.jsonl` of a run folder.
pub fn metrics_file(out: &Path) -> PathBuf {
    out.join("metrics.jsonl")
}

/// Accuracy at offsets 1..B-1 (drops offset 0, never scored).
pub fn offsets_accuracy(stats: &BlockStats) -> Vec<f64> {
    stats.accuracy().into_iter().skip(1).collect()
}

/// The text of the number `key` in one compact JSON line, parsed by Rust's correctly rounded
/// `f64` parser (serde_json's default float parser may be off by one ulp); `None` if absent.
pub fn raw_number(line: &str, key: &str) -> Option<f64> {
    let pattern = format!("\"{key}\":");
    let start = line.find(&pattern)? + pattern.len();
    let end = line[start..].find([',', '}']).map_or(line.len(), |e| start + e);
    line[start..end].trim().parse().ok()
}

/// Reads the JSON lines of `file`; a last line cut short by a kill is dropped.
pub fn read_lines(file: &Path) -> Result<Vec<Value>> {
    let f = match File::open(file) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(file, e)),
    };
    let mut out = Vec::new();
    for line in BufReader::new(f).lines() {
        let line = line.map_err(|e| Error::io(file, e))?;
        if let Ok(v) = serde_json::from_str::<Value>(&line) {
            out.push(v);
        }
    }
    Ok(out)
}

/// `(step, loss)` of the `train` lines of `file`, the losses exactly as written.
pub fn train_losses(file: &Path) -> Result<Vec<(u64, f64)>> {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(file, e)),
    };
    Ok(text
        .lines()
        .filter(|l| l.contains("\"kind\":\"train\""))
        .filter_map(|l| Some((raw_number(l, "step")? as u64, raw_number(l, "loss")?)))
        .collect())
}

/// Rewrites `file` (atomically) with only its complete lines of steps below `step`: the lines
/// a resumed run would otherwise repeat. Returns how many lines were dropped.
pub fn truncate_to_step(file: &Path, step: usize) -> Result<usize> {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(Error::io(file, e)),
    };
    let (mut kept, mut dropped) = (String::new(), 0);
    for line in text.split_inclusive('\n') {
        let keep = line.ends_with('\n')
            && serde_json::from_str::<Value>(line)
                .ok()
                .and_then(|v| v.get("step").and_then(Value::as_u64))
                .is_some_and(|s| (s as usize) < step);
        if keep {
            kept.push_str(line);
        } else {
            dropped += 1;
        }
    }
    write_atomically(file, |f| f.write_all(kept.as_bytes()))?;
    Ok(dropped)
}

/// Writes the metrics of a run: JSON lines and the terminal.
pub struct Reporter {
    file: PathBuf,
    /// `None`: [`Reporter::silent`].
    jsonl: Option<File>,
    bar: Option<ProgressBar>,
    total_steps: usize,
    /// The step this process started at (0, or the resumed checkpoint's): the ETA's pace.
    first_step: usize,
    since: Instant,
    tokens: u64,
    samples: u64,
    flops: f64,
    /// The GPUs `flops` ran on: the MFU divides by their peak (0: not GPUs, no MFU).
    devices: usize,
    /// Seconds the drafter workers waited for features, and the target workers for the drafters.
    waits: Option<(f64, f64)>,
    started: Instant,
    quiet: bool,
}

impl Reporter {
    /// Appends to `OUT/metrics.jsonl` (which the caller has truncated or removed); the run has
    /// `total_steps` steps and starts at `first_step`. `quiet` prints nothing (tests).
    pub fn new(out: &Path, first_step: usize, total_steps: usize, quiet: bool) -> Result<Self> {
        let file = metrics_file(out);
        let jsonl =
            std::fs::OpenOptions::new().create(true).append(true).open(&file).map_err(|e| Error::io(&file, e))?;
        let bar = (!quiet && std::io::stdout().is_terminal()).then(|| {
            let bar = ProgressBar::new(total_steps as u64);
            bar.set_style(
                ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]")
                    .expect("a valid template"),
            );
            bar.set_position(first_step as u64);
            bar.reset_eta();
            bar
        });
        if bar.is_none() && !quiet {
            println!(
                "{:>6} {:>9} {:>8} {:>10} {:>10} {:>9} {:>9} {:>9}",
                "step", "loss", "tau_hat", "lr", "grad norm", "tok/s", "elapsed", "ETA"
            );
        }
        Ok(Reporter { file, jsonl: Some(jsonl), bar, quiet, first_step, ..Reporter::silent(total_steps) })
    }

    /// A reporter that writes nothing and prints only skipped steps (on stderr): a rank other
    /// than 0 of several processes (rank 0 reports the run).
    pub fn silent(total_steps: usize) -> Self {
        let now = Instant::now();
        Reporter {
            file: PathBuf::new(),
            jsonl: None,
            bar: None,
            total_steps,
            first_step: 0,
            since: now,
            tokens: 0,
            samples: 0,
            flops: 0.0,
            devices: 1,
            waits: None,
            started: now,
            quiet: true,
        }
    }

    /// The same reporter, its MFU over `devices` GPUs' peak (0: none, for the CPU).
    pub fn with_devices(mut self, devices: usize) -> Self {
        self.devices = devices;
        self
    }

    /// Leaves time spent outside the steps (an evaluation, a checkpoint) out of the next train
    /// line's throughput.
    pub fn exclude(&mut self, spent: Duration) {
        self.since += spent;
    }

    fn write(&mut self, value: &Value) -> Result<()> {
        let Some(jsonl) = &mut self.jsonl else { return Ok(()) };
        writeln!(jsonl, "{value}").and_then(|()| jsonl.flush()).map_err(|e| Error::io(&self.file, e))
    }

    /// Syncs `metrics.jsonl` (before a checkpoint, so the lines it covers are on disk).
    pub fn sync(&mut self) -> Result<()> {
        let Some(jsonl) = &self.jsonl else { return Ok(()) };
        jsonl.sync_data().map_err(|e| Error::io(&self.file, e))
    }

    /// Prints a line above the progress bar (or plainly).
    pub fn say(&self, line: &str) {
        if self.quiet {
            return;
        }
        match &self.bar {
            Some(bar) => bar.println(line),
            None => println!("{line}"),
        }
    }

    /// Counts a step's tokens, rows, model FLOPs (throughput and MFU) and the pipeline's waits;
    /// advances the bar.
    pub fn count(&mut self, step: usize, tokens: u64, samples: u64, flops: f64, waits: Option<(f64, f64)>) {
        self.tokens += tokens;
        self.samples += samples;
        self.flops += flops;
        if let Some((d, t)) = waits {
            let (a, b) = self.waits.unwrap_or((0.0, 0.0));
            self.waits = Some((a + d, b + t));
        }
        if let Some(bar) = &self.bar {
            bar.set_position(step as u64 + 1);
        }
    }

    /// A `train` line.
    #[allow(clippy::too_many_arguments)]
    pub fn train(
        &mut self,
        step: usize,
        epoch: f64,
        loss: f64,
        stats: Option<&BlockStats>,
        lr: f64,
        grad_norm: f64,
        skipped_total: usize,
        device_bytes: Option<u64>,
    ) -> Result<()> {
        let secs = self.since.elapsed().as_secs_f64().max(1e-9);
        let (tokens_per_s, samples_per_s) = (self.tokens as f64 / secs, self.samples as f64 / secs);
        let mfu =
            (self.flops > 0.0 && self.devices > 0).then(|| self.flops / (secs * PEAK_FLOPS * self.devices as f64));
        let waits = self.waits.take();
        (self.since, self.tokens, self.samples, self.flops) = (Instant::now(), 0, 0, 0.0);
        let tau_hat = stats.map(BlockStats::tau_hat);
        self.write(&json!({
            "kind": "train", "step": step, "epoch": epoch, "loss": loss,
            "acc": stats.map(offsets_accuracy), "tau_hat": tau_hat, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s, "samples_per_s": samples_per_s, "mfu": mfu,
            "device_memory_planned_gb": device_bytes.map(|b| b as f64 / 1e9), "skipped_total": skipped_total,
            "drafters_waited_s": waits.map(|w| w.0), "targets_waited_s": waits.map(|w| w.1),
        }))?;
        let tau = tau_hat.map_or("-".to_string(), |t| format!("{t:.3}"));
        match &self.bar {
            Some(bar) => bar.set_message(format!("loss {loss:.4} tau_hat {tau} lr {lr:.2e}")),
            None if !self.quiet => {
                let elapsed = self.started.elapsed().as_secs_f64();
                let left =
                    eta(elapsed, (step + 1).saturating_sub(self.first_step), self.total_steps.saturating_sub(step + 1));
                println!(
                    "{step:>6} {loss:>9.4} {tau:>8} {lr:>10.3e} {grad_norm:>10.3} {tokens_per_s:>9.0} {elapsed:>8.1}s {left:>9}"
                )
            }
            None => {}
        }
        Ok(())
    }

    /// An `eval` line (held-out rows; `tau`: the real tau by speculative decoding, when measured).
    pub fn eval(&mut self, step: usize, loss: f64, accuracy: &[f64], tau_hat: f64, tau: Option<f64>) -> Result<()> {
        let acc: Vec<f64> = accuracy.iter().skip(1).copied().collect();
        self.write(&json!({"kind": "eval", "step": step, "loss": loss, "acc": acc, "tau_hat": tau_hat, "tau": tau}))?;
        let percent = acc.iter().map(|a| format!("{:.0}", a * 100.0)).collect::<Vec<_>>().join(" ");
        let tau = tau.map_or(String::new(), |t| format!(", real tau {t:.3}"));
        self.say(&format!(
            "  held-out after step {step}: loss {loss:.4}, tau_hat {tau_hat:.3}{tau}, accuracy % [{percent}]"
        ));
        Ok(())
    }

    /// A `skipped` line, also reported on stderr.
    pub fn skipped(&mut self, step: usize, tensor: &str, rows: &[usize], in_a_row: usize, total: usize) -> Result<()> {
        self.write(&json!({
            "kind": "skipped", "step": step, "tensor": tensor, "rows": rows,
            "in_a_row": in_a_row, "skipped_total": total,
        }))?;
        let line = format!(
            "step {step}: non-finite {tensor} (rows {rows:?}); step skipped, no update ({in_a_row} in a row, {total} in total)"
        );
        match &self.bar {
            Some(bar) => bar.suspend(|| eprintln!("{line}")),
            None => eprintln!("{line}"),
        }
        Ok(())
    }

    /// Ends the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    pub fn total_steps(&self) -> usize {
        self.total_steps
    }
}

/// The time `left` more units take at the pace of `done` units in `elapsed` seconds, as
/// `1h02m` / `3m05s` / `42s` (`-` before the first unit).
pub fn eta(elapsed: f64, done: usize, left: usize) -> String {
    if done == 0 {
        return "-".into();
    }
    let s = (elapsed / done as f64 * left as f64).round() as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

/// A size for people: GB with 2 decimals from 1 GB, else MB with 2.
pub fn size_text(bytes: u64) -> String {
    match bytes >= 1_000_000_000 {
        true => format!("{:.2} GB", bytes as f64 / 1e9),
        false => format!("{:.2} MB", bytes as f64 / 1e6),
    }
}

/// Draws `OUT/training.svg` from `metrics.jsonl`: the training loss (and held-out loss) over
/// steps on top, tau_hat (training and held-out) below.
pub fn plot(out: &Path) -> Result<PathBuf> {
    use plotters::prelude::*;
    let lines = read_lines(&metrics_file(out))?;
    let series = |kind: &str, field: &str| -> Vec<(f64, f64)> {
        lines
            .iter()
            .filter(|v| v.get("kind").and_then(Value::as_str) == Some(kind))
            .filter_map(|v| Some((v.get("step")?.as_f64()?, v.get(field)?.as_f64()?)))
            .filter(|(_, y)| y.is_finite())
            .collect()
    };
    let (loss, eval_loss) = (series("train", "loss"), series("eval", "loss"));
    let (tau, eval_tau) = (series("train", "tau_hat"), series("eval", "tau_hat"));
    let file = out.join("training.svg");
    let mut svg = String::new();
    {
        let fail = |e: &dyn std::fmt::Display| Error::io(&file, std::io::Error::other(e.to_string()));
        let root = SVGBackend::with_string(&mut svg, (900, 700)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        let panels = root.split_evenly((2, 1));
        let max_step = loss.iter().chain(&eval_loss).map(|p| p.0).fold(1.0, f64::max);
        for (panel, (title, train, eval)) in
            panels.iter().zip([("loss", &loss, &eval_loss), ("tau_hat", &tau, &eval_tau)])
        {
            let ys = train.iter().chain(eval.iter()).map(|p| p.1);
            let (lo, hi) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| (a.min(y), b.max(y)));
            let floor = if title == "loss" { 0.0 } else { 1.0 };
            let (lo, hi) =
                if lo.is_finite() { (lo.min(floor), hi + 0.05 * (hi - lo).max(1e-3)) } else { (floor, floor + 1.0) };
            let mut chart = ChartBuilder::on(panel)
                .caption(title, ("sans-serif", 20))
                .margin(10)
                .x_label_area_size(30)
                .y_label_area_size(50)
                .build_cartesian_2d(0.0..max_step, lo..hi)
                .map_err(|e| fail(&e))?;
            chart.configure_mesh().x_desc("step").draw().map_err(|e| fail(&e))?;
            chart
                .draw_series(LineSeries::new(train.iter().copied(), &BLUE))
                .map_err(|e| fail(&e))?
                .label("training")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
            chart
                .draw_series(LineSeries::new(eval.iter().copied(), &RED))
                .map_err(|e| fail(&e))?
                .label("held-out")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
            chart.configure_series_labels().background_style(WHITE).border_style(BLACK).draw().map_err(|e| fail(&e))?;
        }
        root.present().map_err(|e| fail(&e))?;
    }
    write_atomically(&file, |f| f.write_all(svg.as_bytes()))?;
    Ok(file)
}
