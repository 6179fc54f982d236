//! Features on the device (spec section 9): target workers are threads that each own a target's
//! forward and a few slots of device memory `[S, F*H]`. A row queued for drafter worker `k`
//! (bounded queues) is run through the forward, its features are copied into a free slot and
//! waited for, and the slot's address goes to worker `k`, whose step reads the features in
//! place; the slot returns to its target worker when the drafter's step has read it (dropping
//! [`FedFeatures`]). A drafter worker takes its rows from the target workers in turn, in the
//! order the coordinator queued them ([`FeedPool::queue_rows`] and [`FeedEnd::next`] keep the same
//! cursor). Each side counts the seconds it waits for the other.
//!
//! Slots live on the target's device. A drafter worker copies a slot into its step's input (on
//! the same device, or peer to peer from another: `Backend::copy_from_peer`) and gives it back
//! at once, so the target refills it while the drafter steps. On the CPU twins the devices are
//! labels: the same protocol, over host memory.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use dflash_optimized::backend::{Allocation, Backend};
use dflash_optimized::model::TargetFeatures;
use dflash_optimized::ops::Elem;
use dflash_reference::data::Row;

use crate::error::{panic_message, Error, Result};

/// A row's features in a target worker's slot (filled and waited for); dropping it gives the
/// slot back.
pub struct FedFeatures {
    /// The slot's address: `[S, F*H]` stored values.
    pub addr: u64,
    /// The row's tokens (the drafter checks it got the row it steps).
    pub tokens: Vec<u32>,
    /// Model FLOPs of the target's forward on the row.
    pub flops: f64,
    /// Whether the slot is on another device than the drafter worker's (copied peer to peer).
    pub copy: bool,
    slot: usize,
    free: Sender<usize>,
}

impl Drop for FedFeatures {
    fn drop(&mut self) {
        // A stopped target worker needs its slot no more.
        let _ = self.free.send(self.slot);
    }
}

type Fed = std::result::Result<FedFeatures, String>;

/// A drafter worker's end of the feed: one queue from each target worker, read in turn.
pub struct FeedEnd {
    from: Vec<Receiver<Fed>>,
    next: usize,
    /// Whether some of its target workers are on another device (its rows' features copied).
    copies: bool,
    /// Seconds waited for features since the last [`FeedEnd::take_waited`].
    waited: f64,
}

impl FeedEnd {
    /// The features of the next row, which must be the row of `tokens`.
    pub fn next(&mut self, tokens: &[u32]) -> Result<FedFeatures> {
        let t = self.next % self.from.len();
        self.next += 1;
        let started = Instant::now();
        let got = self.from[t].recv();
        self.waited += started.elapsed().as_secs_f64();
        let name = format!("target worker {t}");
        match got {
            Ok(Ok(fed)) if fed.tokens == tokens => Ok(fed),
            Ok(Ok(_)) => Err(Error::option(name, "sent the features of another row (the feed is out of order)")),
            Ok(Err(message)) => Err(Error::option(name, message)),
            Err(_) => Err(Error::option(name, "stopped (its thread ended)")),
        }
    }

    /// Whether some rows' features come from another device (copied peer to peer).
    pub fn copies(&self) -> bool {
        self.copies
    }

    /// The seconds waited for features since the last call.
    pub fn take_waited(&mut self) -> f64 {
        std::mem::take(&mut self.waited)
    }
}

/// What a target worker runs: a row's features into one of its slots.
pub trait SlotFill {
    /// Computes `row`'s features into slot `slot` (below the count it was made with) and waits
    /// for them; returns the slot's address and the forward's model FLOPs.
    fn fill(&mut self, slot: usize, row: &Row) -> Result<(u64, f64)>;
}

/// Makes target worker `t`'s [`SlotFill`] with `slots` slots, in its own thread.
pub type MakeSlotFill = dyn Fn(usize, usize) -> Result<Box<dyn SlotFill>> + Send + Sync;

/// A target's forward (dense or hybrid) with `count` feature slots on its backend.
pub struct TargetSlots<B: Backend> {
    forward: Box<dyn TargetFeatures<Backend = B>>,
    slots: Vec<B::Alloc>,
}

impl<B: Backend> TargetSlots<B> {
    pub fn new(forward: Box<dyn TargetFeatures<Backend = B>>, count: usize) -> Result<Self> {
        let (t, fw) = forward.feature_shape();
        let bytes = t.checked_mul(fw).and_then(|n| n.checked_mul(B::Elem::BYTES));
        let bytes = bytes.ok_or_else(|| Error::option("max_len", "the feature slot's size overflows"))?;
        let slots = (0..count)
            .map(|i| forward.backend().alloc(&format!("feature slot {i}"), bytes))
            .collect::<dflash_optimized::Result<Vec<_>>>()?;
        Ok(TargetSlots { forward, slots })
    }
}

impl<B: Backend> SlotFill for TargetSlots<B> {
    fn fill(&mut self, slot: usize, row: &Row) -> Result<(u64, f64)> {
        let (t, fw) = self.forward.feature_shape();
        let s = row.tokens.len();
        if s > t {
            return Err(Error::option("rows", format!("a row of {s} tokens; the forward runs at most {t}")));
        }
        self.forward.run(&[row])?;
        let dst = self.slots[slot].ptr();
        let dev = self.forward.backend();
        dev.copy(dst, self.forward.features_addr(), s * fw * B::Elem::BYTES)?;
        dev.synchronize()?;
        Ok((dst, self.forward.row_flops(&row.doc_ids)))
    }
}

/// The pipeline's balance over a run (spec section 9): `waits` = (seconds the `drafters` drafter
/// workers waited for features, seconds the `targets` target workers waited for the drafters),
/// summed over steps that took `seconds`. A worker is busy when it is not waiting, and both sides
/// handle the same rows, so a row's cost on one side is that side's busy worker-seconds per row;
/// the ratio of the target's cost to the drafter's is how many target workers per drafter worker
/// keep both busy. Returns that ratio and a sentence for the run's end.
pub fn balance(waits: (f64, f64), seconds: f64, targets: usize, drafters: usize) -> Option<(f64, String)> {
    if seconds <= 0.0 || targets == 0 || drafters == 0 {
        return None;
    }
    let (t, d) = (targets as f64, drafters as f64);
    let idle_d = (waits.0 / (d * seconds)).clamp(0.0, 1.0);
    let idle_t = (waits.1 / (t * seconds)).clamp(0.0, 1.0);
    let busy_d = 1.0 - idle_d;
    if busy_d <= 0.0 {
        return None;
    }
    let ratio = t * (1.0 - idle_t) / (d * busy_d);
    let advice = match (idle_d > 0.1, idle_t > 0.1) {
        (true, _) => "the drafters wait for features: more target workers (or GPUs) would feed them",
        (false, true) => "the targets wait for the drafters: fewer target workers would do",
        (false, false) => "both sides are busy",
    };
    Some((
        ratio,
        format!(
            "pipeline: the drafter workers waited {:.0}% of the steps' time for features, the target workers {:.0}% for the drafters; {advice} (balanced at about {ratio:.2} target workers per drafter worker)",
            100.0 * idle_d,
            100.0 * idle_t
        ),
    ))
}

/// The feature slots of each target worker feeding `drafters` drafter workers: one per drafter
/// worker copying from it, and one being filled.
pub fn slots_per_target(drafters: usize) -> usize {
    drafters + 1
}

struct FeedWorker {
    rows: SyncSender<(Row, usize)>,
    thread: Option<JoinHandle<()>>,
}

/// The target workers of a feed (see the module doc).
pub struct FeedPool {
    workers: Vec<FeedWorker>,
    /// Per drafter worker: its next target worker (modulo their count), from `k*T/D` on.
    cursors: Vec<usize>,
    /// Nanoseconds the target workers waited for a free slot (the drafters' steps).
    waited_ns: Arc<AtomicU64>,
}

impl FeedPool {
    /// Starts a target worker on each device of `targets` feeding a drafter worker on each device
    /// of `drafters` (device ids: GPU ordinals, or labels on the CPU), each target worker making
    /// its forward with `make(t, slots)` in its thread, with [`slots_per_target`] slots and a
    /// queue of as many rows; returns the pool and drafter worker `k`'s end at `k`. An error
    /// making a forward names the target worker.
    pub fn new(targets: &[usize], drafters: &[usize], make: Arc<MakeSlotFill>) -> Result<(FeedPool, Vec<FeedEnd>)> {
        if targets.is_empty() || drafters.is_empty() {
            return Err(Error::option("target_workers", "a feed needs at least 1 target and 1 drafter worker"));
        }
        let slots = slots_per_target(drafters.len());
        let waited_ns = Arc::new(AtomicU64::new(0));
        // Drafter worker `k` starts at target worker `k mod targets`: the first rows of a step
        // go to different target workers.
        let mut ends: Vec<FeedEnd> = drafters
            .iter()
            .enumerate()
            .map(|(k, d)| FeedEnd { from: Vec::new(), next: k, copies: targets.iter().any(|t| t != d), waited: 0.0 })
            .collect();
        let mut workers = Vec::with_capacity(targets.len());
        let mut made = Vec::with_capacity(targets.len());
        for (t, &device) in targets.iter().enumerate() {
            let copy: Vec<bool> = drafters.iter().map(|&d| d != device).collect();
            let (rows, inbox) = sync_channel::<(Row, usize)>(slots);
            let mut outs = Vec::with_capacity(drafters.len());
            for end in &mut ends {
                let (out, from) = channel::<Fed>();
                outs.push(out);
                end.from.push(from);
            }
            let (ready, is_made) = channel::<std::result::Result<(), String>>();
            made.push(is_made);
            let (make, waited_ns) = (make.clone(), waited_ns.clone());
            let thread = std::thread::Builder::new()
                .name(format!("target-worker-{t}"))
                .spawn(move || {
                    let mut fill = match make(t, slots) {
                        Ok(f) => {
                            let _ = ready.send(Ok(()));
                            f
                        }
                        Err(e) => {
                            let _ = ready.send(Err(format!("making its forward: {e}")));
                            return;
                        }
                    };
                    let (free, freed) = channel::<usize>();
                    (0..slots).for_each(|i| free.send(i).expect("the receiver is here"));
                    for (row, k) in inbox {
                        let started = Instant::now();
                        let slot = freed.recv().expect("this thread holds a sender");
                        waited_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
                        // A panic is the worker's error, told to the drafters as any other.
                        let filled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fill.fill(slot, &row)));
                        let filled = filled.unwrap_or_else(|p| {
                            Err(Error::option(format!("target worker {t}"), format!("panicked: {}", panic_message(p))))
                        });
                        let fed = filled.map(|(addr, flops)| FedFeatures {
                            addr,
                            tokens: row.tokens,
                            flops,
                            copy: copy[k],
                            slot,
                            free: free.clone(),
                        });
                        match fed {
                            // A drafter worker that stopped dropped its end: the slot comes back.
                            Ok(fed) => drop(outs[k].send(Ok(fed))),
                            // Every drafter worker waiting on this one learns why it stopped.
                            Err(e) => {
                                outs.iter().for_each(|out| drop(out.send(Err(e.to_string()))));
                                return;
                            }
                        }
                    }
                })
                .map_err(|e| Error::option("target_workers", format!("worker {t}: cannot start its thread: {e}")))?;
            workers.push(FeedWorker { rows, thread: Some(thread) });
        }
        // Drafter k's rows start at target worker k*T/D: the drafters' rows of an update spread
        // over all T target workers (staggered by one, 6 targets fed 2 x 3 rows would idle 2).
        let cursors = (0..drafters.len()).map(|k| k * workers.len() / drafters.len()).collect();
        let pool = FeedPool { workers, cursors, waited_ns };
        for (t, is_made) in made.into_iter().enumerate() {
            match is_made.recv() {
                Ok(Ok(())) => {}
                Ok(Err(m)) => return Err(Error::option(format!("target worker {t}"), m)),
                Err(_) => return Err(Error::option(format!("target worker {t}"), "stopped while making its forward")),
            }
        }
        Ok((pool, ends))
    }

    pub fn targets(&self) -> usize {
        self.workers.len()
    }

    /// Queues `rows[k]` for drafter worker `k`, interleaved (row 0 of each worker, then row 1,
    /// ...) so that the workers step side by side, from a thread of its own: the queues are
    /// bounded, and the caller waits for the drafters (with a timeout) instead. A stopped target
    /// worker ends the queueing (the drafter worker waiting for it reports why).
    pub fn queue_rows(&mut self, rows: Vec<Vec<Row>>) {
        let mut order = Vec::new();
        let mut queues: Vec<std::vec::IntoIter<Row>> = rows.into_iter().map(Vec::into_iter).collect();
        while queues.iter().any(|q| q.len() > 0) {
            for (k, q) in queues.iter_mut().enumerate() {
                if let Some(row) = q.next() {
                    let t = self.cursors[k] % self.workers.len();
                    self.cursors[k] += 1;
                    order.push((t, row, k));
                }
            }
        }
        if order.is_empty() {
            return;
        }
        let senders: Vec<SyncSender<(Row, usize)>> = self.workers.iter().map(|w| w.rows.clone()).collect();
        // Its handle is dropped: it ends once its rows are queued, or at the process's exit.
        let _ = std::thread::Builder::new().name("feed-queue".into()).spawn(move || {
            for (t, row, k) in order {
                if senders[t].send((row, k)).is_err() {
                    return;
                }
            }
        });
    }

    /// Leaves the target workers' threads running at drop instead of joining them (after a
    /// failure, one may be stuck on its device): the process's exit ends them.
    pub fn detach(&mut self) {
        self.workers.iter_mut().for_each(|w| drop(w.thread.take()));
    }

    /// The seconds the target workers waited for free slots since the last call.
    pub fn take_waited(&self) -> f64 {
        self.waited_ns.swap(0, Ordering::Relaxed) as f64 * 1e-9
    }
}

impl Drop for FeedPool {
    fn drop(&mut self) {
        for w in &mut self.workers {
            let (closed, _) = sync_channel(1);
            drop(std::mem::replace(&mut w.rows, closed));
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}
