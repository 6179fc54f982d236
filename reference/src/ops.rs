//! Layer ops composed from candle-core primitives that all have a backward (candle-nn's fused
//! `rms_norm`, `softmax_last_dim` and `rope` have none and would silently stop gradients).

use candle_core::{DType, Device, Tensor, D};

use crate::config::RopeScaling;
use crate::error::Result;

/// `x @ w^T`: x `[rows, in]`, w `[out, in]` -> `[rows, out]`.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.matmul(&w.t()?)?)
}

/// RMSNorm over the last dim: `x / sqrt(mean(x^2) + eps) * w`; x `[.., n]`, w `[n]`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let inv_rms = x.sqr()?.mean_keepdim(D::Minus1)?.affine(1.0, eps)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&inv_rms)?.broadcast_mul(w)?)
}

/// `x * sigmoid(x)`.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    let sigmoid = x.neg()?.exp()?.affine(1.0, 1.0)?.recip()?;
    Ok((x * sigmoid)?)
}

/// `log(sum(exp(x)))` over the last dim, keepdim; the max is a detached shift (exact gradient).
pub fn logsumexp(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    Ok(x.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?.log()?.broadcast_add(&max)?)
}

/// RoPE angle tables for `positions`: `cos`, `sin` `[T, d]`, neox layout (the `d/2` frequencies
/// `theta^(-2i/d)` repeated twice).
pub fn rope_tables(positions: &[usize], head_dim: usize, theta: f64, dtype: DType) -> Result<(Tensor, Tensor)> {
    rope_tables_scaled(positions, head_dim, theta, &RopeScaling::Default, dtype)
}

/// [`rope_tables`] under a RoPE scaling: its inverse frequencies, and cos and sin multiplied by
/// its attention factor.
pub fn rope_tables_scaled(
    positions: &[usize],
    head_dim: usize,
    theta: f64,
    scaling: &RopeScaling,
    dtype: DType,
) -> Result<(Tensor, Tensor)> {
    let (half, inv_freq, scale) = (head_dim / 2, scaling.inv_freq(head_dim, theta), scaling.attention_factor());
    let mut cos = Vec::with_capacity(positions.len() * head_dim);
    let mut sin = Vec::with_capacity(positions.len() * head_dim);
    for &p in positions {
        for i in 0..head_dim {
            let angle = p as f64 * inv_freq[i % half];
            cos.push(angle.cos() * scale);
            sin.push(angle.sin() * scale);
        }
    }
    let shape = (positions.len(), head_dim);
    Ok((
        Tensor::from_vec(cos, shape, &Device::Cpu)?.to_dtype(dtype)?,
        Tensor::from_vec(sin, shape, &Device::Cpu)?.to_dtype(dtype)?,
    ))
}

/// Neox RoPE: `x*cos + rotate_half(x)*sin`, `rotate_half([x1, x2]) = [-x2, x1]`;
/// x `[T, heads, d]`, cos/sin `[T, d]`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    let (cos, sin) = (cos.unsqueeze(1)?, sin.unsqueeze(1)?);
    Ok((x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?)
}

/// `[rows, heads*d]` -> per-head RMSNorm with weight `[d]` -> `[rows, heads, d]`.
pub fn head_rms_norm(x: &Tensor, heads: usize, w: &Tensor, eps: f64) -> Result<Tensor> {
    let rows = x.dim(0)?;
    rms_norm(&x.reshape((rows, heads, ()))?, w, eps)
}

/// SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
pub fn swiglu(x: &Tensor, gate: &Tensor, up: &Tensor, down: &Tensor) -> Result<Tensor> {
    let h = (silu(&linear(x, gate)?)? * linear(x, up)?)?;
    linear(&h, down)
}
