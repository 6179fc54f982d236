//! The hybrid target's forward (`dflash_optimized::model::hybrid_forward`, spec section 10)
//! against the reference (`HybridModel::row_features`, the delta rule in its recurrent form) on
//! any backend: random hybrids the GPU kernels can run (GatedDeltaNet head dims 128 and 32, value
//! heads sharing key heads, gated attention with heads of 256 and 64 and partial RoPE, tied and
//! untied) on packed rows of several documents (one longer than a chunk of 64), padding, and
//! launches of T no multiple of 64. Written once over the backend: CI runs it on `Host`, the
//! H200 on `Cuda`.

use candle_core::DType;
use dflash_optimized::backend::Backend;
use dflash_optimized::model::hybrid_forward::HybridForward;
use dflash_optimized::Result;
use dflash_reference::data::Row;
use dflash_reference::hybrid::{HybridConfig, HybridModel};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

use crate::gpu_step::{GpuCheck, PeakMeter};
use crate::target_cases::{features_check, packed_row};
use crate::tolerance::Tolerance;

/// Seed of the random hybrids `xtask gpu-conformance` runs (and CI runs on the bf16 twins).
pub const GPU_HYBRID_SEED: u64 = 11;

/// One hybrid forward to check: a model, the layers it taps and the rows of one launch.
pub struct HybridCase {
    pub name: String,
    pub model: HybridModel,
    pub layer_ids: Vec<usize>,
    pub rows: Vec<Row>,
}

/// A hybrid config of `layer_types`, GatedDeltaNet `(H_k, H_v, d_k, d_v)` and gated attention
/// `(heads, K/V heads, head_dim)` with RoPE on a quarter of the head.
pub fn hybrid_config(
    hidden: usize,
    layer_types: &[&str],
    (key_heads, value_heads, dk, dv): (usize, usize, usize, usize),
    (heads, kv_heads, head_dim): (usize, usize, usize),
    vocab: usize,
    tied: bool,
) -> Result<HybridConfig> {
    let value = json!({
        "model_type": "qwen3_5_text",
        "hidden_size": hidden, "intermediate_size": hidden * 3 / 2 + 8,
        "num_hidden_layers": layer_types.len(), "vocab_size": vocab, "layer_types": layer_types,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": dk, "linear_value_head_dim": dv,
        "linear_num_key_heads": key_heads, "linear_num_value_heads": value_heads,
        "head_dim": head_dim, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        "rms_norm_eps": 1e-6, "tie_word_embeddings": tied, "max_position_embeddings": 8192,
    });
    Ok(HybridConfig::from_value(std::path::Path::new("random/config.json"), &value)?)
}

/// Writes a hybrid target folder for end-to-end runs into `dir`: the fixture Qwen tokenizer (with
/// its chat template) and a random Qwen3.5 hybrid of 3 layers (GatedDeltaNet, gated attention,
/// GatedDeltaNet; hidden 128, so its drafter has one head of 128; heads of 64 and GatedDeltaNet
/// heads of 32, which the GPU kernels run) whose vocab of 768 covers the
/// tokenizer, weights N(0, 0.1), saved in HF format; returns the model.
pub fn write_hybrid_target_folder(dir: &std::path::Path, seed: u64) -> Result<HybridModel> {
    std::fs::create_dir_all(dir).map_err(|e| dflash_optimized::Error::invalid("folder", e.to_string()))?;
    crate::target_cases::copy_fixture_tokenizer(dir).expect("copy the fixture tokenizer");
    let kinds = ["linear_attention", "full_attention", "linear_attention"];
    let config = hybrid_config(128, &kinds, (1, 2, 32, 32), (2, 1, 64), 768, false)?;
    let model = HybridModel::random(config, seed, 0.1, DType::F32)?;
    model.save(dir)?;
    Ok(model)
}

/// Random hybrids the GPU kernels can run, weights N(0, 0.02) (transformers' init; the GDN
/// decays, conv taps and norms as `HybridModel::random` draws them) rounded to bf16 as a
/// checkpoint stores them, the reference computing in `dtype`; each with a packed row of three
/// documents (one across a chunk boundary) and padding, and a row of one document.
pub fn random_hybrid_cases(seed: u64, dtype: DType) -> Result<Vec<HybridCase>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let specs = [
        ("d_k 128 H_v 4/2, attention d 256 gqa2", 256, (2, 4, 128, 128), (4, 2, 256), false),
        ("d_k 32 d_v 48 H_v 3/1, attention d 64 mha, tied", 192, (1, 3, 32, 48), (2, 2, 64), true),
    ];
    let mut cases = Vec::new();
    for (i, (name, hidden, gdn, attn, tied)) in specs.into_iter().enumerate() {
        let kinds = ["linear_attention", "linear_attention", "full_attention", "linear_attention"];
        let config = hybrid_config(hidden, &kinds, gdn, attn, 300, tied)?;
        let random = HybridModel::random(config.clone(), seed * 10 + i as u64, 0.02, DType::F32)?;
        let model =
            HybridModel::from_fn(config, |name, _| Ok(random.weight(name)?.to_dtype(DType::BF16)?.to_dtype(dtype)?))?;
        let v = model.config.vocab_size;
        let rows = vec![
            packed_row(&[rng.random_range(65..140), 1, rng.random_range(2..70)], rng.random_range(1..30), v, &mut rng),
            packed_row(&[rng.random_range(130..300)], 0, v, &mut rng),
        ];
        cases.push(HybridCase { name: name.to_string(), model, layer_ids: vec![3, 0, 2], rows });
    }
    Ok(cases)
}

/// The case's rows through the hybrid forward on `backend()` against the reference's features
/// (f64), within `tol`, as `target_cases::features_check` runs them.
pub fn hybrid_check<B: Backend>(
    case: &HybridCase,
    backend: impl Fn() -> Result<B>,
    tol: Tolerance,
    meter: Option<&mut dyn PeakMeter>,
) -> Result<GpuCheck> {
    let make = || case_forward(case, backend()?);
    features_check(&format!("hybrid {}", case.name), &case.model, &case.layer_ids, &case.rows, make, tol, meter)
}

/// The forward of `case` on `dev` (its model's weights loaded), laid out for its rows.
fn case_forward<B: Backend>(case: &HybridCase, dev: B) -> Result<HybridForward<B>> {
    let total = case.rows.iter().map(|r| r.tokens.len()).sum();
    let mut forward = HybridForward::new(dev, &case.model.config, &case.layer_ids, total)?;
    forward.load_weights(|name, _| case.model.weight(name))?;
    Ok(forward)
}

/// The features of `case`'s rows (one launch) on `dev`, `[T, F*H]` as f64.
pub fn case_features<B: Backend>(case: &HybridCase, dev: B) -> Result<Vec<f64>> {
    let mut forward = case_forward(case, dev)?;
    forward.run(&case.rows.iter().collect::<Vec<_>>())?;
    forward.features_to_host()
}
