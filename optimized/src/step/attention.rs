//! The fused attention of the training step on the CPU: the kernels' CPU twin over the DFlash
//! plan, on tensors. Saves only `out` and `lse` for the backward (no score matrix).

use candle_core::{DType, Device, Tensor};
use dflash_reference::{Error, Result};

use crate::attention::cpu::{attention_backward, attention_forward, AttnShape, Real};
use crate::attention::plan::AttentionPlan;

/// What the attention backward needs besides q, k, v: the output and the per-row logsumexp.
pub struct AttentionSaved {
    /// `[Q, nh, d]`.
    pub out: Tensor,
    /// `[nh, Q]`, flat.
    pub lse: Tensor,
}

fn flat<T: Real + candle_core::WithDType>(t: &Tensor) -> Result<Vec<T>> {
    Ok(t.flatten_all()?.to_vec1::<T>()?)
}

fn forward_typed<T: Real + candle_core::WithDType>(
    plan: &AttentionPlan,
    shape: AttnShape,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<AttentionSaved> {
    let scale = (shape.head_dim as f64).powf(-0.5);
    let (out, lse) = attention_forward(plan, shape, &flat::<T>(q)?, &flat::<T>(k)?, &flat::<T>(v)?, scale)?;
    Ok(AttentionSaved {
        out: Tensor::from_vec(out, q.dims(), &Device::Cpu)?,
        lse: Tensor::from_vec(lse, shape.num_heads * plan.num_queries, &Device::Cpu)?,
    })
}

#[allow(clippy::type_complexity)]
fn backward_typed<T: Real + candle_core::WithDType>(
    plan: &AttentionPlan,
    shape: AttnShape,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    saved: &AttentionSaved,
    dout: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let scale = (shape.head_dim as f64).powf(-0.5);
    let (dq, dk, dv) = attention_backward(
        plan,
        shape,
        &flat::<T>(q)?,
        &flat::<T>(k)?,
        &flat::<T>(v)?,
        &flat::<T>(&saved.out)?,
        &flat::<T>(&saved.lse)?,
        &flat::<T>(dout)?,
        scale,
    )?;
    Ok((
        Tensor::from_vec(dq, q.dims(), &Device::Cpu)?,
        Tensor::from_vec(dk, k.dims(), &Device::Cpu)?,
        Tensor::from_vec(dv, v.dims(), &Device::Cpu)?,
    ))
}

fn shape_of(q: &Tensor, k: &Tensor) -> Result<AttnShape> {
    let (_, num_heads, head_dim) = q.dims3()?;
    let (_, num_kv_heads, _) = k.dims3()?;
    Ok(AttnShape { num_heads, num_kv_heads, head_dim })
}

/// Attention under `plan`: q `[Q, nh, d]`, k and v `[K, nkv, d]` -> saved `out` and `lse`.
pub fn fused_attention_forward(plan: &AttentionPlan, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<AttentionSaved> {
    let shape = shape_of(q, k)?;
    match q.dtype() {
        DType::F32 => forward_typed::<f32>(plan, shape, q, k, v),
        DType::F64 => forward_typed::<f64>(plan, shape, q, k, v),
        other => Err(Error::invalid("q", format!("dtype {other:?}: the CPU step runs in f32 or f64"))),
    }
}

/// `(dq, dk, dv)` shaped like q, k, v, from the output gradient `dout` `[Q, nh, d]`.
pub fn fused_attention_backward(
    plan: &AttentionPlan,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    saved: &AttentionSaved,
    dout: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let shape = shape_of(q, k)?;
    match q.dtype() {
        DType::F32 => backward_typed::<f32>(plan, shape, (q, k, v), saved, dout),
        DType::F64 => backward_typed::<f64>(plan, shape, (q, k, v), saved, dout),
        other => Err(Error::invalid("q", format!("dtype {other:?}: the CPU step runs in f32 or f64"))),
    }
}
