//! The CPU twins of the `elementwise.cu` kernels, element for element on the same layouts, in
//! the storage's arithmetic type (`Elem::Acc`: f32 for bf16 and f32 storage, as the GPU's fp32
//! arithmetic; f64 for f64 storage, the twins against the reference); the CE's log-sum-exp runs
//! in f64. Addresses are host pointers: every access is a raw read or write, so in-place
//! operations (dx over dy, dgate over gate) are fine. Nothing here allocates.

use std::marker::PhantomData;

use super::{AdamWArgs, AdamWBuffers, CeRows, ElementwiseOps, HeadNormRope, HeadNormRopeGrad, Heads, RmsNormGrad};
use crate::ops::{Elem, Real};
use crate::Result;
use dflash_reference::hash::splitmix64;

/// The CPU twins on values stored as `E`.
pub struct ElementwiseTwin<E>(PhantomData<E>);

impl<E> Default for ElementwiseTwin<E> {
    fn default() -> Self {
        ElementwiseTwin(PhantomData)
    }
}

/// Stored value `i` of `p`, in the arithmetic type.
pub fn ld<E: Elem>(p: u64, i: usize) -> E::Acc {
    // SAFETY: callers index inside buffers of the step's layout (or the tests' own buffers).
    unsafe { (*(p as *const E).add(i)).to_acc() }
}

/// Stores `v` as value `i` of `p`.
pub fn st<E: Elem>(p: u64, i: usize, v: E::Acc) {
    // SAFETY: as `ld`.
    unsafe { *(p as *mut E).add(i) = E::from_acc(v) }
}

/// Arithmetic-type value `i` of `p`.
pub fn lda<A: Real>(p: u64, i: usize) -> A {
    // SAFETY: as `ld`.
    unsafe { *(p as *const A).add(i) }
}

/// Stores arithmetic-type `v` as value `i` of `p`.
pub fn sta<A: Real>(p: u64, i: usize, v: A) {
    // SAFETY: as `ld`.
    unsafe { *(p as *mut A).add(i) = v }
}

fn ld_u32(p: u64, i: usize) -> u32 {
    // SAFETY: as `ld`.
    unsafe { *(p as *const u32).add(i) }
}

fn st_u32(p: u64, i: usize, v: u32) {
    // SAFETY: as `ld`.
    unsafe { *(p as *mut u32).add(i) = v }
}

fn sigmoid<A: Real>(x: A) -> A {
    A::ONE / (A::ONE + (-x).exp())
}

/// `1 / sqrt(mean(x_i^2) + eps)` over the `n` stored values of `x` from `base`.
fn inv_rms<E: Elem>(x: u64, base: usize, n: usize, eps: E::Acc) -> E::Acc {
    let ss = (0..n).fold(E::Acc::ZERO, |s, i| s + ld::<E>(x, base + i) * ld::<E>(x, base + i));
    E::Acc::ONE / (ss / E::Acc::from_f64(n as f64) + eps).sqrt()
}

/// The RMSNorm backward of one row of `n` values with output gradient `g(i)`: writes `dx` and
/// adds this row's weight gradient to `partial[0..n]`. With `r = inv`:
/// `dx = r * g * w - x * r^3 * mean(g * w * x)`, `dw += g * x * r`.
#[allow(clippy::too_many_arguments)]
fn rms_norm_row_backward<E: Elem>(
    g: impl Fn(usize) -> E::Acc,
    x: u64,
    w: u64,
    r: E::Acc,
    base: usize,
    n: usize,
    partial: u64,
    mut write: impl FnMut(usize, E::Acc),
) {
    let dot = (0..n).fold(E::Acc::ZERO, |s, i| s + g(i) * ld::<E>(w, i) * ld::<E>(x, base + i));
    let coeff = r * r * r * dot / E::Acc::from_f64(n as f64);
    for i in 0..n {
        let (gi, xv) = (g(i), ld::<E>(x, base + i));
        sta(partial, i, lda::<E::Acc>(partial, i) + gi * xv * r);
        write(i, r * gi * ld::<E>(w, i) - xv * coeff);
    }
}

impl<E: Elem> ElementwiseOps for ElementwiseTwin<E> {
    fn rms_norm_forward(&self, x: u64, w: u64, y: u64, inv: u64, rows: usize, n: usize, eps: f64) -> Result<()> {
        let eps = E::Acc::from_f64(eps);
        for r in 0..rows {
            let rr = inv_rms::<E>(x, r * n, n, eps);
            (0..n).for_each(|i| st::<E>(y, r * n + i, ld::<E>(x, r * n + i) * rr * ld::<E>(w, i)));
            sta(inv, r, rr);
        }
        Ok(())
    }

    fn rms_norm_backward(&self, g: RmsNormGrad, dx: u64, dw: u64, partial: u64, rows: usize, n: usize) -> Result<()> {
        (0..n).for_each(|i| sta(partial, i, E::Acc::ZERO));
        for r in 0..rows {
            let base = r * n;
            // dy is read whole before dx (which may be dy) is written.
            let dy: Vec<E::Acc> = (0..n).map(|i| ld::<E>(g.dy, base + i)).collect();
            let rr = lda::<E::Acc>(g.inv, r);
            rms_norm_row_backward::<E>(
                |i| dy[i],
                g.x,
                g.w,
                rr,
                base,
                n,
                partial,
                |i, v| {
                    let res = g.dres.map_or(E::Acc::ZERO, |d| ld::<E>(d, base + i));
                    st::<E>(dx, base + i, v + res)
                },
            );
        }
        (0..n).for_each(|i| st::<E>(dw, i, lda(partial, i)));
        Ok(())
    }

    fn head_norm_rope_forward(&self, f: HeadNormRope, y: u64, inv: u64, dims: Heads, eps: f64) -> Result<()> {
        HeadNormRope::check_row(f.x_row, dims)?;
        let Heads { tokens, heads, head_dim: d } = dims;
        let (half, eps) = (d / 2, E::Acc::from_f64(eps));
        for row in 0..tokens * heads {
            let (t, base) = (row / heads, row * d);
            let from = t * f.x_row + row % heads * d;
            let rr = inv_rms::<E>(f.x, from, d, eps);
            let normed = |i: usize| ld::<E>(f.x, from + i) * rr * ld::<E>(f.w, i);
            let out: Vec<E::Acc> = (0..d)
                .map(|i| {
                    let rot = if i < half { -normed(i + half) } else { normed(i - half) };
                    normed(i) * lda::<E::Acc>(f.cos, t * d + i) + rot * lda::<E::Acc>(f.sin, t * d + i)
                })
                .collect();
            out.into_iter().enumerate().for_each(|(i, v)| st::<E>(y, base + i, v));
            sta(inv, row, rr);
        }
        Ok(())
    }

    fn rope_forward(&self, x: u64, x_row: usize, cos: u64, sin: u64, y: u64, dims: Heads) -> Result<()> {
        HeadNormRope::check_row(x_row, dims)?;
        let Heads { tokens, heads, head_dim: d } = dims;
        let half = d / 2;
        for row in 0..tokens * heads {
            let (t, base) = (row / heads, row * d);
            let from = t * x_row + row % heads * d;
            let out: Vec<E::Acc> = (0..d)
                .map(|i| {
                    let rot = if i < half { -ld::<E>(x, from + i + half) } else { ld::<E>(x, from + i - half) };
                    ld::<E>(x, from + i) * lda::<E::Acc>(cos, t * d + i) + rot * lda::<E::Acc>(sin, t * d + i)
                })
                .collect();
            out.into_iter().enumerate().for_each(|(i, v)| st::<E>(y, base + i, v));
        }
        Ok(())
    }

    fn head_norm_rope_backward(&self, g: HeadNormRopeGrad, dx: u64, dw: u64, partial: u64, dims: Heads) -> Result<()> {
        g.fwd.check_contiguous(dims)?;
        let Heads { tokens, heads, head_dim: d } = dims;
        let half = d / 2;
        let (cos, sin) = (g.fwd.cos, g.fwd.sin);
        (0..d).for_each(|i| sta(partial, i, E::Acc::ZERO));
        for row in 0..tokens * heads {
            let (t, base) = (row / heads, row * d);
            // Through RoPE: dxn = dy*cos + [u2, -u1] with u = dy*sin.
            let u = |i: usize| ld::<E>(g.dy, base + i) * lda::<E::Acc>(sin, t * d + i);
            let dxn: Vec<E::Acc> = (0..d)
                .map(|i| {
                    let rot = if i < half { u(i + half) } else { -u(i - half) };
                    ld::<E>(g.dy, base + i) * lda::<E::Acc>(cos, t * d + i) + rot
                })
                .collect();
            let rr = lda::<E::Acc>(g.inv, row);
            rms_norm_row_backward::<E>(
                |i| dxn[i],
                g.fwd.x,
                g.fwd.w,
                rr,
                base,
                d,
                partial,
                |i, v| st::<E>(dx, base + i, v),
            );
        }
        (0..d).for_each(|i| st::<E>(dw, i, lda(partial, i)));
        Ok(())
    }

    fn swiglu_forward(&self, gu: u64, h: u64, rows: usize, inter: usize) -> Result<()> {
        for r in 0..rows {
            for c in 0..inter {
                let (g, u) = (ld::<E>(gu, r * 2 * inter + c), ld::<E>(gu, r * 2 * inter + inter + c));
                st::<E>(h, r * inter + c, g * sigmoid(g) * u);
            }
        }
        Ok(())
    }

    fn swiglu_backward(&self, dh: u64, gu: u64, rows: usize, inter: usize) -> Result<()> {
        let one = E::Acc::ONE;
        for r in 0..rows {
            for c in 0..inter {
                let (gi, ui) = (r * 2 * inter + c, r * 2 * inter + inter + c);
                let (d, g, u) = (ld::<E>(dh, r * inter + c), ld::<E>(gu, gi), ld::<E>(gu, ui));
                let s = sigmoid(g);
                st::<E>(gu, gi, d * u * s * (one + g * (one - s)));
                st::<E>(gu, ui, d * g * s);
            }
        }
        Ok(())
    }

    fn ce_grad_rows(&self, ce: CeRows, rows: usize, vocab: usize, scale: f64) -> Result<()> {
        let CeRows { z, labels, weights, loss } = ce;
        for r in 0..rows {
            let base = r * vocab;
            let zf = |i: usize| ld::<E>(z, base + i).to_f64();
            let max = (0..vocab).map(zf).fold(f64::NEG_INFINITY, f64::max);
            let lse = max + (0..vocab).map(|i| (zf(i) - max).exp()).sum::<f64>().ln();
            let (y, w) = (ld_u32(labels, r) as usize, lda::<E::Acc>(weights, r).to_f64());
            sta(loss, r, E::Acc::from_f64(w * (lse - zf(y))));
            for i in 0..vocab {
                let p = (zf(i) - lse).exp();
                st::<E>(z, base + i, E::Acc::from_f64(scale * w * (p - if i == y { 1.0 } else { 0.0 })));
            }
        }
        Ok(())
    }

    /// Candle's argmax, as `dflash_reference::speculative::argmax_rows`: from value 0, a later
    /// value replaces the best only when strictly larger, so ties keep the first index and a NaN
    /// is never taken (a row whose value 0 is NaN gives 0). The kernel reduces in parallel to the
    /// same index.
    fn argmax_rows(&self, z: u64, rows: usize, vocab: usize, out: u64) -> Result<()> {
        if vocab == 0 && rows > 0 {
            return Err(crate::Error::invalid("argmax_rows", "rows of 0 values have no maximum"));
        }
        for r in 0..rows {
            let base = r * vocab;
            let (mut best, mut best_v) = (0, ld::<E>(z, base));
            for i in 1..vocab {
                let v = ld::<E>(z, base + i);
                if best_v < v {
                    (best, best_v) = (i, v);
                }
            }
            st_u32(out, r, best as u32);
        }
        Ok(())
    }

    /// The rows' bytes, as the kernel copies them (stored values that are an fp32 table's
    /// halves, or a NaN's payload, are not values to convert).
    fn copy_rows(&self, scatter: bool, src: u64, idx: u64, dst: u64, count: usize, cols: usize) -> Result<()> {
        let bytes = cols * E::BYTES;
        for r in 0..count {
            let row = ld_u32(idx, r) as usize;
            let (from, to) = if scatter { (r, row) } else { (row, r) };
            // SAFETY: rows inside the callers' buffers, as `ld`'s; `copy` allows overlap.
            unsafe { std::ptr::copy((src as *const u8).add(from * bytes), (dst as *mut u8).add(to * bytes), bytes) };
        }
        Ok(())
    }

    /// Summed in f64 (the kernel's tree of partials is as accurate; a sequential fp32 sum over
    /// a billion-parameter gradient would not be).
    fn sum_squares(&self, stored: bool, x: u64, partial: u64, n: usize, parts: usize) -> Result<()> {
        let value = |i: usize| if stored { ld::<E>(x, i) } else { lda::<E::Acc>(x, i) }.to_f64();
        let sum: f64 = (0..n).map(|i| value(i) * value(i)).sum();
        (0..parts).for_each(|p| sta(partial, p, E::Acc::from_f64(if p == 0 { sum } else { 0.0 })));
        Ok(())
    }

    fn accumulate(&self, acc: u64, g: u64, n: usize) -> Result<()> {
        (0..n).for_each(|i| sta(acc, i, lda::<E::Acc>(acc, i) + ld::<E>(g, i)));
        Ok(())
    }

    fn adamw_update(&self, b: AdamWBuffers, n: usize, a: AdamWArgs) -> Result<()> {
        let c = |x: f64| E::Acc::from_f64(x);
        let (one, lr, b1, b2) = (E::Acc::ONE, c(a.lr), c(a.beta1), c(a.beta2));
        for i in 0..n {
            let g = if b.g_is_stored { ld::<E>(b.g, i) } else { lda::<E::Acc>(b.g, i) };
            let gi = g * c(a.grad_scale);
            let mi = b1 * lda::<E::Acc>(b.m, i) + (one - b1) * gi;
            let vi = b2 * lda::<E::Acc>(b.v, i) + (one - b2) * gi * gi;
            let p = lda::<E::Acc>(b.p, i);
            let pi = p - lr * ((mi / c(a.bc1)) / ((vi / c(a.bc2)).sqrt() + c(a.eps)) + c(a.weight_decay) * p);
            sta(b.m, i, mi);
            sta(b.v, i, vi);
            sta(b.p, i, pi);
            st::<E>(b.p_stored, i, pi);
        }
        Ok(())
    }

    fn fill_normal(&self, dst: u64, n: usize, seed: u64, mean: f32, std: f32) -> Result<()> {
        let (mean, std) = (f64::from(mean), f64::from(std));
        (0..n).for_each(|i| st::<E>(dst, i, E::Acc::from_f64(mean + std * normal_at(seed, i as u64))));
        Ok(())
    }
}

/// The standard normal draw number `i` of `seed`: the CPU twin of `fill_normal_bf16` (Box-Muller
/// on the hash of `(seed, i)`), in f64.
pub fn normal_at(seed: u64, i: u64) -> f64 {
    let h = splitmix64(seed ^ splitmix64(i));
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
