//! The planned step on the CPU: [`Host`] allocates the plan's buffers in host memory and
//! [`HostOps`] are the CPU twins of the `step.cu` kernels, element for element on the same
//! layouts, storing bf16 (the GPU step's twin) or f32 (fp32 arithmetic, f64 for the CE's
//! log-sum-exp). Matmuls are plain loops with fp32
//! accumulation; attention is the fused attention's CPU twin (`attention::cpu`) on fp32 copies.
//! Nothing here allocates except the attention, whose scratch [`Host::attention_scratch_bytes`]
//! bounds (`Backend::attention_scratch_bytes`), so a step's heap is its plan plus that.
//!
//! Addresses are host pointers; every access goes through raw reads and writes, so in-place
//! operations (dx over dy, dgate over gate) are fine.

use std::alloc::{alloc_zeroed, dealloc, Layout};

use dflash_reference::{Error, Result};
use std::marker::PhantomData;

use super::backend::{Allocation, Backend, Elem};
use super::kernels::{normal_at, AdamWArgs, StepOps};
use crate::attention::cpu::{
    attention_backward, attention_backward_bytes, attention_forward, attention_forward_bytes, AttnShape,
};
use crate::attention::plan::AttentionPlan;
use crate::blas::Mat;

/// Alignment of host allocations (the GPU's 16-byte vector loads have their twin here).
const ALIGN: usize = 16;

/// A zeroed host allocation, freed on drop.
pub struct HostAlloc {
    ptr: *mut u8,
    layout: Layout,
}

impl Allocation for HostAlloc {
    fn ptr(&self) -> u64 {
        self.ptr as u64
    }
}

impl Drop for HostAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated by `alloc_zeroed` with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

/// The CPU as a backend of the planned step, storing `E` (bf16: the GPU step's twin; f32).
#[derive(Default)]
pub struct Host<E> {
    ops: HostOps<E>,
}

/// The CPU twins of the `step.cu` kernels, on values stored as `E`.
pub struct HostOps<E>(PhantomData<E>);

impl<E> Default for HostOps<E> {
    fn default() -> Self {
        HostOps(PhantomData)
    }
}

fn ld<E: Elem>(p: u64, i: usize) -> f32 {
    // SAFETY: callers index inside buffers of the step's plan.
    unsafe { (*(p as *const E).add(i)).to_f32() }
}

fn st<E: Elem>(p: u64, i: usize, v: f32) {
    // SAFETY: as `ld`.
    unsafe { *(p as *mut E).add(i) = E::from_f32(v) }
}

fn ld32(p: u64, i: usize) -> f32 {
    // SAFETY: as `ld`.
    unsafe { *(p as *const f32).add(i) }
}

fn st32(p: u64, i: usize, v: f32) {
    // SAFETY: as `ld`.
    unsafe { *(p as *mut f32).add(i) = v }
}

fn ld_u32(p: u64, i: usize) -> u32 {
    // SAFETY: as `ld`.
    unsafe { *(p as *const u32).add(i) }
}

/// `count` stored values from `p` as f32 (allocates: attention scratch only).
fn widen<E: Elem>(p: u64, count: usize) -> Vec<f32> {
    (0..count).map(|i| ld::<E>(p, i)).collect()
}

/// Heap bytes the attention allocates beyond the plan, at its largest (forward or backward):
/// fp32 copies of its bf16 inputs and the CPU twin's own planned ceiling.
fn attention_scratch(plan: &AttentionPlan, shape: AttnShape) -> u64 {
    let (nq, nk) = (plan.num_queries, plan.num_keys);
    let (q, kv) = (nq * shape.num_heads * shape.head_dim, nk * shape.num_kv_heads * shape.head_dim);
    let forward = 4 * (q + 2 * kv) + attention_forward_bytes(plan, shape, 4);
    let backward = 4 * (3 * q + 2 * kv) + attention_backward_bytes(plan, shape, 4);
    forward.max(backward) as u64
}

impl<E: Elem> Backend for Host<E> {
    type Elem = E;
    type Ops = HostOps<E>;
    type Alloc = HostAlloc;
    type Plan = AttentionPlan;

    fn name(&self) -> &str {
        "CPU"
    }

    fn available_bytes(&self) -> Result<u64> {
        Ok(u64::MAX)
    }

    fn alloc(&self, name: &str, bytes: usize) -> Result<HostAlloc> {
        let layout = Layout::from_size_align(bytes.max(1), ALIGN)
            .map_err(|e| Error::invalid(name, format!("{bytes} bytes: {e}")))?;
        // SAFETY: the layout has a nonzero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::invalid(name, format!("out of host memory allocating {bytes} bytes")));
        }
        Ok(HostAlloc { ptr, layout })
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        // SAFETY: callers pass a buffer of at least `src.len()` bytes.
        unsafe { std::ptr::copy(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        // SAFETY: as `upload`.
        unsafe { std::ptr::copy(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn zero(&self, ptr: u64, bytes: usize) -> Result<()> {
        // SAFETY: as `upload`.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, bytes) };
        Ok(())
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: as `upload`.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    fn ops(&self) -> &HostOps<E> {
        &self.ops
    }

    fn matmul(&self, a: Mat, b: Mat, c: u64, beta: f32) -> Result<()> {
        let (m, k) = if a.t { (a.cols, a.rows) } else { (a.rows, a.cols) };
        let (kb, n) = if b.t { (b.cols, b.rows) } else { (b.rows, b.cols) };
        if k != kb {
            return Err(Error::invalid("matmul", format!("inner dims differ: a is {m}x{k}, b is {kb}x{n}")));
        }
        let at = |i: usize, x: usize| if a.t { ld::<E>(a.ptr, x * a.cols + i) } else { ld::<E>(a.ptr, i * a.cols + x) };
        let bt = |x: usize, j: usize| if b.t { ld::<E>(b.ptr, j * b.cols + x) } else { ld::<E>(b.ptr, x * b.cols + j) };
        for i in 0..m {
            for j in 0..n {
                let acc: f32 = (0..k).map(|x| at(i, x) * bt(x, j)).sum();
                let old = if beta != 0.0 { beta * ld::<E>(c, i * n + j) } else { 0.0 };
                st::<E>(c, i * n + j, acc + old);
            }
        }
        Ok(())
    }

    fn upload_plan(&self, plan: &AttentionPlan) -> Result<AttentionPlan> {
        Ok(plan.clone())
    }

    fn attention_scratch_bytes(&self, plan: &AttentionPlan, shape: AttnShape) -> u64 {
        attention_scratch(plan, shape)
    }

    fn attention_forward(
        &self,
        plan: &AttentionPlan,
        shape: AttnShape,
        (q, k, v): (u64, u64, u64),
        (out, lse): (u64, u64),
    ) -> Result<()> {
        let (nq, nk) = (plan.num_queries, plan.num_keys);
        let (q_len, kv_len) = (nq * shape.num_heads * shape.head_dim, nk * shape.num_kv_heads * shape.head_dim);
        let scale = (shape.head_dim as f64).powf(-0.5);
        let (o, l) = attention_forward(
            plan,
            shape,
            &widen::<E>(q, q_len),
            &widen::<E>(k, kv_len),
            &widen::<E>(v, kv_len),
            scale,
        )?;
        o.iter().enumerate().for_each(|(i, &x)| st::<E>(out, i, x));
        l.iter().enumerate().for_each(|(i, &x)| st32(lse, i, x));
        Ok(())
    }

    fn attention_backward(
        &self,
        plan: &AttentionPlan,
        shape: AttnShape,
        (q, k, v): (u64, u64, u64),
        (out, lse, dout): (u64, u64, u64),
        _dsum: u64,
        (dq, dk, dv): (u64, u64, u64),
    ) -> Result<()> {
        let (nq, nk) = (plan.num_queries, plan.num_keys);
        let (q_len, kv_len) = (nq * shape.num_heads * shape.head_dim, nk * shape.num_kv_heads * shape.head_dim);
        let scale = (shape.head_dim as f64).powf(-0.5);
        // SAFETY: lse is the plan's fp32 [nh, Q] buffer.
        let lse = unsafe { std::slice::from_raw_parts(lse as *const f32, shape.num_heads * nq) };
        let (gq, gk, gv) = attention_backward(
            plan,
            shape,
            &widen::<E>(q, q_len),
            &widen::<E>(k, kv_len),
            &widen::<E>(v, kv_len),
            &widen::<E>(out, q_len),
            lse,
            &widen::<E>(dout, q_len),
            scale,
        )?;
        for (dst, src) in [(dq, &gq), (dk, &gk), (dv, &gv)] {
            src.iter().enumerate().for_each(|(i, &x)| st::<E>(dst, i, x));
        }
        Ok(())
    }
}

impl<E: Elem> StepOps for HostOps<E> {
    fn rms_norm_forward(&self, x: u64, w: u64, y: u64, inv: u64, rows: usize, n: usize, eps: f32) -> Result<()> {
        for r in 0..rows {
            let ss: f32 = (0..n).map(|i| ld::<E>(x, r * n + i).powi(2)).sum();
            let rr = 1.0 / (ss / n as f32 + eps).sqrt();
            (0..n).for_each(|i| st::<E>(y, r * n + i, ld::<E>(x, r * n + i) * rr * ld::<E>(w, i)));
            st32(inv, r, rr);
        }
        Ok(())
    }

    fn rms_norm_backward(
        &self,
        (dy, x, w, inv, dres): (u64, u64, u64, u64, u64),
        dx: u64,
        dw: u64,
        partial: u64,
        rows: usize,
        n: usize,
    ) -> Result<()> {
        (0..n).for_each(|i| st32(partial, i, 0.0));
        for r in 0..rows {
            let rr = ld32(inv, r);
            let dot: f32 = (0..n).map(|i| ld::<E>(dy, r * n + i) * ld::<E>(w, i) * ld::<E>(x, r * n + i)).sum();
            let coeff = rr * rr * rr * dot / n as f32;
            for i in 0..n {
                let (g, xv) = (ld::<E>(dy, r * n + i), ld::<E>(x, r * n + i));
                st32(partial, i, ld32(partial, i) + g * xv * rr);
                let res = if dres != 0 { ld::<E>(dres, r * n + i) } else { 0.0 };
                st::<E>(dx, r * n + i, rr * g * ld::<E>(w, i) - xv * coeff + res);
            }
        }
        (0..n).for_each(|i| st::<E>(dw, i, ld32(partial, i)));
        Ok(())
    }

    fn head_norm_rope_forward(
        &self,
        (x, w, cos, sin): (u64, u64, u64, u64),
        y: u64,
        inv: u64,
        (tokens, heads, d): (usize, usize, usize),
        eps: f32,
    ) -> Result<()> {
        let half = d / 2;
        for row in 0..tokens * heads {
            let (t, base) = (row / heads, row * d);
            let rr = 1.0 / ((0..d).map(|i| ld::<E>(x, base + i).powi(2)).sum::<f32>() / d as f32 + eps).sqrt();
            let normed = |i: usize| ld::<E>(x, base + i) * rr * ld::<E>(w, i);
            for i in 0..d {
                let rot = if i < half { -normed(i + half) } else { normed(i - half) };
                st::<E>(y, base + i, normed(i) * ld32(cos, t * d + i) + rot * ld32(sin, t * d + i));
            }
            st32(inv, row, rr);
        }
        Ok(())
    }

    fn head_norm_rope_backward(
        &self,
        (dy, x, w, inv, cos, sin): (u64, u64, u64, u64, u64, u64),
        dx: u64,
        dw: u64,
        partial: u64,
        (tokens, heads, d): (usize, usize, usize),
    ) -> Result<()> {
        let half = d / 2;
        (0..d).for_each(|i| st32(partial, i, 0.0));
        for row in 0..tokens * heads {
            let (t, base) = (row / heads, row * d);
            // dxn = dy*cos + [u2, -u1] with u = dy*sin; kept in the partial's spare row d..2d.
            let u = |i: usize| ld::<E>(dy, base + i) * ld32(sin, t * d + i);
            for i in 0..d {
                let rot = if i < half { u(i + half) } else { -u(i - half) };
                st32(partial, d + i, ld::<E>(dy, base + i) * ld32(cos, t * d + i) + rot);
            }
            let rr = ld32(inv, row);
            let dot: f32 = (0..d).map(|i| ld32(partial, d + i) * ld::<E>(w, i) * ld::<E>(x, base + i)).sum();
            let coeff = rr * rr * rr * dot / d as f32;
            for i in 0..d {
                let (g, xv) = (ld32(partial, d + i), ld::<E>(x, base + i));
                st32(partial, i, ld32(partial, i) + g * xv * rr);
                st::<E>(dx, base + i, rr * g * ld::<E>(w, i) - xv * coeff);
            }
        }
        (0..d).for_each(|i| st::<E>(dw, i, ld32(partial, i)));
        Ok(())
    }

    fn swiglu_forward(&self, gu: u64, h: u64, rows: usize, inter: usize) -> Result<()> {
        for r in 0..rows {
            for c in 0..inter {
                let (g, u) = (ld::<E>(gu, r * 2 * inter + c), ld::<E>(gu, r * 2 * inter + inter + c));
                st::<E>(h, r * inter + c, g / (1.0 + (-g).exp()) * u);
            }
        }
        Ok(())
    }

    fn swiglu_backward(&self, dh: u64, gu: u64, rows: usize, inter: usize) -> Result<()> {
        for r in 0..rows {
            for c in 0..inter {
                let (gi, ui) = (r * 2 * inter + c, r * 2 * inter + inter + c);
                let (d, g, u) = (ld::<E>(dh, r * inter + c), ld::<E>(gu, gi), ld::<E>(gu, ui));
                let s = 1.0 / (1.0 + (-g).exp());
                st::<E>(gu, gi, d * u * s * (1.0 + g * (1.0 - s)));
                st::<E>(gu, ui, d * g * s);
            }
        }
        Ok(())
    }

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
        for r in 0..rows {
            let base = r * vocab;
            let max = (0..vocab).map(|i| f64::from(ld::<E>(z, base + i))).fold(f64::NEG_INFINITY, f64::max);
            let lse = max + (0..vocab).map(|i| (f64::from(ld::<E>(z, base + i)) - max).exp()).sum::<f64>().ln();
            let (y, w) = (ld_u32(labels, r) as usize, ld32(weights, r));
            st32(loss, r, w * (lse - f64::from(ld::<E>(z, base + y))) as f32);
            for i in 0..vocab {
                let p = (f64::from(ld::<E>(z, base + i)) - lse).exp() as f32;
                st::<E>(z, base + i, scale * w * (p - if i == y { 1.0 } else { 0.0 }));
            }
        }
        Ok(())
    }

    fn copy_rows(&self, scatter: bool, src: u64, idx: u64, dst: u64, count: usize, cols: usize) -> Result<()> {
        for r in 0..count {
            let row = ld_u32(idx, r) as usize;
            let (from, to) = if scatter { (r, row) } else { (row, r) };
            (0..cols).for_each(|i| st::<E>(dst, to * cols + i, ld::<E>(src, from * cols + i)));
        }
        Ok(())
    }

    fn sum_squares(&self, stored: bool, x: u64, partial: u64, n: usize, parts: usize) -> Result<()> {
        let sum: f32 = (0..n).map(|i| if stored { ld::<E>(x, i) } else { ld32(x, i) }.powi(2)).sum();
        (0..parts).for_each(|p| st32(partial, p, if p == 0 { sum } else { 0.0 }));
        Ok(())
    }

    fn accumulate(&self, acc: u64, g: u64, n: usize) -> Result<()> {
        (0..n).for_each(|i| st32(acc, i, ld32(acc, i) + ld::<E>(g, i)));
        Ok(())
    }

    fn adamw_update(&self, (p, g, m, v, p_stored): (u64, u64, u64, u64, u64), n: usize, a: AdamWArgs) -> Result<()> {
        for i in 0..n {
            let gi = ld32(g, i) * a.grad_scale;
            let mi = a.beta1 * ld32(m, i) + (1.0 - a.beta1) * gi;
            let vi = a.beta2 * ld32(v, i) + (1.0 - a.beta2) * gi * gi;
            let pi = ld32(p, i) - a.lr * ((mi / a.bc1) / ((vi / a.bc2).sqrt() + a.eps) + a.weight_decay * ld32(p, i));
            st32(m, i, mi);
            st32(v, i, vi);
            st32(p, i, pi);
            st::<E>(p_stored, i, pi);
        }
        Ok(())
    }

    fn fill_normal(&self, dst: u64, n: usize, seed: u64, mean: f32, std: f32) -> Result<()> {
        (0..n).for_each(|i| st::<E>(dst, i, mean + std * normal_at(seed, i as u64) as f32));
        Ok(())
    }
}
