//! The GPU as a backend: the device's memory pool, cuBLAS, the attention kernels,
//! `elementwise.cu` and `gdn.cu`, all on the GPU's one stream.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaStream, PinnedHostSlice};

use super::{Allocation, Backend, Pitched};
use crate::device::buffer::{copy_device, download_device, zero_device, Buf};
use crate::device::gpu::Gpu;
use crate::device::staging::UploadRing;
use crate::ops::attention::cuda::{AttentionKernels, DeviceKeyRanges};
use crate::ops::attention::ranges::KeyRanges;
use crate::ops::attention::AttnShape;
use crate::ops::elementwise::cuda::ElementwiseKernels;
use crate::ops::gdn::cuda::GdnKernels;
use crate::ops::gdn::GdnOps;
use crate::ops::matmul::cuda::{Blas, Out};
use crate::ops::matmul::Mat;
use crate::Result;

impl Allocation for Buf<u8> {
    fn ptr(&self) -> u64 {
        Buf::ptr(self)
    }
}

/// The H200 (or any CUDA GPU): the memory pool, cuBLAS, the attention kernels, the elementwise
/// kernels and the hybrid target's GatedDeltaNet kernels.
pub struct Cuda {
    name: String,
    stream: Arc<CudaStream>,
    kernels: ElementwiseKernels,
    attention: AttentionKernels,
    gdn: GdnKernels,
    blas: Blas,
    available: u64,
    /// Whether `linear` takes 1 to `LINEAR_ROWS` rows through `linear_rows` (the default) or
    /// through cuBLAS (the fallback, for benches that compare them).
    rows_kernel: AtomicBool,
    /// Page-locked host memory `download_parts` lands in (grown on demand), so that its copies
    /// queue without a wait each.
    readback: Mutex<Option<PinnedHostSlice<u8>>>,
    /// Page-locked slots `upload_ranges` stages plans in (made on first use), so that they queue
    /// without waiting for the stream.
    staging: Mutex<Option<UploadRing>>,
}

impl Cuda {
    /// Loads the kernels of `gpu` for heads of `head_dim`.
    pub fn new(gpu: &Gpu, head_dim: usize) -> Result<Self> {
        ElementwiseKernels::check_head_dim(head_dim)?;
        Ok(Cuda {
            name: gpu.name().to_string(),
            stream: gpu.stream().clone(),
            kernels: ElementwiseKernels::load(gpu)?,
            attention: AttentionKernels::load(gpu, head_dim)?,
            gdn: GdnKernels::load(gpu)?,
            blas: Blas::new(gpu)?,
            available: gpu.available_bytes()?,
            rows_kernel: AtomicBool::new(true),
            readback: Mutex::new(None),
            staging: Mutex::new(None),
        })
    }

    /// Sends `linear`'s 1 to `LINEAR_ROWS` rows through `linear_rows` (`true`, the default) or
    /// through cuBLAS.
    pub fn set_rows_kernel(&self, on: bool) {
        self.rows_kernel.store(on, Ordering::Relaxed);
    }
}

impl Backend for Cuda {
    type Elem = half::bf16;
    type Ops = ElementwiseKernels;
    type Alloc = Buf<u8>;
    type Ranges = DeviceKeyRanges;

    const KIND: &'static str = "GPU";

    fn name(&self) -> &str {
        &self.name
    }

    fn available_bytes(&self) -> Result<u64> {
        Ok(self.available)
    }

    fn alloc(&self, name: &str, bytes: usize) -> Result<Buf<u8>> {
        Buf::zeros(&self.stream, name, bytes)
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        // SAFETY: callers pass an allocation of at least `src.len()` bytes; the copy from pageable
        // memory completes before the call returns.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .and_then(|()| self.stream.synchronize())
            .map_err(|e| crate::Error::Gpu(format!("upload of {} bytes: {e}", src.len())))
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        let bytes = download_device::<u8>(&self.stream, src, dst.len())?;
        dst.copy_from_slice(&bytes);
        Ok(())
    }

    fn download_parts(&self, parts: &mut [(u64, &mut [u8])]) -> Result<()> {
        let gpu = |what: &'static str| move |e: cudarc::driver::DriverError| crate::Error::Gpu(format!("{what}: {e}"));
        let total: usize = parts.iter().map(|(_, dst)| dst.len()).sum();
        let mut readback = self.readback.lock().map_err(|_| crate::Error::Gpu("readback buffer poisoned".into()))?;
        if readback.as_ref().is_none_or(|p| p.len() < total) {
            // SAFETY: plain bytes; flags 0 (cached, not write-combined: the host reads them).
            let pinned = unsafe { self.stream.context().alloc_pinned_with_flags::<u8>(total.max(4096), 0) };
            *readback = Some(pinned.map_err(gpu("page-locked readback buffer"))?);
        }
        let staging = readback.as_mut().expect("allocated above").as_mut_slice().map_err(gpu("readback buffer"))?;
        let mut at = 0;
        for (src, dst) in parts.iter() {
            // SAFETY: callers pass live device ranges of `dst.len()` bytes; the staging slice
            // outlives the copy (the wait below).
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut staging[at..at + dst.len()],
                    *src,
                    self.stream.cu_stream(),
                )
            }
            .map_err(gpu("readback copy"))?;
            at += dst.len();
        }
        self.stream.synchronize().map_err(gpu("readback wait"))?;
        let mut at = 0;
        for (_, dst) in parts.iter_mut() {
            dst.copy_from_slice(&staging[at..at + dst.len()]);
            at += dst.len();
        }
        Ok(())
    }

    fn zero(&self, ptr: u64, bytes: usize) -> Result<()> {
        zero_device(&self.stream, ptr, bytes)
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        copy_device::<u8>(&self.stream, dst, src, bytes)
    }

    fn copy_strided(&self, dst: Pitched, src: Pitched, width: usize, rows: usize) -> Result<()> {
        if rows <= 1 || (dst.pitch == width && src.pitch == width) {
            return self.copy(dst.addr, src.addr, width * rows);
        }
        use cudarc::driver::sys;
        let copy = sys::CUDA_MEMCPY2D_st {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src.addr,
            srcArray: std::ptr::null_mut(),
            srcPitch: src.pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst.addr,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst.pitch,
            WidthInBytes: width,
            Height: rows,
        };
        // SAFETY: callers pass live device buffers holding `rows` rows at their pitches; the
        // stream orders the copy.
        unsafe { sys::cuMemcpy2DAsync_v2(&copy, self.stream.cu_stream()) }
            .result()
            .map_err(|e| crate::Error::Gpu(format!("strided copy of {rows} rows of {width} bytes: {e}")))
    }

    /// Through unified addressing (`cuMemcpyAsync` finds both devices from the addresses), peer
    /// to peer where the source's pool shares it ([`Gpu::share_pool_with`]).
    fn copy_from_peer(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // The copy goes to the context current on this thread: this GPU's.
        self.stream.context().bind_to_thread().map_err(|e| crate::Error::Gpu(format!("binding the context: {e}")))?;
        // SAFETY: callers pass allocations of at least `bytes` bytes, the source's complete.
        unsafe { cudarc::driver::sys::cuMemcpyAsync(dst, src, bytes, self.stream.cu_stream()) }
            .result()
            .and_then(|()| self.stream.synchronize())
            .map_err(|e| crate::Error::Gpu(format!("copy of {bytes} bytes from another GPU: {e}")))
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| crate::Error::Gpu(format!("synchronizing the stream: {e}")))
    }

    fn ops(&self) -> &ElementwiseKernels {
        &self.kernels
    }

    fn gdn_ops(&self) -> &dyn GdnOps {
        &self.gdn
    }

    fn matmul(&self, a: Mat, b: Mat, c: u64, beta: f32) -> Result<()> {
        self.blas.matmul(a, b, c, Out::Bf16, 1.0, beta)
    }

    /// 1 to `LINEAR_ROWS` rows (a plain step's one row, a verify block, the drafter's block)
    /// through `linear_rows`, which reads `w` at full bandwidth where cuBLAS's choices for few
    /// rows reach half to 90% of it (`results/gemm-h100*.json`); more rows through cuBLAS.
    fn linear(&self, x: u64, rows: usize, k: usize, w: u64, n: usize, y: u64, beta: f32) -> Result<()> {
        match self.rows_kernel.load(Ordering::Relaxed) && ElementwiseKernels::takes_linear_rows(x, w, rows, k) {
            true => self.kernels.linear_rows(x, w, y, (rows, n, k), beta),
            false => self.matmul(Mat::n(x, rows, k), Mat::t(w, n, k), y, beta),
        }
    }

    fn upload_ranges(&self, ranges: &KeyRanges) -> Result<DeviceKeyRanges> {
        let mut staging = self.staging.lock().map_err(|_| crate::Error::Gpu("upload slots poisoned".into()))?;
        if staging.is_none() {
            *staging = Some(UploadRing::new(&self.stream)?);
        }
        DeviceKeyRanges::upload_staged(&self.stream, ranges, staging.as_mut().expect("made above"))
    }

    fn attention_forward(
        &self,
        ranges: &DeviceKeyRanges,
        shape: AttnShape,
        qkv: (u64, u64, u64),
        out_lse: (u64, u64),
    ) -> Result<()> {
        self.attention.forward(&self.stream, ranges, shape, qkv, out_lse)
    }

    fn attention_backward(
        &self,
        ranges: &DeviceKeyRanges,
        shape: AttnShape,
        qkv: (u64, u64, u64),
        out_lse_dout: (u64, u64, u64),
        dsum: u64,
        grads: (u64, u64, u64),
    ) -> Result<()> {
        self.attention.backward(&self.stream, ranges, shape, qkv, out_lse_dout, dsum, grads)
    }
}
