//! The CPU as a backend of the step: [`Host`] allocates in host memory and runs the CPU twins
//! (`ops::*::twin`) on the same layouts as the GPU, storing bf16 (the GPU step's twin), f32 or
//! f64 (the step against the reference at 1e-10), computing in the storage's arithmetic type.
//! Nothing allocates except the attention, whose heap `memory::attention::host_attention_bytes`
//! bounds, so a step's heap is its layout plus that.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::marker::PhantomData;

use super::{Allocation, Backend, Pitched};
use crate::memory::attention::host_attention_bytes;
use crate::ops::attention::ranges::KeyRanges;
use crate::ops::attention::twin::{attention_backward, attention_forward};
use crate::ops::attention::AttnShape;
use crate::ops::elementwise::twin::{ld, st, sta, ElementwiseTwin};
use crate::ops::gdn::twin::GdnTwin;
use crate::ops::gdn::GdnOps;
use crate::ops::matmul::{twin::matmul, Mat};
use crate::ops::{Elem, Real};
use crate::{Error, Result};

/// Alignment of host allocations (the GPU's 16-byte vector loads have their twin here).
const ALIGN: usize = 16;

/// A zeroed host allocation, freed on drop.
pub struct HostAlloc {
    ptr: *mut u8,
    layout: Layout,
}

impl Allocation for HostAlloc {
    fn ptr(&self) -> u64 {
        self.ptr as u64
    }
}

impl Drop for HostAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated by `alloc_zeroed` with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

/// The CPU as a backend, storing `E`.
pub struct Host<E> {
    ops: ElementwiseTwin<E>,
    gdn: GdnTwin<E>,
    /// What [`Backend::available_bytes`] reports: the host's available memory unless set.
    available: u64,
    _elem: PhantomData<E>,
}

impl<E> Host<E> {
    /// A CPU backend reporting `bytes` free, as a GPU of that size would (the memory-driven
    /// choices, e.g. the step's checkpointing policy, tested on the CPU).
    pub fn with_available(bytes: u64) -> Self {
        Host { available: bytes, ..Self::default() }
    }
}

impl<E> Default for Host<E> {
    fn default() -> Self {
        let available = host_available_bytes().unwrap_or(u64::MAX);
        Host { ops: ElementwiseTwin::default(), gdn: GdnTwin::default(), available, _elem: PhantomData }
    }
}

/// Test-only hook: bytes [`host_available_bytes`] reports instead of the host's (so that a test
/// of a refusal for memory gives the same outcome on any machine).
pub const HOST_AVAILABLE_ENV: &str = "DFLASH_TEST_HOST_AVAILABLE";

/// The memory the host can give new allocations without swapping: `MemAvailable` of
/// `/proc/meminfo` (`None` where it cannot be read), or [`HOST_AVAILABLE_ENV`] where set.
pub fn host_available_bytes() -> Option<u64> {
    if let Some(bytes) = std::env::var(HOST_AVAILABLE_ENV).ok().and_then(|v| v.parse().ok()) {
        return Some(bytes);
    }
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb = text.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?.trim().strip_suffix("kB")?;
    kb.trim().parse::<u64>().ok()?.checked_mul(1024)
}

/// `count` stored values from `p` in the arithmetic type (allocates: attention scratch only).
fn widen<E: Elem>(p: u64, count: usize) -> Vec<E::Acc> {
    (0..count).map(|i| ld::<E>(p, i)).collect()
}

fn elems(ranges: &KeyRanges, shape: AttnShape) -> (usize, usize) {
    let (nq, nk) = (ranges.num_queries, ranges.num_keys);
    (nq * shape.num_heads * shape.head_dim, nk * shape.num_kv_heads * shape.head_dim)
}

impl<E: Elem> Backend for Host<E> {
    type Elem = E;
    type Ops = ElementwiseTwin<E>;
    type Alloc = HostAlloc;
    type Ranges = KeyRanges;

    const KIND: &'static str = "CPU twins";

    fn name(&self) -> &str {
        "CPU"
    }

    fn available_bytes(&self) -> Result<u64> {
        Ok(self.available)
    }

    fn alloc(&self, name: &str, bytes: usize) -> Result<HostAlloc> {
        let layout = Layout::from_size_align(bytes.max(1), ALIGN)
            .map_err(|e| Error::Memory(format!("{name}: {bytes} bytes: {e}")))?;
        // SAFETY: the layout has a nonzero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::Memory(format!("{name}: out of host memory allocating {bytes} bytes")));
        }
        Ok(HostAlloc { ptr, layout })
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        // SAFETY: callers pass a buffer of at least `src.len()` bytes.
        unsafe { std::ptr::copy(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        // SAFETY: as `upload`.
        unsafe { std::ptr::copy(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn zero(&self, ptr: u64, bytes: usize) -> Result<()> {
        // SAFETY: as `upload`.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, bytes) };
        Ok(())
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: as `upload`.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    fn copy_strided(&self, dst: Pitched, src: Pitched, width: usize, rows: usize) -> Result<()> {
        let at = |p: Pitched, r: usize| p.addr + (r * p.pitch) as u64;
        (0..rows).try_for_each(|r| self.copy(at(dst, r), at(src, r), width))
    }

    /// Every CPU "device" shares the host's memory: a plain copy.
    fn copy_from_peer(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.copy(dst, src, bytes)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn ops(&self) -> &ElementwiseTwin<E> {
        &self.ops
    }

    fn gdn_ops(&self) -> &dyn GdnOps {
        &self.gdn
    }

    fn matmul(&self, a: Mat, b: Mat, c: u64, beta: f32) -> Result<()> {
        matmul::<E>(a, b, c, beta)
    }

    fn upload_ranges(&self, ranges: &KeyRanges) -> Result<KeyRanges> {
        Ok(ranges.clone())
    }

    fn attention_scratch_bytes(&self, ranges: &KeyRanges, shape: AttnShape) -> u64 {
        host_attention_bytes(ranges, shape, E::Acc::BYTES)
    }

    fn attention_forward(
        &self,
        ranges: &KeyRanges,
        shape: AttnShape,
        (q, k, v): (u64, u64, u64),
        (out, lse): (u64, u64),
    ) -> Result<()> {
        let (q_len, kv_len) = elems(ranges, shape);
        let scale = (shape.head_dim as f64).powf(-0.5);
        let (o, l) = attention_forward(
            ranges,
            shape,
            &widen::<E>(q, q_len),
            &widen::<E>(k, kv_len),
            &widen::<E>(v, kv_len),
            scale,
        )?;
        o.into_iter().enumerate().for_each(|(i, x)| st::<E>(out, i, x));
        l.into_iter().enumerate().for_each(|(i, x)| sta(lse, i, x));
        Ok(())
    }

    fn attention_backward(
        &self,
        ranges: &KeyRanges,
        shape: AttnShape,
        (q, k, v): (u64, u64, u64),
        (out, lse, dout): (u64, u64, u64),
        _dsum: u64,
        (dq, dk, dv): (u64, u64, u64),
    ) -> Result<()> {
        let (q_len, kv_len) = elems(ranges, shape);
        let scale = (shape.head_dim as f64).powf(-0.5);
        // SAFETY: lse is the layout's [nh, Q] buffer of the arithmetic type.
        let lse = unsafe { std::slice::from_raw_parts(lse as *const E::Acc, shape.num_heads * ranges.num_queries) };
        let (gq, gk, gv) = attention_backward(
            ranges,
            shape,
            &widen::<E>(q, q_len),
            &widen::<E>(k, kv_len),
            &widen::<E>(v, kv_len),
            &widen::<E>(out, q_len),
            lse,
            &widen::<E>(dout, q_len),
            scale,
        )?;
        for (dst, src) in [(dq, gq), (dk, gk), (dv, gv)] {
            src.into_iter().enumerate().for_each(|(i, x)| st::<E>(dst, i, x));
        }
        Ok(())
    }
}
