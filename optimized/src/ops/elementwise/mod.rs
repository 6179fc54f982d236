//! The step's elementwise and reduction operations on raw addresses (device pointers for the
//! CUDA kernels of `elementwise.cu`, host pointers for their CPU twins in [`twin`]): norms, head
//! norm + RoPE, SwiGLU, the CE gradient, the rows' argmax, row copies, sums of squares, gradient
//! accumulation, AdamW and the random fill. "Stored" values are the backend's element type
//! (`Elem`: bf16 on the GPU); side values (inverse RMS, RoPE tables, CE weights and losses,
//! partials, optimizer state) are its arithmetic type (`Elem::Acc`: fp32 on the GPU); indices
//! (labels, rows, argmax) are u32.

pub mod cuda;
pub mod twin;

use crate::Result;

/// Inputs of [`ElementwiseOps::rms_norm_backward`]: the output gradient `dy`, the forward's
/// input `x`, weight `w` and inverse RMS `inv`, and a residual gradient `dres` added to `dx`.
#[derive(Clone, Copy, Debug)]
pub struct RmsNormGrad {
    pub dy: u64,
    pub x: u64,
    pub w: u64,
    pub inv: u64,
    pub dres: Option<u64>,
}

/// Inputs of [`ElementwiseOps::head_norm_rope_forward`]: `x [T, heads, d]` with its tokens
/// `x_row` values apart (`heads * d` when contiguous; more when x is the q or k columns of a
/// stacked `[q | k | v]` projection), the head norm's weight `w [d]` and the RoPE tables `cos`,
/// `sin` `[T, d]`.
#[derive(Clone, Copy, Debug)]
pub struct HeadNormRope {
    pub x: u64,
    pub x_row: usize,
    pub w: u64,
    pub cos: u64,
    pub sin: u64,
}

impl HeadNormRope {
    /// Refuses tokens of x closer than `heads * d` values or at an odd distance (the kernels
    /// load pairs of values).
    pub fn check_row(x_row: usize, dims: Heads) -> Result<()> {
        if x_row < dims.heads * dims.head_dim || !x_row.is_multiple_of(2) {
            return Err(crate::Error::invalid(
                "head x rows",
                format!("{x_row} values apart: need an even distance of at least {} x {}", dims.heads, dims.head_dim),
            ));
        }
        Ok(())
    }

    /// Refuses an `x` whose tokens are not `heads * d` apart (the backward takes contiguous x).
    pub fn check_contiguous(&self, dims: Heads) -> Result<()> {
        if self.x_row != dims.heads * dims.head_dim {
            return Err(crate::Error::invalid(
                "head_norm_rope_backward",
                format!(
                    "x rows {} values apart; the backward takes contiguous [T, {}, {}]",
                    self.x_row, dims.heads, dims.head_dim
                ),
            ));
        }
        Ok(())
    }
}

/// Inputs of [`ElementwiseOps::head_norm_rope_backward`]: the output gradient and the
/// forward's inputs and inverse RMS.
#[derive(Clone, Copy, Debug)]
pub struct HeadNormRopeGrad {
    pub dy: u64,
    pub fwd: HeadNormRope,
    pub inv: u64,
}

/// Buffers of one AdamW update: master weights `p`, moments `m`, `v` (arithmetic type), the
/// gradient `g` (accumulated in the arithmetic type, or a step's own in the stored type when
/// `g_is_stored`), and the stored compute copy `p_stored` it writes.
#[derive(Clone, Copy, Debug)]
pub struct AdamWBuffers {
    pub p: u64,
    pub g: u64,
    pub g_is_stored: bool,
    pub m: u64,
    pub v: u64,
    pub p_stored: u64,
}

/// Buffers of [`ElementwiseOps::ce_grad_rows`]: logits `z [rows, V]` (stored, overwritten by
/// their gradient), labels (u32), weights and the per-row weighted CE it writes (arithmetic type).
#[derive(Clone, Copy, Debug)]
pub struct CeRows {
    pub z: u64,
    pub labels: u64,
    pub weights: u64,
    pub loss: u64,
}

/// Hyper-parameters of one AdamW update of one parameter (`adamw_update`).
#[derive(Clone, Copy, Debug)]
pub struct AdamWArgs {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// `1 - beta1^t` and `1 - beta2^t`.
    pub bc1: f64,
    pub bc2: f64,
    /// The clipping factor applied to the gradient first.
    pub grad_scale: f64,
}

/// Tensor sizes of a head kernel: `tokens` x `heads` heads of `head_dim`.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub tokens: usize,
    pub heads: usize,
    pub head_dim: usize,
}

/// The elementwise and reduction operations: `cuda::ElementwiseKernels` on the GPU,
/// `twin::ElementwiseTwin` on the CPU. Scalars are f64; the kernels take them as fp32.
pub trait ElementwiseOps {
    /// `y [rows, n] = rms_norm(x) * w`, `inv [rows]`.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_forward(&self, x: u64, w: u64, y: u64, inv: u64, rows: usize, n: usize, eps: f64) -> Result<()>;

    /// `dx [rows, n]` (plus `dres`) and `dw [n] :=` the weight gradient, through `partial`
    /// (`[GRAD_PARTS, n]` scratch); `dx` may be `dy`.
    fn rms_norm_backward(&self, g: RmsNormGrad, dx: u64, dw: u64, partial: u64, rows: usize, n: usize) -> Result<()>;

    /// `y [T, heads, d] = rope(rms_norm(x) * w)`, `inv [T*heads]`.
    fn head_norm_rope_forward(&self, f: HeadNormRope, y: u64, inv: u64, dims: Heads, eps: f64) -> Result<()>;

    /// `y [T, heads, d] = rope(x)` with the tables `cos`, `sin` `[T, d]` (targets without q/k norms).
    fn rope_forward(&self, x: u64, x_row: usize, cos: u64, sin: u64, y: u64, dims: Heads) -> Result<()>;

    /// `dx [T, heads, d]` through RoPE and the head norm, `dw [d] :=` (via `partial`); `dx` may be
    /// `dy`.
    fn head_norm_rope_backward(&self, g: HeadNormRopeGrad, dx: u64, dw: u64, partial: u64, dims: Heads) -> Result<()>;

    /// `h [rows, I] = silu(gate) * up` with `gu [rows, 2I]` holding each row's gate then up.
    fn swiglu_forward(&self, gu: u64, h: u64, rows: usize, inter: usize) -> Result<()>;

    /// `gu [rows, 2I]` := each row's `[dgate | dup]` from `dh [rows, I]` and its gate and up.
    fn swiglu_backward(&self, dh: u64, gu: u64, rows: usize, inter: usize) -> Result<()>;

    /// Logits `z [rows, vocab]` := `scale * w * (softmax(z) - onehot(y))`, `loss [rows] = w * CE`.
    fn ce_grad_rows(&self, ce: CeRows, rows: usize, vocab: usize, scale: f64) -> Result<()>;

    /// `out [rows]` (u32) := the first index of each row's maximum in `z [rows, vocab]` (stored).
    fn argmax_rows(&self, z: u64, rows: usize, vocab: usize, out: u64) -> Result<()>;

    /// `dst [count, cols] = src [idx[r], cols]` (`scatter`: `dst [idx[r]] = src [r]`), idx u32.
    fn copy_rows(&self, scatter: bool, src: u64, idx: u64, dst: u64, count: usize, cols: usize) -> Result<()>;

    /// `partial [parts]` with `sum(partial) = sum(x^2)` over `x [n]` (stored values when
    /// `stored`, else the arithmetic type); `parts` CTAs.
    fn sum_squares(&self, stored: bool, x: u64, partial: u64, n: usize, parts: usize) -> Result<()>;

    /// `acc [n] += g [n]` (arithmetic += stored).
    fn accumulate(&self, acc: u64, g: u64, n: usize) -> Result<()>;

    /// One AdamW update of `n` values.
    fn adamw_update(&self, b: AdamWBuffers, n: usize, a: AdamWArgs) -> Result<()>;

    /// `dst [n] = stored(mean + std * normal_at(seed, i))`.
    fn fill_normal(&self, dst: u64, n: usize, seed: u64, mean: f32, std: f32) -> Result<()>;
}
