//! The memory of the drafter at inference (spec section 4): its weights (stored), a K/V cache
//! per layer holding the context's keys and values (the committed positions' projected features)
//! followed by the `B` slots of the block drafted now, and the scratch of one block and of one
//! append of up to `M` context rows, as a typed layout over one allocation
//! (`model::drafter_decode` consumes it). The embedding table and the LM head are the target's.
//! An append's normed rows end where the block's normed rows begin, so that a draft projects the
//! rows appended with it and its block into keys and values in one pass per layer.
//!
//! Shapes: H hidden, I SwiGLU, nh/nkv heads of d, F*H feature width, V vocab, B block, C context.

use dflash_reference::config::DraftConfig;

use super::target::{LayerShape, TargetLayerWeights};
use super::{add, bytes_of, check_fits, mul_usize, Arena, Item, Lifetime, Region};
use crate::{Error, Result};

/// Sizes of the drafter at inference, checked.
#[derive(Clone, Copy, Debug)]
pub struct DrafterDecodeDims {
    pub h: usize,
    pub i: usize,
    pub nh: usize,
    pub nkv: usize,
    pub d: usize,
    pub qd: usize,
    pub kd: usize,
    pub v: usize,
    /// Feature width `F*H`.
    pub fw: usize,
    /// Block size `B`.
    pub b: usize,
    /// Context positions the caches hold (`C`), the block's slots excluded.
    pub c: usize,
    /// Context rows one append takes (`M`).
    pub m: usize,
}

impl DrafterDecodeDims {
    /// The sizes of one of the drafter's layers.
    pub fn layer_shape(&self) -> LayerShape {
        LayerShape { h: self.h, i: self.i, qd: self.qd, kd: self.kd, d: self.d }
    }
}

/// The key scratch of `rows` tokens through a layer (a context append, or a draft's appended
/// rows and block); their positions are consecutive, so their RoPE tables are rows of the
/// position tables.
#[derive(Clone, Copy, Debug)]
pub struct RowsScratch {
    pub k_pre: Region,
    pub inv_k: Region,
}

/// The drafter's typed layout at inference.
#[derive(Clone, Debug)]
pub struct DrafterDecodeLayout {
    pub dims: DrafterDecodeDims,
    /// `fc [H, F*H]`, `hidden_norm [H]`, the final `norm [H]`.
    pub fc: Region,
    pub hidden_norm: Region,
    pub norm: Region,
    pub layers: Vec<TargetLayerWeights>,
    /// The RoPE tables of positions `0..C+B` `[C+B, d]` (arithmetic type), made once.
    pub cos_table: Region,
    pub sin_table: Region,
    /// Per layer, keys (after norm and RoPE) and values `[C+B, nkv*d]`.
    pub k_cache: Vec<Region>,
    pub v_cache: Vec<Region>,
    /// A context append of `n <= M` rows: the projected features `[M, H]` (rows `0..n`), normed
    /// into the last `n` rows of `ctx [M, H]` (`inv [M]`), which `xn` follows.
    pub append: RowsScratch,
    pub ctx_pre: Region,
    pub ctx: Region,
    pub ctx_inv: Region,
    /// The block: token ids (u32 `[B]`: the bonus, then the mask id), residual `x [B, H]`, normed
    /// `xn [B, H]` (right after `ctx`), `inv [B]`; its key scratch holds `2B` rows (up to `B`
    /// appended rows and the block).
    pub block: RowsScratch,
    pub tokens: Region,
    pub x: Region,
    pub xn: Region,
    pub inv: Region,
    pub q_pre: Region,
    pub q: Region,
    pub inv_q: Region,
    pub out: Region,
    pub lse: Region,
    pub gate_up: Region,
    pub h: Region,
    /// The logits of block rows `1..B` `[B-1, V]`.
    pub logits: Region,
    pub bytes: u64,
    pub items: Vec<Item>,
}

impl DrafterDecodeLayout {
    /// The layout of `config` for contexts of up to `context` positions, appended `append_rows`
    /// at a time, storing `widths = (stored, arithmetic)` bytes per value.
    pub fn new(config: &DraftConfig, context: usize, append_rows: usize, widths: (u64, u64)) -> Result<Self> {
        let c = &config.dims;
        if config.block_size < 2 {
            return Err(Error::invalid(
                "block_size",
                format!("{}: a block drafts at least one token", config.block_size),
            ));
        }
        if append_rows == 0 || context < append_rows {
            return Err(Error::invalid(
                "drafter decoding layout",
                format!("appends of {append_rows} rows into a context of {context}: need 1 <= rows <= context"),
            ));
        }
        let z = DrafterDecodeDims {
            h: c.hidden_size,
            i: c.intermediate_size,
            nh: c.num_heads,
            nkv: c.num_kv_heads,
            d: c.head_dim,
            qd: mul_usize("q width (heads x head_dim)", c.num_heads, c.head_dim)?,
            kd: mul_usize("k width (kv heads x head_dim)", c.num_kv_heads, c.head_dim)?,
            v: c.vocab_size,
            fw: mul_usize("feature width (features x hidden)", config.num_features(), c.hidden_size)?,
            b: config.block_size,
            c: context,
            m: append_rows,
        };
        let keys = add("context + block", context as u64, z.b as u64)? as usize;
        let (e, a) = widths;
        let mut ar = Arena::default();
        use Lifetime::{Layer, Model, Saved};
        const WEIGHTS: &str = "drafter weights";
        let fc = ar.take(WEIGHTS, Model, "fc", &[z.h, z.fw], e)?;
        let hidden_norm = ar.take(WEIGHTS, Model, "hidden_norm", &[z.h], e)?;
        let norm = ar.take(WEIGHTS, Model, "norm", &[z.h], e)?;
        let layers = (0..c.num_layers())
            .map(|_| TargetLayerWeights::take(&mut ar, WEIGHTS, z.layer_shape(), true, e))
            .collect::<Result<Vec<_>>>()?;
        const TABLES: &str = "drafter RoPE tables of positions 0..C+B";
        let cos_table = ar.take(TABLES, Model, "cos table", &[keys, z.d], a)?;
        let sin_table = ar.take(TABLES, Model, "sin table", &[keys, z.d], a)?;
        let (mut k_cache, mut v_cache) = (Vec::new(), Vec::new());
        for _ in 0..c.num_layers() {
            k_cache.push(ar.take("drafter context K/V cache", Saved, "k cache", &[keys, z.kd], e)?);
            v_cache.push(ar.take("drafter context K/V cache", Saved, "v cache", &[keys, z.kd], e)?);
        }
        let rows = |ar: &mut Arena, item: &'static str, n: usize| -> Result<RowsScratch> {
            Ok(RowsScratch {
                k_pre: ar.take(item, Layer, "k_pre", &[n, z.kd], e)?,
                inv_k: ar.take(item, Layer, "inv_k", &[n, z.nkv], a)?,
            })
        };
        const APPEND: &str = "drafter context append scratch";
        let append = rows(&mut ar, APPEND, z.m)?;
        let ctx_pre = ar.take(APPEND, Layer, "ctx_pre", &[z.m, z.h], e)?;
        // ctx then xn, one region: an append's rows and the block's adjacent.
        let ctx_xn_rows = add("append rows + block", z.m as u64, z.b as u64)? as usize;
        let ctx_xn = ar.take(APPEND, Layer, "ctx | xn", &[ctx_xn_rows, z.h], e)?;
        let ctx_bytes = bytes_of("ctx", &[z.m, z.h], e)?;
        let ctx = Region { offset: ctx_xn.offset, bytes: ctx_bytes };
        let xn = ctx_xn.skip(ctx_bytes);
        let ctx_inv = ar.take(APPEND, Layer, "ctx inv", &[z.m], a)?;
        const BLOCK: &str = "drafter block scratch";
        let block = rows(&mut ar, BLOCK, mul_usize("appended rows + block", 2, z.b)?)?;
        let mut s = |what: &str, dims: &[usize], w: u64| ar.take(BLOCK, Layer, what, dims, w);
        let tokens = s("tokens", &[z.b], 4)?;
        let x = s("x", &[z.b, z.h], e)?;
        let inv = s("inv", &[z.b], a)?;
        let q_pre = s("q_pre", &[z.b, z.qd], e)?;
        let q = s("q", &[z.b, z.qd], e)?;
        let inv_q = s("inv_q", &[z.b, z.nh], a)?;
        let out = s("attention out", &[z.b, z.qd], e)?;
        let lse = s("lse", &[z.nh, z.b], a)?;
        let gate_up = s("gate_up", &[z.b, 2 * z.i], e)?;
        let h = s("h", &[z.b, z.i], e)?;
        let logits = s("logits", &[z.b - 1, z.v], e)?;
        Ok(DrafterDecodeLayout {
            dims: z,
            fc,
            hidden_norm,
            norm,
            layers,
            cos_table,
            sin_table,
            k_cache,
            v_cache,
            append,
            ctx_pre,
            ctx,
            ctx_inv,
            block,
            tokens,
            x,
            xn,
            inv,
            q_pre,
            q,
            inv_q,
            out,
            lse,
            gate_up,
            h,
            logits,
            bytes: ar.bytes(),
            items: ar.items,
        })
    }

    /// Refuses the layout before anything is allocated when it needs more than `available` bytes
    /// of `device`, naming the largest items.
    pub fn check_fits(&self, available: u64, device: &str) -> Result<()> {
        check_fits("the drafter at inference", self.bytes, &self.items, available, device, "try a shorter context")
    }
}
