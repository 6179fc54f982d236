//! The one set of CPU twins of the step's ops (`dflash_optimized::ops::*::twin`, on tensors
//! through `dflash_conformance::twin_tensors`) against the reference ops of
//! `dflash_reference::ops`: each forward equals the reference forward, and each backward equals
//! candle autograd through the reference op of the functional `sum(y * dy)` for a random upstream
//! gradient `dy`, in f64 (`Host<f64>`) and in f32 (`Host<f32>`), over random shapes and inputs.
//! The CUDA kernels are checked against these twins on the H200 (`xtask gpu-conformance`).

use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Tensor, Var, D};
use dflash_conformance::setups::randn;
use dflash_conformance::tolerance::{rel_error, Tolerance, STEP_OP_F32, STEP_OP_F64};
use dflash_conformance::twin_tensors::{
    argmax_rows, ce_grad_rows, head_norm_rope_backward, head_norm_rope_forward, linear_backward, linear_forward,
    rms_norm_backward, rms_norm_forward, rope_forward, swiglu_backward, swiglu_forward,
};
use dflash_optimized::Result;
use dflash_reference::loss::{decayed_ce, BlockTargets};
use dflash_reference::ops::{self, rope_tables};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Cases per op; each is a handful of tiny tensors in two dtypes.
const CASES: u32 = 4096;

/// Compared quantities, in the order of `Worst`.
const QUANTITIES: [&str; 4] = ["f64 forward", "f64 grads", "f32 forward", "f32 grads"];
/// Largest error seen per quantity, as f64 bits (non-negative f64s order like their bits).
type Worst = [AtomicU64; 4];

fn report(what: &str, worst: &Worst) {
    let errs: Vec<String> = QUANTITIES
        .iter()
        .zip(worst)
        .map(|(n, w)| format!("{n} {:.2e}", f64::from_bits(w.load(Ordering::Relaxed))))
        .collect();
    eprintln!("{what} worst: {}", errs.join(", "));
}

/// `f64` values of a standard normal (never zero) `[shape]` tensor times `gain`.
fn normal(shape: &[usize], gain: f64, rng: &mut ChaCha8Rng) -> Tensor {
    randn(shape, rng, DType::F64).and_then(|t| Ok(t.affine(gain, 0.0)?)).expect("randn")
}

/// The reference op, taking the differentiable inputs (any other input is captured).
type Reference<'a> = &'a dyn Fn(&[Tensor]) -> dflash_reference::Result<Tensor>;
/// The manual pair: `(y, [d input])` from the inputs and `dy`.
type Manual<'a> = &'a dyn Fn(&[Tensor], &Tensor) -> Result<(Tensor, Vec<Tensor>)>;

/// `y = reference(inputs)` and the autograd gradients of `sum(y * dy)` w.r.t. every input.
fn autograd(inputs: &[Tensor], dy: &Tensor, reference: Reference) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t).expect("var")).collect();
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = reference(&tensors).expect("reference forward");
    let grads = (&y * dy).and_then(|f| f.sum_all()).and_then(|f| f.backward()).expect("backward");
    let grads = vars
        .iter()
        .map(|v| grads.get(v.as_tensor()).cloned().unwrap_or_else(|| v.as_tensor().zeros_like().expect("zeros")))
        .collect();
    (y.detach(), grads)
}

/// For gradients that sum terms which can cancel to far below their size: from the inputs and
/// `dy` in f64, per gradient the sum of its terms' absolute values, which its error is divided
/// by instead of its own norm (`None`: its own norm).
type Terms<'a> = &'a dyn Fn(&[Tensor], &Tensor) -> Result<Vec<Option<Tensor>>>;

/// One op under test on one random case.
struct OpCase<'a> {
    label: String,
    /// The differentiable inputs' names, in the order of `inputs` and of the gradients.
    names: &'a [&'a str],
    /// The differentiable inputs and the upstream gradient, f64 values.
    inputs: Vec<Tensor>,
    dy: Tensor,
    reference: Reference<'a>,
    manual: Manual<'a>,
    terms: Option<Terms<'a>>,
    /// For a forward that sums signed terms: the sum of their absolute values, which its error
    /// is divided by (`None`: its own norm).
    forward_terms: Option<Reference<'a>>,
}

fn norm(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64).and_then(|t| t.sqr()?.sum_all()?.to_scalar::<f64>()).expect("norm").sqrt()
}

/// `||got - want|| / ||scale||` in f64 (`rel_error` when `scale` is `None` or zero); infinite
/// when anything is not finite, so that NaN never passes.
fn error_over(got: &Tensor, want: &Tensor, scale: Option<&Tensor>) -> f64 {
    let plain = rel_error(got, want);
    let Some(scale) = scale else { return plain };
    let diff = (got.to_dtype(DType::F64).expect("got") - want.to_dtype(DType::F64).expect("want")).expect("diff");
    let (diff, scale) = (norm(&diff), norm(scale));
    if !plain.is_finite() || !scale.is_finite() {
        f64::INFINITY
    } else if scale == 0.0 {
        plain
    } else {
        diff / scale
    }
}

/// Runs the op on the case in f64 and, rounded, in f32; asserts the manual forward equal to the
/// reference forward and each manual gradient equal to autograd's in the same dtype (its error
/// divided as `terms` says), within `STEP_OP_F64` / `STEP_OP_F32`.
fn check_op(case: &OpCase, worst: &Worst) {
    let label = &case.label;
    let check = |i: usize, what: &str, err: f64, tol: Tolerance| {
        worst[i].fetch_max(err.to_bits(), Ordering::Relaxed);
        assert!(err <= tol.rel, "{label}: {what}: relative error {err:.3e} above {:.0e} ({})", tol.rel, tol.reason);
    };
    let widen = |t: &Tensor| t.to_dtype(DType::F64).expect("to f64");
    for (dtype, tol, base) in [(DType::F64, STEP_OP_F64, 0), (DType::F32, STEP_OP_F32, 2)] {
        let cast = |t: &Tensor| t.to_dtype(dtype).expect("to dtype");
        let (xs, dy): (Vec<Tensor>, Tensor) = (case.inputs.iter().map(cast).collect(), cast(&case.dy));
        let (want_y, want_grads) = autograd(&xs, &dy, case.reference);
        let (y, grads) = (case.manual)(&xs, &dy).expect("manual op");
        let terms = match case.terms {
            Some(terms) => terms(&xs.iter().map(widen).collect::<Vec<_>>(), &widen(&dy)).expect("terms"),
            None => vec![None; grads.len()],
        };
        assert_eq!(y.dims(), want_y.dims(), "{label}: {dtype:?} forward: shapes differ");
        assert_eq!(y.dtype(), dtype, "{label}: forward dtype");
        let forward_scale = case.forward_terms.map(|f| f(&xs.iter().map(widen).collect::<Vec<_>>()).expect("terms"));
        check(base, &format!("{dtype:?} forward"), error_over(&y, &want_y, forward_scale.as_ref()), tol);
        assert_eq!(grads.len(), case.names.len(), "{label}: gradient count");
        for (((name, got), want), scale) in case.names.iter().zip(&grads).zip(&want_grads).zip(&terms) {
            assert_eq!(got.dims(), want.dims(), "{label}: {dtype:?} d{name}: shapes differ");
            assert_eq!(got.dtype(), dtype, "{label}: d{name} dtype");
            check(base + 1, &format!("{dtype:?} d{name}"), error_over(got, want, scale.as_ref()), tol);
        }
    }
}

/// Proves the matmul twin's linear equals `reference::ops::linear` and its input and weight
/// gradients equal autograd (errors of sums that can cancel divided by their terms), over rows
/// 1..=20 and in/out dims 1..=24.
#[test]
fn linear_matches_reference_autograd() {
    let worst = Worst::default();
    let shapes = (1usize..=20, 1usize..=24, 1usize..=24);
    proptest!(ProptestConfig::with_cases(CASES), |((rows, din, dout) in shapes, seed in any::<u64>())| {
        check_linear(rows, din, dout, seed, &worst);
    });
    report("linear", &worst);
}

fn check_linear(rows: usize, din: usize, dout: usize, seed: u64, worst: &Worst) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let x = normal(&[rows, din], 1.0, &mut rng);
    let w = normal(&[dout, din], rng.random_range(0.1..2.0), &mut rng);
    let dy = normal(&[rows, dout], 1.0, &mut rng);
    check_op(
        &OpCase {
            label: format!("linear rows={rows} in={din} out={dout} seed={seed}"),
            names: &["x", "w"],
            inputs: vec![x, w],
            dy,
            reference: &|t| ops::linear(&t[0], &t[1]),
            manual: &|t, dy| {
                let (dx, dw) = linear_backward(dy, &t[0], &t[1])?;
                Ok((linear_forward(&t[0], &t[1])?, vec![dx, dw]))
            },
            // The twin sums in its own order; `dw` sums signed terms over the rows (and `dx` over
            // the outputs), which can cancel: their errors are divided by `|dy| |w|`, `|dy|^T |x|`.
            terms: Some(&|t, dy| {
                let (x, w) = (&t[0], &t[1]);
                Ok(vec![Some(dy.abs()?.matmul(&w.abs()?)?), Some(dy.abs()?.t()?.matmul(&x.abs()?)?)])
            }),
            forward_terms: Some(&|t| ops::linear(&t[0].abs()?, &t[1].abs()?)),
        },
        worst,
    );
}

/// Proves the RMSNorm twin equals `reference::ops::rms_norm` (and its `inv_rms` equals
/// `1/sqrt(mean(x^2)+eps)` by plain loops) and `rms_norm_backward`'s `dx`, `dw` equal autograd,
/// for x `[rows, n]` and `[rows, heads, n]` (the per-head q/k norms), n 1..=24, input scales
/// from 1e-3 (where eps matters) to 10, eps 1e-6 or 1e-5. `dx = r (g - x r^2 mean(g x))` is
/// nearly the part of `g` orthogonal to `x`: it cancels to `eps / (mean(x^2) + eps)` of its terms
/// for n = 1 and to `sin(g, x)` of them for n = 2, and `dw` sums signed terms over the rows, so
/// their errors are divided by their terms `|g| r + |x| r^3 mean(|g x|)` and `sum |dy x| r`.
#[test]
fn rms_norm_matches_reference_autograd() {
    let worst = Worst::default();
    let shapes = (1usize..=20, proptest::option::of(1usize..=4), 1usize..=24, prop::sample::select(vec![1e-6, 1e-5]));
    proptest!(ProptestConfig::with_cases(CASES), |((rows, heads, n, eps) in shapes, seed in any::<u64>())| {
        check_rms_norm(rows, heads, n, eps, seed, &worst);
    });
    report("rms_norm", &worst);
}

fn check_rms_norm(rows: usize, heads: Option<usize>, n: usize, eps: f64, seed: u64, worst: &Worst) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let shape: Vec<usize> = [Some(rows), heads, Some(n)].into_iter().flatten().collect();
    let x = normal(&shape, 10f64.powf(rng.random_range(-3.0..1.0)), &mut rng);
    let w = normal(&[n], 1.0, &mut rng);
    let dy = normal(&shape, 1.0, &mut rng);
    let label = format!("rms_norm x={shape:?} eps={eps} seed={seed}");
    check_op(
        &OpCase {
            label: label.clone(),
            names: &["x", "w"],
            inputs: vec![x, w],
            dy,
            reference: &|t| ops::rms_norm(&t[0], &t[1], eps),
            manual: &|t, dy| {
                let (y, inv_rms) = rms_norm_forward(&t[0], &t[1], eps)?;
                check_inv_rms(&label, &t[0], &inv_rms, eps);
                let (dx, dw) = rms_norm_backward(dy, &t[0], &t[1], &inv_rms)?;
                Ok((y, vec![dx, dw]))
            },
            terms: Some(&|t, dy| rms_norm_terms(&t[0], &t[1], dy, eps)),
            forward_terms: None,
        },
        worst,
    );
}

/// The sums of the absolute terms of RMSNorm's `dx` and `dw` for output gradient `dy`:
/// `|g| r + |x| r^3 mean(|g x|)` with `g = dy w`, and `sum |dy x| r`.
fn rms_norm_terms(x: &Tensor, w: &Tensor, dy: &Tensor, eps: f64) -> Result<Vec<Option<Tensor>>> {
    let r = x.sqr()?.mean_keepdim(D::Minus1)?.affine(1.0, eps)?.sqrt()?.recip()?;
    let g = dy.broadcast_mul(w)?.abs()?;
    let gx = (&g * x.abs()?)?.mean_keepdim(D::Minus1)?;
    let dx_terms = (g.broadcast_mul(&r)? + x.abs()?.broadcast_mul(&(r.powf(3.0)? * gx)?)?)?;
    let dw_terms = (dy.abs()? * x.abs()?.broadcast_mul(&r)?)?.flatten_to(x.rank() - 2)?.sum(0)?;
    Ok(vec![Some(dx_terms), Some(dw_terms)])
}

/// `inv_rms` has shape `[.., 1]` and equals `1/sqrt(mean(x^2)+eps)` computed by plain loops in
/// f64 from the same values, within `STEP_OP_F64` (f64) or `STEP_OP_F32` (f32).
fn check_inv_rms(label: &str, x: &Tensor, inv_rms: &Tensor, eps: f64) {
    let mut dims = x.dims().to_vec();
    let n = dims.pop().expect("rank >= 1");
    assert_eq!(inv_rms.dims(), [dims.as_slice(), &[1]].concat(), "{label}: inv_rms shape");
    let values = x.to_dtype(DType::F64).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1::<f64>()).expect("x");
    let want: Vec<f64> =
        values.chunks(n).map(|r| 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / n as f64 + eps).sqrt()).collect();
    let want = Tensor::from_vec(want, inv_rms.dims(), x.device()).expect("want");
    let tol = if x.dtype() == DType::F64 { STEP_OP_F64 } else { STEP_OP_F32 };
    let err = rel_error(inv_rms, &want);
    assert!(err <= tol.rel, "{label}: {:?} inv_rms: relative error {err:.3e} above {:.0e}", x.dtype(), tol.rel);
}

/// Proves the fused head norm + RoPE twin equals `reference::ops::rope(rms_norm(x, w))` and its
/// backward equals autograd through both, for x `[T, heads, d]`, T 1..=20, heads 1..=4, d even
/// 2..=16, random positions below 8192 (repeated ones too), theta 1e4 or 1e6, input scales 1e-3
/// to 10. RoPE is a rotation, so the norm's cancellation terms are those of RMSNorm with the
/// rotated-back gradient `g = R^T dy` (from autograd of the rope alone).
#[test]
fn head_norm_rope_matches_reference_autograd() {
    let worst = Worst::default();
    let shapes = (1usize..=20, 1usize..=4, 1usize..=8, prop::sample::select(vec![1e4, 1e6]));
    proptest!(ProptestConfig::with_cases(CASES), |((t, heads, half, theta) in shapes, seed in any::<u64>())| {
        check_head_norm_rope(t, heads, half, theta, seed, &worst);
    });
    report("head_norm_rope", &worst);
}

fn check_head_norm_rope(t: usize, heads: usize, half: usize, theta: f64, seed: u64, worst: &Worst) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (d, eps) = (2 * half, 1e-6);
    let positions: Vec<usize> = (0..t).map(|_| rng.random_range(0..8192)).collect();
    let x = normal(&[t, heads, d], 10f64.powf(rng.random_range(-3.0..1.0)), &mut rng);
    let w = normal(&[d], 1.0, &mut rng);
    let dy = normal(&[t, heads, d], 1.0, &mut rng);
    let label = format!("head_norm_rope x=[{t}, {heads}, {d}] theta={theta} positions={positions:?} seed={seed}");
    check_op(
        &OpCase {
            label: label.clone(),
            names: &["x", "w"],
            inputs: vec![x, w],
            dy,
            reference: &|x| {
                let (cos, sin) = rope_tables(&positions, d, theta, x[0].dtype())?;
                ops::rope(&ops::rms_norm(&x[0], &x[1], eps)?, &cos, &sin)
            },
            manual: &|x, dy| {
                let (cos, sin) = rope_tables(&positions, d, theta, x[0].dtype())?;
                let (y, inv) = head_norm_rope_forward(&x[0], &x[1], &cos, &sin, eps)?;
                check_inv_rms(&label, &x[0], &inv, eps);
                let (dx, dw) = head_norm_rope_backward(dy, &x[0], &x[1], &inv, &cos, &sin)?;
                Ok((y, vec![dx, dw]))
            },
            terms: Some(&|t, dy| {
                let (cos, sin) = rope_tables(&positions, d, theta, DType::F64)?;
                let (_, g) = autograd(&[t[0].zeros_like()?], dy, &|z| ops::rope(&z[0], &cos, &sin));
                rms_norm_terms(&t[0], &t[1], &g[0], eps)
            }),
            forward_terms: None,
        },
        worst,
    );
}

/// Proves the RoPE twin (targets without q/k norms) equals `reference::ops::rope`, in f64 and
/// f32, for x `[T, heads, d]` over the shapes, positions and thetas of the head norm's case and
/// the scaled tables of the `llama3` and `yarn` variants. A rotation of a few products per
/// element: the f32 error is a few ulps of `|x|`.
#[test]
fn rope_matches_reference() {
    use dflash_reference::config::RopeScaling;
    let scalings = prop::sample::select(vec![
        RopeScaling::Default,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 512.0,
        },
        RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 1024.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 1.1386,
            truncate: true,
        },
    ]);
    let shapes = (1usize..=20, 1usize..=4, 1usize..=8, prop::sample::select(vec![1e4, 1e6]), scalings);
    proptest!(ProptestConfig::with_cases(CASES / 4), |((t, heads, half, theta, scaling) in shapes, seed in any::<u64>())| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let d = 2 * half;
        let positions: Vec<usize> = (0..t).map(|_| rng.random_range(0..8192)).collect();
        let x = normal(&[t, heads, d], 10f64.powf(rng.random_range(-3.0..1.0)), &mut rng);
        for (dtype, tol) in [(DType::F64, STEP_OP_F64), (DType::F32, STEP_OP_F32)] {
            let x = x.to_dtype(dtype).expect("cast");
            let (cos, sin) = dflash_reference::ops::rope_tables_scaled(&positions, d, theta, &scaling, dtype).expect("tables");
            let want = ops::rope(&x, &cos, &sin).expect("reference rope");
            let got = rope_forward(&x, &cos, &sin).expect("twin rope");
            let err = rel_error(&got, &want);
            prop_assert!(err <= tol.rel, "rope x=[{t}, {heads}, {d}] {scaling:?} {dtype:?}: error {err:.3e} above {:.0e}", tol.rel);
        }
    });
}

/// Proves the SwiGLU twin equals `reference::ops::silu(gate) * up` and its
/// `dgate`, `dup` equal autograd, over rows 1..=20, I 1..=24, gate scales 0.3..6 (into silu's
/// saturated tails). `silu' = s (1 + gate (1 - s))` crosses zero at gate ~ -1.28, so `dgate`'s
/// error is divided by its terms `|dh up| s (1 + |gate| (1 - s))`.
#[test]
fn swiglu_matches_reference_autograd() {
    let worst = Worst::default();
    proptest!(ProptestConfig::with_cases(CASES), |(rows in 1usize..=20, inter in 1usize..=24, seed in any::<u64>())| {
        check_swiglu(rows, inter, seed, &worst);
    });
    report("swiglu", &worst);
}

fn check_swiglu(rows: usize, inter: usize, seed: u64, worst: &Worst) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let gate = normal(&[rows, inter], rng.random_range(0.3..6.0), &mut rng);
    let up = normal(&[rows, inter], 1.0, &mut rng);
    let dh = normal(&[rows, inter], 1.0, &mut rng);
    check_op(
        &OpCase {
            label: format!("swiglu [{rows}, {inter}] seed={seed}"),
            names: &["gate", "up"],
            inputs: vec![gate, up],
            dy: dh,
            reference: &|t| Ok((ops::silu(&t[0])? * &t[1])?),
            manual: &|t, dh| {
                let (dgate, dup) = swiglu_backward(dh, &t[0], &t[1])?;
                Ok((swiglu_forward(&t[0], &t[1])?, vec![dgate, dup]))
            },
            terms: Some(&|t, dh| {
                let (gate, up) = (&t[0], &t[1]);
                let s = gate.neg()?.exp()?.affine(1.0, 1.0)?.recip()?;
                let dsilu_terms = (&s * (gate.abs()? * s.affine(-1.0, 1.0)?)?.affine(1.0, 1.0)?)?;
                Ok(vec![Some(((dh * up)?.abs()? * dsilu_terms)?), None])
            }),
            forward_terms: None,
        },
        worst,
    );
}

/// Proves the CE twin's per-row weighted CE and its gradient equal the reference's decayed CE and
/// its autograd (`d(sum w CE)/dz`) in f64 on the same logits, over rows 1..=12 and vocabs 2..=300
/// with random weights (some zero) and logits at scales up to 20 (peaked rows), storing f64 and
/// f32.
#[test]
fn ce_grad_rows_matches_reference_autograd() {
    let worst = Worst::default();
    proptest!(ProptestConfig::with_cases(CASES / 4), |(rows in 1usize..=12, vocab in 2usize..=300, seed in any::<u64>())| {
        check_ce(rows, vocab, seed, &worst);
    });
    report("ce_grad_rows", &worst);
}

fn check_ce(rows: usize, vocab: usize, seed: u64, worst: &Worst) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let z = normal(&[rows, vocab], rng.random_range(0.1..20.0), &mut rng);
    let labels: Vec<u32> = (0..rows).map(|_| rng.random_range(0..vocab as u32)).collect();
    let weights: Vec<f64> =
        (0..rows).map(|_| if rng.random_bool(0.2) { 0.0 } else { f64::from(rng.random_range(0.1f32..1.0)) }).collect();
    let scale = f64::from(rng.random_range(0.01f32..2.0));
    let total: f64 = weights.iter().sum();
    let label = format!("ce_grad_rows [{rows}, {vocab}] seed={seed}");
    let targets = BlockTargets { labels: labels.clone(), weights: weights.clone() };
    for (dtype, tol, base) in [(DType::F64, STEP_OP_F64, 0), (DType::F32, STEP_OP_F32, 2)] {
        let zt = z.to_dtype(dtype).expect("cast");
        // The reference in f64 on the same (dtype-exact) logits: the twin's log-sum-exp runs in
        // f64 for every storage, so only the rounding of its outputs to the stored type remains.
        // decayed_ce is sum w CE / sum w; scaled back to sum w CE, times `scale`.
        let factor = total * scale;
        let exact = zt.to_dtype(DType::F64).expect("widen");
        let (loss, grads) = autograd(&[exact], &Tensor::new(factor, &candle_core::Device::Cpu).unwrap(), &|t| {
            decayed_ce(&t[0], &targets)
        });
        let (dz, per_row) = ce_grad_rows(&zt, &labels, &weights, scale).expect("twin");
        let sum: f64 = per_row.iter().sum();
        let want_sum = loss.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap() * total;
        let err = (sum - want_sum).abs() / want_sum.abs().max(f64::MIN_POSITIVE);
        worst[base].fetch_max(err.to_bits(), Ordering::Relaxed);
        assert!(err <= tol.rel || total == 0.0, "{label}: {dtype:?} CE sum {sum} vs {want_sum} ({err:.2e})");
        // dz_y = w (p_y - 1) cancels on peaked rows: its error is divided by the terms,
        // scale * w * (p + onehot), not by itself.
        let exact: Vec<f64> = zt.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let mut terms = vec![0.0; rows * vocab];
        for (r, row) in exact.chunks(vocab).enumerate() {
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = row.iter().map(|x| (x - max).exp()).sum();
            for (i, x) in row.iter().enumerate() {
                let onehot = if i == labels[r] as usize { 1.0 } else { 0.0 };
                terms[r * vocab + i] = scale * weights[r] * ((x - max).exp() / sum + onehot);
            }
        }
        let terms = Tensor::from_vec(terms, (rows, vocab), &candle_core::Device::Cpu).unwrap();
        let err = error_over(&dz, &grads[0], Some(&terms));
        worst[base + 1].fetch_max(err.to_bits(), Ordering::Relaxed);
        assert!(err <= tol.rel || total == 0.0, "{label}: {dtype:?} dz: {err:.2e} above {:.0e}", tol.rel);
    }
}

/// Proves the argmax twin equals the reference `argmax_rows` (candle's argmax: the first index of
/// the maximum) in f64 and f32, over rows 1..=12 and vocabs 1..=600 (vocabs that are and are not
/// multiples of the kernel's 8-value loads and of its 256-thread rows), with deliberate ties: in
/// some rows the maximum is copied to a later index (the first one stays the answer), in others to
/// an earlier one (which becomes it).
#[test]
fn argmax_rows_matches_reference() {
    proptest!(ProptestConfig::with_cases(CASES / 4), |(rows in 1usize..=12, vocab in 1usize..=600, seed in any::<u64>())| {
        check_argmax(rows, vocab, seed)?;
    });
}

fn check_argmax(rows: usize, vocab: usize, seed: u64) -> std::result::Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let gain = 10f64.powf(rng.random_range(-2.0..2.0));
    let mut z: Vec<f64> = normal(&[rows, vocab], gain, &mut rng).flatten_all().unwrap().to_vec1().unwrap();
    // The first index of the maximum each row must give, ties included.
    let mut expected = Vec::with_capacity(rows);
    for row in z.chunks_mut(vocab) {
        let first = (1..vocab).fold(0, |m, i| if row[i] > row[m] { i } else { m });
        expected.push(match rng.random_range(0..3) {
            1 if first + 1 < vocab => {
                row[rng.random_range(first + 1..vocab)] = row[first];
                first
            }
            2 if first > 0 => {
                let earlier = rng.random_range(0..first);
                row[earlier] = row[first];
                earlier
            }
            _ => first,
        } as u32);
    }
    let label = format!("argmax_rows [{rows}, {vocab}] seed={seed}");
    for dtype in [DType::F64, DType::F32] {
        let t = Tensor::from_vec(z.clone(), (rows, vocab), &candle_core::Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let want = dflash_reference::speculative::argmax_rows(&t).expect("reference argmax");
        let got = argmax_rows(&t).expect("twin argmax");
        prop_assert_eq!(&got, &want, "{} {:?}", label, dtype);
        if dtype == DType::F64 {
            // f32 rounding may tie two close values; f64 holds the ties as built.
            prop_assert_eq!(&want, &expected, "{} the ties as built", label);
        }
    }
    Ok(())
}

/// Proves the argmax twin treats special values as the reference (candle's argmax) does, in f64
/// and f32: a NaN is never the maximum (candle's `best < v` is false for it) unless the row starts
/// with one, which it keeps (index 0); infinities compare as values; -0 and +0 are equal (the
/// first wins); constant rows and rows of one value give 0.
#[test]
fn argmax_rows_matches_reference_on_nan_infinities_and_signed_zeros() {
    let (nan, inf) = (f64::NAN, f64::INFINITY);
    let cases: [([f64; 4], u32); 10] = [
        ([nan, 1.0, 2.0, 3.0], 0),
        ([1.0, nan, 3.0, 2.0], 2),
        ([1.0, 3.0, nan, 3.0], 1),
        ([nan, nan, nan, nan], 0),
        ([-inf, -inf, -inf, -inf], 0),
        ([-inf, nan, -inf, -1.0], 3),
        ([1.0, inf, 2.0, inf], 1),
        ([-0.0, 0.0, -0.0, -1.0], 0),
        ([-1.0, 0.0, -0.0, 1e-30], 3),
        ([2.0, 2.0, 2.0, 2.0], 0),
    ];
    let values: Vec<f64> = cases.iter().flat_map(|(row, _)| *row).collect();
    let expected: Vec<u32> = cases.iter().map(|&(_, i)| i).collect();
    for dtype in [DType::F64, DType::F32] {
        let t = Tensor::from_vec(values.clone(), (cases.len(), 4), &candle_core::Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let want = dflash_reference::speculative::argmax_rows(&t).expect("reference argmax");
        assert_eq!(want, expected, "{dtype:?}: candle's argmax on special values");
        assert_eq!(argmax_rows(&t).expect("twin argmax"), want, "{dtype:?}");
        let single = t.narrow(1, 0, 1).unwrap().contiguous().unwrap();
        let want = dflash_reference::speculative::argmax_rows(&single).expect("reference argmax");
        assert_eq!(argmax_rows(&single).expect("twin argmax"), want, "{dtype:?}: rows of one value");
    }
}

/// The op cases `xtask gpu-conformance` compares the CUDA kernels with (the elementwise ops, the
/// matmul and the GatedDeltaNet ops), run here on the bf16 twins (the GPU's storage, fp32
/// arithmetic) against the f64 twins, output by output under the tolerances the GPU run uses
/// (bf16 outputs, fp32 outputs, exact copies), for two seeds.
#[test]
fn bf16_twins_match_the_f64_twins_on_the_gpu_op_cases() {
    use dflash_conformance::gpu_step::{compare_ops, kernel_cases};
    use dflash_optimized::backend::host::Host;
    for seed in [7u64, 8] {
        let got = kernel_cases(&Host::<half::bf16>::default(), seed).expect("bf16 twins");
        let want = kernel_cases(&Host::<f64>::default(), seed).expect("f64 twins");
        for check in compare_ops(&got, &want) {
            eprintln!("seed {seed} {}: {:?} (bound {:e})", check.name, check.errors, check.tolerance);
            assert!(check.pass(), "seed {seed} {}: {:?} above {:e}", check.name, check.errors, check.tolerance);
        }
    }
}

/// The CPU twin of the row gather/scatter copies bytes, as the kernel does: on bf16 storage, rows
/// of arbitrary 16-bit words (halves of an fp32 RoPE table, NaN payloads among them) come back
/// bit for bit, gathered and scattered back.
#[test]
fn gathered_rows_are_their_bytes() {
    use dflash_optimized::backend::host::Host;
    use dflash_optimized::backend::{Allocation, Backend};
    use dflash_optimized::ops::elementwise::ElementwiseOps;
    let mut rng = ChaCha8Rng::seed_from_u64(rand::rng().random());
    let host = Host::<half::bf16>::default();
    let (rows, cols) = (rng.random_range(2..20), rng.random_range(1..40));
    // Random words, and the signalling-NaN patterns a conversion would quiet.
    let mut words: Vec<u16> = (0..rows * cols).map(|_| rng.random()).collect();
    words[0] = 0x7f81;
    words[rows * cols - 1] = 0xff81;
    let idx: Vec<u32> = (0..rows as u32).rev().collect();
    let bytes = |v: &[u16]| v.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>();
    let (src, gathered, back) = (
        host.alloc("src", rows * cols * 2).unwrap(),
        host.alloc("gathered", rows * cols * 2).unwrap(),
        host.alloc("back", rows * cols * 2).unwrap(),
    );
    let index = host.alloc("idx", rows * 4).unwrap();
    host.upload(src.ptr(), &bytes(&words)).unwrap();
    host.upload(index.ptr(), &idx.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    host.ops().copy_rows(false, src.ptr(), index.ptr(), gathered.ptr(), rows, cols).unwrap();
    host.ops().copy_rows(true, gathered.ptr(), index.ptr(), back.ptr(), rows, cols).unwrap();
    let read = |a: u64| {
        let mut out = vec![0u8; rows * cols * 2];
        host.download(a, &mut out).unwrap();
        out
    };
    let reversed: Vec<u16> = (0..rows).rev().flat_map(|r| words[r * cols..(r + 1) * cols].to_vec()).collect();
    assert_eq!(read(gathered.ptr()), bytes(&reversed), "gathered rows");
    assert_eq!(read(back.ptr()), bytes(&words), "scattered back");
}
