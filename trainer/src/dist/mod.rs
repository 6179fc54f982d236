//! Data parallelism over drafter workers (spec section 9): each worker is a thread that owns its
//! engine (its device, context and stream are made in the thread and never leave it). A step's
//! rows and anchors are drawn in the run's order, as one engine draws them, and split into
//! contiguous runs, one per worker; each worker accumulates its rows' gradients scaled by the
//! step's total weight (over all workers, spec section 3). The accumulators are then summed:
//! on the host in worker order (a fixed reduction order), or where they live when the engines
//! reduce on their devices ([`reduce`]: NCCL on GPUs, its CPU twin in CI); every worker clips and
//! applies the same update. So the losses, the schedule and the weights do not depend on the
//! worker count, up to the order of the f32 sums (within 1e-6). Checkpoints come from worker 0
//! (every replica is the same) and restore into any number of workers. A worker's error, or a
//! worker that does not answer within [`WORKER_TIMEOUT`], stops the step at once, naming the
//! worker, and aborts the others' reductions (no hang).
//!
//! Several processes ([`group`]) train as one the same way: every process draws the same rows,
//! splits them over all the processes' workers (rank-major: process `r`'s workers take parts
//! `r*local..`), and sums its workers' gradients with the other processes' through the process
//! group ([`group::WorkerRank`]) or NCCL; each step's loss, FLOPs, stats and non-finite flag are
//! summed over the processes too, so every rank logs the same loss and skips the same steps.
//!
//! Features come from the rows, from each engine's own target, or from target workers
//! ([`feed::FeedPool`]: threads with a target's forward whose features stay on their device, in
//! slots each drafter worker copies into its step, on the same GPU or peer to peer from another,
//! the rows streamed while the drafters step). Each
//! step then reports how long the drafters waited for the features and the targets for the
//! drafters.

pub mod feed;
pub mod group;
pub mod reduce;

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use dflash_optimized::memory::step::Checkpointing;
use dflash_reference::data::{Row, TrainRow};
use dflash_reference::drafter::Drafter;
use dflash_reference::eval::EvalReport;
use dflash_reference::train::PreparedRow;
use rand_chacha::ChaCha8Rng;

use crate::engine::{prepare_rows, EngineState, Share, StepBatch, StepEngine, StepOutcome};
use crate::error::{panic_message, Error, Result};
use crate::rows::RowSource;
use feed::FeedPool;
use group::ProcessGroup;
use reduce::Abort;

/// How long the coordinator waits for a drafter worker's answer (a step of many rows on a large
/// target, or a stuck collective) before it stops the run.
pub const WORKER_TIMEOUT: Duration = Duration::from_secs(1800);
/// How often a wait for the workers looks at the other processes of the run (one that stopped
/// ends the wait).
const WATCH_TICK: Duration = Duration::from_secs(1);

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
    /// Sums the accumulated gradients over the workers where they live, making the step for
    /// rows of `shape` if needed: `false` when this engine has no reduction group (the host sums).
    fn reduce_on_device(&mut self, shape: (usize, usize)) -> Result<bool>;
    /// Aborts this engine's reduction group (another worker failed).
    fn abort(&self) -> Option<Abort>;
    /// The checkpointing policy its step was laid out with, where it chose one.
    fn checkpointing(&self) -> Option<Checkpointing> {
        None
    }
    /// The device memory its step was planned to take (with what it keeps beside it), once laid out.
    fn planned_bytes(&self) -> Option<u64> {
        None
    }
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
    fn reduce_on_device(&mut self, shape: (usize, usize)) -> Result<bool> {
        crate::engine::DeviceEngine::reduce_on_device(self, shape)
    }
    fn checkpointing(&self) -> Option<Checkpointing> {
        StepEngine::checkpointing(self)
    }
    fn planned_bytes(&self) -> Option<u64> {
        crate::engine::DeviceEngine::planned_bytes(self)
    }
    fn abort(&self) -> Option<Abort> {
        crate::engine::DeviceEngine::abort(self)
    }
}

/// Makes worker `k`'s engine, in its own thread.
pub type MakeReplica = dyn Fn(usize) -> Result<Box<dyn Replica>> + Send + Sync;

enum Command {
    /// `shape`: the step's (S, N), for the reduction on the device (`None`: no rows at all).
    Accumulate {
        rows: Vec<(TrainRow, PreparedRow)>,
        total: f64,
        want_stats: bool,
        shape: Option<(usize, usize)>,
    },
    /// `sum`: the host-summed gradients (`None`: already summed on the devices).
    Apply {
        shape: (usize, usize),
        sum: Option<Vec<f64>>,
        lr: f64,
        clip_norm: f64,
    },
    Discard,
    State,
    Checkpointing,
    Restore(Box<EngineState>),
    Evaluate {
        rows: Vec<TrainRow>,
        max_anchors: usize,
        gamma: f64,
        seed: u64,
    },
}

enum Reply {
    Made(Option<Abort>),
    /// The worker's share and its gradients (`None`: summed on the devices).
    Accumulated(Box<Share>, Option<Vec<f64>>),
    /// The update, and the device memory the worker's step was planned to take.
    Applied(std::result::Result<f64, String>, Option<u64>),
    State(Box<EngineState>),
    Checkpointing(Option<Checkpointing>),
    Evaluated(EvalReport),
    Done,
}

struct Worker {
    commands: Sender<Command>,
    thread: Option<JoinHandle<()>>,
    abort: Option<Abort>,
}

type Replies = Receiver<(usize, std::result::Result<Reply, String>)>;

/// A [`StepEngine`] over `workers` data-parallel replicas (see the module doc).
pub struct DataParallel {
    workers: Vec<Worker>,
    /// Every worker's replies, tagged with the worker.
    replies: Replies,
    /// Set by a failed step: the workers may be mid-command, so nothing more is sent.
    broken: std::cell::RefCell<Option<String>>,
    /// Target workers feeding the drafter workers' engines on the device, when given.
    feed: Option<FeedPool>,
    config: dflash_reference::config::DraftConfig,
    /// The drafter as of the last [`StepEngine::drafter`] call.
    host_copy: Option<Drafter>,
    /// The other processes training with this one, when several.
    process: Option<Arc<ProcessGroup>>,
    /// The workers' optimizer state is sharded: a checkpoint joins their shards.
    sharded: bool,
    /// How long a worker may be silent ([`WORKER_TIMEOUT`]; tests make it short).
    timeout: Duration,
}

impl DataParallel {
    /// Starts `count` workers, each making its engine with `make(k)` in its thread; an error
    /// of any names the worker.
    pub fn new(
        count: usize,
        config: dflash_reference::config::DraftConfig,
        make: std::sync::Arc<MakeReplica>,
    ) -> Result<Self> {
        Self::start(count, config, make, None)
    }

    /// [`DataParallel::new`] as one process of `group`: it steps its workers' parts of every
    /// step's rows (see the module doc). Every worker's engine must sum its gradients through
    /// the group (or NCCL across the processes). Another process that stops while the engines
    /// are made (their communicators joined) stops this one too.
    pub fn joined(
        count: usize,
        config: dflash_reference::config::DraftConfig,
        make: std::sync::Arc<MakeReplica>,
        group: Arc<ProcessGroup>,
    ) -> Result<Self> {
        let dp = Self::start(count, config, make, Some(group))?;
        if let Some(k) = dp.workers.iter().position(|w| w.abort.is_none()) {
            let why = "has no reduction group: several processes sum their gradients through one";
            return Err(worker_error(k, why.into()));
        }
        Ok(dp)
    }

    fn start(
        count: usize,
        config: dflash_reference::config::DraftConfig,
        make: std::sync::Arc<MakeReplica>,
        process: Option<Arc<ProcessGroup>>,
    ) -> Result<Self> {
        if count == 0 {
            return Err(Error::option("drafter_workers", "at least 1 worker"));
        }
        let mut workers = Vec::with_capacity(count);
        let (outbox, replies) = channel();
        for k in 0..count {
            let (commands, inbox) = channel::<Command>();
            let (make, outbox) = (make.clone(), outbox.clone());
            let thread = std::thread::Builder::new()
                .name(format!("drafter-worker-{k}"))
                .spawn(move || serve(k, make, inbox, outbox))
                .map_err(|e| Error::option("drafter_workers", format!("worker {k}: cannot start its thread: {e}")))?;
            workers.push(Worker { commands, thread: Some(thread), abort: None });
        }
        let mut dp = DataParallel {
            workers,
            replies,
            broken: Default::default(),
            feed: None,
            config,
            host_copy: None,
            process,
            sharded: false,
            timeout: WORKER_TIMEOUT,
        };
        for (k, reply) in dp.collect(true)?.into_iter().enumerate() {
            let Reply::Made(abort) = reply else { return Err(worker_error(k, "an unexpected reply".into())) };
            dp.workers[k].abort = abort;
        }
        Ok(dp)
    }

    /// The same with `feed` computing every row's features on the device (the drafter workers'
    /// engines were made with its ends).
    pub fn with_feed(mut self, feed: FeedPool) -> Self {
        self.feed = Some(feed);
        self
    }

    /// The same over workers whose engines shard the optimizer state
    /// (`DeviceEngine::with_sharded_optimizer(k, workers)`): their states are joined.
    pub fn with_sharded_optimizer(mut self) -> Self {
        self.sharded = true;
        self
    }

    /// The same with workers silent for `timeout` (instead of [`WORKER_TIMEOUT`]) stopping the run.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn send(&self, k: usize, command: Command) -> Result<()> {
        if let Some(why) = self.broken.borrow().as_ref() {
            return Err(Error::worker("drafter workers", format!("stopped after an earlier error: {why}")));
        }
        self.workers[k]
            .commands
            .send(command)
            .map_err(|_| self.stop(worker_error(k, "stopped (its thread ended)".into())))
    }

    /// The next reply, waiting up to `timeout`; when `watch`, in ticks of [`WATCH_TICK`], between
    /// which a process of the group that stopped ends the wait (`Err(Some(..))`: the workers may
    /// be in a reduction on the devices that would never end). `Err(None)`: the timeout. Only
    /// the accumulation watches: no process can finish the run before every process's
    /// accumulation is summed (`sum_shares`), while one may end before the others' last update
    /// or evaluation.
    fn next_reply(
        &self,
        timeout: Duration,
        watch: bool,
    ) -> std::result::Result<(usize, std::result::Result<Reply, String>), Option<Error>> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let tick = match watch && self.process.is_some() {
                true => WATCH_TICK,
                false => left,
            };
            match self.replies.recv_timeout(left.min(tick)) {
                Ok(reply) => return Ok(reply),
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Some(Error::worker("drafter workers", "stopped without a reply (their threads ended)")))
                }
                Err(RecvTimeoutError::Timeout) if left <= tick => return Err(None),
                Err(RecvTimeoutError::Timeout) => {
                    if let Some(why) = self.process.as_ref().and_then(|g| g.peer_gone()) {
                        return Err(Some(Error::Group(why)));
                    }
                }
            }
        }
    }

    /// One reply of every worker, in worker order. The first error (or a worker silent for the
    /// timeout, or when `watch`, another process gone: [`Self::next_reply`]) aborts every
    /// worker's reduction and the process group and stops the step, naming the worker.
    fn collect(&self, watch: bool) -> Result<Vec<Reply>> {
        let mut got: Vec<Option<Reply>> = (0..self.workers.len()).map(|_| None).collect();
        while got.iter().any(Option::is_none) {
            let failure = match self.next_reply(self.timeout, watch) {
                Ok((k, Ok(reply))) => {
                    got[k] = Some(reply);
                    continue;
                }
                Ok((k, Err(message))) => worker_error(k, message),
                Err(Some(failure)) => failure,
                Err(None) => {
                    let silent: Vec<usize> = (0..got.len()).filter(|&k| got[k].is_none()).collect();
                    Error::worker(
                        format!("drafter workers {silent:?}"),
                        format!("no answer within {} s (a stuck device or collective)", self.timeout.as_secs_f64()),
                    )
                }
            };
            return Err(self.stop(failure));
        }
        Ok(got.into_iter().map(|r| r.expect("all collected")).collect())
    }

    /// After `failure`: aborts every worker's reduction and the process group (the other
    /// processes fail at once) and marks the workers stopped.
    fn stop(&self, failure: Error) -> Error {
        for w in &self.workers {
            if let Some(abort) = &w.abort {
                abort();
            }
        }
        if let Some(group) = &self.process {
            group.abort();
        }
        *self.broken.borrow_mut() = Some(failure.to_string());
        failure
    }

    /// Sends `command(k)` to every worker, then collects the replies (see [`Self::collect`]).
    fn all(&self, command: impl Fn(usize) -> Command) -> Result<Vec<Reply>> {
        for k in 0..self.workers.len() {
            self.send(k, command(k))?;
        }
        self.collect(false)
    }

    /// Sends `command` to worker 0 only and waits for its reply.
    fn one(&self, command: Command) -> Result<Reply> {
        self.send(0, command)?;
        self.one_reply(0)
    }

    /// Worker `k`'s reply to a command sent to it alone.
    fn one_reply(&self, k: usize) -> Result<Reply> {
        let failure = match self.next_reply(self.timeout, false) {
            Ok((from, Ok(reply))) if from == k => return Ok(reply),
            Ok((from, Ok(_))) => worker_error(from, "an unexpected reply".into()),
            Ok((from, Err(message))) => worker_error(from, message),
            Err(Some(failure)) => failure,
            Err(None) => worker_error(k, format!("no answer within {} s", self.timeout.as_secs_f64())),
        };
        Err(self.stop(failure))
    }
}

fn worker_error(k: usize, message: String) -> Error {
    Error::worker(format!("drafter worker {k}"), message)
}

/// A worker's loop: makes its engine, then answers commands until the engine is dropped.
fn serve(
    k: usize,
    make: std::sync::Arc<MakeReplica>,
    inbox: Receiver<Command>,
    outbox: Sender<(usize, std::result::Result<Reply, String>)>,
) {
    let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| make(k)));
    let mut engine = match made.unwrap_or_else(|p| {
        Err(Error::worker(format!("drafter worker {k}"), format!("panicked: {}", panic_message(p))))
    }) {
        Ok(e) => {
            let _ = outbox.send((k, Ok(Reply::Made(e.abort()))));
            e
        }
        Err(e) => {
            let _ = outbox.send((k, Err(format!("making its engine: {e}"))));
            return;
        }
    };
    for command in inbox {
        // A panic is the worker's error (its engine is not used again: the run stops).
        let reply = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match command {
            Command::Accumulate { rows, total, want_stats, shape } => {
                let refs: Vec<(&TrainRow, &PreparedRow)> = rows.iter().map(|(r, p)| (r, p)).collect();
                engine.accumulate_rows(&refs, total, want_stats).and_then(|share| {
                    let on_device = match shape {
                        Some(shape) => engine.reduce_on_device(shape)?,
                        None => false,
                    };
                    let grads = match on_device {
                        true => None,
                        false => Some(engine.accumulated()?),
                    };
                    Ok(Reply::Accumulated(Box::new(share), grads))
                })
            }
            Command::Apply { shape, sum, lr, clip_norm } => {
                let set = match &sum {
                    Some(sum) => engine.set_accumulated(shape, sum),
                    None => Ok(()),
                };
                set.and_then(|()| engine.apply(lr, clip_norm)).map(|u| Reply::Applied(u, engine.planned_bytes()))
            }
            Command::Discard => engine.discard().map(|()| Reply::Done),
            Command::State => engine.state().map(|s| Reply::State(Box::new(s))),
            Command::Checkpointing => Ok(Reply::Checkpointing(engine.checkpointing())),
            Command::Restore(state) => engine.restore(&state).map(|()| Reply::Done),
            Command::Evaluate { rows, max_anchors, gamma, seed } => {
                engine.evaluate(&rows, max_anchors, gamma, seed).map(Reply::Evaluated)
            }
        }));
        let (reply, fatal) = match reply {
            Ok(reply) => (reply.map_err(|e| e.to_string()), false),
            Err(p) => (Err(format!("panicked: {}", panic_message(p))), true),
        };
        if outbox.send((k, reply)).is_err() || fatal {
            return;
        }
    }
}

impl Drop for DataParallel {
    fn drop(&mut self) {
        if let (Some(feed), Some(_)) = (&mut self.feed, self.broken.borrow().as_ref()) {
            feed.detach();
        }
        for w in &mut self.workers {
            // Closing the command channel ends the worker's loop.
            let (closed, _) = channel();
            drop(std::mem::replace(&mut w.commands, closed));
            // After a failure a worker may be stuck (a device or collective): leave it to the
            // process's exit rather than hang here.
            if let Some(t) = w.thread.take().filter(|_| self.broken.borrow().is_none()) {
                let _ = t.join();
            }
        }
    }
}

/// `rows` split into `parts` contiguous runs, the first ones one longer when it does not divide.
fn split<T>(rows: Vec<T>, parts: usize) -> Vec<Vec<T>> {
    let mut it = rows.into_iter();
    let n = it.len();
    (0..parts).map(|k| it.by_ref().take(part_range(n, parts, k..k + 1).len()).collect()).collect()
}

/// The rows of parts `of` when `n` rows are [`split`] into `parts`.
pub fn part_range(n: usize, parts: usize, of: std::ops::Range<usize>) -> std::ops::Range<usize> {
    let (base, extra) = (n / parts, n % parts);
    let start = |k: usize| k * base + k.min(extra);
    start(of.start)..start(of.end)
}

impl StepEngine for DataParallel {
    fn name(&self) -> String {
        let targets = self.feed.as_ref().map_or(String::new(), |f| format!(" fed by {} target workers", f.targets()));
        let process = self.process.as_ref();
        let process = process.map_or(String::new(), |g| format!(" on rank {} of {} processes", g.rank(), g.world()));
        format!("optimized, {} data-parallel workers{targets}{process}", self.workers.len())
    }

    /// This process's workers' parts (rank-major over every process's workers).
    fn own_rows(&self, rows: usize) -> std::ops::Range<usize> {
        let local = self.workers.len();
        let (rank, world) = self.process.as_ref().map_or((0, 1), |g| (g.rank(), g.world()));
        part_range(rows, local * world, rank * local..(rank + 1) * local)
    }

    fn step(&mut self, batch: &StepBatch, rng: &mut ChaCha8Rng) -> Result<StepOutcome> {
        self.host_copy = None;
        let outcome = self.step_rows(batch, rng)?;
        let waits = self.feed.as_ref().map(|feed| (outcome.waits.map_or(0.0, |w| w.0), feed.take_waited()));
        Ok(StepOutcome { waits, ..outcome })
    }

    fn state(&self) -> Result<EngineState> {
        self.state_of_worker_0()
    }

    fn restore(&mut self, state: &EngineState) -> Result<()> {
        self.restore_all(state)
    }

    /// Worker 0's (each worker chooses on its own device; they hold the same step).
    fn checkpointing(&self) -> Option<Checkpointing> {
        match self.one(Command::Checkpointing) {
            Ok(Reply::Checkpointing(policy)) => policy,
            _ => None,
        }
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
    /// One step over rows that carry their features (or are fed on the device).
    fn step_rows(&mut self, batch: &StepBatch, rng: &mut ChaCha8Rng) -> Result<StepOutcome> {
        let (prepared, total) = prepare_rows(batch, self.config.block_size, rng)?;
        let shape = prepared.first().map(|(_, p)| (p.input.layout.context_len, p.input.layout.anchors.len()));
        let owned: Vec<(TrainRow, PreparedRow)> = prepared.into_iter().map(|(r, p)| (r.clone(), p)).collect();
        // Every process's workers' parts, rank-major; this process steps its own.
        let local = self.workers.len();
        let (rank, world) = self.process.as_ref().map_or((0, 1), |g| (g.rank(), g.world()));
        let parts: Vec<_> = split(owned, local * world).into_iter().skip(rank * local).take(local).collect();
        let fed: Vec<Vec<Row>> = match self.feed.is_some() {
            true => parts.iter().map(|rows| rows.iter().map(|(r, _)| plain_row(r)).collect()).collect(),
            false => Vec::new(),
        };
        for (k, rows) in parts.into_iter().enumerate() {
            self.send(k, Command::Accumulate { rows, total, want_stats: batch.want_stats, shape })?;
        }
        self.feed_rows(fed);
        let mut share: Option<Share> = None;
        let mut sum: Option<Vec<f64>> = None;
        let mut on_device = false;
        for (k, reply) in self.collect(true)?.into_iter().enumerate() {
            let Reply::Accumulated(s, acc) = reply else {
                return Err(worker_error(k, "an unexpected reply".into()));
            };
            match &mut share {
                None => share = Some(*s),
                Some(all) => all.merge(*s),
            }
            // The fixed reduction order: worker 0, then 1, ...
            match (acc, &mut sum) {
                (None, _) => on_device = true,
                (Some(acc), None) => sum = Some(acc),
                (Some(acc), Some(sum)) if !acc.is_empty() && !sum.is_empty() => {
                    sum.iter_mut().zip(&acc).for_each(|(a, b)| *a += b)
                }
                (Some(acc), Some(sum)) if sum.is_empty() => *sum = acc,
                (Some(_), Some(_)) => {}
            }
        }
        let mut share = share.expect("at least one worker");
        if let Some(group) = &self.process {
            share = group.sum_shares(share).map_err(|e| self.stop(e))?;
        }
        let nothing = !on_device && sum.as_ref().is_none_or(|s| s.is_empty());
        if share.failed.is_some() || shape.is_none() || nothing {
            self.all(|_| Command::Discard)?;
            let update = share.failed.is_none().then_some(Ok(0.0));
            return Ok(share.outcome(total, update, None));
        }
        let (shape, sum) = (shape.expect("checked"), sum.filter(|_| !on_device));
        let replies =
            self.all(|_| Command::Apply { shape, sum: sum.clone(), lr: batch.lr, clip_norm: batch.clip_norm })?;
        // Worker 0's update (every worker applies the same), the largest worker's memory.
        let (mut update, mut device_bytes) = (None, None);
        for (k, reply) in replies.into_iter().enumerate() {
            let Reply::Applied(u, bytes) = reply else { return Err(worker_error(k, "an unexpected reply".into())) };
            update = update.or(Some(u));
            device_bytes = device_bytes.max(bytes);
        }
        Ok(share.outcome(total, update, device_bytes))
    }

    /// Queues every worker's rows with the feed (in the background: a stuck target worker leaves
    /// the wait for the drafters to the timeout).
    fn feed_rows(&mut self, rows: Vec<Vec<Row>>) {
        if let Some(feed) = &mut self.feed {
            feed.queue_rows(rows);
        }
    }

    /// The run's state: worker 0's (every replica holds the same), or every worker's shard of
    /// it joined.
    fn state_of_worker_0(&self) -> Result<EngineState> {
        if self.sharded {
            let states = self
                .all(|_| Command::State)?
                .into_iter()
                .enumerate()
                .map(|(k, r)| match r {
                    Reply::State(s) => Ok(*s),
                    _ => Err(worker_error(k, "an unexpected reply".into())),
                })
                .collect::<Result<Vec<_>>>()?;
            let shards = crate::engine::optimizer_shards(&self.config, self.workers.len());
            return EngineState::join(&states, &shards);
        }
        match self.one(Command::State)? {
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
        let rows = (0..rows.len()).map(|i| rows.row(i)).collect::<Result<Vec<_>>>()?;
        let fed = match self.feed.is_some() {
            true => vec![rows.iter().map(plain_row).collect()],
            false => Vec::new(),
        };
        self.send(0, Command::Evaluate { rows, max_anchors, gamma, seed })?;
        self.feed_rows(fed);
        match self.one_reply(0)? {
            Reply::Evaluated(e) => Ok(e),
            _ => Err(worker_error(0, "an unexpected reply".into())),
        }
    }
}

/// A training row as the target's forward reads it (one document when it has no ids).
fn plain_row(r: &TrainRow) -> Row {
    Row {
        tokens: r.tokens.clone(),
        loss_mask: r.loss_mask.clone(),
        doc_ids: r.doc_ids.clone().unwrap_or_else(|| vec![0; r.len()]),
        positions: r.positions.clone(),
    }
}
