//! The memory of a Qwen3.5/3.6 hybrid target's forward (spec section 10), planned before any GPU
//! forward of it exists: its weights (the embedding table, layers `0..=max(target_layer_ids)`
//! of either kind, the untied LM head the drafter shares), one layer's activations for a launch of
//! `T` tokens (the larger of a GatedDeltaNet layer's and a gated attention layer's, each
//! overlaid with the MLP's), the GatedDeltaNet's fp32 state and its chunked form's scratch, and
//! the feature buffer `[T, F*H]`; and the drafter such a target gets (spec sections 1 and 10).
//!
//! Shapes: T tokens, H hidden, I SwiGLU, V vocab; GDN: H_k/H_v heads of d_k/d_v, conv channels
//! `2 H_k d_k + H_v d_v`, chunks of C; attention: nh/nkv heads of d, q_proj also the gate.

use dflash_reference::config::{default_target_layer_ids, AttnKind, DraftConfig, ModelDims};
use dflash_reference::hybrid::{hybrid_param_shapes, HybridConfig, HybridLayerKind};

use super::{add, check_fits, gb, Arena, Item, Lifetime};
use crate::{Error, Result};

/// Rows per chunk of the chunked GatedDeltaNet forward (the WY/UT form).
pub const GDN_CHUNK: usize = 64;

/// The planned memory of a hybrid target's forward, itemised.
#[derive(Clone, Debug)]
pub struct HybridTargetPlan {
    /// Layers run: `max(target_layer_ids) + 1`.
    pub layers: usize,
    pub tokens: usize,
    pub bytes: u64,
    pub items: Vec<Item>,
}

impl HybridTargetPlan {
    /// The plan of `config` tapping `layer_ids` for launches of `tokens` tokens of one sequence,
    /// storing `widths = (stored, arithmetic)` bytes per value.
    pub fn new(config: &HybridConfig, layer_ids: &[usize], tokens: usize, widths: (u64, u64)) -> Result<Self> {
        let last = *layer_ids.iter().max().ok_or_else(|| Error::invalid("target_layer_ids", "is empty"))?;
        if last >= config.num_layers() {
            return Err(Error::invalid(
                "target_layer_ids",
                format!("layer {last} is out of range for a target of {} layers", config.num_layers()),
            ));
        }
        if tokens == 0 {
            return Err(Error::invalid("tokens", "a launch needs at least 1 token"));
        }
        let (e, a) = widths;
        let (t, h, i) = (tokens, config.hidden_size, config.intermediate_size);
        let mut ar = Arena::default();
        use Lifetime::{Layer, Model, Saved};
        // Weights: what the forward reads (the final norm is never run).
        let ran = |name: &str| match name.strip_prefix("model.layers.") {
            Some(rest) => rest.split('.').next().and_then(|l| l.parse::<usize>().ok()).is_some_and(|l| l <= last),
            None => name == "model.embed_tokens.weight" || name == "lm_head.weight",
        };
        for (name, shape) in hybrid_param_shapes(config).into_iter().filter(|(n, _)| ran(n)) {
            let item = match name.as_str() {
                "model.embed_tokens.weight" => "target embedding table (shared)",
                "lm_head.weight" => "target LM head (the drafter's, shared)",
                n if n.contains(".linear_attn.") => "target GatedDeltaNet weights",
                n if n.contains(".self_attn.") => "target gated attention weights",
                _ => "target MLP and norm weights",
            };
            ar.take(item, Model, &name, &shape, e)?;
        }
        let f = layer_ids.len();
        ar.take("target residual stream and normed input", Saved, "x, xn", &[2, t, h], e)?;
        ar.take("target features", Saved, "features", &[t, f * h], e)?;
        let g = &config.gdn;
        let kinds: Vec<HybridLayerKind> = config.layer_kinds[..=last].to_vec();
        let (d, nh, nkv) = (config.head_dim, config.num_heads, config.num_kv_heads);
        ar.overlay(
            |ar| {
                ar.overlay(
                    |ar| {
                        if !kinds.contains(&HybridLayerKind::Linear) {
                            return Ok(());
                        }
                        const GDN: &str = "target GatedDeltaNet scratch (one layer)";
                        ar.take(GDN, Layer, "qkv before and after the conv", &[2, t, g.conv_dim()], e)?;
                        ar.take(GDN, Layer, "z, and the gated output", &[2, t, g.value_dim()], e)?;
                        ar.take(GDN, Layer, "beta and g", &[2, t, g.num_value_heads], a)?;
                        // The chunked form keeps, per head and chunk, the C x C decay-weighted
                        // k k^T inverse and the chunk's W and U rows (fp32).
                        let chunk_rows = t.div_ceil(GDN_CHUNK) * GDN_CHUNK;
                        let per_row = GDN_CHUNK + g.key_head_dim + g.value_head_dim;
                        ar.take(GDN, Layer, "chunk scratch", &[g.num_value_heads, chunk_rows, per_row], a)?;
                        ar.take(GDN, Layer, "state", &[g.num_value_heads, g.key_head_dim, g.value_head_dim], a)?;
                        Ok(())
                    },
                    |ar| {
                        if !kinds.contains(&HybridLayerKind::Full) {
                            return Ok(());
                        }
                        const ATT: &str = "target gated attention scratch (one layer)";
                        ar.take(ATT, Layer, "q and gate", &[t, 2 * nh * d], e)?;
                        ar.take(ATT, Layer, "k, v", &[2, t, nkv * d], e)?;
                        ar.take(ATT, Layer, "q normed and rotated, attention out", &[2, t, nh * d], e)?;
                        ar.take(ATT, Layer, "lse", &[nh, t], a)?;
                        Ok(())
                    },
                )
            },
            |ar| ar.take("target MLP scratch (one layer)", Layer, "gate_up, h", &[t, 3 * i], e).map(|_| ()),
        )?;
        Ok(HybridTargetPlan { layers: last + 1, tokens, bytes: ar.bytes(), items: ar.items })
    }

    /// Refuses the plan when it needs more than `available` bytes of `device`, naming the largest
    /// items.
    pub fn check_fits(&self, available: u64, device: &str) -> Result<()> {
        let hint = "run the target on its own GPUs (`--target-gpus`) or offline (`xtask features`)";
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

/// The sliding window of the hybrid targets' drafters (spec section 1: 2048).
pub const HYBRID_DRAFTER_WINDOW: usize = 2048;
/// The drafters' own RoPE theta for hybrid targets (spec section 10: 1e7, full RoPE).
pub const HYBRID_DRAFTER_ROPE_THETA: f64 = 1e7;

/// The drafter of a hybrid target as published (spec sections 1 and 10): a Qwen3-layout stack of
/// 4 sliding layers (window 2048) and 1 full, heads of 128 (hidden / 128 query heads, 8 K/V
/// heads), the target's hidden size, SwiGLU size and vocab, its own RoPE theta 1e7, block 16,
/// features from the 5-feature layer rule.
pub fn hybrid_drafter(config: &HybridConfig, mask_token_id: u32) -> Result<DraftConfig> {
    let head_dim = 128;
    if !config.hidden_size.is_multiple_of(head_dim) {
        return Err(Error::invalid(
            "hidden_size",
            format!("{}: not a multiple of the drafter's heads of {head_dim}", config.hidden_size),
        ));
    }
    let mut layer_kinds = vec![AttnKind::Sliding { window: HYBRID_DRAFTER_WINDOW }; 4];
    layer_kinds.push(AttnKind::Full);
    Ok(DraftConfig {
        dims: ModelDims {
            hidden_size: config.hidden_size,
            intermediate_size: config.intermediate_size,
            num_heads: config.hidden_size / head_dim,
            num_kv_heads: 8,
            head_dim,
            vocab_size: config.vocab_size,
            rms_norm_eps: config.rms_norm_eps,
            rope_theta: HYBRID_DRAFTER_ROPE_THETA,
            max_position_embeddings: config.max_position_embeddings,
            layer_kinds,
        },
        block_size: 16,
        num_target_layers: config.num_layers(),
        mask_token_id,
        target_layer_ids: default_target_layer_ids(config.num_layers(), 5),
    })
}
