//! One drafter training step on the CPU, forward and backward written out per layer (no tape):
//! fc + hidden_norm, the layers (RMSNorm, q/k/v projections, per-head q/k RMSNorm, RoPE, fused
//! attention, o projection, SwiGLU MLP, residuals), final norm, and the frozen LM head with the
//! decayed CE in row chunks. Frozen tables (embeddings, LM head) get no gradient.

use std::collections::HashMap;

use candle_core::Tensor;
use dflash_reference::config::{AttnKind, DraftConfig};
use dflash_reference::drafter::{DraftInput, Drafter, FrozenHead};
use dflash_reference::loss::BlockTargets;
use dflash_reference::ops::rope_tables;
use dflash_reference::{Error, Result};

use super::attention::{fused_attention_backward, fused_attention_forward, AttentionSaved};
use super::lm_head_ce::lm_head_ce_forward_backward;
use super::ops::{
    linear_backward, linear_forward, rms_norm_backward, rms_norm_forward, rope_backward, rope_forward, swiglu_backward,
    swiglu_forward,
};
use crate::attention::plan::AttentionPlan;

/// Which activations the forward keeps for the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checkpointing {
    /// Keep every layer's activations.
    None,
    /// Keep each layer's input and its attention output and logsumexp (the expensive part);
    /// recompute the norms, projections and MLP in the backward.
    Selective,
    /// Keep each layer's input only; recompute the layer in the backward.
    PerLayer,
}

impl Checkpointing {
    pub const ALL: [Checkpointing; 3] = [Checkpointing::None, Checkpointing::Selective, Checkpointing::PerLayer];

    /// The policy's name on the command line and in results.
    pub fn name(self) -> &'static str {
        match self {
            Checkpointing::None => "none",
            Checkpointing::Selective => "selective",
            Checkpointing::PerLayer => "per-layer",
        }
    }
}

/// What the forward keeps of one layer until its backward.
enum Kept {
    All(Box<LayerSaved>),
    Attention(AttentionSaved),
    Input,
}

/// The loss of one step and the gradient of every trainable parameter (checkpoint-key order).
pub struct StepResult {
    pub loss: f64,
    pub grads: Vec<(String, Tensor)>,
}

/// What the step reads, shared by every layer: the parameters (detached from any tape), the
/// context features, RoPE tables and the attention plans.
struct StepContext<'a> {
    config: &'a DraftConfig,
    params: HashMap<String, Tensor>,
    /// `[S, H]`, normalised context features.
    ctx: Tensor,
    /// RoPE tables of the queries `[Q, d]` and of the keys `[S+Q, d]`.
    rope_q: (Tensor, Tensor),
    rope_k: (Tensor, Tensor),
    plans: HashMap<AttnKind, AttentionPlan>,
}

impl StepContext<'_> {
    fn w(&self, layer: usize, name: &str) -> &Tensor {
        &self.params[&format!("layers.{layer}.{name}")]
    }
}

/// Activations of one layer kept for its backward.
struct LayerSaved {
    x_in: Tensor,
    xn: Tensor,
    inv_in: Tensor,
    kv_in: Tensor,
    q_pre: Tensor,
    inv_q: Tensor,
    q: Tensor,
    k_pre: Tensor,
    inv_k: Tensor,
    k: Tensor,
    v: Tensor,
    attn: AttentionSaved,
    x_mid: Tensor,
    xn2: Tensor,
    inv_post: Tensor,
    gate: Tensor,
    up: Tensor,
    h: Tensor,
}

/// One layer's forward from its input `x` `[Q, H]`: the output and what the backward needs;
/// `attention` (from an earlier forward of the same layer) skips recomputing the attention.
fn layer_forward(
    cx: &StepContext,
    l: usize,
    x: &Tensor,
    attention: Option<AttentionSaved>,
) -> Result<(Tensor, LayerSaved)> {
    let c = &cx.config.dims;
    let (nq, s) = (x.dim(0)?, cx.ctx.dim(0)?);
    let eps = c.rms_norm_eps;
    let (xn, inv_in) = rms_norm_forward(x, cx.w(l, "input_layernorm.weight"), eps)?;
    let q_pre = linear_forward(&xn, cx.w(l, "self_attn.q_proj.weight"))?.reshape((nq, c.num_heads, c.head_dim))?;
    let (q_normed, inv_q) = rms_norm_forward(&q_pre, cx.w(l, "self_attn.q_norm.weight"), eps)?;
    let q = rope_forward(&q_normed, &cx.rope_q.0, &cx.rope_q.1)?;
    let kv_in = Tensor::cat(&[&cx.ctx, &xn], 0)?; // [S+Q, H]
    let k_pre =
        linear_forward(&kv_in, cx.w(l, "self_attn.k_proj.weight"))?.reshape((s + nq, c.num_kv_heads, c.head_dim))?;
    let (k_normed, inv_k) = rms_norm_forward(&k_pre, cx.w(l, "self_attn.k_norm.weight"), eps)?;
    let k = rope_forward(&k_normed, &cx.rope_k.0, &cx.rope_k.1)?;
    let v =
        linear_forward(&kv_in, cx.w(l, "self_attn.v_proj.weight"))?.reshape((s + nq, c.num_kv_heads, c.head_dim))?;
    let attn = match attention {
        Some(saved) => saved,
        None => fused_attention_forward(&cx.plans[&c.layer_kinds[l]], &q, &k, &v)?,
    };
    let attn_flat = attn.out.reshape((nq, c.num_heads * c.head_dim))?;
    let x_mid = (x + linear_forward(&attn_flat, cx.w(l, "self_attn.o_proj.weight"))?)?;
    let (xn2, inv_post) = rms_norm_forward(&x_mid, cx.w(l, "post_attention_layernorm.weight"), eps)?;
    let gate = linear_forward(&xn2, cx.w(l, "mlp.gate_proj.weight"))?;
    let up = linear_forward(&xn2, cx.w(l, "mlp.up_proj.weight"))?;
    let h = swiglu_forward(&gate, &up)?;
    let out = (&x_mid + linear_forward(&h, cx.w(l, "mlp.down_proj.weight"))?)?;
    let saved = LayerSaved {
        x_in: x.clone(),
        xn,
        inv_in,
        kv_in,
        q_pre,
        inv_q,
        q,
        k_pre,
        inv_k,
        k,
        v,
        attn,
        x_mid,
        xn2,
        inv_post,
        gate,
        up,
        h,
    };
    Ok((out, saved))
}

/// One layer's backward: from `dout` `[Q, H]`, the gradient of its input, the gradient of the
/// context features `[S, H]` it adds, and its parameter gradients (into `grads`).
fn layer_backward(
    cx: &StepContext,
    l: usize,
    sv: &LayerSaved,
    dout: &Tensor,
    grads: &mut HashMap<String, Tensor>,
) -> Result<(Tensor, Tensor)> {
    let c = &cx.config.dims;
    let (nq, s) = (dout.dim(0)?, cx.ctx.dim(0)?);
    let mut put = |name: &str, g: Tensor| grads.insert(format!("layers.{l}.{name}"), g);
    // MLP: out = x_mid + down(swiglu(gate(xn2), up(xn2))).
    let (dh, d_down) = linear_backward(dout, &sv.h, cx.w(l, "mlp.down_proj.weight"))?;
    let (dgate, dup) = swiglu_backward(&dh, &sv.gate, &sv.up)?;
    let (dxn2_gate, d_gate) = linear_backward(&dgate, &sv.xn2, cx.w(l, "mlp.gate_proj.weight"))?;
    let (dxn2_up, d_up) = linear_backward(&dup, &sv.xn2, cx.w(l, "mlp.up_proj.weight"))?;
    let (dx_mid_norm, d_post) = rms_norm_backward(
        &(dxn2_gate + dxn2_up)?,
        &sv.x_mid,
        cx.w(l, "post_attention_layernorm.weight"),
        &sv.inv_post,
    )?;
    let dx_mid = (dout + dx_mid_norm)?;
    put("mlp.down_proj.weight", d_down);
    put("mlp.gate_proj.weight", d_gate);
    put("mlp.up_proj.weight", d_up);
    put("post_attention_layernorm.weight", d_post);
    // Attention: x_mid = x + o(attn(q, k, v)).
    let attn_flat = sv.attn.out.reshape((nq, c.num_heads * c.head_dim))?;
    let (dattn, d_o) = linear_backward(&dx_mid, &attn_flat, cx.w(l, "self_attn.o_proj.weight"))?;
    put("self_attn.o_proj.weight", d_o);
    let dattn = dattn.reshape((nq, c.num_heads, c.head_dim))?;
    let (dq, dk, dv) = fused_attention_backward(&cx.plans[&c.layer_kinds[l]], &sv.q, &sv.k, &sv.v, &sv.attn, &dattn)?;
    let dq_normed = rope_backward(&dq, &cx.rope_q.0, &cx.rope_q.1)?;
    let (dq_pre, d_qnorm) = rms_norm_backward(&dq_normed, &sv.q_pre, cx.w(l, "self_attn.q_norm.weight"), &sv.inv_q)?;
    let dk_normed = rope_backward(&dk, &cx.rope_k.0, &cx.rope_k.1)?;
    let (dk_pre, d_knorm) = rms_norm_backward(&dk_normed, &sv.k_pre, cx.w(l, "self_attn.k_norm.weight"), &sv.inv_k)?;
    put("self_attn.q_norm.weight", d_qnorm);
    put("self_attn.k_norm.weight", d_knorm);
    let (dxn_q, d_q) =
        linear_backward(&dq_pre.reshape((nq, c.num_heads * c.head_dim))?, &sv.xn, cx.w(l, "self_attn.q_proj.weight"))?;
    let (dkv_k, d_k) = linear_backward(
        &dk_pre.reshape((s + nq, c.num_kv_heads * c.head_dim))?,
        &sv.kv_in,
        cx.w(l, "self_attn.k_proj.weight"),
    )?;
    let (dkv_v, d_v) = linear_backward(
        &dv.reshape((s + nq, c.num_kv_heads * c.head_dim))?,
        &sv.kv_in,
        cx.w(l, "self_attn.v_proj.weight"),
    )?;
    put("self_attn.q_proj.weight", d_q);
    put("self_attn.k_proj.weight", d_k);
    put("self_attn.v_proj.weight", d_v);
    let dkv_in = (dkv_k + dkv_v)?; // [S+Q, H]
    let dctx = dkv_in.narrow(0, 0, s)?;
    let dxn = (dxn_q + dkv_in.narrow(0, s, nq)?)?;
    let (dx_norm, d_in) = rms_norm_backward(&dxn, &sv.x_in, cx.w(l, "input_layernorm.weight"), &sv.inv_in)?;
    put("input_layernorm.weight", d_in);
    Ok(((dx_mid + dx_norm)?, dctx))
}

/// The step: the decayed CE of `input`'s blocks against `targets` and every trainable
/// parameter's gradient, computing the LM head in chunks of `lm_chunk_rows` rows.
pub fn drafter_step(
    drafter: &Drafter,
    head: &FrozenHead,
    input: &DraftInput,
    targets: &BlockTargets,
    policy: Checkpointing,
    lm_chunk_rows: usize,
) -> Result<StepResult> {
    let config = &drafter.config;
    let c = &config.dims;
    let eps = c.rms_norm_eps;
    let params: HashMap<String, Tensor> =
        drafter.named_params().iter().map(|(n, v)| (n.clone(), v.as_tensor().detach())).collect();
    let dtype = params["fc.weight"].dtype();
    let features = input.features.to_dtype(dtype)?;
    let ctx_pre = linear_forward(&features, &params["fc.weight"])?;
    let (ctx, inv_hidden) = rms_norm_forward(&ctx_pre, &params["hidden_norm.weight"], eps)?;
    let plans = c
        .layer_kinds
        .iter()
        .map(|&kind| Ok((kind, AttentionPlan::dflash(&input.layout, kind)?)))
        .collect::<Result<HashMap<_, _>>>()?;
    let cx = StepContext {
        config,
        rope_q: rope_tables(&input.query_positions(), c.head_dim, c.rope_theta, dtype)?,
        rope_k: rope_tables(&input.key_positions(), c.head_dim, c.rope_theta, dtype)?,
        params,
        ctx,
        plans,
    };

    // Forward: keep each layer's activations, or only its input.
    let mut x = input.block_embeddings(head, config.mask_token_id, dtype)?;
    let mut kept: Vec<Kept> = Vec::with_capacity(c.num_layers());
    let mut inputs: Vec<Tensor> = Vec::with_capacity(c.num_layers());
    for l in 0..c.num_layers() {
        let (out, saved) = layer_forward(&cx, l, &x, None)?;
        inputs.push(x);
        kept.push(match policy {
            Checkpointing::None => Kept::All(Box::new(saved)),
            Checkpointing::Selective => Kept::Attention(saved.attn),
            Checkpointing::PerLayer => Kept::Input,
        });
        x = out;
    }
    let (hf, inv_final) = rms_norm_forward(&x, &cx.params["norm.weight"], eps)?;
    let total = targets.total_weight();
    let ce = lm_head_ce_forward_backward(&hf, &head.lm_head.to_dtype(dtype)?, targets, lm_chunk_rows)?;
    let (loss, dhf) = if total > 0.0 {
        (ce.weighted_ce_sum / total, ce.dh.affine(1.0 / total, 0.0)?)
    } else {
        (0.0, ce.dh.zeros_like()?)
    };
    if !loss.is_finite() {
        return Err(Error::invalid("loss", format!("{loss}")));
    }

    // Backward, last layer first.
    let mut grads: HashMap<String, Tensor> = HashMap::new();
    let (mut dx, d_norm) = rms_norm_backward(&dhf, &x, &cx.params["norm.weight"], &inv_final)?;
    grads.insert("norm.weight".into(), d_norm);
    let mut dctx = cx.ctx.zeros_like()?;
    for l in (0..c.num_layers()).rev() {
        let saved = match kept.pop().expect("one kept entry per layer") {
            Kept::All(saved) => *saved,
            Kept::Attention(attention) => layer_forward(&cx, l, &inputs[l], Some(attention))?.1,
            Kept::Input => layer_forward(&cx, l, &inputs[l], None)?.1,
        };
        let (dx_in, dctx_l) = layer_backward(&cx, l, &saved, &dx, &mut grads)?;
        dx = dx_in;
        dctx = (dctx + dctx_l)?;
    }
    let (dctx_pre, d_hidden) = rms_norm_backward(&dctx, &ctx_pre, &cx.params["hidden_norm.weight"], &inv_hidden)?;
    let d_fc = dctx_pre.t()?.matmul(&features)?;
    grads.insert("hidden_norm.weight".into(), d_hidden);
    grads.insert("fc.weight".into(), d_fc);

    let grads = drafter
        .named_params()
        .iter()
        .map(|(name, _)| {
            let g = grads.remove(name).ok_or_else(|| Error::invalid("gradients", format!("none for {name}")))?;
            let sq = g.sqr()?.sum_all()?.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
            if !sq.is_finite() {
                return Err(Error::invalid(format!("gradient of {name}"), "holds NaN or Inf"));
            }
            Ok((name.clone(), g))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(StepResult { loss, grads })
}
