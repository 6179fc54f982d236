//! The GatedDeltaNet token mixer of the hybrid target (spec section 10) on raw addresses (host
//! pointers for the CPU twins of [`twin`], device addresses for the kernels of [`cuda`],
//! `gdn.cu`): the depthwise causal conv1d + SiLU,
//! the gates `beta` and `g`, the gated delta rule in chunks of [`GDN_CHUNK`] (the WY / UT form)
//! and the gated output norm; and the gated attention's two ops the elementwise kernels lack
//! (partial RoPE, the sigmoid output gate). "Stored" values are the backend's element type (`Elem`); the gates,
//! the state and the chunk scratch are its arithmetic type (`Elem::Acc`). Packed rows come as
//! documents: token ranges tiling `0..T`, each of which restarts the conv window and the state.

pub mod cuda;
pub mod twin;

use std::ops::Range;

use dflash_reference::hybrid::config::GdnDims;

pub use crate::ops::constants::GDN_CHUNK;
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

    /// Chunks a delta-rule launch runs at most (a group): the chunks of `T` tokens in one segment.
    pub fn state_slots(&self) -> usize {
        self.tokens.div_ceil(GDN_CHUNK).max(1)
    }

    /// Values of the delta rule's scratch, as `memory::hybrid` plans them: see [`DeltaScratch`].
    pub fn scratch_values(&self) -> DeltaScratchValues {
        let (hv, t, dk, dv) = (self.value_heads, self.tokens, self.key_head_dim, self.value_head_dim);
        DeltaScratchValues {
            w: hv * t * dk,
            u: hv * t * dv,
            states: hv * self.state_slots() * dk * dv,
            carry: hv * dk * dv,
        }
    }

    /// Refuses empty sizes, `H_v` not a multiple of `H_k`, and sizes whose scratch
    /// ([`GdnShape::scratch_values`]) or conv channels exceed the address space.
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
        let (hv, t, dk, dv) = (self.value_heads, self.tokens, self.key_head_dim, self.value_head_dim);
        let products = [
            hv.checked_mul(t).and_then(|n| n.checked_mul(dk.max(dv))),
            hv.checked_mul(self.state_slots()).and_then(|n| n.checked_mul(dk)).and_then(|n| n.checked_mul(dv)),
            self.key_heads
                .checked_mul(dk)
                .and_then(|k| k.checked_mul(2))
                .zip(hv.checked_mul(dv))
                .and_then(|(k, v)| k.checked_add(v)),
        ];
        if products.contains(&None) {
            return Err(Error::invalid(
                "GdnShape",
                format!("{self:?}: the delta rule's buffers exceed the address space"),
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

/// The segments of one GatedDeltaNet launch: `ranges` tile `0..T` in order, each restarting the
/// conv window and the state, except that with `resume` the delta rule's first segment continues
/// the state in the carry (decoding: the tokens after a cached state); `table` is the address of
/// their [`segment_table`] (u32 `[4T]`, uploaded by the caller, made with the same `resume`),
/// which the kernels read and the twins do not.
#[derive(Clone, Copy, Debug)]
pub struct Segments<'a> {
    pub ranges: &'a [Range<usize>],
    pub table: u64,
    pub resume: bool,
}

impl Segments<'_> {
    /// Whether the delta rule's state restarts at chunk start `t` (a segment's start, but not the
    /// first one's when resuming).
    pub fn restarts_at(&self, t: usize) -> bool {
        !(self.resume && t == 0) && self.ranges.binary_search_by_key(&t, |r| r.start).is_ok()
    }
}

/// One segment over all `tokens` tokens: a decoding launch's (one sequence).
pub fn one_segment(tokens: usize) -> [Range<usize>; 1] {
    [Range { start: 0, end: tokens }]
}

/// Values of the segment table of a launch of `tokens` tokens.
pub fn segment_table_len(tokens: usize) -> usize {
    4 * tokens
}

/// The chunks of [`GDN_CHUNK`] tokens of `ranges`, each segment chunked from its own start.
pub fn chunks(ranges: &[Range<usize>]) -> impl Iterator<Item = Range<usize>> + '_ {
    ranges.iter().flat_map(|r| r.clone().step_by(GDN_CHUNK).map(move |b| b..(b + GDN_CHUNK).min(r.end)))
}

/// The groups of at most [`GdnShape::state_slots`] consecutive chunks (indices into [`chunks`])
/// that the delta-rule launches of `ranges` run, in order.
pub fn groups(ranges: &[Range<usize>], shape: GdnShape) -> impl Iterator<Item = Range<usize>> {
    let (count, slots) = (chunks(ranges).count(), shape.state_slots());
    (0..count).step_by(slots).map(move |first| first..(first + slots).min(count))
}

/// Refuses a `group` of chunks that is empty, beyond the chunks of `ranges` or longer than
/// [`GdnShape::state_slots`].
pub fn check_group(ranges: &[Range<usize>], group: &Range<usize>, shape: GdnShape) -> Result<()> {
    let count = chunks(ranges).count();
    if group.is_empty() || group.end > count || group.len() > shape.state_slots() {
        return Err(Error::invalid(
            "chunk group",
            format!("{group:?}: must be non-empty, within the {count} chunks and at most {} long", shape.state_slots()),
        ));
    }
    Ok(())
}

/// The device table of `ranges` tiling `0..tokens`: per token the start of its segment `[T]`,
/// then each of [`chunks`] as `(begin, end, 1 if its state restarts)` (at a segment's start but
/// the first's under `resume`, as [`Segments::restarts_at`]), zero-padded to
/// [`segment_table_len`] values.
pub fn segment_table(ranges: &[Range<usize>], tokens: usize, resume: bool) -> Vec<u32> {
    let mut table = vec![0u32; segment_table_len(tokens)];
    for r in ranges {
        table[r.clone()].iter_mut().for_each(|s| *s = r.start as u32);
    }
    for (i, c) in chunks(ranges).enumerate() {
        let starts = table[c.start] as usize == c.start && !(resume && c.start == 0);
        table[tokens + 3 * i..tokens + 3 * i + 3].copy_from_slice(&[c.start as u32, c.end as u32, starts as u32]);
    }
    table
}

/// The chunked delta rule's scratch (per value head): `w [T, d_k]` (stored type: row `t` token
/// `t`'s row of W, an operand of the chunk's products), `u [T, d_v]` (arithmetic type: U, then
/// Delta = U - W S), `states [state_slots, d_k, d_v]` (stored type: slot `i` the state entering
/// chunk `i` of the group, an operand of the output's products) and `carry [d_k, d_v]`
/// (arithmetic type: the state carried through the chunks and from one group to the next).
#[derive(Clone, Copy, Debug)]
pub struct DeltaScratch {
    pub w: u64,
    pub u: u64,
    pub states: u64,
    pub carry: u64,
}

/// Values of each region of a [`DeltaScratch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaScratchValues {
    pub w: usize,
    pub u: usize,
    pub states: usize,
    pub carry: usize,
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

/// The hybrid target's ops: `twin::GdnTwin` on the CPU, `cuda::GdnKernels` on the GPU. Every
/// GatedDeltaNet call checks `shape` (and `docs`).
pub trait GdnOps {
    /// Refuses a shape the ops cannot run (the kernels' head dims), before any work.
    fn check_shape(&self, shape: GdnShape) -> Result<()>;

    /// `y [T, C] = silu(conv(x))`: the depthwise causal conv over time of `x [T, C]` with taps
    /// `w [C, K]` (tap `K-1` on the current token), zero left padding from each document's start.
    /// `y` must not overlap `x`.
    fn conv1d_silu(&self, x: u64, w: u64, y: u64, shape: GdnShape, docs: Segments<'_>) -> Result<()>;

    /// `beta [T, H_v] = sigmoid(b)`, `g [T, H_v] = -exp(A_log) * softplus(a + dt_bias)`
    /// (arithmetic type).
    fn gdn_gates(&self, inp: GateInputs, beta: u64, g: u64, shape: GdnShape) -> Result<()>;

    /// The gated delta rule over the chunks `group` of [`chunks`] of `docs` (see [`groups`]; each
    /// document chunked from its own start), per value head `h` (key head `h / (H_v / H_k)`),
    /// q and k L2-normed (eps [`dflash_reference::hybrid::gdn::L2_NORM_EPS`]), q scaled by
    /// `d_k^-0.5`. The state enters from the carry, zero where a chunk starts its document (not
    /// the first under `docs.resume`), and leaves into it: the groups of a launch run in order.
    fn gated_delta(
        &self,
        b: DeltaBuffers,
        s: DeltaScratch,
        shape: GdnShape,
        docs: Segments<'_>,
        group: Range<usize>,
    ) -> Result<()>;

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
