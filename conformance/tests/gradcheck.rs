//! Gradient checks of the reference (spec sections 1-3): every autograd gradient against central
//! finite differences in f64, for every trainable parameter of random tiny drafters, for the dense
//! attention itself, and the NaN-freedom of rows whose blocks all have `keep = false`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use candle_core::{DType, Device, Tensor, Var};
use dflash_conformance::setups::{randn, random_draft_case, DraftCase};
use dflash_conformance::tolerance::{assert_close, rel_error, FD_F64, ORACLE_F64};
use dflash_reference::attention::dense_attention;
use dflash_reference::drafter::DraftInput;
use dflash_reference::loss::{decayed_ce, BlockTargets};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The finite-difference step. Losses here are O(1..10) and gradients O(1e-3..1) in f64.
/// Central differences err by truncation `h^2/6 * |f'''|` ~ 2e-11 (for O(1) third derivatives)
/// plus rounding `~|L| * 1e-15 / h` ~ 1e-10 (a forward pass of a few hundred f64 ops rounds its
/// loss by about 1e-15 relative); both are 4+ orders of magnitude below the 1e-6 bound of
/// `FD_F64`. A step of 1e-6 would trade truncation (2e-13) for rounding (1e-9); 1e-5 balances
/// the two near the optimum `(eps_f64)^(1/3)` ~ 6e-6 while keeping rounding well clear of 1e-6.
/// The difference quotient divides by the step actually taken, `(x+h) - (x-h)` after rounding.
static FD_STEP: std::sync::LazyLock<f64> =
    std::sync::LazyLock::new(|| std::env::var("FDH").map(|v| v.parse().unwrap()).unwrap_or(1e-5));

static EVALS: AtomicUsize = AtomicUsize::new(0);
fn cpu() -> Device {
    Device::Cpu
}

fn to_vec(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1::<f64>()).expect("tensor to f64 vec")
}

/// Central differences of `loss()` w.r.t. every element of `var`; `var` is restored afterwards.
fn fd_gradient(var: &Var, mut loss: impl FnMut() -> f64) -> Tensor {
    let shape = var.as_tensor().dims().to_vec();
    let dtype = var.as_tensor().dtype();
    let orig = to_vec(var.as_tensor());
    let set = |vals: &[f64]| {
        let t = Tensor::from_slice(vals, shape.as_slice(), &cpu())
            .and_then(|t| t.to_dtype(dtype))
            .expect("perturbed tensor");
        var.set(&t).expect("Var::set");
    };
    let mut vals = orig.clone();
    let mut fd = Vec::with_capacity(orig.len());
    let h0 = *FD_STEP;
    for i in 0..orig.len() {
        let mut at = |step: f64| {
            vals[i] = orig[i] + step;
            set(&vals);
            loss()
        };
        const NTAB: usize = 8;
        const CON: f64 = 1.6;
        let mut a = [[0.0f64; NTAB]; NTAB];
        let mut hh = h0;
        a[0][0] = (at(hh) - at(-hh)) / (2.0 * hh);
        let mut err = f64::INFINITY;
        let mut ans = a[0][0];
        for k in 1..NTAB {
            hh /= CON;
            a[0][k] = (at(hh) - at(-hh)) / (2.0 * hh);
            let mut fac = CON * CON;
            for j in 1..=k {
                a[j][k] = (a[j - 1][k] * fac - a[j - 1][k - 1]) / (fac - 1.0);
                fac *= CON * CON;
                let errt = (a[j][k] - a[j - 1][k]).abs().max((a[j][k] - a[j - 1][k - 1]).abs());
                if errt <= err {
                    err = errt;
                    ans = a[j][k];
                }
            }
            if (a[k][k] - a[k - 1][k - 1]).abs() >= 2.0 * err {
                break;
            }
        }
        EVALS.fetch_add(1, Ordering::Relaxed);
        vals[i] = orig[i];
        fd.push(ans);
    }
    set(&orig);
    Tensor::from_vec(fd, shape.as_slice(), &cpu()).expect("fd tensor")
}

/// The training input and targets of a case, as the trainer builds them.
fn input_and_targets(case: &DraftCase) -> (DraftInput, BlockTargets) {
    let b = case.drafter.config.block_size;
    let input = DraftInput::training(&case.row, &case.anchors, b).expect("training input");
    let targets = BlockTargets::new(&case.row.tokens, &case.row.loss_mask, &case.anchors, b, case.gamma);
    (input, targets)
}

fn loss_tensor(case: &DraftCase, input: &DraftInput, targets: &BlockTargets) -> Tensor {
    let logits = case.drafter.forward(&case.head, input).expect("forward");
    decayed_ce(&logits, targets).expect("decayed_ce")
}

fn scalar(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64).and_then(|t| t.to_scalar::<f64>()).expect("scalar")
}

/// Largest relative error seen by a test, as f64 bits (for the run's summary line).
fn record_max(cell: &AtomicU64, err: f64) {
    let mut cur = cell.load(Ordering::Relaxed);
    while err > f64::from_bits(cur) {
        match cell.compare_exchange(cur, err.to_bits(), Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => break,
            Err(now) => cur = now,
        }
    }
}

/// Proves that the reference autograd gradient of the decayed CE loss w.r.t. EVERY trainable
/// parameter tensor (fc, hidden_norm, every layer's projections and norms, final norm) equals
/// central finite differences over all of its elements, in f64, within `FD_F64`, on random
/// tiny drafters (GQA, full and sliding layers, packed documents with padding, keep flags).
/// Cases whose loss carries no weight are skipped, and the run asserts they stay a minority.
#[test]
fn every_parameter_gradient_matches_finite_differences() {
    let checked = AtomicUsize::new(0);
    let weightless = AtomicUsize::new(0);
    let worst = AtomicU64::new(0f64.to_bits());
    proptest!(ProptestConfig::with_cases(300), |(seed in any::<u64>())| {
        let case = random_draft_case(seed, DType::F64).expect("random case");
        let (input, targets) = input_and_targets(&case);
        if targets.total_weight() == 0.0 {
            weightless.fetch_add(1, Ordering::Relaxed);
        }
        prop_assume!(targets.total_weight() > 0.0);
        let loss = loss_tensor(&case, &input, &targets);
        let l0 = scalar(&loss);
        prop_assert!(l0.is_finite() && l0 > 0.0, "loss {l0} of seed {seed}");
        let grads = loss.backward().expect("backward");
        for (name, var) in case.drafter.named_params() {
            let analytic = match grads.get(var.as_tensor()) {
                Some(g) => g.clone(),
                None => var.as_tensor().zeros_like().expect("zeros"),
            };
            let fd = fd_gradient(var, || scalar(&loss_tensor(&case, &input, &targets)));
            let e = rel_error(&analytic, &fd);
            if e > 1e-12 { let n = to_vec(&fd).iter().map(|x| x*x).sum::<f64>().sqrt(); eprintln!("DBG seed {seed} {name} err {e:.3e} fdnorm {n:.3e} loss {l0:.3e} dims {:?}", case.drafter.config.dims); }
            record_max(&worst, e);
            assert_close(&format!("seed {seed}: d loss / d {name}"), &analytic, &fd, FD_F64);
        }
        // Every perturbation was undone: the loss is bit-for-bit the original one.
        prop_assert_eq!(scalar(&loss_tensor(&case, &input, &targets)).to_bits(), l0.to_bits());
        checked.fetch_add(1, Ordering::Relaxed);
    });
    let (checked, weightless) = (checked.into_inner(), weightless.into_inner());
    eprintln!(
        "drafter gradcheck: {checked} cases checked, {weightless} weightless skipped, \
         worst relative error {:.3e}",
        f64::from_bits(worst.into_inner())
    );
    assert!(
        weightless * 4 <= checked,
        "{weightless} weightless cases for {checked} checked: the gradient check is mostly vacuous"
    );
}

/// A random attention problem: shapes with GQA, a mask with at least one row that sees nothing
/// and at least one row that sees something, q/k/v as f64 variables, and a random cotangent.
struct AttnCase {
    q: Var,
    k: Var,
    v: Var,
    mask: Vec<bool>,
    cotangent: Tensor,
    nq: usize,
    nk: usize,
    group: usize,
}

fn random_attn_case(seed: u64) -> AttnCase {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let nq = rng.random_range(2..=6);
    let nk = rng.random_range(1..=7);
    let nkv = rng.random_range(1..=3);
    let group = rng.random_range(1..=3);
    let d = rng.random_range(1..=4);
    let nh = nkv * group;
    let density = rng.random_range(0.2..0.9);
    let mut mask: Vec<bool> = (0..nq * nk).map(|_| rng.random_bool(density)).collect();
    let blind = rng.random_range(0..nq);
    let sighted = (blind + rng.random_range(1..nq)) % nq;
    mask[blind * nk..(blind + 1) * nk].fill(false);
    let k_seen = rng.random_range(0..nk);
    mask[sighted * nk + k_seen] = true;
    let var = |shape: &[usize], rng: &mut ChaCha8Rng| {
        Var::from_tensor(&randn(shape, rng, DType::F64).expect("randn")).expect("var")
    };
    let q = var(&[nq, nh, d], &mut rng);
    let k = var(&[nk, nkv, d], &mut rng);
    let v = var(&[nk, nkv, d], &mut rng);
    let cotangent = randn(&[nq, nh, d], &mut rng, DType::F64).expect("randn");
    AttnCase { q, k, v, mask, cotangent, nq, nk, group }
}

/// `sum(out * cotangent)`: a random linear functional of the attention output.
fn attn_functional(c: &AttnCase) -> Tensor {
    let out = dense_attention(c.q.as_tensor(), c.k.as_tensor(), c.v.as_tensor(), &c.mask).expect("dense_attention");
    (out * &c.cotangent).and_then(|t| t.sum_all()).expect("functional")
}

/// Softmax attention computed by plain loops, head `h` reading K/V head `h / group`.
fn naive_attention(c: &AttnCase) -> Vec<f64> {
    let (q, k, v) = (to_vec(c.q.as_tensor()), to_vec(c.k.as_tensor()), to_vec(c.v.as_tensor()));
    let (_, nh, d) = c.q.as_tensor().dims3().expect("q dims");
    let nkv = nh / c.group;
    let mut out = vec![0.0; c.nq * nh * d];
    for i in 0..c.nq {
        let seen: Vec<usize> = (0..c.nk).filter(|&j| c.mask[i * c.nk + j]).collect();
        if seen.is_empty() {
            continue;
        }
        for h in 0..nh {
            let g = h / c.group;
            let qi = &q[(i * nh + h) * d..][..d];
            let scores: Vec<f64> = seen
                .iter()
                .map(|&j| {
                    let kj = &k[(j * nkv + g) * d..][..d];
                    qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let z: f64 = e.iter().sum();
            for (&j, ej) in seen.iter().zip(&e) {
                let vj = &v[(j * nkv + g) * d..][..d];
                for x in 0..d {
                    out[(i * nh + h) * d + x] += ej / z * vj[x];
                }
            }
        }
    }
    out
}

/// Proves `dense_attention`'s gradients w.r.t. q, k and v equal central finite differences of a
/// random linear functional of its output (f64, `FD_F64`) for random GQA shapes and random masks,
/// that its output matches plain-loop softmax attention with head `h` reading K/V head
/// `h / (nh/nkv)`, that rows which see nothing output exactly 0 and get exactly zero gradient,
/// and that keys no query sees get exactly zero k and v gradients.
#[test]
fn dense_attention_gradients_match_finite_differences() {
    let worst = AtomicU64::new(0f64.to_bits());
    proptest!(ProptestConfig::with_cases(96), |(seed in any::<u64>())| {
        let c = random_attn_case(seed);
        let out = dense_attention(c.q.as_tensor(), c.k.as_tensor(), c.v.as_tensor(), &c.mask)
            .expect("dense_attention");
        let (nq, nk) = (c.nq, c.nk);
        let naive = Tensor::from_vec(naive_attention(&c), out.dims(), &cpu()).expect("naive");
        assert_close(&format!("seed {seed}: attention output"), &out, &naive, ORACLE_F64);

        let f = attn_functional(&c);
        let grads = f.backward().expect("backward");
        let grad = |var: &Var| {
            grads
                .get(var.as_tensor())
                .cloned()
                .unwrap_or_else(|| var.as_tensor().zeros_like().expect("zeros"))
        };
        let (gq, gk, gv) = (grad(&c.q), grad(&c.k), grad(&c.v));
        let out_rows = to_vec(&out);
        let gq_rows = to_vec(&gq);
        let row_len = out_rows.len() / nq;
        for i in 0..nq {
            if c.mask[i * nk..(i + 1) * nk].iter().any(|&m| m) {
                continue;
            }
            let row = &out_rows[i * row_len..(i + 1) * row_len];
            prop_assert!(row.iter().all(|&x| x == 0.0), "seed {seed}: blind row {i} outputs {row:?}");
            let g = &gq_rows[i * row_len..(i + 1) * row_len];
            prop_assert!(g.iter().all(|&x| x == 0.0), "seed {seed}: blind row {i} has dq {g:?}");
        }
        let (gk_rows, gv_rows) = (to_vec(&gk), to_vec(&gv));
        let key_len = gk_rows.len() / nk;
        for j in 0..nk {
            if (0..nq).any(|i| c.mask[i * nk + j]) {
                continue;
            }
            let (dk, dv) = (&gk_rows[j * key_len..][..key_len], &gv_rows[j * key_len..][..key_len]);
            prop_assert!(
                dk.iter().chain(dv).all(|&x| x == 0.0),
                "seed {seed}: unseen key {j} has dk {dk:?}, dv {dv:?}"
            );
        }
        for (name, var, analytic) in [("q", &c.q, &gq), ("k", &c.k, &gk), ("v", &c.v, &gv)] {
            let fd = fd_gradient(var, || scalar(&attn_functional(&c)));
            record_max(&worst, rel_error(analytic, &fd));
            assert_close(&format!("seed {seed}: d f / d {name}"), analytic, &fd, FD_F64);
        }
    });
    eprintln!("dense attention gradcheck: worst relative error {:.3e}", f64::from_bits(worst.into_inner()));
}

/// Proves that a row whose blocks all have `keep = false` is harmless: the decayed CE loss is
/// exactly 0 (finite, no 0/0) and its backward is NaN-free; and that even a random functional of
/// the logits (which do flow back through the blind attention rows) has finite gradients for
/// every parameter, with exactly zero gradient for everything that only reaches the output
/// through attention (fc, hidden_norm, input_layernorm, every self_attn weight): no block sees
/// any key, so no information can leak through them.
#[test]
fn row_without_kept_blocks_is_finite_and_nan_free() {
    proptest!(ProptestConfig::with_cases(32), |(seed in any::<u64>())| {
        let mut case = random_draft_case(seed, DType::F64).expect("random case");
        case.anchors.keep.fill(false);
        let (input, targets) = input_and_targets(&case);
        prop_assert_eq!(targets.total_weight(), 0.0);
        let loss = loss_tensor(&case, &input, &targets);
        prop_assert_eq!(scalar(&loss), 0.0, "seed {}", seed);
        let grads = loss.backward().expect("loss backward");
        for (name, var) in case.drafter.named_params() {
            if let Some(g) = grads.get(var.as_tensor()) {
                prop_assert!(to_vec(g).iter().all(|x| x.is_finite()), "seed {seed}: {name}");
            }
        }

        let logits = case.drafter.forward(&case.head, &input).expect("forward");
        prop_assert!(to_vec(&logits).iter().all(|x| x.is_finite()), "seed {seed}: logits");
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
        let cotangent = randn(logits.dims(), &mut rng, DType::F64).expect("randn");
        let f = (logits * cotangent).and_then(|t| t.sum_all()).expect("functional");
        let grads = f.backward().expect("functional backward");
        let mut nonzero = 0;
        for (name, var) in case.drafter.named_params() {
            let g = grads.get(var.as_tensor()).map(to_vec).unwrap_or_default();
            prop_assert!(g.iter().all(|x| x.is_finite()), "seed {seed}: NaN in d f / d {name}");
            let attention_only = name.starts_with("fc.")
                || name.starts_with("hidden_norm.")
                || name.contains("input_layernorm")
                || name.contains("self_attn.");
            if attention_only {
                prop_assert!(g.iter().all(|&x| x == 0.0), "seed {seed}: {name} gets {g:?}");
            } else if g.iter().any(|&x| x != 0.0) {
                nonzero += 1;
            }
        }
        // The MLPs and final norm still carry gradient: the functional is not vacuous.
        prop_assert!(nonzero > 0, "seed {seed}: no parameter got any gradient");
    });
}
