//! Launchers of the step's elementwise and reduction kernels (`kernels/step.cu`), on raw device
//! addresses (see [`super::device`]). Each launcher checks the sizes the kernel relies on and
//! names the kernel in errors. The CPU twins are `step::ops` (norms, RoPE, SwiGLU),
//! `step::lm_head_ce` (CE gradient), `dflash_reference::optim::AdamW` and [`normal_at`].

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream, LaunchArgs, LaunchConfig, PushKernelArg};
use dflash_reference::{Error, Result};

use crate::gpu::Gpu;
use crate::profile;

const SOURCE: &str = include_str!("../../../kernels/step.cu");
/// Threads per CTA of the row kernels (`rms_norm_*`, `ce_grad_rows`, copies).
const ROW_THREADS: u32 = 256;
/// `MAX_CHUNKS_PER_THREAD` x `VEC` of the kernel source: `rms_norm_backward` takes rows of at
/// most this many x 256 columns.
const MAX_COLS_PER_THREAD: usize = 4 * 8;
/// `MAX_HEAD_LANE_ELEMS` of the kernel source: head dims of at most this many x 32.
const MAX_HEAD_LANE_ELEMS: usize = 8;
/// CTAs of the kernels that reduce a parameter gradient into per-CTA partials: the number of
/// partial rows [`StepKernels::column_sum`] adds up.
pub const GRAD_PARTS: usize = 528;
/// CTAs of the grid-stride elementwise kernels (2 waves of 132 SMs x 8).
const ELEMENTWISE_CTAS: u32 = 2112;

fn launch_err(kernel: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Gpu(format!("launch {kernel}: {e}"))
}

fn i32_of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::invalid(what, format!("{v} exceeds i32")))
}

/// The compiled kernels of `step.cu`.
pub struct StepKernels {
    stream: Arc<CudaStream>,
    rms_norm_forward: CudaFunction,
    rms_norm_backward: CudaFunction,
    column_sum: CudaFunction,
    head_norm_rope_forward: CudaFunction,
    head_norm_rope_backward: CudaFunction,
    swiglu_forward: CudaFunction,
    swiglu_backward: CudaFunction,
    ce_grad_rows: CudaFunction,
    gather_rows: CudaFunction,
    scatter_rows: CudaFunction,
    sum_squares_f32: CudaFunction,
    sum_squares_bf16: CudaFunction,
    accumulate_bf16: CudaFunction,
    adamw_update: CudaFunction,
    fill_normal_bf16: CudaFunction,
}

/// Hyper-parameters of one AdamW update of one parameter (`adamw_update`).
#[derive(Clone, Copy, Debug)]
pub struct AdamWArgs {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// `1 - beta1^t` and `1 - beta2^t`.
    pub bc1: f32,
    pub bc2: f32,
    /// The clipping factor applied to the gradient first.
    pub grad_scale: f32,
}

fn grid(n: usize, per: u32) -> u32 {
    (n.div_ceil(per as usize) as u32).max(1)
}

impl StepKernels {
    /// Compiles `step.cu` (once per process) and loads its kernels.
    pub fn load(gpu: &Gpu) -> Result<Self> {
        let f = |name: &str| gpu.function("step", SOURCE, name);
        Ok(StepKernels {
            stream: gpu.stream().clone(),
            rms_norm_forward: f("rms_norm_forward")?,
            rms_norm_backward: f("rms_norm_backward")?,
            column_sum: f("column_sum")?,
            head_norm_rope_forward: f("head_norm_rope_forward")?,
            head_norm_rope_backward: f("head_norm_rope_backward")?,
            swiglu_forward: f("swiglu_forward")?,
            swiglu_backward: f("swiglu_backward")?,
            ce_grad_rows: f("ce_grad_rows")?,
            gather_rows: f("gather_rows")?,
            scatter_rows: f("scatter_rows")?,
            sum_squares_f32: f("sum_squares_f32")?,
            sum_squares_bf16: f("sum_squares_bf16")?,
            accumulate_bf16: f("accumulate_bf16")?,
            adamw_update: f("adamw_update")?,
            fill_normal_bf16: f("fill_normal_bf16")?,
        })
    }

    fn rows_cfg(rows: usize, threads: u32) -> LaunchConfig {
        LaunchConfig { grid_dim: (rows.max(1) as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
    }

    fn elementwise_cfg(n: usize) -> LaunchConfig {
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
    fn launch(&self, name: &str, mut b: LaunchArgs<'_>, cfg: LaunchConfig) -> Result<()> {
        // SAFETY: every launcher checks the sizes its kernel relies on before building `b`.
        profile::scope(&self.stream, || name.to_string(), || unsafe { b.launch(cfg) }.map_err(launch_err(name)))?;
        Ok(())
    }

    /// Checks that device addresses are 16-byte aligned (the kernels move 8 bf16 at a time).
    fn check_aligned(kernel: &str, ptrs: &[u64]) -> Result<()> {
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

/// The step's elementwise and reduction operations on device addresses: the `step.cu` kernels
/// ([`StepKernels`]) or their CPU twins on host memory (`super::host::HostOps`). "Stored" values
/// are the backend's element type (`Backend::Elem`: bf16 on the GPU); the rest is fp32.
pub trait StepOps {
    /// `y [rows, n] = rms_norm(x) * w`, `inv [rows]`.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_forward(&self, x: u64, w: u64, y: u64, inv: u64, rows: usize, n: usize, eps: f32) -> Result<()>;

    /// `dx [rows, n]` (`+ dres` unless `dres` is 0) and `dw [n] +=` the weight gradient, through
    /// `partial` (`[GRAD_PARTS, n]` fp32 scratch).
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_backward(
        &self,
        inputs: (u64, u64, u64, u64, u64),
        dx: u64,
        dw: u64,
        partial: u64,
        rows: usize,
        n: usize,
    ) -> Result<()>;

    /// `y [T, heads, d] = rope(rms_norm(x) * w)`, `inv [T*heads]`; cos/sin `[T, d]` fp32.
    #[allow(clippy::too_many_arguments)]
    fn head_norm_rope_forward(
        &self,
        inputs: (u64, u64, u64, u64),
        y: u64,
        inv: u64,
        dims: (usize, usize, usize),
        eps: f32,
    ) -> Result<()>;

    /// `dx [T, heads, d]` through RoPE and the head norm, `dw [d] +=` (via `partial`).
    #[allow(clippy::too_many_arguments)]
    fn head_norm_rope_backward(
        &self,
        inputs: (u64, u64, u64, u64, u64, u64),
        dx: u64,
        dw: u64,
        partial: u64,
        dims: (usize, usize, usize),
    ) -> Result<()>;

    /// `h [rows, I] = silu(gate) * up` with `gu [rows, 2I]` holding each row's gate then up.
    fn swiglu_forward(&self, gu: u64, h: u64, rows: usize, inter: usize) -> Result<()>;

    /// `gu [rows, 2I]` := each row's `[dgate | dup]` from `dh [rows, I]` and its gate and up.
    fn swiglu_backward(&self, dh: u64, gu: u64, rows: usize, inter: usize) -> Result<()>;

    /// Logits `z [rows, vocab]` := `scale * w * (softmax(z) - onehot(y))`, `loss [rows] = w * CE`.
    #[allow(clippy::too_many_arguments)]
    fn ce_grad_rows(
        &self,
        z: u64,
        labels: u64,
        weights: u64,
        loss: u64,
        rows: usize,
        vocab: usize,
        scale: f32,
    ) -> Result<()>;

    /// `dst [count, cols] = src [idx[r], cols]` (`scatter`: `dst [idx[r]] = src [r]`).
    fn copy_rows(&self, scatter: bool, src: u64, idx: u64, dst: u64, count: usize, cols: usize) -> Result<()>;

    /// `partial [parts]` with `sum(partial) = sum(x^2)` over `x [n]` (stored values when
    /// `stored`, else fp32); `parts` CTAs.
    fn sum_squares(&self, stored: bool, x: u64, partial: u64, n: usize, parts: usize) -> Result<()>;

    /// `acc [n] += g [n]` (fp32 += stored).
    fn accumulate(&self, acc: u64, g: u64, n: usize) -> Result<()>;

    /// One AdamW update of `p [n]` (fp32) from `g` with moments `m`, `v`; writes the stored
    /// compute copy `p_stored`.
    fn adamw_update(&self, buffers: (u64, u64, u64, u64, u64), n: usize, a: AdamWArgs) -> Result<()>;

    /// `dst [n] = stored(mean + std * normal_at(seed, i))`.
    fn fill_normal(&self, dst: u64, n: usize, seed: u64, mean: f32, std: f32) -> Result<()>;
}

impl StepOps for StepKernels {
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_forward(&self, x: u64, w: u64, y: u64, inv: u64, rows: usize, n: usize, eps: f32) -> Result<()> {
        Self::check_cols(n)?;
        if rows == 0 {
            return Ok(());
        }
        let (r, c) = (i32_of("rows", rows)?, i32_of("n", n)?);
        let mut b = self.stream.launch_builder(&self.rms_norm_forward);
        b.arg(&x).arg(&w).arg(&y).arg(&inv).arg(&r).arg(&c).arg(&eps);
        self.launch("rms_norm_forward", b, Self::rows_cfg(rows, ROW_THREADS))
    }

    #[allow(clippy::too_many_arguments)]
    fn rms_norm_backward(
        &self,
        (dy, x, w, inv, dres): (u64, u64, u64, u64, u64),
        dx: u64,
        dw: u64,
        partial: u64,
        rows: usize,
        n: usize,
    ) -> Result<()> {
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

    #[allow(clippy::too_many_arguments)]
    fn head_norm_rope_forward(
        &self,
        (x, w, cos, sin): (u64, u64, u64, u64),
        y: u64,
        inv: u64,
        (tokens, heads, d): (usize, usize, usize),
        eps: f32,
    ) -> Result<()> {
        Self::check_head_dim(d)?;
        let rows = tokens * heads;
        if rows == 0 {
            return Ok(());
        }
        let (t, h, dd) = (i32_of("tokens", tokens)?, i32_of("heads", heads)?, i32_of("head_dim", d)?);
        let mut b = self.stream.launch_builder(&self.head_norm_rope_forward);
        b.arg(&x).arg(&w).arg(&cos).arg(&sin).arg(&y).arg(&inv).arg(&t).arg(&h).arg(&dd).arg(&eps);
        let warps = ROW_THREADS / 32;
        let cfg =
            LaunchConfig { grid_dim: (grid(rows, warps), 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 };
        self.launch("head_norm_rope_forward", b, cfg)
    }

    #[allow(clippy::too_many_arguments)]
    fn head_norm_rope_backward(
        &self,
        (dy, x, w, inv, cos, sin): (u64, u64, u64, u64, u64, u64),
        dx: u64,
        dw: u64,
        partial: u64,
        (tokens, heads, d): (usize, usize, usize),
    ) -> Result<()> {
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

    #[allow(clippy::too_many_arguments)]
    fn ce_grad_rows(
        &self,
        z: u64,
        labels: u64,
        weights: u64,
        loss: u64,
        rows: usize,
        vocab: usize,
        scale: f32,
    ) -> Result<()> {
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

    fn adamw_update(&self, (p, g, m, v, p_bf16): (u64, u64, u64, u64, u64), n: usize, a: AdamWArgs) -> Result<()> {
        let nn = n as i64;
        let mut b = self.stream.launch_builder(&self.adamw_update);
        b.arg(&p).arg(&g).arg(&m).arg(&v).arg(&p_bf16).arg(&nn);
        b.arg(&a.lr).arg(&a.beta1).arg(&a.beta2).arg(&a.eps).arg(&a.weight_decay).arg(&a.bc1).arg(&a.bc2);
        b.arg(&a.grad_scale);
        self.launch("adamw_update", b, Self::elementwise_cfg(n))
    }

    fn fill_normal(&self, dst: u64, n: usize, seed: u64, mean: f32, std: f32) -> Result<()> {
        let nn = n as i64;
        let mut b = self.stream.launch_builder(&self.fill_normal_bf16);
        b.arg(&dst).arg(&nn).arg(&seed).arg(&mean).arg(&std);
        self.launch("fill_normal_bf16", b, Self::elementwise_cfg(n))
    }
}

/// splitmix64, as `mix64` of the kernel source.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The standard normal draw number `i` of `seed`: the CPU twin of `fill_normal_bf16` (Box-Muller
/// on the hash of `(seed, i)`), in f64.
pub fn normal_at(seed: u64, i: u64) -> f64 {
    let h = mix64(seed ^ mix64(i));
    let u1 = ((h >> 40) + 1) as f64 / (1u64 << 24) as f64;
    let u2 = (h & 0xff_ffff) as f64 / (1u64 << 24) as f64;
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hash-based draws are standard normal: mean ~0, variance ~1 over many draws, and
    /// different seeds give different draws.
    #[test]
    fn normal_at_is_standard_normal() {
        let n = 200_000u64;
        let draws: Vec<f64> = (0..n).map(|i| normal_at(7, i)).collect();
        let mean = draws.iter().sum::<f64>() / n as f64;
        let var = draws.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        // 5 standard errors of the mean (1/sqrt(n)) and of the variance (sqrt(2/n)).
        assert!(mean.abs() < 5.0 / (n as f64).sqrt(), "mean {mean}");
        assert!((var - 1.0).abs() < 5.0 * (2.0 / n as f64).sqrt(), "variance {var}");
        assert_ne!(normal_at(7, 0), normal_at(8, 0));
    }
}
