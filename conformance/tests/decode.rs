//! The optimized decoder (`dflash_optimized::model::speculative`: K/V caches for the target and
//! the drafter, the causal plan after the cached positions, the drafter's context cache, the
//! rollback by the accepted length) on the CPU twins in f64 against the reference decoder
//! (spec section 4), which recomputes everything every step: the same tokens and the same accept
//! length at every step, and a greedy decode equal to the reference's. The GPU runs the same
//! check (`decode_cases::decode_check`) in `xtask gpu-conformance`.

use dflash_conformance::decode_cases::{
    builtin_pair, decode_check, fixture_pairs, gpu_hybrid_pairs, gpu_pairs, hybrid_pairs, random_pair, random_prompt,
    DecodeMatch, Pair, BF16_NEAR_TIE,
};
use dflash_optimized::backend::host::Host;
use dflash_optimized::model::speculative::SpecDecoder;
use dflash_reference::speculative::Sampling;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn host(_head_dim: usize) -> dflash_optimized::Result<Host<f64>> {
    Ok(Host::default())
}

fn prompts(pair: &Pair, count: usize, lens: std::ops::RangeInclusive<usize>, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let vocab = pair.target.config.dims.vocab_size;
    (0..count).map(|_| random_prompt(rng.random_range(lens.clone()), vocab, &mut rng)).collect()
}

/// Proves on 24 random tiny targets (both architectures, tied or not, full and sliding layers)
/// with random drafters of blocks 2-6 that the cached decoder on the twins gives the reference's
/// tokens and accept lengths exactly, for prompts of 1-9 tokens and 20 new tokens; and that drafts
/// were accepted (the rollback and the multi-token appends ran), some whole blocks among them.
#[test]
fn cached_decoding_equals_the_reference_decoder() {
    let (mut accepted, mut cases) = (0, 0);
    for seed in 0..24u64 {
        let pair = random_pair(seed, 2 + seed as usize % 5);
        let (check, n) =
            decode_check(&pair, host, &prompts(&pair, 2, 1..=9, seed), (20, &Sampling::Greedy), DecodeMatch::Exact)
                .expect("decode");
        assert!(check.errors.iter().all(|e| e.1 == 0.0), "{}: {:?}", check.name, check.errors);
        accepted += n;
        cases += 1;
    }
    assert!(accepted > cases, "only {accepted} drafts accepted over {cases} cases: the multi-token path barely ran");
}

/// Proves the same on the checked-in Qwen3 (q/k norms, untied) and Llama (tied, bf16 shards)
/// fixtures with drafters of a sliding and a full layer, on prompts longer than the drafter's
/// window; and on the GPU check's random pairs of real head dims.
#[test]
fn cached_decoding_equals_the_reference_on_the_fixtures() {
    for pair in fixture_pairs(11) {
        let (check, _) =
            decode_check(&pair, host, &prompts(&pair, 2, 6..=14, 3), (24, &Sampling::Greedy), DecodeMatch::Exact)
                .expect("decode");
        assert!(check.errors.iter().all(|e| e.1 == 0.0), "{}: {:?}", check.name, check.errors);
    }
    // The GPU check's pairs in f64 (heads of 64 and 128: q, k and v of one token in one pass).
    for pair in gpu_pairs(2, candle_core::DType::F64) {
        let (check, _) =
            decode_check(&pair, host, &prompts(&pair, 1, 30..=50, 4), (12, &Sampling::Greedy), DecodeMatch::Exact)
                .expect("decode");
        assert!(check.errors.iter().all(|e| e.1 == 0.0), "{}: {:?}", check.name, check.errors);
    }
}

/// Proves the same for hybrid targets (spec section 10): GatedDeltaNet layers decode from their
/// kept state and conv window, a verify block keeps its accepted prefix (the state advanced by
/// it alone), prefill launches longer than a block, prompts longer than one prefill launch and
/// the attention layers' K/V caches: the
/// reference's tokens and accept lengths exactly, on the f64 twins, with drafts accepted.
#[test]
fn cached_hybrid_decoding_equals_the_reference_decoder() {
    let (mut accepted, mut cases) = (0, 0);
    for (seed, block) in [(1u64, 4usize), (2, 16)] {
        for pair in hybrid_pairs(seed, block, candle_core::DType::F64) {
            let vocab = pair.target.config.vocab_size;
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let prompts: Vec<Vec<u32>> = [1, 7, 30].iter().map(|&n| random_prompt(n, vocab, &mut rng)).collect();
            let (check, n) =
                decode_check(&pair, host, &prompts, (24, &Sampling::Greedy), DecodeMatch::Exact).expect("decode");
            assert!(check.errors.iter().all(|e| e.1 == 0.0), "{}: {:?}", check.name, check.errors);
            eprintln!("{}", check.name);
            accepted += n;
            cases += 1;
        }
    }
    assert!(accepted > cases, "only {accepted} drafts accepted over {cases} cases: the kept prefixes barely ran");
    // A prompt longer than one prefill launch (512 tokens): the second launch resumes the first's
    // states and windows.
    let pair = hybrid_pairs(3, 8, candle_core::DType::F64).remove(1);
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let prompts = vec![random_prompt(530, pair.target.config.vocab_size, &mut rng)];
    let (check, _) = decode_check(&pair, host, &prompts, (12, &Sampling::Greedy), DecodeMatch::Exact).expect("decode");
    assert!(check.errors.iter().all(|e| e.1 == 0.0), "{} (530-token prompt): {:?}", check.name, check.errors);
    // The GPU check's hybrids in f64 (GatedDeltaNet heads of 128 and 32, attention of 256 and 64).
    for pair in gpu_hybrid_pairs(2, candle_core::DType::F64) {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let prompts = vec![random_prompt(rng.random_range(30..=80), pair.target.config.vocab_size, &mut rng)];
        let (check, _) =
            decode_check(&pair, host, &prompts, (12, &Sampling::Greedy), DecodeMatch::Exact).expect("decode");
        assert!(check.errors.iter().all(|e| e.1 == 0.0), "{}: {:?}", check.name, check.errors);
    }
}

/// The same math in f64 in another order (the chunked delta rule against the reference's
/// recurrence, fused twins against candle ops): as `gdn_twins`' f64 bound.
const HYBRID_DECODE_F64: f64 = 1e-10;

/// Proves the hybrid decoding forward's kept prefixes directly: after a prompt, a verify launch
/// of 8 tokens of which the first `m` are kept (every `m` of 1..=8), then 5 more tokens decoded
/// at `past = prompt + m`, gives the reference forward's logits and tapped layer outputs of
/// `prompt + block[..m] + rest` on those 5 rows, in f64; a verify launch the state was not kept
/// from, and a second `keep`, are refused.
#[test]
fn a_kept_prefix_of_a_verify_launch_equals_the_reference_forward() {
    use candle_core::Tensor;
    use dflash_conformance::tolerance::rel_error;
    use dflash_optimized::backend::Backend;
    use dflash_optimized::model::hybrid_forward::HybridForward;
    use dflash_optimized::ops::bytes_of;
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    for pair in hybrid_pairs(3, 8, candle_core::DType::F64) {
        let (model, vocab) = (&pair.target, pair.target.config.vocab_size);
        let ids = vec![model.config.num_layers() - 1, 0];
        let mut forward = HybridForward::decoding(Host::<f64>::default(), &model.config, &ids, 64, 64, 8).unwrap();
        forward.load_weights(|name, _| model.weight(name)).unwrap();
        let (prompt, block, rest) =
            (random_prompt(10, vocab, &mut rng), random_prompt(8, vocab, &mut rng), random_prompt(5, vocab, &mut rng));
        let launch = |forward: &mut HybridForward<Host<f64>>, tokens: &[u32]| {
            forward.backend().upload(forward.tokens_addr(), bytes_of(tokens)).unwrap();
        };
        for m in 1..=8 {
            launch(&mut forward, &prompt);
            forward.decode(prompt.len(), 0, 1).unwrap();
            launch(&mut forward, &block);
            let plans = forward.decode_plans(prompt.len(), block.len()).unwrap();
            forward.verify(&plans, 8).unwrap();
            forward.keep(m).unwrap();
            assert!(forward.keep(m).is_err(), "a second keep of one verify launch was accepted");
            launch(&mut forward, &rest);
            forward.decode(rest.len(), prompt.len() + m, rest.len()).unwrap();
            let logits: Vec<f64> = forward.logits_to_host(rest.len()).unwrap().concat();
            let features = forward.features_to_host().unwrap();

            let seq: Vec<u32> = prompt.iter().chain(&block[..m]).chain(&rest).copied().collect();
            let want = model.forward(&seq, &ids).unwrap();
            let tail = seq.len() - rest.len();
            let want_logits = want.logits.narrow(0, tail, rest.len()).unwrap();
            let hidden: Vec<Tensor> = want.hidden.iter().map(|h| h.narrow(0, tail, rest.len()).unwrap()).collect();
            let want_features = Tensor::cat(&hidden, 1).unwrap();
            let got = |v: Vec<f64>, like: &Tensor| Tensor::from_vec(v, like.dims(), like.device()).unwrap();
            let err = rel_error(&got(logits, &want_logits), &want_logits)
                .max(rel_error(&got(features, &want_features), &want_features));
            assert!(err <= HYBRID_DECODE_F64, "{}: keeping {m} of 8: relative error {err:.2e}", pair.name);
        }
        let err = forward.keep(1).expect_err("keep after a kept launch").to_string();
        assert!(err.contains("no verify launch"), "{err}");
    }
}

/// Proves that prompts the decoder cannot take are errors naming the prompt, before any decoding:
/// empty, a token outside the vocab, longer than the context with the new tokens.
#[test]
fn bad_prompts_are_errors() {
    let pair = random_pair(3, 4);
    let mut decoder = SpecDecoder::new(host, &pair.target.config, Some(&pair.drafter.config), 8).expect("decoder");
    decoder.target.load_weights(|name, _| pair.target.weight(name)).expect("target weights");
    let vocab = pair.target.config.dims.vocab_size as u32;
    for (prompt, max_new, says) in
        [(vec![], 2, "is empty"), (vec![1, vocab], 2, "not below the vocab"), (vec![1, 2, 3], 6, "exceed")]
    {
        let spec = decoder.speculative_decode(&prompt, max_new).expect_err("bad prompt accepted");
        let greedy = decoder.greedy_decode(&prompt, max_new).expect_err("bad prompt accepted");
        for e in [spec, greedy] {
            assert!(e.to_string().contains("prompt") && e.to_string().contains(says), "{prompt:?}: {e}");
        }
    }
}

/// Proves that a target whose weights hold a NaN (here its final norm) is refused at its first
/// logits, as the reference decoder refuses it, greedy, speculative or sampled: its argmax would
/// be token 0 everywhere, decoded as full acceptance.
#[test]
fn non_finite_logits_are_errors() {
    let pair = random_pair(rand::random(), 4);
    let mut decoder = SpecDecoder::new(host, &pair.target.config, Some(&pair.drafter.config), 16).expect("decoder");
    decoder
        .target
        .load_weights(|name, _| match name {
            "model.norm.weight" => Ok(pair.target.weight(name)?.affine(0.0, f64::NAN)?),
            _ => pair.target.weight(name),
        })
        .expect("target weights");
    let drafter = decoder.drafter.as_mut().expect("built with a drafter");
    drafter.load_weights(|name, _| Ok(pair.drafter.param(name).clone())).expect("drafter weights");
    let sampled = Sampling::Temperature { temperature: 0.7, seed: 1 };
    let errors = [
        decoder.greedy_decode(&[1, 2, 3], 4).expect_err("NaN logits decoded"),
        decoder.speculative_decode(&[1, 2, 3], 4).expect_err("NaN logits decoded"),
        decoder.speculative_decode_traced(&[1, 2, 3], 4, &sampled).expect_err("NaN logits decoded"),
        decoder.plain_decode(&[1, 2, 3], 4, &sampled).expect_err("NaN logits decoded"),
    ];
    for e in errors {
        assert!(e.to_string().contains(dflash_reference::speculative::NON_FINITE_LOGITS), "{e}");
    }
    // A finite target with a drafter whose final norm is NaN: its proposals are refused too.
    decoder.target.load_weights(|name, _| pair.target.weight(name)).expect("target weights");
    let drafter = decoder.drafter.as_mut().expect("built with a drafter");
    drafter
        .load_weights(|name, _| match name {
            "norm.weight" => Ok(pair.drafter.param(name).affine(0.0, f64::NAN)?),
            _ => Ok(pair.drafter.param(name).clone()),
        })
        .expect("drafter weights");
    assert!(decoder.greedy_decode(&[1, 2, 3], 4).is_ok(), "the target alone decodes");
    for e in [
        decoder.speculative_decode(&[1, 2, 3], 4).expect_err("NaN drafts decoded"),
        decoder.speculative_decode_traced(&[1, 2, 3], 4, &sampled).expect_err("NaN drafts decoded"),
    ] {
        assert!(e.to_string().contains(dflash_reference::speculative::NON_FINITE_LOGITS), "{e}");
    }
}

/// Proves that a drafter made for another target is refused when the decoder is built, naming
/// the mismatched field.
#[test]
fn a_mismatched_drafter_is_refused() {
    let pair = random_pair(5, 3);
    let mut other = pair.target.config.clone();
    other.dims.vocab_size += 1;
    let err = SpecDecoder::new(host, &other, Some(&pair.drafter.config), 16).err().expect("mismatch accepted");
    assert!(err.to_string().contains("vocab_size"), "{err}");
}

/// Proves the same for a trained pair: the GPU built-in target with the drafter its built-in
/// training run made (`fixtures/drafter-gpu-builtin`), whose drafts are accepted several at a
/// time (tau above 1.5 over the prompts), on prompts like its training rows' (16 random tokens).
#[test]
fn a_trained_drafter_decodes_as_the_reference() {
    let pair = builtin_pair(candle_core::DType::F64);
    let (check, accepted) =
        decode_check(&pair, host, &prompts(&pair, 3, 16..=16, 21), (32, &Sampling::Greedy), DecodeMatch::Exact)
            .expect("decode");
    assert!(check.errors.iter().all(|e| e.1 == 0.0), "{}: {:?}", check.name, check.errors);
    // tau = tokens / steps above 1.5 is more than a third of the 96 tokens accepted drafts.
    assert!(accepted > 96 / 3, "{accepted} drafts accepted over 3 x 32 tokens: {}", check.name);
}

/// Proves the teacher-forced judging the GPU check uses: on the f64 twins, with no margin at all
/// (`rel` 0), every token and draft of the trained pair's decodes is the reference's exact
/// argmax; on the bf16 twins (the GPU's storage rounding, with CPU arithmetic), within the bf16
/// near-tie margin, and where speculative and greedy outputs part, they part at a near-tie.
#[test]
fn teacher_forced_judging_accepts_the_twins() {
    let pair = builtin_pair(candle_core::DType::F64);
    let prompts = prompts(&pair, 2, 16..=16, 5);
    let (check, _) = decode_check(&pair, host, &prompts, (24, &Sampling::Greedy), DecodeMatch::NearTie { rel: 0.0 })
        .expect("decode");
    assert!(check.errors.iter().all(|e| e.1 == 0.0), "{}: {:?}", check.name, check.errors);
    let bf16_host = |_| Ok(Host::<half::bf16>::default());
    let near = DecodeMatch::NearTie { rel: BF16_NEAR_TIE };
    let (check, _) =
        decode_check(&builtin_pair(candle_core::DType::F32), bf16_host, &prompts, (24, &Sampling::Greedy), near)
            .expect("decode");
    assert!(check.errors.iter().all(|e| e.1 == 0.0), "{}: {:?}", check.name, check.errors);
}

/// Proves seeded sampling (spec section 4: argmax proposals, accepted while the target's sample
/// at that position equals the proposal) on the twins in f64: the cached decoder's speculative
/// and plain outputs equal the reference's, and each other's, at temperatures 0.5 and 1.0 over
/// random pairs, the trained pair and random hybrids (at 0.7); and different seeds give
/// different outputs.
#[test]
fn sampled_decoding_equals_the_reference_and_plain_sampling() {
    let mut pairs: Vec<Pair> = (0..6u64).map(|seed| random_pair(seed + 100, 2 + seed as usize % 4)).collect();
    pairs.push(builtin_pair(candle_core::DType::F64));
    let mut accepted = 0;
    for (i, pair) in pairs.iter().enumerate() {
        for temperature in [0.5, 1.0] {
            let sampling = Sampling::new(temperature, 7 + i as u64).expect("sampling");
            let (check, n) =
                decode_check(pair, host, &prompts(pair, 2, 3..=16, i as u64), (20, &sampling), DecodeMatch::Exact)
                    .expect("decode");
            assert!(check.errors.iter().all(|e| e.1 == 0.0), "{} at T={temperature}: {:?}", check.name, check.errors);
            accepted += n;
        }
    }
    // The hybrids: the same with their states kept across verify blocks.
    for (i, pair) in hybrid_pairs(7, 4, candle_core::DType::F64).iter().enumerate() {
        let sampling = Sampling::new(0.7, 3 + i as u64).expect("sampling");
        let mut rng = ChaCha8Rng::seed_from_u64(i as u64);
        let prompts = vec![random_prompt(9, pair.target.config.vocab_size, &mut rng)];
        let (check, n) = decode_check(pair, host, &prompts, (20, &sampling), DecodeMatch::Exact).expect("decode");
        assert!(check.errors.iter().all(|e| e.1 == 0.0), "{} sampled: {:?}", check.name, check.errors);
        accepted += n;
    }
    assert!(accepted > 0, "no draft accepted under sampling: only the A = 0 path ran");
    let pair = &pairs[6];
    let prompt = &prompts(pair, 1, 16..=16, 1)[0];
    let sample = |seed| {
        let s = Sampling::new(1.0, seed).expect("sampling");
        dflash_reference::speculative::plain_decode(&pair.target, prompt, 24, &s).expect("decode")
    };
    assert_ne!(sample(1), sample(2), "two seeds gave the same 24 sampled tokens");
}

/// Proves that a temperature that is negative, NaN or infinite is an error naming it; 0 is greedy.
#[test]
fn bad_temperatures_are_errors() {
    for t in [-1.0, f64::NAN, f64::INFINITY] {
        let e = Sampling::new(t, 0).expect_err("bad temperature accepted");
        assert!(e.to_string().contains("temperature"), "{e}");
    }
    assert_eq!(Sampling::new(0.0, 3).expect("greedy"), Sampling::Greedy);
}

/// Proves the stop at an end-of-sequence id in the cached decoder on the f64 twins: with a stop
/// set holding an id of the unstopped greedy output (at a random index, past the first read-back
/// of the plain decode at times; for two of the built-in pair's decodes, an accepted draft inside
/// a verify step, so the cut of a step runs) and one absent from it, its speculative decode equals the
/// reference's, tokens and every accept length, and its plain decode equals the reference's and
/// ends at the first stop id; for fresh random pairs, the trained built-in pair, a hybrid, and
/// under seeded sampling. An empty stop set decodes `max_new` tokens.
#[test]
fn cached_decoding_stops_as_the_reference() {
    use dflash_conformance::decode_cases::{pair_decoder, stop_position, DecodedTarget};
    use dflash_reference::speculative::{plain_decode_until, speculative_decode_until};
    /// `inside`: the stop falls on an accepted draft before the end of its verify step where
    /// there is one (a decode of 16 tokens at least), else anywhere.
    fn check<T: DecodedTarget>(
        pair: &Pair<T>,
        prompt: &[u32],
        sampling: &Sampling,
        inside_wanted: bool,
        rng: &mut ChaCha8Rng,
    ) -> bool {
        let max_new = rng.random_range(if inside_wanted { 16 } else { 1 }..=40);
        let mut decoder = pair_decoder(pair, host, prompt.len() + max_new).expect("decoder");
        let free = decoder.plain_decode_until(prompt, max_new, sampling, &[]).expect("plain");
        assert_eq!(free.len(), max_new, "{}: an empty stop set", pair.name);
        let (unstopped, _) = decoder.speculative_decode_until(prompt, max_new, sampling, &[]).expect("speculative");
        let at = stop_position(&free, &unstopped.accept_lengths, max_new, inside_wanted, rng);
        let id = free[at];
        let first = free.iter().position(|&t| t == id).expect("taken from it");
        let absent = (0..pair.target.vocab_size() as u32).find(|t| !free.contains(t));
        let stop: Vec<u32> = absent.into_iter().chain([id]).collect();
        let plain = decoder.plain_decode_until(prompt, max_new, sampling, &stop).expect("plain");
        let want_plain = plain_decode_until(&pair.target, prompt, max_new, sampling, &stop).expect("reference plain");
        assert_eq!((&plain, &want_plain[..]), (&want_plain, &free[..=first]), "{}: stop {stop:?}", pair.name);
        let (ours, _) = decoder.speculative_decode_until(prompt, max_new, sampling, &stop).expect("speculative");
        let want = speculative_decode_until(&pair.target, &pair.drafter, prompt, max_new, sampling, &stop)
            .expect("reference speculative");
        assert_eq!(ours, want, "{}: stop {stop:?}", pair.name);
        assert_eq!(ours.tokens, want_plain, "{}: stop {stop:?}", pair.name);
        1 + ours.accept_lengths.iter().sum::<usize>() > ours.tokens.len()
    }
    // Fresh inputs each run; the root seed reproduces them.
    let root: u64 = rand::rng().random();
    eprintln!("root seed {root}");
    let mut rng = ChaCha8Rng::seed_from_u64(root);
    let mut cut_inside = 0;
    for _ in 0..12 {
        let pair = random_pair(rng.random(), rng.random_range(2..=6));
        let prompt = random_prompt(rng.random_range(1..=9), pair.target.config.dims.vocab_size, &mut rng);
        cut_inside += usize::from(check(&pair, &prompt, &Sampling::Greedy, false, &mut rng));
    }
    let pair = builtin_pair(candle_core::DType::F64);
    for i in 0..4 {
        let prompt = random_prompt(16, pair.target.config.dims.vocab_size, &mut rng);
        let sampling = match i {
            3 => Sampling::new(1.0, rng.random()).expect("sampling"),
            _ => Sampling::Greedy,
        };
        cut_inside += usize::from(check(&pair, &prompt, &sampling, i < 2, &mut rng));
    }
    let hybrid = &hybrid_pairs(rng.random(), 4, candle_core::DType::F64)[0];
    let prompt = random_prompt(9, hybrid.target.config.vocab_size, &mut rng);
    check(hybrid, &prompt, &Sampling::Greedy, false, &mut rng);
    assert!(cut_inside > 0, "root seed {root}: no stop fell inside a verify step");
}
