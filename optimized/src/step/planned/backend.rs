//! Where the planned step runs: memory, copies, matmuls, attention and the [`StepOps`], on raw
//! addresses. [`Cuda`] is the GPU (cuBLAS, the attention kernels, `step.cu`); `super::host::Host`
//! runs the same step on the CPU with the kernels' twins, so CI exercises the step driver and
//! measures its heap against the plan.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use dflash_reference::Result;

use super::device::{copy_device, download_device, zero_device, Buf};
use super::kernels::{StepKernels, StepOps};
use crate::attention::cpu::AttnShape;
use crate::attention::cuda::{AttentionKernels, DevicePlan};
use crate::attention::plan::AttentionPlan;
use crate::blas::{Blas, Mat, Out};
use crate::gpu::Gpu;

/// What a backend stores weights, activations and step gradients in: bf16 on the GPU, bf16 or
/// f32 on the CPU.
pub trait Elem: Copy + Default + Send + Sync + 'static {
    const BYTES: usize;
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl Elem for half::bf16 {
    const BYTES: usize = 2;

    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }

    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}

impl Elem for f32 {
    const BYTES: usize = 4;

    fn from_f32(x: f32) -> Self {
        x
    }

    fn to_f32(self) -> f32 {
        self
    }
}

/// An allocation of a backend, freed on drop.
pub trait Allocation {
    /// The address of byte 0.
    fn ptr(&self) -> u64;
}

impl Allocation for Buf<u8> {
    fn ptr(&self) -> u64 {
        Buf::ptr(self)
    }
}

/// Memory and operations of the planned step (values stored as [`Backend::Elem`] unless
/// stated).
pub trait Backend {
    type Elem: Elem;
    type Ops: StepOps;
    type Alloc: Allocation;
    /// An attention plan where the backend's attention reads it.
    type Plan;

    /// What runs the step, e.g. `NVIDIA H200`.
    fn name(&self) -> &str;
    /// Bytes a new allocation can get.
    fn available_bytes(&self) -> Result<u64>;
    /// `bytes` zeroed bytes, named `name` in errors.
    fn alloc(&self, name: &str, bytes: usize) -> Result<Self::Alloc>;
    fn upload(&self, dst: u64, src: &[u8]) -> Result<()>;
    /// Fills `dst` from address `src` (waits for queued work).
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()>;
    fn zero(&self, ptr: u64, bytes: usize) -> Result<()>;
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()>;
    fn ops(&self) -> &Self::Ops;
    /// `c [m, n] = a @ b + beta * c`, fp32 accumulation.
    fn matmul(&self, a: Mat, b: Mat, c: u64, beta: f32) -> Result<()>;
    fn upload_plan(&self, plan: &AttentionPlan) -> Result<Self::Plan>;
    /// Memory the attention takes beyond the plan's buffers under `plan` (none on the GPU).
    fn attention_scratch_bytes(&self, _plan: &Self::Plan, _shape: AttnShape) -> u64 {
        0
    }
    /// `out [Q, nh, d]` and `lse [nh, Q]` (fp32) from q, k, v.
    fn attention_forward(
        &self,
        plan: &Self::Plan,
        shape: AttnShape,
        qkv: (u64, u64, u64),
        out_lse: (u64, u64),
    ) -> Result<()>;
    /// dq, dk, dv from q, k, v, out, lse and dout; `dsum [nh, Q]` is scratch the backend may use.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        plan: &Self::Plan,
        shape: AttnShape,
        qkv: (u64, u64, u64),
        out_lse_dout: (u64, u64, u64),
        dsum: u64,
        grads: (u64, u64, u64),
    ) -> Result<()>;
}

/// `len` values of `T` from address `src` of `backend`.
pub fn download<T: Copy + Default, B: Backend>(backend: &B, src: u64, len: usize) -> Result<Vec<T>> {
    let mut out = vec![T::default(); len];
    // SAFETY: plain-old-data values viewed as their bytes.
    let bytes = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, std::mem::size_of_val(&out[..])) };
    backend.download(src, bytes)?;
    Ok(out)
}

/// The H200 (or any CUDA GPU): the memory pool, cuBLAS, the attention kernels and `step.cu`.
pub struct Cuda {
    name: String,
    stream: Arc<CudaStream>,
    kernels: StepKernels,
    attention: AttentionKernels,
    blas: Blas,
    available: u64,
}

impl Cuda {
    /// Loads the kernels of `gpu` for heads of `head_dim`.
    pub fn new(gpu: &Gpu, head_dim: usize) -> Result<Self> {
        StepKernels::check_head_dim(head_dim)?;
        Ok(Cuda {
            name: gpu.name().to_string(),
            stream: gpu.stream().clone(),
            kernels: StepKernels::load(gpu)?,
            attention: AttentionKernels::load(gpu, head_dim)?,
            blas: Blas::new(gpu)?,
            available: gpu.available_bytes()?,
        })
    }
}

impl Backend for Cuda {
    type Elem = half::bf16;
    type Ops = StepKernels;
    type Alloc = Buf<u8>;
    type Plan = DevicePlan;

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
            .map_err(|e| dflash_reference::Error::Gpu(format!("upload of {} bytes: {e}", src.len())))
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        let bytes = download_device::<u8>(&self.stream, src, dst.len())?;
        dst.copy_from_slice(&bytes);
        Ok(())
    }

    fn zero(&self, ptr: u64, bytes: usize) -> Result<()> {
        zero_device(&self.stream, ptr, bytes)
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        copy_device::<u8>(&self.stream, dst, src, bytes)
    }

    fn ops(&self) -> &StepKernels {
        &self.kernels
    }

    fn matmul(&self, a: Mat, b: Mat, c: u64, beta: f32) -> Result<()> {
        self.blas.matmul(a, b, c, Out::Bf16, 1.0, beta)
    }

    fn upload_plan(&self, plan: &AttentionPlan) -> Result<DevicePlan> {
        DevicePlan::upload(&self.stream, plan)
    }

    fn attention_forward(
        &self,
        plan: &DevicePlan,
        shape: AttnShape,
        qkv: (u64, u64, u64),
        out_lse: (u64, u64),
    ) -> Result<()> {
        self.attention.forward(&self.stream, plan, shape, qkv, out_lse)
    }

    fn attention_backward(
        &self,
        plan: &DevicePlan,
        shape: AttnShape,
        qkv: (u64, u64, u64),
        out_lse_dout: (u64, u64, u64),
        dsum: u64,
        grads: (u64, u64, u64),
    ) -> Result<()> {
        self.attention.backward(&self.stream, plan, shape, qkv, out_lse_dout, dsum, grads)
    }
}
