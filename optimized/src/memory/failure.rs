//! Peaks of the known failure modes (spec section 5, items 6 and 7), for comparison with a plan.

use super::step::{StepDims, StepShape};
use super::{bytes_of, BF16};
use crate::Result;
use dflash_reference::config::DraftConfig;

/// Peak bytes of the known failure modes at `shape`, for comparison with a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailureModes {
    /// Eager attention materialising `[heads, Q, K]` scores per layer for the backward: fp32
    /// scores, fp32 probabilities and their bf16 copy kept by autograd, the boolean mask, and
    /// fp32 gradients of probabilities and scores in the backward (19 bytes per score).
    pub unfused_attention_one_layer: u64,
    /// Chunked attention without checkpointing: every query chunk of `chunk_rows` rows keeps its
    /// K and V expanded to all query heads (`[heads, K, d]` bf16 each) until the backward, in
    /// every layer.
    pub chunked_attention_all_layers: u64,
    pub chunk_rows: usize,
}

/// Bytes per score element of eager attention (see [`FailureModes::unfused_attention_one_layer`]).
const EAGER_BYTES_PER_SCORE: u64 = 4 + 4 + 2 + 1 + 4 + 4;

/// The failure modes' peaks for `config` at `shape`, chunked attention in chunks of `chunk_rows`.
pub fn failure_modes(config: &DraftConfig, shape: StepShape, chunk_rows: usize) -> Result<FailureModes> {
    let z = StepDims::new(config, shape)?;
    let chunks = z.q.div_ceil(chunk_rows.max(1));
    Ok(FailureModes {
        unfused_attention_one_layer: bytes_of("eager attention scores", &[z.nh, z.q, z.k], EAGER_BYTES_PER_SCORE)?,
        chunked_attention_all_layers: bytes_of("chunked attention K/V", &[z.layers, chunks, 2, z.nh, z.k, z.d], BF16)?,
        chunk_rows,
    })
}
