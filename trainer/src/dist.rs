//! Data parallelism over drafter workers (spec section 9): each worker is a thread that owns its
//! engine (its device, context and stream are made in the thread and never leave it). A step's
//! rows and anchors are drawn in the run's order, as one engine draws them, and split into
//! contiguous runs, one per worker; each worker accumulates its rows' gradients scaled by the
//! step's total weight (over all workers, spec section 3); the accumulators are summed in worker
//! order (a fixed reduction order) and the sum is handed back to every worker, which clips and
//! applies the same update. So the losses, the schedule and the weights do not depend on the
//! worker count, up to the order of the f32 sums (within 1e-6). Checkpoints come from worker 0
//! (every replica is the same) and restore into any number of workers. A worker's error stops
//! the step, naming the worker.
//!
//! This is the CPU pipeline (threads, an in-process all-reduce); NCCL between GPUs replaces the
//! reduction, not the protocol.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

use dflash_reference::data::TrainRow;
use dflash_reference::drafter::Drafter;
use dflash_reference::eval::EvalReport;
use dflash_reference::train::PreparedRow;
use rand_chacha::ChaCha8Rng;

use crate::engine::{prepare_rows, EngineState, Share, StepBatch, StepEngine, StepOutcome};
use crate::error::{Error, Result};
use crate::rows::RowSource;

/// What a data-parallel worker's engine does (`DeviceEngine` on any backend implements it).
pub trait Replica {
    /// Accumulates the gradients of `rows`, each scaled by `1 / total`.
    fn accumulate_rows(&mut self, rows: &[(&TrainRow, &PreparedRow)], total: f64, want_stats: bool) -> Result<Share>;
    /// The accumulated gradients (flat, f64).
    fn accumulated(&self) -> Result<Vec<f64>>;
    /// Replaces them (making the step for rows of `shape` = (S, N) if needed).
    fn set_accumulated(&mut self, shape: (usize, usize), values: &[f64]) -> Result<()>;
    /// Clips and applies them: the norm, or the non-finite gradient (nothing applied).
    fn apply(&mut self, lr: f64, clip_norm: f64) -> Result<std::result::Result<f64, String>>;
    /// Drops them.
    fn discard(&mut self) -> Result<()>;
    fn state(&self) -> Result<EngineState>;
    fn restore(&mut self, state: &EngineState) -> Result<()>;
    fn evaluate(&mut self, rows: &dyn RowSource, max_anchors: usize, gamma: f64, seed: u64) -> Result<EvalReport>;
}

impl<B: dflash_optimized::backend::Backend> Replica for crate::engine::DeviceEngine<B> {
    fn accumulate_rows(&mut self, rows: &[(&TrainRow, &PreparedRow)], total: f64, want_stats: bool) -> Result<Share> {
        crate::engine::DeviceEngine::accumulate_rows(self, rows, total, want_stats)
    }
    fn accumulated(&self) -> Result<Vec<f64>> {
        crate::engine::DeviceEngine::accumulated(self)
    }
    fn set_accumulated(&mut self, shape: (usize, usize), values: &[f64]) -> Result<()> {
        crate::engine::DeviceEngine::set_accumulated(self, shape, values)
    }
    fn apply(&mut self, lr: f64, clip_norm: f64) -> Result<std::result::Result<f64, String>> {
        crate::engine::DeviceEngine::apply(self, lr, clip_norm)
    }
    fn discard(&mut self) -> Result<()> {
        crate::engine::DeviceEngine::discard(self)
    }
    fn state(&self) -> Result<EngineState> {
        StepEngine::state(self)
    }
    fn restore(&mut self, state: &EngineState) -> Result<()> {
        StepEngine::restore(self, state)
    }
    fn evaluate(&mut self, rows: &dyn RowSource, max_anchors: usize, gamma: f64, seed: u64) -> Result<EvalReport> {
        StepEngine::evaluate(self, rows, max_anchors, gamma, seed)
    }
}

/// Makes worker `k`'s engine, in its own thread.
pub type MakeReplica = dyn Fn(usize) -> Result<Box<dyn Replica>> + Send + Sync;

enum Command {
    Accumulate { rows: Vec<(TrainRow, PreparedRow)>, total: f64, want_stats: bool },
    Apply { shape: (usize, usize), sum: Vec<f64>, lr: f64, clip_norm: f64 },
    Discard,
    State,
    Restore(Box<EngineState>),
    Evaluate { rows: Vec<TrainRow>, max_anchors: usize, gamma: f64, seed: u64 },
}

enum Reply {
    Accumulated(Box<Share>, Vec<f64>),
    Applied(std::result::Result<f64, String>),
    State(Box<EngineState>),
    Evaluated(EvalReport),
    Done,
}

struct Worker {
    commands: Sender<Command>,
    replies: Receiver<std::result::Result<Reply, String>>,
    thread: Option<JoinHandle<()>>,
}

/// A [`StepEngine`] over `workers` data-parallel replicas (see the module doc).
pub struct DataParallel {
    workers: Vec<Worker>,
    config: dflash_reference::config::DraftConfig,
    /// The drafter as of the last [`StepEngine::drafter`] call.
    host_copy: Option<Drafter>,
}

impl DataParallel {
    /// Starts `count` workers, each making its engine with `make(k)` in its thread; an error
    /// of any names the worker.
    pub fn new(
        count: usize,
        config: dflash_reference::config::DraftConfig,
        make: std::sync::Arc<MakeReplica>,
    ) -> Result<Self> {
        if count == 0 {
            return Err(Error::option("drafter_workers", "at least 1 worker"));
        }
        let mut workers = Vec::with_capacity(count);
        for k in 0..count {
            let (commands, inbox) = channel::<Command>();
            let (outbox, replies) = channel();
            let make = make.clone();
            let thread = std::thread::Builder::new()
                .name(format!("drafter-worker-{k}"))
                .spawn(move || serve(k, make, inbox, outbox))
                .map_err(|e| Error::option("drafter_workers", format!("worker {k}: cannot start its thread: {e}")))?;
            workers.push(Worker { commands, replies, thread: Some(thread) });
        }
        let dp = DataParallel { workers, config, host_copy: None };
        for k in 0..count {
            dp.wait(k)?;
        }
        Ok(dp)
    }

    /// Number of workers.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether there is no worker (never: [`DataParallel::new`] refuses 0).
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    fn send(&self, k: usize, command: Command) -> Result<()> {
        self.workers[k].commands.send(command).map_err(|_| worker_error(k, "stopped".into()))
    }

    fn wait(&self, k: usize) -> Result<Reply> {
        match self.workers[k].replies.recv() {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(message)) => Err(worker_error(k, message)),
            Err(_) => Err(worker_error(k, "stopped without a reply (its thread ended)".into())),
        }
    }

    /// Sends `command(k)` to every worker, then collects the replies in worker order: a failing
    /// worker's error (the first by worker order) stops the step.
    fn all(&self, command: impl Fn(usize) -> Command) -> Result<Vec<Reply>> {
        for k in 0..self.workers.len() {
            self.send(k, command(k))?;
        }
        let replies: Vec<Result<Reply>> = (0..self.workers.len()).map(|k| self.wait(k)).collect();
        replies.into_iter().collect()
    }
}

fn worker_error(k: usize, message: String) -> Error {
    Error::option(format!("drafter worker {k}"), message)
}

/// A worker's loop: makes its engine, then answers commands until the engine is dropped.
fn serve(
    k: usize,
    make: std::sync::Arc<MakeReplica>,
    inbox: Receiver<Command>,
    outbox: Sender<std::result::Result<Reply, String>>,
) {
    let mut engine = match make(k) {
        Ok(e) => {
            let _ = outbox.send(Ok(Reply::Done));
            e
        }
        Err(e) => {
            let _ = outbox.send(Err(format!("making its engine: {e}")));
            return;
        }
    };
    for command in inbox {
        let reply = match command {
            Command::Accumulate { rows, total, want_stats } => {
                let refs: Vec<(&TrainRow, &PreparedRow)> = rows.iter().map(|(r, p)| (r, p)).collect();
                engine
                    .accumulate_rows(&refs, total, want_stats)
                    .and_then(|share| Ok(Reply::Accumulated(Box::new(share), engine.accumulated()?)))
            }
            Command::Apply { shape, sum, lr, clip_norm } => {
                engine.set_accumulated(shape, &sum).and_then(|()| engine.apply(lr, clip_norm)).map(Reply::Applied)
            }
            Command::Discard => engine.discard().map(|()| Reply::Done),
            Command::State => engine.state().map(|s| Reply::State(Box::new(s))),
            Command::Restore(state) => engine.restore(&state).map(|()| Reply::Done),
            Command::Evaluate { rows, max_anchors, gamma, seed } => {
                engine.evaluate(&rows, max_anchors, gamma, seed).map(Reply::Evaluated)
            }
        };
        if outbox.send(reply.map_err(|e| e.to_string())).is_err() {
            return;
        }
    }
}

impl Drop for DataParallel {
    fn drop(&mut self) {
        for w in &mut self.workers {
            // Closing the command channel ends the worker's loop.
            let (closed, _) = channel();
            drop(std::mem::replace(&mut w.commands, closed));
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// `rows` split into `parts` contiguous runs, the first ones one longer when it does not divide.
fn split<T>(rows: Vec<T>, parts: usize) -> Vec<Vec<T>> {
    let (base, extra) = (rows.len() / parts, rows.len() % parts);
    let mut it = rows.into_iter();
    (0..parts).map(|k| it.by_ref().take(base + usize::from(k < extra)).collect()).collect()
}

impl StepEngine for DataParallel {
    fn name(&self) -> String {
        format!("device, {} data-parallel workers", self.workers.len())
    }

    fn step(&mut self, batch: &StepBatch, rng: &mut ChaCha8Rng) -> Result<StepOutcome> {
        self.host_copy = None;
        let (prepared, total) = prepare_rows(batch, self.config.block_size, rng)?;
        let shape = prepared.first().map(|(_, p)| (p.input.layout.context_len, p.input.layout.anchors.len()));
        let owned: Vec<(TrainRow, PreparedRow)> = prepared.into_iter().map(|(r, p)| (r.clone(), p)).collect();
        let mut parts = split(owned, self.workers.len());
        for (k, rows) in parts.iter_mut().enumerate() {
            let rows = std::mem::take(rows);
            self.send(k, Command::Accumulate { rows, total, want_stats: batch.want_stats })?;
        }
        let mut share: Option<Share> = None;
        let mut sum: Vec<f64> = Vec::new();
        for k in 0..self.workers.len() {
            let Reply::Accumulated(s, acc) = self.wait(k)? else {
                return Err(worker_error(k, "an unexpected reply".into()));
            };
            match &mut share {
                None => share = Some(*s),
                Some(all) => all.merge(*s),
            }
            // The fixed reduction order: worker 0, then 1, ...
            if sum.is_empty() {
                sum = acc;
            } else if !acc.is_empty() {
                sum.iter_mut().zip(&acc).for_each(|(a, b)| *a += b);
            }
        }
        let share = share.expect("at least one worker");
        if share.failed.is_some() || shape.is_none() || sum.is_empty() {
            self.all(|_| Command::Discard)?;
            let update = share.failed.is_none().then_some(Ok(0.0));
            return Ok(share.outcome(total, update, None));
        }
        let shape = shape.expect("checked");
        let replies =
            self.all(|_| Command::Apply { shape, sum: sum.clone(), lr: batch.lr, clip_norm: batch.clip_norm })?;
        let Some(Reply::Applied(update)) = replies.into_iter().next() else {
            return Err(worker_error(0, "an unexpected reply".into()));
        };
        Ok(share.outcome(total, Some(update), None))
    }

    fn state(&self) -> Result<EngineState> {
        self.send(0, Command::State)?;
        match self.wait(0)? {
            Reply::State(s) => Ok(*s),
            _ => Err(worker_error(0, "an unexpected reply".into())),
        }
    }

    fn restore(&mut self, state: &EngineState) -> Result<()> {
        self.host_copy = None;
        self.all(|_| Command::Restore(Box::new(state.clone()))).map(|_| ())
    }

    fn drafter(&mut self) -> Result<&Drafter> {
        if self.host_copy.is_none() {
            let state = self.state()?;
            let mut params = state.params.into_iter();
            self.host_copy = Some(Drafter::from_fn(self.config.clone(), |_, _| {
                params.next().ok_or_else(|| dflash_reference::Error::invalid("checkpoint", "too few tensors"))
            })?);
        }
        Ok(self.host_copy.as_ref().expect("made above"))
    }

    /// On worker 0 (every replica holds the same weights).
    fn evaluate(&mut self, rows: &dyn RowSource, max_anchors: usize, gamma: f64, seed: u64) -> Result<EvalReport> {
        let rows = (0..rows.len()).map(|i| rows.row(i)).collect::<Result<Vec<_>>>()?;
        self.send(0, Command::Evaluate { rows, max_anchors, gamma, seed })?;
        match self.wait(0)? {
            Reply::Evaluated(e) => Ok(e),
            _ => Err(worker_error(0, "an unexpected reply".into())),
        }
    }
}
