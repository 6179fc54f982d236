//! NCCL over the drafter GPUs (spec section 9): one rank per GPU, made and used in that GPU's
//! thread (an NCCL communicator is neither Send nor Sync). Gradient sums run on a stream of the
//! rank's own, each after the work its GPU's stream had queued when it was started, so that they
//! overlap the rest of the backward; broadcasts run on the GPU's stream. The library
//! (`libnccl.so`) is opened at run time on first use; a machine without it gets an error naming
//! it, not a panic.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::CudaStream;
use cudarc::nccl::{result, sys};

use super::gpu::Gpu;
use crate::{Error, Result};

/// The 128-byte id rank 0 makes and every rank joins with.
pub type UniqueId = [std::ffi::c_char; 128];

/// Runs an NCCL call, turning the loader's panic (no `libnccl.so`) into an error.
fn nccl<T>(what: &str, call: impl FnOnce() -> std::result::Result<T, result::NcclError>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(call)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Error::Gpu(format!("NCCL {what}: {e:?}"))),
        Err(_) => Err(Error::Gpu(format!("NCCL {what}: libnccl.so could not be opened (is NCCL installed?)"))),
    }
}

/// A new id for a communicator of several ranks (made once, by rank 0, and shared).
pub fn unique_id() -> Result<UniqueId> {
    nccl("ncclGetUniqueId", result::get_uniqueid).map(|id| id.internal)
}

/// The communicator's handle, for aborting it from another thread (a stuck or failed peer).
#[derive(Clone, Debug)]
pub struct AbortHandle {
    comm: usize,
    /// Set once the communicator is aborted or destroyed (whichever comes first frees it).
    ended: Arc<AtomicBool>,
}

impl AbortHandle {
    /// Aborts the communicator: its pending and later calls return an error.
    pub fn abort(&self) {
        if self.ended.swap(true, Ordering::SeqCst) {
            return;
        }
        // SAFETY: ncclCommAbort may be called from any thread on a live communicator (not yet
        // destroyed: `ended` was clear); the rank that owns it destroys nothing after this.
        let _ = catch_unwind(|| unsafe { result::comm_abort(self.comm as sys::ncclComm_t) });
    }
}

/// One rank of a communicator over `world` GPUs.
pub struct Rank {
    comm: sys::ncclComm_t,
    /// The GPU's stream (the step's work).
    stream: Arc<CudaStream>,
    /// The gradient sums' own stream.
    sums: Arc<CudaStream>,
    ended: Arc<AtomicBool>,
    pub rank: usize,
    pub world: usize,
}

impl Rank {
    /// Joins the communicator `id` as `rank` of `world` on `gpu` (blocks until every rank has).
    pub fn join(gpu: &Gpu, rank: usize, world: usize, id: &UniqueId) -> Result<Rank> {
        let (r, w) = (i32::try_from(rank), i32::try_from(world));
        let (Ok(r), Ok(w)) = (r, w) else {
            return Err(Error::invalid("NCCL rank", format!("rank {rank} of {world}: too many")));
        };
        if rank >= world {
            return Err(Error::invalid("NCCL rank", format!("rank {rank} of a world of {world}")));
        }
        let mut comm = std::mem::MaybeUninit::uninit();
        let id = sys::ncclUniqueId { internal: *id };
        // SAFETY: `comm` is written by ncclCommInitRank before it is read.
        let comm = nccl("ncclCommInitRank", || unsafe {
            result::comm_init_rank(comm.as_mut_ptr(), w, id, r).map(|_| comm.assume_init())
        })?;
        let stream = gpu.stream().clone();
        let sums = stream.context().new_stream().map_err(|e| Error::Gpu(format!("a stream for NCCL's sums: {e}")));
        let ended = Arc::new(AtomicBool::new(false));
        match sums {
            Ok(sums) => Ok(Rank { comm, stream, sums, ended, rank, world }),
            Err(e) => {
                // SAFETY: the communicator was just made and nothing is queued on it.
                let _ = catch_unwind(AssertUnwindSafe(|| unsafe { result::comm_destroy(comm) }));
                Err(e)
            }
        }
    }

    /// Starts summing `count` f32 at device address `addr` over the ranks, in place, after the
    /// work the GPU's stream has queued so far; [`Rank::wait`] waits for it.
    pub fn all_reduce_sum_f32(&self, addr: u64, count: usize) -> Result<()> {
        self.sums.join(&self.stream).map_err(|e| Error::Gpu(format!("ordering ncclAllReduce after the step: {e}")))?;
        // SAFETY: callers pass a live buffer of `count` f32 on this rank's GPU that nothing
        // writes before `wait`; the sums' stream orders it after the step's work.
        nccl("ncclAllReduce", || unsafe {
            result::all_reduce(
                addr as *const std::ffi::c_void,
                addr as *mut std::ffi::c_void,
                count,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                self.sums.cu_stream() as sys::cudaStream_t,
            )
        })
        .map(|_| ())
    }

    /// Waits for every sum started so far.
    pub fn wait(&self) -> Result<()> {
        self.sums.synchronize().map_err(|e| Error::Gpu(format!("after ncclAllReduce: {e}")))
    }

    /// Every rank's part of the buffer at `addr` to every rank: `parts[r]` = (byte offset, bytes)
    /// of rank `r`'s part, broadcast from `r` in place (one group of broadcasts); waits for it.
    pub fn broadcast_parts(&self, addr: u64, parts: &[(usize, usize)]) -> Result<()> {
        if parts.len() != self.world {
            return Err(Error::invalid("NCCL parts", format!("{} parts for {} ranks", parts.len(), self.world)));
        }
        nccl("ncclGroupStart", result::group_start)?;
        for (root, &(offset, bytes)) in parts.iter().enumerate() {
            let at = (addr + offset as u64) as *mut std::ffi::c_void;
            // SAFETY: callers pass a live buffer holding every part on this rank's GPU; the
            // stream orders it; the group is ended below whatever happens.
            let sent = nccl("ncclBroadcast", || unsafe {
                result::broadcast(
                    at,
                    at,
                    bytes,
                    sys::ncclDataType_t::ncclUint8,
                    root as i32,
                    self.comm,
                    self.stream.cu_stream() as sys::cudaStream_t,
                )
            });
            if let Err(e) = sent {
                let _ = nccl("ncclGroupEnd", result::group_end);
                return Err(e);
            }
        }
        nccl("ncclGroupEnd", result::group_end)?;
        self.stream.synchronize().map_err(|e| Error::Gpu(format!("after ncclBroadcast: {e}")))
    }

    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle { comm: self.comm as usize, ended: self.ended.clone() }
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        if self.ended.swap(true, Ordering::SeqCst) {
            return;
        }
        // Sums still queued (a step that stopped before its wait) finish first: a run that
        // stops on an error aborts every communicator, which returns above instead.
        let _ = self.sums.synchronize();
        // SAFETY: the communicator is live (not aborted) and nothing is queued on it.
        let _ = catch_unwind(AssertUnwindSafe(|| unsafe { result::comm_destroy(self.comm) }));
    }
}
