//! The optimized step's chunked LM head + decayed CE (issue 4) against the reference: the weighted
//! CE sum of the full logits (`weighted_ce_sum(linear(h, lm_head))`) and its candle-autograd
//! gradient wrt `h`, in f64 and f32, over random shapes, chunk sizes, weights and labels.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use candle_core::{DType, Tensor, Var};
use dflash_conformance::setups::{randn, tensor_from};
use dflash_conformance::tolerance::{rel_error, Tolerance, LM_HEAD_CE_F32, LM_HEAD_CE_F64};
use dflash_optimized::step::lm_head_ce::{lm_head_ce_chunk_bytes, lm_head_ce_forward_backward, LmHeadCe};
use dflash_reference::loss::{weighted_ce_sum, BlockTargets};
use dflash_reference::ops::linear;
use dflash_reference::{Error, Result};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A random case: h `[R, H]` and lm_head `[V, H]` (f64 values exact in f32), targets with zero
/// weights on random rows and on whole random blocks of a random size, and a chunk size.
struct Case {
    h: Tensor,
    lm_head: Tensor,
    targets: BlockTargets,
    chunk_rows: usize,
}

fn random_case(seed: u64) -> Result<Case> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (rows, hidden, vocab) = (rng.random_range(1..40), rng.random_range(1..24), rng.random_range(2..50));
    let f32_exact = |t: Tensor| t.to_dtype(DType::F32)?.to_dtype(DType::F64);
    let h = f32_exact(randn(&[rows, hidden], &mut rng, DType::F64)?)?;
    let lm_head = f32_exact(randn(&[vocab, hidden], &mut rng, DType::F64)?)?;
    let block = rng.random_range(1..=6);
    let dead_blocks: Vec<bool> = (0..rows.div_ceil(block)).map(|_| rng.random_bool(0.25)).collect();
    let weights =
        (0..rows)
            .map(|r| {
                if dead_blocks[r / block] || rng.random_bool(0.25) {
                    0.0
                } else {
                    (-rng.random_range(0.0..3.0f64)).exp()
                }
            })
            .collect();
    let labels = (0..rows).map(|_| rng.random_range(0..vocab as u32)).collect();
    let chunk_rows = rng.random_range(1..rows + 3);
    Ok(Case { h, lm_head, targets: BlockTargets { labels, weights }, chunk_rows })
}

/// The reference in f64: `weighted_ce_sum` of the full logits and its autograd gradient wrt h.
fn reference(h: &Tensor, lm_head: &Tensor, targets: &BlockTargets) -> Result<(f64, Tensor)> {
    let h = Var::from_tensor(h)?;
    let sum = weighted_ce_sum(&linear(h.as_tensor(), lm_head)?, targets)?;
    let dh = sum.backward()?.remove(h.as_tensor()).expect("h is on the path to the loss");
    Ok((sum.to_scalar::<f64>()?, dh))
}

/// The optimized pass with h and lm_head in `dtype`.
fn optimized(case: &Case, dtype: DType, chunk_rows: usize) -> Result<LmHeadCe> {
    lm_head_ce_forward_backward(&case.h.to_dtype(dtype)?, &case.lm_head.to_dtype(dtype)?, &case.targets, chunk_rows)
}

/// `|got - want| / |want|` (`|got|` when `want` is 0).
fn rel_scalar(got: f64, want: f64) -> f64 {
    if want == 0.0 {
        got.abs()
    } else {
        (got - want).abs() / want.abs()
    }
}

/// The worst errors seen over a property's cases, printed at its end (`--no-capture`).
#[derive(Default)]
struct Worst {
    cases: AtomicUsize,
    zero_weight_rows: AtomicUsize,
    sum: AtomicU64,
    dh: AtomicU64,
}

impl Worst {
    fn record(&self, slot: &AtomicU64, err: f64) {
        slot.fetch_max(err.to_bits(), Ordering::Relaxed);
    }

    fn report(&self, what: &str) {
        let get = |slot: &AtomicU64| f64::from_bits(slot.load(Ordering::Relaxed));
        let (cases, zero) = (self.cases.load(Ordering::Relaxed), self.zero_weight_rows.load(Ordering::Relaxed));
        eprintln!(
            "{what}: {cases} cases, {zero} zero-weight rows; worst rel err: sum {:.3e}, dh {:.3e}",
            get(&self.sum),
            get(&self.dh)
        );
        assert!(zero > 0, "{what}: no zero-weight rows drawn");
    }
}

/// Sum and dh in `dtype` match the f64 reference within `tol`, and rows of zero weight get an
/// exactly zero dh.
fn matches_reference(dtype: DType, tol: Tolerance, cases: u32, what: &str) {
    let worst = Worst::default();
    proptest!(ProptestConfig::with_cases(cases), |(seed in any::<u64>())| {
        let case = random_case(seed).expect("random case");
        let (want_sum, want_dh) = reference(&case.h, &case.lm_head, &case.targets).expect("reference");
        let got = optimized(&case, dtype, case.chunk_rows).expect("optimized pass");
        let (sum_err, dh_err) = (rel_scalar(got.weighted_ce_sum, want_sum), rel_error(&got.dh, &want_dh));
        worst.record(&worst.sum, sum_err);
        worst.record(&worst.dh, dh_err);
        worst.cases.fetch_add(1, Ordering::Relaxed);
        prop_assert!(sum_err <= tol.rel, "sum {} vs {want_sum}: rel err {sum_err:.3e} ({})", got.weighted_ce_sum, tol.reason);
        prop_assert!(dh_err <= tol.rel, "dh: rel err {dh_err:.3e} ({})", tol.reason);
        let dh = got.dh.to_dtype(DType::F64).expect("f64").to_vec2::<f64>().expect("dh rows");
        for (r, (row, &w)) in dh.iter().zip(&case.targets.weights).enumerate().filter(|(_, (_, &w))| w == 0.0) {
            worst.zero_weight_rows.fetch_add(1, Ordering::Relaxed);
            prop_assert!(row.iter().all(|&x| x == 0.0), "row {r} of weight {w} has dh {row:?}");
        }
    });
    worst.report(what);
}

#[test]
fn matches_reference_f64() {
    matches_reference(DType::F64, LM_HEAD_CE_F64, 1000, "f64");
}

#[test]
fn matches_reference_f32() {
    matches_reference(DType::F32, LM_HEAD_CE_F32, 1000, "f32");
}

/// One row per chunk and all rows in one chunk agree to rounding.
fn chunk_size_does_not_matter(dtype: DType, tol: Tolerance, cases: u32, what: &str) {
    let worst = Worst::default();
    proptest!(ProptestConfig::with_cases(cases), |(seed in any::<u64>())| {
        let case = random_case(seed).expect("random case");
        let rows = case.targets.labels.len();
        let one = optimized(&case, dtype, 1).expect("chunks of one row");
        let all = optimized(&case, dtype, rows).expect("one chunk");
        let (sum_err, dh_err) = (rel_scalar(one.weighted_ce_sum, all.weighted_ce_sum), rel_error(&one.dh, &all.dh));
        worst.record(&worst.sum, sum_err);
        worst.record(&worst.dh, dh_err);
        worst.cases.fetch_add(1, Ordering::Relaxed);
        worst.zero_weight_rows.fetch_add(case.targets.weights.iter().filter(|&&w| w == 0.0).count(), Ordering::Relaxed);
        prop_assert!(sum_err <= tol.rel, "sum: chunk 1 vs {rows}: rel err {sum_err:.3e}");
        prop_assert!(dh_err <= tol.rel, "dh: chunk 1 vs {rows}: rel err {dh_err:.3e}");
    });
    worst.report(what);
}

#[test]
fn chunk_size_does_not_matter_f64() {
    chunk_size_does_not_matter(DType::F64, LM_HEAD_CE_F64, 500, "f64 chunk 1 vs R");
}

#[test]
fn chunk_size_does_not_matter_f32() {
    chunk_size_does_not_matter(DType::F32, LM_HEAD_CE_F32, 500, "f32 chunk 1 vs R");
}

/// Rows of zero weight are never read: NaN in them changes nothing, and all-zero weights give a
/// zero sum and an exactly zero dh.
#[test]
fn zero_weight_rows_are_skipped() -> Result<()> {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let (rows, hidden, vocab) = (12, 5, 9);
    let lm_head = randn(&[vocab, hidden], &mut rng, DType::F64)?;
    let labels: Vec<u32> = (0..rows).map(|_| rng.random_range(0..vocab as u32)).collect();
    let weights: Vec<f64> = (0..rows).map(|r| if r % 3 == 0 { 0.0 } else { 0.5 }).collect();
    let clean = randn(&[rows, hidden], &mut rng, DType::F64)?.to_vec2::<f64>()?;
    let poisoned: Vec<f64> = clean
        .iter()
        .zip(&weights)
        .flat_map(|(row, &w)| row.iter().map(move |&x| if w == 0.0 { f64::NAN } else { x }))
        .collect();
    let clean = tensor_from(clean.concat(), &[rows, hidden], DType::F64)?;
    let poisoned = tensor_from(poisoned, &[rows, hidden], DType::F64)?;
    let targets = BlockTargets { labels: labels.clone(), weights };
    for chunk_rows in [1, 2, 5, rows] {
        let want = lm_head_ce_forward_backward(&clean, &lm_head, &targets, chunk_rows)?;
        let got = lm_head_ce_forward_backward(&poisoned, &lm_head, &targets, chunk_rows)?;
        assert_eq!(got.weighted_ce_sum, want.weighted_ce_sum, "chunk {chunk_rows}: sum");
        assert_eq!(got.dh.to_vec2::<f64>()?, want.dh.to_vec2::<f64>()?, "chunk {chunk_rows}: dh");
    }

    let zero = BlockTargets { labels, weights: vec![0.0; rows] };
    for dtype in [DType::F64, DType::F32] {
        let got = lm_head_ce_forward_backward(&clean.to_dtype(dtype)?, &lm_head.to_dtype(dtype)?, &zero, 4)?;
        assert_eq!(got.weighted_ce_sum, 0.0, "{dtype:?}: all-zero weights");
        assert_eq!(got.dh.dims(), &[rows, hidden]);
        assert_eq!(got.dh.dtype(), dtype);
        let dh = got.dh.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        assert!(dh.iter().all(|&x| x == 0.0), "{dtype:?}: dh {dh:?} of all-zero weights");
    }
    Ok(())
}

/// Bad inputs are refused, naming the argument at fault.
#[test]
fn bad_inputs_name_the_argument() -> Result<()> {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let h = randn(&[3, 4], &mut rng, DType::F32)?;
    let lm_head = randn(&[6, 4], &mut rng, DType::F32)?;
    let targets = BlockTargets { labels: vec![0, 5, 2], weights: vec![0.0, 1.0, 0.5] };
    let expect_invalid = |what: &str, got: Result<LmHeadCe>, case: &str| match got {
        Err(Error::Invalid { what: w, message }) => {
            assert_eq!(w, what, "{case}: wrong argument named ({message})");
        }
        Err(e) => panic!("{case}: expected an invalid `{what}`, got {e}"),
        Ok(_) => panic!("{case}: accepted"),
    };
    let vocab_label = BlockTargets { labels: vec![0, 6, 2], ..targets.clone() };
    expect_invalid("targets", lm_head_ce_forward_backward(&h, &lm_head, &vocab_label, 2), "label = V");
    // A zero-weight row's label is checked too, as the reference's gather does.
    let zero_weight_label = BlockTargets { labels: vec![99, 0, 2], ..targets.clone() };
    expect_invalid("targets", lm_head_ce_forward_backward(&h, &lm_head, &zero_weight_label, 2), "label > V, weight 0");
    let short = BlockTargets { labels: vec![0, 1], weights: vec![1.0, 1.0] };
    expect_invalid("targets", lm_head_ce_forward_backward(&h, &lm_head, &short, 2), "2 targets for 3 rows");
    expect_invalid("chunk_rows", lm_head_ce_forward_backward(&h, &lm_head, &targets, 0), "chunk_rows 0");
    expect_invalid("h", lm_head_ce_forward_backward(&h.flatten_all()?, &lm_head, &targets, 2), "h of rank 1");
    let narrow = randn(&[6, 3], &mut rng, DType::F32)?;
    expect_invalid("lm_head", lm_head_ce_forward_backward(&h, &narrow, &targets, 2), "lm_head hidden 3 vs 4");
    let f64_head = lm_head.to_dtype(DType::F64)?;
    expect_invalid("lm_head", lm_head_ce_forward_backward(&h, &f64_head, &targets, 2), "lm_head f64, h f32");
    let bf16 = (h.to_dtype(DType::BF16)?, lm_head.to_dtype(DType::BF16)?);
    expect_invalid("h", lm_head_ce_forward_backward(&bf16.0, &bf16.1, &targets, 2), "bf16");
    Ok(())
}

/// The planner's chunk buffer: one `[chunk, V]` logits buffer, overwritten by dz.
#[test]
fn chunk_bytes() {
    assert_eq!(lm_head_ce_chunk_bytes(1024, 151_936, DType::BF16), 1024 * 151_936 * 2);
    assert_eq!(lm_head_ce_chunk_bytes(3, 10, DType::F32), 120);
    assert_eq!(lm_head_ce_chunk_bytes(3, 10, DType::F64), 240);
}
