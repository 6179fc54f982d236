//! The CPU twins of the step's ops on candle tensors (f64 tensors run `Host<f64>`, f32 tensors
//! `Host<f32>`), so that `tests/twins.rs` can hold each twin to the reference op and its
//! autograd. Shapes as the step uses them; the twins run on their own host buffers.

use candle_core::{DType, Device, Tensor};
use dflash_optimized::backend::host::Host;
use dflash_optimized::backend::Backend;
use dflash_optimized::ops::constants::GRAD_PARTS;
use dflash_optimized::ops::elementwise::{CeRows, ElementwiseOps, HeadNormRope, HeadNormRopeGrad, Heads, RmsNormGrad};
use dflash_optimized::ops::matmul::Mat;
use dflash_optimized::{Error, Result};

use crate::op_cases::{Buffers, Kind};

fn values(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

fn tensor(v: Vec<f64>, shape: &[usize], dtype: DType) -> Result<Tensor> {
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dtype)?)
}

/// Runs `f` on the Host backend storing the dtype of `like` (f64 or f32).
fn on_host<R>(
    like: &Tensor,
    f64_run: impl FnOnce(&Host<f64>) -> Result<R>,
    f32_run: impl FnOnce(&Host<f32>) -> Result<R>,
) -> Result<R> {
    match like.dtype() {
        DType::F64 => f64_run(&Host::default()),
        DType::F32 => f32_run(&Host::default()),
        other => Err(Error::invalid("dtype", format!("{other:?}: the twins' tensors are f64 or f32"))),
    }
}

macro_rules! both {
    ($like:expr, |$dev:ident| $body:expr) => {
        on_host($like, |$dev| $body, |$dev| $body)
    };
}

/// `y [rows, out] = x [rows, in] @ w [out, in]^T` by the matmul twin.
pub fn linear_forward(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let ((rows, din), (dout, _)) = (x.dims2()?, w.dims2()?);
    both!(x, |dev| linear_forward_on(dev, x, w, rows, din, dout))
}

fn linear_forward_on<B: Backend>(
    dev: &B,
    x: &Tensor,
    w: &Tensor,
    rows: usize,
    din: usize,
    dout: usize,
) -> Result<Tensor> {
    let mut b = Buffers::new(dev);
    let (xp, wp, y) =
        (b.put(Kind::Stored, &values(x)?)?, b.put(Kind::Stored, &values(w)?)?, b.zeros(Kind::Stored, rows * dout)?);
    dev.matmul(Mat::n(xp, rows, din), Mat::t(wp, dout, din), y, 0.0)?;
    tensor(b.get(Kind::Stored, y, rows * dout)?, &[rows, dout], x.dtype())
}

/// `(dx = dy @ w, dw = dy^T @ x)` by the matmul twin, as the step's input and weight gradients.
pub fn linear_backward(dy: &Tensor, x: &Tensor, w: &Tensor) -> Result<(Tensor, Tensor)> {
    let ((rows, din), (dout, _)) = (x.dims2()?, w.dims2()?);
    both!(x, |dev| {
        let mut b = Buffers::new(dev);
        let s = Kind::Stored;
        let (dyp, xp, wp) = (b.put(s, &values(dy)?)?, b.put(s, &values(x)?)?, b.put(s, &values(w)?)?);
        let (dx, dw) = (b.zeros(s, rows * din)?, b.zeros(s, dout * din)?);
        dev.matmul(Mat::n(dyp, rows, dout), Mat::n(wp, dout, din), dx, 0.0)?;
        dev.matmul(Mat::t(dyp, rows, dout), Mat::n(xp, rows, din), dw, 0.0)?;
        Ok((
            tensor(b.get(s, dx, rows * din)?, &[rows, din], x.dtype())?,
            tensor(b.get(s, dw, dout * din)?, &[dout, din], x.dtype())?,
        ))
    })
}

/// RMSNorm over the last dim of x `[.., n]` with w `[n]`: `(y, inv_rms [.., 1])`.
pub fn rms_norm_forward(x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let n = *x.dims().last().ok_or_else(|| Error::invalid("x", "rank 0"))?;
    let rows = x.elem_count() / n;
    both!(x, |dev| {
        let mut b = Buffers::new(dev);
        let (xp, wp) = (b.put(Kind::Stored, &values(x)?)?, b.put(Kind::Stored, &values(w)?)?);
        let (y, inv) = (b.zeros(Kind::Stored, rows * n)?, b.zeros(Kind::Acc, rows)?);
        dev.ops().rms_norm_forward(xp, wp, y, inv, rows, n, eps)?;
        let mut inv_shape = x.dims().to_vec();
        *inv_shape.last_mut().expect("rank >= 1") = 1;
        Ok((
            tensor(b.get(Kind::Stored, y, rows * n)?, x.dims(), x.dtype())?,
            tensor(b.get(Kind::Acc, inv, rows)?, &inv_shape, x.dtype())?,
        ))
    })
}

/// `(dx [.., n], dw [n])` of RMSNorm from dy, with the forward's `inv_rms [.., 1]`.
pub fn rms_norm_backward(dy: &Tensor, x: &Tensor, w: &Tensor, inv_rms: &Tensor) -> Result<(Tensor, Tensor)> {
    let n = *x.dims().last().ok_or_else(|| Error::invalid("x", "rank 0"))?;
    let rows = x.elem_count() / n;
    both!(x, |dev| {
        let mut b = Buffers::new(dev);
        let s = Kind::Stored;
        let g = RmsNormGrad {
            dy: b.put(s, &values(dy)?)?,
            x: b.put(s, &values(x)?)?,
            w: b.put(s, &values(w)?)?,
            inv: b.put(Kind::Acc, &values(inv_rms)?)?,
            dres: None,
        };
        let (dx, dw, partial) = (b.zeros(s, rows * n)?, b.zeros(s, n)?, b.zeros(Kind::Acc, GRAD_PARTS * n)?);
        dev.ops().rms_norm_backward(g, dx, dw, partial, rows, n)?;
        Ok((tensor(b.get(s, dx, rows * n)?, x.dims(), x.dtype())?, tensor(b.get(s, dw, n)?, &[n], x.dtype())?))
    })
}

/// The inputs of a head norm + RoPE on `dev`: x `[T, heads, d]`, w `[d]`, cos and sin `[T, d]`.
fn head_inputs<B: Backend>(
    b: &mut Buffers<B>,
    x: &Tensor,
    w: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<(HeadNormRope, Heads)> {
    let (tokens, heads, head_dim) = x.dims3()?;
    let f = HeadNormRope {
        x: b.put(Kind::Stored, &values(x)?)?,
        x_row: heads * head_dim,
        w: b.put(Kind::Stored, &values(w)?)?,
        cos: b.put(Kind::Acc, &values(cos)?)?,
        sin: b.put(Kind::Acc, &values(sin)?)?,
    };
    Ok((f, Heads { tokens, heads, head_dim }))
}

/// `(rope(rms_norm(x) * w), inv_rms [T, heads, 1])` for x `[T, heads, d]`, tables `[T, d]`.
pub fn head_norm_rope_forward(
    x: &Tensor,
    w: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let (t, heads, _) = x.dims3()?;
    both!(x, |dev| {
        let mut b = Buffers::new(dev);
        let (f, dims) = head_inputs(&mut b, x, w, cos, sin)?;
        let (y, inv) = (b.zeros(Kind::Stored, x.elem_count())?, b.zeros(Kind::Acc, t * heads)?);
        dev.ops().head_norm_rope_forward(f, y, inv, dims, eps)?;
        Ok((
            tensor(b.get(Kind::Stored, y, x.elem_count())?, x.dims(), x.dtype())?,
            tensor(b.get(Kind::Acc, inv, t * heads)?, &[t, heads, 1], x.dtype())?,
        ))
    })
}

/// `rope(x)` for x `[T, heads, d]`, tables `[T, d]`.
pub fn rope_forward(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let ones = Tensor::ones(x.dim(2)?, x.dtype(), x.device())?;
    both!(x, |dev| {
        let mut b = Buffers::new(dev);
        let (f, dims) = head_inputs(&mut b, x, &ones, cos, sin)?;
        let y = b.zeros(Kind::Stored, x.elem_count())?;
        dev.ops().rope_forward(f.x, f.x_row, f.cos, f.sin, y, dims)?;
        tensor(b.get(Kind::Stored, y, x.elem_count())?, x.dims(), x.dtype())
    })
}

/// `(dx [T, heads, d], dw [d])` through RoPE and the head norm.
pub fn head_norm_rope_backward(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    inv_rms: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let d = x.dims3()?.2;
    both!(x, |dev| {
        let mut b = Buffers::new(dev);
        let (fwd, dims) = head_inputs(&mut b, x, w, cos, sin)?;
        let g =
            HeadNormRopeGrad { dy: b.put(Kind::Stored, &values(dy)?)?, fwd, inv: b.put(Kind::Acc, &values(inv_rms)?)? };
        let (dx, dw, partial) =
            (b.zeros(Kind::Stored, x.elem_count())?, b.zeros(Kind::Stored, d)?, b.zeros(Kind::Acc, GRAD_PARTS * d)?);
        dev.ops().head_norm_rope_backward(g, dx, dw, partial, dims)?;
        Ok((
            tensor(b.get(Kind::Stored, dx, x.elem_count())?, x.dims(), x.dtype())?,
            tensor(b.get(Kind::Stored, dw, d)?, &[d], x.dtype())?,
        ))
    })
}

/// `[gate | up]` rows `[rows, 2I]`, as the step holds them.
fn gate_up(gate: &Tensor, up: &Tensor) -> Result<Vec<f64>> {
    values(&Tensor::cat(&[gate, up], 1)?)
}

/// `silu(gate) * up`, all `[rows, I]`.
pub fn swiglu_forward(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let (rows, inter) = gate.dims2()?;
    both!(gate, |dev| {
        let mut b = Buffers::new(dev);
        let (gu, h) = (b.put(Kind::Stored, &gate_up(gate, up)?)?, b.zeros(Kind::Stored, rows * inter)?);
        dev.ops().swiglu_forward(gu, h, rows, inter)?;
        tensor(b.get(Kind::Stored, h, rows * inter)?, &[rows, inter], gate.dtype())
    })
}

/// `(dgate, dup)` `[rows, I]` from dh.
pub fn swiglu_backward(dh: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
    let (rows, inter) = gate.dims2()?;
    both!(gate, |dev| {
        let mut b = Buffers::new(dev);
        let (gu, dhp) = (b.put(Kind::Stored, &gate_up(gate, up)?)?, b.put(Kind::Stored, &values(dh)?)?);
        dev.ops().swiglu_backward(dhp, gu, rows, inter)?;
        let both = tensor(b.get(Kind::Stored, gu, 2 * rows * inter)?, &[rows, 2 * inter], gate.dtype())?;
        Ok((both.narrow(1, 0, inter)?, both.narrow(1, inter, inter)?))
    })
}

/// The CE twin over logits `z [rows, V]`: `(dz = scale * w (softmax(z) - onehot(y)), w * CE per
/// row)`.
pub fn ce_grad_rows(z: &Tensor, labels: &[u32], weights: &[f64], scale: f64) -> Result<(Tensor, Vec<f64>)> {
    let (rows, vocab) = z.dims2()?;
    both!(z, |dev| {
        let mut b = Buffers::new(dev);
        let zp = b.put(Kind::Stored, &values(z)?)?;
        let lp = b.put(Kind::U32, &labels.iter().map(|&y| f64::from(y)).collect::<Vec<_>>())?;
        let (wp, loss) = (b.put(Kind::Acc, weights)?, b.zeros(Kind::Acc, rows)?);
        dev.ops().ce_grad_rows(CeRows { z: zp, labels: lp, weights: wp, loss }, rows, vocab, scale)?;
        Ok((tensor(b.get(Kind::Stored, zp, rows * vocab)?, &[rows, vocab], z.dtype())?, b.get(Kind::Acc, loss, rows)?))
    })
}

/// The argmax twin over `z [rows, V]`: the first index of each row's maximum.
pub fn argmax_rows(z: &Tensor) -> Result<Vec<u32>> {
    let (rows, vocab) = z.dims2()?;
    both!(z, |dev| {
        let mut b = Buffers::new(dev);
        let (zp, out) = (b.put(Kind::Stored, &values(z)?)?, b.zeros(Kind::U32, rows)?);
        dev.ops().argmax_rows(zp, rows, vocab, out)?;
        Ok(b.get(Kind::U32, out, rows)?.into_iter().map(|i| i as u32).collect())
    })
}
