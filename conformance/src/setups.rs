//! Random tiny configs, models and rows for property tests; every value drawn fresh from a seed.

use candle_core::{DType, Device, Tensor};
use dflash_reference::anchors::Anchors;
use dflash_reference::config::{AttnKind, DraftConfig, ModelDims, RopeScaling, TargetArch, TargetConfig};
use dflash_reference::data::TrainRow;
use dflash_reference::drafter::{random_normal, Drafter, FrozenHead};
use dflash_reference::Result;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A drafter with random (not init-valued) parameters, its frozen head, a packed row and
/// anchors: everything one loss evaluation needs.
pub struct DraftCase {
    pub drafter: Drafter,
    pub head: FrozenHead,
    pub row: TrainRow,
    pub anchors: Anchors,
    pub gamma: f64,
}

/// Random dims: heads, kv heads, head_dim, layers (a mix of full and sliding), vocab.
pub fn random_dims(rng: &mut ChaCha8Rng) -> ModelDims {
    let num_kv_heads = rng.random_range(1..=2);
    let num_heads = num_kv_heads * rng.random_range(1..=2);
    let head_dim = 2 * rng.random_range(1..=3);
    let layers = rng.random_range(1..=2);
    // One window per config: HF's config.json has a single `sliding_window`.
    let window = rng.random_range(1..=6);
    let layer_kinds =
        (0..layers).map(|_| if rng.random_bool(0.5) { AttnKind::Full } else { AttnKind::Sliding { window } }).collect();
    ModelDims {
        hidden_size: 2 * rng.random_range(2..=4),
        intermediate_size: rng.random_range(3..=8),
        num_heads,
        num_kv_heads,
        head_dim,
        vocab_size: rng.random_range(5..=12),
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        max_position_embeddings: 256,
        layer_kinds,
    }
}

/// A random tiny target of either architecture.
pub fn random_target_config(rng: &mut ChaCha8Rng) -> TargetConfig {
    TargetConfig {
        arch: if rng.random_bool(0.5) { TargetArch::Qwen3 } else { TargetArch::Llama },
        dims: random_dims(rng),
        tie_word_embeddings: rng.random_bool(0.5),
        rope_scaling: RopeScaling::Default,
    }
}

/// Random sorted anchors over `loss_mask` candidates (at least one kept when possible), with
/// some `keep = false` entries mixed in.
fn random_anchors(s: usize, n: usize, rng: &mut ChaCha8Rng) -> Anchors {
    let mut positions: Vec<usize> = (0..n).map(|_| rng.random_range(0..s - 1)).collect();
    positions.sort_unstable();
    let keep = (0..n).map(|j| j == 0 || rng.random_bool(0.8)).collect();
    Anchors { positions, keep }
}

/// A random drafter case in `dtype`: random dims and block size, S tokens over 1-3 packed
/// documents (with padding), N anchors, random features, embeddings and parameters.
pub fn random_draft_case(seed: u64, dtype: DType) -> Result<DraftCase> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let dims = random_dims(&mut rng);
    let (h, v) = (dims.hidden_size, dims.vocab_size);
    let num_features = rng.random_range(1..=2);
    let num_target_layers = 4;
    let config = DraftConfig {
        dims,
        block_size: rng.random_range(2..=5),
        num_target_layers,
        mask_token_id: (v - 1) as u32,
        target_layer_ids: (0..num_features).map(|i| i % num_target_layers).collect(),
    };
    let drafter = Drafter::from_fn(config.clone(), |_, shape| {
        let t = random_normal(shape, 0.3, &mut rng, dtype)?;
        Ok(if shape.len() == 1 { t.affine(1.0, 1.0)? } else { t })
    })?;
    let head = FrozenHead {
        embed: random_normal(&[v, h], 1.0, &mut rng, dtype)?,
        lm_head: random_normal(&[v, h], 1.0, &mut rng, dtype)?,
    };
    let s = rng.random_range(4..=14);
    let row = random_packed_row(s, v, num_features * h, &mut rng, dtype)?;
    let n = rng.random_range(1..=4);
    let anchors = random_anchors(s, n, &mut rng);
    let gamma = rng.random_range(1.0..8.0);
    Ok(DraftCase { drafter, head, row, anchors, gamma })
}

/// A random drafter case the GPU step can run: head_dim 64 (its kernels' granule), 1-2 KV heads
/// with 1-4 query heads each, a sliding and a full layer, hidden 64-192, a vocab of a few
/// hundred, blocks of 4-16, packed documents and `keep = false` blocks; in `dtype`.
pub fn gpu_draft_case(seed: u64, dtype: DType) -> Result<DraftCase> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let num_kv_heads = rng.random_range(1..=2);
    let window = rng.random_range(3..=40);
    let dims = ModelDims {
        hidden_size: 64 * rng.random_range(1..=3),
        intermediate_size: rng.random_range(50..=300),
        num_heads: num_kv_heads * rng.random_range(1..=4),
        num_kv_heads,
        head_dim: 64,
        vocab_size: rng.random_range(200..=700),
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        max_position_embeddings: 4096,
        layer_kinds: vec![AttnKind::Sliding { window }, AttnKind::Full],
    };
    let (h, v) = (dims.hidden_size, dims.vocab_size);
    let num_features = 2;
    let config = DraftConfig {
        dims,
        block_size: rng.random_range(4..=16),
        num_target_layers: 4,
        mask_token_id: (v - 1) as u32,
        target_layer_ids: vec![1, 3],
    };
    let drafter = Drafter::from_fn(config.clone(), |_, shape| {
        // Linears at about 1/sqrt(fan_in) keep activations O(1) through the layers.
        let std = if shape.len() == 1 { 0.3 } else { 1.0 / (shape[1] as f64).sqrt() };
        let t = random_normal(shape, std, &mut rng, dtype)?;
        Ok(if shape.len() == 1 { t.affine(1.0, 1.0)? } else { t })
    })?;
    let head = FrozenHead {
        embed: random_normal(&[v, h], 1.0, &mut rng, dtype)?,
        lm_head: random_normal(&[v, h], 1.0 / (h as f64).sqrt(), &mut rng, dtype)?,
    };
    let s = rng.random_range(20..=300);
    let row = random_packed_row(s, v, num_features * h, &mut rng, dtype)?;
    let n = rng.random_range(1..=24);
    let anchors = random_anchors(s, n, &mut rng);
    let gamma = rng.random_range(1.0..8.0);
    Ok(DraftCase { drafter, head, row, anchors, gamma })
}

/// A row of `s` tokens (ids below `vocab - 1`) in 1-3 packed documents with positions
/// restarting per document, maybe a padded tail, a random loss mask and random features.
pub fn random_packed_row(
    s: usize,
    vocab: usize,
    feature_dim: usize,
    rng: &mut ChaCha8Rng,
    dtype: DType,
) -> Result<TrainRow> {
    let tokens = (0..s).map(|_| rng.random_range(0..vocab as u32 - 1)).collect();
    let docs = rng.random_range(1..=3);
    let pad = if rng.random_bool(0.5) { rng.random_range(0..=s / 4) } else { 0 };
    let mut doc_ids = Vec::with_capacity(s);
    let mut positions = Vec::with_capacity(s);
    let mut doc = 0i64;
    let mut pos = 0;
    for i in 0..s {
        if i >= s - pad {
            doc_ids.push(-1);
            positions.push(0);
            continue;
        }
        if i > 0 && doc < docs - 1 && rng.random_bool(0.2) {
            doc += 1;
            pos = 0;
        }
        doc_ids.push(doc);
        positions.push(pos);
        pos += 1;
    }
    let loss_mask = doc_ids.iter().map(|&d| d >= 0 && rng.random_bool(0.8)).collect();
    let features = random_normal(&[s, feature_dim], 1.0, rng, dtype)?;
    let row = TrainRow { tokens, loss_mask, doc_ids: Some(doc_ids), positions, features };
    row.validate()?;
    Ok(row)
}

/// A `[shape]` tensor of standard normal values (never zeros), for ad-hoc inputs.
pub fn randn(shape: &[usize], rng: &mut ChaCha8Rng, dtype: DType) -> Result<Tensor> {
    random_normal(shape, 1.0, rng, dtype)
}

/// A `[shape]` tensor on the CPU from f64 values, as `dtype`.
pub fn tensor_from(values: Vec<f64>, shape: &[usize], dtype: DType) -> Result<Tensor> {
    Ok(Tensor::from_vec(values, shape, &Device::Cpu)?.to_dtype(dtype)?)
}
