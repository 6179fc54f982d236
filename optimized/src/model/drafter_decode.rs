//! The drafter at inference (spec section 4), over a backend: the committed positions' features
//! are projected once into each layer's context K/V cache (a prompt's by
//! [`DrafterDecode::append_context`], a verify step's accepted rows by the next draft, each layer
//! projecting them and the block in one pass, as one launch per projection);
//! each draft runs the block `[bonus, MASK x (B-1)]` at positions `n..n+B` through the layers,
//! its own K/V written into the cache's slots after the context and recomputed every step, under
//! the DFlash plan of one block anchored at `n` (context `[0, n)`, the block bidirectional in full
//! layers, causal in sliding ones); the argmax of rows `1..B` are the proposals, written where
//! the caller asks (the target's verify tokens). The embedding table and LM head are the target's.

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use dflash_reference::config::{AttnKind, DraftConfig};
use dflash_reference::mask::BlockLayout;
use dflash_reference::ops::rope_tables;

use crate::backend::{Allocation, Backend, Pitched};
use crate::memory::drafter_decode::{DrafterDecodeLayout, RowsScratch};
use crate::memory::target::TargetLayerWeights;
use crate::memory::Region;
use crate::ops::attention::ranges::KeyRanges;
use crate::ops::attention::AttnShape;
use crate::ops::elementwise::{ElementwiseOps, HeadNormRope, Heads};
use crate::ops::{arithmetic, bytes_of, stored, Elem, Real};
use crate::{Error, Result};

/// The context's last rows that a draft appends before drafting ([`DrafterDecode::draft`]):
/// the features `[rows, F*H]` at address `features`, of positions `past..past+rows`, which end
/// where the draft's block begins.
#[derive(Clone, Copy, Debug)]
pub struct ContextRows {
    pub features: u64,
    pub past: usize,
    pub rows: usize,
}

/// The attention plans of one draft: a block after `n` context positions, per layer kind.
pub struct DraftPlans<B: Backend> {
    n: usize,
    plans: HashMap<AttnKind, B::Ranges>,
}

/// The drafter's inference forward over one allocation of its layout.
pub struct DrafterDecode<B: Backend> {
    dev: B,
    pub config: DraftConfig,
    pub layout: DrafterDecodeLayout,
    _memory: B::Alloc,
    base: u64,
    /// The target's embedding table and LM head `[V, H]` (stored), shared.
    embed: u64,
    head: u64,
}

impl<B: Backend> DrafterDecode<B> {
    /// Lays out `config` for contexts of up to `context` positions appended `append_rows` at a
    /// time, reading the target's `embed` table and LM `head` at those addresses of `dev`'s
    /// memory; refused before allocating when it cannot fit.
    pub fn new(
        dev: B,
        config: &DraftConfig,
        context: usize,
        append_rows: usize,
        (embed, head): (u64, u64),
    ) -> Result<Self> {
        let layout = DrafterDecodeLayout::new(config, context, append_rows, super::widths::<B>())?;
        let device = format!("{} (drafter decoding, a context of {context})", dev.name());
        layout.check_fits(dev.available_bytes()?, &device)?;
        let bytes = usize::try_from(layout.bytes)
            .map_err(|_| Error::Memory(format!("{device}: {} bytes exceed the address space", layout.bytes)))?;
        let memory = dev.alloc("drafter decoding", bytes)?;
        let base = memory.ptr();
        let c = &config.dims;
        let all: Vec<usize> = (0..context + config.block_size).collect();
        let (cos, sin) = rope_tables(&all, c.head_dim, c.rope_theta, DType::F64)?;
        dev.upload(layout.cos_table.at(base), bytes_of(&arithmetic::<B::Elem>(cos)?))?;
        dev.upload(layout.sin_table.at(base), bytes_of(&arithmetic::<B::Elem>(sin)?))?;
        let mask = vec![config.mask_token_id; config.block_size];
        dev.upload(layout.tokens.at(base), bytes_of(&mask))?;
        Ok(DrafterDecode { dev, config: config.clone(), layout, _memory: memory, base, embed, head })
    }

    fn at(&self, r: Region) -> u64 {
        r.at(self.base)
    }

    /// The backend the drafter decodes on.
    pub fn backend(&self) -> &B {
        &self.dev
    }

    /// Loads every weight from `get(checkpoint_key, shape)` (a drafter's named parameters), as
    /// stored values; gate and up are stacked.
    pub fn load_weights(&mut self, get: impl Fn(&str, &[usize]) -> dflash_reference::Result<Tensor>) -> Result<()> {
        let z = self.layout.dims;
        let put = |r: Region, name: &str, shape: &[usize]| -> Result<()> {
            let values = stored::<B::Elem>(&get(name, shape)?)?;
            self.dev.upload(self.at(r), bytes_of(&values))
        };
        put(self.layout.fc, "fc.weight", &[z.h, z.fw])?;
        put(self.layout.hidden_norm, "hidden_norm.weight", &[z.h])?;
        put(self.layout.norm, "norm.weight", &[z.h])?;
        for (l, w) in self.layout.layers.iter().enumerate() {
            w.load(&format!("layers.{l}."), z.layer_shape(), B::Elem::BYTES, put)?;
        }
        Ok(())
    }

    /// The RoPE tables `(cos, sin)` `[n, d]` of positions `first..first+n`: rows of the tables.
    fn rope(&self, first: usize) -> (u64, u64) {
        let row = (self.layout.dims.d * <B::Elem as Elem>::Acc::BYTES * first) as u64;
        (self.at(self.layout.cos_table) + row, self.at(self.layout.sin_table) + row)
    }

    /// `k [n, nkv, d] = rope(k_norm(x W_k^T))` and `v = x W_v^T` of `n` rows `x [n, H]` of layer
    /// `w`, into the caches of layer `l` from position `first` on.
    fn keys_values(
        &self,
        l: usize,
        w: &TargetLayerWeights,
        x: u64,
        rows: &RowsScratch,
        first: usize,
        n: usize,
    ) -> Result<()> {
        let (z, lay) = (self.layout.dims, &self.layout);
        let skip = (first * z.kd * B::Elem::BYTES) as u64;
        self.dev.linear(x, n, z.h, self.at(w.k), z.kd, self.at(rows.k_pre), 0.0)?;
        self.dev.linear(x, n, z.h, self.at(w.v), z.kd, self.at(lay.v_cache[l]) + skip, 0.0)?;
        let (cos, sin) = self.rope(first);
        let f = HeadNormRope {
            x: self.at(rows.k_pre),
            x_row: z.kd,
            w: self.at(w.k_norm.expect("drafter layers have k norms")),
            cos,
            sin,
        };
        let dims = Heads { tokens: n, heads: z.nkv, head_dim: z.d };
        let eps = self.config.dims.rms_norm_eps;
        self.dev.ops().head_norm_rope_forward(f, self.at(lay.k_cache[l]) + skip, self.at(rows.inv_k), dims, eps)
    }

    /// Whether layer `w` projects `rows` rows through its stacked q/k/v weight into the `gate_up`
    /// scratch (free until the MLP): `[rows, qd + 2 kd]` must fit there.
    fn stacked(&self, w: &TargetLayerWeights, rows: usize) -> bool {
        let z = self.layout.dims;
        w.qkv_stacked() && ((rows * (z.qd + 2 * z.kd) * B::Elem::BYTES) as u64) <= self.layout.gate_up.bytes
    }

    /// A draft's q, k and v of layer `l` in one projection of the `rows` rows at `x` (the
    /// appended rows, then the block) through the stacked weight: q of the block's rows (the last
    /// B, RoPE `(cos, sin)` of the block's positions) from their columns; k and v of every row into
    /// the caches from position `first`.
    fn stacked_qkv(
        &self,
        l: usize,
        w: &TargetLayerWeights,
        x: u64,
        (first, rows): (usize, usize),
        q_norm: u64,
        (cos, sin): (u64, u64),
    ) -> Result<()> {
        let (z, lay, ops) = (self.layout.dims, &self.layout, self.dev.ops());
        let (e, eps) = (B::Elem::BYTES, self.config.dims.rms_norm_eps);
        let width = z.qd + 2 * z.kd;
        let qkv = self.at(lay.gate_up);
        self.dev.linear(x, rows, z.h, self.at(w.q), width, qkv, 0.0)?;
        let block_q = qkv + ((rows - z.b) * width * e) as u64;
        let f = HeadNormRope { x: block_q, x_row: width, w: q_norm, cos, sin };
        let q_heads = Heads { tokens: z.b, heads: z.nh, head_dim: z.d };
        ops.head_norm_rope_forward(f, self.at(lay.q), self.at(lay.inv_q), q_heads, eps)?;
        let skip = (first * z.kd * e) as u64;
        let (k_cos, k_sin) = self.rope(first);
        let k_norm = self.at(w.k_norm.expect("drafter layers have k norms"));
        let f = HeadNormRope { x: qkv + (z.qd * e) as u64, x_row: width, w: k_norm, cos: k_cos, sin: k_sin };
        let k_heads = Heads { tokens: rows, heads: z.nkv, head_dim: z.d };
        ops.head_norm_rope_forward(f, self.at(lay.k_cache[l]) + skip, self.at(lay.block.inv_k), k_heads, eps)?;
        let (v_cache, v) = (self.at(lay.v_cache[l]) + skip, qkv + ((z.qd + z.kd) * e) as u64);
        self.dev.copy_strided(
            Pitched { addr: v_cache, pitch: z.kd * e },
            Pitched { addr: v, pitch: width * e },
            z.kd * e,
            rows,
        )
    }

    /// Where the normed context rows of an append of `n` rows go: the last `n` rows of `ctx`,
    /// which the block's normed rows `xn` follow.
    fn ctx_rows(&self, n: usize) -> u64 {
        let z = self.layout.dims;
        self.at(self.layout.ctx) + ((z.m - n) * z.h * B::Elem::BYTES) as u64
    }

    /// `ctx = hidden_norm(features W_fc^T)` of `n` rows of features `[n, F*H]` at address
    /// `features`, into [`DrafterDecode::ctx_rows`] (`n <= M`).
    fn project_context(&self, features: u64, n: usize) -> Result<()> {
        let (z, lay) = (self.layout.dims, &self.layout);
        let eps = self.config.dims.rms_norm_eps;
        self.dev.linear(features, n, z.fw, self.at(lay.fc), z.h, self.at(lay.ctx_pre), 0.0)?;
        let (pre, inv) = (self.at(lay.ctx_pre), self.at(lay.ctx_inv));
        self.dev.ops().rms_norm_forward(pre, self.at(lay.hidden_norm), self.ctx_rows(n), inv, n, z.h, eps)
    }

    /// Refuses an append of `n` rows at `past` that the context cannot take.
    fn check_append(&self, past: usize, n: usize) -> Result<()> {
        let z = self.layout.dims;
        if n == 0 || n > z.m || past + n > z.c {
            return Err(Error::invalid(
                "drafter context",
                format!("{n} rows at {past}: appends of 1..={} rows within a context of {}", z.m, z.c),
            ));
        }
        Ok(())
    }

    /// Appends the features `[n, F*H]` at address `features` (the target's, of positions
    /// `past..past+n`) to the context: `ctx = hidden_norm(features W_fc^T)`, then each layer's
    /// keys and values of `ctx` into its cache at `past`. (A draft takes the rows that the last
    /// verify step accepted itself: [`ContextRows`].)
    pub fn append_context(&self, features: u64, past: usize, n: usize) -> Result<()> {
        self.check_append(past, n)?;
        self.project_context(features, n)?;
        for (l, w) in self.layout.layers.iter().enumerate() {
            self.keys_values(l, w, self.ctx_rows(n), &self.layout.append, past, n)?;
        }
        Ok(())
    }

    /// The plans of a block after a context of `n` positions, per layer kind (uploaded in stream
    /// order, without a wait: [`Backend::upload_ranges`]).
    pub fn plans(&self, n: usize) -> Result<DraftPlans<B>> {
        let z = self.layout.dims;
        if n == 0 || n > z.c {
            return Err(Error::invalid("drafter context", format!("{n} positions; this drafter holds 1..={}", z.c)));
        }
        let layout = BlockLayout::new(n, z.b, vec![n], vec![true], None)?;
        let mut plans = HashMap::new();
        for &kind in &self.config.dims.layer_kinds {
            if let std::collections::hash_map::Entry::Vacant(e) = plans.entry(kind) {
                e.insert(self.dev.upload_ranges(&KeyRanges::dflash(&layout, kind)?)?);
            }
        }
        Ok(DraftPlans { n, plans })
    }

    /// Drafts the block of `plans` (after a context of `plans.n` positions) opened by the bonus
    /// token whose id (u32) is at device address `bonus`: the proposals `d_1..d_{B-1}` (u32) are
    /// written to address `out`. With `appended`, the context's last rows are appended first and
    /// each layer projects them and the block into keys and values in one pass. Nothing goes
    /// through the host.
    pub fn draft(&self, plans: &DraftPlans<B>, appended: Option<ContextRows>, bonus: u64, out: u64) -> Result<()> {
        let (z, lay, n) = (self.layout.dims, &self.layout, plans.n);
        // The rows whose keys and values each layer writes: `rows` of them at `kv_x`, from
        // position `first`.
        let (first, rows, kv_x) = match appended {
            Some(c) => {
                if c.past + c.rows != n || c.rows > z.b {
                    return Err(Error::invalid(
                        "drafter context",
                        format!(
                            "{} rows appended at {} with a draft after {n} positions: a draft appends at most \
                             the {} rows before its block",
                            c.rows, c.past, z.b
                        ),
                    ));
                }
                self.check_append(c.past, c.rows)?;
                self.project_context(c.features, c.rows)?;
                (c.past, c.rows + z.b, self.ctx_rows(c.rows))
            }
            None => (n, z.b, self.at(lay.xn)),
        };
        self.dev.copy(self.at(lay.tokens), bonus, 4)?;
        let (cos, sin) = self.rope(n);
        let eps = self.config.dims.rms_norm_eps;
        let ops = self.dev.ops();
        let (x, xn, inv) = (self.at(lay.x), self.at(lay.xn), self.at(lay.inv));
        ops.copy_rows(false, self.embed, self.at(lay.tokens), x, z.b, z.h)?;
        let shape = AttnShape { num_heads: z.nh, num_kv_heads: z.nkv, head_dim: z.d };
        for (l, w) in lay.layers.iter().enumerate() {
            ops.rms_norm_forward(x, self.at(w.input_norm), xn, inv, z.b, z.h, eps)?;
            // The appended rows (ctx) end where the block's (xn) begin: `rows` rows at kv_x.
            let q_norm = self.at(w.q_norm.expect("drafter layers have q norms"));
            if self.stacked(w, rows) {
                self.stacked_qkv(l, w, kv_x, (first, rows), q_norm, (cos, sin))?;
            } else {
                self.dev.linear(xn, z.b, z.h, self.at(w.q), z.qd, self.at(lay.q_pre), 0.0)?;
                let f = HeadNormRope { x: self.at(lay.q_pre), x_row: z.qd, w: q_norm, cos, sin };
                let q_heads = Heads { tokens: z.b, heads: z.nh, head_dim: z.d };
                ops.head_norm_rope_forward(f, self.at(lay.q), self.at(lay.inv_q), q_heads, eps)?;
                self.keys_values(l, w, kv_x, &lay.block, first, rows)?;
            }
            let plan = &plans.plans[&self.config.dims.layer_kinds[l]];
            let qkv = (self.at(lay.q), self.at(lay.k_cache[l]), self.at(lay.v_cache[l]));
            self.dev.attention_forward(plan, shape, qkv, (self.at(lay.out), self.at(lay.lse)))?;
            self.dev.linear(self.at(lay.out), z.b, z.qd, self.at(w.o), z.h, x, 1.0)?;
            ops.rms_norm_forward(x, self.at(w.post_norm), xn, inv, z.b, z.h, eps)?;
            let (gate_up, h) = (self.at(lay.gate_up), self.at(lay.h));
            self.dev.linear(xn, z.b, z.h, self.at(w.gate_up), 2 * z.i, gate_up, 0.0)?;
            ops.swiglu_forward(gate_up, h, z.b, z.i)?;
            self.dev.linear(h, z.b, z.i, self.at(w.down), z.h, x, 1.0)?;
        }
        // Proposals: argmax(lm_head(norm(x))) of rows 1..B.
        let row1 = (z.h * B::Elem::BYTES) as u64;
        ops.rms_norm_forward(x + row1, self.at(lay.norm), xn, inv, z.b - 1, z.h, eps)?;
        self.dev.linear(xn, z.b - 1, z.h, self.head, z.v, self.at(lay.logits), 0.0)?;
        ops.argmax_rows(self.at(lay.logits), z.b - 1, z.v, out)
    }

    /// The last draft's first `rows` logit rows on the host, as f64 `[rows][V]` (refused when
    /// one is NaN or Inf).
    pub fn logits_to_host(&self, rows: usize) -> Result<Vec<Vec<f64>>> {
        let z = self.layout.dims;
        super::logits_to_host(&self.dev, self.at(self.layout.logits), (rows, z.b - 1), z.v)
    }
}
