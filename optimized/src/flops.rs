//! Model FLOPs and the peak they are measured against (MFU = FLOPs / (time x [`PEAK_FLOPS`])):
//! the drafter's training step and the target's forward, as the benches and the trainer count
//! them.

use dflash_reference::config::{DraftConfig, TargetConfig};

use crate::memory::step::StepShape;

/// Dense bf16 peak of the H200 (and H100 SXM) that MFU divides by, in FLOP/s.
pub const PEAK_FLOPS: f64 = 989e12;

/// How [`step_model_flops`] counts.
pub const STEP_FLOP_CONVENTION: &str =
    "model FLOPs of one step, no recompute: each trainable linear 3 x 2*rows*in*out \
    (forward, input and weight gradients); fc 2 x (features need no gradient); the frozen LM head 2 x over the \
    rows with CE weight; attention 3.5 x 4*head_dim*heads*allowed pairs per layer. MFU = FLOPs / (time x 989 TFLOP/s)";

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
