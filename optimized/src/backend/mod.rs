//! Where the step runs: memory, copies, matmuls, attention and the elementwise ops on raw
//! addresses. [`cuda::Cuda`] is the GPU (cuBLAS, the attention kernels, `elementwise.cu`);
//! [`host::Host`] runs the same step on the CPU with the kernels' twins, so CI exercises the step
//! driver, its layout and its heap.

pub mod cuda;
pub mod host;

use crate::ops::attention::ranges::KeyRanges;
use crate::ops::attention::AttnShape;
use crate::ops::elementwise::ElementwiseOps;
use crate::ops::gdn::GdnOps;
use crate::ops::matmul::Mat;
pub use crate::ops::Elem;
use crate::Result;

/// Rows in device memory: the first at `addr`, each `pitch` bytes after the one before.
#[derive(Clone, Copy, Debug)]
pub struct Pitched {
    pub addr: u64,
    pub pitch: usize,
}

/// An allocation of a backend, freed on drop.
pub trait Allocation {
    /// The address of byte 0.
    fn ptr(&self) -> u64;
}

/// Memory and operations of the step (values stored as [`Backend::Elem`] unless
/// stated).
pub trait Backend {
    type Elem: Elem;
    type Ops: ElementwiseOps;
    type Alloc: Allocation;
    /// Key ranges where the backend's attention reads them.
    type Ranges;

    /// The kind of backend, in words (`GPU`, `CPU twins`), known before one is made.
    const KIND: &'static str;

    /// What runs the step, e.g. `NVIDIA H200`.
    fn name(&self) -> &str;
    /// Bytes a new allocation can get.
    fn available_bytes(&self) -> Result<u64>;
    /// `bytes` zeroed bytes, named `name` in errors.
    fn alloc(&self, name: &str, bytes: usize) -> Result<Self::Alloc>;
    fn upload(&self, dst: u64, src: &[u8]) -> Result<()>;
    /// Fills `dst` from address `src` (waits for queued work).
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()>;
    /// Fills each `dst` from its address, waiting for queued work once (a decode step's readback
    /// of its proposals and the target's tokens).
    fn download_parts(&self, parts: &mut [(u64, &mut [u8])]) -> Result<()> {
        parts.iter_mut().try_for_each(|(src, dst)| self.download(*src, dst))
    }
    fn zero(&self, ptr: u64, bytes: usize) -> Result<()>;
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()>;
    /// Copies `rows` rows of `width` bytes from `src` to `dst`, each at its own pitch (one column
    /// block of a row-major matrix into another).
    fn copy_strided(&self, dst: Pitched, src: Pitched, width: usize, rows: usize) -> Result<()>;
    /// Fills `dst` from `src` in the memory of another device of this kind that shared it with
    /// this one (a target worker's feature slot on another GPU), and waits for the copy.
    fn copy_from_peer(&self, dst: u64, src: u64, bytes: usize) -> Result<()>;
    /// Waits for the work queued so far (before another worker reads what it wrote).
    fn synchronize(&self) -> Result<()>;
    fn ops(&self) -> &Self::Ops;
    /// The hybrid target's ops (GatedDeltaNet, partial RoPE, output gate): the CPU twins on the
    /// host, `gdn.cu` on the GPU.
    fn gdn_ops(&self) -> &dyn GdnOps;
    /// `c [m, n] = a @ b + beta * c`, accumulating in the arithmetic type.
    fn matmul(&self, a: Mat, b: Mat, c: u64, beta: f32) -> Result<()>;
    /// `y [rows, n] = x [rows, k] @ w [n, k]^T + beta * y` (a linear layer, HF weight layout).
    #[allow(clippy::too_many_arguments)]
    fn linear(&self, x: u64, rows: usize, k: usize, w: u64, n: usize, y: u64, beta: f32) -> Result<()> {
        self.matmul(Mat::n(x, rows, k), Mat::t(w, n, k), y, beta)
    }
    /// An attention plan on the device, queued in stream order (on the GPU without waiting for
    /// the work queued before it).
    fn upload_ranges(&self, ranges: &KeyRanges) -> Result<Self::Ranges>;
    /// Memory the attention takes beyond the step's layout under `ranges` (none on the GPU).
    fn attention_scratch_bytes(&self, _ranges: &Self::Ranges, _shape: AttnShape) -> u64 {
        0
    }
    /// `out [Q, nh, d]` and `lse [nh, Q]` (fp32) from q, k, v.
    fn attention_forward(
        &self,
        ranges: &Self::Ranges,
        shape: AttnShape,
        qkv: (u64, u64, u64),
        out_lse: (u64, u64),
    ) -> Result<()>;
    /// dq, dk, dv from q, k, v, out, lse and dout; `dsum [nh, Q]` is scratch the backend may use.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        ranges: &Self::Ranges,
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
    backend.download(src, crate::ops::bytes_of_mut(&mut out))?;
    Ok(out)
}
