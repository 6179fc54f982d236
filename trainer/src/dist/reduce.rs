//! The all-reduce of the drafter workers' accumulated gradients where they live (spec section 9):
//! NCCL on GPUs ([`dflash_optimized::device::nccl::Rank`]), and its CPU twin [`HostGroup`] (an
//! in-process all-reduce in rank order, so CI runs the same protocol: every rank sums the same
//! gradient buckets in the same order, a failed or stuck rank aborts the others). A worker
//! starts each bucket's sum as its last row's backward finishes the bucket (NCCL on a stream of
//! its own, beside the backward) and waits for them all before the update.

use std::sync::{Arc, Condvar, Mutex};

use dflash_optimized::device::nccl::Rank;

use crate::error::{Error, Result};

/// Aborts a reduction group from any thread: every pending and later reduction fails.
pub type Abort = Arc<dyn Fn() + Send + Sync>;

/// One rank's all-reduce.
pub trait GradReduce {
    /// Sums `count` f32 at address `addr` (a bucket of the engine's gradient accumulator) over
    /// the ranks, in place: after the work this rank's device has queued so far, complete once
    /// [`GradReduce::wait`] returns (the CPU groups sum at once). Every rank makes the same
    /// calls in the same order.
    fn all_reduce_sum_f32(&self, addr: u64, count: usize) -> Result<()>;
    /// Waits for every sum started so far.
    fn wait(&self) -> Result<()> {
        Ok(())
    }
    fn abort(&self) -> Abort;
    /// With the optimizer state sharded: every rank's buffer at `addr` (values of `elem` bytes)
    /// holds fresh values in its own shard (`shards[rank]`, contiguous in rank order); after the
    /// call every rank holds all of them.
    fn all_gather_shards(&self, addr: u64, elem: usize, shards: &[(usize, usize)]) -> Result<()> {
        let _ = (addr, elem, shards);
        Err(Error::option("shard_optimizer", "this reduction group cannot gather sharded weights"))
    }
}

impl GradReduce for Rank {
    fn all_reduce_sum_f32(&self, addr: u64, count: usize) -> Result<()> {
        Ok(Rank::all_reduce_sum_f32(self, addr, count)?)
    }
    fn wait(&self) -> Result<()> {
        Ok(Rank::wait(self)?)
    }
    fn abort(&self) -> Abort {
        let handle = self.abort_handle();
        Arc::new(move || handle.abort())
    }
    fn all_gather_shards(&self, addr: u64, elem: usize, shards: &[(usize, usize)]) -> Result<()> {
        let bytes: Vec<(usize, usize)> = shards.iter().map(|&(lo, hi)| (lo * elem, (hi - lo) * elem)).collect();
        Ok(Rank::broadcast_parts(self, addr, &bytes)?)
    }
}

/// How long a host rank waits for the others before failing (a stuck peer): as long as the
/// coordinator waits for a worker, since a peer may be stepping, or evaluating on rank 0.
pub const HOST_REDUCE_TIMEOUT: std::time::Duration = super::WORKER_TIMEOUT;

#[derive(Default)]
struct Round {
    /// Each rank's bytes of the round being gathered.
    parts: Vec<Option<Vec<u8>>>,
    /// The last completed round's result, and its number.
    result: Arc<Vec<u8>>,
    done: u64,
    aborted: bool,
}

/// The CPU twin of an NCCL communicator over host memory (the `Host<f32>` backend's addresses):
/// ranks deposit their bytes, the last to arrive combines them in rank order (a fixed order: the
/// same bits at every run) and every rank reads the result.
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

impl HostRank {
    /// Deposits `mine`; once every rank has, `combine` (the parts in rank order) gives the
    /// round's result, which every rank gets.
    fn exchange(&self, mine: Vec<u8>, combine: impl FnOnce(Vec<Vec<u8>>) -> Result<Vec<u8>>) -> Result<Arc<Vec<u8>>> {
        let fail = |m: &str| Error::worker(format!("drafter worker {}", self.rank), m.to_string());
        let g = &self.group;
        let mut round = g.round.lock().map_err(|_| fail("the reduction group is poisoned"))?;
        if round.aborted {
            return Err(fail("the reduction was aborted (another worker failed)"));
        }
        let this = round.done;
        round.parts[self.rank] = Some(mine);
        if round.parts.iter().all(Option::is_some) {
            let parts = round.parts.iter_mut().map(|p| p.take().expect("all arrived")).collect();
            match combine(parts) {
                Ok(result) => round.result = Arc::new(result),
                Err(e) => {
                    round.aborted = true;
                    g.arrived.notify_all();
                    return Err(e);
                }
            }
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
                    "the other workers did not reach the collective within {} s",
                    HOST_REDUCE_TIMEOUT.as_secs()
                )));
            }
        }
        Ok(round.result.clone())
    }
}

impl GradReduce for HostRank {
    fn all_reduce_sum_f32(&self, addr: u64, count: usize) -> Result<()> {
        // SAFETY: the caller passes a live host buffer of `count` f32 that only this thread uses.
        let values = unsafe { std::slice::from_raw_parts_mut(addr as *mut f32, count) };
        let rank = self.rank;
        let sum = self.exchange(dflash_optimized::ops::bytes_of(values).to_vec(), |parts| {
            let mut sum = vec![0f32; count];
            for part in parts {
                if part.len() != count * 4 {
                    return Err(Error::worker(format!("drafter worker {rank}"), "ranks reduce different sizes"));
                }
                part.chunks_exact(4)
                    .zip(sum.iter_mut())
                    .for_each(|(b, a)| *a += f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            }
            Ok(dflash_optimized::ops::bytes_of(&sum).to_vec())
        })?;
        // SAFETY: as above, as bytes.
        unsafe { std::ptr::copy_nonoverlapping(sum.as_ptr(), addr as *mut u8, count * 4) };
        Ok(())
    }

    fn all_gather_shards(&self, addr: u64, elem: usize, shards: &[(usize, usize)]) -> Result<()> {
        let (lo, hi) = shards[self.rank];
        // SAFETY: the caller passes a live host buffer of `shards`' last end values of `elem` bytes.
        let mine = unsafe { std::slice::from_raw_parts((addr as usize + lo * elem) as *const u8, (hi - lo) * elem) };
        let all = self.exchange(mine.to_vec(), |parts| Ok(parts.concat()))?;
        let end = shards.last().map_or(0, |s| s.1) * elem;
        if all.len() != end {
            return Err(Error::worker(format!("drafter worker {}", self.rank), "shards that do not tile the weights"));
        }
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(all.as_ptr(), addr as *mut u8, end) };
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
