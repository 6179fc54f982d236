//! Per-layer ops of the drafter step as explicit forward/backward pairs (llm.c style): plain
//! candle tensors on the CPU (f32 or f64), never tracked by autograd. Each forward is the
//! reference op of `dflash_reference::ops` (called, not copied, wherever it exposes what the
//! backward needs); each backward is derived by hand, its formula on the line `d... =`, and
//! composed from candle's matmul, broadcast and reduction ops. Gradients are named `d*`.
//!
//! Conformance: `conformance/tests/step_ops.rs` proves every backward equal to candle autograd of
//! the reference op and every forward equal to the reference forward.

use candle_core::{Tensor, D};
use dflash_reference::ops;
use dflash_reference::Result;

/// `y = x @ w^T`: x `[rows, in]`, w `[out, in]` -> `[rows, out]`. Exactly `reference::ops::linear`.
pub fn linear_forward(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    ops::linear(x, w)
}

/// `(dx [rows, in], dw [out, in])` from dy `[rows, out]`:
/// `dx = dy @ w`, `dw = dy^T @ x`.
pub fn linear_backward(dy: &Tensor, x: &Tensor, w: &Tensor) -> Result<(Tensor, Tensor)> {
    let dx = dy.matmul(w)?;
    let dw = dy.t()?.matmul(x)?;
    Ok((dx, dw))
}

/// RMSNorm over the last dim: x `[.., n]`, w `[n]` -> `(y [.., n], inv_rms [.., 1])`;
/// `y = x * inv_rms * w`, `inv_rms = 1 / sqrt(mean(x^2) + eps)`.
///
/// The same ops in the same order as `reference::ops::rms_norm` (so `y` is bit-equal to it),
/// written out here because the reference keeps `inv_rms` to itself and the backward needs it.
pub fn rms_norm_forward(x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let inv_rms = x.sqr()?.mean_keepdim(D::Minus1)?.affine(1.0, eps)?.sqrt()?.recip()?;
    let y = x.broadcast_mul(&inv_rms)?.broadcast_mul(w)?;
    Ok((y, inv_rms))
}

/// `(dx [.., n], dw [n])` from dy `[.., n]`, with `inv_rms [.., 1]` of the forward (`r` below);
/// `dw` sums over all leading dims. With `g = dy * w` and `d r / d x_i = -r^3 x_i / n`:
/// `dx = r * (g - x * r^2 * mean(g * x))`, `dw = sum_leading(dy * x * r)`.
pub fn rms_norm_backward(dy: &Tensor, x: &Tensor, w: &Tensor, inv_rms: &Tensor) -> Result<(Tensor, Tensor)> {
    let n = x.dim(D::Minus1)?;
    let g = dy.broadcast_mul(w)?;
    let gx_mean = (&g * x)?.mean_keepdim(D::Minus1)?;
    let coeff = (inv_rms.sqr()? * gx_mean)?;
    let dx = g.broadcast_sub(&x.broadcast_mul(&coeff)?)?.broadcast_mul(inv_rms)?;
    let x_hat = x.broadcast_mul(inv_rms)?;
    let dw = (dy * x_hat)?.reshape(((), n))?.sum(0)?;
    Ok((dx, dw))
}

/// Neox RoPE: x `[T, heads, d]`, cos/sin `[T, d]` (as `reference::ops::rope_tables` makes them)
/// -> `[T, heads, d]`; `y = x * cos + rotate_half(x) * sin`. Exactly `reference::ops::rope`.
pub fn rope_forward(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    ops::rope(x, cos, sin)
}

/// dx `[T, heads, d]` from dy `[T, heads, d]`: the transpose of the rotation. `rotate_half` is the
/// matrix `R [x1, x2] = [-x2, x1]` with `R^T [y1, y2] = [y2, -y1]`, so with `u = dy * sin`:
/// `dx = dy * cos + R^T u = dy * cos + [u2, -u1]` (exact for any tables, not only neox ones).
pub fn rope_backward(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = dy.dim(D::Minus1)? / 2;
    let (cos, sin) = (cos.unsqueeze(1)?, sin.unsqueeze(1)?);
    let u = dy.broadcast_mul(&sin)?;
    let rotated_t =
        Tensor::cat(&[&u.narrow(D::Minus1, half, half)?, &u.narrow(D::Minus1, 0, half)?.neg()?], D::Minus1)?;
    Ok((dy.broadcast_mul(&cos)? + rotated_t)?)
}

/// `h = silu(gate) * up`, all `[rows, I]`; `silu` is `reference::ops::silu`.
pub fn swiglu_forward(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok((ops::silu(gate)? * up)?)
}

/// `(dgate, dup)` `[rows, I]` from dh `[rows, I]`. With `s = sigmoid(gate)`, `silu = gate * s` and
/// `silu' = s * (1 + gate * (1 - s))`: `dgate = dh * up * silu'`, `dup = dh * silu`.
/// (`s` is the reference's sigmoid, `1 / (1 + exp(-gate))`, computed once for both.)
pub fn swiglu_backward(dh: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
    let s = gate.neg()?.exp()?.affine(1.0, 1.0)?.recip()?;
    let silu = (gate * &s)?;
    let dsilu = (&s * (gate * s.affine(-1.0, 1.0)?)?.affine(1.0, 1.0)?)?;
    let dgate = ((dh * up)? * dsilu)?;
    let dup = (dh * silu)?;
    Ok((dgate, dup))
}
