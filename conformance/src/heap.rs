//! A counting allocator for heap-peak tests: a test binary installs [`CountingAllocator`] as its
//! `#[global_allocator]`, then [`measure`] or [`HeapMeter`] read the live bytes and their
//! high-water mark. (nextest runs each test in its own process, so tests do not disturb each
//! other's counts.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use dflash_optimized::Result;

use crate::gpu_step::PeakMeter;

/// The system allocator, counting live heap bytes and their high-water mark.
pub struct CountingAllocator;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
            PEAK.fetch_max(live, Ordering::SeqCst);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
    }
}

/// Runs `f` and returns its result and the heap bytes it added at its peak.
pub fn measure<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let before = LIVE.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    let result = f();
    (result, PEAK.load(Ordering::SeqCst) - before)
}

/// The heap as a [`PeakMeter`].
#[derive(Default)]
pub struct HeapMeter {
    before: usize,
}

impl PeakMeter for HeapMeter {
    fn start(&mut self) -> Result<()> {
        self.before = LIVE.load(Ordering::SeqCst);
        PEAK.store(self.before, Ordering::SeqCst);
        Ok(())
    }

    fn forget_peak(&mut self) -> Result<()> {
        PEAK.store(LIVE.load(Ordering::SeqCst), Ordering::SeqCst);
        Ok(())
    }

    fn peak(&mut self) -> Result<u64> {
        Ok(PEAK.load(Ordering::SeqCst).saturating_sub(self.before) as u64)
    }
}
