//! The memory planner (DESIGN.md, "Know memory before spending it"): a pure function of the
//! drafter config, the step's shapes and the checkpointing policy that itemises the bytes of a
//! GPU training step (bf16 compute, fp32 master weights, gradients and AdamW state) and predicts
//! its peak, next to the peaks of the known failure modes (spec section 5, items 6 and 7).

use dflash_reference::config::DraftConfig;
use dflash_reference::drafter::param_shapes;

/// Bytes of one bf16 value, and of one f32 value.
const BF16: u64 = 2;
const F32: u64 = 4;

/// Which activations the forward keeps for the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Every layer's activations.
    None,
    /// Each layer's input and its attention output and logsumexp; the norms, projections and
    /// the MLP are recomputed (as the CPU step's `Checkpointing::Selective`).
    Selective,
    /// Each layer's input only; the whole layer is recomputed in the backward.
    PerLayer,
}

impl Policy {
    pub const ALL: [Policy; 3] = [Policy::None, Policy::Selective, Policy::PerLayer];

    pub fn name(self) -> &'static str {
        match self {
            Policy::None => "none",
            Policy::Selective => "selective",
            Policy::PerLayer => "per-layer",
        }
    }
}

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

/// The itemised plan of one step and its predicted peak.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Held for the whole run (weights, master copy, gradients, optimizer state, frozen tables).
    pub persistent: Vec<PlanItem>,
    /// Held from the forward until the backward (inputs, context features, saved activations).
    pub saved: Vec<PlanItem>,
    /// The largest transient of the step (one layer's backward, or one LM-head chunk).
    pub transient: Vec<PlanItem>,
    pub peak: u64,
    /// The peak without optimizer state and fp32 master weights (what a PyTorch step measured
    /// without its optimizer counts).
    pub peak_without_optimizer: u64,
}

/// Sizes the plan is made of.
struct Dims {
    hidden: u64,
    inter: u64,
    q_dim: u64,
    kv_dim: u64,
    heads: u64,
    layers: u64,
    vocab: u64,
    features: u64,
    s: u64,
    q: u64,
    k: u64,
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
            layers: c.num_layers() as u64,
            vocab: c.vocab_size as u64,
            features: config.num_features() as u64,
            s: shape.context_len as u64,
            q,
            k: shape.context_len as u64 + q,
        }
    }

    /// One layer's saved activations under `policy`.
    fn layer_saved(&self, policy: Policy) -> u64 {
        let input = self.q * self.hidden * BF16;
        let attention = self.q * self.q_dim * BF16 + self.heads * self.q * F32; // out, lse
        let rest = self.q * self.hidden * 3 * BF16 // xn, x_mid, xn2
            + (self.q * self.q_dim + self.k * self.kv_dim) * 2 * BF16 // q, k before and after norm + RoPE
            + self.k * self.kv_dim * BF16 // v
            + self.q * self.inter * 3 * BF16 // gate, up, h
            + (self.q * 2 + self.q * self.heads + self.k * self.heads) * F32; // inverse RMS values
        match policy {
            Policy::None => input + attention + rest,
            Policy::Selective => input + attention,
            Policy::PerLayer => input,
        }
    }
}

/// The plan of one step of `config` at `shape` under `policy`.
pub fn plan_step(config: &DraftConfig, shape: StepShape, policy: Policy) -> MemoryPlan {
    let d = Dims::new(config, shape);
    let params: u64 = param_shapes(config).iter().map(|(_, s)| s.iter().product::<usize>() as u64).sum();
    let persistent = vec![
        PlanItem { name: "weights (bf16 compute copy)", bytes: params * BF16 },
        PlanItem { name: "gradients (fp32)", bytes: params * F32 },
        PlanItem { name: "master weights (fp32)", bytes: params * F32 },
        PlanItem { name: "AdamW moments (fp32, 2x)", bytes: params * F32 * 2 },
        PlanItem { name: "frozen embedding + LM head (bf16)", bytes: 2 * d.vocab * d.hidden * BF16 },
    ];
    let recompute_one = if policy == Policy::None { 0 } else { d.layer_saved(Policy::None) - d.layer_saved(policy) };
    let saved = vec![
        PlanItem { name: "target features [S, F*H] (bf16)", bytes: d.s * d.features * d.hidden * BF16 },
        PlanItem { name: "context ctx and its pre-norm [S, H] (bf16)", bytes: 2 * d.s * d.hidden * BF16 },
        PlanItem { name: "saved activations, all layers", bytes: d.layers * d.layer_saved(policy) },
        PlanItem { name: "final hidden [Q, H] (bf16)", bytes: d.q * d.hidden * BF16 },
    ];
    let layer_backward = recompute_one
        + (d.q * d.q_dim * 2 + d.k * d.kv_dim * 2) * BF16 // dq, dout; dk, dv
        + d.heads * d.q * F32 // dsum
        + (d.q * d.inter * 2 + d.q * d.hidden * 3 + d.k * d.hidden) * BF16; // MLP and residual gradients
    let lm_chunk = shape.lm_chunk_rows as u64 * d.vocab * F32 + d.q * d.hidden * BF16;
    let transient = if layer_backward >= lm_chunk {
        vec![PlanItem { name: "one layer's backward (recompute, activation gradients)", bytes: layer_backward }]
    } else {
        vec![PlanItem { name: "LM head + CE chunk (fp32 logits) and dh", bytes: lm_chunk }]
    };
    let sum = |items: &[PlanItem]| items.iter().map(|i| i.bytes).sum::<u64>();
    let peak = sum(&persistent) + sum(&saved) + sum(&transient);
    let optimizer_only = params * F32 * 3;
    MemoryPlan { persistent, saved, transient, peak, peak_without_optimizer: peak - optimizer_only }
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

/// Renders `bytes` as GB (1e9 bytes) with 3 decimals.
pub fn gb(bytes: u64) -> String {
    format!("{:.3} GB", bytes as f64 / 1e9)
}

impl MemoryPlan {
    /// The plan as a table: one line per item, the peak, and whether it fits `device_bytes`.
    pub fn render(&self, device_bytes: u64) -> String {
        let mut out = String::new();
        for (title, items) in [("persistent", &self.persistent), ("saved", &self.saved), ("transient", &self.transient)]
        {
            out.push_str(&format!("{title}:\n"));
            for item in items.iter() {
                out.push_str(&format!("  {:<58} {:>12}\n", item.name, gb(item.bytes)));
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
