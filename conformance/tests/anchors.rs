//! Anchor sampling and block targets (spec section 3): which anchors are drawn, how uniformly,
//! and which label and weight every block row gets.

use dflash_conformance::tolerance::ORACLE_F64;
use dflash_reference::anchors::{sample_anchors, Anchors};
use dflash_reference::loss::{default_gamma, BlockTargets};
use dflash_reference::mask::BlockLayout;
use proptest::prelude::*;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A random loss mask of `len` tokens, each 1 with probability `density`.
fn random_mask(len: usize, density: f64, rng: &mut ChaCha8Rng) -> Vec<bool> {
    (0..len).map(|_| rng.random_bool(density)).collect()
}

/// The candidates by the spec's words: positions whose token and next token are both learned
/// (which also keeps `a + 1` inside the row).
fn candidates(mask: &[bool]) -> Vec<usize> {
    mask.windows(2).enumerate().filter(|(_, w)| w[0] && w[1]).map(|(a, _)| a).collect()
}

fn draw(mask: &[bool], n_max: usize, seed: u64) -> Anchors {
    sample_anchors(mask, n_max, &mut ChaCha8Rng::seed_from_u64(seed))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Proves the shape of a draw: `n_max` entries; exactly `min(n_max, #candidates)` kept, all
    /// first; kept anchors strictly increasing (sorted, unique), each a candidate (`m[a] =
    /// m[a+1] = 1`, `a <= S-2`); padding entries after them keep the positions sorted and inside
    /// the row, so the padded anchors form a valid packed layout.
    #[test]
    fn draws_are_sorted_unique_candidates_padded_at_the_end(
        len in 0usize..40,
        density in 0.0f64..1.0,
        n_max in 0usize..16,
        seed in any::<u64>(),
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xa5a5);
        let mask = random_mask(len, density, &mut rng);
        let cands = candidates(&mask);
        let anchors = draw(&mask, n_max, seed);
        let n = n_max.min(cands.len());
        prop_assert_eq!(anchors.positions.len(), n_max);
        prop_assert_eq!(anchors.keep.len(), n_max);
        prop_assert_eq!(anchors.num_kept(), n);
        let expected_keep: Vec<bool> = (0..n_max).map(|j| j < n).collect();
        prop_assert_eq!(&anchors.keep, &expected_keep);
        let kept = &anchors.positions[..n];
        prop_assert!(kept.windows(2).all(|w| w[0] < w[1]), "kept not strictly increasing: {kept:?}");
        for &a in kept {
            prop_assert!(a + 2 <= len && mask[a] && mask[a + 1], "anchor {a} is no candidate of {mask:?}");
            prop_assert!(cands.contains(&a));
        }
        prop_assert!(anchors.positions.windows(2).all(|w| w[0] <= w[1]), "{:?}", anchors.positions);
        if len > 0 {
            prop_assert!(anchors.positions.iter().all(|&a| a < len));
            let docs = Some(vec![0i64; len]);
            prop_assert!(BlockLayout::new(len, 3, anchors.positions.clone(), anchors.keep.clone(), docs).is_ok());
        }
    }

    /// Proves determinism and freshness: the same seed gives the same draw; with at least 10
    /// candidates and 1 <= N < #candidates (so at least 10 possible draws), 8 different seeds
    /// do not all give the same draw (probability of that for a uniform sampler at most
    /// 10^-7).
    #[test]
    fn draws_are_deterministic_per_seed_and_vary_across_seeds(
        len in 24usize..48,
        n_pick in any::<u64>(),
        seed in any::<u64>(),
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5a5a);
        let mask = random_mask(len, 0.9, &mut rng);
        let c = candidates(&mask).len();
        prop_assume!(c >= 10);
        let n = 1 + (n_pick % (c as u64 - 1)) as usize;
        prop_assert_eq!(draw(&mask, n, seed), draw(&mask, n, seed));
        let draws: Vec<Anchors> = (0..8).map(|i| draw(&mask, n, seed.wrapping_add(i))).collect();
        prop_assert!(draws.iter().any(|d| d != &draws[0]), "8 seeds, one draw: {:?}", draws[0]);
    }

    /// Proves that every kept anchor carries loss weight: a candidate `a` has `m[a+1] = 1`, so
    /// offset 1 of its block is valid with weight exp(0) = 1 (for B >= 2).
    #[test]
    fn every_drawn_anchor_is_scored_at_offset_one(
        len in 2usize..40,
        n_max in 1usize..12,
        b in 2usize..8,
        seed in any::<u64>(),
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x77);
        let mask = random_mask(len, 0.7, &mut rng);
        let tokens: Vec<u32> = (0..len).map(|_| rng.random_range(0..100)).collect();
        let anchors = draw(&mask, n_max, seed);
        let t = BlockTargets::new(&tokens, &mask, &anchors, b, 3.0);
        for j in 0..anchors.num_kept() {
            prop_assert_eq!(t.weights[j * b + 1], 1.0, "block {}", j);
        }
        prop_assert!(t.total_weight() >= anchors.num_kept() as f64);
    }
}

/// Proves the draw is uniform: over T draws of N out of c candidates each candidate appears
/// with frequency near p = N/c, and the counts pass a chi-square test.
///
/// Per candidate: its count is Binomial(T, p) (the draws are independent), so by Hoeffding
/// `P(|count/T - p| >= eps) <= 2 exp(-2 T eps^2)`; eps = sqrt(ln(2c/1e-6) / 2T) makes the
/// chance that any of the c candidates breaks the bound at most 1e-6.
///
/// Chi-square: within one draw, two candidates are both picked with probability
/// N(N-1)/(c(c-1)), so Cov(count_i, count_k) = -T p(1-p)/(c-1) and the counts' covariance is
/// T p(1-p) c/(c-1) (I - 11^T/c). Hence X = (c-1)/c * sum_i (count_i - Tp)^2 / (T p(1-p)) is
/// asymptotically chi-square with k = c-1 degrees of freedom, and by Laurent-Massart
/// `P(X >= k + 2 sqrt(k x) + 2x) <= e^-x`; x = 14 bounds a false alarm by 1e-6.
/// Power: a sampler that never draws one candidate adds (c-1)/c * T p/(1-p) >= T/c > 100
/// (c < 39 here) to X, more than the bound's slack above the mean, 2 sqrt(14 k) + 28 < 75.
#[test]
fn draws_are_uniform_over_candidates() {
    const T: usize = 4000;
    let mut tested = 0;
    for case_seed in 0..8u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(1000 + case_seed);
        let len = rng.random_range(12..40);
        let mask = random_mask(len, 0.85, &mut rng);
        let cands = candidates(&mask);
        let c = cands.len();
        if c < 3 {
            continue;
        }
        let n = rng.random_range(1..c);
        let p = n as f64 / c as f64;
        let mut counts = vec![0usize; len];
        let mut draws = ChaCha8Rng::seed_from_u64(rng.random());
        for _ in 0..T {
            let a = sample_anchors(&mask, n, &mut draws);
            assert_eq!(a.num_kept(), n);
            for &pos in &a.positions {
                counts[pos] += 1;
            }
        }
        let eps = ((2.0 * c as f64 / 1e-6).ln() / (2.0 * T as f64)).sqrt();
        let var = T as f64 * p * (1.0 - p);
        let mut chi2 = 0.0;
        for (pos, &count) in counts.iter().enumerate() {
            if !cands.contains(&pos) {
                assert_eq!(count, 0, "position {pos} is no candidate but was drawn");
                continue;
            }
            let freq = count as f64 / T as f64;
            assert!(
                (freq - p).abs() < eps,
                "candidate {pos}: frequency {freq:.4}, expected {p:.4} +- {eps:.4} (c = {c}, N = {n})"
            );
            chi2 += (count as f64 - T as f64 * p).powi(2) / var;
        }
        let x = 14.0;
        let k = (c - 1) as f64;
        let stat = chi2 * k / c as f64;
        let bound = k + 2.0 * (k * x).sqrt() + 2.0 * x;
        assert!(stat < bound, "chi-square {stat:.1} above {bound:.1} (c = {c}, N = {n}, counts {counts:?})");
        tested += 1;
    }
    assert!(tested >= 6, "only {tested} of 8 masks had 3+ candidates");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Proves the block targets of spec 3: label of row (j, o) is `x[a_j + o]` (the token AT
    /// the mask slot, never `x[a_j+o+1]`: tokens are distinct here, so a shifted label cannot
    /// coincide), 0 past the row end; weight `exp(-(o-1)/gamma)` exactly where o >= 1, keep[j],
    /// `a_j+o < S` and `m[a_j+o]`, else 0 (offset 0, past the end, unlearned tokens, dropped
    /// blocks); the weights decay by exp(-1/gamma) per offset; total = sum.
    #[test]
    fn block_targets_label_the_slot_and_decay(
        s in 1usize..30,
        n in 0usize..6,
        b in 1usize..10,
        gamma in 0.5f64..10.0,
        seed in any::<u64>(),
    ) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut tokens: Vec<u32> = (0..s as u32).map(|t| 7 + 3 * t).collect();
        tokens.shuffle(&mut rng);
        let mask = random_mask(s, 0.7, &mut rng);
        let mut positions: Vec<usize> = (0..n).map(|_| rng.random_range(0..s)).collect();
        positions.sort_unstable();
        let keep: Vec<bool> = (0..n).map(|_| rng.random_bool(0.75)).collect();
        let anchors = Anchors { positions, keep };
        let t = BlockTargets::new(&tokens, &mask, &anchors, b, gamma);
        prop_assert_eq!(t.labels.len(), n * b);
        prop_assert_eq!(t.weights.len(), n * b);
        let decay = (-1.0 / gamma).exp();
        for j in 0..n {
            let (a, keep) = (anchors.positions[j], anchors.keep[j]);
            for o in 0..b {
                let (label, w) = (t.labels[j * b + o], t.weights[j * b + o]);
                let p = a + o;
                if p < s {
                    prop_assert_eq!(label, tokens[p], "label of block {} offset {}", j, o);
                } else {
                    prop_assert_eq!(label, 0, "label past the row end");
                }
                let scored = o >= 1 && keep && p < s && mask[p];
                if scored {
                    let want = decay.powi(o as i32 - 1);
                    prop_assert!(
                        (w - want).abs() <= ORACLE_F64.rel * want,
                        "weight {} of block {} offset {}, want {}", w, j, o, want
                    );
                    if o == 1 {
                        prop_assert_eq!(w, 1.0);
                    }
                } else {
                    prop_assert_eq!(w, 0.0, "unscored row (block {}, offset {})", j, o);
                }
            }
        }
        let sum: f64 = t.weights.iter().sum();
        prop_assert_eq!(t.total_weight(), sum);
    }
}

/// Proves the targets on a hand-worked row. tokens `[10, 11, 12, 13, 14]`, loss mask
/// `[0, 1, 1, 1, 1]`, B = 3, gamma = 2, anchors `[1, 3, 3]` with keep `[true, true, false]`:
/// - block 0 (a = 1): o0 label 11 weight 0; o1 label x[2] = 12, weight exp(0) = 1; o2 label
///   x[3] = 13, weight exp(-1/2);
/// - block 1 (a = 3): o0 label 13 weight 0; o1 label 14 weight 1; o2 position 5 = S: label 0,
///   weight 0;
/// - block 2 (keep = false): labels 13, 14, 0, weights all 0.
///
/// Total weight 2 + exp(-1/2). Then with m[3] = 0, block 0's o2 (position 3) loses its weight.
#[test]
fn hand_worked_targets() {
    let tokens = [10, 11, 12, 13, 14];
    let anchors = Anchors { positions: vec![1, 3, 3], keep: vec![true, true, false] };
    let mask = [false, true, true, true, true];
    let t = BlockTargets::new(&tokens, &mask, &anchors, 3, 2.0);
    let e = (-0.5f64).exp();
    assert_eq!(t.labels, vec![11, 12, 13, 13, 14, 0, 13, 14, 0]);
    assert_eq!(t.weights, vec![0.0, 1.0, e, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
    assert_eq!(t.total_weight(), 2.0 + e);

    let mask = [false, true, true, false, true];
    let t = BlockTargets::new(&tokens, &mask, &anchors, 3, 2.0);
    assert_eq!(t.weights, vec![0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
}

/// Proves the spec's decay constants: gamma = 7 for B = 16, 5 for B = 10, 4 for B = 8.
#[test]
fn default_gamma_matches_the_spec() {
    assert_eq!(default_gamma(16), 7.0);
    assert_eq!(default_gamma(10), 5.0);
    assert_eq!(default_gamma(8), 4.0);
}

/// Proves the candidates on a hand-worked mask and that a draw of more than there are keeps
/// them all: mask `[1, 1, 0, 1, 1, 1, 0]` has candidates {0, 3, 4} (6 is masked, 5's
/// successor is masked, 2 is masked); N_max = 5 keeps 0, 3, 4 and pads two entries with
/// keep = false.
#[test]
fn hand_worked_candidates() {
    let mask = [true, true, false, true, true, true, false];
    for seed in 0..4 {
        let a = draw(&mask, 5, seed);
        assert_eq!(&a.positions[..3], &[0, 3, 4]);
        assert_eq!(a.keep, vec![true, true, true, false, false]);
    }
    let a = draw(&[true; 1], 2, 0);
    assert_eq!(a.num_kept(), 0, "a one-token row has no candidate (a <= S-2)");
}
