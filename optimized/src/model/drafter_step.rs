//! The drafter's training step (spec sections 1-3), forward and backward written out per layer
//! (llm.c style, no tape) over a backend: on the GPU in bf16 with fp32 accumulation (cuBLAS, the
//! fused attention, `elementwise.cu`), or on the CPU with their twins storing bf16, f32 or f64.
//! Every buffer is a region of the step's typed layout (`memory::step::StepLayout`), one
//! allocation made when the step is made (after checking that it fits), so the step's memory is
//! its plan.
//!
//! Shapes (one row): S context tokens, Q = N*B block rows, K = S + Q keys, H hidden, I SwiGLU,
//! nh/nkv heads of d. Each step writes every parameter's gradient once in the stored type (on the
//! GPU one bf16 rounding of an fp32-accumulated result, as PyTorch's bf16 autograd does); the
//! optimizer (`train::adamw`) accumulates steps and applies them to the master weights.

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use dflash_reference::config::{AttnKind, DraftConfig};
use dflash_reference::drafter::{param_shapes, DraftInput, Drafter, FrozenHead};
use dflash_reference::loss::BlockTargets;
use dflash_reference::mask::BlockLayout;
use dflash_reference::ops::rope_tables;

use crate::backend::{download, Allocation, Backend};
use crate::memory::step::{AttnActs, Checkpointing, LayerActs, OptimizerShape, StepLayout, StepShape};
use crate::memory::Region;
use crate::ops::attention::ranges::KeyRanges;
use crate::ops::attention::AttnShape;
use crate::ops::constants::NORM_PARTS;
use crate::ops::elementwise::{CeRows, ElementwiseOps, HeadNormRope, HeadNormRopeGrad, Heads, RmsNormGrad};
use crate::ops::matmul::Mat;
use crate::ops::{Elem, Real};
use crate::{Error, Result};

/// One parameter's place in the flat weight and gradient regions.
#[derive(Clone, Debug)]
pub struct ParamSlot {
    pub name: String,
    pub shape: Vec<usize>,
    /// Offset of element 0, in elements.
    pub offset: usize,
    pub len: usize,
}

/// What [`DrafterStep::step_with`] calls when the backward has queued a bucket's gradients.
pub type BucketDone<'a, B> = dyn FnMut(&DrafterStep<B>, usize) -> Result<()> + 'a;

/// The flat layout of the trainable parameters, in checkpoint-key order.
pub fn param_slots(config: &DraftConfig) -> Vec<ParamSlot> {
    let mut offset = 0;
    param_shapes(config)
        .into_iter()
        .map(|(name, shape)| {
            let len = shape.iter().product();
            let slot = ParamSlot { name, shape, offset, len };
            offset += len;
            slot
        })
        .collect()
}

/// The gradient buckets of the flat parameters in the order the step's backward completes them:
/// the final norm, layer L-1 down to layer 0, then `hidden_norm` and `fc` (contiguous ranges
/// that cover every parameter once). A bucket's gradients are final once its part of the
/// backward is queued: a data-parallel worker starts summing it with the others' while the rest
/// of the backward runs.
pub fn grad_buckets(config: &DraftConfig) -> Vec<std::ops::Range<usize>> {
    let slots = param_slots(config);
    let start = |name: &str| slots.iter().find(|s| s.name == name).map_or(0, |s| s.offset);
    let end = slots.last().map_or(0, |s| s.offset + s.len);
    let layers = config.dims.num_layers();
    // Layer l starts at its input norm; the final norm follows the last layer.
    let mut starts: Vec<usize> = (0..layers).map(|l| start(&format!("layers.{l}.input_layernorm.weight"))).collect();
    starts.push(start("norm.weight"));
    let last_layers = (0..layers).rev().map(|l| starts[l]..starts[l + 1]);
    std::iter::once(starts[layers]..end).chain(last_layers).chain(std::iter::once(0..starts[0])).collect()
}

/// What a forward of one layer is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Recompute {
    /// The step's forward: everything, through the layer output.
    No,
    /// The backward's recompute of a layer whose attention out/lse were kept.
    KeptAttention,
    /// The backward's recompute of the whole layer.
    All,
}

/// Queries or keys: which half of the attention's inputs a head norm + RoPE makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Q,
    K,
}

/// Which gradients to reduce: the last step's (stored) or the update's (the optimizer's
/// accumulated ones; the step's own when it has no accumulator).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grads {
    Step,
    Update,
}

/// What one step computed: the loss of its row (`sum w CE / sum w`, accumulated in f64) and the
/// row's total weight.
#[derive(Clone, Copy, Debug)]
pub struct StepLoss {
    pub loss: f64,
    pub total_weight: f64,
}

/// One parameter's regions in the flat weight and gradient buffers.
#[derive(Clone, Copy, Debug)]
struct Param {
    w: u64,
    g: u64,
}

/// Each layer's parameters, by role.
#[derive(Clone, Copy, Debug)]
struct LayerParams {
    input_norm: Param,
    q: Param,
    k: Param,
    v: Param,
    o: Param,
    q_norm: Param,
    k_norm: Param,
    post_norm: Param,
    /// gate_proj, immediately followed by up_proj (one matmul with the stacked weight).
    gate_up: Param,
    down: Param,
}

/// The drafter's training step for one config at fixed shapes under one checkpointing policy,
/// on a backend: the GPU (`DrafterStep<Cuda>`) or the CPU twins (`DrafterStep<Host<E>>`).
pub struct DrafterStep<B: Backend> {
    dev: B,
    pub config: DraftConfig,
    pub shape: StepShape,
    pub layout: StepLayout,
    /// The one allocation every region lives in.
    _memory: B::Alloc,
    base: u64,
    /// The frozen LM head `[V, H]`: the layout's, or the target forward's.
    lm_head: u64,
    slots: Vec<ParamSlot>,
    fc: Param,
    hidden_norm: Param,
    final_norm: Param,
    layers: Vec<LayerParams>,
    ranges: HashMap<AttnKind, B::Ranges>,
    /// The block rows with a nonzero CE weight, in the order their labels and weights were uploaded.
    ce_rows: Vec<u32>,
    /// Whether a step records the weighted rows' top-1 predictions ([`DrafterStep::predictions`]).
    record_predictions: bool,
    /// Whether the predictions region holds the last step's (on the current input).
    predicted: bool,
    total_weight: f64,
}

impl<B: Backend> DrafterStep<B> {
    /// Lays out the step of `config` at `shape` under `policy` (with the optimizer's whole state
    /// and its gradient accumulator when `optimizer`) for `dev`, checks that it fits in its free
    /// memory, then allocates it: a step that cannot fit is refused before anything is allocated,
    /// naming its largest items.
    pub fn new(dev: B, config: &DraftConfig, shape: StepShape, policy: Checkpointing, optimizer: bool) -> Result<Self> {
        let optimizer = optimizer.then(|| OptimizerShape::whole(param_slots(config).iter().map(|s| s.len).sum(), true));
        Self::with_head(dev, config, shape, policy, optimizer, None)
    }

    /// [`DrafterStep::new`] with the optimizer's regions `optimizer` (`StepLayout::with_head`),
    /// reading the frozen LM head `[V, H]` (stored) at `shared_head` when given (the target
    /// forward's, on the same device: no second copy), else holding its own (filled by
    /// [`DrafterStep::load_lm_head`]).
    pub fn with_head(
        dev: B,
        config: &DraftConfig,
        shape: StepShape,
        policy: Checkpointing,
        optimizer: Option<OptimizerShape>,
        shared_head: Option<u64>,
    ) -> Result<Self> {
        let elem = B::Elem::BYTES as u64;
        let widths = (elem, <B::Elem as Elem>::Acc::BYTES as u64);
        let layout = StepLayout::with_head(config, shape, policy, optimizer, widths, shared_head.is_none())?;
        let device =
            format!("{} ({} policy, S={} N={})", dev.name(), policy.name(), shape.context_len, shape.num_anchors);
        layout.check_fits(dev.available_bytes()?, &device)?;
        let bytes = usize::try_from(layout.bytes)
            .map_err(|_| Error::Memory(format!("{device}: {} bytes exceed the address space", layout.bytes)))?;
        let memory = dev.alloc("step", bytes)?;
        let base = memory.ptr();
        let slots = param_slots(config);
        let index: HashMap<&str, &ParamSlot> = slots.iter().map(|s| (s.name.as_str(), s)).collect();
        let (weights, grads) = (layout.weights.at(base), layout.grads.at(base));
        let param = |name: &str| -> Result<Param> {
            let s = index.get(name).ok_or_else(|| Error::invalid("parameters", format!("no parameter `{name}`")))?;
            let off = (s.offset * B::Elem::BYTES) as u64;
            Ok(Param { w: weights + off, g: grads + off })
        };
        let mut layers = Vec::with_capacity(config.dims.num_layers());
        for l in 0..config.dims.num_layers() {
            let p = |name: &str| param(&format!("layers.{l}.{name}"));
            let slot = |n: &str| index.get(format!("layers.{l}.mlp.{n}.weight").as_str()).copied();
            if slot("gate_proj").zip(slot("up_proj")).is_none_or(|(g, u)| g.offset + g.len != u.offset) {
                return Err(Error::invalid("parameters", format!("layer {l}: gate_proj and up_proj must be adjacent")));
            }
            layers.push(LayerParams {
                input_norm: p("input_layernorm.weight")?,
                q: p("self_attn.q_proj.weight")?,
                k: p("self_attn.k_proj.weight")?,
                v: p("self_attn.v_proj.weight")?,
                o: p("self_attn.o_proj.weight")?,
                q_norm: p("self_attn.q_norm.weight")?,
                k_norm: p("self_attn.k_norm.weight")?,
                post_norm: p("post_attention_layernorm.weight")?,
                gate_up: p("mlp.gate_proj.weight")?,
                down: p("mlp.down_proj.weight")?,
            });
        }
        let lm_head = match (shared_head, layout.lm_head) {
            (Some(addr), _) => addr,
            (None, Some(r)) => r.at(base),
            (None, None) => return Err(Error::invalid("lm_head", "the layout holds no LM head and none is shared")),
        };
        // The RoPE tables of every position a row can hold, uploaded once.
        let positions: Vec<usize> = (0..shape.context_len + config.block_size).collect();
        let c = &config.dims;
        let (cos, sin) = rope_tables(&positions, c.head_dim, c.rope_theta, DType::F64)?;
        for (t, r) in [(cos, layout.input.rope_cos), (sin, layout.input.rope_sin)] {
            dev.upload(r.at(base), crate::ops::bytes_of(&Self::acc(t.flatten_all()?.to_vec1::<f64>()?)))?;
        }
        Ok(DrafterStep {
            lm_head,
            fc: param("fc.weight")?,
            hidden_norm: param("hidden_norm.weight")?,
            final_norm: param("norm.weight")?,
            layers,
            dev,
            config: config.clone(),
            shape,
            layout,
            _memory: memory,
            base,
            slots,
            ranges: HashMap::new(),
            ce_rows: Vec::new(),
            record_predictions: false,
            predicted: false,
            total_weight: 0.0,
        })
    }

    pub fn slots(&self) -> &[ParamSlot] {
        &self.slots
    }

    /// The address of a region of the step's layout.
    pub fn addr(&self, r: Region) -> u64 {
        r.at(self.base)
    }

    /// The peak the step holds: its layout and what the backend's attention needs beyond it
    /// under the uploaded input's key ranges.
    pub fn planned_peak(&self) -> u64 {
        let shape = self.attn_shape();
        let attention = self.ranges.values().map(|r| self.dev.attention_scratch_bytes(r, shape)).max().unwrap_or(0);
        self.layout.total_bytes() + attention
    }

    /// The address of the frozen LM head `[V, H]` the step reads (its own or the shared one).
    pub fn lm_head_addr(&self) -> u64 {
        self.lm_head
    }

    /// The backend the step runs on.
    pub fn backend(&self) -> &B {
        &self.dev
    }

    /// Trainable scalars (the length of the flat weight and gradient regions).
    pub fn num_params(&self) -> usize {
        self.layout.dims.params
    }

    /// Sets every byte of `r` to zero.
    pub fn zero(&self, r: Region) -> Result<()> {
        self.dev.zero(self.addr(r), r.bytes as usize)
    }

    /// Copies `host` to the start of `r`.
    fn upload<T: Copy>(&self, what: &str, r: Region, host: &[T]) -> Result<()> {
        let bytes = crate::ops::bytes_of(host);
        if bytes.len() as u64 > r.bytes {
            return Err(Error::invalid(what, format!("{} bytes for a region of {}", bytes.len(), r.bytes)));
        }
        self.dev.upload(self.addr(r), bytes)
    }

    /// `t` as stored values.
    fn stored(t: &Tensor) -> Result<Vec<B::Elem>> {
        crate::ops::stored(t)
    }

    /// Values in the arithmetic type.
    fn acc(values: impl IntoIterator<Item = f64>) -> Vec<<B::Elem as Elem>::Acc> {
        values.into_iter().map(<B::Elem as Elem>::Acc::from_f64).collect()
    }

    /// The drafter's parameters as stored compute weights (and, with an optimizer, masters in the
    /// arithmetic type).
    pub fn load_weights(&mut self, drafter: &Drafter) -> Result<()> {
        let mut flat = Vec::with_capacity(self.num_params());
        for slot in &self.slots {
            let t = drafter.param(&slot.name);
            if t.dims() != slot.shape.as_slice() {
                return Err(Error::invalid(
                    &slot.name,
                    format!("shape {:?}, the step expects {:?}", t.dims(), slot.shape),
                ));
            }
            flat.extend(t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?);
        }
        // The compute copy is the masters rounded as the update rounds them (from the arithmetic
        // type), so a restored step continues bitwise.
        let stored: Vec<B::Elem> =
            flat.iter().map(|&x| B::Elem::from_acc(<B::Elem as Elem>::Acc::from_f64(x))).collect();
        self.upload("weights", self.layout.weights, &stored)?;
        if let Some(opt) = self.layout.optimizer {
            let (lo, hi) = opt.shard;
            flat.truncate(hi);
            self.upload("master", opt.master, &Self::acc(flat.split_off(lo)))?;
        }
        Ok(())
    }

    /// The frozen LM head `[V, H]`, stored.
    pub fn load_lm_head(&mut self, head: &FrozenHead) -> Result<()> {
        let (v, h) = head.lm_head.dims2()?;
        let z = self.layout.dims;
        if (v, h) != (z.v, z.h) {
            return Err(Error::invalid("lm_head", format!("shape [{v}, {h}], the step expects [{}, {}]", z.v, z.h)));
        }
        let region = self
            .layout
            .lm_head
            .ok_or_else(|| Error::invalid("lm_head", "this step reads the target's shared LM head; load it there"))?;
        self.upload("lm_head", region, &Self::stored(&head.lm_head)?)
    }

    /// Uploads one row's input: features, block embeddings (from the frozen table on the host),
    /// then the blocks ([`DrafterStep::set_blocks`]). Shapes must match the step's.
    pub fn set_input(&mut self, input: &DraftInput, head: &FrozenHead, targets: &BlockTargets) -> Result<()> {
        let z = self.layout.dims;
        if input.features.dims() != [z.s, z.fw] {
            return Err(Error::invalid(
                "features",
                format!("shape {:?}, expected [{}, {}]", input.features.dims(), z.s, z.fw),
            ));
        }
        self.check_blocks(&input.layout)?;
        self.upload("features", self.layout.input.features, &Self::stored(&input.features)?)?;
        let x0 = input.block_embeddings(head, self.config.mask_token_id, DType::F64)?;
        self.upload("block embeddings", self.layout.residual[0], &Self::stored(&x0)?)?;
        self.set_blocks(&input.layout, &input.query_positions(), &input.key_positions(), targets)
    }

    /// Uploads one row's input whose features are already on the device (the target forward's,
    /// `[S, F*H]` stored at `features`): they are copied into the step's input, the block
    /// embeddings are gathered on the device from the frozen table at `embed` (`[V, H]`), then the
    /// blocks ([`DrafterStep::set_blocks`]). `input.features` is not read (it may be `[S, 0]`).
    pub fn set_input_device(
        &mut self,
        features: u64,
        embed: u64,
        input: &DraftInput,
        targets: &BlockTargets,
    ) -> Result<()> {
        let z = self.layout.dims;
        self.check_blocks(&input.layout)?;
        self.dev.copy(self.input_features(), features, z.s * z.fw * B::Elem::BYTES)?;
        self.set_input_after_features(embed, input, targets)
    }

    /// Where the step reads a row's features (`[S, F*H]` stored): a caller may write them there
    /// itself (uploaded from the host, or copied from another device), then call
    /// [`DrafterStep::set_input_after_features`].
    pub fn input_features(&self) -> u64 {
        self.addr(self.layout.input.features)
    }

    /// [`DrafterStep::set_input_device`] for a row whose features are already at
    /// [`DrafterStep::input_features`].
    pub fn set_input_after_features(&mut self, embed: u64, input: &DraftInput, targets: &BlockTargets) -> Result<()> {
        let z = self.layout.dims;
        self.check_blocks(&input.layout)?;
        let i = self.layout.input;
        let tokens = input.block_tokens(self.config.mask_token_id);
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= z.v) {
            return Err(Error::invalid("block tokens", format!("token {bad} is not below the vocab size {}", z.v)));
        }
        self.upload("block tokens", i.block_tokens, &tokens)?;
        let x0 = self.addr(self.layout.residual[0]);
        self.dev.ops().copy_rows(false, embed, self.addr(i.block_tokens), x0, z.q, z.h)?;
        self.set_blocks(&input.layout, &input.query_positions(), &input.key_positions(), targets)
    }

    fn check_blocks(&self, layout: &BlockLayout) -> Result<()> {
        let z = self.layout.dims;
        let (s, q) = (layout.context_len, layout.num_queries());
        if (s, q) != (z.s, z.q) || layout.block_size != self.config.block_size {
            return Err(Error::invalid(
                "input",
                format!("S={s}, {q} block rows; this step was laid out for S={}, {} rows", z.s, z.q),
            ));
        }
        Ok(())
    }

    /// Uploads what follows from the blocks of a row whose features and block embeddings are in
    /// place: the RoPE tables of the queries `[Q, d]` and keys `[K, d]`, the attention's key
    /// ranges per layer kind, and the CE labels and weights of the rows that have weight.
    pub fn set_blocks(
        &mut self,
        layout: &BlockLayout,
        query_positions: &[usize],
        key_positions: &[usize],
        targets: &BlockTargets,
    ) -> Result<()> {
        self.check_blocks(layout)?;
        // The rows of the position tables (arithmetic-type rows copied as stored-width columns).
        let i = self.layout.input;
        let p = self.layout.dims.s + self.config.block_size;
        let cols = self.layout.dims.d * <B::Elem as Elem>::Acc::BYTES / B::Elem::BYTES;
        for (name, positions, region, (cos, sin)) in [
            ("query positions", query_positions, i.positions_q, (i.cos_q, i.sin_q)),
            ("key positions", key_positions, i.positions_k, (i.cos_k, i.sin_k)),
        ] {
            if let Some(&bad) = positions.iter().find(|&&x| x >= p) {
                return Err(Error::invalid(name, format!("position {bad} is not below S + B = {p}")));
            }
            let idx: Vec<u32> = positions.iter().map(|&x| x as u32).collect();
            self.upload(name, region, &idx)?;
            let ops = self.dev.ops();
            ops.copy_rows(false, self.addr(i.rope_cos), self.addr(region), self.addr(cos), idx.len(), cols)?;
            ops.copy_rows(false, self.addr(i.rope_sin), self.addr(region), self.addr(sin), idx.len(), cols)?;
        }
        self.ranges.clear();
        for &kind in &self.config.dims.layer_kinds {
            if !self.ranges.contains_key(&kind) {
                let uploaded = self.dev.upload_ranges(&KeyRanges::dflash(layout, kind)?)?;
                self.ranges.insert(kind, uploaded);
            }
        }
        self.set_targets(targets)
    }

    fn set_targets(&mut self, targets: &BlockTargets) -> Result<()> {
        let z = self.layout.dims;
        if targets.labels.len() != z.q || targets.weights.len() != z.q {
            return Err(Error::invalid("targets", format!("{} labels for {} block rows", targets.labels.len(), z.q)));
        }
        if let Some((r, y)) = targets.labels.iter().enumerate().find(|&(_, &y)| y as usize >= z.v) {
            return Err(Error::invalid("targets", format!("label {y} of row {r} is not below the vocab size {}", z.v)));
        }
        let rows: Vec<u32> = (0..z.q as u32).filter(|&r| targets.weights[r as usize] != 0.0).collect();
        let labels: Vec<u32> = rows.iter().map(|&r| targets.labels[r as usize]).collect();
        let weights = Self::acc(rows.iter().map(|&r| targets.weights[r as usize]));
        let i = self.layout.input;
        self.upload("rows_ce", i.rows_ce, &rows)?;
        self.upload("labels", i.labels, &labels)?;
        self.upload("weights_ce", i.weights_ce, &weights)?;
        self.ce_rows = rows;
        self.predicted = false;
        self.total_weight = targets.total_weight();
        Ok(())
    }

    /// One forward and backward of the uploaded row: writes `grad_scale * d(sum w CE)/dθ` into
    /// the parameter gradients (`grad_scale = 1 / total weight` gives the row's mean-loss
    /// gradient) and returns the row's loss (when recording, the weighted rows' predictions too).
    /// Fails naming the step and the loss when the loss is not finite.
    pub fn step(&mut self, grad_scale: f64) -> Result<StepLoss> {
        self.step_with(grad_scale, &mut |_, _| Ok(()))
    }

    /// [`DrafterStep::step`], calling `done(self, i)` as soon as the backward has queued the
    /// gradients of bucket `i` of [`grad_buckets`] (in that order, each once).
    pub fn step_with(&mut self, grad_scale: f64, done: &mut BucketDone<'_, B>) -> Result<StepLoss> {
        self.predicted = false;
        self.forward(grad_scale)?;
        self.predicted = self.record_predictions;
        self.backward(done)
    }

    /// The step's forward through the LM head and the CE gradient (and the predictions when
    /// recording): `grad.b` holds the gradient of `hf`.
    fn forward(&self, grad_scale: f64) -> Result<()> {
        let (z, lay, ops) = (self.layout.dims, &self.layout, self.dev.ops());
        let at = |r: Region| r.at(self.base);
        let eps = self.config.dims.rms_norm_eps;
        // Context: ctx = hidden_norm(features @ fc^T).
        self.linear(at(lay.input.features), z.s, z.fw, self.fc.w, z.h, at(lay.ctx_pre), 0.0)?;
        ops.rms_norm_forward(at(lay.ctx_pre), self.hidden_norm.w, at(lay.ctx), at(lay.inv_hidden), z.s, z.h, eps)?;
        for l in 0..z.layers {
            self.layer_forward(l, Recompute::No)?;
        }
        let last = at(lay.residual[z.layers]);
        ops.rms_norm_forward(last, self.final_norm.w, at(lay.hf), at(lay.inv_final), z.q, z.h, eps)?;
        self.lm_head_ce(grad_scale)
    }

    /// The step's backward from `grad.b` (the gradient of `hf`) into every parameter gradient,
    /// calling `done` per finished bucket; returns the loss.
    fn backward(&self, done: &mut BucketDone<'_, B>) -> Result<StepLoss> {
        let (z, lay, ops) = (self.layout.dims, &self.layout, self.dev.ops());
        let at = |r: Region| r.at(self.base);
        // grad.b = dhf (from the LM head), grad.a = the gradient of the last layer's output.
        let (scratch, last) = (lay.scratch, at(lay.residual[z.layers]));
        let g = RmsNormGrad { dy: at(lay.grad_b), x: last, w: self.final_norm.w, inv: at(lay.inv_final), dres: None };
        ops.rms_norm_backward(g, at(scratch.grad_a), self.final_norm.g, at(scratch.dw_partial), z.q, z.h)?;
        done(self, 0)?;
        self.zero(scratch.dctx)?;
        for l in (0..z.layers).rev() {
            match self.layout.policy {
                Checkpointing::None => {}
                Checkpointing::Selective => self.layer_forward(l, Recompute::KeptAttention)?,
                Checkpointing::PerLayer => self.layer_forward(l, Recompute::All)?,
            }
            self.layer_backward(l)?;
            done(self, z.layers - l)?;
        }
        // dctx -> through hidden_norm (in place) -> fc.
        let dctx = at(scratch.dctx);
        let g =
            RmsNormGrad { dy: dctx, x: at(lay.ctx_pre), w: self.hidden_norm.w, inv: at(lay.inv_hidden), dres: None };
        ops.rms_norm_backward(g, dctx, self.hidden_norm.g, at(scratch.dw_partial), z.s, z.h)?;
        self.weight_grad(dctx, z.s, z.h, at(lay.input.features), z.fw, self.fc.g)?;
        done(self, z.layers + 1)?;
        self.loss()
    }

    /// Whether the following steps record the top-1 prediction of each weighted block row (the
    /// argmax of its logits, on each LM-head chunk before the CE gradient overwrites them) for
    /// [`DrafterStep::predictions`]; off by default. The loss and gradients are the same either way.
    pub fn set_record_predictions(&mut self, on: bool) {
        self.record_predictions = on;
    }

    /// The last step's top-1 prediction of every block row (`[Q]`, block-row order `j*B + o`),
    /// `u32::MAX` on rows without CE weight (not computed); downloaded (waits for the step). Fails
    /// unless that step, on the current input, recorded them ([`DrafterStep::set_record_predictions`]).
    pub fn predictions(&self) -> Result<Vec<u32>> {
        if !self.predicted {
            return Err(Error::invalid(
                "predictions",
                "none recorded for the current input: set_record_predictions(true), then run a step",
            ));
        }
        let mut all = vec![u32::MAX; self.layout.dims.q];
        if !self.ce_rows.is_empty() {
            let got: Vec<u32> = download(&self.dev, self.addr(self.layout.input.predictions), self.ce_rows.len())?;
            self.ce_rows.iter().zip(got).for_each(|(&r, p)| all[r as usize] = p);
        }
        Ok(all)
    }

    /// Layer `l`'s forward from its input residual into the next, keeping its activations where
    /// the policy put them; a recompute stops at what the backward reads (gate and up), and
    /// reuses kept attention.
    fn layer_forward(&self, l: usize, recompute: Recompute) -> Result<()> {
        let (z, lay, w) = (self.layout.dims, &self.layout, &self.layers[l]);
        let (a, t) = (lay.acts[l], lay.attn[l]);
        let at = |r: Region| r.at(self.base);
        let eps = self.config.dims.rms_norm_eps;
        let x_in = at(lay.residual[l]);
        let ctx_bytes = (z.s * z.h * B::Elem::BYTES) as u64;
        let (kv_in, xn) = (at(a.kv_in), at(a.kv_in.skip(ctx_bytes)));
        self.dev.copy(kv_in, at(lay.ctx), ctx_bytes as usize)?;
        self.dev.ops().rms_norm_forward(x_in, w.input_norm.w, xn, at(a.inv_in), z.q, z.h, eps)?;
        // q = rope(q_norm(xn @ Wq^T)); k = rope(k_norm(kv_in @ Wk^T)); v = kv_in @ Wv^T.
        self.linear(xn, z.q, z.h, w.q.w, z.qd, at(a.q_pre), 0.0)?;
        self.head_norm_rope_forward(l, &a, Side::Q)?;
        self.linear(kv_in, z.k, z.h, w.k.w, z.kd, at(a.k_pre), 0.0)?;
        self.head_norm_rope_forward(l, &a, Side::K)?;
        self.linear(kv_in, z.k, z.h, w.v.w, z.kd, at(a.v), 0.0)?;
        if recompute != Recompute::KeptAttention {
            let (q, k) = (at(lay.scratch.q), at(lay.scratch.k));
            let ranges = &self.ranges[&self.config.dims.layer_kinds[l]];
            self.dev.attention_forward(ranges, self.attn_shape(), (q, k, at(a.v)), (at(t.out), at(t.lse)))?;
        }
        // x_mid = x + out @ Wo^T; xn2 = post_norm(x_mid); out = x_mid + down(silu(gate) * up).
        let x_mid = at(a.x_mid);
        self.dev.copy(x_mid, x_in, z.q * z.h * B::Elem::BYTES)?;
        self.linear(at(t.out), z.q, z.qd, w.o.w, z.h, x_mid, 1.0)?;
        self.post_norm_forward(l, &a)?;
        // gate | up = xn2 @ [W_gate; W_up]^T: the two weights are adjacent in the flat buffer.
        self.linear(at(lay.scratch.xn2), z.q, z.h, w.gate_up.w, 2 * z.i, at(a.gate_up), 0.0)?;
        if recompute != Recompute::No {
            return Ok(());
        }
        let h = at(lay.scratch.h);
        self.dev.ops().swiglu_forward(at(a.gate_up), h, z.q, z.i)?;
        let x_out = at(lay.residual[l + 1]);
        self.dev.copy(x_out, x_mid, z.q * z.h * B::Elem::BYTES)?;
        self.linear(h, z.q, z.i, w.down.w, z.h, x_out, 1.0)
    }

    /// One side (queries or keys) of layer `l`'s head norm + RoPE: its inputs (the pre-norm
    /// projection, the norm weight, the RoPE tables), shapes, norm parameter, inverse RMS and
    /// output (the shared scratch).
    fn side(&self, l: usize, a: &LayerActs, side: Side) -> (HeadNormRope, Heads, Param, u64, u64) {
        let (z, i, w, s) = (self.layout.dims, self.layout.input, &self.layers[l], &self.layout.scratch);
        let at = |r: Region| r.at(self.base);
        let (x, norm, inv, y, cos, sin, tokens, heads) = match side {
            Side::Q => (a.q_pre, w.q_norm, a.inv_q, s.q, i.cos_q, i.sin_q, z.q, z.nh),
            Side::K => (a.k_pre, w.k_norm, a.inv_k, s.k, i.cos_k, i.sin_k, z.k, z.nkv),
        };
        let f = HeadNormRope { x: at(x), x_row: heads * z.d, w: norm.w, cos: at(cos), sin: at(sin) };
        (f, Heads { tokens, heads, head_dim: z.d }, norm, at(inv), at(y))
    }

    /// q (or k) = rope(head_norm(pre-norm)) of layer `l`, into the shared scratch.
    fn head_norm_rope_forward(&self, l: usize, a: &LayerActs, side: Side) -> Result<()> {
        let (f, dims, _, inv, y) = self.side(l, a, side);
        self.dev.ops().head_norm_rope_forward(f, y, inv, dims, self.config.dims.rms_norm_eps)
    }

    /// `xn2` = post_norm(x_mid) of layer `l`, into the shared scratch.
    fn post_norm_forward(&self, l: usize, a: &LayerActs) -> Result<()> {
        let z = self.layout.dims;
        let at = |r: Region| r.at(self.base);
        let (w, eps) = (self.layers[l].post_norm.w, self.config.dims.rms_norm_eps);
        self.dev.ops().rms_norm_forward(at(a.x_mid), w, at(self.layout.scratch.xn2), at(a.inv_post), z.q, z.h, eps)
    }

    /// Layer `l`'s backward: `grad.a` holds the gradient of its output on entry and of its input
    /// on return; its parameter gradients are written, and its context gradient added to `dctx`.
    fn layer_backward(&self, l: usize) -> Result<()> {
        let (z, lay, w, ops) = (self.layout.dims, &self.layout, &self.layers[l], self.dev.ops());
        let (a, t): (LayerActs, AttnActs) = (lay.acts[l], lay.attn[l]);
        let s = lay.scratch;
        let at = |r: Region| r.at(self.base);
        let (dout, dx_mid, dscratch) = (at(s.grad_a), at(lay.grad_b), at(s.grad_c));
        let x_in = at(lay.residual[l]);
        let ctx_bytes = (z.s * z.h * B::Elem::BYTES) as u64;
        let (kv_in, xn, h) = (at(a.kv_in), at(a.kv_in.skip(ctx_bytes)), at(s.h));
        let (q, k, xn2) = (at(s.q), at(s.k), at(s.xn2));
        if lay.policy == Checkpointing::None {
            // The shared scratch holds the last layer's: recompute this layer's.
            self.head_norm_rope_forward(l, &a, Side::Q)?;
            self.head_norm_rope_forward(l, &a, Side::K)?;
            self.post_norm_forward(l, &a)?;
        }
        // MLP: h = silu(gate) * up (recomputed); dWdown = dout^T h; dh = dout @ Wdown (into h).
        let gate_up = at(a.gate_up);
        ops.swiglu_forward(gate_up, h, z.q, z.i)?;
        self.weight_grad(dout, z.q, z.h, h, z.i, w.down.g)?;
        self.input_grad(dout, z.q, z.h, w.down.w, z.i, h, 0.0)?;
        // gate_up := dgate | dup; dxn2 = [dgate | dup] @ [W_gate; W_up]; the stacked weight
        // gradient [dW_gate; dW_up] lands on both adjacent gradients at once.
        ops.swiglu_backward(h, gate_up, z.q, z.i)?;
        self.input_grad(gate_up, z.q, 2 * z.i, w.gate_up.w, z.h, dscratch, 0.0)?;
        self.weight_grad(gate_up, z.q, 2 * z.i, xn2, z.h, w.gate_up.g)?;
        // dx_mid = dout + post_norm backward.
        let dw_partial = at(s.dw_partial);
        let g = RmsNormGrad { dy: dscratch, x: at(a.x_mid), w: w.post_norm.w, inv: at(a.inv_post), dres: Some(dout) };
        ops.rms_norm_backward(g, dx_mid, w.post_norm.g, dw_partial, z.q, z.h)?;
        // Attention: dattn = dx_mid @ Wo (in grad.c, free until dxn), dWo = dx_mid^T out; then
        // the fused backward.
        let (out, lse, dattn) = (at(t.out), at(t.lse), dscratch);
        self.input_grad(dx_mid, z.q, z.h, w.o.w, z.qd, dattn, 0.0)?;
        self.weight_grad(dx_mid, z.q, z.h, out, z.qd, w.o.g)?;
        let (dq, dk, dv) = (at(s.dq), at(s.dk), at(s.dv));
        let ranges = &self.ranges[&self.config.dims.layer_kinds[l]];
        let grads = (dq, dk, dv);
        self.dev.attention_backward(
            ranges,
            self.attn_shape(),
            (q, k, at(a.v)),
            (out, lse, dattn),
            at(s.dsum),
            grads,
        )?;
        // Through RoPE and the head norms, in place.
        for (side, d) in [(Side::Q, dq), (Side::K, dk)] {
            let (fwd, dims, norm, inv, _) = self.side(l, &a, side);
            ops.head_norm_rope_backward(HeadNormRopeGrad { dy: d, fwd, inv }, d, norm.g, dw_partial, dims)?;
        }
        // Projections: dxn = dq @ Wq + (dk @ Wk + dv @ Wv)[S..]; dctx += (dk @ Wk + dv @ Wv)[..S].
        self.input_grad(dq, z.q, z.qd, w.q.w, z.h, dscratch, 0.0)?;
        let kv_ctx = (z.s * z.kd * B::Elem::BYTES) as u64;
        self.input_grad(dk + kv_ctx, z.q, z.kd, w.k.w, z.h, dscratch, 1.0)?;
        self.input_grad(dv + kv_ctx, z.q, z.kd, w.v.w, z.h, dscratch, 1.0)?;
        self.input_grad(dk, z.s, z.kd, w.k.w, z.h, at(s.dctx), 1.0)?;
        self.input_grad(dv, z.s, z.kd, w.v.w, z.h, at(s.dctx), 1.0)?;
        self.weight_grad(dq, z.q, z.qd, xn, z.h, w.q.g)?;
        self.weight_grad(dk, z.k, z.kd, kv_in, z.h, w.k.g)?;
        self.weight_grad(dv, z.k, z.kd, kv_in, z.h, w.v.g)?;
        // dx = dx_mid + input_norm backward (into grad.a).
        let g = RmsNormGrad { dy: dscratch, x: x_in, w: w.input_norm.w, inv: at(a.inv_in), dres: Some(dx_mid) };
        ops.rms_norm_backward(g, dout, w.input_norm.g, dw_partial, z.q, z.h)
    }

    /// The frozen LM head and decayed CE over the weighted rows, `lm_rows` at a time: `grad.b
    /// [Q, H]` gets `grad_scale * d(sum w CE)/dhf` (zero on unweighted rows); when recording,
    /// each chunk's argmax goes to the predictions before the CE gradient overwrites its logits.
    fn lm_head_ce(&self, grad_scale: f64) -> Result<()> {
        let (z, lay, ops) = (self.layout.dims, &self.layout, self.dev.ops());
        let at = |r: Region| r.at(self.base);
        self.zero(lay.grad_b)?;
        let (hd, i) = (lay.head, lay.input);
        let acc = <B::Elem as Elem>::Acc::BYTES as u64;
        let mut start = 0;
        let weighted = self.ce_rows.len();
        while start < weighted {
            let n = z.lm_rows.min(weighted - start);
            let rows = at(i.rows_ce) + 4 * start as u64;
            ops.copy_rows(false, at(lay.hf), rows, at(hd.rows), n, z.h)?;
            self.linear(at(hd.rows), n, z.h, self.lm_head, z.v, at(hd.logits), 0.0)?;
            if self.record_predictions {
                ops.argmax_rows(at(hd.logits), n, z.v, at(i.predictions) + 4 * start as u64)?;
            }
            let (labels, weights, loss) = (
                at(i.labels) + 4 * start as u64,
                at(i.weights_ce) + acc * start as u64,
                at(i.loss_rows) + acc * start as u64,
            );
            ops.ce_grad_rows(CeRows { z: at(hd.logits), labels, weights, loss }, n, z.v, grad_scale)?;
            self.input_grad(at(hd.logits), n, z.v, self.lm_head, z.h, at(hd.drows), 0.0)?;
            ops.copy_rows(true, at(hd.drows), rows, at(lay.grad_b), n, z.h)?;
            start += n;
        }
        Ok(())
    }

    /// The loss of the last step from its per-row CE (downloaded: waits for the step).
    fn loss(&self) -> Result<StepLoss> {
        let losses: Vec<<B::Elem as Elem>::Acc> =
            download(&self.dev, self.addr(self.layout.input.loss_rows), self.ce_rows.len())?;
        let sum: f64 = losses.iter().map(|&x| x.to_f64()).sum();
        let loss = if self.total_weight > 0.0 { sum / self.total_weight } else { 0.0 };
        if !loss.is_finite() {
            return Err(Error::NonFinite {
                what: "loss".into(),
                message: format!("{loss} (not finite) on {}", self.dev.name()),
            });
        }
        Ok(StepLoss { loss, total_weight: self.total_weight })
    }

    /// `y [rows, n] = x [rows, k] @ w [n, k]^T + beta * y`.
    #[allow(clippy::too_many_arguments)]
    fn linear(&self, x: u64, rows: usize, k: usize, w: u64, n: usize, y: u64, beta: f32) -> Result<()> {
        self.dev.linear(x, rows, k, w, n, y, beta)
    }

    /// `dx [rows, k] = dy [rows, n] @ w [n, k] + beta * dx`.
    #[allow(clippy::too_many_arguments)]
    fn input_grad(&self, dy: u64, rows: usize, n: usize, w: u64, k: usize, dx: u64, beta: f32) -> Result<()> {
        self.dev.matmul(Mat::n(dy, rows, n), Mat::n(w, n, k), dx, beta)
    }

    /// `dw [n, k] = dy [rows, n]^T @ x [rows, k]` (the step's stored gradient).
    fn weight_grad(&self, dy: u64, rows: usize, n: usize, x: u64, k: usize, dw: u64) -> Result<()> {
        self.dev.matmul(Mat::t(dy, rows, n), Mat::n(x, rows, k), dw, 0.0)
    }

    fn attn_shape(&self) -> AttnShape {
        let z = self.layout.dims;
        AttnShape { num_heads: z.nh, num_kv_heads: z.nkv, head_dim: z.d }
    }

    /// Every parameter gradient of the last step on the host, in checkpoint-key order.
    pub fn grads_to_host(&self) -> Result<Vec<(String, Vec<f64>)>> {
        let all: Vec<B::Elem> = download(&self.dev, self.addr(self.layout.grads), self.num_params())?;
        let all: Vec<f64> = all.into_iter().map(Elem::to_f64).collect();
        Ok(self.slots.iter().map(|s| (s.name.clone(), all[s.offset..s.offset + s.len].to_vec())).collect())
    }

    /// The optimizer's gradient accumulator, or `None` when AdamW reads the step's own gradients;
    /// fails when the step was made without its optimizer regions.
    pub fn accumulator(&self) -> Result<Option<Region>> {
        let opt = self
            .layout
            .optimizer
            .ok_or_else(|| Error::invalid("optimizer", "the step was made without its optimizer regions"))?;
        Ok(opt.grads.accumulator())
    }

    /// The sum of squares of every parameter's gradient, of the last step or the update's, as
    /// partials summed in f64 on the host; fails naming the first gradient that holds NaN or Inf.
    pub fn grad_sum_squares(&self, which: Grads) -> Result<Vec<f64>> {
        let accumulated = match which {
            Grads::Step => None,
            Grads::Update => self.accumulator()?,
        };
        let (region, stored, width) = match accumulated {
            None => (self.layout.grads, true, B::Elem::BYTES),
            Some(acc) => (acc, false, <B::Elem as Elem>::Acc::BYTES),
        };
        let acc = <B::Elem as Elem>::Acc::BYTES;
        let partial = self.addr(self.layout.scratch.norm_partial);
        for (n, slot) in self.slots.iter().enumerate() {
            let g = self.addr(region) + (slot.offset * width) as u64;
            self.dev.ops().sum_squares(stored, g, partial + (n * NORM_PARTS * acc) as u64, slot.len, NORM_PARTS)?;
        }
        let partials: Vec<<B::Elem as Elem>::Acc> = download(&self.dev, partial, self.slots.len() * NORM_PARTS)?;
        self.slots
            .iter()
            .enumerate()
            .map(|(n, slot)| {
                let sq: f64 = partials[n * NORM_PARTS..(n + 1) * NORM_PARTS].iter().map(|&x| x.to_f64()).sum();
                if !sq.is_finite() {
                    return Err(Error::NonFinite {
                        what: match which {
                            Grads::Step => format!("gradient of {}", slot.name),
                            Grads::Update => format!("gradient of {} (accumulated for the update)", slot.name),
                        },
                        message: "holds NaN or Inf".into(),
                    });
                }
                Ok(sq)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::named::named_configs;

    /// The flat layout covers every parameter once, in checkpoint-key order, without gaps, and
    /// keeps each layer's gate and up projections adjacent (the stacked-weight matmul needs it).
    #[test]
    fn param_slots_are_contiguous_and_stack_gate_and_up() {
        for p in named_configs() {
            let slots = param_slots(&p.config);
            let shapes = param_shapes(&p.config);
            assert_eq!(slots.len(), shapes.len());
            let mut next = 0;
            for (slot, (name, shape)) in slots.iter().zip(&shapes) {
                assert_eq!((&slot.name, &slot.shape, slot.offset), (name, shape, next));
                next += slot.len;
            }
            for l in 0..p.config.dims.num_layers() {
                let find = |n: &str| slots.iter().find(|s| s.name == format!("layers.{l}.mlp.{n}.weight")).unwrap();
                let (gate, up) = (find("gate_proj"), find("up_proj"));
                assert_eq!(gate.offset + gate.len, up.offset, "{}: layer {l}", p.name);
            }
        }
    }
}
