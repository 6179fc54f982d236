//! Model FLOPs and the peak they are measured against (MFU = FLOPs / (time x [`PEAK_FLOPS`])):
//! the drafter's training step and the target's forward, as the benches and the trainer count
//! them.

use dflash_reference::config::{DraftConfig, TargetConfig};
use dflash_reference::hybrid::{HybridConfig, HybridLayerKind};

use crate::memory::step::StepShape;

/// Dense bf16 peak of the H200 (and H100 SXM) that MFU divides by, in FLOP/s.
pub const PEAK_FLOPS: f64 = 989e12;

/// How [`step_model_flops`] counts.
pub const STEP_FLOP_CONVENTION: &str =
    "model FLOPs of one step over the rows' document tokens and kept blocks (padding is not counted), no \
    checkpointing recompute: each trainable linear 3 x 2*rows*in*out (forward, input and weight gradients); fc 2 x \
    (features need no gradient); the frozen LM head 2 x over the rows with CE weight; attention 3.5 x \
    4*head_dim*heads*allowed pairs per layer (FlashAttention's count: its backward recomputes the scores). \
    MFU = FLOPs / (time x 989 TFLOP/s)";

/// How [`target_forward_flops`] counts.
pub const TARGET_FLOP_CONVENTION: &str =
    "model FLOPs of the forward that ran: per layer 2*T*(in*out) over q, k, v, o, gate, \
    up, down plus causal attention 4*head_dim*heads*T(T+1)/2; ours over layers 0..=max(layer ids), transformers' \
    over all layers and the LM head 2*T*H*V; MFU = FLOPs / (time x 989 TFLOP/s)";

/// Model FLOPs of one drafter step (see [`STEP_FLOP_CONVENTION`]): `weighted_rows` rows reach
/// the LM head, `pairs[l]` is layer `l`'s allowed (query, key) pairs.
pub fn step_model_flops(config: &DraftConfig, shape: StepShape, weighted_rows: usize, pairs: &[u64]) -> f64 {
    let c = &config.dims;
    let (h, i, v) = (c.hidden_size as f64, c.intermediate_size as f64, c.vocab_size as f64);
    let (qd, kd) = ((c.num_heads * c.head_dim) as f64, (c.num_kv_heads * c.head_dim) as f64);
    let q = (shape.num_anchors * config.block_size) as f64;
    let k = shape.context_len as f64 + q;
    let linear = |rows: f64, fan_in: f64, fan_out: f64| 2.0 * rows * fan_in * fan_out;
    let layer = linear(q, h, qd) + 2.0 * linear(k, h, kd) + linear(q, qd, h) + 3.0 * linear(q, h, i);
    let fc = linear(shape.context_len as f64, (config.num_features() * c.hidden_size) as f64, h);
    let lm_head = linear(weighted_rows as f64, h, v);
    let attention: f64 = pairs.iter().map(|&p| 3.5 * 4.0 * (c.head_dim * c.num_heads) as f64 * p as f64).sum();
    3.0 * layer * c.num_layers() as f64 + 2.0 * fc + 2.0 * lm_head + attention
}

/// Model FLOPs of a causal forward of one document of `t` tokens through `layers` layers, plus
/// an LM head when `lm_head` (see [`TARGET_FLOP_CONVENTION`]).
pub fn target_forward_flops(config: &TargetConfig, layers: usize, t: usize, lm_head: bool) -> f64 {
    let c = &config.dims;
    let (h, qd, kd, i) = (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size);
    let t = t as f64;
    let linears = 2.0 * t * (h * qd + 2 * h * kd + qd * h + 3 * h * i) as f64;
    let attention = 4.0 * (c.head_dim * c.num_heads) as f64 * t * (t + 1.0) / 2.0;
    let head = if lm_head { 2.0 * t * (h * c.vocab_size) as f64 } else { 0.0 };
    layers as f64 * (linears + attention) + head
}

/// Model FLOPs of a hybrid target's forward (spec section 10) of one document of `t` tokens
/// through its first `layers` layers, no LM head: per layer the SwiGLU 2*T*3*H*I and the mixer's
/// linears 2*T*(in*out) (GatedDeltaNet: in_proj qkv, z, b, a and out_proj; gated attention: q_proj
/// with its gate, k, v, o) plus the GatedDeltaNet's delta rule 6*d_k*d_v per value head and token
/// (read, update and query the state) or the causal attention 4*head_dim*heads*T(T+1)/2.
pub fn hybrid_forward_flops(config: &HybridConfig, layers: usize, t: usize) -> f64 {
    let (h, i, g) = (config.hidden_size, config.intermediate_size, &config.gdn);
    let (qd, kd) = (config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim);
    let tf = t as f64;
    let mlp = 2.0 * tf * (3 * h * i) as f64;
    let gdn_linears = (g.conv_dim() + g.value_dim() + 2 * g.num_value_heads) * h + g.value_dim() * h;
    let gdn = 2.0 * tf * gdn_linears as f64 + 6.0 * tf * (g.num_value_heads * g.key_head_dim * g.value_head_dim) as f64;
    let attention = 2.0 * tf * (2 * qd * h + 2 * kd * h + qd * h) as f64
        + 4.0 * (config.head_dim * config.num_heads) as f64 * tf * (tf + 1.0) / 2.0;
    config.layer_kinds[..layers.min(config.num_layers())]
        .iter()
        .map(|k| {
            mlp + match k {
                HybridLayerKind::Linear => gdn,
                HybridLayerKind::Full => attention,
            }
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::named::named_configs;

    /// The FLOP count reproduces GPU.md's (the project's H200 notes) 73.4 model TFLOP of the
    /// Qwen3-8B drafter step (S=3072, N=512, LM head over all 8192 rows, attention at its anchor
    /// table's density).
    #[test]
    fn model_flops_of_the_named_step_match_gpu_md() {
        let named = named_configs().into_iter().next().unwrap();
        let q = named.shape.num_anchors * named.config.block_size;
        // Allowed pairs of the S=3072 N=512 anchor case: density 0.138 of 8192 x 11264 (GPU.md).
        let pairs = (0.138 * (q * (named.shape.context_len + q)) as f64) as u64;
        let tflop = step_model_flops(&named.config, named.shape, q, &[pairs; 5]) / 1e12;
        assert!((tflop - 73.4).abs() < 0.2, "{tflop:.2} TFLOP, GPU.md says 73.4");
    }
}
