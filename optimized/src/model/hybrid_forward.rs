//! The frozen hybrid target's forward (spec section 10: Qwen3.5/3.6, GatedDeltaNet and gated
//! attention layers) over packed training rows, layer by layer over a backend: the matmuls, the
//! norms, SwiGLU and the causal attention through the backend's ops, the GatedDeltaNet, partial
//! RoPE and output gate through its [`GdnOps`] (the CPU twins, or `gdn.cu`). Only layers
//! `0..=max(target_layer_ids)` run (no final norm, no logits); each tapped layer's output is
//! scattered into the features `[T, F*H]` (concatenated per token, in `layer_ids` order).
//!
//! Packed rows: each document restarts the conv window and the delta rule's state, and its
//! attention is causal over its own tokens (positions from the row), so a document sees no
//! other; padding tokens get zero features. Zero-centred norms (`x / rms(x) * (1 + w)`) run as
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
use crate::memory::hybrid::{GatedAttnWeightRegions, GdnWeightRegions, HybridLayout, MixerRegions};
use crate::memory::Region;
use crate::ops::attention::ranges::KeyRanges;
use crate::ops::attention::AttnShape;
use crate::ops::elementwise::{ElementwiseOps, Heads};
use crate::ops::gdn::{groups, segment_table, DeltaBuffers, DeltaScratch, GateInputs, GdnShape, Segments};
use crate::ops::{arithmetic, bytes_of, stored, Elem, Real};
use crate::{Error, Result};

/// HF weight names (suffixes) of the zero-centred norms: loaded as `1 + w`.
const ZERO_CENTRED: [&str; 4] =
    ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight"];

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
}

/// A launch's documents: `docs` (attention, per document) and `segments` (the GatedDeltaNet's
/// restarts: the documents and the padding runs, tiling `0..T`), with the causal plan of each
/// document length.
struct Launch<'a, R> {
    docs: &'a [Range<usize>],
    segments: &'a [Range<usize>],
    plans: &'a HashMap<usize, R>,
}

impl<B: Backend> HybridForward<B> {
    /// Lays out the forward of `config` tapping `layer_ids` for launches of up to `max_tokens`
    /// tokens, checks that the backend has the hybrid ops and that it fits its free memory, then
    /// allocates it: a target that cannot fit is refused before anything is allocated, naming
    /// its largest items.
    pub fn new(dev: B, config: &HybridConfig, layer_ids: &[usize], max_tokens: usize) -> Result<Self> {
        let widths = (B::Elem::BYTES as u64, <B::Elem as Elem>::Acc::BYTES as u64);
        let layout = HybridLayout::new(config, layer_ids, max_tokens, widths)?;
        dev.gdn_ops().check_shape(GdnShape::new(&config.gdn, max_tokens))?;
        let device = format!("{} (hybrid target, {max_tokens} tokens per launch)", dev.name());
        layout.plan()?.check_fits(dev.available_bytes()?, &device)?;
        let bytes = usize::try_from(layout.bytes)
            .map_err(|_| Error::Memory(format!("{device}: {} bytes exceed the address space", layout.bytes)))?;
        let memory = dev.alloc("hybrid target", bytes)?;
        let base = memory.ptr();
        let all: Vec<usize> = (0..max_tokens).collect();
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
        })
    }

    fn at(&self, r: Region) -> u64 {
        r.at(self.base)
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
            self.dev.upload(self.at(*region), bytes_of(&stored::<B::Elem>(&t)?))?;
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
        self.forward(total, Launch { docs: &docs, segments: &segments, plans: &plans })
    }

    /// The layers over the uploaded launch of `t` tokens.
    fn forward(&self, t: usize, launch: Launch<'_, B::Ranges>) -> Result<()> {
        let (lay, ops) = (&self.layout, self.dev.ops());
        let (h, i, eps) = (self.config.hidden_size, self.config.intermediate_size, self.config.rms_norm_eps);
        let e = B::Elem::BYTES as u64;
        let (x, xn, inv) = (self.at(lay.x), self.at(lay.xn), self.at(lay.inv));
        ops.copy_rows(false, self.at(lay.embed), self.at(lay.token_ids), x, t, h)?;
        for (l, w) in lay.layers.iter().enumerate() {
            ops.rms_norm_forward(x, self.at(w.input_norm), xn, inv, t, h, eps)?;
            match &w.mixer {
                MixerRegions::Gdn(g) => self.gdn_mixer(g, t, launch.segments)?,
                MixerRegions::Attention(a) => self.attention_mixer(a, t, &launch)?,
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
        let (gdn, h, eps) = (self.dev.gdn_ops(), self.config.hidden_size, self.config.rms_norm_eps);
        let shape = GdnShape::new(&self.config.gdn, t);
        let (xn, hv, vd) = (self.at(self.layout.xn), shape.value_heads, shape.value_dim());
        let at = |r: Region| self.at(r);
        let docs = Segments { ranges: segments, table: self.at(self.layout.segments), resume: false };
        self.dev.linear(xn, t, h, at(w.in_proj_qkv), shape.conv_channels(), at(s.qkv_pre), 0.0)?;
        gdn.conv1d_silu(at(s.qkv_pre), at(w.conv1d), at(s.qkv), shape, docs)?;
        self.dev.linear(xn, t, h, at(w.in_proj_z), vd, at(s.z), 0.0)?;
        self.dev.linear(xn, t, h, at(w.in_proj_b), hv, at(s.b), 0.0)?;
        self.dev.linear(xn, t, h, at(w.in_proj_a), hv, at(s.a), 0.0)?;
        let gates = GateInputs { b: at(s.b), a: at(s.a), a_log: at(w.a_log), dt_bias: at(w.dt_bias) };
        gdn.gdn_gates(gates, at(s.beta), at(s.g), shape)?;
        let buffers = DeltaBuffers { qkv: at(s.qkv), beta: at(s.beta), g: at(s.g), out: at(s.o) };
        let scratch = DeltaScratch { w: at(s.w), u: at(s.u), states: at(s.states), carry: at(s.carry) };
        for group in groups(segments, shape) {
            gdn.gated_delta(buffers, scratch, shape, docs, group)?;
        }
        gdn.gated_rms_norm(at(s.o), at(s.z), at(w.norm), at(s.o), shape, eps)?;
        self.dev.linear(at(s.o), t, vd, at(w.out_proj), h, self.at(self.layout.x), 1.0)
    }

    /// `x += o_proj(attention(rope(norm(q)), rope(norm(k)), v) * sigmoid(gate))`, causal per
    /// document (padding rows zero).
    fn attention_mixer(&self, w: &GatedAttnWeightRegions, t: usize, launch: &Launch<'_, B::Ranges>) -> Result<()> {
        let s = self.layout.attn.expect("a layout with attention layers holds their scratch");
        let (gdn, ops) = (self.dev.gdn_ops(), self.dev.ops());
        let c = &self.config;
        let (h, d, nh, nkv, eps) = (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, c.rms_norm_eps);
        let (qd, kd, e) = (nh * d, nkv * d, B::Elem::BYTES as u64);
        let (xn, at) = (self.at(self.layout.xn), |r: Region| self.at(r));
        let (cos, sin) = (at(self.layout.cos), at(self.layout.sin));
        self.dev.linear(xn, t, h, at(w.q_proj), qd, at(s.q), 0.0)?;
        self.dev.linear(xn, t, h, at(w.q_proj) + (qd * h) as u64 * e, qd, at(s.gate), 0.0)?;
        self.dev.linear(xn, t, h, at(w.k_proj), kd, at(s.k), 0.0)?;
        self.dev.linear(xn, t, h, at(w.v_proj), kd, at(s.v), 0.0)?;
        // Head norms into `out` (free until the attention), then partial RoPE back.
        for (x, norm, inv, heads) in [(s.q, w.q_norm, s.inv_q, nh), (s.k, w.k_norm, s.inv_k, nkv)] {
            ops.rms_norm_forward(at(x), at(norm), at(s.out), at(inv), t * heads, d, eps)?;
            let dims = Heads { tokens: t, heads, head_dim: d };
            gdn.partial_rope(at(s.out), cos, sin, at(x), dims, c.rope.rotary_dim)?;
        }
        let shape = AttnShape { num_heads: nh, num_kv_heads: nkv, head_dim: d };
        for run in launch.docs {
            let (q_off, k_off) = ((run.start * qd) as u64 * e, (run.start * kd) as u64 * e);
            let qkv = (at(s.q) + q_off, at(s.k) + k_off, at(s.v) + k_off);
            self.dev.attention_forward(&launch.plans[&run.len()], shape, qkv, (at(s.out) + q_off, at(s.lse)))?;
        }
        for pad in &self.padding {
            self.dev.zero(at(s.out) + (pad.start * qd) as u64 * e, pad.len() * qd * e as usize)?;
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
