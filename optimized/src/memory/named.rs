//! The named configurations the planner and the benchmarks use.

use dflash_reference::config::{AttnKind, DraftConfig, ModelDims, RopeScaling, TargetArch, TargetConfig};

use super::step::StepShape;

/// A named configuration to plan: a drafter and one step's shapes.
pub struct NamedConfig {
    pub name: &'static str,
    pub config: DraftConfig,
    pub shape: StepShape,
}

/// LM-head rows per chunk of the named plans.
pub const DEFAULT_LM_CHUNK_ROWS: usize = 1024;

/// The configurations issue 4 names: the Qwen3-8B drafter at S=3072, N=512, and the drafter of
/// a 64-layer target (hidden 5120, SwiGLU 17408, 40/8 heads of 128 assumed, 4 sliding layers of
/// window 2048 + 1 full) at S=8192, N=1024.
pub fn named_configs() -> Vec<NamedConfig> {
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
        NamedConfig {
            name: "qwen3-8b-drafter S=3072 N=512",
            // The target's dims, 5 full layers, blocks of 16, features from [1, 9, 17, 25, 33].
            config: DraftConfig::for_target(&qwen3_8b_target(), 5, 16, 151669, 5),
            shape: StepShape { context_len: 3072, num_anchors: 512, lm_chunk_rows: DEFAULT_LM_CHUNK_ROWS },
        },
        NamedConfig {
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

/// Qwen3-8B as a target (the published config's dims: 36 layers, hidden 4096, 32/8 heads of 128,
/// SwiGLU 12288, vocab 151936, untied LM head, rope_theta 1e6).
pub fn qwen3_8b_target() -> TargetConfig {
    TargetConfig {
        arch: TargetArch::Qwen3,
        dims: ModelDims {
            hidden_size: 4096,
            intermediate_size: 12288,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            vocab_size: 151936,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            max_position_embeddings: 40960,
            layer_kinds: vec![AttnKind::Full; 36],
        },
        tie_word_embeddings: false,
        rope_scaling: RopeScaling::Default,
    }
}
