//! The all-reduce of the drafter workers' accumulated gradients where they live (spec section 9):
//! NCCL on GPUs ([`dflash_optimized::device::nccl::Rank`]), and its CPU twin [`HostGroup`] (an
//! in-process all-reduce in rank order, so CI runs the same protocol: every rank reduces after
//! its rows, a failed or stuck rank aborts the others).

use std::sync::{Arc, Condvar, Mutex};

use dflash_optimized::device::nccl::Rank;

use crate::error::{Error, Result};

/// Aborts a reduction group from any thread: every pending and later reduction fails.
pub type Abort = Arc<dyn Fn() + Send + Sync>;

/// One rank's all-reduce: sums `count` f32 at address `addr` (the engine's gradient
/// accumulator) over the ranks, in place, and waits for it.
pub trait GradReduce {
    fn all_reduce_sum_f32(&self, addr: u64, count: usize) -> Result<()>;
    fn abort(&self) -> Abort;
}

impl GradReduce for Rank {
    fn all_reduce_sum_f32(&self, addr: u64, count: usize) -> Result<()> {
        Ok(Rank::all_reduce_sum_f32(self, addr, count)?)
    }
    fn abort(&self) -> Abort {
        let handle = self.abort_handle();
        Arc::new(move || handle.abort())
    }
}

/// How long a host rank waits for the others before failing (a stuck peer): as long as the
/// coordinator waits for a worker, since a peer may be stepping, or evaluating on rank 0.
pub const HOST_REDUCE_TIMEOUT: std::time::Duration = super::WORKER_TIMEOUT;

#[derive(Default)]
struct Round {
    /// Each rank's values of the round being gathered.
    parts: Vec<Option<Vec<f32>>>,
    /// The last completed round's sum, and its number.
    sum: Arc<Vec<f32>>,
    done: u64,
    aborted: bool,
}

/// The CPU twin of an NCCL communicator over host memory (the `Host<f32>` backend's addresses):
/// ranks deposit their values, the last to arrive sums them in rank order (a fixed order: the
/// same bits at every run).
pub struct HostGroup {
    round: Mutex<Round>,
    arrived: Condvar,
}

/// One rank of a [`HostGroup`].
pub struct HostRank {
    group: Arc<HostGroup>,
    rank: usize,
}

impl HostGroup {
    /// The `world` ranks of a new group.
    pub fn ranks(world: usize) -> Vec<HostRank> {
        let round = Round { parts: vec![None; world], ..Round::default() };
        let group = Arc::new(HostGroup { round: Mutex::new(round), arrived: Condvar::new() });
        (0..world).map(|rank| HostRank { group: group.clone(), rank }).collect()
    }
}

impl GradReduce for HostRank {
    fn all_reduce_sum_f32(&self, addr: u64, count: usize) -> Result<()> {
        let fail = |m: &str| Error::option(format!("drafter worker {}", self.rank), m.to_string());
        // SAFETY: the caller passes a live host buffer of `count` f32 that only this thread uses.
        let values = unsafe { std::slice::from_raw_parts_mut(addr as *mut f32, count) };
        let g = &self.group;
        let mut round = g.round.lock().map_err(|_| fail("the reduction group is poisoned"))?;
        if round.aborted {
            return Err(fail("the reduction was aborted (another worker failed)"));
        }
        let this = round.done;
        round.parts[self.rank] = Some(values.to_vec());
        if round.parts.iter().all(Option::is_some) {
            let mut sum = vec![0f32; count];
            for part in round.parts.iter_mut().map(|p| p.take().expect("all arrived")) {
                if part.len() != count {
                    round.aborted = true;
                    g.arrived.notify_all();
                    return Err(fail("ranks reduce different sizes"));
                }
                sum.iter_mut().zip(&part).for_each(|(a, b)| *a += b);
            }
            round.sum = Arc::new(sum);
            round.done += 1;
            g.arrived.notify_all();
        } else {
            let (r, timeout) = g
                .arrived
                .wait_timeout_while(round, HOST_REDUCE_TIMEOUT, |r| r.done == this && !r.aborted)
                .map_err(|_| fail("the reduction group is poisoned"))?;
            round = r;
            if round.aborted {
                return Err(fail("the reduction was aborted (another worker failed)"));
            }
            if timeout.timed_out() {
                return Err(fail(&format!(
                    "the other workers did not reach the all-reduce within {} s",
                    HOST_REDUCE_TIMEOUT.as_secs()
                )));
            }
        }
        values.copy_from_slice(&round.sum);
        Ok(())
    }

    fn abort(&self) -> Abort {
        let group = self.group.clone();
        Arc::new(move || {
            if let Ok(mut round) = group.round.lock() {
                round.aborted = true;
            }
            group.arrived.notify_all();
        })
    }
}
