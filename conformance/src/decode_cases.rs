//! Speculative decoding cases (spec section 4): random tiny targets with peaked next-token
//! distributions and random drafters for them (what the reference decoder's properties are
//! proven on), the fixture targets with drafters for them, and targets the GPU kernels can run;
//! and the check of the optimized decoder (`dflash_optimized::model::speculative`) on a backend
//! against the reference decoder, written once: CI runs it on `Host`, the H200 on `Cuda`.

use candle_core::DType;
use dflash_optimized::backend::Backend;
use dflash_optimized::memory::hybrid::hybrid_drafter;
use dflash_optimized::model::hybrid_forward::HybridForward;
use dflash_optimized::model::speculative::{DecodeTarget, SpecDecoder};
use dflash_optimized::model::target_forward::TargetForward;
use dflash_optimized::Result;
use dflash_reference::config::{AttnKind, DraftConfig, ModelDims, RopeScaling, TargetArch, TargetConfig};
use dflash_reference::drafter::{is_norm, random_normal, DraftInput, Drafter};
use dflash_reference::hybrid::{HybridConfig, HybridModel};
use dflash_reference::speculative::{plain_decode, speculative_decode_with, Sampling, SpecOutput};
use dflash_reference::target::{Target, TargetKind, TargetModel};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::fixtures_dir;
use crate::gpu_step::GpuCheck;
use crate::hybrid_cases::hybrid_config;
use crate::setups::random_target_config;

/// Init std of the random tiny targets: peaked next-token distributions, unlike a near-uniform
/// 0.02, so that random drafters get some drafts accepted.
pub const TARGET_STD: f64 = 0.5;

/// A target (dense, or a hybrid) and a drafter for it.
pub struct Pair<T = TargetModel> {
    pub name: String,
    pub target: T,
    pub drafter: Drafter,
}

/// A reference target whose optimized decoder [`decode_check`] holds to it: the dense
/// `TargetModel` ([`TargetForward`]) or the hybrid `HybridModel` ([`HybridForward`]).
pub trait DecodedTarget: Target {
    type Forward<B: Backend>: DecodeTarget<Backend = B>;
    /// The optimized decoders of this target and of a `drafter` for contexts of `context`
    /// positions, on backends from `make(head_dim)` (no weights loaded).
    fn decoder<B: Backend>(
        &self,
        make: impl Fn(usize) -> Result<B>,
        drafter: &DraftConfig,
        context: usize,
    ) -> Result<SpecDecoder<Self::Forward<B>>>;
    /// Loads this target's weights into its optimized decoder's forward.
    fn load_into<B: Backend>(&self, forward: &mut Self::Forward<B>) -> Result<()>;
    /// Its config, as a target folder's.
    fn kind(&self) -> TargetKind;
}

impl DecodedTarget for TargetModel {
    type Forward<B: Backend> = TargetForward<B>;
    fn decoder<B: Backend>(
        &self,
        make: impl Fn(usize) -> Result<B>,
        drafter: &DraftConfig,
        context: usize,
    ) -> Result<SpecDecoder<TargetForward<B>>> {
        SpecDecoder::new(make, &self.config, Some(drafter), context)
    }
    fn load_into<B: Backend>(&self, forward: &mut TargetForward<B>) -> Result<()> {
        forward.load_weights(|name, _| self.weight(name))
    }
    fn kind(&self) -> TargetKind {
        TargetKind::Dense(self.config.clone())
    }
}

impl DecodedTarget for HybridModel {
    type Forward<B: Backend> = HybridForward<B>;
    fn decoder<B: Backend>(
        &self,
        make: impl Fn(usize) -> Result<B>,
        drafter: &DraftConfig,
        context: usize,
    ) -> Result<SpecDecoder<HybridForward<B>>> {
        SpecDecoder::hybrid(make, &self.config, Some(drafter), context)
    }
    fn load_into<B: Backend>(&self, forward: &mut HybridForward<B>) -> Result<()> {
        forward.load_weights(|name, _| self.weight(name))
    }
    fn kind(&self) -> TargetKind {
        TargetKind::Hybrid(self.config.clone())
    }
}

/// The optimized decoders of `pair` for contexts of `context` positions on backends from
/// `make(head_dim)`, both models' weights loaded.
pub fn pair_decoder<B: Backend, T: DecodedTarget>(
    pair: &Pair<T>,
    make: impl Fn(usize) -> Result<B>,
    context: usize,
) -> Result<SpecDecoder<T::Forward<B>>> {
    let mut decoder = pair.target.decoder(make, &pair.drafter.config, context)?;
    pair.target.load_into(&mut decoder.target)?;
    let drafter = decoder.drafter.as_mut().expect("built with a drafter");
    drafter.load_weights(|name, _| Ok(pair.drafter.param(name).clone()))?;
    Ok(decoder)
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

/// Where a stop id goes in a decode of `max_new` tokens whose unstopped output is `tokens` and
/// whose unstopped speculative steps accepted `accept_lengths`: with `inside`, an accepted draft
/// before the end of its verify step (the first of its id in `tokens`: a stop there cuts the
/// step's tokens) where there is one; else any of the first `max_new` tokens.
pub fn stop_position(
    tokens: &[u32],
    accept_lengths: &[usize],
    max_new: usize,
    inside: bool,
    rng: &mut impl Rng,
) -> usize {
    let mut drafts = Vec::new();
    let mut start = 1; // the prefill's token, then each step's A + 1
    for &a in accept_lengths {
        drafts.extend((start..start + a - 1).filter(|&p| p < max_new && !tokens[..p].contains(&tokens[p])));
        start += a;
    }
    match inside && !drafts.is_empty() {
        false => rng.random_range(0..max_new),
        true => drafts[rng.random_range(0..drafts.len())],
    }
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

/// Init std of the GPU pairs' linears (transformers' init).
pub const GPU_PAIR_STD: f64 = 0.02;

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
            let random =
                TargetModel::random(config.clone(), rng.random(), GPU_PAIR_STD, DType::F32).expect("random target");
            let target = TargetModel::from_fn(config.clone(), |n, _| bf16(random.weight(n)?)).expect("bf16 target");
            let mask = (config.dims.vocab_size - 1) as u32;
            let mut draft = DraftConfig::for_target(&config, 2, block, mask, 2);
            draft.dims.layer_kinds = vec![AttnKind::Sliding { window: 24 }, AttnKind::Full];
            let drafter = random_drafter(draft, GPU_PAIR_STD, &mut rng, DType::F32);
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

/// Random tiny hybrid targets (spec section 10: GatedDeltaNet and gated attention layers, linears
/// normal(0, [`TARGET_STD`]) for peaked distributions over a vocab of 12; one tied) in `dtype`
/// with random drafters of `block_size` for them (linears normal(0, 0.5)).
pub fn hybrid_pairs(seed: u64, block_size: usize, dtype: DType) -> Vec<Pair<HybridModel>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let linear = "linear_attention";
    let specs: [(&str, &[&str], bool); 2] = [
        ("hybrid gdn-attn-gdn-gdn", &[linear, "full_attention", linear, linear], false),
        ("hybrid attn-gdn-gdn tied", &["full_attention", linear, linear], true),
    ];
    specs
        .into_iter()
        .map(|(name, kinds, tied)| {
            let config = hybrid_config(128, kinds, (1, 2, 16, 24), (2, 1, 32), 12, tied).expect("hybrid config");
            let weights = (TARGET_STD, 0.5, false);
            hybrid_pair(&format!("{name}, block {block_size}"), config, block_size, weights, &mut rng, dtype)
        })
        .collect()
}

/// Hybrids the GPU kernels can run (GatedDeltaNet d_k 128 and 32, gated attention d 256 and 64,
/// one tied) with weights normal(0, [`GPU_PAIR_STD`]) rounded to bf16 as a checkpoint stores them,
/// held in `dtype`, and drafters of block 16 for them.
pub fn gpu_hybrid_pairs(seed: u64, dtype: DType) -> Vec<Pair<HybridModel>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let linear = "linear_attention";
    let kinds = [linear, linear, "full_attention", linear];
    let specs = [
        ("gpu hybrid d_k 128 H_v 4/2, attention d 256 gqa2", 256, (2, 4, 128, 128), (4, 2, 256), false),
        ("gpu hybrid d_k 32 d_v 48 H_v 3/1, attention d 64, tied", 128, (1, 3, 32, 48), (2, 2, 64), true),
    ];
    specs
        .into_iter()
        .map(|(name, hidden, gdn, attn, tied)| {
            let config = hybrid_config(hidden, &kinds, gdn, attn, 320, tied).expect("hybrid config");
            let weights = (GPU_PAIR_STD, GPU_PAIR_STD, true);
            hybrid_pair(name, config, 16, weights, &mut rng, dtype)
        })
        .collect()
}

/// A random hybrid of `config` and a random drafter of `block_size` for it (the published
/// hybrid drafter's shape, spec sections 1 and 10: heads of 128, two layers, a sliding then a
/// full one, two features), linears normal(0, `std`) for the target then the drafter, rounded to
/// bf16 when `bf16`, held in `dtype`.
fn hybrid_pair(
    name: &str,
    config: HybridConfig,
    block_size: usize,
    (target_std, drafter_std, bf16): (f64, f64, bool),
    rng: &mut ChaCha8Rng,
    dtype: DType,
) -> Pair<HybridModel> {
    let round = |t: candle_core::Tensor| -> dflash_reference::Result<candle_core::Tensor> {
        Ok(if bf16 { t.to_dtype(DType::BF16)?.to_dtype(dtype)? } else { t.to_dtype(dtype)? })
    };
    let random = HybridModel::random(config.clone(), rng.random(), target_std, DType::F64).expect("random hybrid");
    let target = HybridModel::from_fn(config.clone(), |n, _| round(random.weight(n)?)).expect("hybrid target");
    let mask = (config.vocab_size - 1) as u32;
    let mut draft = hybrid_drafter(&config, (2, block_size, 2), mask).expect("hybrid drafter");
    draft.dims.layer_kinds[0] = AttnKind::Sliding { window: 5 };
    let drafter = random_drafter(draft, drafter_std, rng, DType::F64);
    let drafter = Drafter::from_fn(drafter.config.clone(), |n, _| round(drafter.param(n).clone())).expect("drafter");
    Pair { name: name.to_string(), target, drafter }
}

/// How the optimized decoder is held to the reference.
#[derive(Clone, Copy, Debug)]
pub enum DecodeMatch {
    /// The same tokens and accept lengths as the reference decoders (the f64 twins).
    Exact,
    /// Teacher-forced on our own output (bf16 on the GPU, where a near-tie of the reference's
    /// logits may go either way): every token we emit and every draft we propose is the
    /// reference's argmax at that position, or within `rel` times the row's RMS logit of it.
    NearTie { rel: f64 },
}

/// The near-tie margin of bf16 decoding, in units of the row's logit standard deviation: the
/// hidden states carry the 1e-2 relative error of bf16 storage (the bound the GPU target's
/// features meet, `GPU_KERNEL_BF16`), so a logit is off by about 1e-2 of the row's spread and the
/// difference of two by 1.4e-2; 0.1 is seven of those, while a token unrelated to the argmax
/// lies one to three standard deviations below it. (Random nets of a large init std amplify bf16
/// rounding past this: their drafts miss by up to 0.35 on the bf16 twin, which is why the GPU
/// pairs use transformers' init.)
pub const BF16_NEAR_TIE: f64 = 0.1;

/// The optimized decoder of `pair` on `backend()` under `sampling`, for each prompt: its
/// speculative output equals its own plain decode (lossless) and every accept length is the longest prefix of that step's
/// drafts the output agrees with; against the reference as `matching` says. Each error is a count
/// of tokens or steps; all must be 0. Also returns the drafts accepted in all (so that a caller
/// can require the multi-token path to have run).
pub fn decode_check<B: Backend, T: DecodedTarget>(
    pair: &Pair<T>,
    backend: impl Fn(usize) -> Result<B>,
    prompts: &[Vec<u32>],
    (max_new, sampling): (usize, &Sampling),
    matching: DecodeMatch,
) -> Result<(GpuCheck, usize)> {
    let context = prompts.iter().map(Vec::len).max().unwrap_or(0) + max_new;
    let mut decoder = pair_decoder(pair, &backend, context)?;
    let differ = |a: &[u32], b: &[u32]| a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len());
    let mut counts = [0usize; 4];
    let (mut accepted, mut ties, mut steps) = (0, 0, 0);
    for prompt in prompts {
        let (ours, drafts) = decoder.speculative_decode_traced(prompt, max_new, sampling)?;
        let greedy = decoder.plain_decode(prompt, max_new, sampling)?;
        counts[1] += inconsistent_steps(&ours.tokens, &ours.accept_lengths, &drafts);
        accepted += ours.accept_lengths.iter().map(|a| a - 1).sum::<usize>();
        steps += ours.accept_lengths.len();
        match matching {
            DecodeMatch::Exact => {
                counts[0] += differ(&ours.tokens, &greedy);
                let want = speculative_decode_with(&pair.target, &pair.drafter, prompt, max_new, sampling)?;
                let plain = plain_decode(&pair.target, prompt, max_new, sampling)?;
                counts[2] += differ(&ours.tokens, &want.tokens) + differ(&greedy, &plain);
                counts[3] += ours.accept_lengths.iter().zip(&want.accept_lengths).filter(|(a, b)| a != b).count()
                    + ours.accept_lengths.len().abs_diff(want.accept_lengths.len());
            }
            DecodeMatch::NearTie { rel } => {
                let judged = teacher_forced(pair, prompt, (&ours, &drafts), (&greedy, sampling), rel)?;
                counts[0] += judged.divergence;
                (counts[2], counts[3], ties) =
                    (counts[2] + judged.far[0], counts[3] + judged.far[1], ties + judged.near);
            }
        }
    }
    let names = match matching {
        DecodeMatch::Exact => [
            "tokens (speculative and greedy) differing from the reference decoders'",
            "accept lengths differing from the reference's",
        ],
        DecodeMatch::NearTie { .. } => [
            "tokens that are no reference argmax beyond a near-tie",
            "drafts that are no reference drafter argmax beyond a near-tie",
        ],
    };
    let lossless = match matching {
        DecodeMatch::Exact => "speculative tokens differing from our greedy decode",
        DecodeMatch::NearTie { .. } => "speculative and greedy outputs parting other than at a near-tie",
    };
    let errors = vec![
        (lossless.to_string(), counts[0] as f64),
        ("accept lengths not the longest agreeing prefix of their drafts".to_string(), counts[1] as f64),
        (names[0].to_string(), counts[2] as f64),
        (names[1].to_string(), counts[3] as f64),
    ];
    let tie_note = match matching {
        DecodeMatch::Exact => String::new(),
        DecodeMatch::NearTie { .. } => format!(", {ties} near-ties taken the other way"),
    };
    let name = format!(
        "decode {} ({} prompts x {max_new}, tau {:.2}{tie_note})",
        pair.name,
        prompts.len(),
        // The mean of A + 1 over the verify steps.
        (accepted + steps) as f64 / steps.max(1) as f64
    );
    Ok((GpuCheck { name, errors, tolerance: 0.0, memory: None }, accepted))
}

/// Verify steps whose `A + 1` is not 1 + the longest prefix of their drafts equal to the tokens
/// after their bonus (within the tokens kept: the last step may run past them).
fn inconsistent_steps(tokens: &[u32], accept_lengths: &[usize], drafts: &[Vec<u32>]) -> usize {
    let mut pos = 0;
    let mut bad = 0;
    for (&a, d) in accept_lengths.iter().zip(drafts) {
        let after = &tokens[(pos + 1).min(tokens.len())..];
        let matched = d.iter().zip(after).take_while(|(x, y)| x == y).count();
        let cut = matched == d.len().min(after.len()) && after.len() < d.len();
        if (cut && a < matched + 1) || (!cut && a != matched + 1) {
            bad += 1;
        }
        pos += a;
    }
    bad + accept_lengths.len().abs_diff(drafts.len())
}

/// `None` when `chosen` is `row`'s argmax; else whether it is a near-tie (within `rel` times the
/// row's standard deviation of the maximum: the spread, blind to a common offset).
fn judge(row: &[f64], chosen: u32, rel: f64) -> Option<bool> {
    let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mean = row.iter().sum::<f64>() / row.len() as f64;
    let std = (row.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / row.len() as f64).sqrt();
    let z = row[chosen as usize];
    match (z >= max, z >= max - rel * std) {
        (true, _) => None,
        (false, near) => Some(near),
    }
}

/// What the reference says of a decode of ours, teacher-forced.
struct Judged {
    /// Tokens and drafts beyond a near-tie of the reference's argmax.
    far: [usize; 2],
    /// Near-ties taken the other way.
    near: usize,
    /// 1 when our speculative and greedy outputs part at a token where the two choices are no
    /// near-tie of each other under the reference.
    divergence: usize,
}

/// Our tokens and drafts judged by the reference on our own output: the target's logits of the
/// whole decode (one forward) and the reference drafter's at every verify step (from the
/// committed prefix's features, a causal slice of the whole decode's); and where our speculative
/// output first parts from our greedy one, whether that is a near-tie.
fn teacher_forced<T: Target>(
    pair: &Pair<T>,
    prompt: &[u32],
    (ours, drafts): (&SpecOutput, &[Vec<u32>]),
    (greedy, sampling): (&[u32], &Sampling),
    rel: f64,
) -> Result<Judged> {
    let rows = |t: &candle_core::Tensor| -> Result<Vec<Vec<f64>>> { Ok(t.to_dtype(DType::F64)?.to_vec2::<f64>()?) };
    let tokens = &ours.tokens;
    let seq: Vec<u32> = prompt.iter().chain(tokens).copied().collect();
    let ids = &pair.drafter.config.target_layer_ids;
    let whole = pair.target.forward(&seq, ids)?;
    // The target's scores (its logits, or their Gumbel-perturbed values when sampling).
    let logits: Vec<Vec<f64>> =
        rows(&whole.logits)?.iter().enumerate().map(|(p, row)| sampling.scores(row, p + 1)).collect();
    let features = candle_core::Tensor::cat(&whole.hidden, 1)?;
    let mut judged = Judged { far: [0; 2], near: 0, divergence: 0 };
    let mut count = |verdict: Option<bool>, k: usize| match verdict {
        None => {}
        Some(true) => judged.near += 1,
        Some(false) => judged.far[k] += 1,
    };
    for (i, &t) in tokens.iter().enumerate() {
        count(judge(&logits[prompt.len() + i - 1], t, rel), 0);
    }
    let head = pair.target.frozen_head();
    let b = pair.drafter.config.block_size;
    let mut pos = 0;
    for (&a, d) in ours.accept_lengths.iter().zip(drafts) {
        let n = prompt.len() + pos;
        let input = DraftInput::inference(features.narrow(0, 0, n)?, seq[n], b)?;
        let draft_logits = rows(&pair.drafter.forward(&head, &input)?)?;
        for (o, &dt) in d.iter().enumerate() {
            count(judge(&draft_logits[o + 1], dt, rel), 1);
        }
        pos += a;
    }
    if let Some(i) = tokens.iter().zip(greedy).position(|(a, b)| a != b) {
        let row = &logits[prompt.len() + i - 1];
        let near = |t: u32| judge(row, t, rel) != Some(false);
        judged.divergence = usize::from(!(near(tokens[i]) && near(greedy[i])));
    }
    Ok(judged)
}

#[cfg(test)]
mod tests {
    use super::judge;

    /// Row [1, 3, 2.9]: mean 2.3, std sqrt((1.69 + 0.49 + 0.36) / 3) = 0.920, so with `rel` 0.2
    /// the margin is 0.184: index 2 (0.1 below the max) is a near-tie, index 0 (2 below) is not;
    /// the argmax passes; with `rel` 0 only the argmax does.
    #[test]
    fn judging_by_hand() {
        let row = [1.0, 3.0, 2.9];
        assert_eq!(judge(&row, 1, 0.2), None);
        assert_eq!(judge(&row, 2, 0.2), Some(true));
        assert_eq!(judge(&row, 0, 0.2), Some(false));
        assert_eq!(judge(&row, 2, 0.0), Some(false));
    }
}
