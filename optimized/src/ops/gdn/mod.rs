//! The GatedDeltaNet token mixer of the hybrid target (spec section 10) on raw addresses (host
//! pointers for the CPU twins of [`twin`]; no kernel yet): the depthwise causal conv1d + SiLU,
//! the gates `beta` and `g`, the gated delta rule in chunks of [`GDN_CHUNK`] (the WY / UT form)
//! and the gated output norm; and the gated attention's two ops the elementwise kernels lack
//! (partial RoPE, the sigmoid output gate). "Stored" values are the backend's element type (`Elem`); the gates,
//! the state and the chunk scratch are its arithmetic type (`Elem::Acc`). Packed rows come as
//! documents: token ranges tiling `0..T`, each of which restarts the conv window and the state.

pub mod twin;

use std::ops::Range;

use dflash_reference::hybrid::config::GdnDims;

pub use crate::memory::hybrid::GDN_CHUNK;
use crate::ops::elementwise::Heads;
use crate::{Error, Result};

/// Sizes of one GatedDeltaNet call: `tokens` T, `H_k` key heads of `d_k` (queries share them),
/// `H_v` value heads of `d_v` (a multiple of `H_k`), conv kernel `K`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnShape {
    pub tokens: usize,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub conv_kernel: usize,
}

impl GdnShape {
    /// The shape of a layer of `dims` over `tokens` tokens.
    pub fn new(dims: &GdnDims, tokens: usize) -> Self {
        GdnShape {
            tokens,
            key_heads: dims.num_key_heads,
            value_heads: dims.num_value_heads,
            key_head_dim: dims.key_head_dim,
            value_head_dim: dims.value_head_dim,
            conv_kernel: dims.conv_kernel,
        }
    }

    /// `H_k * d_k`: the width of q and of k in the conv's output.
    pub fn key_dim(&self) -> usize {
        self.key_heads * self.key_head_dim
    }

    /// `H_v * d_v`: the width of v, z and the output.
    pub fn value_dim(&self) -> usize {
        self.value_heads * self.value_head_dim
    }

    /// The conv channels `C = 2 H_k d_k + H_v d_v`: q, k, v in that order.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Values of the chunk scratch `[H_v, ceil(T/C) C, C + d_k + d_v]` and of the state
    /// `[H_v, d_k, d_v]`, in the arithmetic type, as `memory::hybrid` plans them.
    pub fn scratch_values(&self) -> (usize, usize) {
        let rows = self.tokens.div_ceil(GDN_CHUNK) * GDN_CHUNK;
        let per_row = GDN_CHUNK + self.key_head_dim + self.value_head_dim;
        (self.value_heads * rows * per_row, self.value_heads * self.key_head_dim * self.value_head_dim)
    }

    /// Refuses empty sizes and `H_v` not a multiple of `H_k`.
    pub fn check(&self) -> Result<()> {
        let sizes =
            [self.tokens, self.key_heads, self.value_heads, self.key_head_dim, self.value_head_dim, self.conv_kernel];
        if sizes.contains(&0) {
            return Err(Error::invalid("GdnShape", format!("{self:?} has an empty size")));
        }
        if !self.value_heads.is_multiple_of(self.key_heads) {
            return Err(Error::invalid(
                "GdnShape",
                format!("{} value heads are not a multiple of {} key heads", self.value_heads, self.key_heads),
            ));
        }
        Ok(())
    }

    /// [`GdnShape::check`], and refuses `docs` that do not tile `0..T` with non-empty ranges in
    /// order.
    pub fn check_docs(&self, docs: &[Range<usize>]) -> Result<()> {
        self.check()?;
        let mut end = 0;
        for doc in docs {
            if doc.start != end || doc.end <= doc.start {
                return Err(Error::invalid("docs", format!("{docs:?} do not tile 0..{} in order", self.tokens)));
            }
            end = doc.end;
        }
        if end != self.tokens {
            return Err(Error::invalid("docs", format!("{docs:?} do not tile 0..{} in order", self.tokens)));
        }
        Ok(())
    }
}

/// The chunked delta rule's scratch, arithmetic type, sizes from [`GdnShape::scratch_values`]:
/// `chunk` (per value head, row `t` holds token `t`'s row, within its chunk, of the UT inverse
/// `(I + A)^-1` and then of the decayed `Q K^T` `[C]`, of W `[d_k]`, and of U and then Delta
/// `[d_v]`) and `state` `[H_v, d_k, d_v]`.
#[derive(Clone, Copy, Debug)]
pub struct DeltaScratch {
    pub chunk: u64,
    pub state: u64,
}

/// Inputs and output of [`GdnOps::gated_delta`]: `qkv [T, C]` (stored: the conv's output, q
/// then k then v channels), `beta`, `g` `[T, H_v]` (arithmetic type) and `out [T, H_v, d_v]`.
#[derive(Clone, Copy, Debug)]
pub struct DeltaBuffers {
    pub qkv: u64,
    pub beta: u64,
    pub g: u64,
    pub out: u64,
}

/// Inputs of [`GdnOps::gdn_gates`]: the projections `b`, `a` `[T, H_v]` and the weights
/// `A_log`, `dt_bias` `[H_v]` (stored).
#[derive(Clone, Copy, Debug)]
pub struct GateInputs {
    pub b: u64,
    pub a: u64,
    pub a_log: u64,
    pub dt_bias: u64,
}

/// The hybrid target's ops without a kernel yet: `twin::GdnTwin` on the CPU. Every GatedDeltaNet
/// call checks `shape` (and `docs`).
pub trait GdnOps {
    /// `y [T, C] = silu(conv(x))`: the depthwise causal conv over time of `x [T, C]` with taps
    /// `w [C, K]` (tap `K-1` on the current token), zero left padding from each document's start.
    /// `y` must not overlap `x`.
    fn conv1d_silu(&self, x: u64, w: u64, y: u64, shape: GdnShape, docs: &[Range<usize>]) -> Result<()>;

    /// `beta [T, H_v] = sigmoid(b)`, `g [T, H_v] = -exp(A_log) * softplus(a + dt_bias)`
    /// (arithmetic type).
    fn gdn_gates(&self, inp: GateInputs, beta: u64, g: u64, shape: GdnShape) -> Result<()>;

    /// The gated delta rule in chunks of [`GDN_CHUNK`] (each document chunked from its own start,
    /// the state zero there): per value head `h` (key head `h / (H_v / H_k)`), q and k L2-normed
    /// (eps [`dflash_reference::hybrid::gdn::L2_NORM_EPS`]), q scaled by `d_k^-0.5`.
    fn gated_delta(&self, b: DeltaBuffers, s: DeltaScratch, shape: GdnShape, docs: &[Range<usize>]) -> Result<()>;

    /// `y [T, H_v, d_v] = rms_norm(o) * w * silu(z)` per head, with `o`, `z` `[T, H_v, d_v]` and
    /// `w [d_v]`; `y` may be `o`.
    fn gated_rms_norm(&self, o: u64, z: u64, w: u64, y: u64, shape: GdnShape, eps: f64) -> Result<()>;

    /// `y [T, heads, d]`: RoPE (rotate-half) on the first `rotary` dims of each head with the
    /// tables `cos`, `sin` `[T, rotary]` (arithmetic type), the other dims copied; `y` may be `x`.
    /// Refuses an odd `rotary` or one above `d`.
    fn partial_rope(&self, x: u64, cos: u64, sin: u64, y: u64, dims: Heads, rotary: usize) -> Result<()>;

    /// `y [n] = x * sigmoid(gate)` (the gated attention's output gate); `y` may be `x`.
    fn output_gate(&self, x: u64, gate: u64, y: u64, n: usize) -> Result<()>;
}
