//! Greedy speculative decoding (spec section 4) against plain greedy decoding: lossless output,
//! accept lengths that are the longest agreeing draft prefixes, tau in `[1, B]`, the stop at an
//! end-of-sequence id, and errors (not panics) on a mismatched drafter or an empty prompt.

use std::cell::Cell;

use candle_core::DType;
use dflash_conformance::decode_cases::{
    random_draft_config, random_drafter, random_pair, random_prompt, stop_position, Pair, TARGET_STD,
};
use dflash_conformance::setups::random_target_config;
use dflash_reference::config::AttnKind;
use dflash_reference::drafter::DraftInput;
use dflash_reference::speculative::{
    argmax_rows, greedy_decode, plain_decode_until, speculative_decode, speculative_decode_until, Sampling, SpecOutput,
};
use dflash_reference::target::Target;
use dflash_reference::target::TargetModel;
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestRunner};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The accept lengths a correct speculative decode must report, recomputed from the greedy
/// continuation: at each step, the bonus is the next greedy token, the drafter proposes from
/// the features of the committed tokens, and `A` is the longest prefix equal to greedy.
fn expected_accept_lengths(pair: &Pair, prompt: &[u32], greedy: &[u32], max_new: usize) -> Vec<usize> {
    let config = &pair.drafter.config;
    let b = config.block_size;
    let head = pair.target.frozen_head();
    // The prefill's token, then steps while tokens remain: each drafts after the last token
    // emitted, from the features of those before it.
    let mut done = max_new.min(1);
    let mut lengths = Vec::new();
    while done < max_new {
        let committed: Vec<u32> = prompt.iter().chain(&greedy[..done - 1]).copied().collect();
        let features = pair.target.features(&committed, &config.target_layer_ids).expect("target features");
        let input = DraftInput::inference(features, greedy[done - 1], b).expect("inference input");
        let logits = pair.drafter.forward(&head, &input).expect("drafter forward");
        let drafts = argmax_rows(&logits.narrow(0, 1, b - 1).unwrap()).unwrap();
        let accepted = drafts.iter().zip(&greedy[done..]).take_while(|(d, g)| d == g).count();
        lengths.push(accepted + 1);
        done += accepted + 1;
    }
    lengths
}

/// Checks one decode against greedy decoding; returns the number of accepted drafts.
fn check_lossless(pair: &Pair, prompt: &[u32], max_new: usize) -> Result<usize, String> {
    let b = pair.drafter.config.block_size;
    let out: SpecOutput = speculative_decode(&pair.target, &pair.drafter, prompt, max_new)
        .map_err(|e| format!("speculative_decode: {e}"))?;
    // B - 1 extra greedy tokens: the last verify step may run past max_new.
    let greedy = greedy_decode(&pair.target, prompt, max_new + b - 1).map_err(|e| format!("greedy_decode: {e}"))?;
    if out.tokens.len() != max_new {
        return Err(format!("{} tokens, asked for {max_new}", out.tokens.len()));
    }
    if out.tokens[..] != greedy[..max_new] {
        return Err(format!("speculative {:?} != greedy {:?}", out.tokens, &greedy[..max_new]));
    }
    if let Some(&bad) = out.accept_lengths.iter().find(|&&a| !(1..=b).contains(&a)) {
        return Err(format!("accept length {bad} outside [1, {b}]"));
    }
    // After the prefill's token, every step but the last emits all its A + 1 tokens; the last
    // reaches max_new (no step when the prefill's token does).
    let total: usize = out.accept_lengths.iter().sum();
    let before_last = total - out.accept_lengths.last().copied().unwrap_or(0);
    let ends = match out.accept_lengths.is_empty() {
        true => max_new <= 1,
        false => 1 + before_last < max_new && max_new <= 1 + total,
    };
    if !ends {
        return Err(format!(
            "accept lengths {:?} (sum {total}) do not end at the {max_new} tokens emitted",
            out.accept_lengths
        ));
    }
    if !out.accept_lengths.is_empty() {
        let tau = out.tau();
        if !(1.0..=b as f64).contains(&tau) {
            return Err(format!("tau {tau} outside [1, {b}]"));
        }
    }
    let want = expected_accept_lengths(pair, prompt, &greedy, max_new);
    if out.accept_lengths != want {
        return Err(format!("accept lengths {:?}, longest agreeing prefixes give {want:?}", out.accept_lengths));
    }
    Ok(total - out.accept_lengths.len())
}

/// Proves lossless greedy speculative decoding on random tiny f64 targets and random drafters
/// (block 2-6, full/sliding layers, prompts of 1-8 tokens, 0-20 new tokens): the output equals
/// greedy decoding token for token, every accept length is the longest prefix of drafts the
/// target agrees with and lies in `[1, B]`, the lengths cover the output, tau is in `[1, B]`;
/// and over the run some drafts were accepted, so the multi-token path was exercised.
#[test]
fn speculative_equals_greedy() {
    let accepted = Cell::new(0usize);
    let mut runner = TestRunner::new(ProptestConfig { cases: 40, ..ProptestConfig::default() });
    let strategy = (any::<u64>(), 2usize..=6, 1usize..=8, 0usize..=20);
    let result = runner.run(&strategy, |(seed, b, prompt_len, max_new)| {
        let pair = random_pair(seed, b);
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
        let prompt = random_prompt(prompt_len, pair.target.config.dims.vocab_size, &mut rng);
        let n = check_lossless(&pair, &prompt, max_new).map_err(TestCaseError::fail)?;
        accepted.set(accepted.get() + n);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    assert!(accepted.get() > 0, "no verify step accepted a draft in the whole run: only the A = 0 path was tested");
}

/// Proves, on 40 fixed seeds (random targets, drafters and prompts, 24 new tokens, block
/// 2-6), that decoding stays lossless while drafts are really accepted: some step accepts 2 or
/// more drafts, some step accepts a whole block (A = B - 1), and the mean tau is above 1.
#[test]
fn multi_token_steps_are_lossless() {
    let (mut steps, mut accepted, mut longest, mut full_blocks) = (0, 0, 0, 0);
    for seed in 0..40u64 {
        let b = 2 + (seed as usize % 5);
        let pair = random_pair(seed, b);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let prompt = random_prompt(rng.random_range(1..=6), pair.target.config.dims.vocab_size, &mut rng);
        let max_new = 24;
        let n = check_lossless(&pair, &prompt, max_new).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        let out = speculative_decode(&pair.target, &pair.drafter, &prompt, max_new).unwrap();
        steps += out.accept_lengths.len();
        accepted += n;
        longest = longest.max(out.accept_lengths.iter().copied().max().unwrap_or(0));
        full_blocks += out.accept_lengths.iter().filter(|&&a| a == b && b > 2).count();
    }
    assert!(longest >= 3, "no step accepted 2 or more drafts (longest A+1 = {longest})");
    assert!(full_blocks > 0, "no step with B > 2 accepted its whole block");
    let tau = (steps + accepted) as f64 / steps as f64;
    assert!(tau > 1.0, "mean tau {tau} over all seeds");
}

/// Proves that a drafter built for another target (different hidden size, vocabulary or number
/// of target layers) is refused with an error naming the mismatch, not a panic.
#[test]
fn mismatched_drafter_is_an_error() {
    for seed in 0..6u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let target_config = random_target_config(&mut rng);
        let target = TargetModel::random(target_config.clone(), seed, TARGET_STD, DType::F64).unwrap();
        let vocab = target_config.dims.vocab_size;
        let prompt = random_prompt(3, vocab, &mut rng);

        let mut wider = target_config.clone();
        wider.dims.hidden_size += 2;
        let mut bigger_vocab = target_config.clone();
        bigger_vocab.dims.vocab_size += 3;
        let mut deeper = target_config.clone();
        deeper.dims.layer_kinds.push(AttnKind::Full);
        let cases = [(wider, "hidden_size"), (bigger_vocab, "vocab_size"), (deeper, "num_target_layers")];
        for (other, field) in cases {
            let config = random_draft_config(&other, 3, &mut rng);
            let drafter = random_drafter(config, 0.5, &mut rng, DType::F64);
            let result = speculative_decode(&target, &drafter, &prompt, 4);
            match result {
                Ok(out) => panic!("seed {seed}: {field} mismatch accepted, gave {out:?}"),
                Err(e) => assert!(e.to_string().contains(field), "seed {seed}: error does not name {field}: {e}"),
            }
        }
        // The matching drafter for the same target works (the error above is the mismatch).
        let config = random_draft_config(&target_config, 3, &mut rng);
        let drafter = random_drafter(config, 0.5, &mut rng, DType::F64);
        speculative_decode(&target, &drafter, &prompt, 4).expect("matching drafter");
    }
}

/// Proves that an empty prompt is an error (naming the prompt) for both decoders, not a panic.
#[test]
fn empty_prompt_is_an_error() {
    let pair = random_pair(7, 4);
    let spec = speculative_decode(&pair.target, &pair.drafter, &[], 5)
        .expect_err("speculative_decode accepted an empty prompt");
    assert!(spec.to_string().contains("prompt"), "{spec}");
    let greedy = greedy_decode(&pair.target, &[], 5).expect_err("greedy accepted an empty prompt");
    assert!(greedy.to_string().contains("prompt"), "{greedy}");
}

/// Through the reference `Target` trait the hybrid target decodes like the dense one (spec
/// sections 4 and 10): with the built-in hybrid and a random drafter of its shape, speculative
/// decoding equals plain greedy decoding on prompts shorter and longer than a GatedDeltaNet
/// chunk, every accept length in `[1, B]`; a drafter for a target of another depth is refused,
/// naming both sides.
#[test]
fn a_hybrid_target_decodes_losslessly() {
    use dflash_reference::builtin::{hybrid_draft_config, hybrid_target};
    use dflash_reference::drafter::Drafter;
    let target = hybrid_target(3, DType::F32).expect("hybrid target");
    let config = hybrid_draft_config(&target.config);
    let drafter = Drafter::init(config.clone(), 4, DType::F32).expect("drafter");
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for len in [5, 70] {
        let prompt = random_prompt(len, target.config.vocab_size, &mut rng);
        let out = speculative_decode(&target, &drafter, &prompt, 12).expect("speculative");
        let greedy = greedy_decode(&target, &prompt, 12).expect("greedy");
        assert_eq!(out.tokens, greedy, "prompt of {len}");
        assert!(out.accept_lengths.iter().all(|a| (1..=config.block_size).contains(a)), "{:?}", out.accept_lengths);
    }
    let mut deeper = config;
    deeper.num_target_layers += 1;
    let other = Drafter::init(deeper, 4, DType::F32).expect("drafter");
    let err = speculative_decode(&target, &other, &[1, 2, 3], 4).expect_err("another depth").to_string();
    assert!(err.contains("num_target_layers 9 but the target's is 8"), "{err}");
}

/// One stop check: `pair` on `prompt`, with a stop set holding an id of the unstopped greedy
/// output (at a random index: the set cannot be vacuous; with `inside_wanted`, an accepted draft
/// before the end of its verify step where the unstopped decode has one) and an id that is no
/// token of it (or none). The stopped speculative decode equals the stopped greedy decode, and both are the
/// unstopped greedy output through the first occurrence of the stop id; the accept lengths are
/// those of a decode cut at that many tokens (the last step's `A + 1` counted whole). Returns
/// whether the stop cut tokens off its verify step.
fn check_stop(
    pair: &Pair,
    prompt: &[u32],
    max_new: usize,
    inside_wanted: bool,
    rng: &mut impl Rng,
) -> Result<bool, String> {
    let b = pair.drafter.config.block_size;
    let greedy = greedy_decode(&pair.target, prompt, max_new + b - 1).map_err(|e| format!("greedy_decode: {e}"))?;
    let unstopped = speculative_decode(&pair.target, &pair.drafter, prompt, max_new)
        .map_err(|e| format!("speculative_decode: {e}"))?;
    let at = stop_position(&greedy, &unstopped.accept_lengths, max_new, inside_wanted, rng);
    let id = greedy[at];
    let first = greedy.iter().position(|&t| t == id).expect("taken from it");
    let absent = (0..pair.target.config.dims.vocab_size as u32).find(|t| !greedy[..=first].contains(t));
    let mut stop: Vec<u32> = absent.into_iter().chain([id]).collect();
    if rng.random_bool(0.5) {
        stop.reverse();
    }
    let want = &greedy[..=first];
    let plain = plain_decode_until(&pair.target, prompt, max_new, &Sampling::Greedy, &stop)
        .map_err(|e| format!("plain_decode_until: {e}"))?;
    if plain != want {
        return Err(format!("stop {stop:?}: greedy {plain:?}, the unstopped greedy through {id} is {want:?}"));
    }
    let out = speculative_decode_until(&pair.target, &pair.drafter, prompt, max_new, &Sampling::Greedy, &stop)
        .map_err(|e| format!("speculative_decode_until: {e}"))?;
    if out.tokens != want {
        return Err(format!("stop {stop:?}: speculative {:?}, greedy {want:?}", out.tokens));
    }
    let lengths = expected_accept_lengths(pair, prompt, &greedy, first + 1);
    if out.accept_lengths != lengths {
        return Err(format!("stop {stop:?}: accept lengths {:?}, want {lengths:?}", out.accept_lengths));
    }
    Ok(1 + out.accept_lengths.iter().sum::<usize>() > out.tokens.len())
}

/// Proves the stop at an end-of-sequence id on fresh random tiny targets, drafters (block 2-6)
/// and prompts, and on the trained built-in pair (drafts accepted several at a time, so the stop
/// often falls inside a verify step): greedy and speculative decoding with the same stop set end
/// at its first id in the output, token for token, with the accept lengths of a decode cut there;
/// under seeded sampling the two stopped decodes agree too; an empty stop set decodes `max_new`.
#[test]
fn speculative_and_greedy_decoding_stop_at_the_same_end_id() {
    // Fresh inputs each run; the root seed in every failure reproduces them.
    let root: u64 = rand::rng().random();
    let mut rng = ChaCha8Rng::seed_from_u64(root);
    let mut cut_inside = 0;
    for case in 0..30 {
        let seed: u64 = rng.random();
        let b = rng.random_range(2..=6);
        let pair = random_pair(seed, b);
        let prompt = random_prompt(rng.random_range(1..=8), pair.target.config.dims.vocab_size, &mut rng);
        let max_new = rng.random_range(1..=20);
        let cut = check_stop(&pair, &prompt, max_new, false, &mut rng)
            .unwrap_or_else(|e| panic!("root seed {root}, case {case} (block {b}, {max_new} new): {e}"));
        cut_inside += usize::from(cut);
    }
    let pair = dflash_conformance::decode_cases::builtin_pair(DType::F64);
    let vocab = pair.target.config.dims.vocab_size;
    for case in 0..6 {
        let prompt = random_prompt(16, vocab, &mut rng);
        let cut = check_stop(&pair, &prompt, 32, case % 2 == 0, &mut rng)
            .unwrap_or_else(|e| panic!("root seed {root}, built-in pair, case {case}: {e}"));
        cut_inside += usize::from(cut);
    }
    assert!(cut_inside > 0, "root seed {root}: no stop fell inside a verify step: the cut of a step never ran");

    // Seeded sampling: speculative and plain sampling stop at the same place.
    let prompt = random_prompt(16, vocab, &mut rng);
    let sampling = Sampling::new(1.0, rng.random()).unwrap();
    let free = plain_decode_until(&pair.target, &prompt, 24, &sampling, &[]).unwrap();
    assert_eq!(free.len(), 24, "an empty stop set decodes max_new tokens");
    let stop = [free[rng.random_range(0..24)]];
    let first = free.iter().position(|t| *t == stop[0]).unwrap();
    let plain = plain_decode_until(&pair.target, &prompt, 24, &sampling, &stop).unwrap();
    let spec = speculative_decode_until(&pair.target, &pair.drafter, &prompt, 24, &sampling, &stop).unwrap();
    let want = &free[..=first];
    assert_eq!((&plain[..], &spec.tokens[..]), (want, want), "root seed {root}: sampled, stop {stop:?}");
}
