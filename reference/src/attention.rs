//! Dense math attention with an explicit boolean mask; GQA by repeating K/V heads.

use candle_core::{Device, Tensor, D};

use crate::error::{Error, Result};

/// Added to the scores of masked-out pairs: far below any real score, finite so that a row
/// that sees nothing stays NaN-free (its output is then zeroed explicitly).
const MASKED_SCORE: f64 = -1e30;

/// `softmax(q k^T * d^-0.5 + mask) v` per query head.
/// q `[Q, nh, d]`, k and v `[K, nkv, d]`, mask `[Q, K]` row-major (true = may attend)
/// -> `[Q, nh, d]`. Query head `h` reads K/V head `h / (nh/nkv)`. Rows that see nothing give zeros.
pub fn dense_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &[bool]) -> Result<Tensor> {
    let (nq, nh, d) = q.dims3()?;
    let (nk, nkv, _) = k.dims3()?;
    if mask.len() != nq * nk {
        return Err(Error::invalid("mask", format!("{} entries for {nq} x {nk} scores", mask.len())));
    }
    let group = nh / nkv;
    let repeat = |x: &Tensor| -> Result<Tensor> {
        Ok(x.unsqueeze(2)?.broadcast_as((nk, nkv, group, d))?.reshape((nk, nh, d))?.transpose(0, 1)?.contiguous()?)
    };
    let (k, v) = (repeat(k)?, repeat(v)?); // [nh, K, d]
    let q = q.transpose(0, 1)?.contiguous()?; // [nh, Q, d]
    let dtype = q.dtype();
    let bias: Vec<f64> = mask.iter().map(|&m| if m { 0.0 } else { MASKED_SCORE }).collect();
    let bias = Tensor::from_vec(bias, (nq, nk), &Device::Cpu)?.to_dtype(dtype)?;
    let sees_any: Vec<f64> = mask.chunks(nk.max(1)).map(|row| f64::from(u8::from(row.iter().any(|&m| m)))).collect();
    let sees_any = Tensor::from_vec(sees_any, (nq, 1), &Device::Cpu)?.to_dtype(dtype)?;

    let scores = q.matmul(&k.t()?)?.affine((d as f64).powf(-0.5), 0.0)?.broadcast_add(&bias)?; // [nh, Q, K]
    let max = scores.max_keepdim(D::Minus1)?.detach();
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?.broadcast_mul(&sees_any)?;
    Ok(p.matmul(&v)?.transpose(0, 1)?) // [Q, nh, d]
}
