//! Speculative decoding cases (spec section 4): random tiny targets with peaked next-token
//! distributions and random drafters for them (what the reference decoder's properties are
//! proven on), the fixture targets with drafters for them, and targets the GPU kernels can run;
//! and the check of the optimized decoder (`dflash_optimized::model::speculative`) on a backend
//! against the reference decoder, written once: CI runs it on `Host`, the H200 on `Cuda`.

use candle_core::DType;
use dflash_optimized::backend::Backend;
use dflash_optimized::model::speculative::SpecDecoder;
use dflash_optimized::Result;
use dflash_reference::config::{AttnKind, DraftConfig, ModelDims, RopeScaling, TargetArch, TargetConfig};
use dflash_reference::drafter::{is_norm, random_normal, Drafter};
use dflash_reference::speculative::{greedy_decode, speculative_decode};
use dflash_reference::target::TargetModel;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::fixtures_dir;
use crate::gpu_step::GpuCheck;
use crate::setups::random_target_config;

/// Init std of the random tiny targets: peaked next-token distributions, unlike a near-uniform
/// 0.02, so that random drafters get some drafts accepted.
pub const TARGET_STD: f64 = 0.5;

/// A target and a drafter for it.
pub struct Pair {
    pub name: String,
    pub target: TargetModel,
    pub drafter: Drafter,
}

/// A drafter config for `target` with `block_size`, 1-2 layers of a random full/sliding mix and
/// 1-2 features whose default layer ids fall inside the target.
pub fn random_draft_config(target: &TargetConfig, block_size: usize, rng: &mut ChaCha8Rng) -> DraftConfig {
    let layers = rng.random_range(1..=2);
    let mask = (target.dims.vocab_size - 1) as u32;
    let num_target_layers = target.dims.num_layers();
    let mut config = DraftConfig::for_target(target, layers, block_size, mask, 2);
    if rng.random_bool(0.5) || config.target_layer_ids.iter().any(|&l| l >= num_target_layers) {
        config = DraftConfig::for_target(target, layers, block_size, mask, 1);
    }
    // One window per config, as HF's config.json has a single `sliding_window`.
    let window = rng.random_range(1..=6);
    config.dims.layer_kinds =
        (0..layers).map(|_| if rng.random_bool(0.5) { AttnKind::Full } else { AttnKind::Sliding { window } }).collect();
    config
}

/// Random parameters in `dtype`: linears normal(0, `std`), norms 1 + normal(0, 0.1).
pub fn random_drafter(config: DraftConfig, std: f64, rng: &mut ChaCha8Rng, dtype: DType) -> Drafter {
    Drafter::from_fn(config, |name, shape| {
        if is_norm(name) {
            Ok(random_normal(shape, 0.1, rng, dtype)?.affine(1.0, 1.0)?)
        } else {
            random_normal(shape, std, rng, dtype)
        }
    })
    .expect("random drafter")
}

/// A random tiny f64 target (either architecture, tied or not, full and sliding layers) and a
/// random drafter of `block_size` for it (linears normal(0, 0.5)).
pub fn random_pair(seed: u64, block_size: usize) -> Pair {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let target_config = random_target_config(&mut rng);
    let target =
        TargetModel::random(target_config.clone(), rng.random(), TARGET_STD, DType::F64).expect("random target");
    let config = random_draft_config(&target_config, block_size, &mut rng);
    let drafter = random_drafter(config, 0.5, &mut rng, DType::F64);
    Pair { name: format!("random seed {seed}, block {block_size}"), target, drafter }
}

/// `len` random tokens below `vocab - 1` (the drafters' mask id is `vocab - 1`).
pub fn random_prompt(len: usize, vocab: usize, rng: &mut ChaCha8Rng) -> Vec<u32> {
    (0..len).map(|_| rng.random_range(0..vocab as u32 - 1)).collect()
}

/// The checked-in Qwen3 and Llama fixture targets (f64) with random drafters of block 4 (a
/// sliding then a full layer, features from layers 0 and 2).
pub fn fixture_pairs(seed: u64) -> Vec<Pair> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    ["target-qwen3", "target-llama"]
        .into_iter()
        .map(|fixture| {
            let target = TargetModel::load(&fixtures_dir().join(fixture), DType::F64).expect("fixture target");
            let mask = (target.config.dims.vocab_size - 1) as u32;
            let mut config = DraftConfig::for_target(&target.config, 2, 4, mask, 2);
            config.dims.layer_kinds = vec![AttnKind::Sliding { window: 5 }, AttnKind::Full];
            let drafter = random_drafter(config, 0.5, &mut rng, DType::F64);
            Pair { name: fixture.to_string(), target, drafter }
        })
        .collect()
}

/// Targets the GPU kernels can run (heads of 64 and 128, GQA, Qwen3 and Llama, a sliding layer)
/// with peaked distributions (linears normal(0, `std`) scaled so that the logits' margins stay
/// far above bf16's rounding), and drafters of block 16 and 8 for them; weights rounded to bf16
/// (what a checkpoint stores) and held in `dtype`.
pub fn gpu_pairs(seed: u64, dtype: DType) -> Vec<Pair> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let specs = [
        ("qwen3 d128 gqa4", TargetArch::Qwen3, 128, (8, 2), 16),
        ("llama d64 mha sliding tied", TargetArch::Llama, 64, (2, 2), 8),
    ];
    specs
        .into_iter()
        .map(|(name, arch, d, (nh, nkv), block)| {
            let mut layer_kinds = vec![AttnKind::Full; 4];
            if name.contains("sliding") {
                layer_kinds[1] = AttnKind::Sliding { window: 40 };
            }
            let config = TargetConfig {
                arch,
                dims: ModelDims {
                    hidden_size: 256,
                    intermediate_size: 512,
                    num_heads: nh,
                    num_kv_heads: nkv,
                    head_dim: d,
                    vocab_size: 320,
                    rms_norm_eps: 1e-6,
                    rope_theta: 1e6,
                    max_position_embeddings: 4096,
                    layer_kinds,
                },
                tie_word_embeddings: name.contains("tied"),
                rope_scaling: RopeScaling::Default,
            };
            let bf16 = |t: candle_core::Tensor| -> dflash_reference::Result<candle_core::Tensor> {
                Ok(t.to_dtype(DType::BF16)?.to_dtype(dtype)?)
            };
            let random = TargetModel::random(config.clone(), rng.random(), 0.2, DType::F32).expect("random target");
            let target = TargetModel::from_fn(config.clone(), |n, _| bf16(random.weight(n)?)).expect("bf16 target");
            let mask = (config.dims.vocab_size - 1) as u32;
            let mut draft = DraftConfig::for_target(&config, 2, block, mask, 2);
            draft.dims.layer_kinds = vec![AttnKind::Sliding { window: 24 }, AttnKind::Full];
            let drafter = random_drafter(draft, 0.2, &mut rng, DType::F32);
            let drafter =
                Drafter::from_fn(drafter.config.clone(), |n, _| bf16(drafter.param(n).clone())).expect("bf16");
            Pair { name: name.to_string(), target, drafter }
        })
        .collect()
}

/// The folder of the drafter trained by the GPU built-in default (`fixtures/scripts/README.md`).
pub const BUILTIN_DRAFTER: &str = "drafter-gpu-builtin";

/// The GPU built-in target (seed 0; weights rounded to bf16 as the GPU stores them, held in
/// `dtype`) with the drafter its built-in training run made (`fixtures/drafter-gpu-builtin`):
/// a trained pair, whose drafts are accepted several at a time.
pub fn builtin_pair(dtype: DType) -> Pair {
    let random = dflash_reference::builtin::gpu_target(0, DType::F32).expect("built-in target");
    let target = TargetModel::from_fn(random.config.clone(), |n, _| {
        Ok(random.weight(n)?.to_dtype(DType::BF16)?.to_dtype(dtype)?)
    })
    .expect("bf16 target");
    let drafter = Drafter::load(&fixtures_dir().join(BUILTIN_DRAFTER), dtype).expect("the built-in trained drafter");
    Pair { name: "GPU built-in target, its trained drafter".to_string(), target, drafter }
}

/// The optimized decoder of `pair` on `backend()`, for each prompt: its speculative output
/// against the reference's speculative decode (tokens and every accept length) and its plain
/// greedy decode against its own speculative output and the reference's greedy decode. Each
/// error is a count of differing tokens or steps; all must be 0. Also returns the total drafts
/// accepted (so that a caller can require the multi-token path to have run).
pub fn decode_check<B: Backend>(
    pair: &Pair,
    backend: impl Fn() -> Result<B>,
    prompts: &[Vec<u32>],
    max_new: usize,
) -> Result<(GpuCheck, usize)> {
    let context = prompts.iter().map(Vec::len).max().unwrap_or(0) + max_new;
    let mut decoder = SpecDecoder::new(&backend, &pair.target.config, Some(&pair.drafter.config), context)?;
    decoder.target.load_weights(|name, _| pair.target.weight(name))?;
    decoder
        .drafter
        .as_mut()
        .expect("built with a drafter")
        .load_weights(|name, _| Ok(pair.drafter.param(name).clone()))?;
    let differ = |a: &[u32], b: &[u32]| a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len());
    let (mut vs_reference, mut steps_differ, mut vs_own_greedy, mut greedy_vs_reference) = (0, 0, 0, 0);
    let mut accepted = 0;
    for prompt in prompts {
        let ours = decoder.speculative_decode(prompt, max_new)?;
        let want = speculative_decode(&pair.target, &pair.drafter, prompt, max_new)?;
        vs_reference += differ(&ours.tokens, &want.tokens);
        steps_differ += ours.accept_lengths.iter().zip(&want.accept_lengths).filter(|(a, b)| a != b).count()
            + ours.accept_lengths.len().abs_diff(want.accept_lengths.len());
        let greedy = decoder.greedy_decode(prompt, max_new)?;
        vs_own_greedy += differ(&ours.tokens, &greedy);
        greedy_vs_reference += differ(&greedy, &greedy_decode(&pair.target, prompt, max_new)?);
        accepted += ours.accept_lengths.iter().map(|a| a - 1).sum::<usize>();
    }
    let errors = vec![
        ("speculative tokens differing from the reference's".to_string(), vs_reference as f64),
        ("accept lengths differing from the reference's".to_string(), steps_differ as f64),
        ("speculative tokens differing from our greedy decode".to_string(), vs_own_greedy as f64),
        ("greedy tokens differing from the reference's".to_string(), greedy_vs_reference as f64),
    ];
    let name =
        format!("decode {} ({} prompts x {max_new} tokens, {accepted} drafts accepted)", pair.name, prompts.len());
    Ok((GpuCheck { name, errors, tolerance: 0.0, memory: None }, accepted))
}
