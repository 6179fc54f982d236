//! One CUDA GPU through cudarc (GPU.md, the project's H200 notes): context and stream, NVRTC-compiled kernel modules
//! (compiled once per module per process), the memory pool's high-water mark, and CUDA-event
//! timing.
//!
//! cudarc opens the driver (`libcuda.so`) and NVRTC (`libnvrtc.so.13`) at run time, so the binary
//! builds and runs without a CUDA toolkit: [`Gpu::open`] answers `Ok(None)` on a machine without a
//! driver or a device (the CPU path is used there), and compiling a kernel fails with an error,
//! not a panic, when NVRTC is not found (`LD_LIBRARY_PATH=/usr/local/cuda/lib64` on the H200).
//!
//! All work goes to one stream, the context's default (null) stream (a second worker on the same
//! GPU opens it with a stream of its own), so that allocations, kernels and copies are ordered
//! without events; device memory comes from the device's default memory
//! pool (stream-ordered allocation), whose release threshold is raised so that freed memory is
//! kept for reuse instead of being returned to the driver at every synchronisation.

use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use crate::{Error, Result};
use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaModule, CudaStream, DriverError};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

/// The virtual architecture kernels are compiled for (H100 / H200, with the `a` features: wgmma,
/// setmaxnreg).
pub const ARCH: &str = "compute_90a";

/// A CUDA device, its context and the stream all work is queued on.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    /// Loaded modules by module name, with the source each was compiled from.
    modules: Mutex<HashMap<&'static str, LoadedModule>>,
}

struct LoadedModule {
    source: &'static str,
    module: Arc<CudaModule>,
}

fn driver_error(operation: &str, e: DriverError) -> Error {
    Error::Gpu(format!("{operation}: {e}"))
}

impl Gpu {
    /// Opens device `ordinal`. `Ok(None)` when there is no CUDA driver library or no CUDA device
    /// (a machine without a GPU); an error when the driver fails otherwise, or when `ordinal` is
    /// not below the number of devices.
    pub fn open(ordinal: usize) -> Result<Option<Gpu>> {
        Self::open_on(ordinal, false)
    }

    /// [`Gpu::open`] with a stream of its own (non-blocking) instead of the device's default
    /// stream: a second worker on the same GPU (a target worker beside a drafter worker) whose
    /// work overlaps the other's.
    pub fn open_own_stream(ordinal: usize) -> Result<Option<Gpu>> {
        Self::open_on(ordinal, true)
    }

    /// How many CUDA devices this machine has: 0 without a driver library or a device.
    pub fn count() -> Result<usize> {
        // SAFETY: only tries to load the driver library (and unloads it again).
        if !unsafe { sys::is_culib_present() } {
            return Ok(0);
        }
        match catch_unwind(CudaContext::device_count) {
            Ok(Ok(count)) => Ok(usize::try_from(count).unwrap_or(0)),
            Ok(Err(DriverError(sys::CUresult::CUDA_ERROR_NO_DEVICE))) => Ok(0),
            Ok(Err(e)) => Err(driver_error("initialising the CUDA driver (cuInit, cuDeviceGetCount)", e)),
            Err(_) => Err(Error::Gpu("the CUDA driver library is unusable (older than CUDA 13.0?)".into())),
        }
    }

    fn open_on(ordinal: usize, own_stream: bool) -> Result<Option<Gpu>> {
        // SAFETY: only tries to load the driver library (and unloads it again).
        if !unsafe { sys::is_culib_present() } {
            return Ok(None);
        }
        // cudarc resolves each driver function on first use and panics when the library lacks it
        // (a driver older than the CUDA 13.0 API it was built for): that becomes an error.
        catch_unwind(AssertUnwindSafe(|| Self::open_with_driver(ordinal, own_stream))).unwrap_or_else(|panic| {
            let message = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            Err(Error::Gpu(format!(
                "opening GPU {ordinal}: the CUDA driver library is unusable (older than CUDA 13.0?): {message}"
            )))
        })
    }

    fn open_with_driver(ordinal: usize, own_stream: bool) -> Result<Option<Gpu>> {
        let count = match CudaContext::device_count() {
            Ok(count) => usize::try_from(count).unwrap_or(0),
            Err(DriverError(sys::CUresult::CUDA_ERROR_NO_DEVICE)) => 0,
            Err(e) => return Err(driver_error("initialising the CUDA driver (cuInit, cuDeviceGetCount)", e)),
        };
        if count == 0 {
            return Ok(None);
        }
        if ordinal >= count {
            return Err(Error::Gpu(format!("GPU {ordinal} requested, but this machine has {count} CUDA device(s)")));
        }
        let ctx =
            CudaContext::new(ordinal).map_err(|e| driver_error(&format!("creating a context on GPU {ordinal}"), e))?;
        let name = ctx.name().map_err(|e| driver_error("cuDeviceGetName", e))?;
        // SAFETY: all work of this context goes to its one stream (see the module doc), which
        // orders every access; cudarc's per-buffer events would only add overhead to launches.
        unsafe { ctx.disable_event_tracking() };
        let stream = match own_stream {
            true => ctx.new_stream().map_err(|e| driver_error(&format!("creating a stream on GPU {ordinal}"), e))?,
            false => ctx.default_stream(),
        };
        let gpu = Gpu { ctx, stream, name, modules: Mutex::new(HashMap::new()) };
        if gpu.ctx.has_async_alloc() {
            let mut keep_all = u64::MAX;
            gpu.set_pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &mut keep_all)?;
        }
        Ok(Some(gpu))
    }

    /// The device's name, e.g. `NVIDIA H200`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The stream all work of this GPU is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Kernel `name` of `module`, compiled from `source` (CUDA C) by NVRTC for [`ARCH`] on first
    /// use of `module` in this process, then taken from the cache. `module` names the source in
    /// errors and in NVRTC's log (`module.cu`); one module name must always come with the same
    /// source. Include path: `$CUDA_HOME/include` (default `/usr/local/cuda/include`, where
    /// `cuda_bf16.h` lives); options `--std=c++17 --generate-line-info` (NVRTC optimises device
    /// code fully by default). A compile error carries NVRTC's log.
    pub fn function(&self, module: &'static str, source: &'static str, name: &str) -> Result<CudaFunction> {
        if name.contains('\0') {
            return Err(Error::Gpu(format!("kernel name {name:?} of module `{module}` contains a NUL byte")));
        }
        let loaded = self.module(module, source)?;
        loaded
            .load_function(name)
            .map_err(|e| driver_error(&format!("loading kernel `{name}` of module `{module}`"), e))
    }

    fn module(&self, module: &'static str, source: &'static str) -> Result<Arc<CudaModule>> {
        // A panic while the lock was held cannot leave a half-inserted entry: use the map as is.
        let mut modules = self.modules.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(loaded) = modules.get(module) {
            if std::ptr::eq(loaded.source, source) || loaded.source == source {
                return Ok(loaded.module.clone());
            }
            return Err(Error::Gpu(format!("module `{module}` was already compiled from a different source")));
        }
        let ptx = compile(module, source)?;
        let loaded = self.ctx.load_module(ptx).map_err(|e| driver_error(&format!("loading module `{module}`"), e))?;
        modules.insert(module, LoadedModule { source, module: loaded.clone() });
        Ok(loaded)
    }

    /// Lets the GPUs `peers` read this GPU's memory-pool allocations directly (drafter workers
    /// copying a target worker's feature slots from this GPU, over NVLink or PCIe): pool memory
    /// is readable by its own device only until its pool grants access. Fails naming both GPUs
    /// when a peer has no direct path to this one.
    pub fn share_pool_with(&self, peers: &[usize]) -> Result<()> {
        let own = self.ctx.ordinal();
        if !self.ctx.has_async_alloc() {
            // Plain allocations (no pool): copied between devices through unified addressing
            // without a grant.
            return Ok(());
        }
        let pool = self.default_pool()?;
        for &peer in peers.iter().filter(|&&p| p != own) {
            let peer_dev = result::device::get(peer as i32).map_err(|e| driver_error(&format!("GPU {peer}"), e))?;
            let mut can = 0;
            // SAFETY: both devices come from the initialised driver; `can` receives an int.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, peer_dev, self.ctx.cu_device()) }
                .result()
                .map_err(|e| driver_error(&format!("cuDeviceCanAccessPeer(GPU {peer}, GPU {own})"), e))?;
            if can == 0 {
                return Err(Error::Gpu(format!(
                    "GPU {peer} cannot read GPU {own}'s memory directly (no peer-to-peer path between them): put the target workers on GPUs their drafter workers can reach, on the drafters' own GPUs, or cache the features offline (`xtask features`)"
                )));
            }
            let access = sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: peer as i32,
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: one access descriptor for the pool of this live context's device.
            unsafe { sys::cuMemPoolSetAccess(pool, &access, 1) }
                .result()
                .map_err(|e| driver_error(&format!("cuMemPoolSetAccess(GPU {own}'s pool, GPU {peer})"), e))?;
        }
        Ok(())
    }

    /// Highest memory in use in the device's default memory pool since it was opened or since
    /// [`Gpu::reset_pool_high`], in bytes (like `torch.cuda.max_memory_allocated`), after
    /// synchronising the stream.
    pub fn pool_used_high(&self) -> Result<u64> {
        self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
    }

    /// Restarts [`Gpu::pool_used_high`] from the memory in use now, after synchronising the stream.
    pub fn reset_pool_high(&self) -> Result<()> {
        self.synchronize()?;
        let mut zero = 0u64;
        self.set_pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, &mut zero)
    }

    /// `(free, total)` device memory in bytes, as the driver reports it (`cuMemGetInfo`).
    pub fn memory_info(&self) -> Result<(u64, u64)> {
        let (free, total) = self.ctx.mem_get_info().map_err(|e| driver_error("cuMemGetInfo", e))?;
        Ok((free as u64, total as u64))
    }

    /// Bytes a new allocation can get: the driver's free memory plus what the memory pool holds
    /// but does not use (freed buffers it keeps for reuse).
    pub fn available_bytes(&self) -> Result<u64> {
        let (free, _) = self.memory_info()?;
        let reserved = self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        Ok(free + reserved.saturating_sub(self.pool_used()?))
    }

    /// Memory in use in the device's default memory pool, in bytes, after synchronising the stream.
    pub fn pool_used(&self) -> Result<u64> {
        self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }

    /// Median time in ms of `iters` calls of `f` (CUDA events recorded on the stream around each
    /// call), after `warmup` calls that are not timed. `f` queues its work on [`Gpu::stream`].
    pub fn time_ms(&self, warmup: usize, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        if iters == 0 {
            return Err(Error::invalid("iters", "timing needs at least 1 iteration"));
        }
        for _ in 0..warmup {
            f()?;
        }
        let event = || {
            self.ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| driver_error("creating a timing event", e))
        };
        let (start, end) = (event()?, event()?);
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            start.record(&self.stream).map_err(|e| driver_error("recording the start event", e))?;
            f()?;
            end.record(&self.stream).map_err(|e| driver_error("recording the end event", e))?;
            times.push(f64::from(start.elapsed_ms(&end).map_err(|e| driver_error("reading the event timer", e))?));
        }
        Ok(median(&mut times))
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| driver_error(&format!("synchronising the stream of {}", self.name), e))
    }

    fn default_pool(&self) -> Result<sys::CUmemoryPool> {
        if !self.ctx.has_async_alloc() {
            return Err(Error::Gpu(format!("{} has no stream-ordered memory pool to measure", self.name)));
        }
        // SAFETY: the device comes from a live context.
        unsafe { result::device::get_default_mem_pool(self.ctx.cu_device()) }
            .map_err(|e| driver_error("cuDeviceGetDefaultMemPool", e))
    }

    fn pool_attribute(&self, attribute: sys::CUmemPool_attribute) -> Result<u64> {
        self.synchronize()?;
        let pool = self.default_pool()?;
        let mut value = 0u64;
        // SAFETY: the usage attributes are `cuuint64_t`, written into `value`.
        unsafe { result::mem_pool::get_attribute(pool, attribute, &mut value as *mut u64 as *mut c_void) }
            .map_err(|e| driver_error(&format!("cuMemPoolGetAttribute({attribute:?})"), e))?;
        Ok(value)
    }

    fn set_pool_attribute(&self, attribute: sys::CUmemPool_attribute, value: &mut u64) -> Result<()> {
        let pool = self.default_pool()?;
        // SAFETY: the release threshold and the high-water marks are `cuuint64_t`, read from `value`.
        unsafe { result::mem_pool::set_attribute(pool, attribute, value as *mut u64 as *mut c_void) }
            .map_err(|e| driver_error(&format!("cuMemPoolSetAttribute({attribute:?})"), e))
    }
}

/// Whether the NVRTC library can be opened here (no GPU needed): `cargo xtask gpu-bundle` then
/// compiles every kernel before the binary goes to the GPU machine.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to load the NVRTC library (and unloads it again).
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles `source` to PTX with NVRTC (no GPU needed); errors name the module and carry NVRTC's
/// log.
pub fn compile(module: &str, source: &str) -> Result<Ptx> {
    let what = format!("compiling module `{module}` with NVRTC");
    if module.contains('\0') || source.contains('\0') {
        return Err(Error::Gpu(format!("{what}: the module name or source contains a NUL byte")));
    }
    if !nvrtc_present() {
        return Err(Error::Gpu(format!(
            "{what}: the NVRTC library (libnvrtc.so.13) was not found; run with LD_LIBRARY_PATH=/usr/local/cuda/lib64"
        )));
    }
    let cuda_home = std::env::var("CUDA_HOME").unwrap_or_else(|_| "/usr/local/cuda".to_string());
    let options = CompileOptions {
        arch: Some(ARCH),
        include_paths: vec![format!("{cuda_home}/include")],
        options: vec!["--std=c++17".to_string(), "--generate-line-info".to_string()],
        name: Some(format!("{module}.cu")),
        ..CompileOptions::default()
    };
    compile_ptx_with_opts(source, options).map_err(|e| match e {
        CompileError::CompileError { nvrtc, options, log } => {
            Error::Gpu(format!("{what} ({}) failed: {nvrtc}\n{}", options.join(" "), log.to_string_lossy().trim_end()))
        }
        other => Error::Gpu(format!("{what}: {other}")),
    })
}

/// The median of `values` (the mean of the two middle ones for an even count); `values` is
/// sorted in place and must not be empty.
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CI has no GPU: opening one must answer `Ok(None)`, not panic. On a machine with a driver
    /// and a device it opens the device instead.
    #[test]
    fn open_without_a_driver_is_none_and_does_not_panic() {
        let driver_present = unsafe { sys::is_culib_present() };
        match Gpu::open(0) {
            Ok(None) => {}
            Ok(Some(gpu)) => assert!(driver_present, "opened {} without a driver library", gpu.name()),
            Err(e) => panic!("opening GPU 0 failed (driver library present: {driver_present}): {e}"),
        }
        if !driver_present {
            assert!(matches!(Gpu::open(3), Ok(None)), "any ordinal is None without a driver");
        }
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
