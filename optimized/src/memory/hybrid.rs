//! The memory of a Qwen3.5/3.6 hybrid target's forward (spec section 10): its weights (the
//! embedding table, layers `0..=max(target_layer_ids)` of either kind, the untied LM head the
//! drafter shares), one layer's activations for a launch of `T` tokens (the larger of a
//! GatedDeltaNet layer's and a gated attention layer's, each overlaid with the MLP's), the
//! GatedDeltaNet's fp32 state and its chunked form's scratch, and the feature buffer `[T, F*H]`,
//! as a typed layout over one allocation ([`HybridLayout`], what `model::hybrid_forward` consumes)
//! whose items are the plan ([`HybridTargetPlan`]); and the drafter such a target gets (spec
//! sections 1 and 10).
//!
//! Shapes: T tokens, H hidden, I SwiGLU, V vocab; GDN: H_k/H_v heads of d_k/d_v, conv channels
//! `2 H_k d_k + H_v d_v`, chunks of C; attention: nh/nkv heads of d, q_proj also the gate, RoPE
//! on the first r dims.

use std::collections::HashMap;

use dflash_reference::config::{training_target_layer_ids, AttnKind, DraftConfig, ModelDims};
use dflash_reference::hybrid::{hybrid_param_shapes, HybridConfig, HybridLayerKind};

use super::attention::causal_plans_bytes;
use super::{add, check_fits, gb, Arena, Item, Lifetime, Region};
use crate::ops::attention::ranges::KeyRanges;
use crate::ops::gdn::{segment_table_len, GdnShape};
use crate::{Error, Result};

/// One GatedDeltaNet layer's weights (HF names under `linear_attn.`), stored; `conv1d` `[C, K]`.
#[derive(Clone, Copy, Debug)]
pub struct GdnWeightRegions {
    pub in_proj_qkv: Region,
    pub in_proj_z: Region,
    pub in_proj_b: Region,
    pub in_proj_a: Region,
    pub conv1d: Region,
    pub a_log: Region,
    pub dt_bias: Region,
    pub norm: Region,
    pub out_proj: Region,
}

/// One gated attention layer's weights (HF names under `self_attn.`), stored; `q_proj`
/// `[2, nh*d, H]` holds every head's query rows, then every head's gate rows.
#[derive(Clone, Copy, Debug)]
pub struct GatedAttnWeightRegions {
    pub q_proj: Region,
    pub k_proj: Region,
    pub v_proj: Region,
    pub o_proj: Region,
    pub q_norm: Region,
    pub k_norm: Region,
}

/// A layer's token mixer.
#[derive(Clone, Copy, Debug)]
pub enum MixerRegions {
    Gdn(GdnWeightRegions),
    Attention(GatedAttnWeightRegions),
}

/// One decoder layer's weights; `gate_up` is `[2I, H]` (gate rows, then up rows).
#[derive(Clone, Copy, Debug)]
pub struct HybridLayerWeights {
    pub input_norm: Region,
    pub post_norm: Region,
    pub gate_up: Region,
    pub down: Region,
    pub mixer: MixerRegions,
}

/// A GatedDeltaNet layer's scratch: the projections `qkv_pre [T, C]`, `z [T, H_v d_v]`, `b`,
/// `a` `[T, H_v]` (stored), the conv's output `qkv [T, C]`, the delta rule's output `o`
/// (gated in place), the gates `beta`, `g` `[T, H_v]` (arithmetic type) and the delta rule's
/// scratch of [`GdnShape::scratch_values`] (`ops::gdn::DeltaScratch`: W and the entering states
/// stored, U / Delta and the carried state arithmetic).
#[derive(Clone, Copy, Debug)]
pub struct GdnScratch {
    pub qkv_pre: Region,
    pub qkv: Region,
    pub z: Region,
    pub o: Region,
    pub b: Region,
    pub a: Region,
    pub beta: Region,
    pub g: Region,
    pub w: Region,
    pub u: Region,
    pub states: Region,
    pub carry: Region,
}

/// A gated attention layer's scratch: `q`, `gate`, `out` `[T, nh*d]`, `k`, `v` `[T, nkv*d]`
/// (stored; q and k normed and rotated in place), `lse [nh, T]` and the head norms' inverse RMS
/// `inv_q [T*nh]`, `inv_k [T*nkv]` (arithmetic type).
#[derive(Clone, Copy, Debug)]
pub struct GatedAttnScratch {
    pub q: Region,
    pub gate: Region,
    pub k: Region,
    pub v: Region,
    pub out: Region,
    pub lse: Region,
    pub inv_q: Region,
    pub inv_k: Region,
}

/// The MLP's scratch: `gate_up [T, 2I]`, `h [T, I]`.
#[derive(Clone, Copy, Debug)]
pub struct HybridMlpScratch {
    pub gate_up: Region,
    pub h: Region,
}

/// A GatedDeltaNet layer's decoding state (spec sections 4 and 10): the kept `state
/// [H_v, d_k, d_v]` (arithmetic type) and conv `window [K-1, C]` (the last conv inputs, stored),
/// and what the last verify launch of up to `R` tokens saved to keep a prefix of it: its conv
/// input `pre [K-1+R, C]` (the window, then its tokens), the conv's output `qkv [R, C]` and the
/// gates `beta`, `g` `[R, H_v]`.
#[derive(Clone, Copy, Debug)]
pub struct GdnCacheRegions {
    pub state: Region,
    pub window: Region,
    pub pre: Region,
    pub qkv: Region,
    pub beta: Region,
    pub g: Region,
}

/// A layer's decoding cache: the GatedDeltaNet's state, or the keys (after norm and RoPE) and
/// values `[C, nkv*d]` of a gated attention layer.
#[derive(Clone, Copy, Debug)]
pub enum LayerCacheRegions {
    Gdn(GdnCacheRegions),
    Attention { k: Region, v: Region },
}

/// The segment tables (u32, `ops::gdn::segment_table`) of a decoding launch of `t` tokens: the
/// conv's over `K-1+t` rows (the window, then the tokens: one segment) and the delta rule's over
/// the `t` tokens (one segment resuming the kept state).
#[derive(Clone, Copy, Debug)]
pub struct DecodeTables {
    pub conv: Region,
    pub delta: Region,
}

/// What decoding adds to the layout: every layer runs with its cache, then the final norm, the
/// LM head and the next tokens.
#[derive(Clone, Debug)]
pub struct HybridDecodeRegions {
    /// Positions the attention caches hold (`C`).
    pub context: usize,
    /// Rows whose logits one launch takes, and the longest verify launch (`R`).
    pub logit_rows: usize,
    pub final_norm: Region,
    /// Per layer run.
    pub caches: Vec<LayerCacheRegions>,
    /// The logits `[R, V]` (stored) and their argmax, the next tokens (u32 `[R]`).
    pub logits: Region,
    pub next: Region,
    /// The tables of launches of `t = 1..=R` tokens (index `t - 1`), made once, and those of a
    /// longer launch, uploaded with it.
    pub tables: Vec<DecodeTables>,
    pub launch_tables: DecodeTables,
}

/// The hybrid target forward's typed layout over one allocation, for launches of up to `tokens`.
#[derive(Clone, Debug)]
pub struct HybridLayout {
    pub tokens: usize,
    /// Layers run: `max(target_layer_ids) + 1`.
    pub layers_run: usize,
    pub embed: Region,
    pub layers: Vec<HybridLayerWeights>,
    /// Every weight read, as `(HF name, shape, region)` (gate and up the halves of `gate_up`).
    pub weights: Vec<(String, Vec<usize>, Region)>,
    /// The RoPE tables of positions `0..T` `[T, r]` (arithmetic type), made once.
    pub cos_table: Region,
    pub sin_table: Region,
    /// A launch's token ids and positions (u32 `[T]`), its GatedDeltaNet segment table (u32, see
    /// `ops::gdn::segment_table`), its RoPE tables `[T, r]` gathered from the position tables, and
    /// per tapped layer `f` the u32 rows `t*F + f` of the features `[T*F, H]`.
    pub token_ids: Region,
    pub positions: Region,
    pub segments: Region,
    pub cos: Region,
    pub sin: Region,
    pub feature_rows: Vec<Region>,
    /// The residual stream and the normed input `[T, H]`, its inverse RMS `[T]`.
    pub x: Region,
    pub xn: Region,
    pub inv: Region,
    /// `None` when no layer run is of that kind.
    pub gdn: Option<GdnScratch>,
    pub attn: Option<GatedAttnScratch>,
    pub mlp: HybridMlpScratch,
    /// The features `[T, F*H]`.
    pub features: Region,
    /// The decoding parts, in a decoding layout.
    pub decode: Option<HybridDecodeRegions>,
    /// The allocation's bytes (the key ranges are beside it).
    pub bytes: u64,
    pub items: Vec<Item>,
}

/// The item of a weight by its HF name.
fn weight_item(name: &str) -> &'static str {
    match name {
        "model.embed_tokens.weight" => "target embedding table (shared)",
        "lm_head.weight" => "target LM head (the drafter's, shared)",
        n if n.contains(".linear_attn.") => "target GatedDeltaNet weights",
        n if n.contains(".self_attn.") => "target gated attention weights",
        _ => "target MLP and norm weights",
    }
}

impl HybridLayout {
    /// The layout of `config` tapping `layer_ids` for launches of up to `tokens` tokens, storing
    /// `widths = (stored, arithmetic)` bytes per value.
    pub fn new(config: &HybridConfig, layer_ids: &[usize], tokens: usize, widths: (u64, u64)) -> Result<Self> {
        Self::build(config, layer_ids, tokens, widths, None)
    }

    /// The decoding layout (spec sections 4 and 10) of `config`: launches of up to `tokens`
    /// tokens at positions below `context`, every layer with its cache, the features of the
    /// tapped `layer_ids`, and the logits of up to `logit_rows` rows per launch (also the longest
    /// launch whose prefix can be kept).
    pub fn decoding(
        config: &HybridConfig,
        layer_ids: &[usize],
        tokens: usize,
        context: usize,
        logit_rows: usize,
        widths: (u64, u64),
    ) -> Result<Self> {
        super::check_decoding_sizes(tokens, context, logit_rows)?;
        Self::build(config, layer_ids, tokens, widths, Some((context, logit_rows)))
    }

    fn build(
        config: &HybridConfig,
        layer_ids: &[usize],
        tokens: usize,
        widths: (u64, u64),
        decode: Option<(usize, usize)>,
    ) -> Result<Self> {
        let tapped = *layer_ids.iter().max().ok_or_else(|| Error::invalid("target_layer_ids", "is empty"))?;
        let last = if decode.is_some() { config.num_layers().max(1) - 1 } else { tapped };
        if tapped >= config.num_layers() {
            return Err(Error::invalid(
                "target_layer_ids",
                format!("layer {tapped} is out of range for a target of {} layers", config.num_layers()),
            ));
        }
        if tokens == 0 {
            return Err(Error::invalid("tokens", "a launch needs at least 1 token"));
        }
        let (e, a) = widths;
        let (t, h, i) = (tokens, config.hidden_size, config.intermediate_size);
        let mut ar = Arena::default();
        use Lifetime::{Input, Layer, Model, Saved};
        // Weights: what the forward reads (the final norm only when decoding); gate and up stacked.
        let ran = |name: &str| match name.strip_prefix("model.layers.") {
            Some(rest) => rest.split('.').next().and_then(|l| l.parse::<usize>().ok()).is_some_and(|l| l <= last),
            None => {
                name == "model.embed_tokens.weight"
                    || name == "lm_head.weight"
                    || (name == "model.norm.weight" && decode.is_some())
            }
        };
        let mut weights = Vec::new();
        let mut gate = None;
        for (name, shape) in hybrid_param_shapes(config).into_iter().filter(|(n, _)| ran(n)) {
            let region = if name.ends_with("mlp.gate_proj.weight") {
                let both = ar.take(weight_item(&name), Model, "mlp.gate_up_proj", &[2, shape[0], shape[1]], e)?;
                gate = Some(both);
                Region { bytes: both.bytes / 2, ..both }
            } else if name.ends_with("mlp.up_proj.weight") {
                let both = gate.take().ok_or_else(|| Error::invalid(&name, "comes before its gate_proj"))?;
                both.skip(both.bytes / 2)
            } else {
                ar.take(weight_item(&name), Model, &name, &shape, e)?
            };
            weights.push((name, shape, region));
        }
        let named: HashMap<&str, Region> = weights.iter().map(|(n, _, r)| (n.as_str(), *r)).collect();
        let layers = (0..=last)
            .map(|l| {
                let w = |n: &str| named[format!("model.layers.{l}.{n}").as_str()];
                let mixer = match config.layer_kinds[l] {
                    HybridLayerKind::Linear => MixerRegions::Gdn(GdnWeightRegions {
                        in_proj_qkv: w("linear_attn.in_proj_qkv.weight"),
                        in_proj_z: w("linear_attn.in_proj_z.weight"),
                        in_proj_b: w("linear_attn.in_proj_b.weight"),
                        in_proj_a: w("linear_attn.in_proj_a.weight"),
                        conv1d: w("linear_attn.conv1d.weight"),
                        a_log: w("linear_attn.A_log"),
                        dt_bias: w("linear_attn.dt_bias"),
                        norm: w("linear_attn.norm.weight"),
                        out_proj: w("linear_attn.out_proj.weight"),
                    }),
                    HybridLayerKind::Full => MixerRegions::Attention(GatedAttnWeightRegions {
                        q_proj: w("self_attn.q_proj.weight"),
                        k_proj: w("self_attn.k_proj.weight"),
                        v_proj: w("self_attn.v_proj.weight"),
                        o_proj: w("self_attn.o_proj.weight"),
                        q_norm: w("self_attn.q_norm.weight"),
                        k_norm: w("self_attn.k_norm.weight"),
                    }),
                };
                let gate_up = w("mlp.gate_proj.weight");
                HybridLayerWeights {
                    input_norm: w("input_layernorm.weight"),
                    post_norm: w("post_attention_layernorm.weight"),
                    gate_up: Region { bytes: 2 * gate_up.bytes, ..gate_up },
                    down: w("mlp.down_proj.weight"),
                    mixer,
                }
            })
            .collect();
        let embed = named["model.embed_tokens.weight"];
        let kinds: Vec<HybridLayerKind> = config.layer_kinds[..=last].to_vec();
        let r = config.rope.rotary_dim;
        // Not weights (`weight_bytes`), though made once.
        const TABLES: &str = "target RoPE tables of positions 0..T (decoding: 0..C)";
        let held = decode.map_or(t, |(context, _)| context);
        let cos_table = ar.take(TABLES, Saved, "cos table", &[held, r], a)?;
        let sin_table = ar.take(TABLES, Saved, "sin table", &[held, r], a)?;
        const INPUTS: &str = "target inputs (tokens, RoPE tables, feature rows)";
        let token_ids = ar.take(INPUTS, Saved, "tokens", &[t], 4)?;
        let positions = ar.take(INPUTS, Saved, "positions", &[t], 4)?;
        let segments = ar.take(INPUTS, Saved, "segment table", &[segment_table_len(t)], 4)?;
        let cos = ar.take(INPUTS, Saved, "cos", &[t, r], a)?;
        let sin = ar.take(INPUTS, Saved, "sin", &[t, r], a)?;
        let f = layer_ids.len();
        let feature_rows = (0..f).map(|_| ar.take(INPUTS, Saved, "feature rows", &[t], 4)).collect::<Result<_>>()?;
        let (d, nh, nkv) = (config.head_dim, config.num_heads, config.num_kv_heads);
        if kinds.contains(&HybridLayerKind::Full) {
            // Beside the allocation: the causal plans.
            let group_rows = KeyRanges::causal_group_rows(nh / nkv);
            let plans = causal_plans_bytes(t, group_rows)?;
            ar.count("target attention key ranges", Input, plans);
        }
        const RESIDUAL: &str = "target residual stream and normed input";
        let x = ar.take(RESIDUAL, Saved, "x", &[t, h], e)?;
        let xn = ar.take(RESIDUAL, Saved, "xn", &[t, h], e)?;
        let inv = ar.take(RESIDUAL, Saved, "inv", &[t], a)?;
        let features = ar.take("target features", Saved, "features", &[t, f, h], e)?;
        let g = GdnShape::new(&config.gdn, t);
        g.check()?;
        // Decoding's conv runs over the window's K-1 rows, then the launch's.
        let conv_rows = t + if decode.is_some() { g.conv_kernel - 1 } else { 0 };
        let ((gdn, attn), mlp) = ar.overlay(
            |ar| {
                ar.overlay(
                    |ar| {
                        if !kinds.contains(&HybridLayerKind::Linear) {
                            return Ok(None);
                        }
                        const GDN: &str = "target GatedDeltaNet scratch (one layer)";
                        let mut s = |what: &str, dims: &[usize], w: u64| ar.take(GDN, Layer, what, dims, w);
                        let d = g.scratch_values();
                        Ok(Some(GdnScratch {
                            qkv_pre: s("qkv before the conv", &[conv_rows, g.conv_channels()], e)?,
                            qkv: s("qkv after the conv", &[conv_rows, g.conv_channels()], e)?,
                            z: s("z", &[t, g.value_dim()], e)?,
                            o: s("the gated output", &[t, g.value_dim()], e)?,
                            b: s("b", &[t, g.value_heads], e)?,
                            a: s("a", &[t, g.value_heads], e)?,
                            beta: s("beta", &[t, g.value_heads], a)?,
                            g: s("g", &[t, g.value_heads], a)?,
                            w: s("W of the chunks", &[d.w], e)?,
                            u: s("U then Delta of the chunks", &[d.u], a)?,
                            states: s("the states entering the chunks", &[d.states], e)?,
                            carry: s("the carried state", &[d.carry], a)?,
                        }))
                    },
                    |ar| {
                        if !kinds.contains(&HybridLayerKind::Full) {
                            return Ok(None);
                        }
                        const ATT: &str = "target gated attention scratch (one layer)";
                        let mut s = |what: &str, dims: &[usize], w: u64| ar.take(ATT, Layer, what, dims, w);
                        Ok(Some(GatedAttnScratch {
                            q: s("q", &[t, nh, d], e)?,
                            gate: s("gate", &[t, nh, d], e)?,
                            k: s("k", &[t, nkv, d], e)?,
                            v: s("v", &[t, nkv, d], e)?,
                            out: s("attention out", &[t, nh, d], e)?,
                            lse: s("lse", &[nh, t], a)?,
                            inv_q: s("inv_q", &[t, nh], a)?,
                            inv_k: s("inv_k", &[t, nkv], a)?,
                        }))
                    },
                )
            },
            |ar| {
                let mut s =
                    |what: &str, dims: &[usize]| ar.take("target MLP scratch (one layer)", Layer, what, dims, e);
                Ok(HybridMlpScratch { gate_up: s("gate_up", &[t, 2, i])?, h: s("h", &[t, i])? })
            },
        )?;
        let decode = match decode {
            None => None,
            Some((context, logit_rows)) => {
                let final_norm = named["model.norm.weight"];
                let (c, hv, k) = (g.conv_channels(), g.value_heads, g.conv_kernel);
                let caches = kinds
                    .iter()
                    .map(|kind| {
                        Ok(match kind {
                            HybridLayerKind::Linear => {
                                const STATE: &str = "target GatedDeltaNet decoding state";
                                const SAVED: &str = "target GatedDeltaNet verify launch (kept prefix)";
                                let (dk, dv) = (g.key_head_dim, g.value_head_dim);
                                LayerCacheRegions::Gdn(GdnCacheRegions {
                                    state: ar.take(STATE, Saved, "state", &[hv, dk, dv], a)?,
                                    window: ar.take(STATE, Saved, "conv window", &[k - 1, c], e)?,
                                    pre: ar.take(SAVED, Saved, "conv input", &[k - 1 + logit_rows, c], e)?,
                                    qkv: ar.take(SAVED, Saved, "conv output", &[logit_rows, c], e)?,
                                    beta: ar.take(SAVED, Saved, "beta", &[logit_rows, hv], a)?,
                                    g: ar.take(SAVED, Saved, "g", &[logit_rows, hv], a)?,
                                })
                            }
                            HybridLayerKind::Full => LayerCacheRegions::Attention {
                                k: ar.take("target K/V cache", Saved, "k cache", &[context, nkv * d], e)?,
                                v: ar.take("target K/V cache", Saved, "v cache", &[context, nkv * d], e)?,
                            },
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let logits = ar.take("target logits", Layer, "logits", &[logit_rows, config.vocab_size], e)?;
                let next = ar.take("target next tokens", Saved, "next", &[logit_rows], 4)?;
                const SEGMENTS: &str = "target GatedDeltaNet segment tables";
                let mut tables_of = |n: usize| -> Result<DecodeTables> {
                    Ok(DecodeTables {
                        conv: ar.take(SEGMENTS, Saved, "conv", &[segment_table_len(k - 1 + n)], 4)?,
                        delta: ar.take(SEGMENTS, Saved, "delta", &[segment_table_len(n)], 4)?,
                    })
                };
                let tables = (1..=logit_rows).map(&mut tables_of).collect::<Result<Vec<_>>>()?;
                let launch_tables = tables_of(t)?;
                Some(HybridDecodeRegions {
                    context,
                    logit_rows,
                    final_norm,
                    caches,
                    logits,
                    next,
                    tables,
                    launch_tables,
                })
            }
        };
        Ok(HybridLayout {
            tokens,
            layers_run: last + 1,
            embed,
            layers,
            weights,
            cos_table,
            sin_table,
            token_ids,
            positions,
            segments,
            cos,
            sin,
            feature_rows,
            x,
            xn,
            inv,
            gdn,
            attn,
            mlp,
            features,
            decode,
            bytes: ar.bytes(),
            items: ar.items,
        })
    }

    /// The allocation and the key ranges beside it.
    pub fn total_bytes(&self) -> Result<u64> {
        let beside = self.items.iter().filter(|i| i.lifetime == Lifetime::Input).map(|i| i.bytes).sum();
        add("hybrid target", self.bytes, beside)
    }

    /// The layout's plan: its items and total.
    pub fn plan(&self) -> Result<HybridTargetPlan> {
        Ok(HybridTargetPlan {
            layers: self.layers_run,
            tokens: self.tokens,
            bytes: self.total_bytes()?,
            items: self.items.clone(),
        })
    }
}

/// The planned memory of a hybrid target's forward, itemised: [`HybridLayout`]'s items.
#[derive(Clone, Debug)]
pub struct HybridTargetPlan {
    /// Layers run: `max(target_layer_ids) + 1`.
    pub layers: usize,
    pub tokens: usize,
    /// The allocation and the key ranges beside it.
    pub bytes: u64,
    pub items: Vec<Item>,
}

impl HybridTargetPlan {
    /// The plan of `config` tapping `layer_ids` for launches of `tokens` tokens, storing
    /// `widths = (stored, arithmetic)` bytes per value.
    pub fn new(config: &HybridConfig, layer_ids: &[usize], tokens: usize, widths: (u64, u64)) -> Result<Self> {
        HybridLayout::new(config, layer_ids, tokens, widths)?.plan()
    }

    /// Refuses the plan when it needs more than `available` bytes of `device`, naming the largest
    /// items.
    pub fn check_fits(&self, available: u64, device: &str) -> Result<()> {
        let hint =
            "run the target on a GPU of its own (`train --target-workers`, `--gpus`) or offline (`xtask features`)";
        check_fits("the hybrid target", self.bytes, &self.items, available, device, hint)
    }

    /// The plan as a table: one line per item and the total.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for item in &self.items {
            out.push_str(&format!("  {:<58} {:>12}\n", item.name, gb(item.bytes)));
        }
        out.push_str(&format!("  {:<58} {:>12}\n", "target total", gb(self.bytes)));
        out
    }

    /// The weights alone (what a target GPU holds however the rows are split).
    pub fn weight_bytes(&self) -> Result<u64> {
        self.items.iter().filter(|i| i.lifetime == Lifetime::Model).try_fold(0, |s, i| add("weights", s, i.bytes))
    }
}

/// The published hybrid drafter's `(layers, block size, features)` (spec sections 1 and 10).
pub const HYBRID_DRAFTER_RECIPE: (usize, usize, usize) = (5, 16, 5);
/// The sliding window of the hybrid targets' drafters (spec section 1: 2048).
pub const HYBRID_DRAFTER_WINDOW: usize = 2048;
/// The drafters' own RoPE theta for hybrid targets (spec section 10: 1e7, full RoPE).
pub const HYBRID_DRAFTER_ROPE_THETA: f64 = 1e7;

/// The drafter of a hybrid target (spec sections 1 and 10): a Qwen3-layout stack of
/// `num_layers` layers, the last full and the others sliding (window 2048), heads of 128
/// (hidden / 128 query heads, 8 K/V heads or the most below that divide them), the target's hidden size, SwiGLU size and vocab, its
/// own RoPE theta 1e7, features from the layer rule for `num_features`. As published: 5 layers,
/// block 16, 5 features.
pub fn hybrid_drafter(
    config: &HybridConfig,
    (num_layers, block_size, num_features): (usize, usize, usize),
    mask_token_id: u32,
) -> Result<DraftConfig> {
    let head_dim = 128;
    if !config.hidden_size.is_multiple_of(head_dim) {
        return Err(Error::invalid(
            "hidden_size",
            format!("{}: not a multiple of the drafter's heads of {head_dim}", config.hidden_size),
        ));
    }
    if num_layers == 0 || num_features == 0 || num_features > config.num_layers() {
        return Err(Error::invalid(
            "drafter",
            format!("{num_layers} layers and {num_features} features for a target of {} layers", config.num_layers()),
        ));
    }
    // 8 K/V heads as published; fewer when the query heads are not a multiple of 8.
    let heads = config.hidden_size / head_dim;
    let kv_heads = (1..=8).rev().find(|k| heads.is_multiple_of(*k)).unwrap_or(1);
    let mut layer_kinds = vec![AttnKind::Sliding { window: HYBRID_DRAFTER_WINDOW }; num_layers - 1];
    layer_kinds.push(AttnKind::Full);
    Ok(DraftConfig {
        dims: ModelDims {
            hidden_size: config.hidden_size,
            intermediate_size: config.intermediate_size,
            num_heads: config.hidden_size / head_dim,
            num_kv_heads: kv_heads,
            head_dim,
            vocab_size: config.vocab_size,
            rms_norm_eps: config.rms_norm_eps,
            rope_theta: HYBRID_DRAFTER_ROPE_THETA,
            max_position_embeddings: config.max_position_embeddings,
            layer_kinds,
        },
        block_size,
        num_target_layers: config.num_layers(),
        mask_token_id,
        target_layer_ids: training_target_layer_ids(config.num_layers(), num_features),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixture hybrid (GDN and attention layers) tapping layers 3 and 1 at T = 100, bf16:
    /// the plan is the layout's items and total; the weight regions hold exactly the plan's
    /// weights (the parameter count of layers 0..=3, the embedding and the head, 2 bytes each);
    /// each layer-scratch item is the sum of its regions; every region lies in the allocation.
    #[test]
    fn the_layout_is_the_plan() {
        let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/target-qwen3_5/config.json");
        let config = HybridConfig::from_file(&file).expect("fixture config");
        let layout = HybridLayout::new(&config, &[3, 1], 100, (2, 4)).expect("layout");
        let plan = HybridTargetPlan::new(&config, &[3, 1], 100, (2, 4)).expect("plan");
        assert_eq!(plan.items, layout.items);
        assert_eq!(plan.bytes, layout.total_bytes().expect("total"));
        let layer = |r: &str| r.split('.').next().and_then(|l| l.parse::<usize>().ok());
        let in_layers = |n: &str| n.strip_prefix("model.layers.").is_none_or(|r| layer(r).is_some_and(|l| l <= 3));
        let params: usize = hybrid_param_shapes(&config)
            .into_iter()
            .filter(|(n, _)| n != "model.norm.weight" && in_layers(n))
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        let weights: u64 = layout.weights.iter().map(|(_, _, r)| r.bytes).sum();
        assert_eq!((weights, plan.weight_bytes().expect("weights")), (2 * params as u64, 2 * params as u64));
        let item = |name: &str| plan.items.iter().find(|i| i.name == name).map(|i| i.bytes).expect(name);
        let (g, a, m) = (layout.gdn.expect("GDN scratch"), layout.attn.expect("attention scratch"), layout.mlp);
        let gdn = [g.qkv_pre, g.qkv, g.z, g.o, g.b, g.a, g.beta, g.g, g.w, g.u, g.states, g.carry];
        let attn = [a.q, a.gate, a.k, a.v, a.out, a.lse, a.inv_q, a.inv_k];
        let sum = |r: &[Region]| r.iter().map(|r| r.bytes).sum::<u64>();
        assert_eq!(sum(&gdn), item("target GatedDeltaNet scratch (one layer)"));
        assert_eq!(sum(&attn), item("target gated attention scratch (one layer)"));
        assert_eq!(sum(&[m.gate_up, m.h]), item("target MLP scratch (one layer)"));
        let others = [m.gate_up, m.h, layout.x, layout.features, layout.cos_table];
        let all = gdn.iter().chain(&attn).chain(&others);
        assert!(all.chain(layout.weights.iter().map(|(_, _, r)| r)).all(|r| r.offset + r.bytes <= layout.bytes));
    }
}
