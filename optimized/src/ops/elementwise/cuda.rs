//! Launchers of the elementwise and reduction kernels (`elementwise.cu`) on raw device addresses.
//! Each launcher checks the sizes the kernel relies on and names the kernel in errors; the CPU
//! twins are `super::twin`, and `xtask gpu-conformance` checks each kernel against its twin.

use std::sync::Arc;

use super::{AdamWArgs, AdamWBuffers, CeRows, ElementwiseOps, HeadNormRope, HeadNormRopeGrad, Heads, RmsNormGrad};
use crate::device::gpu::Gpu;
use crate::device::profile;
use crate::ops::constants::{
    ELEMENTWISE_CTAS, GRAD_PARTS, HEAD_LANE_VALUES, LINEAR_ROWS, LINEAR_ROWS_COLUMNS, LINEAR_ROWS_WARPS,
    MAX_CHUNKS_PER_THREAD, MAX_HEAD_LANE_ELEMS, ROW_THREADS, VEC,
};
use crate::ops::sources::elementwise_source;
use crate::{Error, Result};
use cudarc::driver::{CudaFunction, CudaStream, LaunchArgs, LaunchConfig, PushKernelArg};

/// Columns one thread of `rms_norm_backward` holds: rows of at most this many x `ROW_THREADS`.
const MAX_COLS_PER_THREAD: usize = MAX_CHUNKS_PER_THREAD * VEC;

fn launch_err(kernel: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Gpu(format!("launch {kernel}: {e}"))
}

/// Launches a kernel with its arguments on `stream`, under `name` in errors and profiles.
pub(crate) fn launch_named(
    stream: &Arc<CudaStream>,
    name: &str,
    mut b: LaunchArgs<'_>,
    cfg: LaunchConfig,
) -> Result<()> {
    // SAFETY: every launcher checks the sizes its kernel relies on before building `b`.
    profile::scope(stream, || name.to_string(), || unsafe { b.launch(cfg) }.map_err(launch_err(name)))?;
    Ok(())
}

pub(crate) fn i32_of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::invalid(what, format!("{v} exceeds i32")))
}

/// The compiled kernels of `elementwise.cu`.
pub struct ElementwiseKernels {
    stream: Arc<CudaStream>,
    rms_norm_forward: CudaFunction,
    rms_norm_backward: CudaFunction,
    column_sum: CudaFunction,
    head_norm_rope_forward: CudaFunction,
    head_norm_rope_backward: CudaFunction,
    rope_forward: CudaFunction,
    swiglu_forward: CudaFunction,
    swiglu_backward: CudaFunction,
    ce_grad_rows: CudaFunction,
    argmax_rows: CudaFunction,
    linear_rows: CudaFunction,
    gather_rows: CudaFunction,
    scatter_rows: CudaFunction,
    sum_squares_f32: CudaFunction,
    sum_squares_bf16: CudaFunction,
    accumulate_bf16: CudaFunction,
    adamw_update: CudaFunction,
    adamw_update_bf16_grad: CudaFunction,
    fill_normal_bf16: CudaFunction,
}

pub(crate) fn grid(n: usize, per: u32) -> u32 {
    (n.div_ceil(per as usize) as u32).max(1)
}

impl ElementwiseKernels {
    /// Compiles `elementwise.cu` (once per process) and loads its kernels.
    pub fn load(gpu: &Gpu) -> Result<Self> {
        let f = |name: &str| gpu.function("elementwise", elementwise_source(), name);
        Ok(ElementwiseKernels {
            stream: gpu.stream().clone(),
            rms_norm_forward: f("rms_norm_forward")?,
            rms_norm_backward: f("rms_norm_backward")?,
            column_sum: f("column_sum")?,
            head_norm_rope_forward: f("head_norm_rope_forward")?,
            rope_forward: f("rope_forward")?,
            head_norm_rope_backward: f("head_norm_rope_backward")?,
            swiglu_forward: f("swiglu_forward")?,
            swiglu_backward: f("swiglu_backward")?,
            ce_grad_rows: f("ce_grad_rows")?,
            argmax_rows: f("argmax_rows")?,
            linear_rows: f("linear_rows")?,
            gather_rows: f("gather_rows")?,
            scatter_rows: f("scatter_rows")?,
            sum_squares_f32: f("sum_squares_f32")?,
            sum_squares_bf16: f("sum_squares_bf16")?,
            accumulate_bf16: f("accumulate_bf16")?,
            adamw_update: f("adamw_update")?,
            adamw_update_bf16_grad: f("adamw_update_bf16_grad")?,
            fill_normal_bf16: f("fill_normal_bf16")?,
        })
    }

    fn rows_cfg(rows: usize, threads: u32) -> LaunchConfig {
        LaunchConfig { grid_dim: (rows.max(1) as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
    }

    /// The forward head kernels' grid over `rows` (token, head) rows of `d`: `HEAD_LANE_VALUES
    /// / (d / 32)` rows a warp.
    fn head_rows_cfg(rows: usize, d: usize) -> LaunchConfig {
        let per_cta = (ROW_THREADS / 32) * (HEAD_LANE_VALUES / (d / 32)) as u32;
        LaunchConfig { grid_dim: (grid(rows, per_cta), 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 }
    }

    pub(crate) fn elementwise_cfg(n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (grid(n, ROW_THREADS).min(ELEMENTWISE_CTAS), 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Grid (chunks of a row, rows) of the SwiGLU kernels: 8-value chunks when `inter % 8 == 0`.
    fn row_chunks_cfg(rows: usize, inter: usize) -> LaunchConfig {
        let per_row = if inter.is_multiple_of(8) { inter / 8 } else { inter };
        LaunchConfig {
            grid_dim: (grid(per_row, ROW_THREADS), rows.clamp(1, 65_535) as u32, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn check_cols(n: usize) -> Result<()> {
        let max = MAX_COLS_PER_THREAD * ROW_THREADS as usize;
        if n == 0 || !n.is_multiple_of(8) || n > max {
            return Err(Error::invalid(
                "hidden size",
                format!("{n}: the norm kernels take a multiple of 8 up to {max}"),
            ));
        }
        Ok(())
    }

    /// Launches a kernel with its arguments, under `name` in errors and profiles.
    fn launch(&self, name: &str, b: LaunchArgs<'_>, cfg: LaunchConfig) -> Result<()> {
        launch_named(&self.stream, name, b, cfg)
    }

    /// Whether [`ElementwiseKernels::linear_rows`] takes `y [m, n] = x [m, k] @ w [n, k]^T`: `m`
    /// from 1 to [`LINEAR_ROWS`], `k` a multiple of 8, x and w 16-byte aligned (else the caller
    /// uses cuBLAS).
    pub fn takes_linear_rows(x: u64, w: u64, m: usize, k: usize) -> bool {
        (1..=LINEAR_ROWS).contains(&m) && k > 0 && k.is_multiple_of(8) && x.is_multiple_of(16) && w.is_multiple_of(16)
    }

    /// `y [m, n] = x [m, k] @ w [n, k]^T + beta * y` (bf16, fp32 accumulation on the tensor
    /// cores) for up to [`LINEAR_ROWS`] rows: batch-1 decoding's linear layers (a plain step's
    /// row, a verify block's and the drafter block's), bound by reading `w` once; each row's
    /// result the same for every `m`.
    pub fn linear_rows(&self, x: u64, w: u64, y: u64, (m, n, k): (usize, usize, usize), beta: f32) -> Result<()> {
        if !Self::takes_linear_rows(x, w, m, k) {
            return Err(Error::invalid(
                "linear_rows",
                format!("m = {m} must be 1 to {LINEAR_ROWS} and k = {k} a multiple of 8, x and w 16-byte aligned"),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        let (rows, cols, inner) = (i32_of("m", m)?, i32_of("n", n)?, i32_of("k", k)?);
        let mut b = self.stream.launch_builder(&self.linear_rows);
        b.arg(&x).arg(&w).arg(&y).arg(&rows).arg(&cols).arg(&inner).arg(&beta);
        let cfg = LaunchConfig {
            grid_dim: (grid(n, LINEAR_ROWS_COLUMNS as u32), 1, 1),
            block_dim: (32 * LINEAR_ROWS_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch("linear_rows", b, cfg)
    }

    /// Checks that device addresses are 16-byte aligned (the kernels move 8 bf16 at a time).
    /// Refuses a device address that is not 16-byte aligned (the 16-byte loads), naming the kernel.
    pub(crate) fn check_aligned(kernel: &str, ptrs: &[u64]) -> Result<()> {
        match ptrs.iter().find(|&&p| p % 16 != 0) {
            Some(p) => Err(Error::Gpu(format!("{kernel}: device address {p:#x} is not 16-byte aligned"))),
            None => Ok(()),
        }
    }

    /// Checks a head dim for the head kernels: a multiple of 64 (RoPE partners in one lane) up
    /// to 256.
    pub fn check_head_dim(d: usize) -> Result<()> {
        if d == 0 || !d.is_multiple_of(64) || d > MAX_HEAD_LANE_ELEMS * 32 {
            return Err(Error::invalid(
                "head_dim",
                format!("{d}: the GPU step needs a multiple of 64 up to {}", MAX_HEAD_LANE_ELEMS * 32),
            ));
        }
        Ok(())
    }

    /// `out [n] = bf16(sum_p partial [parts, n])`.
    fn column_sum(&self, partial: u64, out: u64, parts: usize, n: usize) -> Result<()> {
        let (p, c) = (i32_of("parts", parts)?, i32_of("n", n)?);
        let mut b = self.stream.launch_builder(&self.column_sum);
        b.arg(&partial).arg(&out).arg(&p).arg(&c);
        let cfg = LaunchConfig {
            grid_dim: (grid(n, ROW_THREADS), 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch("column_sum", b, cfg)
    }
}

impl ElementwiseOps for ElementwiseKernels {
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_forward(&self, x: u64, w: u64, y: u64, inv: u64, rows: usize, n: usize, eps: f64) -> Result<()> {
        let eps = eps as f32;
        Self::check_cols(n)?;
        Self::check_aligned("rms_norm_forward", &[x, w, y])?;
        if rows == 0 {
            return Ok(());
        }
        let (r, c) = (i32_of("rows", rows)?, i32_of("n", n)?);
        let mut b = self.stream.launch_builder(&self.rms_norm_forward);
        b.arg(&x).arg(&w).arg(&y).arg(&inv).arg(&r).arg(&c).arg(&eps);
        self.launch("rms_norm_forward", b, Self::rows_cfg(rows, ROW_THREADS))
    }

    fn rms_norm_backward(&self, g: RmsNormGrad, dx: u64, dw: u64, partial: u64, rows: usize, n: usize) -> Result<()> {
        let RmsNormGrad { dy, x, w, inv, dres } = g;
        let dres = dres.unwrap_or(0);
        Self::check_cols(n)?;
        Self::check_aligned("rms_norm_backward", &[dy, x, w, dres, dx])?;
        if rows == 0 {
            return Ok(());
        }
        let (r, c) = (i32_of("rows", rows)?, i32_of("n", n)?);
        let mut b = self.stream.launch_builder(&self.rms_norm_backward);
        b.arg(&dy).arg(&x).arg(&w).arg(&inv).arg(&dres).arg(&dx).arg(&partial).arg(&r).arg(&c);
        let cfg =
            LaunchConfig { grid_dim: (GRAD_PARTS as u32, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 };
        self.launch("rms_norm_backward", b, cfg)?;
        self.column_sum(partial, dw, GRAD_PARTS, n)
    }

    fn head_norm_rope_forward(&self, f: HeadNormRope, y: u64, inv: u64, dims: Heads, eps: f64) -> Result<()> {
        let eps = eps as f32;
        HeadNormRope::check_row(f.x_row, dims)?;
        let (HeadNormRope { x, x_row, w, cos, sin }, Heads { tokens, heads, head_dim: d }) = (f, dims);
        Self::check_head_dim(d)?;
        let rows = tokens * heads;
        if rows == 0 {
            return Ok(());
        }
        let (t, h, dd) = (i32_of("tokens", tokens)?, i32_of("heads", heads)?, i32_of("head_dim", d)?);
        let mut b = self.stream.launch_builder(&self.head_norm_rope_forward);
        let xr = i32_of("x row", x_row)?;
        b.arg(&x).arg(&w).arg(&cos).arg(&sin).arg(&y).arg(&inv).arg(&t).arg(&h).arg(&dd).arg(&xr).arg(&eps);
        self.launch("head_norm_rope_forward", b, Self::head_rows_cfg(rows, d))
    }

    fn rope_forward(&self, x: u64, x_row: usize, cos: u64, sin: u64, y: u64, dims: Heads) -> Result<()> {
        HeadNormRope::check_row(x_row, dims)?;
        let Heads { tokens, heads, head_dim: d } = dims;
        Self::check_head_dim(d)?;
        let rows = tokens * heads;
        if rows == 0 {
            return Ok(());
        }
        let (t, h, dd) = (i32_of("tokens", tokens)?, i32_of("heads", heads)?, i32_of("head_dim", d)?);
        let mut b = self.stream.launch_builder(&self.rope_forward);
        let xr = i32_of("x row", x_row)?;
        b.arg(&x).arg(&cos).arg(&sin).arg(&y).arg(&t).arg(&h).arg(&dd).arg(&xr);
        self.launch("rope_forward", b, Self::head_rows_cfg(rows, d))
    }

    fn head_norm_rope_backward(&self, g: HeadNormRopeGrad, dx: u64, dw: u64, partial: u64, dims: Heads) -> Result<()> {
        g.fwd.check_contiguous(dims)?;
        let HeadNormRopeGrad { dy, fwd: HeadNormRope { x, w, cos, sin, .. }, inv } = g;
        let Heads { tokens, heads, head_dim: d } = dims;
        Self::check_head_dim(d)?;
        if tokens * heads == 0 {
            return Ok(());
        }
        let (t, h, dd) = (i32_of("tokens", tokens)?, i32_of("heads", heads)?, i32_of("head_dim", d)?);
        let mut b = self.stream.launch_builder(&self.head_norm_rope_backward);
        b.arg(&dy).arg(&x).arg(&w).arg(&inv).arg(&cos).arg(&sin).arg(&dx).arg(&partial).arg(&t).arg(&h).arg(&dd);
        let cfg =
            LaunchConfig { grid_dim: (GRAD_PARTS as u32, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 };
        self.launch("head_norm_rope_backward", b, cfg)?;
        self.column_sum(partial, dw, GRAD_PARTS, d)
    }

    fn swiglu_forward(&self, gu: u64, h: u64, rows: usize, inter: usize) -> Result<()> {
        if inter.is_multiple_of(8) {
            Self::check_aligned("swiglu_forward", &[gu, h])?;
        }
        let (r, i) = (i32_of("rows", rows)?, i32_of("intermediate size", inter)?);
        let mut b = self.stream.launch_builder(&self.swiglu_forward);
        b.arg(&gu).arg(&h).arg(&r).arg(&i);
        let cfg = Self::row_chunks_cfg(rows, inter);
        self.launch("swiglu_forward", b, cfg)
    }

    fn swiglu_backward(&self, dh: u64, gu: u64, rows: usize, inter: usize) -> Result<()> {
        if inter.is_multiple_of(8) {
            Self::check_aligned("swiglu_backward", &[dh, gu])?;
        }
        let (r, i) = (i32_of("rows", rows)?, i32_of("intermediate size", inter)?);
        let mut b = self.stream.launch_builder(&self.swiglu_backward);
        b.arg(&dh).arg(&gu).arg(&r).arg(&i);
        let cfg = Self::row_chunks_cfg(rows, inter);
        self.launch("swiglu_backward", b, cfg)
    }

    fn ce_grad_rows(&self, ce: CeRows, rows: usize, vocab: usize, scale: f64) -> Result<()> {
        let CeRows { z, labels, weights, loss } = ce;
        let scale = scale as f32;
        if vocab.is_multiple_of(8) {
            Self::check_aligned("ce_grad_rows", &[z])?;
        }
        if rows == 0 {
            return Ok(());
        }
        let (r, v) = (i32_of("rows", rows)?, i32_of("vocab", vocab)?);
        let mut b = self.stream.launch_builder(&self.ce_grad_rows);
        b.arg(&z).arg(&labels).arg(&weights).arg(&loss).arg(&r).arg(&v).arg(&scale);
        self.launch("ce_grad_rows", b, Self::rows_cfg(rows, 1024))
    }

    fn argmax_rows(&self, z: u64, rows: usize, vocab: usize, out: u64) -> Result<()> {
        if vocab.is_multiple_of(8) {
            Self::check_aligned("argmax_rows", &[z])?;
        }
        if rows == 0 {
            return Ok(());
        }
        if vocab == 0 {
            return Err(Error::invalid("argmax_rows", "rows of 0 values have no maximum"));
        }
        let (r, v) = (i32_of("rows", rows)?, i32_of("vocab", vocab)?);
        let mut b = self.stream.launch_builder(&self.argmax_rows);
        b.arg(&z).arg(&out).arg(&r).arg(&v);
        // 1024 threads: a decoding row of 151,936 logits is 5 rounds of 4 loads in flight each.
        self.launch("argmax_rows", b, Self::rows_cfg(rows, 1024))
    }

    fn copy_rows(&self, scatter: bool, src: u64, idx: u64, dst: u64, count: usize, cols: usize) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let (n, c) = (i32_of("rows", count)?, i32_of("cols", cols)?);
        let (f, name) = if scatter { (&self.scatter_rows, "scatter_rows") } else { (&self.gather_rows, "gather_rows") };
        let mut b = self.stream.launch_builder(f);
        b.arg(&src).arg(&idx).arg(&dst).arg(&n).arg(&c);
        self.launch(name, b, Self::rows_cfg(count, ROW_THREADS))
    }

    fn sum_squares(&self, stored: bool, x: u64, partial: u64, n: usize, parts: usize) -> Result<()> {
        let nn = n as i64;
        let (f, name) = if stored {
            (&self.sum_squares_bf16, "sum_squares_bf16")
        } else {
            (&self.sum_squares_f32, "sum_squares_f32")
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(&x).arg(&partial).arg(&nn);
        let cfg = LaunchConfig { grid_dim: (parts as u32, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 };
        self.launch(name, b, cfg)
    }

    fn accumulate(&self, acc: u64, g: u64, n: usize) -> Result<()> {
        let nn = n as i64;
        let mut b = self.stream.launch_builder(&self.accumulate_bf16);
        b.arg(&acc).arg(&g).arg(&nn);
        self.launch("accumulate_bf16", b, Self::elementwise_cfg(n))
    }

    fn adamw_update(&self, buffers: AdamWBuffers, n: usize, a: AdamWArgs) -> Result<()> {
        let AdamWBuffers { p, g, g_is_stored, m, v, p_stored } = buffers;
        let nn = n as i64;
        // The kernel's hyper-parameters are fp32, as its arithmetic.
        let h = [a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.bc1, a.bc2, a.grad_scale].map(|x| x as f32);
        let (f, name) = match g_is_stored {
            true => (&self.adamw_update_bf16_grad, "adamw_update_bf16_grad"),
            false => (&self.adamw_update, "adamw_update"),
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(&p).arg(&g).arg(&m).arg(&v).arg(&p_stored).arg(&nn);
        for x in &h {
            b.arg(x);
        }
        self.launch(name, b, Self::elementwise_cfg(n))
    }

    fn fill_normal(&self, dst: u64, n: usize, seed: u64, mean: f32, std: f32) -> Result<()> {
        let nn = n as i64;
        let mut b = self.stream.launch_builder(&self.fill_normal_bf16);
        b.arg(&dst).arg(&nn).arg(&seed).arg(&mean).arg(&std);
        self.launch("fill_normal_bf16", b, Self::elementwise_cfg(n))
    }
}
