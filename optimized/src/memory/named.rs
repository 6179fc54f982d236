//! The named configurations the planner and the benchmarks use.

use dflash_reference::config::{AttnKind, DraftConfig, ModelDims, RopeScaling, TargetArch, TargetConfig};
use dflash_reference::hybrid::HybridConfig;

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

/// The 27B Qwen3.5 hybrid of spec section 10 (random weights have its shape): hidden 5120,
/// SwiGLU 17408, 64 layers = 48 GatedDeltaNet + 16 gated attention (every 4th), H_k 16 / H_v 48
/// heads of 128, 24/4 attention heads of 256 with RoPE on a quarter (theta 1e7), vocab 248320,
/// untied.
pub fn qwen3_5_27b_target() -> HybridConfig {
    let value = serde_json::json!({
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 5120,
        "intermediate_size": 17408, "num_hidden_layers": 64, "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "head_dim": 256,
        "num_attention_heads": 24, "num_key_value_heads": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        "attn_output_gate": true, "vocab_size": 248320, "tie_word_embeddings": false,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    });
    HybridConfig::from_value(std::path::Path::new("qwen3.5-27b/config.json"), &value)
        .expect("the named 27B hybrid config is valid")
}
