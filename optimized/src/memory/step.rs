//! The memory of one drafter training step: a typed layout of named regions per phase and per
//! layer (llm.c's ParameterTensors / ActivationTensors over one allocation), built from the
//! drafter config, the step's shapes, the checkpointing policy and the backend's storage and
//! arithmetic widths. The step (`model::drafter_step`) allocates [`StepLayout::bytes`] once and
//! addresses every buffer through these fields; the plan ([`MemoryPlan`]) is the same layout's
//! items, so the plan is what the step holds.
//!
//! Shapes (one row): S context tokens, Q = N*B block rows, K = S + Q keys, H hidden, I SwiGLU,
//! nh/nkv heads of d, F*H feature width, V vocab, P trainable scalars.

use crate::Result;
use dflash_reference::config::DraftConfig;
use dflash_reference::drafter::param_shapes;

use super::attention::key_ranges_bytes;
use super::{add_usize, bytes_of, check_fits, gb, mul_usize, Arena, Item, Lifetime, Region, F32};
use crate::ops::constants::{GRAD_PARTS, NORM_PARTS};

/// Which activations the forward keeps for the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
    /// Every policy, fastest first (the Qwen3-8B drafter's step on the H200: 130.6, 150.0 and
    /// 155.5 ms, `results/step-h200.json`) and so keeping the most first.
    pub const ALL: [Checkpointing; 3] = [Checkpointing::None, Checkpointing::Selective, Checkpointing::PerLayer];

    /// The policy's name on the command line and in results.
    pub fn name(self) -> &'static str {
        match self {
            Checkpointing::None => "none",
            Checkpointing::Selective => "selective",
            Checkpointing::PerLayer => "per-layer",
        }
    }

    /// The policy named `name` (as [`Checkpointing::name`] prints it).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// Free memory a step whose policy [`fastest_fitting`] chose leaves beside its plan: what the
/// plan does not count (cuBLAS's workspaces, the driver's rounding of allocations).
pub const POLICY_HEADROOM: u64 = 1 << 30;

/// The first of `policies` (fastest first, as [`Checkpointing::ALL`]) whose step's peak (from
/// `peak`), with `beside` more bytes, fits `available` less [`POLICY_HEADROOM`]; the last one
/// when none does (the caller then checks that one without the headroom, and refuses it before
/// allocating when it does not fit).
pub fn fastest_fitting(
    policies: &[Checkpointing],
    available: u64,
    beside: u64,
    peak: impl Fn(Checkpointing) -> Result<u64>,
) -> Result<Checkpointing> {
    let last = *policies.last().ok_or_else(|| crate::Error::invalid("checkpointing", "no policy to choose from"))?;
    for &policy in policies {
        let need = peak(policy)?.saturating_add(beside).saturating_add(POLICY_HEADROOM);
        if need <= available {
            return Ok(policy);
        }
    }
    Ok(last)
}

/// The shapes of one training step: one row of `context_len` tokens with `num_anchors` blocks,
/// and the LM head computed `lm_chunk_rows` block rows at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    pub context_len: usize,
    pub num_anchors: usize,
    pub lm_chunk_rows: usize,
}

/// Sizes of one step, checked: every product below fits in `usize`.
#[derive(Clone, Copy, Debug)]
pub struct StepDims {
    pub s: usize,
    pub q: usize,
    pub k: usize,
    pub h: usize,
    pub i: usize,
    pub nh: usize,
    pub nkv: usize,
    pub d: usize,
    pub qd: usize,
    pub kd: usize,
    pub fw: usize,
    pub v: usize,
    pub layers: usize,
    /// LM-head rows per chunk (at most Q).
    pub lm_rows: usize,
    /// Trainable scalars.
    pub params: usize,
}

impl StepDims {
    /// Checks `shape` against `config` (at least two tokens, one anchor and one LM-head row; no
    /// more anchors than tokens; token ids that fit u32) and every size against overflow.
    pub fn new(config: &DraftConfig, shape: StepShape) -> Result<Self> {
        let c = &config.dims;
        let invalid = |what: &str, msg: String| Err(crate::Error::invalid(what, msg));
        if shape.context_len < 2 {
            return invalid("seq", format!("{} tokens; a row needs at least 2", shape.context_len));
        }
        // Anchor slots beyond the candidates are padding (keep = false); more slots than tokens
        // can only be a mistake (e.g. 1000 anchors on 80-token rows).
        if shape.num_anchors == 0 || shape.num_anchors > shape.context_len {
            return invalid(
                "anchors",
                format!(
                    "{} anchors for a row of {} tokens: between 1 and the row's length",
                    shape.num_anchors, shape.context_len
                ),
            );
        }
        if shape.lm_chunk_rows == 0 {
            return invalid("lm_chunk_rows", "0; at least 1".into());
        }
        if c.vocab_size == 0 || c.vocab_size as u64 > u64::from(u32::MAX) + 1 {
            return invalid("vocab_size", format!("{}: token ids are u32, so 1..=2^32", c.vocab_size));
        }
        let q = mul_usize("block rows (anchors x block size)", shape.num_anchors, config.block_size)?;
        let k = add_usize("keys (context + block rows)", shape.context_len, q)?;
        let qd = mul_usize("q width (heads x head_dim)", c.num_heads, c.head_dim)?;
        let kd = mul_usize("k width (kv heads x head_dim)", c.num_kv_heads, c.head_dim)?;
        let fw = mul_usize("feature width (features x hidden)", config.num_features(), c.hidden_size)?;
        let mut params = 0usize;
        for (name, shape) in param_shapes(config) {
            let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            params = n
                .and_then(|n| params.checked_add(n))
                .ok_or_else(|| crate::Error::invalid(&name, format!("{shape:?}: the parameter count overflows")))?;
        }
        Ok(StepDims {
            s: shape.context_len,
            q,
            k,
            h: c.hidden_size,
            i: c.intermediate_size,
            nh: c.num_heads,
            nkv: c.num_kv_heads,
            d: c.head_dim,
            qd,
            kd,
            fw,
            v: c.vocab_size,
            layers: c.num_layers(),
            lm_rows: shape.lm_chunk_rows.min(q),
            params,
        })
    }
}

/// The optimizer's regions (fp32 on the GPU): master weights, the gradients it reads, moments.
/// Masters and moments hold parameters `shard.0..shard.1` of the flat parameter vector (all of
/// them, or this worker's shard when the optimizer state is sharded over drafter workers).
#[derive(Clone, Copy, Debug)]
pub struct OptimizerRegions {
    pub master: Region,
    pub grads: UpdateGrads,
    pub adam_m: Region,
    pub adam_v: Region,
    pub shard: (usize, usize),
}

/// Where AdamW reads the update's gradients.
#[derive(Clone, Copy, Debug)]
pub enum UpdateGrads {
    /// Every parameter's gradient accumulated over rows (and all-reduced whole over workers), in
    /// the arithmetic type.
    Accumulated(Region),
    /// The step's own gradients (one row per update on one worker: nothing to add up), read in
    /// their stored type where the backward wrote them: bitwise the accumulated update (one stored
    /// value added to zero is exact), without the accumulator (4 bytes per parameter).
    Stored,
}

impl UpdateGrads {
    /// The accumulator, when the gradients are accumulated.
    pub fn accumulator(&self) -> Option<Region> {
        match self {
            UpdateGrads::Accumulated(r) => Some(*r),
            UpdateGrads::Stored => None,
        }
    }
}

/// What the optimizer's regions hold: the masters and moments of parameters `shard.0..shard.1`,
/// and an fp32 accumulator of every gradient when `accumulate` (several rows per update, or
/// several workers to sum over); else AdamW reads the step's own gradients
/// ([`UpdateGrads::Stored`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptimizerShape {
    pub shard: (usize, usize),
    pub accumulate: bool,
}

impl OptimizerShape {
    /// The whole state of `params` parameters.
    pub fn whole(params: usize, accumulate: bool) -> Self {
        OptimizerShape { shard: (0, params), accumulate }
    }
}

/// Worker `k`'s shard of `params` parameters over `workers`: contiguous, the first ones one
/// longer when it does not divide.
pub fn optimizer_shard(params: usize, k: usize, workers: usize) -> (usize, usize) {
    let (base, extra) = (params / workers, params % workers);
    let lo = k * base + k.min(extra);
    (lo, lo + base + usize::from(k < extra))
}

/// One row's inputs: features `[S, F*H]` (stored), RoPE tables `[Q or K, d]` (arithmetic type),
/// and the CE rows: their indices, labels (u32), weights and per-row loss (arithmetic type) and
/// top-1 predictions (u32).
#[derive(Clone, Copy, Debug)]
pub struct InputRegions {
    pub features: Region,
    pub cos_q: Region,
    pub sin_q: Region,
    pub cos_k: Region,
    pub sin_k: Region,
    /// The RoPE tables of positions `0..P`, `P = S + B` (every context and block position),
    /// `[P, d]` (arithmetic type): the rows' tables are gathered from them on the device.
    pub rope_cos: Region,
    pub rope_sin: Region,
    /// The positions (u32) of the queries `[Q]` and the keys `[K]` the tables are gathered at.
    pub positions_q: Region,
    pub positions_k: Region,
    pub labels: Region,
    pub weights_ce: Region,
    pub rows_ce: Region,
    pub loss_rows: Region,
    /// The block tokens `[Q]` (u32) the block embeddings are gathered from on the device.
    pub block_tokens: Region,
    /// The top-1 prediction (u32) of each weighted row, in the order of `rows_ce` (`[Q]`: at most
    /// Q rows), when the step records them.
    pub predictions: Region,
}

/// What a layer's backward reads of its forward: `kv_in [K, H]` (ctx rows, then xn), the
/// pre-norm q `[Q, nh*d]` and k `[K, nkv*d]`, v, `x_mid [Q, H]`, `gate_up [Q, 2I]`, and the
/// inverse RMS of each norm (arithmetic type).
#[derive(Clone, Copy, Debug)]
pub struct LayerActs {
    pub kv_in: Region,
    pub inv_in: Region,
    pub q_pre: Region,
    pub inv_q: Region,
    pub k_pre: Region,
    pub inv_k: Region,
    pub v: Region,
    pub x_mid: Region,
    pub inv_post: Region,
    pub gate_up: Region,
}

/// A layer's attention output `[Q, nh*d]` and logsumexp `[nh, Q]`.
#[derive(Clone, Copy, Debug)]
pub struct AttnActs {
    pub out: Region,
    pub lse: Region,
}

/// Scratch of one layer's phase, shared by every layer: q and k after norm + RoPE and `xn2`
/// (recomputed per layer), the SwiGLU output, the activation gradients, and reduction partials.
#[derive(Clone, Copy, Debug)]
pub struct LayerScratch {
    pub q: Region,
    pub k: Region,
    pub xn2: Region,
    pub h: Region,
    /// The gradient of a layer's output, then of its input.
    pub grad_a: Region,
    /// `dxn2` and `dxn`, and between them the attention's output gradient `[Q, max(H, nh*d)]`.
    pub grad_c: Region,
    pub dq: Region,
    pub dk: Region,
    pub dv: Region,
    pub dsum: Region,
    pub dctx: Region,
    /// `[GRAD_PARTS, max(H, d)]` partial sums of a norm weight's gradient.
    pub dw_partial: Region,
    /// `[params, NORM_PARTS]` partial sums of squares of the gradient norm.
    pub norm_partial: Region,
}

/// Scratch of one LM-head chunk: its gathered rows, logits (overwritten by their gradient) and
/// the rows' gradient.
#[derive(Clone, Copy, Debug)]
pub struct HeadScratch {
    pub rows: Region,
    pub logits: Region,
    pub drows: Region,
}

/// Every region of one step over one allocation of [`StepLayout::bytes`].
#[derive(Clone, Debug)]
pub struct StepLayout {
    pub policy: Checkpointing,
    pub dims: StepDims,
    /// Bytes of a stored value (bf16: 2) and of an arithmetic value (fp32: 4).
    pub elem_bytes: u64,
    pub acc_bytes: u64,
    /// `[P]` compute weights and one step's gradients (stored), the frozen LM head `[V, H]`.
    pub weights: Region,
    pub grads: Region,
    /// The frozen LM head `[V, H]`, when the step holds its own (`None`: the target's, shared).
    pub lm_head: Option<Region>,
    pub optimizer: Option<OptimizerRegions>,
    pub input: InputRegions,
    /// `fc` output and context `[S, H]`, inverse RMS of the hidden norm `[S]`.
    pub ctx_pre: Region,
    pub ctx: Region,
    pub inv_hidden: Region,
    /// `[Q, H]` per layer input and the last layer's output (`layers + 1`).
    pub residual: Vec<Region>,
    /// The final norm's output `[Q, H]` and inverse RMS.
    pub hf: Region,
    pub inv_final: Region,
    /// Per layer: its own saved activations, or the one recompute set the policy shares.
    pub acts: Vec<LayerActs>,
    pub attn: Vec<AttnActs>,
    pub scratch: LayerScratch,
    /// The LM head's output gradient, then a layer's `dx_mid` `[Q, H]`.
    pub grad_b: Region,
    pub head: HeadScratch,
    /// Bytes of the allocation.
    pub bytes: u64,
    /// Bytes uploaded with each input beside the allocation (the attention's key ranges).
    pub input_bytes: u64,
    pub items: Vec<Item>,
}

/// Plan items (the names a plan prints).
const SAVED_LAYERS: &str = "saved layer activations, all layers";
const SAVED_ATTENTION: &str = "saved attention out + logsumexp, all layers";
const WORKSPACE: &str = "one layer's activations (recomputed in the backward)";
const WORKSPACE_ATTENTION: &str = "one layer's attention out + logsumexp (recomputed)";
const INPUTS: &str = "inputs: features, RoPE tables, labels, weights";

/// `S + B`: positions below it cover every context and block position of a row (a block's
/// offset `o` sits at its anchor's position `+ o`, the inference block at `S + o`).
pub fn rope_positions(z: &StepDims, config: &DraftConfig) -> Result<usize> {
    z.s.checked_add(config.block_size).ok_or_else(|| crate::Error::invalid("block_size", "S + B overflows"))
}
const PREDICTIONS: &str = "top-1 predictions of the block rows (u32)";
const KEY_RANGES: &str = "attention key ranges (uploaded with each input)";
const PADDING: &str = "alignment padding";

impl StepLayout {
    /// The layout of `config`'s step at `shape` under `policy`, storing values of `elem_bytes`
    /// and computing in values of `acc_bytes`, with the optimizer's whole state and its gradient
    /// accumulator when `optimizer`, holding its own frozen LM head.
    pub fn new(
        config: &DraftConfig,
        shape: StepShape,
        policy: Checkpointing,
        optimizer: bool,
        widths: (u64, u64),
    ) -> Result<Self> {
        let optimizer =
            optimizer.then(|| OptimizerShape::whole(StepDims::new(config, shape).map_or(0, |z| z.params), true));
        Self::with_head(config, shape, policy, optimizer, widths, true)
    }

    /// [`StepLayout::new`] with the optimizer's regions `optimizer` (none when `None`), holding
    /// the frozen LM head only when `own_head` (else the step reads the one the target's forward
    /// holds: no second copy on the device).
    pub fn with_head(
        config: &DraftConfig,
        shape: StepShape,
        policy: Checkpointing,
        optimizer: Option<OptimizerShape>,
        (elem_bytes, acc_bytes): (u64, u64),
        own_head: bool,
    ) -> Result<Self> {
        let z = StepDims::new(config, shape)?;
        let (e, a) = (elem_bytes, acc_bytes);
        let mut ar = Arena::default();
        use Lifetime::{Head, Layer, Model, Optimizer, Saved, Transient};
        let weights = ar.take("weights (compute copy)", Model, "weights", &[z.params], e)?;
        let grads = ar.take("gradients of one step", Model, "grads", &[z.params], e)?;
        let lm_head = match own_head {
            true => Some(ar.take("frozen LM head", Model, "lm_head", &[z.v, z.h], e)?),
            false => None,
        };
        let optimizer = match optimizer {
            Some(OptimizerShape { shard: (lo, hi), .. }) if lo > hi || hi > z.params => {
                return Err(crate::Error::invalid("optimizer shard", format!("{lo}..{hi} of {} parameters", z.params)))
            }
            Some(OptimizerShape { shard: (lo, hi), accumulate }) => Some(OptimizerRegions {
                master: ar.take("master weights (fp32)", Optimizer, "master", &[hi - lo], a)?,
                grads: match accumulate {
                    true => UpdateGrads::Accumulated(ar.take(
                        "accumulated gradients (fp32)",
                        Optimizer,
                        "grad_acc",
                        &[z.params],
                        a,
                    )?),
                    false => UpdateGrads::Stored,
                },
                adam_m: ar.take("AdamW moments (fp32, 2x)", Optimizer, "adam_m", &[hi - lo], a)?,
                adam_v: ar.take("AdamW moments (fp32, 2x)", Optimizer, "adam_v", &[hi - lo], a)?,
                shard: (lo, hi),
            }),
            None => None,
        };
        let input = InputRegions {
            features: ar.take(INPUTS, Saved, "features", &[z.s, z.fw], e)?,
            cos_q: ar.take(INPUTS, Saved, "cos_q", &[z.q, z.d], a)?,
            sin_q: ar.take(INPUTS, Saved, "sin_q", &[z.q, z.d], a)?,
            cos_k: ar.take(INPUTS, Saved, "cos_k", &[z.k, z.d], a)?,
            sin_k: ar.take(INPUTS, Saved, "sin_k", &[z.k, z.d], a)?,
            rope_cos: ar.take(INPUTS, Saved, "rope_cos", &[rope_positions(&z, config)?, z.d], a)?,
            rope_sin: ar.take(INPUTS, Saved, "rope_sin", &[rope_positions(&z, config)?, z.d], a)?,
            positions_q: ar.take(INPUTS, Saved, "positions_q", &[z.q], F32)?,
            positions_k: ar.take(INPUTS, Saved, "positions_k", &[z.k], F32)?,
            labels: ar.take(INPUTS, Saved, "labels", &[z.q], F32)?,
            weights_ce: ar.take(INPUTS, Saved, "weights_ce", &[z.q], a)?,
            rows_ce: ar.take(INPUTS, Saved, "rows_ce", &[z.q], F32)?,
            loss_rows: ar.take(INPUTS, Saved, "loss_rows", &[z.q], a)?,
            block_tokens: ar.take(INPUTS, Saved, "block_tokens", &[z.q], F32)?,
            predictions: ar.take(PREDICTIONS, Saved, "predictions", &[z.q], F32)?,
        };
        let context = "context: fc output, ctx, inverse RMS";
        let ctx_pre = ar.take(context, Saved, "ctx_pre", &[z.s, z.h], e)?;
        let ctx = ar.take(context, Saved, "ctx", &[z.s, z.h], e)?;
        let inv_hidden = ar.take(context, Saved, "inv_hidden", &[z.s], a)?;
        let residual_item = "residual stream: every layer's input, the output";
        let residual = (0..=z.layers)
            .map(|l| ar.take(residual_item, Saved, &format!("residual.{l}"), &[z.q, z.h], e))
            .collect::<Result<Vec<_>>>()?;
        let final_item = "final norm output and inverse RMS";
        let hf = ar.take(final_item, Saved, "hf", &[z.q, z.h], e)?;
        let inv_final = ar.take(final_item, Saved, "inv_final", &[z.q], a)?;

        let take_acts = |ar: &mut Arena, item, lifetime| -> Result<LayerActs> {
            Ok(LayerActs {
                kv_in: ar.take(item, lifetime, "kv_in", &[z.k, z.h], e)?,
                inv_in: ar.take(item, lifetime, "inv_in", &[z.q], a)?,
                q_pre: ar.take(item, lifetime, "q_pre", &[z.q, z.qd], e)?,
                inv_q: ar.take(item, lifetime, "inv_q", &[z.q, z.nh], a)?,
                k_pre: ar.take(item, lifetime, "k_pre", &[z.k, z.kd], e)?,
                inv_k: ar.take(item, lifetime, "inv_k", &[z.k, z.nkv], a)?,
                v: ar.take(item, lifetime, "v", &[z.k, z.kd], e)?,
                x_mid: ar.take(item, lifetime, "x_mid", &[z.q, z.h], e)?,
                inv_post: ar.take(item, lifetime, "inv_post", &[z.q], a)?,
                gate_up: ar.take(item, lifetime, "gate_up", &[z.q, 2, z.i], e)?,
            })
        };
        let take_attn = |ar: &mut Arena, item, lifetime| -> Result<AttnActs> {
            Ok(AttnActs {
                out: ar.take(item, lifetime, "attention out", &[z.q, z.qd], e)?,
                lse: ar.take(item, lifetime, "attention lse", &[z.nh, z.q], a)?,
            })
        };
        let saved_acts = match policy {
            Checkpointing::None => {
                Some((0..z.layers).map(|_| take_acts(&mut ar, SAVED_LAYERS, Saved)).collect::<Result<Vec<_>>>()?)
            }
            _ => None,
        };
        let saved_attn = match policy {
            Checkpointing::PerLayer => None,
            _ => Some((0..z.layers).map(|_| take_attn(&mut ar, SAVED_ATTENTION, Saved)).collect::<Result<Vec<_>>>()?),
        };
        // The LM head's output gradient is written in the head phase and read by the first
        // layer's backward: it lives outside the overlaid phases.
        let grad_b = ar.take("output gradient of the LM head / of a layer", Transient, "grad.b", &[z.q, z.h], e)?;
        let params = param_shapes(config).len();
        let ((shared_acts, shared_attn, scratch), head) = ar.overlay(
            |ar| {
                let shared_acts = match saved_acts {
                    Some(_) => None,
                    None => Some(take_acts(ar, WORKSPACE, Layer)?),
                };
                let shared_attn = match saved_attn {
                    Some(_) => None,
                    None => Some(take_attn(ar, WORKSPACE_ATTENTION, Layer)?),
                };
                let cheap = "q, k after norm + RoPE, xn2 (recomputed per layer)";
                let grads = "activation gradients of one layer";
                let reductions = "reduction partials (norm weights, gradient norm)";
                let scratch = LayerScratch {
                    q: ar.take(cheap, Layer, "q", &[z.q, z.qd], e)?,
                    k: ar.take(cheap, Layer, "k", &[z.k, z.kd], e)?,
                    xn2: ar.take(cheap, Layer, "xn2", &[z.q, z.h], e)?,
                    h: ar.take("SwiGLU output / its gradient", Layer, "h", &[z.q, z.i], e)?,
                    grad_a: ar.take(grads, Layer, "grad.a", &[z.q, z.h], e)?,
                    grad_c: ar.take(grads, Layer, "grad.c", &[z.q, z.h.max(z.qd)], e)?,
                    dq: ar.take(grads, Layer, "dq", &[z.q, z.qd], e)?,
                    dk: ar.take(grads, Layer, "dk", &[z.k, z.kd], e)?,
                    dv: ar.take(grads, Layer, "dv", &[z.k, z.kd], e)?,
                    dsum: ar.take(grads, Layer, "dsum", &[z.nh, z.q], a)?,
                    dctx: ar.take(grads, Layer, "dctx", &[z.s, z.h], e)?,
                    dw_partial: ar.take(reductions, Layer, "dw_partial", &[GRAD_PARTS, z.h.max(z.d)], a)?,
                    norm_partial: ar.take(reductions, Layer, "norm_partial", &[params, NORM_PARTS], a)?,
                };
                Ok((shared_acts, shared_attn, scratch))
            },
            |ar| {
                let lm = "one LM-head chunk: rows, logits / their gradient";
                Ok(HeadScratch {
                    rows: ar.take(lm, Head, "lm.rows", &[z.lm_rows, z.h], e)?,
                    logits: ar.take(lm, Head, "lm.logits", &[z.lm_rows, z.v], e)?,
                    drows: ar.take(lm, Head, "lm.drows", &[z.lm_rows, z.h], e)?,
                })
            },
        )?;
        let acts = saved_acts.unwrap_or_else(|| vec![shared_acts.expect("taken when not saved"); z.layers]);
        let attn = saved_attn.unwrap_or_else(|| vec![shared_attn.expect("taken when not saved"); z.layers]);
        let bytes = ar.bytes();
        let placed: u64 = ar.items.iter().filter(|i| !matches!(i.lifetime, Layer | Head)).map(|i| i.bytes).sum();
        let layer_phase: u64 = ar.items.iter().filter(|i| i.lifetime == Layer).map(|i| i.bytes).sum();
        let head_phase: u64 = ar.items.iter().filter(|i| i.lifetime == Head).map(|i| i.bytes).sum();
        ar.count(PADDING, Transient, bytes - placed - layer_phase.max(head_phase));
        let kinds: std::collections::HashSet<_> = config.dims.layer_kinds.iter().collect();
        let input_bytes = bytes_of("key ranges", &[kinds.len()], key_ranges_bytes(shape.num_anchors, z.k)?)?;
        ar.count(KEY_RANGES, Lifetime::Input, input_bytes);
        Ok(StepLayout {
            policy,
            dims: z,
            elem_bytes,
            acc_bytes,
            weights,
            grads,
            lm_head,
            optimizer,
            input,
            ctx_pre,
            ctx,
            inv_hidden,
            residual,
            hf,
            inv_final,
            acts,
            attn,
            scratch,
            grad_b,
            head,
            bytes,
            input_bytes,
            items: ar.items,
        })
    }

    /// Bytes the step holds: the allocation and what each input uploads beside it.
    pub fn total_bytes(&self) -> u64 {
        self.bytes.saturating_add(self.input_bytes)
    }

    /// Refuses the step before anything is allocated when it needs more than `available` bytes
    /// of `device`, naming the largest items.
    pub fn check_fits(&self, available: u64, device: &str) -> Result<()> {
        let hint = "try a checkpointing policy that keeps less, fewer anchors or a shorter context";
        check_fits("the step", self.total_bytes(), &self.items, available, device, hint)
    }

    /// The itemised plan of this layout.
    pub fn plan(&self) -> MemoryPlan {
        let items = |keep: &dyn Fn(Lifetime) -> bool| -> Vec<Item> {
            self.items.iter().filter(|i| keep(i.lifetime)).cloned().collect()
        };
        let optimizer: u64 = self.items.iter().filter(|i| i.lifetime == Lifetime::Optimizer).map(|i| i.bytes).sum();
        MemoryPlan {
            persistent: items(&|l| matches!(l, Lifetime::Model | Lifetime::Optimizer)),
            saved: items(&|l| matches!(l, Lifetime::Saved | Lifetime::Input)),
            transient: items(&|l| l == Lifetime::Transient),
            layer_scratch: items(&|l| l == Lifetime::Layer),
            head_scratch: items(&|l| l == Lifetime::Head),
            peak: self.total_bytes(),
            peak_without_optimizer: self.total_bytes() - optimizer,
        }
    }
}

/// The itemised plan of one step and its predicted peak.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Held for the whole run (weights, gradients, frozen LM head, master copy, optimizer state).
    pub persistent: Vec<Item>,
    /// Held from the forward until the backward (inputs, context features, saved activations).
    pub saved: Vec<Item>,
    /// Scratch outside the overlaid phases, and the alignment padding.
    pub transient: Vec<Item>,
    /// What the overlaid scratch holds in a layer's phase, and in the LM-head phase (the larger
    /// of the two counts towards the peak).
    pub layer_scratch: Vec<Item>,
    pub head_scratch: Vec<Item>,
    pub peak: u64,
    /// The peak without optimizer state and fp32 master copies of weights and gradients (what a
    /// PyTorch step measured without its optimizer counts).
    pub peak_without_optimizer: u64,
}

/// The plan of one training step on the GPU (bf16 storage, fp32 arithmetic, with the optimizer's
/// state, its largest shard over `shards` workers (1: the whole), and, when `accumulate`, its
/// gradient accumulator: several rows per update or several workers) of `config` at `shape`
/// under `policy`, holding its own LM head unless `shared_head` (the target's forward on the
/// same GPU holds it).
pub fn plan_step(
    config: &DraftConfig,
    shape: StepShape,
    policy: Checkpointing,
    shared_head: bool,
    (accumulate, shards): (bool, usize),
) -> Result<MemoryPlan> {
    let params = StepDims::new(config, shape)?.params;
    // The first shard is the largest.
    let optimizer = OptimizerShape { shard: optimizer_shard(params, 0, shards.max(1)), accumulate };
    Ok(StepLayout::with_head(config, shape, policy, Some(optimizer), (super::BF16, F32), !shared_head)?.plan())
}

impl MemoryPlan {
    /// The plan as a table: one line per item, the peak, and whether it fits `device_bytes`.
    pub fn render(&self, device_bytes: u64) -> String {
        let mut out = String::new();
        for (title, items) in [
            ("persistent", &self.persistent),
            ("saved", &self.saved),
            ("transient", &self.transient),
            ("  overlaid scratch, a layer's phase", &self.layer_scratch),
            ("  overlaid scratch, the LM-head phase", &self.head_scratch),
        ] {
            out.push_str(&format!("{title}:\n"));
            let indent = if title.starts_with(' ') { "    " } else { "  " };
            for item in items.iter() {
                out.push_str(&format!(
                    "{indent}{:<width$} {:>12}\n",
                    item.name,
                    gb(item.bytes),
                    width = 60 - indent.len()
                ));
            }
        }
        out.push_str(&format!("  {:<58} {:>12}\n", "predicted peak", gb(self.peak)));
        out.push_str(&format!(
            "  {:<58} {:>12}\n",
            "peak without optimizer state and master weights",
            gb(self.peak_without_optimizer)
        ));
        let verdict = if self.peak <= device_bytes { "fits" } else { "DOES NOT FIT" };
        out.push_str(&format!("  {verdict} in {}\n", gb(device_bytes)));
        out
    }
}
