//! Page-locked staging of small host-to-device copies. A copy from pageable memory waits for the
//! work queued before it; one from page-locked memory queues on the stream like a kernel. So a
//! decode step's attention plans go through an [`UploadRing`]: they queue behind the step before
//! without a host round trip (spec section 4: none but the accept/reject decision).

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream, PinnedHostSlice};

use crate::{Error, Result};

fn gpu_err(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Gpu(format!("{what}: {e}"))
}

/// One page-locked slot and the event recorded after the last copy out of it.
struct Slot {
    host: PinnedHostSlice<u8>,
    copied: CudaEvent,
}

/// [`UploadRing::SLOTS`] page-locked slots of [`UploadRing::SLOT_BYTES`], used in turn. A slot is
/// written again only once the copy out of it has run (its event), so a copy's bytes are never
/// overwritten before the stream reaches it.
pub struct UploadRing {
    slots: Vec<Slot>,
    next: usize,
}

impl UploadRing {
    /// Slots in turn: a decode step queues at most 4 plans (2 layer kinds, drafter and target),
    /// so a slot comes back two steps after its copy was queued, long run by then.
    pub const SLOTS: usize = 8;
    /// A slot's bytes: a decode plan is a few hundred bytes; a training step's (S=3072, N=512)
    /// 14 KB. Larger copies are the caller's to make another way.
    pub const SLOT_BYTES: usize = 64 << 10;

    /// Allocates the slots (page-locked host memory) and their events on `stream`'s context.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        let ctx = stream.context();
        let slots = (0..Self::SLOTS)
            .map(|_| {
                // SAFETY: plain bytes, written before each copy out of them; flags 0 (cached).
                let host = unsafe { ctx.alloc_pinned_with_flags::<u8>(Self::SLOT_BYTES, 0) }
                    .map_err(gpu_err("page-locked upload slot"))?;
                let copied = ctx
                    .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(gpu_err("upload slot event"))?;
                Ok(Slot { host, copied })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(UploadRing { slots, next: 0 })
    }

    /// Queues the copy of `src` to the device address `dst` on `stream`, after the work queued
    /// before it and without waiting for that work; `Ok(false)` (nothing queued) when `src` is
    /// larger than a slot.
    ///
    /// # Safety
    /// `dst` must be a live device allocation of at least `src.len()` bytes until the stream has
    /// run the copy.
    pub unsafe fn upload(&mut self, stream: &Arc<CudaStream>, dst: u64, src: &[u8]) -> Result<bool> {
        if src.len() > Self::SLOT_BYTES {
            return Ok(false);
        }
        let slot = &mut self.slots[self.next];
        self.next = (self.next + 1) % Self::SLOTS;
        slot.copied.synchronize().map_err(gpu_err("waiting for an upload slot"))?;
        let host = slot.host.as_mut_slice().map_err(gpu_err("upload slot"))?;
        host[..src.len()].copy_from_slice(src);
        // SAFETY: the slot's bytes stay as written until the event recorded below has passed
        // (the wait above, when the slot comes round again); the caller vouches for `dst`.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, &host[..src.len()], stream.cu_stream()) }
            .map_err(gpu_err("queued upload"))?;
        slot.copied.record(stream).map_err(gpu_err("recording an upload slot's event"))?;
        Ok(true)
    }
}
