//! Dense matmuls on the GPU through cuBLAS (bf16 operands, fp32 accumulation) in row-major
//! terms: `c [m, n] = alpha * op(a) [m, k] @ op(b) [k, n] + beta * c`, `c` in bf16 or fp32. The
//! CPU twin is `super::twin::matmul`.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::{result, CudaBlas};
use cudarc::cublaslt::{result as lt, sys as ltsys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::device::gpu::Gpu;
use crate::device::profile;
use crate::{Error, Result};

use super::Mat;

/// A cuBLAS handle on the GPU's stream.
pub struct Blas {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
}

/// The element type of a matmul output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Out {
    Bf16,
    F32,
}

fn dim(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::invalid("matmul size", format!("{v} exceeds i32")))
}

impl Blas {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let blas =
            CudaBlas::new(gpu.stream().clone()).map_err(|e| Error::Gpu(format!("create cuBLAS handle: {e:?}")))?;
        Ok(Blas { blas, stream: gpu.stream().clone() })
    }

    /// `c [m, n] = alpha * a @ b + beta * c` with `a`, `b` as used (`[m, k]`, `[k, n]`), `c`
    /// row-major at `c` in `out`. Row-major `c` is column-major `c^T = b^T a^T`, so cuBLAS gets
    /// `b` first; a row-major operand stored `[r, cc]` is column-major `[cc, r]` with ld `cc`,
    /// which is the transpose needed unless the operand is used transposed.
    pub fn matmul(&self, a: Mat, b: Mat, c: u64, out: Out, alpha: f32, beta: f32) -> Result<()> {
        let ((m, k), (kb, n)) = (a.used(), b.used());
        if k != kb {
            return Err(Error::invalid("matmul", format!("inner dims differ: a is {m}x{k}, b is {kb}x{n}")));
        }
        let op = |x: &Mat| if x.t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
        let c_type = match out {
            Out::Bf16 => cudaDataType::CUDA_R_16BF,
            Out::F32 => cudaDataType::CUDA_R_32F,
        };
        let name =
            || format!("gemm {m}x{n}x{k} {}{} -> {out:?}", if a.t { "T" } else { "N" }, if b.t { "T" } else { "N" });
        // SAFETY: the addresses are live device buffers of the stated shapes (callers' contract);
        // alpha and beta are f32 as CUBLAS_COMPUTE_32F requires.
        profile::scope(&self.stream, name, || {
            unsafe {
                result::gemm_ex(
                    *self.blas.handle(),
                    op(&b),
                    op(&a),
                    dim(n)?,
                    dim(m)?,
                    dim(k)?,
                    &alpha as *const f32 as *const c_void,
                    b.ptr as *const c_void,
                    cudaDataType::CUDA_R_16BF,
                    dim(b.cols)?,
                    a.ptr as *const c_void,
                    cudaDataType::CUDA_R_16BF,
                    dim(a.cols)?,
                    &beta as *const f32 as *const c_void,
                    c as *mut c_void,
                    c_type,
                    dim(n)?,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| Error::Gpu(format!("cuBLAS gemm {m}x{n}x{k}: {e:?}")))
        })
    }

    /// `y [m, n] = x [m, k] @ w [n, k]^T`, all row-major bf16, fp32 accumulation.
    pub fn linear(
        &self,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        y: &mut CudaSlice<bf16>,
        (m, n, k): (usize, usize, usize),
    ) -> Result<()> {
        for (name, len, want) in [("x", x.len(), m * k), ("w", w.len(), n * k), ("y", y.len(), m * n)] {
            if len < want {
                return Err(Error::invalid(name, format!("{len} elements, need {want} for m={m} n={n} k={k}")));
            }
        }
        let stream = &self.stream;
        let (x, _x) = x.device_ptr(stream);
        let (w, _w) = w.device_ptr(stream);
        let (y, _y) = y.device_ptr_mut(stream);
        self.matmul(Mat::n(x, m, k), Mat::t(w, n, k), y, Out::Bf16, 1.0, 0.0)
    }
}

/// One of cuBLASLt's candidate algorithms for an [`LtLinear`], with its configuration (for
/// printing): algorithm id, tile, stages, split-k, cluster shape (cuBLASLt's enum values).
#[derive(Clone, Copy, Debug)]
pub struct LtAlgo {
    algo: ltsys::cublasLtMatmulAlgo_t,
    pub workspace: usize,
    pub waves: f32,
    pub id: u32,
    pub tile: u32,
    pub stages: u32,
    pub splitk: u32,
    pub cluster: u32,
}

/// The row-major linear `y [m, n] = x [m, k] @ w [n, k]^T` (bf16, fp32 accumulation, the same
/// operation as [`Blas::linear`]) through cuBLASLt with a chosen algorithm: `bench gemm --algos`
/// times cuBLASLt's heuristic candidates against `cublasGemmEx`'s default choice.
pub struct LtLinear {
    handle: ltsys::cublasLtHandle_t,
    desc: ltsys::cublasLtMatmulDesc_t,
    /// w `[n, k]` row-major as column-major `[k, n]` used transposed; x `[m, k]` as `[k, m]`;
    /// y `[m, n]` as `[n, m]`.
    layouts: [ltsys::cublasLtMatrixLayout_t; 3],
    pref: ltsys::cublasLtMatmulPreference_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
}

impl LtLinear {
    /// Workspace bytes offered to cuBLASLt (NVIDIA's recommendation on Hopper: 32 MiB).
    const WORKSPACE: usize = 32 << 20;

    pub fn new(gpu: &Gpu, (m, n, k): (usize, usize, usize)) -> Result<Self> {
        let e = |what: &'static str| move |err: lt::CublasError| Error::Gpu(format!("cuBLASLt {what}: {err:?}"));
        let (m64, n64, k64) = (m as u64, n as u64, k as u64);
        let handle = lt::create_handle().map_err(e("create"))?;
        let desc =
            lt::create_matmul_desc(ltsys::cublasComputeType_t::CUBLAS_COMPUTE_32F, ltsys::cudaDataType::CUDA_R_32F)
                .map_err(e("matmul descriptor"))?;
        let trans = cublasOperation_t::CUBLAS_OP_T;
        // SAFETY: `desc` is live; the attribute is a cublasOperation_t passed by address and size.
        unsafe {
            lt::set_matmul_desc_attribute(
                desc,
                ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &trans as *const _ as *const c_void,
                std::mem::size_of_val(&trans),
            )
        }
        .map_err(e("transpose attribute"))?;
        let bf = ltsys::cudaDataType::CUDA_R_16BF;
        let layouts = [
            lt::create_matrix_layout(bf, k64, n64, k as i64).map_err(e("layout of w"))?,
            lt::create_matrix_layout(bf, k64, m64, k as i64).map_err(e("layout of x"))?,
            lt::create_matrix_layout(bf, n64, m64, n as i64).map_err(e("layout of y"))?,
        ];
        let pref = lt::create_matmul_pref().map_err(e("preference"))?;
        let bytes = Self::WORKSPACE as u64;
        // SAFETY: `pref` is live; the attribute is a u64 passed by address and size.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                ltsys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &bytes as *const u64 as *const c_void,
                8,
            )
        }
        .map_err(e("workspace preference"))?;
        let stream = gpu.stream().clone();
        let workspace = stream
            .alloc_zeros::<u8>(Self::WORKSPACE)
            .map_err(|err| Error::Gpu(format!("cuBLASLt workspace: {err:?}")))?;
        Ok(LtLinear { handle, desc, layouts, pref, workspace, stream })
    }

    /// Up to `count` of cuBLASLt's heuristic candidates, its first choice first.
    pub fn algos(&self, count: usize) -> Result<Vec<LtAlgo>> {
        let mut results: Vec<ltsys::cublasLtMatmulHeuristicResult_t> = Vec::with_capacity(count);
        let mut found: i32 = 0;
        let [w, x, y] = self.layouts;
        // SAFETY: the descriptors are live; `results` has room for `count` entries, of which
        // cuBLASLt writes `found`.
        unsafe {
            ltsys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                self.desc,
                w,
                x,
                y,
                y,
                self.pref,
                i32::try_from(count).map_err(|_| Error::invalid("algos", "count exceeds i32"))?,
                results.as_mut_ptr(),
                &mut found,
            )
            .result()
            .map_err(|err| Error::Gpu(format!("cuBLASLt heuristics: {err:?}")))?;
            results.set_len(usize::try_from(found).unwrap_or(0).min(count));
        }
        let config = |algo: &ltsys::cublasLtMatmulAlgo_t, attr| -> u32 {
            let (mut v, mut written) = (0u32, 0usize);
            // SAFETY: `algo` came from the heuristics; the attributes read are 4-byte values.
            let status = unsafe {
                ltsys::cublasLtMatmulAlgoConfigGetAttribute(
                    algo,
                    attr,
                    &mut v as *mut u32 as *mut c_void,
                    4,
                    &mut written,
                )
            };
            if status.result().is_ok() {
                v
            } else {
                u32::MAX
            }
        };
        use ltsys::cublasLtMatmulAlgoConfigAttributes_t as A;
        Ok(results
            .iter()
            .filter(|r| r.state.result().is_ok())
            .map(|r| LtAlgo {
                algo: r.algo,
                workspace: r.workspaceSize,
                waves: r.wavesCount,
                id: config(&r.algo, A::CUBLASLT_ALGO_CONFIG_ID),
                tile: config(&r.algo, A::CUBLASLT_ALGO_CONFIG_TILE_ID),
                stages: config(&r.algo, A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
                splitk: config(&r.algo, A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                cluster: config(&r.algo, A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
            })
            .collect())
    }

    /// `y = x @ w^T` by `algo` (one of [`LtLinear::algos`]), queued on the GPU's stream.
    pub fn run(&self, algo: &LtAlgo, x: u64, w: u64, y: u64) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let [wl, xl, yl] = self.layouts;
        let (ws, _guard) = self.workspace.device_ptr(&self.stream);
        // SAFETY: the descriptors are live, x, w and y are device buffers of this linear's
        // shapes (the caller's contract), the workspace holds `WORKSPACE` bytes.
        unsafe {
            lt::matmul(
                self.handle,
                self.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                w as *const c_void,
                wl,
                x as *const c_void,
                xl,
                y as *const c_void,
                yl,
                y as *mut c_void,
                yl,
                &algo.algo,
                ws as *mut c_void,
                Self::WORKSPACE,
                self.stream.cu_stream() as ltsys::cudaStream_t,
            )
        }
        .map_err(|err| Error::Gpu(format!("cuBLASLt matmul: {err:?}")))
    }
}

impl Drop for LtLinear {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by `new` and is destroyed once; errors at teardown
        // have no one to go to.
        unsafe {
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_matmul_pref(self.pref);
            let _ = lt::destroy_matmul_desc(self.desc);
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
