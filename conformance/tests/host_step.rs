//! The planned training step on the CPU (`step::gpu::host`): the GPU step's driver, buffers and
//! bf16 layouts with the CPU twins of its kernels. Against the reference in f64 on bf16-exact
//! inputs (the GPU step's bound), under every checkpointing policy (identical gradients), with
//! its heap peak from a counting allocator against the plan.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use dflash_conformance::gpu_step::{planned_step_checks, PeakMeter};
use dflash_optimized::step::gpu::host::Host;
use dflash_reference::Result;

/// Counts live heap bytes and their high-water mark.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
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

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The heap measured by the counting allocator.
struct HeapMeter {
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

/// Heap the step holds besides its planned buffers: the names, addresses and parameter slots of
/// about a hundred buffers (a few kB), and the attention plans' host copies; 64 KiB bounds them.
const BOOKKEEPING_BYTES: u64 = 64 << 10;

#[test]
fn planned_step_on_the_cpu_matches_the_reference_within_its_plan() {
    // The tests of this binary share the counting allocator: this is its only test.
    for seed in [1u64, 2, 3] {
        let checks = planned_step_checks(
            seed,
            "cpu step",
            || Ok(Host::default()),
            &mut HeapMeter { before: 0 },
            BOOKKEEPING_BYTES,
        )
        .expect("the planned step on the CPU");
        for c in &checks {
            println!("{} errors {:?} memory {:?}", c.name, c.errors, c.memory);
            assert!(
                c.pass(),
                "{}: errors {:?} (bound {}), memory (measured, planned) {:?}",
                c.name,
                c.errors,
                c.tolerance,
                c.memory
            );
        }
    }
}
