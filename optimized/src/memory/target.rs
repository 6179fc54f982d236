//! The memory of the target's forward on the GPU (spec sections 3 and 9): its frozen weights
//! (the embedding table, layers `0..=max(target_layer_ids)` and, untied, the LM head the drafter
//! shares), one layer's activations for a launch of up to `T` tokens, and the feature buffer
//! `[T, F*H]` it writes, as a typed layout over one allocation (`model::target_forward` consumes
//! it as is). The layers after the last tapped one, the final norm and the logits are never run,
//! except by the decoding layout ([`TargetLayout::decoding`], spec section 4): every layer, the
//! final norm, the LM head, a K/V cache of `C` positions per layer and the logits of the rows
//! whose next token is taken.
//!
//! Shapes: T tokens per launch, H hidden, I SwiGLU, nh/nkv heads of d, F tapped layers, V vocab.

use dflash_reference::config::TargetConfig;

use super::attention::causal_plans_bytes;
use super::{add, bytes_of, check_fits, gb, mul_usize, Arena, Item, Lifetime, Region};
use crate::ops::attention::ranges::KeyRanges;
use crate::{Error, Result};

/// Sizes of one target launch, checked: every product below fits in `usize`.
#[derive(Clone, Copy, Debug)]
pub struct TargetDims {
    /// Tokens per launch (one or several rows).
    pub t: usize,
    pub h: usize,
    pub i: usize,
    pub nh: usize,
    pub nkv: usize,
    pub d: usize,
    pub qd: usize,
    pub kd: usize,
    pub v: usize,
    /// Layers run: `max(target_layer_ids) + 1`.
    pub layers: usize,
    /// Tapped layers `F`.
    pub f: usize,
    /// Feature width `F*H`.
    pub fw: usize,
}

impl TargetDims {
    /// The sizes of one of the target's layers.
    pub fn layer_shape(&self) -> LayerShape {
        LayerShape { h: self.h, i: self.i, qd: self.qd, kd: self.kd, d: self.d }
    }
}

/// One decoder layer's frozen weights; `gate_up` is `[2I, H]` (gate rows, then up rows).
#[derive(Clone, Copy, Debug)]
pub struct TargetLayerWeights {
    pub input_norm: Region,
    pub q: Region,
    pub k: Region,
    pub v: Region,
    pub o: Region,
    /// Qwen3's per-head q/k norms; `None` for Llama.
    pub q_norm: Option<Region>,
    pub k_norm: Option<Region>,
    pub post_norm: Region,
    pub gate_up: Region,
    pub down: Region,
}

/// The sizes of one decoder layer: hidden `h`, SwiGLU `i`, q width `qd`, k/v width `kd`, head `d`.
#[derive(Clone, Copy, Debug)]
pub struct LayerShape {
    pub h: usize,
    pub i: usize,
    pub qd: usize,
    pub kd: usize,
    pub d: usize,
}

impl TargetLayerWeights {
    /// Whether q, k and v lie back to back: one stacked `[qd + 2 kd, H]` weight that a single
    /// projection reads.
    pub fn qkv_stacked(&self) -> bool {
        self.q.offset + self.q.bytes == self.k.offset && self.k.offset + self.k.bytes == self.v.offset
    }

    /// One layer's weights taken from `ar` as `item`, `elem` bytes per value; q/k norms when
    /// `head_norms` (Qwen3 and the drafter).
    pub fn take(ar: &mut Arena, item: &'static str, z: LayerShape, head_norms: bool, elem: u64) -> Result<Self> {
        let mut w = |what: &str, dims: &[usize]| ar.take(item, Lifetime::Model, what, dims, elem);
        Ok(TargetLayerWeights {
            input_norm: w("input_layernorm", &[z.h])?,
            q: w("q_proj", &[z.qd, z.h])?,
            k: w("k_proj", &[z.kd, z.h])?,
            v: w("v_proj", &[z.kd, z.h])?,
            o: w("o_proj", &[z.h, z.qd])?,
            q_norm: if head_norms { Some(w("q_norm", &[z.d])?) } else { None },
            k_norm: if head_norms { Some(w("k_norm", &[z.d])?) } else { None },
            post_norm: w("post_attention_layernorm", &[z.h])?,
            gate_up: w("gate_up_proj", &[2, z.i, z.h])?,
            down: w("down_proj", &[z.h, z.i])?,
        })
    }

    /// Loads the layer through `put(region, name, shape)`, each name `{prefix}{hf name}.weight`
    /// (`model.layers.3.` for a target, `layers.3.` for a drafter); gate and up are stacked.
    pub fn load(
        &self,
        prefix: &str,
        z: LayerShape,
        elem: usize,
        put: impl Fn(Region, &str, &[usize]) -> Result<()>,
    ) -> Result<()> {
        let name = |n: &str| format!("{prefix}{n}.weight");
        put(self.input_norm, &name("input_layernorm"), &[z.h])?;
        put(self.q, &name("self_attn.q_proj"), &[z.qd, z.h])?;
        put(self.k, &name("self_attn.k_proj"), &[z.kd, z.h])?;
        put(self.v, &name("self_attn.v_proj"), &[z.kd, z.h])?;
        put(self.o, &name("self_attn.o_proj"), &[z.h, z.qd])?;
        if let (Some(qn), Some(kn)) = (self.q_norm, self.k_norm) {
            put(qn, &name("self_attn.q_norm"), &[z.d])?;
            put(kn, &name("self_attn.k_norm"), &[z.d])?;
        }
        put(self.post_norm, &name("post_attention_layernorm"), &[z.h])?;
        let half = (z.i * z.h * elem) as u64;
        put(Region { bytes: half, ..self.gate_up }, &name("mlp.gate_proj"), &[z.i, z.h])?;
        put(self.gate_up.skip(half), &name("mlp.up_proj"), &[z.i, z.h])?;
        put(self.down, &name("mlp.down_proj"), &[z.h, z.i])
    }
}

/// The attention half of a layer's scratch (overlaid with [`MlpScratch`]).
#[derive(Clone, Copy, Debug)]
pub struct AttnScratch {
    /// The projections before the head norms and RoPE: the stacked `[t, qd + 2 kd]` rows of one
    /// pass over stacked weights, else q `[t, qd]` then k `[t, kd]`.
    pub qkv_pre: Region,
    pub v: Region,
    pub q: Region,
    pub k: Region,
    pub out: Region,
    pub lse: Region,
    pub inv_q: Region,
    pub inv_k: Region,
}

/// The MLP half of a layer's scratch.
#[derive(Clone, Copy, Debug)]
pub struct MlpScratch {
    pub gate_up: Region,
    pub h: Region,
}

/// What decoding adds to the layout: every layer runs, then the final norm and the LM head.
#[derive(Clone, Debug)]
pub struct DecodeRegions {
    /// Positions the caches hold (`C`).
    pub context: usize,
    /// Rows whose logits one launch takes (`R`).
    pub logit_rows: usize,
    pub final_norm: Region,
    /// Per layer, the cached keys (after norm and RoPE) and values `[C, kv heads * d]`.
    pub k_cache: Vec<Region>,
    pub v_cache: Vec<Region>,
    /// The logits `[R, V]` (stored) and their argmax, the next tokens (u32 `[R]`).
    pub logits: Region,
    pub next: Region,
}

/// The target's typed layout over one allocation.
#[derive(Clone, Debug)]
pub struct TargetLayout {
    pub dims: TargetDims,
    pub embed: Region,
    /// The untied LM head (the drafter's frozen head), when the layout holds it.
    pub lm_head: Option<Region>,
    pub layers: Vec<TargetLayerWeights>,
    /// The RoPE tables of positions `0..T` `[T, d]` (arithmetic type), made once.
    pub cos_table: Region,
    pub sin_table: Region,
    /// Token ids and positions (u32) of a launch, and its RoPE tables `[T, d]` gathered from the
    /// position tables.
    pub tokens: Region,
    pub positions: Region,
    pub cos: Region,
    pub sin: Region,
    /// Per tapped layer `f`, the u32 row indices `t*F + f` that scatter its output `[T, H]` into
    /// the features viewed as `[T*F, H]`.
    pub feature_rows: Vec<Region>,
    /// The residual stream `[T, H]`, the normed input `[T, H]` and its inverse RMS `[T]`.
    pub x: Region,
    pub xn: Region,
    pub inv: Region,
    pub attn: AttnScratch,
    pub mlp: MlpScratch,
    /// The features `[T, F*H]`, when the layout holds them (else the caller's buffer).
    pub features: Option<Region>,
    /// The decoding parts, in a decoding layout.
    pub decode: Option<DecodeRegions>,
    pub bytes: u64,
    pub items: Vec<Item>,
}

impl TargetLayout {
    /// The layout of `config` tapping `layer_ids` for launches of up to `tokens` tokens, storing
    /// `widths = (stored, arithmetic)` bytes per value; `with_lm_head` keeps an untied LM head
    /// (tied heads are the embedding table), `with_features` the feature buffer.
    pub fn new(
        config: &TargetConfig,
        layer_ids: &[usize],
        tokens: usize,
        widths: (u64, u64),
        with_lm_head: bool,
        with_features: bool,
    ) -> Result<Self> {
        Self::build(config, layer_ids, tokens, widths, with_lm_head, with_features, None)
    }

    /// The decoding layout (spec section 4) of `config`: launches of up to `tokens` tokens at
    /// positions below `context` (the caches' size), every layer, the features of the tapped
    /// `layer_ids`, and the logits of up to `logit_rows` rows per launch.
    pub fn decoding(
        config: &TargetConfig,
        layer_ids: &[usize],
        tokens: usize,
        context: usize,
        logit_rows: usize,
        widths: (u64, u64),
    ) -> Result<Self> {
        super::check_decoding_sizes(tokens, context, logit_rows)?;
        Self::build(config, layer_ids, tokens, widths, true, true, Some((context, logit_rows)))
    }

    fn build(
        config: &TargetConfig,
        layer_ids: &[usize],
        tokens: usize,
        widths: (u64, u64),
        with_lm_head: bool,
        with_features: bool,
        decode: Option<(usize, usize)>,
    ) -> Result<Self> {
        config.check_runs_here("laying out the target's forward")?;
        let c = &config.dims;
        let last = *layer_ids.iter().max().ok_or_else(|| Error::invalid("target_layer_ids", "is empty"))?;
        if last >= c.num_layers() {
            return Err(Error::invalid(
                "target_layer_ids",
                format!("layer {last} is out of range for a target of {} layers", c.num_layers()),
            ));
        }
        if tokens == 0 {
            return Err(Error::invalid("tokens", "a launch needs at least 1 token"));
        }
        let z = TargetDims {
            t: tokens,
            h: c.hidden_size,
            i: c.intermediate_size,
            nh: c.num_heads,
            nkv: c.num_kv_heads,
            d: c.head_dim,
            qd: mul_usize("q width (heads x head_dim)", c.num_heads, c.head_dim)?,
            kd: mul_usize("k width (kv heads x head_dim)", c.num_kv_heads, c.head_dim)?,
            v: c.vocab_size,
            layers: if decode.is_some() { c.num_layers() } else { last + 1 },
            f: layer_ids.len(),
            fw: mul_usize("feature width (features x hidden)", layer_ids.len(), c.hidden_size)?,
        };
        let (e, a) = widths;
        let mut ar = Arena::default();
        use Lifetime::{Input, Layer, Model, Saved};
        let embed = ar.take("target embedding table (shared)", Model, "embed_tokens", &[z.v, z.h], e)?;
        let lm_head = match with_lm_head && !config.tie_word_embeddings {
            true => Some(ar.take("target LM head (the drafter's, shared)", Model, "lm_head", &[z.v, z.h], e)?),
            false => None,
        };
        let qwen3 = config.arch.has_qk_norm();
        let shape = z.layer_shape();
        let layers = (0..z.layers)
            .map(|_| TargetLayerWeights::take(&mut ar, "target layer weights", shape, qwen3, e))
            .collect::<Result<Vec<_>>>()?;
        let t = z.t;
        let positions_held = decode.map_or(t, |(context, _)| context);
        const TABLES: &str = "target RoPE tables of positions 0..T (decoding: 0..C)";
        let cos_table = ar.take(TABLES, Model, "cos table", &[positions_held, z.d], a)?;
        let sin_table = ar.take(TABLES, Model, "sin table", &[positions_held, z.d], a)?;
        const INPUTS: &str = "target inputs (tokens, RoPE tables, feature rows)";
        let tokens = ar.take(INPUTS, Saved, "tokens", &[t], 4)?;
        let positions = ar.take(INPUTS, Saved, "positions", &[t], 4)?;
        let cos = ar.take(INPUTS, Saved, "cos", &[t, z.d], a)?;
        let sin = ar.take(INPUTS, Saved, "sin", &[t, z.d], a)?;
        let feature_rows = (0..z.f).map(|_| ar.take(INPUTS, Saved, "feature rows", &[t], 4)).collect::<Result<_>>()?;
        // Beside the allocation: the causal plans of each layer kind.
        let group_rows = KeyRanges::causal_group_rows(z.nh / z.nkv);
        let kinds: std::collections::HashSet<_> = c.layer_kinds[..z.layers].iter().collect();
        let plans = causal_plans_bytes(t, group_rows)?;
        ar.count("target attention key ranges", Input, bytes_of("key ranges", &[kinds.len()], plans)?);
        let x = ar.take("target residual stream", Saved, "x", &[t, z.h], e)?;
        let xn = ar.take("target normed input", Saved, "xn", &[t, z.h], e)?;
        let inv = ar.take("target normed input", Saved, "inv", &[t], a)?;
        let (attn, mlp) = ar.overlay(
            |ar| {
                let mut s =
                    |what: &str, dims: &[usize], w: u64| ar.take("target attention scratch", Layer, what, dims, w);
                Ok(AttnScratch {
                    qkv_pre: s("qkv_pre", &[t, z.qd + 2 * z.kd], e)?,
                    v: s("v", &[t, z.kd], e)?,
                    q: s("q", &[t, z.qd], e)?,
                    k: s("k", &[t, z.kd], e)?,
                    out: s("attention out", &[t, z.qd], e)?,
                    lse: s("lse", &[z.nh, t], a)?,
                    inv_q: s("inv_q", &[t, z.nh], a)?,
                    inv_k: s("inv_k", &[t, z.nkv], a)?,
                })
            },
            |ar| {
                let mut s = |what: &str, dims: &[usize]| ar.take("target MLP scratch", Layer, what, dims, e);
                Ok(MlpScratch { gate_up: s("gate_up", &[t, 2 * z.i])?, h: s("h", &[t, z.i])? })
            },
        )?;
        let features = match with_features {
            true => Some(ar.take("target features", Saved, "features", &[t, z.fw], e)?),
            false => None,
        };
        let decode = match decode {
            None => None,
            Some((context, logit_rows)) => {
                let final_norm = ar.take("target final norm", Model, "norm", &[z.h], e)?;
                let (mut k_cache, mut v_cache) = (Vec::new(), Vec::new());
                for _ in 0..z.layers {
                    k_cache.push(ar.take("target K/V cache", Saved, "k cache", &[context, z.kd], e)?);
                    v_cache.push(ar.take("target K/V cache", Saved, "v cache", &[context, z.kd], e)?);
                }
                let logits = ar.take("target logits", Layer, "logits", &[logit_rows, z.v], e)?;
                let next = ar.take("target next tokens", Saved, "next", &[logit_rows], 4)?;
                Some(DecodeRegions { context, logit_rows, final_norm, k_cache, v_cache, logits, next })
            }
        };
        Ok(TargetLayout {
            dims: z,
            embed,
            lm_head,
            layers,
            cos_table,
            sin_table,
            tokens,
            positions,
            cos,
            sin,
            feature_rows,
            x,
            xn,
            inv,
            attn,
            mlp,
            features,
            decode,
            bytes: ar.bytes(),
            items: ar.items,
        })
    }

    /// Refuses the layout before anything is allocated when it needs more than `available` bytes
    /// of `device`, naming the largest items.
    pub fn check_fits(&self, available: u64, device: &str) -> Result<()> {
        let hint = "try fewer tokens per launch, or run the target on its own GPU or offline (`xtask features`)";
        check_fits("the target", self.total_bytes()?, &self.items, available, device, hint)
    }

    /// The allocation and the key ranges beside it.
    pub fn total_bytes(&self) -> Result<u64> {
        let beside = self.items.iter().filter(|i| i.lifetime == Lifetime::Input).map(|i| i.bytes).sum();
        add("target", self.bytes, beside)
    }

    /// Bytes of the features of `tokens` tokens (what one launch writes).
    pub fn feature_bytes(&self, tokens: usize, elem: u64) -> Result<u64> {
        bytes_of("features", &[tokens, self.dims.fw], elem)
    }

    /// The layout as a table: one line per item and the total.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for item in &self.items {
            out.push_str(&format!("  {:<58} {:>12}\n", item.name, gb(item.bytes)));
        }
        out.push_str(&format!("  {:<58} {:>12}\n", "target total", gb(self.total_bytes().unwrap_or(u64::MAX))));
        out
    }
}
