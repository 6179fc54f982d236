//! The fused attention under the DFlash mask and causal attention (spec section 2): the key
//! ranges each row group sees ([`ranges`], O(groups) metadata), the CPU twin of the kernels
//! ([`twin`]), the CUDA launcher ([`cuda`]) and the kernels (`attention.cu`). Never a dense mask,
//! a score matrix or K/V expanded to the query heads.

pub mod cuda;
pub mod ranges;
pub mod twin;

/// Heads and head size of one call; query head `h` reads K/V head `h / (num_heads / num_kv_heads)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}
