//! The frozen target's forward over packed training rows (spec sections 3 and 9), layer by layer
//! over a backend: on the GPU in bf16 with fp32 accumulation (cuBLAS, the fused causal attention,
//! `elementwise.cu`), or on the CPU with their twins. Only layers `0..=max(target_layer_ids)` run
//! (no final norm, no logits); each tapped layer's output is scattered into the features
//! `[T, F*H]` (concatenated per token, in `target_layer_ids` order) that the drafter reads.
//!
//! Packed rows: attention runs once per document (a causal plan over its own tokens, positions
//! from the row's `positions`), so a document sees no other; padding tokens get zero features.
//! Decoding (spec section 4, [`TargetForward::decoding`]): every layer runs over new tokens
//! against a K/V cache (the causal plan after the cached positions), then the final norm, the LM
//! head and the argmax of the last rows, on the device; the cache is rolled back by decoding the
//! next tokens at a smaller `past`.
//!
//! Shapes: T tokens per launch (rows concatenated), H hidden, I SwiGLU, nh/nkv heads of d,
//! C cached positions, R logit rows.

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use dflash_reference::config::{AttnKind, TargetConfig};
use dflash_reference::data::{document_runs, Row};
use dflash_reference::ops::rope_tables_scaled;

use crate::backend::{download, Allocation, Backend, Pitched};
use crate::memory::target::{DecodeRegions, TargetLayout};
use crate::memory::Region;
use crate::ops::attention::ranges::KeyRanges;
use crate::ops::attention::AttnShape;
use crate::ops::elementwise::{ElementwiseOps, HeadNormRope, Heads};
use crate::ops::{arithmetic, bytes_of, stored, Elem, Real};
use crate::{Error, Result};

/// The causal plans of one decoding launch: `t` tokens after `past` cached positions, per kind.
pub struct DecodePlans<B: Backend> {
    past: usize,
    t: usize,
    plans: HashMap<AttnKind, B::Ranges>,
}

/// Where a launch's attention finds its keys.
enum Attend<'a, R> {
    /// Packed rows: each document causal over its own tokens, with its plan by (length, kind).
    Documents { docs: &'a [std::ops::Range<usize>], plans: &'a HashMap<(usize, AttnKind), R> },
    /// Decoding: the launch's tokens sit after `past` cached positions (its K/V appended to the
    /// cache there), with the plan of each layer kind.
    Cached { past: usize, plans: &'a HashMap<AttnKind, R> },
}

/// The target's forward at a launch capacity of `layout.dims.t` tokens, on a backend.
pub struct TargetForward<B: Backend> {
    dev: B,
    pub config: TargetConfig,
    pub layer_ids: Vec<usize>,
    pub layout: TargetLayout,
    /// The one allocation every region lives in.
    _memory: B::Alloc,
    base: u64,
    /// Tokens of the last launch, and the token ranges of its padding.
    tokens: usize,
    padding: Vec<std::ops::Range<usize>>,
}

impl<B: Backend> TargetForward<B> {
    /// Lays out the forward of `config` tapping `layer_ids` for launches of up to `max_tokens`
    /// tokens (with the untied LM head when `with_lm_head`, for the drafter to share), checks
    /// that it fits the backend's free memory, then allocates it: a target that cannot fit is
    /// refused before anything is allocated, naming its largest items.
    pub fn new(
        dev: B,
        config: &TargetConfig,
        layer_ids: &[usize],
        max_tokens: usize,
        with_lm_head: bool,
    ) -> Result<Self> {
        let layout = TargetLayout::new(config, layer_ids, max_tokens, super::widths::<B>(), with_lm_head, true)?;
        let device = format!("{} (target, {max_tokens} tokens per launch)", dev.name());
        Self::allocate(dev, config, layer_ids, layout, &device)
    }

    /// The decoding forward (spec section 4): launches of up to `max_tokens` tokens at positions
    /// below `context`, every layer with its K/V cache, the final norm, the LM head and the next
    /// tokens of up to `logit_rows` rows per launch; refused before allocating when it cannot fit.
    pub fn decoding(
        dev: B,
        config: &TargetConfig,
        layer_ids: &[usize],
        max_tokens: usize,
        context: usize,
        logit_rows: usize,
    ) -> Result<Self> {
        let layout = TargetLayout::decoding(config, layer_ids, max_tokens, context, logit_rows, super::widths::<B>())?;
        let device = format!("{} (target decoding, a context of {context})", dev.name());
        Self::allocate(dev, config, layer_ids, layout, &device)
    }

    fn allocate(
        dev: B,
        config: &TargetConfig,
        layer_ids: &[usize],
        layout: TargetLayout,
        device: &str,
    ) -> Result<Self> {
        layout.check_fits(dev.available_bytes()?, device)?;
        let bytes = usize::try_from(layout.bytes)
            .map_err(|_| Error::Memory(format!("{device}: {} bytes exceed the address space", layout.bytes)))?;
        let memory = dev.alloc("target", bytes)?;
        let base = memory.ptr();
        let c = &config.dims;
        let z = layout.dims;
        let held = layout.decode.as_ref().map_or(z.t, |d| d.context);
        let all: Vec<usize> = (0..held).collect();
        let (cos, sin) = rope_tables_scaled(&all, c.head_dim, c.rope_theta, &config.rope_scaling, DType::F64)?;
        dev.upload(layout.cos_table.at(base), bytes_of(&arithmetic::<B::Elem>(cos)?))?;
        dev.upload(layout.sin_table.at(base), bytes_of(&arithmetic::<B::Elem>(sin)?))?;
        let f = layer_ids.len() as u32;
        for (i, rows) in layout.feature_rows.iter().enumerate() {
            let idx: Vec<u32> = (0..z.t as u32).map(|t| t * f + i as u32).collect();
            dev.upload(rows.at(base), bytes_of(&idx))?;
        }
        Ok(TargetForward {
            dev,
            config: config.clone(),
            layer_ids: layer_ids.to_vec(),
            layout,
            _memory: memory,
            base,
            tokens: 0,
            padding: Vec::new(),
        })
    }

    fn at(&self, r: Region) -> u64 {
        r.at(self.base)
    }

    /// The backend the forward runs on.
    pub fn backend(&self) -> &B {
        &self.dev
    }

    /// Loads every weight the forward reads from `get(hf_name, shape)` (e.g. a checkpoint's
    /// `WeightSet`, or a reference `TargetModel`), as stored values; gate and up are stacked.
    pub fn load_weights(&mut self, get: impl Fn(&str, &[usize]) -> dflash_reference::Result<Tensor>) -> Result<()> {
        let z = self.layout.dims;
        let put = |r: Region, name: &str, shape: &[usize]| -> Result<()> {
            let values = stored::<B::Elem>(&get(name, shape)?)?;
            self.dev.upload(self.at(r), bytes_of(&values))
        };
        put(self.layout.embed, "model.embed_tokens.weight", &[z.v, z.h])?;
        if let Some(head) = self.layout.lm_head {
            put(head, "lm_head.weight", &[z.v, z.h])?;
        }
        if let Some(d) = &self.layout.decode {
            put(d.final_norm, "model.norm.weight", &[z.h])?;
        }
        for (l, w) in self.layout.layers.iter().enumerate() {
            w.load(&format!("model.layers.{l}."), z.layer_shape(), B::Elem::BYTES, put)?;
        }
        Ok(())
    }

    /// The address of the embedding table `[V, H]` and of the LM head `[V, H]` (the table when
    /// tied; `None` when untied and not held), stored: the drafter's frozen tables.
    pub fn frozen_tables(&self) -> (u64, Option<u64>) {
        let embed = self.at(self.layout.embed);
        let head = match self.config.tie_word_embeddings {
            true => Some(embed),
            false => self.layout.lm_head.map(|r| self.at(r)),
        };
        (embed, head)
    }

    /// Model FLOPs of this forward on a packed row with `doc_ids` (`flops::target_forward_flops`
    /// per document over the layers run, no LM head).
    pub fn row_flops(&self, doc_ids: &[i64]) -> f64 {
        let layers = self.layer_ids.iter().max().map_or(0, |&l| l + 1);
        document_runs(doc_ids)
            .into_iter()
            .map(|run| crate::flops::target_forward_flops(&self.config, layers, run.len(), false))
            .sum()
    }

    /// The features of the last launch `[tokens, F*H]`: their address.
    pub fn features_addr(&self) -> u64 {
        self.layout.features.map(|r| self.at(r)).expect("the forward's layout holds its features")
    }

    /// Runs the target over `rows` concatenated (at most the launch capacity in all), writing
    /// their features: row `r`'s start at token `sum of the earlier rows' lengths`.
    pub fn run(&mut self, rows: &[&Row]) -> Result<()> {
        let z = self.layout.dims;
        let total: usize = rows.iter().map(|r| r.tokens.len()).sum();
        if total == 0 || total > z.t {
            return Err(Error::invalid(
                "rows",
                format!("{total} tokens in one launch; the target was laid out for 1..={}", z.t),
            ));
        }
        let (mut tokens, mut positions, mut docs, mut padding) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, row) in rows.iter().enumerate() {
            row.validate().map_err(|e| Error::invalid(format!("row {i}"), e.to_string()))?;
            if let Some(&bad) = row.tokens.iter().find(|&&t| t as usize >= z.v) {
                return Err(Error::invalid(
                    format!("row {i}"),
                    format!("token id {bad} is not below the vocab size {}", z.v),
                ));
            }
            let start = tokens.len();
            let runs = document_runs(&row.doc_ids);
            let mut covered = start;
            for run in &runs {
                if run.start + start > covered {
                    padding.push(covered..run.start + start);
                }
                docs.push(run.start + start..run.end + start);
                covered = run.end + start;
            }
            if covered < start + row.tokens.len() {
                padding.push(covered..start + row.tokens.len());
            }
            tokens.extend_from_slice(&row.tokens);
            positions.extend_from_slice(&row.positions);
        }
        self.tokens = total;
        self.padding = padding;
        let c = &self.config.dims;
        let lay = &self.layout;
        let positions: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        self.dev.upload(self.at(lay.tokens), bytes_of(&tokens))?;
        self.positions(&positions)?;
        // The causal plan of each distinct document length and layer kind, uploaded once.
        let group_rows = KeyRanges::causal_group_rows(z.nh / z.nkv);
        let mut plans = HashMap::new();
        for run in &docs {
            for &kind in &c.layer_kinds[..z.layers] {
                if let std::collections::hash_map::Entry::Vacant(e) = plans.entry((run.len(), kind)) {
                    e.insert(self.dev.upload_ranges(&KeyRanges::causal(run.len(), kind, group_rows)?)?);
                }
            }
        }
        let rope = (self.at(self.layout.cos), self.at(self.layout.sin));
        self.forward(total, rope, Attend::Documents { docs: &docs, plans: &plans })
    }

    /// Uploads a launch's positions and gathers its RoPE tables from the position tables (rows
    /// copied as stored-width columns).
    fn positions(&self, positions: &[u32]) -> Result<()> {
        let lay = &self.layout;
        self.dev.upload(self.at(lay.positions), bytes_of(positions))?;
        let cols = lay.dims.d * <B::Elem as Elem>::Acc::BYTES / B::Elem::BYTES;
        let (ops, t) = (self.dev.ops(), positions.len());
        ops.copy_rows(false, self.at(lay.cos_table), self.at(lay.positions), self.at(lay.cos), t, cols)?;
        ops.copy_rows(false, self.at(lay.sin_table), self.at(lay.positions), self.at(lay.sin), t, cols)
    }

    fn decode_regions(&self) -> Result<&DecodeRegions> {
        self.layout
            .decode
            .as_ref()
            .ok_or_else(|| Error::invalid("target", "this forward was not laid out for decoding"))
    }

    /// Where a launch's token ids (u32 `[T]`) live: [`TargetForward::decode`] reads them there.
    pub fn tokens_addr(&self) -> u64 {
        self.at(self.layout.tokens)
    }

    /// Where the next tokens (u32 `[R]`) of the last decoding launch live.
    pub fn next_addr(&self) -> Result<u64> {
        Ok(self.at(self.decode_regions()?.next))
    }

    /// The causal plans of `t` tokens after `past` cached positions, per layer kind (uploaded in
    /// stream order, without a wait: [`Backend::upload_ranges`]).
    pub fn decode_plans(&self, past: usize, t: usize) -> Result<DecodePlans<B>> {
        let z = self.layout.dims;
        let group_rows = KeyRanges::causal_group_rows(z.nh / z.nkv);
        let mut plans = HashMap::new();
        for &kind in &self.config.dims.layer_kinds {
            if let std::collections::hash_map::Entry::Vacant(e) = plans.entry(kind) {
                e.insert(self.dev.upload_ranges(&KeyRanges::causal_after(past, t, kind, group_rows)?)?);
            }
        }
        Ok(DecodePlans { past, t, plans })
    }

    /// Decodes `t` tokens whose ids are at [`TargetForward::tokens_addr`], at positions
    /// `past..past+t` after `past` cached ones: their K/V overwrite the cache from `past` on
    /// (so decoding at a smaller `past` rolls it back), their features `[t, F*H]` are written,
    /// and the argmax of the logits of the last `logit_rows` rows goes to the next tokens.
    pub fn decode(&mut self, t: usize, past: usize, logit_rows: usize) -> Result<()> {
        let plans = self.decode_plans(past, t)?;
        self.decode_with(&plans, logit_rows)
    }

    /// [`TargetForward::decode`] under plans made by [`TargetForward::decode_plans`].
    pub fn decode_with(&mut self, plans: &DecodePlans<B>, logit_rows: usize) -> Result<()> {
        let (t, past) = (plans.t, plans.past);
        let (z, d) = (self.layout.dims, self.decode_regions()?.clone());
        if t == 0 || t > z.t || logit_rows == 0 || logit_rows > t.min(d.logit_rows) {
            return Err(Error::invalid(
                "decode",
                format!("{t} tokens with {logit_rows} logit rows; the target was laid out for 1..={} tokens and up to {} rows", z.t, d.logit_rows),
            ));
        }
        if past + t > d.context {
            return Err(Error::invalid(
                "decode",
                format!("positions {past}..{} exceed the context of {} the caches hold", past + t, d.context),
            ));
        }
        self.tokens = t;
        self.padding.clear();
        // Consecutive positions: their RoPE tables are rows past.. of the position tables.
        let lay = &self.layout;
        let row = (z.d * <B::Elem as Elem>::Acc::BYTES * past) as u64;
        let rope = (self.at(lay.cos_table) + row, self.at(lay.sin_table) + row);
        self.forward(t, rope, Attend::Cached { past, plans: &plans.plans })?;
        let head = self.frozen_tables().1.expect("a decoding layout holds its LM head");
        let scratch = (self.at(lay.xn), self.at(lay.inv), self.at(d.logits), self.at(d.next));
        let dims = (t, z.h, z.v, self.config.dims.rms_norm_eps);
        super::next_tokens(&self.dev, self.at(lay.x), (self.at(d.final_norm), head), scratch, dims, logit_rows)
    }

    /// The layers over the uploaded launch of `t` tokens with its RoPE tables `(cos, sin)`
    /// `[t, d]`.
    fn forward(&self, t: usize, (cos, sin): (u64, u64), attend: Attend<'_, B::Ranges>) -> Result<()> {
        let (z, lay, ops) = (self.layout.dims, &self.layout, self.dev.ops());
        let at = |r: Region| r.at(self.base);
        let e = B::Elem::BYTES as u64;
        let eps = self.config.dims.rms_norm_eps;
        let (x, xn, s) = (at(lay.x), at(lay.xn), lay.attn);
        ops.copy_rows(false, at(lay.embed), at(lay.tokens), x, t, z.h)?;
        let shape = AttnShape { num_heads: z.nh, num_kv_heads: z.nkv, head_dim: z.d };
        for (l, w) in lay.layers.iter().enumerate() {
            // q, k = rope(head_norm(xn W^T)) (Qwen3) or rope(xn W^T) (Llama); v = xn Wv^T.
            ops.rms_norm_forward(x, at(w.input_norm), xn, at(lay.inv), t, z.h, eps)?;
            // Decoding writes this launch's k and v into the caches after the past positions.
            let (k, v) = match (&attend, &lay.decode) {
                (Attend::Cached { past, .. }, Some(d)) => {
                    let skip = (past * z.kd) as u64 * e;
                    (at(d.k_cache[l]) + skip, at(d.v_cache[l]) + skip)
                }
                _ => (at(s.k), at(s.v)),
            };
            // Over stacked weights, q, k and v in one pass: q and k read in place by their head
            // norms, v copied to where attention reads it. Else three projections.
            let (width, pre) = (z.qd + 2 * z.kd, at(s.qkv_pre));
            let stacked = w.qkv_stacked();
            let (q_pre, k_pre) = if stacked {
                self.dev.linear(xn, t, z.h, at(w.q), width, pre, 0.0)?;
                let kd = z.kd * e as usize;
                let v_cols = Pitched { addr: pre + ((z.qd + z.kd) as u64) * e, pitch: width * e as usize };
                self.dev.copy_strided(Pitched { addr: v, pitch: kd }, v_cols, kd, t)?;
                (pre, pre + z.qd as u64 * e)
            } else {
                let k_pre = pre + (t * z.qd) as u64 * e;
                self.dev.linear(xn, t, z.h, at(w.q), z.qd, pre, 0.0)?;
                self.dev.linear(xn, t, z.h, at(w.k), z.kd, k_pre, 0.0)?;
                self.dev.linear(xn, t, z.h, at(w.v), z.kd, v, 0.0)?;
                (pre, k_pre)
            };
            let sides = [(q_pre, w.q_norm, at(s.q), s.inv_q, z.nh), (k_pre, w.k_norm, k, s.inv_k, z.nkv)];
            for (pre, norm, out, inv, heads) in sides {
                let dims = Heads { tokens: t, heads, head_dim: z.d };
                let x_row = if stacked { width } else { heads * z.d };
                // The layout holds q/k norms exactly for the architectures that have them.
                match norm {
                    Some(norm) => {
                        let f = HeadNormRope { x: pre, x_row, w: at(norm), cos, sin };
                        ops.head_norm_rope_forward(f, out, at(inv), dims, eps)?
                    }
                    None => ops.rope_forward(pre, x_row, cos, sin, out, dims)?,
                }
            }
            let kind = self.config.dims.layer_kinds[l];
            match &attend {
                // Causal attention per document; padding rows attend to nothing (zero output).
                Attend::Documents { docs, plans } => {
                    for run in docs.iter() {
                        let (q_off, k_off) = ((run.start * z.qd) as u64 * e, (run.start * z.kd) as u64 * e);
                        let qkv = (at(s.q) + q_off, k + k_off, v + k_off);
                        self.dev.attention_forward(
                            &plans[&(run.len(), kind)],
                            shape,
                            qkv,
                            (at(s.out) + q_off, at(s.lse)),
                        )?;
                    }
                    for pad in &self.padding {
                        self.dev.zero(at(s.out) + (pad.start * z.qd) as u64 * e, pad.len() * z.qd * e as usize)?;
                    }
                }
                Attend::Cached { past, plans } => {
                    let skip = (past * z.kd) as u64 * e;
                    let qkv = (at(s.q), k - skip, v - skip);
                    self.dev.attention_forward(&plans[&kind], shape, qkv, (at(s.out), at(s.lse)))?;
                }
            }
            // x += out Wo^T; x += down(silu(gate) * up) of post_norm(x).
            self.dev.linear(at(s.out), t, z.qd, at(w.o), z.h, x, 1.0)?;
            ops.rms_norm_forward(x, at(w.post_norm), xn, at(lay.inv), t, z.h, eps)?;
            let (gate_up, h) = (at(lay.mlp.gate_up), at(lay.mlp.h));
            self.dev.linear(xn, t, z.h, at(w.gate_up), 2 * z.i, gate_up, 0.0)?;
            ops.swiglu_forward(gate_up, h, t, z.i)?;
            self.dev.linear(h, t, z.i, at(w.down), z.h, x, 1.0)?;
            for (f, _) in self.layer_ids.iter().enumerate().filter(|(_, &id)| id == l) {
                ops.copy_rows(true, x, at(lay.feature_rows[f]), self.features_addr(), t, z.h)?;
            }
        }
        for pad in &self.padding {
            self.dev.zero(self.features_addr() + (pad.start * z.fw) as u64 * e, pad.len() * z.fw * e as usize)?;
        }
        Ok(())
    }

    /// The logits of the last decoding launch's `rows` logit rows on the host, as f64 `[rows][V]`.
    pub fn logits_to_host(&self, rows: usize) -> Result<Vec<Vec<f64>>> {
        let d = self.decode_regions()?;
        super::logits_to_host(&self.dev, self.at(d.logits), (rows, d.logit_rows), self.layout.dims.v)
    }

    /// The features of the last launch on the host as bf16 bits, `[tokens, F*H]` (bf16 storage,
    /// the only 2-byte one, as it is; wider storage rounded).
    pub fn features_to_host_bf16(&self) -> Result<Vec<u16>> {
        if B::Elem::BYTES == 2 {
            return download::<u16, B>(&self.dev, self.features_addr(), self.tokens * self.layout.dims.fw);
        }
        Ok(self.features_to_host()?.into_iter().map(|x| half::bf16::from_f64(x).to_bits()).collect())
    }

    /// The features of the last launch on the host, `[tokens, F*H]` as f64.
    pub fn features_to_host(&self) -> Result<Vec<f64>> {
        let n = self.tokens * self.layout.dims.fw;
        Ok(download::<B::Elem, B>(&self.dev, self.features_addr(), n)?.into_iter().map(Elem::to_f64).collect())
    }
}
