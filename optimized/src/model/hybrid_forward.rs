//! The frozen hybrid target's forward (spec section 10: Qwen3.5/3.6, GatedDeltaNet and gated
//! attention layers) over packed training rows, layer by layer over a backend: the matmuls, the
//! norms, SwiGLU and the causal attention through the backend's ops, the GatedDeltaNet, partial
//! RoPE and output gate through its [`GdnOps`] (the CPU twins, or `gdn.cu`). Only layers
//! `0..=max(target_layer_ids)` run (no final norm, no logits); each tapped layer's output is
//! scattered into the features `[T, F*H]` (concatenated per token, in `layer_ids` order).
//!
//! Packed rows: each document restarts the conv window and the delta rule's state, and its
//! attention is causal over its own tokens (positions from the row), so a document sees no
//! other; padding tokens get zero features.
//! Decoding (spec sections 4 and 10, [`HybridForward::decoding`]): every layer runs over new
//! tokens after a cache: a GatedDeltaNet layer's kept state and conv window (its launch resumes
//! them), a gated attention layer's K/V (the causal plan after the cached positions); then the
//! final norm, the LM head and the argmax of the last rows. A kept launch advances the state; a
//! verify launch ([`HybridForward::verify`]) reads it, saving what [`HybridForward::keep`]
//! needs to advance it by any prefix of the launch (the attention caches roll back by `past`). Zero-centred norms (`x / rms(x) * (1 + w)`) run as
//! plain RMSNorms over `1 + w`, made at load time; `q_proj` is loaded as its query rows, then
//! its gate rows.
//!
//! Shapes: T tokens per launch (rows concatenated), H hidden, I SwiGLU; GDN: C conv channels,
//! H_v value heads of d_v; attention: nh/nkv heads of d, RoPE on the first r dims.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{DType, Tensor};
use dflash_reference::config::AttnKind;
use dflash_reference::data::{document_runs, Row};
use dflash_reference::hybrid::HybridConfig;
use dflash_reference::ops::rope_tables;

use crate::backend::{download, Allocation, Backend};
use crate::memory::hybrid::{
    DecodeTables, GatedAttnWeightRegions, GdnCacheRegions, GdnWeightRegions, HybridDecodeRegions, HybridLayout,
    LayerCacheRegions, MixerRegions,
};
use crate::memory::Region;
use crate::ops::attention::ranges::KeyRanges;
use crate::ops::attention::AttnShape;
use crate::ops::elementwise::{ElementwiseOps, Heads};
use crate::ops::gdn::{groups, one_segment, segment_table, DeltaBuffers, DeltaScratch, GateInputs, GdnShape, Segments};
use crate::ops::{arithmetic, bytes_of, with_stored, Elem, Real};
use crate::{Error, Result};

/// HF weight names (suffixes) of the zero-centred norms: loaded as `1 + w`.
const ZERO_CENTRED: [&str; 5] = [
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "model.norm.weight",
];

/// The hybrid target's forward at a launch capacity of `layout.tokens` tokens, on a backend.
pub struct HybridForward<B: Backend> {
    dev: B,
    pub config: HybridConfig,
    pub layer_ids: Vec<usize>,
    pub layout: HybridLayout,
    /// The one allocation every region lives in.
    _memory: B::Alloc,
    base: u64,
    /// Tokens of the last launch, and the token ranges of its padding.
    tokens: usize,
    padding: Vec<Range<usize>>,
    /// Tokens of the last verify launch while none of it is kept.
    verified: Option<usize>,
}

/// A launch's documents: `docs` (attention, per document) and `segments` (the GatedDeltaNet's
/// restarts: the documents and the padding runs, tiling `0..T`), with the causal plan of each
/// document length.
struct Launch<'a, R> {
    docs: &'a [Range<usize>],
    segments: &'a [Range<usize>],
    plans: &'a HashMap<usize, R>,
}

/// A decoding launch: its tokens after `past` cached positions, the attention's causal plan
/// after them, the GatedDeltaNet's segment tables, and whether it verifies (the state read, not
/// advanced).
struct Cached<'a, R> {
    past: usize,
    plan: Option<&'a R>,
    tables: DecodeTables,
    verify: bool,
}

/// What a launch attends over and resumes from.
enum Mode<'a, R> {
    Rows(Launch<'a, R>),
    Decode(Cached<'a, R>),
}

/// The causal plan of `t` tokens after `past` cached positions (none without attention layers).
pub struct HybridDecodePlans<B: Backend> {
    past: usize,
    t: usize,
    attention: Option<B::Ranges>,
}

impl<B: Backend> HybridForward<B> {
    /// Lays out the forward of `config` tapping `layer_ids` for launches of up to `max_tokens`
    /// tokens, checks that the backend has the hybrid ops and that it fits its free memory, then
    /// allocates it: a target that cannot fit is refused before anything is allocated, naming
    /// its largest items.
    pub fn new(dev: B, config: &HybridConfig, layer_ids: &[usize], max_tokens: usize) -> Result<Self> {
        let layout = HybridLayout::new(config, layer_ids, max_tokens, super::widths::<B>())?;
        let device = format!("{} (hybrid target, {max_tokens} tokens per launch)", dev.name());
        Self::allocate(dev, config, layer_ids, layout, &device)
    }

    /// The decoding forward (spec sections 4 and 10): launches of up to `max_tokens` tokens at
    /// positions below `context`, every layer with its cache, the final norm, the LM head and
    /// the next tokens of up to `logit_rows` rows per launch (verify launches of up to as many
    /// tokens); refused before allocating when it cannot fit.
    pub fn decoding(
        dev: B,
        config: &HybridConfig,
        layer_ids: &[usize],
        max_tokens: usize,
        context: usize,
        logit_rows: usize,
    ) -> Result<Self> {
        let layout = HybridLayout::decoding(config, layer_ids, max_tokens, context, logit_rows, super::widths::<B>())?;
        let device = format!("{} (hybrid target decoding, a context of {context})", dev.name());
        let forward = Self::allocate(dev, config, layer_ids, layout, &device)?;
        // The segment tables of the launches of 1..=R tokens, made once.
        let d = forward.decode_regions()?;
        for (i, tables) in d.tables.iter().enumerate() {
            forward.upload_tables(*tables, i + 1)?;
        }
        Ok(forward)
    }

    fn allocate(
        dev: B,
        config: &HybridConfig,
        layer_ids: &[usize],
        layout: HybridLayout,
        device: &str,
    ) -> Result<Self> {
        let max_tokens = layout.tokens;
        dev.gdn_ops().check_shape(GdnShape::new(&config.gdn, max_tokens))?;
        layout.plan()?.check_fits(dev.available_bytes()?, device)?;
        let bytes = usize::try_from(layout.bytes)
            .map_err(|_| Error::Memory(format!("{device}: {} bytes exceed the address space", layout.bytes)))?;
        let memory = dev.alloc("hybrid target", bytes)?;
        let base = memory.ptr();
        let held = layout.decode.as_ref().map_or(max_tokens, |d| d.context);
        let all: Vec<usize> = (0..held).collect();
        let (cos, sin) = rope_tables(&all, config.rope.rotary_dim, config.rope.theta, DType::F64)?;
        dev.upload(layout.cos_table.at(base), bytes_of(&arithmetic::<B::Elem>(cos)?))?;
        dev.upload(layout.sin_table.at(base), bytes_of(&arithmetic::<B::Elem>(sin)?))?;
        let f = layer_ids.len() as u32;
        for (i, rows) in layout.feature_rows.iter().enumerate() {
            let idx: Vec<u32> = (0..max_tokens as u32).map(|t| t * f + i as u32).collect();
            dev.upload(rows.at(base), bytes_of(&idx))?;
        }
        Ok(HybridForward {
            dev,
            config: config.clone(),
            layer_ids: layer_ids.to_vec(),
            layout,
            _memory: memory,
            base,
            tokens: 0,
            padding: Vec::new(),
            verified: None,
        })
    }

    fn at(&self, r: Region) -> u64 {
        r.at(self.base)
    }

    fn decode_regions(&self) -> Result<&HybridDecodeRegions> {
        self.layout.decode.as_ref().ok_or_else(|| Error::invalid("decode", "this target was not laid out for decoding"))
    }

    /// Uploads into `tables` the segment tables of a decoding launch of `t` tokens.
    fn upload_tables(&self, tables: DecodeTables, t: usize) -> Result<()> {
        let k = self.config.gdn.conv_kernel;
        self.dev.upload(self.at(tables.conv), bytes_of(&segment_table(&one_segment(k - 1 + t), k - 1 + t, false)))?;
        self.dev.upload(self.at(tables.delta), bytes_of(&segment_table(&one_segment(t), t, true)))
    }

    /// Loads every weight the forward reads from `get(hf_name, shape)` (text-layout names, e.g. a
    /// reference `HybridModel`'s), as stored values: the zero-centred norms as `1 + w`, `q_proj`
    /// reordered to its query rows then its gate rows.
    pub fn load_weights(&mut self, get: impl Fn(&str, &[usize]) -> dflash_reference::Result<Tensor>) -> Result<()> {
        let (nh, d, h) = (self.config.num_heads, self.config.head_dim, self.config.hidden_size);
        for (name, shape, region) in &self.layout.weights {
            let t = get(name, shape)?;
            let t = if ZERO_CENTRED.iter().any(|n| name.ends_with(n)) {
                t.to_dtype(DType::F64)?.affine(1.0, 1.0)?
            } else if name.ends_with("self_attn.q_proj.weight") {
                // [nh, (query | gate), d, H] -> [(query | gate), nh, d, H].
                t.reshape((nh, 2, d, h))?.transpose(0, 1)?.contiguous()?
            } else {
                t
            };
            with_stored::<B::Elem, _>(&t, |v| self.dev.upload(self.at(*region), bytes_of(v)))?;
        }
        Ok(())
    }

    /// The backend the forward runs on.
    pub fn backend(&self) -> &B {
        &self.dev
    }

    /// The address of the embedding table `[V, H]` and of the LM head `[V, H]` (the table when
    /// tied), stored: the drafter's frozen tables (the layout always holds an untied head).
    pub fn frozen_tables(&self) -> (u64, Option<u64>) {
        let embed = self.at(self.layout.embed);
        let head = match self.config.tie_word_embeddings {
            true => Some(embed),
            false => self.layout.weights.iter().find(|(n, _, _)| n == "lm_head.weight").map(|(_, _, r)| self.at(*r)),
        };
        (embed, head)
    }

    /// Model FLOPs of this forward on a packed row with `doc_ids` (`flops::hybrid_forward_flops`
    /// per document over the layers run).
    pub fn row_flops(&self, doc_ids: &[i64]) -> f64 {
        document_runs(doc_ids)
            .into_iter()
            .map(|run| crate::flops::hybrid_forward_flops(&self.config, self.layout.layers_run, run.len()))
            .sum()
    }

    /// The features of the last launch `[tokens, F*H]`: their address.
    pub fn features_addr(&self) -> u64 {
        self.at(self.layout.features)
    }

    /// Runs the target over `rows` concatenated (at most the launch capacity in all), writing
    /// their features: row `r`'s start at token `sum of the earlier rows' lengths`.
    pub fn run(&mut self, rows: &[&Row]) -> Result<()> {
        let (cap, vocab) = (self.layout.tokens, self.config.vocab_size);
        let total: usize = rows.iter().map(|r| r.tokens.len()).sum();
        if total == 0 || total > cap {
            return Err(Error::invalid(
                "rows",
                format!("{total} tokens in one launch; the target was laid out for 1..={cap}"),
            ));
        }
        let (mut tokens, mut positions, mut docs, mut padding) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, row) in rows.iter().enumerate() {
            row.validate().map_err(|e| Error::invalid(format!("row {i}"), e.to_string()))?;
            if let Some(&bad) = row.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(Error::invalid(
                    format!("row {i}"),
                    format!("token id {bad} is not below the vocab size {vocab}"),
                ));
            }
            let start = tokens.len();
            let mut covered = start;
            for run in document_runs(&row.doc_ids) {
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
            positions.extend(row.positions.iter().map(|&p| p as u32));
        }
        let mut segments: Vec<Range<usize>> = docs.iter().chain(&padding).cloned().collect();
        segments.sort_by_key(|r| r.start);
        self.tokens = total;
        self.padding = padding;
        let lay = &self.layout;
        self.dev.upload(self.at(lay.token_ids), bytes_of(&tokens))?;
        self.dev.upload(self.at(lay.positions), bytes_of(&positions))?;
        if lay.gdn.is_some() {
            self.dev.upload(self.at(lay.segments), bytes_of(&segment_table(&segments, total, false)))?;
        }
        // The RoPE tables of the positions, rows copied as stored-width columns.
        let cols = self.config.rope.rotary_dim * <B::Elem as Elem>::Acc::BYTES / B::Elem::BYTES;
        let ops = self.dev.ops();
        ops.copy_rows(false, self.at(lay.cos_table), self.at(lay.positions), self.at(lay.cos), total, cols)?;
        ops.copy_rows(false, self.at(lay.sin_table), self.at(lay.positions), self.at(lay.sin), total, cols)?;
        // The causal plan of each distinct document length, uploaded once (attention layers only).
        let mut plans = HashMap::new();
        if lay.attn.is_some() {
            let group_rows = KeyRanges::causal_group_rows(self.config.num_heads / self.config.num_kv_heads);
            for run in &docs {
                if let std::collections::hash_map::Entry::Vacant(e) = plans.entry(run.len()) {
                    e.insert(self.dev.upload_ranges(&KeyRanges::causal(run.len(), AttnKind::Full, group_rows)?)?);
                }
            }
        }
        let rope = (self.at(lay.cos), self.at(lay.sin));
        self.forward(total, rope, Mode::Rows(Launch { docs: &docs, segments: &segments, plans: &plans }))
    }

    /// The address of a decoding launch's token ids (u32 `[t]`, written by the caller).
    pub fn tokens_addr(&self) -> u64 {
        self.at(self.layout.token_ids)
    }

    /// Where the next tokens (u32 `[R]`) of the last decoding launch live.
    pub fn next_addr(&self) -> Result<u64> {
        Ok(self.at(self.decode_regions()?.next))
    }

    /// The causal plan of `t` tokens after `past` cached positions (uploaded in stream order,
    /// without a wait: [`Backend::upload_ranges`]).
    pub fn decode_plans(&self, past: usize, t: usize) -> Result<HybridDecodePlans<B>> {
        let attention = match self.layout.attn {
            None => None,
            Some(_) => {
                let group_rows = KeyRanges::causal_group_rows(self.config.num_heads / self.config.num_kv_heads);
                Some(self.dev.upload_ranges(&KeyRanges::causal_after(past, t, AttnKind::Full, group_rows)?)?)
            }
        };
        Ok(HybridDecodePlans { past, t, attention })
    }

    /// Decodes and keeps `t` tokens whose ids are at [`HybridForward::tokens_addr`], at positions
    /// `past..past+t` after `past` cached ones (`past` 0 starts a new sequence): the attention
    /// caches are written from `past` on, the GatedDeltaNet states and windows advanced by the
    /// `t` tokens; their features `[t, F*H]` are written and the argmax of the logits of the last
    /// `logit_rows` rows goes to the next tokens.
    pub fn decode(&mut self, t: usize, past: usize, logit_rows: usize) -> Result<()> {
        let plans = self.decode_plans(past, t)?;
        let d = self.decode_regions()?;
        let tables = match t <= d.logit_rows {
            true => d.tables[t.max(1) - 1],
            false => {
                let tables = d.launch_tables;
                self.check_launch(&plans, logit_rows)?;
                self.upload_tables(tables, t)?;
                tables
            }
        };
        if past == 0 {
            self.reset()?;
        }
        self.launch(&plans, logit_rows, tables, false)
    }

    /// Decodes `plans.t` tokens (at most the logit rows) as [`HybridForward::decode`] does but
    /// keeps none: the GatedDeltaNet states stay as they were, and [`HybridForward::keep`] then
    /// advances them by a prefix of the launch.
    pub fn verify(&mut self, plans: &HybridDecodePlans<B>, logit_rows: usize) -> Result<()> {
        let d = self.decode_regions()?;
        if plans.t > d.logit_rows || plans.past == 0 {
            return Err(Error::invalid(
                "verify",
                format!(
                    "{} tokens after {} cached positions; a verify launch takes 1..={} tokens after a kept prefix",
                    plans.t, plans.past, d.logit_rows
                ),
            ));
        }
        let tables = d.tables[plans.t.max(1) - 1];
        self.launch(plans, logit_rows, tables, true)?;
        self.verified = Some(plans.t);
        Ok(())
    }

    /// Keeps the first `kept` tokens of the last verify launch: each GatedDeltaNet state and conv
    /// window advanced by them (the delta rule rerun over their saved inputs); the attention
    /// caches need nothing (the next launch at `past + kept` overwrites the rest).
    pub fn keep(&mut self, kept: usize) -> Result<()> {
        let t = self.verified.take().ok_or_else(|| Error::invalid("keep", "no verify launch to keep a prefix of"))?;
        if kept == 0 || kept > t {
            return Err(Error::invalid("keep", format!("{kept} tokens of a verify launch of {t}")));
        }
        let d = self.decode_regions()?;
        let s = self.layout.gdn;
        let (gdn, at) = (self.dev.gdn_ops(), |r: Region| self.at(r));
        let shape = GdnShape::new(&self.config.gdn, kept);
        let row = (shape.conv_channels() * B::Elem::BYTES) as u64;
        let window = (shape.conv_kernel - 1) * row as usize;
        let one = one_segment(kept);
        let docs = Segments { ranges: &one, table: at(d.tables[kept - 1].delta), resume: true };
        for cache in &d.caches {
            let (LayerCacheRegions::Gdn(c), Some(s)) = (cache, s) else { continue };
            self.dev.copy(at(c.window), at(c.pre) + kept as u64 * row, window)?;
            let buffers = DeltaBuffers { qkv: at(c.qkv), beta: at(c.beta), g: at(c.g), out: at(s.o) };
            let scratch = DeltaScratch { w: at(s.w), u: at(s.u), states: at(s.states), carry: at(c.state) };
            for group in groups(&one, shape) {
                gdn.gated_delta(buffers, scratch, shape, docs, group)?;
            }
        }
        Ok(())
    }

    /// Zeroes every GatedDeltaNet state and conv window (a new sequence).
    fn reset(&self) -> Result<()> {
        for cache in &self.decode_regions()?.caches {
            if let LayerCacheRegions::Gdn(c) = cache {
                self.dev.zero(self.at(c.state), c.state.bytes as usize)?;
                self.dev.zero(self.at(c.window), c.window.bytes as usize)?;
            }
        }
        Ok(())
    }

    /// Refuses a launch the layout cannot take.
    fn check_launch(&self, plans: &HybridDecodePlans<B>, logit_rows: usize) -> Result<()> {
        let (t, past, d) = (plans.t, plans.past, self.decode_regions()?);
        if t == 0 || t > self.layout.tokens || logit_rows == 0 || logit_rows > t.min(d.logit_rows) {
            return Err(Error::invalid(
                "decode",
                format!(
                    "{t} tokens with {logit_rows} logit rows; the target was laid out for 1..={} tokens and up to {} rows",
                    self.layout.tokens, d.logit_rows
                ),
            ));
        }
        if past + t > d.context {
            return Err(Error::invalid(
                "decode",
                format!("positions {past}..{} exceed the context of {} the caches hold", past + t, d.context),
            ));
        }
        Ok(())
    }

    /// A decoding launch under `plans` with the segment tables `tables`, then the next tokens.
    fn launch(
        &mut self,
        plans: &HybridDecodePlans<B>,
        logit_rows: usize,
        tables: DecodeTables,
        verify: bool,
    ) -> Result<()> {
        self.check_launch(plans, logit_rows)?;
        let (t, past) = (plans.t, plans.past);
        self.tokens = t;
        self.padding.clear();
        self.verified = None;
        // Consecutive positions: their RoPE tables are rows past.. of the position tables.
        let row = (self.config.rope.rotary_dim * <B::Elem as Elem>::Acc::BYTES * past) as u64;
        let rope = (self.at(self.layout.cos_table) + row, self.at(self.layout.sin_table) + row);
        let cached = Cached { past, plan: plans.attention.as_ref(), tables, verify };
        self.forward(t, rope, Mode::Decode(cached))?;
        let d = self.decode_regions()?;
        let head = self.frozen_tables().1.expect("a decoding layout holds its LM head");
        let lay = &self.layout;
        let scratch = (self.at(lay.xn), self.at(lay.inv), self.at(d.logits), self.at(d.next));
        let dims = (t, self.config.hidden_size, self.config.vocab_size, self.config.rms_norm_eps);
        super::next_tokens(&self.dev, self.at(lay.x), (self.at(d.final_norm), head), scratch, dims, logit_rows)
    }

    /// The logits of the last decoding launch's `rows` logit rows on the host, as f64 `[rows][V]`.
    pub fn logits_to_host(&self, rows: usize) -> Result<Vec<Vec<f64>>> {
        let (d, v) = (self.decode_regions()?, self.config.vocab_size);
        super::logits_to_host(&self.dev, self.at(d.logits), (rows, d.logit_rows), v)
    }

    /// The layers over the uploaded launch of `t` tokens with its RoPE tables `(cos, sin)`
    /// `[t, r]`.
    fn forward(&self, t: usize, rope: (u64, u64), mode: Mode<'_, B::Ranges>) -> Result<()> {
        let (lay, ops) = (&self.layout, self.dev.ops());
        let (h, i, eps) = (self.config.hidden_size, self.config.intermediate_size, self.config.rms_norm_eps);
        let e = B::Elem::BYTES as u64;
        let (x, xn, inv) = (self.at(lay.x), self.at(lay.xn), self.at(lay.inv));
        ops.copy_rows(false, self.at(lay.embed), self.at(lay.token_ids), x, t, h)?;
        for (l, w) in lay.layers.iter().enumerate() {
            ops.rms_norm_forward(x, self.at(w.input_norm), xn, inv, t, h, eps)?;
            let cache = lay.decode.as_ref().map(|d| d.caches[l]);
            match (&w.mixer, &mode, cache) {
                (MixerRegions::Gdn(g), Mode::Rows(launch), _) => self.gdn_mixer(g, t, launch.segments)?,
                (MixerRegions::Gdn(g), Mode::Decode(c), Some(LayerCacheRegions::Gdn(state))) => {
                    self.gdn_decode(g, &state, t, c)?
                }
                (MixerRegions::Attention(a), Mode::Rows(_), _) => self.attention_mixer(a, t, rope, &mode, None)?,
                (MixerRegions::Attention(a), Mode::Decode(_), Some(LayerCacheRegions::Attention { k, v })) => {
                    self.attention_mixer(a, t, rope, &mode, Some((self.at(k), self.at(v))))?
                }
                _ => return Err(Error::invalid("decode", format!("layer {l}: its cache is not of its kind"))),
            }
            // x += down(silu(gate) * up) of post_norm(x).
            ops.rms_norm_forward(x, self.at(w.post_norm), xn, inv, t, h, eps)?;
            let (gate_up, hidden) = (self.at(lay.mlp.gate_up), self.at(lay.mlp.h));
            self.dev.linear(xn, t, h, self.at(w.gate_up), 2 * i, gate_up, 0.0)?;
            ops.swiglu_forward(gate_up, hidden, t, i)?;
            self.dev.linear(hidden, t, i, self.at(w.down), h, x, 1.0)?;
            for (f, _) in self.layer_ids.iter().enumerate().filter(|(_, &id)| id == l) {
                ops.copy_rows(true, x, self.at(lay.feature_rows[f]), self.features_addr(), t, h)?;
            }
        }
        let fw = self.layer_ids.len() * h;
        for pad in &self.padding {
            self.dev.zero(self.features_addr() + (pad.start * fw) as u64 * e, pad.len() * fw * e as usize)?;
        }
        Ok(())
    }

    /// `x += out_proj(gated_norm(delta_rule(conv(xn W_qkv^T)), xn W_z^T))`, the state and the
    /// conv window restarting at each of `segments`.
    fn gdn_mixer(&self, w: &GdnWeightRegions, t: usize, segments: &[Range<usize>]) -> Result<()> {
        let s = self.layout.gdn.expect("a layout with GatedDeltaNet layers holds their scratch");
        let (gdn, h, xn) = (self.dev.gdn_ops(), self.config.hidden_size, self.at(self.layout.xn));
        let shape = GdnShape::new(&self.config.gdn, t);
        let at = |r: Region| self.at(r);
        let docs = Segments { ranges: segments, table: self.at(self.layout.segments), resume: false };
        self.dev.linear(xn, t, h, at(w.in_proj_qkv), shape.conv_channels(), at(s.qkv_pre), 0.0)?;
        gdn.conv1d_silu(at(s.qkv_pre), at(w.conv1d), at(s.qkv), shape, docs)?;
        let delta = DeltaBuffers { qkv: at(s.qkv), beta: at(s.beta), g: at(s.g), out: at(s.o) };
        self.gdn_after_conv(w, shape, delta, at(s.carry), docs)
    }

    /// The GatedDeltaNet token mixer after its conv (whose output is `delta.qkv`): z, b and a
    /// projected from `xn`, the gates into `delta.beta`, `delta.g`, the delta rule over `docs`
    /// with its state in `carry`, then `x += out_proj(gated_norm(o, z))`.
    fn gdn_after_conv(
        &self,
        w: &GdnWeightRegions,
        shape: GdnShape,
        delta: DeltaBuffers,
        carry: u64,
        docs: Segments<'_>,
    ) -> Result<()> {
        let s = self.layout.gdn.expect("a layout with GatedDeltaNet layers holds their scratch");
        let (gdn, h, eps) = (self.dev.gdn_ops(), self.config.hidden_size, self.config.rms_norm_eps);
        let (xn, t, hv, vd) = (self.at(self.layout.xn), shape.tokens, shape.value_heads, shape.value_dim());
        let at = |r: Region| self.at(r);
        self.dev.linear(xn, t, h, at(w.in_proj_z), vd, at(s.z), 0.0)?;
        self.dev.linear(xn, t, h, at(w.in_proj_b), hv, at(s.b), 0.0)?;
        self.dev.linear(xn, t, h, at(w.in_proj_a), hv, at(s.a), 0.0)?;
        let gates = GateInputs { b: at(s.b), a: at(s.a), a_log: at(w.a_log), dt_bias: at(w.dt_bias) };
        gdn.gdn_gates(gates, delta.beta, delta.g, shape)?;
        let scratch = DeltaScratch { w: at(s.w), u: at(s.u), states: at(s.states), carry };
        for group in groups(docs.ranges, shape) {
            gdn.gated_delta(delta, scratch, shape, docs, group)?;
        }
        gdn.gated_rms_norm(at(s.o), at(s.z), at(w.norm), at(s.o), shape, eps)?;
        self.dev.linear(at(s.o), t, vd, at(w.out_proj), h, at(self.layout.x), 1.0)
    }

    /// [`HybridForward::gdn_mixer`] of a decoding launch of `t` tokens, one sequence after the
    /// layer's kept state: the conv over the kept window then the launch's inputs, the delta
    /// rule resuming the kept state. A kept launch advances the state and the window; a verify
    /// launch runs on a copy of the state and saves its conv input and the delta rule's inputs
    /// for [`HybridForward::keep`].
    fn gdn_decode(
        &self,
        w: &GdnWeightRegions,
        c: &GdnCacheRegions,
        t: usize,
        launch: &Cached<'_, B::Ranges>,
    ) -> Result<()> {
        let s = self.layout.gdn.expect("a layout with GatedDeltaNet layers holds their scratch");
        let (gdn, h) = (self.dev.gdn_ops(), self.config.hidden_size);
        let shape = GdnShape::new(&self.config.gdn, t);
        let (ch, k) = (shape.conv_channels(), shape.conv_kernel);
        let row = (ch * B::Elem::BYTES) as u64;
        let (xn, at) = (self.at(self.layout.xn), |r: Region| self.at(r));
        // The conv input `[K-1+t, C]`: the kept window, then the launch's projections.
        let pre = if launch.verify { at(c.pre) } else { at(s.qkv_pre) };
        self.dev.copy(pre, at(c.window), (k - 1) * row as usize)?;
        self.dev.linear(xn, t, h, at(w.in_proj_qkv), ch, pre + (k - 1) as u64 * row, 0.0)?;
        let window_and_launch = one_segment(k - 1 + t);
        let conv = Segments { ranges: &window_and_launch, table: at(launch.tables.conv), resume: false };
        gdn.conv1d_silu(pre, at(w.conv1d), at(s.qkv), GdnShape { tokens: k - 1 + t, ..shape }, conv)?;
        let conv_out = at(s.qkv) + (k - 1) as u64 * row;
        let (qkv, beta, g) = match launch.verify {
            true => {
                self.dev.copy(at(c.qkv), conv_out, t * row as usize)?;
                (at(c.qkv), at(c.beta), at(c.g))
            }
            false => (conv_out, at(s.beta), at(s.g)),
        };
        // A verify launch reads a copy of the state; a kept one advances the state and window.
        let carry = match launch.verify {
            true => {
                self.dev.copy(at(s.carry), at(c.state), c.state.bytes as usize)?;
                at(s.carry)
            }
            false => {
                self.dev.copy(at(c.window), pre + t as u64 * row, (k - 1) * row as usize)?;
                at(c.state)
            }
        };
        let one = one_segment(t);
        let docs = Segments { ranges: &one, table: at(launch.tables.delta), resume: true };
        self.gdn_after_conv(w, shape, DeltaBuffers { qkv, beta, g, out: at(s.o) }, carry, docs)
    }

    /// `x += o_proj(attention(rope(norm(q)), rope(norm(k)), v) * sigmoid(gate))` with the RoPE
    /// tables `rope` `[t, r]`: causal per document (padding rows zero) over packed rows; when
    /// decoding, k and v written into the layer's caches `kv` after the cached positions and the
    /// attention over them.
    fn attention_mixer(
        &self,
        w: &GatedAttnWeightRegions,
        t: usize,
        (cos, sin): (u64, u64),
        mode: &Mode<'_, B::Ranges>,
        kv: Option<(u64, u64)>,
    ) -> Result<()> {
        let s = self.layout.attn.expect("a layout with attention layers holds their scratch");
        let (gdn, ops) = (self.dev.gdn_ops(), self.dev.ops());
        let c = &self.config;
        let (h, d, nh, nkv, eps) = (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, c.rms_norm_eps);
        let (qd, kd, e) = (nh * d, nkv * d, B::Elem::BYTES as u64);
        let (xn, at) = (self.at(self.layout.xn), |r: Region| self.at(r));
        // Where this launch's k and v go: the scratch, or the caches after the past positions.
        let past = match mode {
            Mode::Decode(cached) => cached.past,
            Mode::Rows(_) => 0,
        };
        let skip = (past * kd) as u64 * e;
        let (k, v) = kv.map_or((at(s.k), at(s.v)), |(k, v)| (k + skip, v + skip));
        self.dev.linear(xn, t, h, at(w.q_proj), qd, at(s.q), 0.0)?;
        self.dev.linear(xn, t, h, at(w.q_proj) + (qd * h) as u64 * e, qd, at(s.gate), 0.0)?;
        self.dev.linear(xn, t, h, at(w.k_proj), kd, at(s.k), 0.0)?;
        self.dev.linear(xn, t, h, at(w.v_proj), kd, v, 0.0)?;
        // Head norms into `out` (free until the attention), then partial RoPE back (k into `k`).
        for (x, y, norm, inv, heads) in [(s.q, at(s.q), w.q_norm, s.inv_q, nh), (s.k, k, w.k_norm, s.inv_k, nkv)] {
            ops.rms_norm_forward(at(x), at(norm), at(s.out), at(inv), t * heads, d, eps)?;
            let dims = Heads { tokens: t, heads, head_dim: d };
            gdn.partial_rope(at(s.out), cos, sin, y, dims, c.rope.rotary_dim)?;
        }
        let shape = AttnShape { num_heads: nh, num_kv_heads: nkv, head_dim: d };
        match mode {
            Mode::Rows(launch) => {
                for run in launch.docs {
                    let (q_off, k_off) = ((run.start * qd) as u64 * e, (run.start * kd) as u64 * e);
                    let qkv = (at(s.q) + q_off, k + k_off, v + k_off);
                    self.dev.attention_forward(
                        &launch.plans[&run.len()],
                        shape,
                        qkv,
                        (at(s.out) + q_off, at(s.lse)),
                    )?;
                }
                for pad in &self.padding {
                    self.dev.zero(at(s.out) + (pad.start * qd) as u64 * e, pad.len() * qd * e as usize)?;
                }
            }
            Mode::Decode(cached) => {
                let plan = cached.plan.expect("a decoding launch with attention layers has their plan");
                self.dev.attention_forward(plan, shape, (at(s.q), k - skip, v - skip), (at(s.out), at(s.lse)))?;
            }
        }
        gdn.output_gate(at(s.out), at(s.gate), at(s.out), t * qd)?;
        self.dev.linear(at(s.out), t, qd, at(w.o_proj), h, self.at(self.layout.x), 1.0)
    }

    /// The features of the last launch on the host, `[tokens, F*H]` as f64.
    pub fn features_to_host(&self) -> Result<Vec<f64>> {
        let n = self.tokens * self.layer_ids.len() * self.config.hidden_size;
        Ok(download::<B::Elem, B>(&self.dev, self.features_addr(), n)?.into_iter().map(Elem::to_f64).collect())
    }
}
