//! The CPU twin of the fused attention (issue 3) against the reference dense attention with its
//! dense boolean mask: output, log-sum-exp and all three gradients, in f64 and f32, over random
//! DFlash layouts and causal plans; and the attention plan against the reference mask predicate
//! (spec section 2).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use candle_core::{DType, Device, Tensor, Var};
use dflash_conformance::setups::randn;
use dflash_conformance::tolerance::{Tolerance, TWIN_F32, TWIN_F32_GRAD_TERMS, TWIN_F64};
use dflash_optimized::ops::attention::ranges::KeyRanges;
use dflash_optimized::ops::attention::twin::{
    attention_backward, attention_forward, group_tiles, tile_kind, AttnShape, TileKind,
};
use dflash_optimized::ops::constants::{forward_tile_k, TILE_K};
use dflash_optimized::ops::Real;
use dflash_optimized::Error;
use dflash_reference::attention::dense_attention;
use dflash_reference::config::AttnKind;
use dflash_reference::mask::{causal_allow, causal_dense, BlockLayout};
use dflash_reference::Error as RefError;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A sequence or context length: 1..=150, often a tile boundary or just around one.
fn random_len(rng: &mut ChaCha8Rng) -> usize {
    if rng.random_bool(0.3) {
        [1, 63, 64, 65, 128, 129][rng.random_range(0..6)]
    } else {
        rng.random_range(1..=150)
    }
}

/// Full attention, or a sliding window from 1 to 20 past `len` (so sometimes larger than it).
fn random_kind(len: usize, rng: &mut ChaCha8Rng) -> AttnKind {
    if rng.random_bool(0.5) {
        AttnKind::Full
    } else {
        AttnKind::Sliding { window: rng.random_range(1..=len + 20) }
    }
}

/// Contiguous documents 0, 1, 2, ... of random lengths, with runs of -1 padding before, between
/// and after them.
fn packed_docs(s: usize, rng: &mut ChaCha8Rng) -> Vec<i64> {
    let mut next = 0;
    let mut current = if rng.random_bool(0.2) { -1 } else { 0 };
    if current == 0 {
        next = 1;
    }
    let mut docs = Vec::with_capacity(s);
    for i in 0..s {
        if i > 0 && rng.random_bool(0.08) {
            current = if current != -1 && rng.random_bool(0.3) { -1 } else { next };
            next += i64::from(current != -1);
        }
        docs.push(current);
    }
    docs
}

/// A random DFlash layout: S from `random_len`, B in 1..=8 or 16, N in 1..=4, sorted anchors (the
/// inference anchor `S` possible without documents), keep flags with at least one kept block,
/// one document or packed documents with padding.
fn random_layout(rng: &mut ChaCha8Rng) -> BlockLayout {
    let s = random_len(rng);
    let b = if rng.random_bool(0.2) { 16 } else { rng.random_range(1..=8) };
    let n = rng.random_range(1..=4);
    let doc_ids = rng.random_bool(0.5).then(|| packed_docs(s, rng));
    let top = if doc_ids.is_some() { s - 1 } else { s };
    let mut anchors: Vec<usize> = (0..n).map(|_| rng.random_range(0..=top)).collect();
    anchors.sort_unstable();
    let kept = rng.random_range(0..n);
    let keep = (0..n).map(|j| j == kept || rng.random_bool(0.7)).collect();
    BlockLayout::new(s, b, anchors, keep, doc_ids).expect("random layout")
}

/// A random plan with its dense reference mask and a label: a DFlash layer over a random layout,
/// or a causal sequence of random length in random groups of 1..=70 rows.
fn random_plan(causal: bool, rng: &mut ChaCha8Rng) -> (KeyRanges, Vec<bool>, String) {
    if causal {
        let t = random_len(rng);
        let kind = random_kind(t, rng);
        let group_rows = rng.random_range(1..=70);
        let plan = KeyRanges::causal(t, kind, group_rows).expect("causal plan");
        (plan, causal_dense(kind, t), format!("causal T={t} {kind:?} group_rows={group_rows}"))
    } else {
        let layout = random_layout(rng);
        let kind = random_kind(layout.context_len, rng);
        let plan = KeyRanges::dflash(&layout, kind).expect("dflash plan");
        (plan, layout.dense(kind), format!("{layout:?} {kind:?}"))
    }
}

/// One attention problem: plan, dense mask, shape, and standard normal q (times a random gain
/// that sharpens or flattens the softmax), k, v and output gradient.
struct Problem {
    plan: KeyRanges,
    mask: Vec<bool>,
    label: String,
    shape: AttnShape,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    dout: Vec<f64>,
}

fn random_problem(seed: u64, causal: bool) -> Problem {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (plan, mask, label) = random_plan(causal, &mut rng);
    let num_kv_heads = rng.random_range(1..=2);
    let num_heads = num_kv_heads * [1, 2, 4][rng.random_range(0..3)];
    let shape = AttnShape { num_heads, num_kv_heads, head_dim: rng.random_range(1..=16) };
    let (nq, nk, d) = (plan.num_queries, plan.num_keys, shape.head_dim);
    let mut normal = |n: usize| randn(&[n], &mut rng, DType::F64).and_then(|t| Ok(t.to_vec1::<f64>()?)).expect("randn");
    let (q, k, v, dout) = (
        normal(nq * num_heads * d),
        normal(nk * num_kv_heads * d),
        normal(nk * num_kv_heads * d),
        normal(nq * num_heads * d),
    );
    let gain = rng.random_range(0.5..3.0);
    let q = q.into_iter().map(|x| x * gain).collect();
    Problem { plan, mask, label, shape, q, k, v, dout }
}

fn tensor(values: &[f64], dims: &[usize]) -> Tensor {
    Tensor::from_slice(values, dims, &Device::Cpu).expect("tensor")
}

fn to_vec(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1::<f64>()).expect("tensor to vec")
}

/// The reference in f64: out and the gradients of `sum(out * dout)` w.r.t. q, k, v by autograd.
fn reference(p: &Problem, [q, k, v, dout]: [&[f64]; 4]) -> [Vec<f64>; 4] {
    let AttnShape { num_heads: nh, num_kv_heads: nkv, head_dim: d } = p.shape;
    let (nq, nk) = (p.plan.num_queries, p.plan.num_keys);
    let var = |x: &[f64], dims: &[usize]| Var::from_tensor(&tensor(x, dims)).expect("var");
    let (q, k, v) = (var(q, &[nq, nh, d]), var(k, &[nk, nkv, d]), var(v, &[nk, nkv, d]));
    let out = dense_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &p.mask).expect("dense_attention");
    let f = (&out * tensor(dout, &[nq, nh, d])).and_then(|t| t.sum_all()).expect("functional");
    let grads = f.backward().expect("backward");
    let grad = |x: &Var| grads.get(x.as_tensor()).map(to_vec).unwrap_or_else(|| vec![0.0; x.as_tensor().elem_count()]);
    [to_vec(&out), grad(&q), grad(&k), grad(&v)]
}

/// Log-sum-exp `[nh, Q]` of the scaled scores over the keys the dense mask allows, by plain
/// loops in f64 (-inf for rows that see nothing), and its terms' size `[nh, Q]`: `|lse| + max |score|`
/// with each score's products made absolute (0 for rows that see nothing).
fn dense_lse(p: &Problem, q: &[f64], k: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let AttnShape { num_heads: nh, num_kv_heads: nkv, head_dim: d } = p.shape;
    let (nq, nk) = (p.plan.num_queries, p.plan.num_keys);
    let scale = (d as f64).powf(-0.5);
    let mut lse = vec![f64::NEG_INFINITY; nh * nq];
    let mut terms = vec![0.0; nh * nq];
    for h in 0..nh {
        let kh = h / (nh / nkv);
        for i in 0..nq {
            let q_row = &q[(i * nh + h) * d..][..d];
            let scores: Vec<f64> = (0..nk)
                .filter(|&j| p.mask[i * nk + j])
                .map(|j| scale * q_row.iter().zip(&k[(j * nkv + kh) * d..][..d]).map(|(a, b)| a * b).sum::<f64>())
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            if max > f64::NEG_INFINITY {
                lse[h * nq + i] = max + scores.iter().map(|s| (s - max).exp()).sum::<f64>().ln();
                let abs_score = (0..nk).filter(|&j| p.mask[i * nk + j]).map(|j| {
                    scale * q_row.iter().zip(&k[(j * nkv + kh) * d..][..d]).map(|(a, b)| (a * b).abs()).sum::<f64>()
                });
                terms[h * nq + i] = lse[h * nq + i].abs() + abs_score.fold(0.0, f64::max);
            }
        }
    }
    (lse, terms)
}

/// The sum of the absolute values of the terms of each gradient `[dq, dk, dv]`, in f64 from the
/// reference's out and lse: `scale * sum_k p |dp - Dsum|`-style sums with every factor made
/// absolute (`|dp| + |Dsum|`, `|k|`, `|q|`, `|dout|`). Rounding in any order of summation is
/// bounded by eps times these, whatever cancellation leaves of the gradient itself.
fn gradient_terms(p: &Problem, [q, k, v, dout]: [&[f64]; 4], out: &[f64], lse: &[f64]) -> [Vec<f64>; 3] {
    let AttnShape { num_heads: nh, num_kv_heads: nkv, head_dim: d } = p.shape;
    let (nq, nk) = (p.plan.num_queries, p.plan.num_keys);
    let scale = (d as f64).powf(-0.5);
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    // The dot products dp = dout.v and Dsum = dout.out are sums of signed terms too: their size is
    // the sum of the terms' absolute values, which f32 rounding scales with.
    let dot_abs = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x * y).abs()).sum::<f64>();
    let (mut tq, mut tk, mut tv) = (vec![0.0; nq * nh * d], vec![0.0; nk * nkv * d], vec![0.0; nk * nkv * d]);
    for i in 0..nq {
        for h in 0..nh {
            let row = (i * nh + h) * d;
            let dsum = dot_abs(&dout[row..][..d], &out[row..][..d]);
            for j in (0..nk).filter(|&j| p.mask[i * nk + j]) {
                let kv = (j * nkv + h / (nh / nkv)) * d;
                let prob = (scale * dot(&q[row..][..d], &k[kv..][..d]) - lse[h * nq + i]).exp();
                let ds = scale * prob * (dot_abs(&dout[row..][..d], &v[kv..][..d]) + dsum);
                for x in 0..d {
                    tq[row + x] += ds * k[kv + x].abs();
                    tk[kv + x] += ds * q[row + x].abs();
                    tv[kv + x] += prob * dout[row + x].abs();
                }
            }
        }
    }
    [tq, tk, tv]
}

/// What the gradients' errors are divided by.
#[derive(Clone, Copy, PartialEq)]
enum GradScale {
    /// The reference gradient's norm (DESIGN.md's measure).
    Reference,
    /// The norm of the sum of the terms' absolute values (`gradient_terms`).
    Terms,
}

/// Compared quantities; the last three are the gradients' plain relative errors, reported only
/// (they are the asserted ones under `GradScale::Reference`).
const QUANTITIES: [&str; 8] = ["out", "lse", "dq", "dk", "dv", "dq/ref", "dk/ref", "dv/ref"];
/// Largest error seen per quantity, as f64 bits (non-negative f64s order like their bits).
type Worst = [AtomicU64; 8];

fn report(what: &str, worst: &Worst) -> String {
    let errs: Vec<String> = QUANTITIES
        .iter()
        .zip(worst)
        .map(|(n, w)| format!("{n} {:.2e}", f64::from_bits(w.load(Ordering::Relaxed))))
        .collect();
    format!("{what}: {}", errs.join(", "))
}

/// `||got - want|| / ||scale||`, infinite when anything is not finite (NaN never passes).
fn error_over(got: &[f64], want: &[f64], scale: &[f64]) -> f64 {
    if got.iter().chain(want).chain(scale).any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let norm = |x: &mut dyn Iterator<Item = f64>| x.map(|x| x * x).sum::<f64>().sqrt();
    let (diff, scale) = (norm(&mut got.iter().zip(want).map(|(g, w)| g - w)), norm(&mut scale.iter().copied()));
    if scale == 0.0 {
        norm(&mut got.iter().copied())
    } else {
        diff / scale
    }
}

/// Runs the twin in `T` on the problem's inputs rounded to `T` and checks it against the f64
/// reference on those same rounded inputs: out and lse within `values`, dq, dk and dv within
/// `grads` divided as `grad_scale` says; rows that see nothing output exactly 0 with lse -inf
/// and exactly zero dq; keys nobody sees get exactly zero dk and dv.
fn check_twin<T: Real + Into<f64>>(
    p: &Problem,
    values: Tolerance,
    grads: Tolerance,
    grad_scale: GradScale,
    worst: &Worst,
) {
    let AttnShape { num_heads: nh, num_kv_heads: nkv, head_dim: d } = p.shape;
    let (nq, nk) = (p.plan.num_queries, p.plan.num_keys);
    let round = |x: &[f64]| -> Vec<T> { x.iter().map(|&x| T::from_f64(x)).collect() };
    let widen = |x: &[T]| -> Vec<f64> { x.iter().map(|&x| x.into()).collect() };
    let (q, k, v, dout) = (round(&p.q), round(&p.k), round(&p.v), round(&p.dout));
    let inputs = [widen(&q), widen(&k), widen(&v), widen(&dout)];
    let inputs = [&inputs[0][..], &inputs[1], &inputs[2], &inputs[3]];
    let [want_out, want_dq, want_dk, want_dv] = reference(p, inputs);
    let (want_lse, lse_terms) = dense_lse(p, inputs[0], inputs[1]);

    let scale = (d as f64).powf(-0.5);
    let (out, lse) = attention_forward(&p.plan, p.shape, &q, &k, &v, scale).expect("attention_forward");
    let (dq, dk, dv) =
        attention_backward(&p.plan, p.shape, &q, &k, &v, &out, &lse, &dout, scale).expect("attention_backward");
    let (out, lse, dq, dk, dv) = (widen(&out), widen(&lse), widen(&dq), widen(&dk), widen(&dv));

    let label = format!("{} {:?}", p.label, p.shape);
    let check = |i: usize, err: f64, tol: Tolerance| {
        worst[i].fetch_max(err.to_bits(), Ordering::Relaxed);
        assert!(err <= tol.rel, "{label}: {}: error {err:.3e} above {:.0e} ({})", QUANTITIES[i], tol.rel, tol.reason);
    };
    let seen =
        |x: &[f64]| -> Vec<f64> { x.iter().zip(&want_lse).filter(|(_, w)| w.is_finite()).map(|(&x, _)| x).collect() };
    check(0, error_over(&out, &want_out, &want_out), values);
    // The lse against its terms' size (|lse| and the largest |score| with every product made
    // absolute): a row's lse near 0 by cancellation keeps the rounding of the scores it sums.
    check(1, error_over(&seen(&lse), &seen(&want_lse), &seen(&lse_terms)), values);
    let terms = gradient_terms(p, inputs, &want_out, &want_lse);
    for (i, (got, want)) in [(&dq, &want_dq), (&dk, &want_dk), (&dv, &want_dv)].into_iter().enumerate() {
        let plain = error_over(got, want, want);
        worst[5 + i].fetch_max(plain.to_bits(), Ordering::Relaxed);
        let err = if grad_scale == GradScale::Terms { error_over(got, want, &terms[i]) } else { plain };
        check(2 + i, err, grads);
    }

    for i in (0..nq).filter(|&i| !p.mask[i * nk..(i + 1) * nk].contains(&true)) {
        let rows = i * nh * d..(i + 1) * nh * d;
        assert!(
            out[rows.clone()].iter().chain(&dq[rows]).all(|&x| x == 0.0),
            "{label}: blind row {i}: out or dq not 0"
        );
        assert!((0..nh).all(|h| lse[h * nq + i] == f64::NEG_INFINITY), "{label}: blind row {i}: lse not -inf");
    }
    for j in (0..nk).filter(|&j| (0..nq).all(|i| !p.mask[i * nk + j])) {
        let keys = j * nkv * d..(j + 1) * nkv * d;
        assert!(dk[keys.clone()].iter().chain(&dv[keys]).all(|&x| x == 0.0), "{label}: unseen key {j}: dk or dv not 0");
    }
}

/// What a twin test exercised, so that a lucky draw cannot make it vacuous.
#[derive(Default)]
struct Coverage {
    cases: AtomicUsize,
    full_tiles: AtomicUsize,
    partial_tiles: AtomicUsize,
    multi_tile: AtomicUsize,
    multi_forward_tile: AtomicUsize,
    blind_rows: AtomicUsize,
    gqa4: AtomicUsize,
}

impl Coverage {
    fn count(&self, p: &Problem) {
        let add = |c: &AtomicUsize, n: usize| c.fetch_add(n, Ordering::Relaxed);
        add(&self.cases, 1);
        for g in 0..p.plan.groups.len() {
            for tile_k in [TILE_K, forward_tile_k(p.shape.head_dim)] {
                for (_, kind) in group_tiles(&p.plan, g, tile_k) {
                    add(if kind == TileKind::Full { &self.full_tiles } else { &self.partial_tiles }, 1);
                }
            }
        }
        add(&self.multi_tile, usize::from(p.plan.num_keys > TILE_K));
        add(&self.multi_forward_tile, usize::from(p.plan.num_keys > forward_tile_k(p.shape.head_dim)));
        let nk = p.plan.num_keys;
        add(&self.blind_rows, p.mask.chunks(nk).filter(|row| !row.contains(&true)).count());
        add(&self.gqa4, usize::from(p.shape.num_heads == 4 * p.shape.num_kv_heads));
    }

    /// Asserts that every feature occurred; rows that see nothing only when `blind_rows` (causal
    /// rows always see themselves).
    fn assert_exercised(&self, what: &str, blind_rows: bool) {
        let n = |c: &AtomicUsize| c.load(Ordering::Relaxed);
        let mut counts = vec![
            ("full tiles", n(&self.full_tiles)),
            ("partial tiles", n(&self.partial_tiles)),
            ("cases of several KV tiles", n(&self.multi_tile)),
            ("cases of several forward KV tiles", n(&self.multi_forward_tile)),
            ("cases of 4 query heads per KV head", n(&self.gqa4)),
        ];
        if blind_rows {
            counts.push(("rows that see nothing", n(&self.blind_rows)));
        }
        eprintln!("{what}: {} cases, {counts:?}", n(&self.cases));
        for (name, count) in counts {
            assert!(count > 0, "{what}: no {name} in {} cases", n(&self.cases));
        }
    }
}

fn twin_matches_reference(causal: bool, cases: u32, what: &str) {
    let (w64, w32) = (Worst::default(), Worst::default());
    let coverage = Coverage::default();
    proptest!(ProptestConfig::with_cases(cases), |(seed in any::<u64>())| {
        let p = random_problem(seed, causal);
        check_twin::<f64>(&p, TWIN_F64, TWIN_F64, GradScale::Reference, &w64);
        check_twin::<f32>(&p, TWIN_F32, TWIN_F32_GRAD_TERMS, GradScale::Terms, &w32);
        coverage.count(&p);
    });
    eprintln!("{}\n{}", report(&format!("{what} f64 worst"), &w64), report(&format!("{what} f32 worst"), &w32));
    coverage.assert_exercised(what, !causal);
}

/// Proves the CPU twin equals the reference dense attention on DFlash layers: output, lse and
/// the gradients of q, k and v, in f64 (`TWIN_F64`) and f32 (`TWIN_F32`), with exact zeros for
/// rows that see nothing and keys nobody sees; over random GQA shapes (1, 2, 4 query heads per
/// KV head, d up to 16) and layouts (S across tile boundaries, B up to 16, N from 1, keep=false
/// blocks, the inference anchor S, packed documents with padding, full and sliding layers with
/// windows beyond S).
#[test]
fn twin_matches_dense_attention_on_dflash_layers() {
    twin_matches_reference(false, 512, "dflash");
}

/// Proves the same on causal plans (the target and inference): full and sliding (windows beyond
/// T), T across tile boundaries, random row groups.
#[test]
fn twin_matches_dense_attention_on_causal_plans() {
    twin_matches_reference(true, 256, "causal");
}

/// Checks `plan` against the reference predicate `allow`: elementwise, the allowed-pair count,
/// the inverse ranges of `kv_tile_group_ranges` (for `TILE_K` and `tile_k`), and each group's
/// tile kinds and visited tiles against the allowed pairs of its rows in each tile (for `TILE_K`,
/// the forward's tile at head dim 128 and `tile_k`).
fn check_plan(plan: &KeyRanges, allow: impl Fn(usize, usize) -> bool, tile_k: usize, label: &str) -> usize {
    let (nq, nk) = (plan.num_queries, plan.num_keys);
    let mut pairs = 0;
    for q in 0..nq {
        for k in 0..nk {
            assert_eq!(plan.allow(q, k), allow(q, k), "{label}: allow({q}, {k})");
            pairs += u64::from(allow(q, k));
        }
    }
    assert_eq!(plan.allowed_pairs(), pairs, "{label}: allowed pairs");
    for tile in [TILE_K, tile_k] {
        let ranges = plan.kv_tile_group_ranges(tile);
        assert_eq!(ranges.len(), nk.div_ceil(tile), "{label}: tiles of {tile}");
        for (q, k) in (0..nq).flat_map(|q| (0..nk).map(move |k| (q, k))).filter(|&(q, k)| allow(q, k)) {
            let (g, (first, end)) = (q / plan.group_rows, ranges[k / tile]);
            assert!(first as usize <= g && g < end as usize, "{label}: ({q}, {k}) of group {g} outside {first}..{end}");
        }
    }
    for (tile, g) in
        [TILE_K, forward_tile_k(128), tile_k].into_iter().flat_map(|t| (0..plan.groups.len()).map(move |g| (t, g)))
    {
        let (first, end) = plan.group_row_range(g);
        let mut want_tiles = Vec::new();
        for t in 0..nk.div_ceil(tile) {
            let keys = t * tile..((t + 1) * tile).min(nk);
            let seen =
                (first..end).flat_map(|q| keys.clone().map(move |k| (q, k))).filter(|&(q, k)| allow(q, k)).count();
            let want = match seen {
                0 => None,
                n if n == (end - first) * keys.len() => Some(TileKind::Full),
                _ => Some(TileKind::Partial),
            };
            assert_eq!(tile_kind(plan, g, t, tile), want, "{label}: group {g} tile {t} of {tile}");
            want_tiles.extend(want.map(|kind| (t, kind)));
        }
        assert_eq!(group_tiles(plan, g, tile).collect::<Vec<_>>(), want_tiles, "{label}: tiles of {tile}, group {g}");
    }
    nq * nk
}

/// Proves the plan encodes exactly the reference mask: `allow` equals `BlockLayout::allow` and
/// `causal_allow` elementwise, `allowed_pairs` their count, every allowed pair's group lies in its
/// KV tile's `kv_tile_group_ranges`, and each group visits exactly the tiles its rows see, as
/// full or partial, on random DFlash layouts and causal plans.
#[test]
fn plan_encodes_the_reference_mask() {
    let (cases, pairs) = (AtomicUsize::new(0), AtomicUsize::new(0));
    proptest!(ProptestConfig::with_cases(1024), |(seed in any::<u64>())| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let tile_k = rng.random_range(1..=80);
        let checked = if rng.random_bool(0.5) {
            let t = random_len(&mut rng);
            let kind = random_kind(t, &mut rng);
            let group_rows = rng.random_range(1..=70);
            let plan = KeyRanges::causal(t, kind, group_rows).expect("causal plan");
            check_plan(&plan, |q, k| causal_allow(kind, q, k), tile_k, &format!("causal T={t} {kind:?} {group_rows}"))
        } else {
            let layout = random_layout(&mut rng);
            let kind = random_kind(layout.context_len, &mut rng);
            let plan = KeyRanges::dflash(&layout, kind).expect("dflash plan");
            check_plan(&plan, |q, k| layout.allow(kind, q, k), tile_k, &format!("{layout:?} {kind:?}"))
        };
        cases.fetch_add(1, Ordering::Relaxed);
        pairs.fetch_add(checked, Ordering::Relaxed);
    });
    eprintln!("plan vs mask: {} cases, {} (query, key) pairs", cases.into_inner(), pairs.into_inner());
}

/// Proves a DFlash plan refuses packed documents whose ids are not contiguous runs (an id coming
/// back after another id or after padding), naming `doc_ids`.
#[test]
fn non_contiguous_documents_are_refused() {
    proptest!(ProptestConfig::with_cases(256), |(seed in any::<u64>())| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let s = rng.random_range(3..=150);
        let mut docs = packed_docs(s, &mut rng);
        docs[0] = 0;
        let Some(other) = docs.iter().position(|&d| d != 0).filter(|&i| i + 1 < s) else { return Ok(()) };
        let back = rng.random_range(other + 1..s);
        docs[back] = 0;
        let layout = BlockLayout::new(s, 4, vec![0, s - 1], vec![true, true], Some(docs.clone())).expect("layout");
        for kind in [AttnKind::Full, AttnKind::Sliding { window: 8 }] {
            match KeyRanges::dflash(&layout, kind) {
                Err(Error::Reference(RefError::Invalid { what, .. })) => prop_assert_eq!(what, "doc_ids"),
                other => prop_assert!(false, "{docs:?}: {other:?}"),
            }
        }
    });
}

/// Proves the twin refuses a tensor of the wrong length, naming it, and an invalid head shape.
#[test]
fn wrong_lengths_are_refused_naming_the_tensor() {
    let p = random_problem(7, false);
    let scale = (p.shape.head_dim as f64).powf(-0.5);
    let (out, lse) = attention_forward(&p.plan, p.shape, &p.q, &p.k, &p.v, scale).expect("forward");
    let names = ["q", "k", "v", "out", "lse", "dout"];
    for (i, name) in names.iter().enumerate() {
        let mut args = [p.q.clone(), p.k.clone(), p.v.clone(), out.clone(), lse.clone(), p.dout.clone()];
        args[i].pop();
        let [q, k, v, out, lse, dout] = &args;
        let want_name = |r: Result<(), Error>| match r {
            Err(Error::Reference(RefError::Invalid { what, .. })) => assert_eq!(what, *name),
            other => panic!("{name} one short: {other:?}"),
        };
        want_name(attention_backward(&p.plan, p.shape, q, k, v, out, lse, dout, scale).map(|_| ()));
        if i < 3 {
            want_name(attention_forward(&p.plan, p.shape, q, k, v, scale).map(|_| ()));
        }
    }
    let bad = AttnShape { num_heads: 3, num_kv_heads: 2, ..p.shape };
    match attention_forward(&p.plan, bad, &p.q, &p.k, &p.v, scale) {
        Err(Error::Reference(RefError::Invalid { what, .. })) => assert_eq!(what, "shape"),
        other => panic!("3 heads over 2 KV heads: {other:?}"),
    }
}

/// The words a plan puts on the GPU (`DeviceKeyRanges::words`) fit what the memory plan counts for
/// it: a DFlash layer's in `key_ranges_bytes(N, keys)` (the training step's plan), a causal one's
/// in `causal_plans_bytes(T, group_rows)` (the target's forward). One word over is a measured peak
/// over the plan on the GPU (as `gpu-conformance` once found: a trailing 0 past each plan).
#[test]
fn device_plan_words_fit_their_memory_plan() {
    use dflash_optimized::memory::attention::{causal_plans_bytes, key_ranges_bytes};
    use dflash_optimized::ops::attention::cuda::DeviceKeyRanges;
    let seed: u64 = rand::rng().random();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for _ in 0..256 {
        let (plan, planned, label) = match rng.random_bool(0.5) {
            true => {
                let t = random_len(&mut rng);
                let (kind, group_rows) = (random_kind(t, &mut rng), rng.random_range(1..=70));
                let plan = KeyRanges::causal(t, kind, group_rows).expect("causal plan");
                (plan, causal_plans_bytes(t, group_rows).expect("bytes"), format!("causal T={t} {kind:?} {group_rows}"))
            }
            false => {
                let layout = random_layout(&mut rng);
                let kind = random_kind(layout.context_len, &mut rng);
                let plan = KeyRanges::dflash(&layout, kind).expect("dflash plan");
                let planned = key_ranges_bytes(layout.anchors.len(), plan.num_keys).expect("bytes");
                (plan, planned, format!("{layout:?} {kind:?}"))
            }
        };
        let (words, _) = DeviceKeyRanges::words(&plan);
        let bytes = 4 * words.len() as u64;
        assert!(bytes <= planned, "seed {seed}: {label}: {bytes} bytes on the device, {planned} planned");
    }
}
