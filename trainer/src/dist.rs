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
//! Target workers ([`TargetPool`]) are threads that each own a target's forward: a step's rows
//! go to them through bounded queues (round robin, in order), their features come back, and the
//! drafter workers read them from the rows; each step reports how long the drafters waited for
//! the features and the targets for the drafters. Without target workers each drafter worker's
//! engine runs the target itself (a target and a drafter sharing a device).
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
    /// Target workers computing the rows' features (rows that carry `[S, 0]`), when given.
    targets: Option<TargetPool>,
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
        let dp = DataParallel { workers, targets: None, config, host_copy: None };
        for k in 0..count {
            dp.wait(k)?;
        }
        Ok(dp)
    }

    /// The same with `targets` computing every row's features (the drafter workers' engines then
    /// read the features from the rows).
    pub fn with_targets(mut self, targets: TargetPool) -> Self {
        self.targets = Some(targets);
        self
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
        let targets =
            self.targets.as_ref().map_or(String::new(), |t| format!(" fed by {} target workers", t.workers.len()));
        format!("device, {} data-parallel workers{targets}", self.workers.len())
    }

    fn step(&mut self, batch: &StepBatch, rng: &mut ChaCha8Rng) -> Result<StepOutcome> {
        self.host_copy = None;
        // With target workers: the rows' features first (the drafter workers wait for them).
        let mut waits = None;
        let featured: Vec<Vec<TrainRow>>;
        let with_features;
        let batch = match &self.targets {
            None => batch,
            Some(pool) => {
                let rows: Vec<&TrainRow> = batch.micro_batches.iter().flatten().copied().collect();
                let (features, waited) = pool.features(&rows)?;
                let mut features = features.into_iter();
                featured = batch
                    .micro_batches
                    .iter()
                    .map(|m| {
                        m.iter()
                            .map(|r| TrainRow { features: features.next().expect("one per row"), ..(*r).clone() })
                            .collect()
                    })
                    .collect();
                with_features = StepBatch {
                    micro_batches: featured.iter().map(|m| m.iter().collect()).collect(),
                    ..batch.clone_options()
                };
                waits = Some(waited);
                &with_features
            }
        };
        let started = std::time::Instant::now();
        let outcome = self.step_rows(batch, rng)?;
        Ok(StepOutcome { waits: waits.map(|w| (w, started.elapsed().as_secs_f64())), ..outcome })
    }

    fn state(&self) -> Result<EngineState> {
        self.state_of_worker_0()
    }

    fn restore(&mut self, state: &EngineState) -> Result<()> {
        self.restore_all(state)
    }

    fn drafter(&mut self) -> Result<&Drafter> {
        self.drafter_copy()
    }

    /// On worker 0 (every replica holds the same weights).
    fn evaluate(&mut self, rows: &dyn RowSource, max_anchors: usize, gamma: f64, seed: u64) -> Result<EvalReport> {
        self.evaluate_on_worker_0(rows, max_anchors, gamma, seed)
    }
}

impl DataParallel {
    /// One step over rows that carry their features.
    fn step_rows(&mut self, batch: &StepBatch, rng: &mut ChaCha8Rng) -> Result<StepOutcome> {
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

    fn state_of_worker_0(&self) -> Result<EngineState> {
        self.send(0, Command::State)?;
        match self.wait(0)? {
            Reply::State(s) => Ok(*s),
            _ => Err(worker_error(0, "an unexpected reply".into())),
        }
    }

    fn restore_all(&mut self, state: &EngineState) -> Result<()> {
        self.host_copy = None;
        self.all(|_| Command::Restore(Box::new(state.clone()))).map(|_| ())
    }

    fn drafter_copy(&mut self) -> Result<&Drafter> {
        if self.host_copy.is_none() {
            let state = self.state_of_worker_0()?;
            let mut params = state.params.into_iter();
            self.host_copy = Some(Drafter::from_fn(self.config.clone(), |_, _| {
                params.next().ok_or_else(|| dflash_reference::Error::invalid("checkpoint", "too few tensors"))
            })?);
        }
        Ok(self.host_copy.as_ref().expect("made above"))
    }

    fn evaluate_on_worker_0(
        &mut self,
        rows: &dyn RowSource,
        max_anchors: usize,
        gamma: f64,
        seed: u64,
    ) -> Result<EvalReport> {
        let mut rows = (0..rows.len()).map(|i| rows.row(i)).collect::<Result<Vec<_>>>()?;
        if let Some(pool) = &self.targets {
            let (features, _) = pool.features(&rows.iter().collect::<Vec<_>>())?;
            rows.iter_mut().zip(features).for_each(|(r, f)| r.features = f);
        }
        self.send(0, Command::Evaluate { rows, max_anchors, gamma, seed })?;
        match self.wait(0)? {
            Reply::Evaluated(e) => Ok(e),
            _ => Err(worker_error(0, "an unexpected reply".into())),
        }
    }
}

/// What a target worker computes: a row's features `[S, F*H]` (f32, on the host).
pub trait FeatureSource {
    fn features(&mut self, row: &dflash_reference::data::Row) -> Result<candle_core::Tensor>;
}

impl<B: dflash_optimized::backend::Backend> FeatureSource
    for dflash_optimized::model::target_forward::TargetForward<B>
{
    fn features(&mut self, row: &dflash_reference::data::Row) -> Result<candle_core::Tensor> {
        self.run(&[row])?;
        let (s, fw) = (row.tokens.len(), self.layout.dims.fw);
        let values: Vec<f32> = self.features_to_host()?.into_iter().map(|x| x as f32).collect();
        Ok(candle_core::Tensor::from_vec(values, (s, fw), &candle_core::Device::Cpu)?)
    }
}

/// Makes target worker `k`'s forward, in its own thread.
pub type MakeFeatures = dyn Fn(usize) -> Result<Box<dyn FeatureSource>> + Send + Sync;

struct TargetWorker {
    rows: std::sync::mpsc::SyncSender<dflash_reference::data::Row>,
    features: Receiver<std::result::Result<candle_core::Tensor, String>>,
    thread: Option<JoinHandle<()>>,
}

/// Target workers: threads that each own a target's forward and compute the features of the
/// rows handed to them through a bounded queue (`capacity` rows each), in order.
pub struct TargetPool {
    workers: Vec<TargetWorker>,
}

impl TargetPool {
    /// Starts `count` target workers, each making its forward with `make(k)` in its thread.
    pub fn new(count: usize, capacity: usize, make: std::sync::Arc<MakeFeatures>) -> Result<Self> {
        if count == 0 || capacity == 0 {
            return Err(Error::option("target_workers", "at least 1 worker with a queue of at least 1 row"));
        }
        let mut workers = Vec::with_capacity(count);
        for k in 0..count {
            let (rows, inbox) = std::sync::mpsc::sync_channel::<dflash_reference::data::Row>(capacity);
            let (outbox, features) = channel();
            let make = make.clone();
            let thread = std::thread::Builder::new()
                .name(format!("target-worker-{k}"))
                .spawn(move || {
                    let mut forward = match make(k) {
                        Ok(f) => f,
                        Err(e) => {
                            let _ = outbox.send(Err(format!("making its forward: {e}")));
                            return;
                        }
                    };
                    for row in inbox {
                        if outbox.send(forward.features(&row).map_err(|e| e.to_string())).is_err() {
                            return;
                        }
                    }
                })
                .map_err(|e| Error::option("target_workers", format!("worker {k}: cannot start its thread: {e}")))?;
            workers.push(TargetWorker { rows, features, thread: Some(thread) });
        }
        Ok(TargetPool { workers })
    }

    /// The features of `rows`, row `i` computed by worker `i mod count`; returns them in order
    /// and the seconds spent waiting for them after the last row was queued.
    pub fn features(&self, rows: &[&TrainRow]) -> Result<(Vec<candle_core::Tensor>, f64)> {
        let n = self.workers.len();
        let fail = |k: usize, m: String| Error::option(format!("target worker {k}"), m);
        let mut out = Vec::with_capacity(rows.len());
        let mut waited = 0.0;
        // Queue a window of rows, then collect in order while queueing the rest.
        let mut sent = 0;
        let send = |i: usize| -> Result<()> {
            let r = rows[i];
            let row = dflash_reference::data::Row {
                tokens: r.tokens.clone(),
                loss_mask: r.loss_mask.clone(),
                doc_ids: r.doc_ids.clone().unwrap_or_else(|| vec![0; r.len()]),
                positions: r.positions.clone(),
            };
            self.workers[i % n].rows.send(row).map_err(|_| fail(i % n, "stopped".into()))
        };
        while sent < rows.len().min(n) {
            send(sent)?;
            sent += 1;
        }
        for i in 0..rows.len() {
            let started = std::time::Instant::now();
            let got = self.workers[i % n].features.recv();
            waited += started.elapsed().as_secs_f64();
            match got {
                Ok(Ok(t)) => out.push(t),
                Ok(Err(m)) => return Err(fail(i % n, m)),
                Err(_) => return Err(fail(i % n, "stopped without a reply (its thread ended)".into())),
            }
            if sent < rows.len() {
                send(sent)?;
                sent += 1;
            }
        }
        Ok((out, waited))
    }
}

impl Drop for TargetPool {
    fn drop(&mut self) {
        for w in &mut self.workers {
            let (closed, _) = std::sync::mpsc::sync_channel(1);
            drop(std::mem::replace(&mut w.rows, closed));
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}
