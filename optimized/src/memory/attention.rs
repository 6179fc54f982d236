//! Bytes of the fused attention: its key ranges on the device, what one forward + backward
//! allocates beyond its inputs on the GPU, and the CPU twin's heap ceilings. (The kernels' shared
//! memory per CTA is part of their launch: `ops::attention::cuda`.)

use super::{bytes_of, F32};
use crate::ops::attention::ranges::KeyRanges;
use crate::ops::attention::twin::AttnShape;
use crate::ops::constants::TILE_K;
use crate::Result;

/// Bytes of one layer kind's key ranges on the device: a 6-u32 row group per block and a 2-u32
/// range per KV tile of the `keys` keys (`ops::attention::cuda::DeviceKeyRanges`).
pub fn key_ranges_bytes(blocks: usize, keys: usize) -> Result<u64> {
    let groups = bytes_of("key ranges: row groups", &[blocks, 6], F32)?;
    let tiles = bytes_of("key ranges: KV tiles", &[keys.div_ceil(TILE_K), 2], F32)?;
    super::add("key ranges", groups, tiles)
}

/// Bytes of a target's causal key ranges for launches of `t` tokens with row groups of
/// `group_rows` query rows: the causal plan of each document length, at most one row group and
/// one KV tile more per document than one plan of `t` (documents <= `t`).
pub fn causal_plans_bytes(t: usize, group_rows: usize) -> Result<u64> {
    let too_many = || crate::Error::invalid("key ranges", format!("{t} tokens per launch exceed the address space"));
    let blocks = t.div_ceil(group_rows).checked_add(t).ok_or_else(too_many)?;
    let keys = t.div_ceil(TILE_K).checked_add(t).and_then(|n| n.checked_mul(TILE_K)).ok_or_else(too_many)?;
    key_ranges_bytes(blocks, keys)
}

/// What one forward + backward allocates on the GPU beyond its inputs: out and dq
/// (`[Q, nh, d]` bf16), dk and dv (`[K, nkv, d]` bf16), lse and dsum (`[nh, Q]` f32). The
/// kernels allocate nothing else: no score matrix, no mask, no expanded K/V.
pub fn cuda_extra_bytes(ranges: &KeyRanges, shape: AttnShape) -> u64 {
    let (nq, nk, d) = (ranges.num_queries as u64, ranges.num_keys as u64, shape.head_dim as u64);
    let (nh, nkv) = (shape.num_heads as u64, shape.num_kv_heads as u64);
    2 * (2 * nq * nh * d) + 2 * (2 * nk * nkv * d) + 2 * (4 * nh * nq)
}

/// The heap ceiling of the twin's forward for values of `elem_bytes`: out `[Q, nh, d]` and lse
/// `[nh, Q]`, plus one row group's running max, sum and accumulator (`group_rows * nh/nkv`
/// rows). No `[Q, K]` buffer, no expanded K/V.
pub fn twin_forward_bytes(ranges: &KeyRanges, shape: AttnShape, elem_bytes: usize) -> usize {
    let AttnShape { num_heads: nh, num_kv_heads: nkv, head_dim: d } = shape;
    let rows = ranges.group_rows * (nh / nkv);
    elem_bytes * (ranges.num_queries * nh * d + nh * ranges.num_queries + rows * (2 + d))
}

/// The heap ceiling of the twin's backward: dsum `[nh, Q]`, dq `[Q, nh, d]`, dk and dv
/// `[K, nkv, d]`, and the inverse ranges (two u32 per KV tile).
pub fn twin_backward_bytes(ranges: &KeyRanges, shape: AttnShape, elem_bytes: usize) -> usize {
    let AttnShape { num_heads: nh, num_kv_heads: nkv, head_dim: d } = shape;
    let (nq, nk) = (ranges.num_queries, ranges.num_keys);
    elem_bytes * (nh * nq + nq * nh * d + 2 * nk * nkv * d) + 8 * nk.div_ceil(TILE_K)
}

/// Heap bytes the Host backend's attention allocates beyond the step's layout, at its largest
/// (forward or backward): copies of its stored inputs in the arithmetic type (`acc_bytes`) and
/// the twin's own ceiling.
pub fn host_attention_bytes(ranges: &KeyRanges, shape: AttnShape, acc_bytes: usize) -> u64 {
    let (nq, nk) = (ranges.num_queries, ranges.num_keys);
    let (q, kv) = (nq * shape.num_heads * shape.head_dim, nk * shape.num_kv_heads * shape.head_dim);
    let forward = acc_bytes * (q + 2 * kv) + twin_forward_bytes(ranges, shape, acc_bytes);
    let backward = acc_bytes * (3 * q + 2 * kv) + twin_backward_bytes(ranges, shape, acc_bytes);
    forward.max(backward) as u64
}
