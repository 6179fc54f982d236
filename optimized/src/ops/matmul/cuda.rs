//! Dense matmuls on the GPU through cuBLAS (bf16 operands, fp32 accumulation) in row-major
//! terms: `c [m, n] = alpha * op(a) [m, k] @ op(b) [k, n] + beta * c`, `c` in bf16 or fp32. The
//! CPU twin is `super::twin::matmul`.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::{result, CudaBlas};
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
