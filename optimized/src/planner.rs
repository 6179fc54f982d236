//! The memory planner (DESIGN.md, "Know memory before spending it"): a pure function of the
//! drafter config, the step's shapes and the checkpointing policy that itemises the bytes of a
//! GPU training step (bf16 compute, fp32 master weights, gradients and AdamW state) and predicts
//! its peak, next to the peaks of the known failure modes (spec section 5, items 6 and 7).

use dflash_reference::config::DraftConfig;
use dflash_reference::drafter::param_shapes;

use crate::attention::cpu::TILE_K;
pub use crate::step::drafter_step::Checkpointing;
use crate::step::planned::kernels::GRAD_PARTS;

/// Bytes of one bf16 value, and of one f32 (or u32) value.
const BF16: u64 = 2;
const F32: u64 = 4;

/// Which activations the forward keeps for the backward (the CPU step's and the GPU step's).
pub type Policy = Checkpointing;

/// The shapes of one training step: one row of `context_len` tokens with `num_anchors` blocks,
/// and the LM head computed `lm_chunk_rows` block rows at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    pub context_len: usize,
    pub num_anchors: usize,
    pub lm_chunk_rows: usize,
}

/// One itemised line of a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanItem {
    pub name: &'static str,
    pub bytes: u64,
}

/// When a buffer of the step is needed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lifetime {
    /// For the whole run: bf16 weights, one step's bf16 gradients, the frozen LM head.
    Model,
    /// For the whole run, only when training: fp32 master weights, fp32 accumulated gradients
    /// and AdamW moments.
    Optimizer,
    /// From the forward to the backward: inputs, context, saved activations.
    Saved,
    /// Scratch used in the layer phases and the LM-head phase (the head's output gradient).
    Transient,
    /// Scratch of one layer's forward or backward, reused by every layer; shares the scratch
    /// region with [`Lifetime::Head`] (the two phases never overlap).
    Layer,
    /// Scratch of one LM-head chunk, inside the scratch region.
    Head,
}

/// The key of the region the [`Lifetime::Layer`] and [`Lifetime::Head`] buffers live in.
pub const SCRATCH: &str = "scratch";
/// Alignment of buffers inside the scratch region, in bytes.
const SCRATCH_ALIGN: u64 = 256;

/// One device buffer of the GPU step: `key` (what the step looks it up by), the plan item it
/// counts under, its size, and for a scratch buffer its byte offset in the [`SCRATCH`] region
/// (it is then not allocated by itself).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepBuffer {
    pub key: String,
    pub item: &'static str,
    pub lifetime: Lifetime,
    pub bytes: u64,
    pub scratch_offset: Option<u64>,
}

/// The itemised plan of one step and its predicted peak.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Held for the whole run (weights, gradients, frozen LM head, master copy, optimizer state).
    pub persistent: Vec<PlanItem>,
    /// Held from the forward until the backward (inputs, context features, saved activations).
    pub saved: Vec<PlanItem>,
    /// Scratch: the scratch region and what lives outside it.
    pub transient: Vec<PlanItem>,
    /// What the scratch region holds in a layer's phase, and in the LM-head phase (not added
    /// to the peak: the region is).
    pub layer_scratch: Vec<PlanItem>,
    pub head_scratch: Vec<PlanItem>,
    pub peak: u64,
    /// The peak without optimizer state and fp32 master copies of weights and gradients (what a
    /// PyTorch step measured without its optimizer counts).
    pub peak_without_optimizer: u64,
}

/// Sizes the buffers are made of.
struct Dims {
    hidden: u64,
    inter: u64,
    q_dim: u64,
    kv_dim: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    layers: u64,
    vocab: u64,
    features: u64,
    s: u64,
    q: u64,
    k: u64,
    lm_rows: u64,
}

impl Dims {
    fn new(config: &DraftConfig, shape: StepShape) -> Self {
        let c = &config.dims;
        let q = (shape.num_anchors * config.block_size) as u64;
        Dims {
            hidden: c.hidden_size as u64,
            inter: c.intermediate_size as u64,
            q_dim: (c.num_heads * c.head_dim) as u64,
            kv_dim: (c.num_kv_heads * c.head_dim) as u64,
            heads: c.num_heads as u64,
            kv_heads: c.num_kv_heads as u64,
            head_dim: c.head_dim as u64,
            layers: c.num_layers() as u64,
            vocab: c.vocab_size as u64,
            features: (config.num_features() * c.hidden_size) as u64,
            s: shape.context_len as u64,
            q,
            k: shape.context_len as u64 + q,
            lm_rows: (shape.lm_chunk_rows as u64).min(q).max(1),
        }
    }
}

/// Plan items of the saved activations and of their recompute workspace.
const SAVED_LAYERS: &str = "saved layer activations, all layers";
const SAVED_ATTENTION: &str = "saved attention out + logsumexp, all layers";
const WORKSPACE: &str = "one layer's activations (recomputed in the backward)";
const WORKSPACE_ATTENTION: &str = "one layer's attention out + logsumexp (recomputed)";

/// The key of the attention plans' bytes: uploaded by `DevicePlan` with each input, not
/// allocated with the other buffers.
pub const ATTENTION_PLANS: &str = "attention plans";

/// Fp32 partials per parameter of the gradient-norm reduction.
pub const NORM_PARTS: usize = 64;

/// Every device buffer of one GPU training step of `config` at `shape` under `policy`, with
/// `optimizer` buffers when training (not when only the step is measured). The GPU step
/// allocates exactly these (`step::planned`), so the plan is what the step holds.
pub fn step_buffers(config: &DraftConfig, shape: StepShape, policy: Policy, optimizer: bool) -> Vec<StepBuffer> {
    step_buffers_of(config, shape, policy, optimizer, BF16)
}

/// [`step_buffers`] for a step storing weights, activations and step gradients in values of
/// `elem` bytes (2 for bf16: the GPU; 4 for f32: the CPU step in f32).
pub fn step_buffers_of(
    config: &DraftConfig,
    shape: StepShape,
    policy: Policy,
    optimizer: bool,
    elem: u64,
) -> Vec<StepBuffer> {
    let d = Dims::new(config, shape);
    let layers = config.dims.num_layers();
    let params: u64 = param_shapes(config).iter().map(|(_, s)| s.iter().product::<usize>() as u64).sum();
    let mut out = Vec::new();
    let mut add = |key: String, item: &'static str, lifetime: Lifetime, bytes: u64| {
        out.push(StepBuffer { key, item, lifetime, bytes, scratch_offset: None })
    };
    use Lifetime::{Head, Layer, Model, Optimizer, Saved, Transient};
    add("weights".into(), "weights (compute copy)", Model, params * elem);
    add("grads".into(), "gradients of one step", Model, params * elem);
    add("lm_head".into(), "frozen LM head", Model, d.vocab * d.hidden * elem);
    if optimizer {
        add("master".into(), "master weights (fp32)", Optimizer, params * F32);
        add("grad_acc".into(), "accumulated gradients (fp32)", Optimizer, params * F32);
        add("adam_m".into(), "AdamW moments (fp32, 2x)", Optimizer, params * F32);
        add("adam_v".into(), "AdamW moments (fp32, 2x)", Optimizer, params * F32);
    }
    let inputs = "inputs: features, RoPE tables, labels, weights";
    add("features".into(), inputs, Saved, d.s * d.features * elem);
    for key in ["cos_q", "sin_q"] {
        add(key.into(), inputs, Saved, d.q * d.head_dim * F32);
    }
    for key in ["cos_k", "sin_k"] {
        add(key.into(), inputs, Saved, d.k * d.head_dim * F32);
    }
    for key in ["labels", "weights_ce", "rows_ce", "loss_rows"] {
        add(key.into(), inputs, Saved, d.q * F32);
    }
    let context = "context: fc output, ctx, inverse RMS";
    add("ctx_pre".into(), context, Saved, d.s * d.hidden * elem);
    add("ctx".into(), context, Saved, d.s * d.hidden * elem);
    add("inv_hidden".into(), context, Saved, d.s * F32);
    let residual = "residual stream: every layer's input, the output";
    for l in 0..=layers {
        add(format!("residual.{l}"), residual, Saved, d.q * d.hidden * elem);
    }
    add("hf".into(), "final norm output and inverse RMS", Saved, d.q * d.hidden * elem);
    add("inv_final".into(), "final norm output and inverse RMS", Saved, d.q * F32);

    let layer_sets: Vec<(String, &'static str, Lifetime)> = match policy {
        Policy::None => (0..layers).map(|l| (format!("layers.{l}."), SAVED_LAYERS, Saved)).collect(),
        _ => vec![("recompute.".to_string(), WORKSPACE, Layer)],
    };
    for (prefix, item, lifetime) in layer_sets {
        for (name, bytes) in [
            ("kv_in", d.k * d.hidden * elem),
            ("inv_in", d.q * F32),
            ("q_pre", d.q * d.q_dim * elem),
            ("inv_q", d.q * d.heads * F32),
            ("k_pre", d.k * d.kv_dim * elem),
            ("inv_k", d.k * d.kv_heads * F32),
            ("v", d.k * d.kv_dim * elem),
            ("x_mid", d.q * d.hidden * elem),
            ("inv_post", d.q * F32),
            ("gate_up", d.q * 2 * d.inter * elem),
        ] {
            add(format!("{prefix}{name}"), item, lifetime, bytes);
        }
    }
    let attention_sets: Vec<(String, &'static str, Lifetime)> = match policy {
        Policy::PerLayer => vec![("recompute.".to_string(), WORKSPACE_ATTENTION, Layer)],
        _ => (0..layers).map(|l| (format!("layers.{l}."), SAVED_ATTENTION, Saved)).collect(),
    };
    for (prefix, item, lifetime) in attention_sets {
        add(format!("{prefix}out"), item, lifetime, d.q * d.q_dim * elem);
        add(format!("{prefix}lse"), item, lifetime, d.heads * d.q * F32);
    }

    // Cheap to recompute from what a layer keeps, so one copy serves every layer: q and k after
    // their norm and RoPE (from q_pre, k_pre) and the post-attention norm's output (from x_mid).
    let cheap = "q, k after norm + RoPE, xn2 (recomputed per layer)";
    add("q".into(), cheap, Layer, d.q * d.q_dim * elem);
    add("k".into(), cheap, Layer, d.k * d.kv_dim * elem);
    add("xn2".into(), cheap, Layer, d.q * d.hidden * elem);
    let grads = "activation gradients of one layer";
    add("h".into(), "SwiGLU output / its gradient", Layer, d.q * d.inter * elem);
    add("grad.a".into(), grads, Layer, d.q * d.hidden * elem);
    // grad.b also takes the LM head's output gradient.
    add("grad.b".into(), "output gradient of the LM head / of a layer", Transient, d.q * d.hidden * elem);
    // grad.c holds dxn2 and dxn, and between them the attention's output gradient.
    add("grad.c".into(), grads, Layer, d.q * d.hidden.max(d.q_dim) * elem);
    add("dq".into(), grads, Layer, d.q * d.q_dim * elem);
    add("dk".into(), grads, Layer, d.k * d.kv_dim * elem);
    add("dv".into(), grads, Layer, d.k * d.kv_dim * elem);
    add("dsum".into(), grads, Layer, d.heads * d.q * F32);
    add("dctx".into(), grads, Layer, d.s * d.hidden * elem);
    let reductions = "reduction partials (norm weights, gradient norm)";
    add("dw_partial".into(), reductions, Layer, GRAD_PARTS as u64 * d.hidden.max(d.head_dim) * F32);
    let param_count = param_shapes(config).len() as u64;
    add("norm_partial".into(), reductions, Layer, param_count * NORM_PARTS as u64 * F32);
    // One DFlash attention plan per distinct layer kind: a 6-u32 row group per block and a
    // 2-u32 range per 64-key tile (`attention::cuda::DevicePlan`).
    let kinds: std::collections::HashSet<_> = config.dims.layer_kinds.iter().collect();
    let plan_bytes = shape.num_anchors as u64 * 6 * F32 + d.k.div_ceil(TILE_K as u64) * 2 * F32;
    add(ATTENTION_PLANS.into(), inputs, Saved, kinds.len() as u64 * plan_bytes);
    let lm = "one LM-head chunk: rows, logits / their gradient";
    add("lm.rows".into(), lm, Head, d.lm_rows * d.hidden * elem);
    add("lm.logits".into(), lm, Head, d.lm_rows * d.vocab * elem);
    add("lm.drows".into(), lm, Head, d.lm_rows * d.hidden * elem);
    place_in_scratch(&mut out);
    out
}

/// Lays the layer-phase and the head-phase scratch buffers out from offset 0 of one region each
/// (aligned), and adds the region, as large as the larger phase.
fn place_in_scratch(buffers: &mut Vec<StepBuffer>) {
    let mut region = 0;
    for phase in [Lifetime::Layer, Lifetime::Head] {
        let mut offset = 0;
        for b in buffers.iter_mut().filter(|b| b.lifetime == phase) {
            b.scratch_offset = Some(offset);
            offset += b.bytes.div_ceil(SCRATCH_ALIGN) * SCRATCH_ALIGN;
        }
        region = region.max(offset);
    }
    buffers.push(StepBuffer {
        key: SCRATCH.to_string(),
        item: "scratch region (one layer's phase or one LM-head chunk)",
        lifetime: Lifetime::Transient,
        bytes: region,
        scratch_offset: None,
    });
}

/// The plan of one training step (with optimizer state) of `config` at `shape` under `policy`:
/// the buffers of [`step_buffers`] summed per item.
pub fn plan_step(config: &DraftConfig, shape: StepShape, policy: Policy) -> MemoryPlan {
    let buffers = step_buffers(config, shape, policy, true);
    let items = |keep: &dyn Fn(Lifetime) -> bool| {
        let mut items: Vec<PlanItem> = Vec::new();
        for b in buffers.iter().filter(|b| keep(b.lifetime)) {
            match items.iter_mut().find(|i| i.name == b.item) {
                Some(i) => i.bytes += b.bytes,
                None => items.push(PlanItem { name: b.item, bytes: b.bytes }),
            }
        }
        items
    };
    let persistent = items(&|l| matches!(l, Lifetime::Model | Lifetime::Optimizer));
    let saved = items(&|l| l == Lifetime::Saved);
    let transient = items(&|l| l == Lifetime::Transient);
    let layer_scratch = items(&|l| l == Lifetime::Layer);
    let head_scratch = items(&|l| l == Lifetime::Head);
    let peak = allocated_bytes(&buffers);
    let optimizer: u64 = buffers.iter().filter(|b| b.lifetime == Lifetime::Optimizer).map(|b| b.bytes).sum();
    MemoryPlan {
        persistent,
        saved,
        transient,
        layer_scratch,
        head_scratch,
        peak,
        peak_without_optimizer: peak - optimizer,
    }
}

/// Peak bytes of the known failure modes at `shape`, for comparison with a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailureModes {
    /// Eager attention materialising `[heads, Q, K]` scores per layer for the backward: fp32
    /// scores, fp32 probabilities and their bf16 copy kept by autograd, the boolean mask, and
    /// fp32 gradients of probabilities and scores in the backward (19 bytes per score).
    pub unfused_attention_one_layer: u64,
    /// Chunked attention without checkpointing: every query chunk of `chunk_rows` rows keeps its
    /// K and V expanded to all query heads (`[heads, K, d]` bf16 each) until the backward, in
    /// every layer.
    pub chunked_attention_all_layers: u64,
    pub chunk_rows: usize,
}

/// Bytes per score element of eager attention (see [`FailureModes::unfused_attention_one_layer`]).
const EAGER_BYTES_PER_SCORE: u64 = 4 + 4 + 2 + 1 + 4 + 4;

/// The failure modes' peaks for `config` at `shape`, chunked attention in chunks of `chunk_rows`.
pub fn failure_modes(config: &DraftConfig, shape: StepShape, chunk_rows: usize) -> FailureModes {
    let d = Dims::new(config, shape);
    let head_dim = config.dims.head_dim as u64;
    let chunks = d.q.div_ceil(chunk_rows.max(1) as u64);
    FailureModes {
        unfused_attention_one_layer: d.heads * d.q * d.k * EAGER_BYTES_PER_SCORE,
        chunked_attention_all_layers: d.layers * chunks * 2 * d.heads * d.k * head_dim * BF16,
        chunk_rows,
    }
}

/// Bytes the step allocates: every buffer outside the scratch region (the region included).
pub fn allocated_bytes(buffers: &[StepBuffer]) -> u64 {
    buffers.iter().filter(|b| b.scratch_offset.is_none()).map(|b| b.bytes).sum()
}

/// Refuses a step whose `buffers` (of [`step_buffers`]) need more than `available` bytes, before
/// anything is allocated: the error names the total, the device and the largest buffers.
pub fn check_fits(buffers: &[StepBuffer], available: u64, device: &str) -> Result<(), String> {
    let needed = allocated_bytes(buffers);
    if needed <= available {
        return Ok(());
    }
    let mut largest: Vec<&StepBuffer> = buffers.iter().filter(|b| b.scratch_offset.is_none()).collect();
    largest.sort_by_key(|b| std::cmp::Reverse(b.bytes));
    let names: Vec<String> =
        largest.iter().take(4).map(|b| format!("{} ({}) {}", b.key, b.item, gb(b.bytes))).collect();
    Err(format!(
        "the step needs {} but {device} has {} available; largest buffers: {}; try a checkpointing policy that \
         keeps less, fewer anchors or a shorter context",
        gb(needed),
        gb(available),
        names.join(", ")
    ))
}

/// Renders `bytes` as GB (1e9 bytes) with 3 decimals.
pub fn gb(bytes: u64) -> String {
    format!("{:.3} GB", bytes as f64 / 1e9)
}

impl MemoryPlan {
    /// The plan as a table: one line per item, the peak, and whether it fits `device_bytes`.
    pub fn render(&self, device_bytes: u64) -> String {
        let mut out = String::new();
        for (title, items) in [
            ("persistent", &self.persistent),
            ("saved", &self.saved),
            ("transient", &self.transient),
            ("  in the scratch region, a layer's phase", &self.layer_scratch),
            ("  in the scratch region, the LM-head phase", &self.head_scratch),
        ] {
            out.push_str(&format!("{title}:\n"));
            let indent = if title.starts_with(' ') { "    " } else { "  " };
            for item in items.iter() {
                out.push_str(&format!(
                    "{indent}{:<width$} {:>12}\n",
                    item.name,
                    gb(item.bytes),
                    width = 60 - indent.len()
                ));
            }
        }
        out.push_str(&format!("  {:<58} {:>12}\n", "predicted peak", gb(self.peak)));
        out.push_str(&format!(
            "  {:<58} {:>12}\n",
            "peak without optimizer state and master weights",
            gb(self.peak_without_optimizer)
        ));
        let verdict = if self.peak <= device_bytes { "fits" } else { "DOES NOT FIT" };
        out.push_str(&format!("  {verdict} in {}\n", gb(device_bytes)));
        out
    }
}

/// A named configuration to plan: a drafter and one step's shapes.
pub struct NamedPlan {
    pub name: &'static str,
    pub config: DraftConfig,
    pub shape: StepShape,
}

/// LM-head rows per chunk of the named plans.
pub const DEFAULT_LM_CHUNK_ROWS: usize = 1024;

/// The configurations issue 4 names: the Qwen3-8B drafter at S=3072, N=512, and the drafter of
/// a 64-layer target (hidden 5120, SwiGLU 17408, 40/8 heads of 128 assumed, 4 sliding layers of
/// window 2048 + 1 full) at S=8192, N=1024.
pub fn named_plans() -> Vec<NamedPlan> {
    use dflash_reference::config::{AttnKind, ModelDims};
    let drafter = |hidden, inter, heads, layer_kinds: Vec<AttnKind>, target_layers, target_layer_ids| DraftConfig {
        dims: ModelDims {
            hidden_size: hidden,
            intermediate_size: inter,
            num_heads: heads,
            num_kv_heads: 8,
            head_dim: 128,
            vocab_size: 151936,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            max_position_embeddings: 40960,
            layer_kinds,
        },
        block_size: 16,
        num_target_layers: target_layers,
        mask_token_id: 151669,
        target_layer_ids,
    };
    let sliding = AttnKind::Sliding { window: 2048 };
    vec![
        NamedPlan {
            name: "qwen3-8b-drafter S=3072 N=512",
            config: drafter(4096, 12288, 32, vec![AttnKind::Full; 5], 36, vec![1, 9, 17, 25, 33]),
            shape: StepShape { context_len: 3072, num_anchors: 512, lm_chunk_rows: DEFAULT_LM_CHUNK_ROWS },
        },
        NamedPlan {
            name: "64-layer-target drafter S=8192 N=1024",
            config: drafter(
                5120,
                17408,
                40,
                vec![sliding, sliding, sliding, sliding, AttnKind::Full],
                64,
                dflash_reference::config::default_target_layer_ids(64, 5),
            ),
            shape: StepShape { context_len: 8192, num_anchors: 1024, lm_chunk_rows: DEFAULT_LM_CHUNK_ROWS },
        },
    ]
}
