//! The frozen target's forward over packed training rows (spec sections 3 and 9), layer by layer
//! over a backend: on the GPU in bf16 with fp32 accumulation (cuBLAS, the fused causal attention,
//! `elementwise.cu`), or on the CPU with their twins. Only layers `0..=max(target_layer_ids)` run
//! (no final norm, no logits); each tapped layer's output is scattered into the features
//! `[T, F*H]` (concatenated per token, in `target_layer_ids` order) that the drafter reads.
//!
//! Packed rows: attention runs once per document (a causal plan over its own tokens, positions
//! from the row's `positions`), so a document sees no other; padding tokens get zero features.
//! Shapes: T tokens per launch (rows concatenated), H hidden, I SwiGLU, nh/nkv heads of d.

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use dflash_reference::config::{TargetArch, TargetConfig};
use dflash_reference::data::{document_runs, Row};
use dflash_reference::ops::rope_tables_scaled;

use crate::backend::{download, Allocation, Backend};
use crate::memory::target::TargetLayout;
use crate::memory::Region;
use crate::ops::attention::ranges::KeyRanges;
use crate::ops::attention::AttnShape;
use crate::ops::elementwise::{ElementwiseOps, HeadNormRope, Heads};
use crate::ops::{bytes_of, stored, Elem, Real};
use crate::{Error, Result};

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
        let widths = (B::Elem::BYTES as u64, <B::Elem as Elem>::Acc::BYTES as u64);
        let layout = TargetLayout::new(config, layer_ids, max_tokens, widths, with_lm_head, true)?;
        let device = format!("{} (target, {max_tokens} tokens per launch)", dev.name());
        layout.check_fits(dev.available_bytes()?, &device)?;
        let bytes = usize::try_from(layout.bytes)
            .map_err(|_| Error::Memory(format!("{device}: {} bytes exceed the address space", layout.bytes)))?;
        let memory = dev.alloc("target", bytes)?;
        let base = memory.ptr();
        let c = &config.dims;
        let all: Vec<usize> = (0..max_tokens).collect();
        let (cos, sin) = rope_tables_scaled(&all, c.head_dim, c.rope_theta, &config.rope_scaling, DType::F64)?;
        dev.upload(layout.cos_table.at(base), bytes_of(&acc::<B::Elem>(cos)?))?;
        dev.upload(layout.sin_table.at(base), bytes_of(&acc::<B::Elem>(sin)?))?;
        let f = layer_ids.len() as u32;
        for (i, rows) in layout.feature_rows.iter().enumerate() {
            let idx: Vec<u32> = (0..max_tokens as u32).map(|t| t * f + i as u32).collect();
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
        for (l, w) in self.layout.layers.iter().enumerate() {
            let name = |n: &str| format!("model.layers.{l}.{n}.weight");
            put(w.input_norm, &name("input_layernorm"), &[z.h])?;
            put(w.q, &name("self_attn.q_proj"), &[z.qd, z.h])?;
            put(w.k, &name("self_attn.k_proj"), &[z.kd, z.h])?;
            put(w.v, &name("self_attn.v_proj"), &[z.kd, z.h])?;
            put(w.o, &name("self_attn.o_proj"), &[z.h, z.qd])?;
            if let (Some(qn), Some(kn)) = (w.q_norm, w.k_norm) {
                put(qn, &name("self_attn.q_norm"), &[z.d])?;
                put(kn, &name("self_attn.k_norm"), &[z.d])?;
            }
            put(w.post_norm, &name("post_attention_layernorm"), &[z.h])?;
            let half = (z.i * z.h * B::Elem::BYTES) as u64;
            put(Region { bytes: half, ..w.gate_up }, &name("mlp.gate_proj"), &[z.i, z.h])?;
            put(w.gate_up.skip(half), &name("mlp.up_proj"), &[z.i, z.h])?;
            put(w.down, &name("mlp.down_proj"), &[z.h, z.i])?;
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
        self.dev.upload(self.at(lay.positions), bytes_of(&positions))?;
        // The launch's RoPE tables: rows of the position tables (copied as stored-width columns).
        let cols = z.d * <B::Elem as Elem>::Acc::BYTES / B::Elem::BYTES;
        let ops = self.dev.ops();
        ops.copy_rows(false, self.at(lay.cos_table), self.at(lay.positions), self.at(lay.cos), total, cols)?;
        ops.copy_rows(false, self.at(lay.sin_table), self.at(lay.positions), self.at(lay.sin), total, cols)?;
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
        self.forward(total, &docs, &plans)
    }

    /// The layers over the uploaded launch of `t` tokens.
    fn forward(
        &self,
        t: usize,
        docs: &[std::ops::Range<usize>],
        plans: &HashMap<(usize, dflash_reference::config::AttnKind), B::Ranges>,
    ) -> Result<()> {
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
            self.dev.linear(xn, t, z.h, at(w.q), z.qd, at(s.q_pre), 0.0)?;
            self.dev.linear(xn, t, z.h, at(w.k), z.kd, at(s.k_pre), 0.0)?;
            self.dev.linear(xn, t, z.h, at(w.v), z.kd, at(s.v), 0.0)?;
            let sides = [(s.q_pre, w.q_norm, s.q, s.inv_q, z.nh), (s.k_pre, w.k_norm, s.k, s.inv_k, z.nkv)];
            for (pre, norm, out, inv, heads) in sides {
                let dims = Heads { tokens: t, heads, head_dim: z.d };
                match (self.config.arch, norm) {
                    (TargetArch::Qwen3, Some(norm)) => {
                        let f = HeadNormRope { x: at(pre), w: at(norm), cos: at(lay.cos), sin: at(lay.sin) };
                        ops.head_norm_rope_forward(f, at(out), at(inv), dims, eps)?
                    }
                    _ => ops.rope_forward(at(pre), at(lay.cos), at(lay.sin), at(out), dims)?,
                }
            }
            // Causal attention per document; padding rows attend to nothing (zero output).
            let kind = self.config.dims.layer_kinds[l];
            for run in docs {
                let (q_off, k_off) = ((run.start * z.qd) as u64 * e, (run.start * z.kd) as u64 * e);
                let qkv = (at(s.q) + q_off, at(s.k) + k_off, at(s.v) + k_off);
                self.dev.attention_forward(&plans[&(run.len(), kind)], shape, qkv, (at(s.out) + q_off, at(s.lse)))?;
            }
            for pad in &self.padding {
                self.dev.zero(at(s.out) + (pad.start * z.qd) as u64 * e, pad.len() * z.qd * e as usize)?;
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

/// `t`'s values in the arithmetic type of `E`.
fn acc<E: Elem>(t: Tensor) -> Result<Vec<E::Acc>> {
    Ok(t.flatten_all()?.to_vec1::<f64>()?.into_iter().map(E::Acc::from_f64).collect())
}
