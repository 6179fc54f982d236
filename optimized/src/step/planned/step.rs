//! The planned training step: the CPU step (`step::drafter_step`) op for op over a backend
//! (`super::backend`): on the GPU in bf16 with fp32 accumulation (cuBLAS, the fused attention,
//! the `step.cu` kernels), or on the CPU with their twins storing bf16 or f32. Every buffer is one
//! of the planner's `step_buffers_of`, allocated once when the step is made (after checking that
//! they fit), so the step's memory is its plan.
//!
//! Shapes (one row): S context tokens, Q = N*B block rows, K = S + Q keys, H hidden, I SwiGLU,
//! nh/nkv heads of d. Each step writes every parameter's gradient once in the stored type (on the
//! GPU one bf16 rounding of an fp32-accumulated result, as PyTorch's bf16 autograd does); the
//! optimizer (`super::adamw`) accumulates steps in fp32 and applies them to fp32 master weights.

use std::collections::HashMap;

use dflash_reference::config::{AttnKind, DraftConfig};
use dflash_reference::drafter::{param_shapes, DraftInput, Drafter, FrozenHead};
use dflash_reference::loss::BlockTargets;
use dflash_reference::ops::rope_tables;
use dflash_reference::{Error, Result};

use super::backend::{download, Allocation, Backend, Cuda, Elem};
use super::kernels::StepOps;
use crate::attention::cpu::AttnShape;
use crate::attention::plan::AttentionPlan;
use crate::blas::Mat;
use crate::gpu::Gpu;
use crate::planner::{
    allocated_bytes, check_fits, step_buffers_of, Policy, StepShape, ATTENTION_PLANS, NORM_PARTS, SCRATCH,
};

/// One parameter's place in the flat weight and gradient buffers.
#[derive(Clone, Debug)]
pub struct ParamSlot {
    pub name: String,
    pub shape: Vec<usize>,
    /// Offset of element 0, in elements.
    pub offset: usize,
    pub len: usize,
}

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

/// The sizes of one step.
#[derive(Clone, Copy)]
struct Sizes {
    s: usize,
    q: usize,
    k: usize,
    h: usize,
    i: usize,
    nh: usize,
    nkv: usize,
    d: usize,
    qd: usize,
    kd: usize,
    fw: usize,
    v: usize,
    eps: f32,
}

/// The step's buffers by planner key: the allocated ones, and the address and size of every key
/// (inside the scratch region for scratch buffers).
struct Buffers<A> {
    map: HashMap<String, A>,
    addr: HashMap<String, (u64, usize)>,
}

impl<A> Buffers<A> {
    fn ptr(&self, key: &str) -> u64 {
        self.addr.get(key).unwrap_or_else(|| panic!("step buffer `{key}` is not in the plan")).0
    }

    fn bytes(&self, key: &str) -> usize {
        self.addr.get(key).unwrap_or_else(|| panic!("step buffer `{key}` is not in the plan")).1
    }
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

/// What one step computed: the loss of its row (`sum w CE / sum w`, accumulated in f64) and the
/// row's total weight.
#[derive(Clone, Copy, Debug)]
pub struct StepLoss {
    pub loss: f64,
    pub total_weight: f64,
}

/// The planned training step of one drafter config at fixed shapes under one checkpointing
/// policy, on a backend: the GPU ([`GpuStep`]) or the CPU twin (`Step<Host>`).
pub struct Step<B: Backend> {
    dev: B,
    pub config: DraftConfig,
    pub shape: StepShape,
    pub policy: Policy,
    slots: Vec<ParamSlot>,
    slot_index: HashMap<String, usize>,
    sizes: Sizes,
    bufs: Buffers<B::Alloc>,
    plans: HashMap<AttnKind, B::Plan>,
    /// Rows with a nonzero CE weight, in the order their labels and weights were uploaded.
    weighted_rows: usize,
    /// Steps run so far (named in errors: the step whose loss or gradient went bad).
    steps_done: u64,
    total_weight: f64,
    /// Planned bytes of all buffers (what the step allocated).
    pub planned_bytes: u64,
}

/// The step on the GPU.
pub type GpuStep = Step<Cuda>;

impl Step<Cuda> {
    /// The step on `gpu`: see [`Step::with_backend`].
    pub fn new(gpu: &Gpu, config: &DraftConfig, shape: StepShape, policy: Policy, optimizer: bool) -> Result<Self> {
        Self::with_backend(Cuda::new(gpu, config.dims.head_dim)?, config, shape, policy, optimizer)
    }
}

impl<B: Backend> Step<B> {
    /// Allocates every buffer of the plan of `config` at `shape` under `policy` (with the
    /// optimizer's when `optimizer`) on `dev`, after checking that they fit in its free memory;
    /// a step that cannot fit is refused before anything is allocated, naming its largest items.
    pub fn with_backend(
        dev: B,
        config: &DraftConfig,
        shape: StepShape,
        policy: Policy,
        optimizer: bool,
    ) -> Result<Self> {
        let c = &config.dims;
        if shape.num_anchors == 0 || shape.context_len == 0 || shape.lm_chunk_rows == 0 {
            return Err(Error::invalid("step shape", format!("{shape:?}: context, anchors and LM chunk must be >= 1")));
        }
        let specs = step_buffers_of(config, shape, policy, optimizer, B::Elem::BYTES as u64);
        let planned_bytes = allocated_bytes(&specs);
        let device =
            format!("{} ({} policy, S={} N={})", dev.name(), policy.name(), shape.context_len, shape.num_anchors);
        check_fits(&specs, dev.available_bytes()?, &device).map_err(Error::Gpu)?;
        let mut map = HashMap::new();
        for spec in specs.iter().filter(|b| b.key != ATTENTION_PLANS && b.scratch_offset.is_none()) {
            map.insert(spec.key.clone(), dev.alloc(&spec.key, spec.bytes as usize)?);
        }
        let scratch = map.get(SCRATCH).map_or(0, |a: &B::Alloc| a.ptr());
        let addr = specs
            .iter()
            .filter_map(|b| {
                let ptr = match b.scratch_offset {
                    Some(offset) => scratch + offset,
                    None => map.get(&b.key)?.ptr(),
                };
                Some((b.key.clone(), (ptr, b.bytes as usize)))
            })
            .collect();
        let slots = param_slots(config);
        for l in 0..c.num_layers() {
            let slot = |name: &str| slots.iter().find(|s| s.name == format!("layers.{l}.mlp.{name}.weight"));
            let (gate, up) = (slot("gate_proj"), slot("up_proj"));
            if gate.zip(up).is_none_or(|(g, u)| g.offset + g.len != u.offset) {
                return Err(Error::invalid("parameters", format!("layer {l}: gate_proj and up_proj must be adjacent")));
            }
        }
        let q = shape.num_anchors * config.block_size;
        let sizes = Sizes {
            s: shape.context_len,
            q,
            k: shape.context_len + q,
            h: c.hidden_size,
            i: c.intermediate_size,
            nh: c.num_heads,
            nkv: c.num_kv_heads,
            d: c.head_dim,
            qd: c.num_heads * c.head_dim,
            kd: c.num_kv_heads * c.head_dim,
            fw: config.num_features() * c.hidden_size,
            v: c.vocab_size,
            eps: c.rms_norm_eps as f32,
        };
        Ok(Step {
            dev,
            config: config.clone(),
            shape,
            policy,
            slot_index: slots.iter().enumerate().map(|(i, s)| (s.name.clone(), i)).collect(),
            slots,
            sizes,
            bufs: Buffers { map, addr },
            plans: HashMap::new(),
            weighted_rows: 0,
            steps_done: 0,
            total_weight: 0.0,
            planned_bytes,
        })
    }

    pub fn slots(&self) -> &[ParamSlot] {
        &self.slots
    }

    /// Device address of a buffer of the plan (`weights`, `grads`, `master`, ...).
    pub fn buffer(&self, key: &str) -> u64 {
        self.bufs.ptr(key)
    }

    /// The planned peak: the buffers, and what the backend's attention needs beyond them under
    /// the uploaded input's plans.
    pub fn planned_peak(&self) -> u64 {
        let shape = self.attn_shape();
        self.planned_bytes + self.plans.values().map(|p| self.dev.attention_scratch_bytes(p, shape)).max().unwrap_or(0)
    }

    /// The backend the step runs on.
    pub fn backend(&self) -> &B {
        &self.dev
    }

    /// Whether the plan gave this step a buffer `key` (the optimizer's only when asked for).
    pub fn has_buffer(&self, key: &str) -> bool {
        self.bufs.map.contains_key(key)
    }

    /// Trainable scalars (the length of the flat weight and gradient buffers).
    pub fn num_params(&self) -> usize {
        self.slots.last().map_or(0, |s| s.offset + s.len)
    }

    /// Sets every byte of buffer `key` to zero.
    pub fn zero_buffer(&self, key: &str) -> Result<()> {
        self.dev.zero(self.bufs.ptr(key), self.bufs.bytes(key))
    }

    /// Copies `host` to the start of buffer `key`.
    fn upload<T: Copy>(&mut self, key: &str, host: &[T]) -> Result<()> {
        // SAFETY: plain-old-data values viewed as their bytes.
        let bytes = unsafe { std::slice::from_raw_parts(host.as_ptr() as *const u8, std::mem::size_of_val(host)) };
        if bytes.len() > self.bufs.bytes(key) {
            return Err(Error::invalid(key, format!("{} bytes for a buffer of {}", bytes.len(), self.bufs.bytes(key))));
        }
        self.dev.upload(self.bufs.ptr(key), bytes)
    }

    fn w(&self, name: &str) -> u64 {
        let slot = &self.slots[self.slot_index[name]];
        self.bufs.ptr("weights") + (slot.offset * B::Elem::BYTES) as u64
    }

    fn g(&self, name: &str) -> u64 {
        let slot = &self.slots[self.slot_index[name]];
        self.bufs.ptr("grads") + (slot.offset * B::Elem::BYTES) as u64
    }

    fn lw(&self, l: usize, name: &str) -> u64 {
        self.w(&format!("layers.{l}.{name}"))
    }

    fn lg(&self, l: usize, name: &str) -> u64 {
        self.g(&format!("layers.{l}.{name}"))
    }

    /// The drafter's parameters as stored compute weights (and, with an optimizer, fp32 masters).
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
            flat.extend(t.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?);
        }
        let stored: Vec<B::Elem> = flat.iter().map(|&x| B::Elem::from_f32(x)).collect();
        self.upload("weights", &stored)?;
        if self.bufs.map.contains_key("master") {
            self.upload("master", &flat)?;
        }
        Ok(())
    }

    /// The frozen LM head `[V, H]`, stored.
    pub fn load_lm_head(&mut self, head: &FrozenHead) -> Result<()> {
        let (v, h) = head.lm_head.dims2()?;
        if (v, h) != (self.sizes.v, self.sizes.h) {
            return Err(Error::invalid(
                "lm_head",
                format!("shape [{v}, {h}], the step expects [{}, {}]", self.sizes.v, self.sizes.h),
            ));
        }
        let host: Vec<B::Elem> = head
            .lm_head
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1::<f32>()?
            .into_iter()
            .map(B::Elem::from_f32)
            .collect();
        self.upload("lm_head", &host)
    }

    /// Random weights made on the device (the spec's init: normal(0, 0.02) for linears, ones
    /// for norms) and a random LM head (normal(0, 0.02)); for benchmarks.
    pub fn randomize_weights(&mut self, seed: u64) -> Result<()> {
        for (n, slot) in self.slots.iter().enumerate() {
            let (mean, std) = if dflash_reference::drafter::is_norm(&slot.name) { (1.0, 0.0) } else { (0.0, 0.02) };
            let ptr = self.bufs.ptr("weights") + (slot.offset * B::Elem::BYTES) as u64;
            self.dev.ops().fill_normal(ptr, slot.len, seed.wrapping_add(n as u64), mean, std)?;
        }
        let (lm, n) = (self.bufs.ptr("lm_head"), self.sizes.v * self.sizes.h);
        self.dev.ops().fill_normal(lm, n, seed ^ 0x5eed_1e4d, 0.0, 0.02)
    }

    /// Uploads one row's input: features, block embeddings (`x0`, from the frozen table on the
    /// host), RoPE tables, attention plans, and the CE labels and weights of the rows that have
    /// weight. Shapes must match the step's.
    pub fn set_input(&mut self, input: &DraftInput, head: &FrozenHead, targets: &BlockTargets) -> Result<()> {
        let z = self.sizes;
        let (s, q) = (input.layout.context_len, input.layout.num_queries());
        if (s, q) != (z.s, z.q) || input.layout.block_size != self.config.block_size {
            return Err(Error::invalid(
                "input",
                format!("S={s}, {q} block rows; this step was planned for S={}, {} rows", z.s, z.q),
            ));
        }
        if input.features.dims() != [z.s, z.fw] {
            return Err(Error::invalid(
                "features",
                format!("shape {:?}, expected [{}, {}]", input.features.dims(), z.s, z.fw),
            ));
        }
        let stored = |t: &candle_core::Tensor| -> Result<Vec<B::Elem>> {
            let values = t.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
            Ok(values.into_iter().map(B::Elem::from_f32).collect())
        };
        self.upload("features", &stored(&input.features)?)?;
        let x0 = input.block_embeddings(head, self.config.mask_token_id, candle_core::DType::F32)?;
        self.upload("residual.0", &stored(&x0)?)?;
        self.set_positions(&input.query_positions(), &input.key_positions())?;
        self.set_plans(|kind| AttentionPlan::dflash(&input.layout, kind))?;
        self.set_targets(targets)
    }

    /// RoPE tables of the queries `[Q, d]` and keys `[K, d]` (fp32).
    fn set_positions(&mut self, query_positions: &[usize], key_positions: &[usize]) -> Result<()> {
        let c = &self.config.dims;
        let table = |pos: &[usize]| -> Result<(Vec<f32>, Vec<f32>)> {
            let (cos, sin) = rope_tables(pos, c.head_dim, c.rope_theta, candle_core::DType::F32)?;
            Ok((cos.flatten_all()?.to_vec1()?, sin.flatten_all()?.to_vec1()?))
        };
        let (cq, sq) = table(query_positions)?;
        let (ck, sk) = table(key_positions)?;
        self.upload("cos_q", &cq)?;
        self.upload("sin_q", &sq)?;
        self.upload("cos_k", &ck)?;
        self.upload("sin_k", &sk)
    }

    fn set_plans(&mut self, make: impl Fn(AttnKind) -> Result<AttentionPlan>) -> Result<()> {
        self.plans.clear();
        for &kind in &self.config.dims.layer_kinds {
            if !self.plans.contains_key(&kind) {
                let plan = make(kind)?;
                let uploaded = self.dev.upload_plan(&plan)?;
                self.plans.insert(kind, uploaded);
            }
        }
        Ok(())
    }

    fn set_targets(&mut self, targets: &BlockTargets) -> Result<()> {
        let z = self.sizes;
        if targets.labels.len() != z.q || targets.weights.len() != z.q {
            return Err(Error::invalid("targets", format!("{} labels for {} block rows", targets.labels.len(), z.q)));
        }
        if let Some((r, y)) = targets.labels.iter().enumerate().find(|&(_, &y)| y as usize >= z.v) {
            return Err(Error::invalid("targets", format!("label {y} of row {r} is not below the vocab size {}", z.v)));
        }
        let rows: Vec<u32> = (0..z.q as u32).filter(|&r| targets.weights[r as usize] != 0.0).collect();
        let labels: Vec<u32> = rows.iter().map(|&r| targets.labels[r as usize]).collect();
        let weights: Vec<f32> = rows.iter().map(|&r| targets.weights[r as usize] as f32).collect();
        self.upload("rows_ce", &rows)?;
        self.upload("labels", &labels)?;
        self.upload("weights_ce", &weights)?;
        self.weighted_rows = rows.len();
        self.total_weight = targets.total_weight();
        Ok(())
    }

    /// A random input made on the device (features and block embeddings normal(0, 1)) for the
    /// given anchors of one document of `S` tokens, with random labels; for benchmarks.
    pub fn set_random_input(&mut self, anchors: &[usize], gamma: f64, seed: u64) -> Result<()> {
        use rand::{Rng, SeedableRng};
        let z = self.sizes;
        let b = self.config.block_size;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let tokens: Vec<u32> = (0..z.s).map(|_| rng.random_range(0..z.v as u32)).collect();
        let keep = vec![true; anchors.len()];
        let layout = dflash_reference::mask::BlockLayout::new(z.s, b, anchors.to_vec(), keep.clone(), None)?;
        let anchor_set = dflash_reference::anchors::Anchors { positions: anchors.to_vec(), keep };
        let targets = BlockTargets::new(&tokens, &vec![true; z.s], &anchor_set, b, gamma);
        let (features, x0) = (self.bufs.ptr("features"), self.bufs.ptr("residual.0"));
        self.dev.ops().fill_normal(features, z.s * z.fw, seed ^ 1, 0.0, 1.0)?;
        self.dev.ops().fill_normal(x0, z.q * z.h, seed ^ 2, 0.0, 1.0)?;
        let queries: Vec<usize> = anchors.iter().flat_map(|&a| (0..b).map(move |o| a + o)).collect();
        let keys: Vec<usize> = (0..z.s).chain(queries.iter().copied()).collect();
        self.set_positions(&queries, &keys)?;
        self.set_plans(|kind| AttentionPlan::dflash(&layout, kind))?;
        self.set_targets(&targets)
    }

    /// One forward and backward of the uploaded row: writes `grad_scale * d(sum w CE)/dθ` into
    /// the parameter gradients (`grad_scale = 1 / total weight` gives the row's mean-loss
    /// gradient) and returns the row's loss. Fails naming the step and the loss when the loss is
    /// not finite.
    pub fn step(&mut self, grad_scale: f64) -> Result<StepLoss> {
        self.steps_done += 1;
        let z = self.sizes;
        let layers = self.config.dims.num_layers();
        // Context: ctx = hidden_norm(features @ fc^T).
        self.linear(self.bufs.ptr("features"), z.s, z.fw, self.w("fc.weight"), z.h, self.bufs.ptr("ctx_pre"), 0.0)?;
        self.dev.ops().rms_norm_forward(
            self.bufs.ptr("ctx_pre"),
            self.w("hidden_norm.weight"),
            self.bufs.ptr("ctx"),
            self.bufs.ptr("inv_hidden"),
            z.s,
            z.h,
            z.eps,
        )?;
        for l in 0..layers {
            let (acts, attn) = self.layer_sets(l);
            self.layer_forward(l, &acts, &attn, Recompute::No)?;
        }
        self.dev.ops().rms_norm_forward(
            self.bufs.ptr(&format!("residual.{layers}")),
            self.w("norm.weight"),
            self.bufs.ptr("hf"),
            self.bufs.ptr("inv_final"),
            z.q,
            z.h,
            z.eps,
        )?;
        self.lm_head_ce(grad_scale)?;

        // Backward: grad.b = dhf (from the LM head), grad.a = the gradient of the last layer's output.
        self.dev.ops().rms_norm_backward(
            (
                self.bufs.ptr("grad.b"),
                self.bufs.ptr(&format!("residual.{layers}")),
                self.w("norm.weight"),
                self.bufs.ptr("inv_final"),
                0,
            ),
            self.bufs.ptr("grad.a"),
            self.g("norm.weight"),
            self.bufs.ptr("dw_partial"),
            z.q,
            z.h,
        )?;
        self.zero_buffer("dctx")?;
        for l in (0..layers).rev() {
            let (acts, attn) = self.layer_sets(l);
            match self.policy {
                Policy::None => {}
                Policy::Selective => self.layer_forward(l, &acts, &attn, Recompute::KeptAttention)?,
                Policy::PerLayer => self.layer_forward(l, &acts, &attn, Recompute::All)?,
            }
            self.layer_backward(l, &acts, &attn)?;
        }
        // dctx -> through hidden_norm (in place) -> fc.
        let dctx = self.bufs.ptr("dctx");
        self.dev.ops().rms_norm_backward(
            (dctx, self.bufs.ptr("ctx_pre"), self.w("hidden_norm.weight"), self.bufs.ptr("inv_hidden"), 0),
            dctx,
            self.g("hidden_norm.weight"),
            self.bufs.ptr("dw_partial"),
            z.s,
            z.h,
        )?;
        self.weight_grad(dctx, z.s, z.h, self.bufs.ptr("features"), z.fw, self.g("fc.weight"))?;
        self.loss()
    }

    /// Key prefixes of layer `l`'s activations and of its attention out/lse: its own saved ones
    /// or the shared recompute workspace, as the policy allocated them.
    fn layer_sets(&self, l: usize) -> (String, String) {
        let own = format!("layers.{l}.");
        let shared = "recompute.".to_string();
        match self.policy {
            Policy::None => (own.clone(), own),
            Policy::Selective => (shared, own),
            Policy::PerLayer => (shared.clone(), shared),
        }
    }

    /// Layer `l`'s forward from `residual.l` into `residual.{l+1}`, keeping its activations in
    /// the set `a` and its attention out/lse in `t`; a recompute stops at what the backward
    /// reads (gate and up), and reuses kept attention.
    fn layer_forward(&self, l: usize, a: &str, t: &str, recompute: Recompute) -> Result<()> {
        let z = self.sizes;
        let p = |name: &str| self.bufs.ptr(&format!("{a}{name}"));
        let x_in = self.bufs.ptr(&format!("residual.{l}"));
        let kv_in = p("kv_in");
        let xn = kv_in + (z.s * z.h * B::Elem::BYTES) as u64;
        self.dev.copy(kv_in, self.bufs.ptr("ctx"), z.s * z.h * B::Elem::BYTES)?;
        self.dev.ops().rms_norm_forward(
            x_in,
            self.lw(l, "input_layernorm.weight"),
            xn,
            p("inv_in"),
            z.q,
            z.h,
            z.eps,
        )?;
        // q = rope(q_norm(xn @ Wq^T)); k = rope(k_norm(kv_in @ Wk^T)); v = kv_in @ Wv^T.
        self.linear(xn, z.q, z.h, self.lw(l, "self_attn.q_proj.weight"), z.qd, p("q_pre"), 0.0)?;
        self.q_k_forward(l, a, "q")?;
        self.linear(kv_in, z.k, z.h, self.lw(l, "self_attn.k_proj.weight"), z.kd, p("k_pre"), 0.0)?;
        self.q_k_forward(l, a, "k")?;
        self.linear(kv_in, z.k, z.h, self.lw(l, "self_attn.v_proj.weight"), z.kd, p("v"), 0.0)?;
        let (out, lse) = (self.bufs.ptr(&format!("{t}out")), self.bufs.ptr(&format!("{t}lse")));
        if recompute != Recompute::KeptAttention {
            let plan = &self.plans[&self.config.dims.layer_kinds[l]];
            let (q, k) = (self.bufs.ptr("q"), self.bufs.ptr("k"));
            self.dev.attention_forward(plan, self.attn_shape(), (q, k, p("v")), (out, lse))?;
        }
        // x_mid = x + out @ Wo^T; xn2 = post_norm(x_mid); out = x_mid + down(silu(gate) * up).
        let x_mid = p("x_mid");
        self.dev.copy(x_mid, x_in, z.q * z.h * B::Elem::BYTES)?;
        self.linear(out, z.q, z.qd, self.lw(l, "self_attn.o_proj.weight"), z.h, x_mid, 1.0)?;
        self.post_norm_forward(l, a)?;
        let xn2 = self.bufs.ptr("xn2");
        // gate | up = xn2 @ [W_gate; W_up]^T: the two weights are adjacent in the flat buffer.
        self.linear(xn2, z.q, z.h, self.lw(l, "mlp.gate_proj.weight"), 2 * z.i, p("gate_up"), 0.0)?;
        if recompute != Recompute::No {
            return Ok(());
        }
        let h = self.bufs.ptr("h");
        self.dev.ops().swiglu_forward(p("gate_up"), h, z.q, z.i)?;
        let x_out = self.bufs.ptr(&format!("residual.{}", l + 1));
        self.dev.copy(x_out, x_mid, z.q * z.h * B::Elem::BYTES)?;
        self.linear(h, z.q, z.i, self.lw(l, "mlp.down_proj.weight"), z.h, x_out, 1.0)
    }

    /// `q` (or `k`) = rope(head_norm(q_pre)) of layer `l` from its set `a`, into the shared buffer.
    fn q_k_forward(&self, l: usize, a: &str, which: &str) -> Result<()> {
        let z = self.sizes;
        let p = |name: &str| self.bufs.ptr(&format!("{a}{name}"));
        let (tokens, heads, tables) =
            if which == "q" { (z.q, z.nh, ("cos_q", "sin_q")) } else { (z.k, z.nkv, ("cos_k", "sin_k")) };
        self.dev.ops().head_norm_rope_forward(
            (
                p(&format!("{which}_pre")),
                self.lw(l, &format!("self_attn.{which}_norm.weight")),
                self.bufs.ptr(tables.0),
                self.bufs.ptr(tables.1),
            ),
            self.bufs.ptr(which),
            p(&format!("inv_{which}")),
            (tokens, heads, z.d),
            z.eps,
        )
    }

    /// `xn2` = post_norm(x_mid) of layer `l` from its set `a`, into the shared buffer.
    fn post_norm_forward(&self, l: usize, a: &str) -> Result<()> {
        let z = self.sizes;
        let p = |name: &str| self.bufs.ptr(&format!("{a}{name}"));
        let w = self.lw(l, "post_attention_layernorm.weight");
        self.dev.ops().rms_norm_forward(p("x_mid"), w, self.bufs.ptr("xn2"), p("inv_post"), z.q, z.h, z.eps)
    }

    /// Layer `l`'s backward: `grad.a` holds the gradient of its output on entry and of its input
    /// on return; its parameter gradients are added, and its context gradient added to `dctx`.
    fn layer_backward(&self, l: usize, a: &str, t: &str) -> Result<()> {
        let z = self.sizes;
        let p = |name: &str| self.bufs.ptr(&format!("{a}{name}"));
        let b = |key: &str| self.bufs.ptr(key);
        let (dout, dx_mid, dscratch) = (b("grad.a"), b("grad.b"), b("grad.c"));
        let x_in = b(&format!("residual.{l}"));
        let (kv_in, h) = (p("kv_in"), b("h"));
        let xn = kv_in + (z.s * z.h * B::Elem::BYTES) as u64;
        let (q, k, xn2) = (b("q"), b("k"), b("xn2"));
        if self.policy == Policy::None {
            // The shared buffers hold the last layer's: recompute this layer's.
            self.q_k_forward(l, a, "q")?;
            self.q_k_forward(l, a, "k")?;
            self.post_norm_forward(l, a)?;
        }
        // MLP: h = silu(gate) * up (recomputed); dWdown += dout^T h; dh = dout @ Wdown (into h).
        let gate_up = p("gate_up");
        self.dev.ops().swiglu_forward(gate_up, h, z.q, z.i)?;
        self.weight_grad(dout, z.q, z.h, h, z.i, self.lg(l, "mlp.down_proj.weight"))?;
        self.input_grad(dout, z.q, z.h, self.lw(l, "mlp.down_proj.weight"), z.i, h, 0.0)?;
        // gate_up := dgate | dup; dxn2 = [dgate | dup] @ [W_gate; W_up]; the stacked weight
        // gradient [dW_gate; dW_up] lands on both adjacent gradients at once.
        self.dev.ops().swiglu_backward(h, gate_up, z.q, z.i)?;
        self.input_grad(gate_up, z.q, 2 * z.i, self.lw(l, "mlp.gate_proj.weight"), z.h, dscratch, 0.0)?;
        self.weight_grad(gate_up, z.q, 2 * z.i, xn2, z.h, self.lg(l, "mlp.gate_proj.weight"))?;
        // dx_mid = dout + post_norm backward.
        self.dev.ops().rms_norm_backward(
            (dscratch, p("x_mid"), self.lw(l, "post_attention_layernorm.weight"), p("inv_post"), dout),
            dx_mid,
            self.lg(l, "post_attention_layernorm.weight"),
            b("dw_partial"),
            z.q,
            z.h,
        )?;
        // Attention: dattn = dx_mid @ Wo, dWo += dx_mid^T out; then the fused backward.
        let (out, lse) = (b(&format!("{t}out")), b(&format!("{t}lse")));
        let dattn = dscratch; // free until dxn

        self.input_grad(dx_mid, z.q, z.h, self.lw(l, "self_attn.o_proj.weight"), z.qd, dattn, 0.0)?;
        self.weight_grad(dx_mid, z.q, z.h, out, z.qd, self.lg(l, "self_attn.o_proj.weight"))?;
        let (dq, dk, dv) = (b("dq"), b("dk"), b("dv"));
        let plan = &self.plans[&self.config.dims.layer_kinds[l]];
        self.dev.attention_backward(
            plan,
            self.attn_shape(),
            (q, k, p("v")),
            (out, lse, dattn),
            b("dsum"),
            (dq, dk, dv),
        )?;
        // Through RoPE and the head norms, in place.
        self.dev.ops().head_norm_rope_backward(
            (dq, p("q_pre"), self.lw(l, "self_attn.q_norm.weight"), p("inv_q"), b("cos_q"), b("sin_q")),
            dq,
            self.lg(l, "self_attn.q_norm.weight"),
            b("dw_partial"),
            (z.q, z.nh, z.d),
        )?;
        self.dev.ops().head_norm_rope_backward(
            (dk, p("k_pre"), self.lw(l, "self_attn.k_norm.weight"), p("inv_k"), b("cos_k"), b("sin_k")),
            dk,
            self.lg(l, "self_attn.k_norm.weight"),
            b("dw_partial"),
            (z.k, z.nkv, z.d),
        )?;
        // Projections: dxn = dq @ Wq + (dk @ Wk + dv @ Wv)[S..]; dctx += (dk @ Wk + dv @ Wv)[..S].
        let (wq, wk, wv) = (
            self.lw(l, "self_attn.q_proj.weight"),
            self.lw(l, "self_attn.k_proj.weight"),
            self.lw(l, "self_attn.v_proj.weight"),
        );
        self.input_grad(dq, z.q, z.qd, wq, z.h, dscratch, 0.0)?;
        let (dk_blocks, dv_blocks) =
            (dk + (z.s * z.kd * B::Elem::BYTES) as u64, dv + (z.s * z.kd * B::Elem::BYTES) as u64);
        self.input_grad(dk_blocks, z.q, z.kd, wk, z.h, dscratch, 1.0)?;
        self.input_grad(dv_blocks, z.q, z.kd, wv, z.h, dscratch, 1.0)?;
        self.input_grad(dk, z.s, z.kd, wk, z.h, b("dctx"), 1.0)?;
        self.input_grad(dv, z.s, z.kd, wv, z.h, b("dctx"), 1.0)?;
        self.weight_grad(dq, z.q, z.qd, xn, z.h, self.lg(l, "self_attn.q_proj.weight"))?;
        self.weight_grad(dk, z.k, z.kd, kv_in, z.h, self.lg(l, "self_attn.k_proj.weight"))?;
        self.weight_grad(dv, z.k, z.kd, kv_in, z.h, self.lg(l, "self_attn.v_proj.weight"))?;
        // dx = dx_mid + input_norm backward (into grad.a).
        self.dev.ops().rms_norm_backward(
            (dscratch, x_in, self.lw(l, "input_layernorm.weight"), p("inv_in"), dx_mid),
            dout,
            self.lg(l, "input_layernorm.weight"),
            b("dw_partial"),
            z.q,
            z.h,
        )
    }

    /// The frozen LM head and decayed CE over the weighted rows, `lm_chunk_rows` at a time:
    /// `grad.b [Q, H]` gets `grad_scale * d(sum w CE)/dhf` (zero on unweighted rows).
    fn lm_head_ce(&mut self, grad_scale: f64) -> Result<()> {
        let z = self.sizes;
        self.zero_buffer("grad.b")?;
        let b = |key: &str| self.bufs.ptr(key);
        let chunk = self.shape.lm_chunk_rows.min(z.q).max(1);
        let mut start = 0;
        while start < self.weighted_rows {
            let n = chunk.min(self.weighted_rows - start);
            let rows = b("rows_ce") + (start * 4) as u64;
            self.dev.ops().copy_rows(false, b("hf"), rows, b("lm.rows"), n, z.h)?;
            self.linear(b("lm.rows"), n, z.h, b("lm_head"), z.v, b("lm.logits"), 0.0)?;
            self.dev.ops().ce_grad_rows(
                b("lm.logits"),
                b("labels") + (start * 4) as u64,
                b("weights_ce") + (start * 4) as u64,
                b("loss_rows") + (start * 4) as u64,
                n,
                z.v,
                grad_scale as f32,
            )?;
            self.input_grad(b("lm.logits"), n, z.v, b("lm_head"), z.h, b("lm.drows"), 0.0)?;
            self.dev.ops().copy_rows(true, b("lm.drows"), rows, b("grad.b"), n, z.h)?;
            start += n;
        }
        Ok(())
    }

    /// The loss of the last step from its per-row CE (downloaded: waits for the step).
    fn loss(&self) -> Result<StepLoss> {
        let losses: Vec<f32> = download(&self.dev, self.bufs.ptr("loss_rows"), self.weighted_rows)?;
        let sum: f64 = losses.iter().map(|&x| f64::from(x)).sum();
        let loss = if self.total_weight > 0.0 { sum / self.total_weight } else { 0.0 };
        if !loss.is_finite() {
            return Err(Error::invalid(
                format!("loss of step {}", self.steps_done),
                format!("{loss} (not finite) on {}", self.dev.name()),
            ));
        }
        Ok(StepLoss { loss, total_weight: self.total_weight })
    }

    /// `y [rows, n] = x [rows, k] @ w [n, k]^T + beta * y`.
    #[allow(clippy::too_many_arguments)]
    fn linear(&self, x: u64, rows: usize, k: usize, w: u64, n: usize, y: u64, beta: f32) -> Result<()> {
        self.dev.matmul(Mat::n(x, rows, k), Mat::t(w, n, k), y, beta)
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
        AttnShape { num_heads: self.sizes.nh, num_kv_heads: self.sizes.nkv, head_dim: self.sizes.d }
    }

    /// Every parameter gradient of the last step on the host, in checkpoint-key order.
    pub fn grads_to_host(&self) -> Result<Vec<(String, Vec<f32>)>> {
        let all: Vec<B::Elem> = download(&self.dev, self.bufs.ptr("grads"), self.num_params())?;
        let all: Vec<f32> = all.into_iter().map(Elem::to_f32).collect();
        Ok(self.slots.iter().map(|s| (s.name.clone(), all[s.offset..s.offset + s.len].to_vec())).collect())
    }

    /// The sum of squares of every parameter's gradient, of the last step (`grads`, stored) or
    /// accumulated (`grad_acc`, fp32), as fp32 partials summed in f64 on the host; fails naming
    /// the first gradient that holds NaN or Inf.
    pub fn grad_sum_squares(&self, key: &str) -> Result<Vec<f64>> {
        let partial = self.bufs.ptr("norm_partial");
        let stored = key == "grads";
        let width = if stored { B::Elem::BYTES } else { 4 };
        for (n, slot) in self.slots.iter().enumerate() {
            let g = self.bufs.ptr(key) + (slot.offset * width) as u64;
            self.dev.ops().sum_squares(stored, g, partial + (n * NORM_PARTS * 4) as u64, slot.len, NORM_PARTS)?;
        }
        let partials: Vec<f32> = download(&self.dev, self.bufs.ptr("norm_partial"), self.slots.len() * NORM_PARTS)?;
        self.slots
            .iter()
            .enumerate()
            .map(|(n, slot)| {
                let sq: f64 = partials[n * NORM_PARTS..(n + 1) * NORM_PARTS].iter().map(|&x| x as f64).sum();
                if !sq.is_finite() {
                    return Err(Error::invalid(
                        format!("gradient of {} ({key}, after step {})", slot.name, self.steps_done),
                        "holds NaN or Inf",
                    ));
                }
                Ok(sq)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::named_plans;

    /// The flat layout covers every parameter once, in checkpoint-key order, without gaps, and
    /// keeps each layer's gate and up projections adjacent (the stacked-weight matmul needs it).
    #[test]
    fn param_slots_are_contiguous_and_stack_gate_and_up() {
        for p in named_plans() {
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
