//! Dense matmuls on the GPU through cuBLAS (bf16 in and out, fp32 accumulation) in the
//! row-major `linear` layout of the training step: `y [m, n] = x [m, k] @ w [n, k]^T`. The CPU
//! twin is `dflash_reference::ops::linear`.

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::CudaSlice;
use dflash_reference::{Error, Result};
use half::bf16;

use crate::gpu::Gpu;

/// A cuBLAS handle on the GPU's stream.
pub struct Blas {
    blas: CudaBlas,
}

impl Blas {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let blas =
            CudaBlas::new(gpu.stream().clone()).map_err(|e| Error::Gpu(format!("create cuBLAS handle: {e:?}")))?;
        Ok(Blas { blas })
    }

    /// `y [m, n] = x [m, k] @ w [n, k]^T`, all row-major bf16, fp32 accumulation. Row-major `y`
    /// is column-major `y^T = w x^T`: cuBLAS computes it with `w` transposed and `x` as is.
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
        let dim = |v: usize| i32::try_from(v).map_err(|_| Error::invalid("matmul size", format!("{v} exceeds i32")));
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: dim(n)?,
            n: dim(m)?,
            k: dim(k)?,
            alpha: bf16::ONE,
            lda: dim(k)?,
            ldb: dim(k)?,
            beta: bf16::ZERO,
            ldc: dim(n)?,
        };
        unsafe { self.blas.gemm(cfg, w, x, y) }.map_err(|e| Error::Gpu(format!("cuBLAS gemm {m}x{n}x{k}: {e:?}")))
    }
}
