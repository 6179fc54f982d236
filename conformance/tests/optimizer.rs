//! The optimiser of spec section 3: the warmup + cosine schedule, AdamW against a scalar
//! implementation, global grad-norm clipping, and the reference training loop (the loss goes
//! down; a NaN is an error naming the step).

use std::cell::Cell;

use candle_core::{DType, Device, Tensor, Var};
use dflash_conformance::setups::randn;
use dflash_conformance::tolerance::{assert_close, CLIP_NORM, ORACLE_F64};
use dflash_reference::builtin::generate_rows;
use dflash_reference::config::{AttnKind, DraftConfig, ModelDims, RopeScaling, TargetArch, TargetConfig};
use dflash_reference::data::TrainRow;
use dflash_reference::drafter::Drafter;
use dflash_reference::loss::default_gamma;
use dflash_reference::optim::{clip_grad_norm, lr_at, AdamW, AdamWConfig};
use dflash_reference::target::TargetModel;
use dflash_reference::train::{batch_loss, train, TrainOptions};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rstest::rstest;

/// Flattens a tensor to f64 values.
fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

/// Named random parameters of random shapes (1-D and 2-D), as the drafter's `named_params`.
fn random_params(rng: &mut ChaCha8Rng) -> Vec<(String, Var)> {
    let names = [
        "fc.weight",
        "hidden_norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.up_proj.weight",
        "norm.weight",
    ];
    names
        .iter()
        .map(|name| {
            let shape = if name.ends_with("norm.weight") {
                vec![rng.random_range(2..=6)]
            } else {
                vec![rng.random_range(1..=5), rng.random_range(2..=6)]
            };
            let t = randn(&shape, rng, DType::F64).unwrap();
            (name.to_string(), Var::from_tensor(&t).unwrap())
        })
        .collect()
}

/// Fresh random gradients shaped like `params`, scaled by `scale`.
fn random_grads(params: &[(String, Var)], scale: f64, rng: &mut ChaCha8Rng) -> Vec<Tensor> {
    params.iter().map(|(_, p)| randn(p.dims(), rng, DType::F64).unwrap().affine(scale, 0.0).unwrap()).collect()
}

fn global_norm(grads: &[Tensor]) -> f64 {
    grads.iter().flat_map(values).map(|x| x * x).sum::<f64>().sqrt()
}

/// Proves the schedule for many run lengths: linear warmup `peak*(s+1)/w` over
/// `w = ceil(4% of steps)` steps reaching the peak, then a cosine from the peak to 0 at the
/// last step that never increases (0 at the last step whenever one follows the warmup, a single
/// one too); never negative, never above the peak. A fraction whose product rounds above an
/// integer (7% of 100 = 7.000000000000001) warms up over that integer.
#[test]
fn lr_warmup_then_cosine() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let tol = ORACLE_F64.rel;
    for total in [1, 2, 3, 4, 7, 24, 25, 26, 49, 50, 51, 99, 100, 101, 333, 1000, 2501] {
        let peak = rng.random_range(1e-5..1e-1);
        let lrs: Vec<f64> = (0..total).map(|s| lr_at(s, total, peak, 0.04)).collect();
        let warmup = (4 * total).div_ceil(100).max(1);
        for (s, &lr) in lrs.iter().enumerate() {
            assert!(
                lr.is_finite() && lr >= 0.0 && lr <= peak * (1.0 + tol),
                "total {total}: lr[{s}] = {lr} outside [0, {peak}]"
            );
            if s < warmup {
                let want = peak * (s + 1) as f64 / warmup as f64;
                assert!(
                    (lr - want).abs() <= tol * peak,
                    "total {total}, warmup {warmup}: lr[{s}] = {lr}, linear warmup gives {want}"
                );
            }
        }
        assert!(
            (lrs[warmup - 1] - peak).abs() <= tol * peak,
            "total {total}: warmup ends at {} not at the peak {peak}",
            lrs[warmup - 1]
        );
        for s in warmup..total {
            assert!(
                lrs[s] <= lrs[s - 1] * (1.0 + tol),
                "total {total}: lr rises after warmup at step {s}: {} -> {}",
                lrs[s - 1],
                lrs[s]
            );
        }
        if total > warmup {
            assert_eq!(lrs[total - 1], 0.0, "total {total}: the last step's lr");
        }
        if total >= warmup + 2 {
            // A cosine from the peak at step `warmup` to 0 at step `total - 1`.
            let span = (total - 1 - warmup) as f64;
            for s in warmup..total {
                let progress = (s - warmup) as f64 / span;
                let want = peak * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                assert!(
                    (lrs[s] - want).abs() <= tol * peak,
                    "total {total}: lr[{s}] = {}, cosine gives {want}",
                    lrs[s]
                );
                if s > warmup {
                    assert!(lrs[s] < lrs[s - 1], "total {total}: lr flat at step {s}");
                }
            }
            assert!(lrs[total - 1] <= tol * peak, "total {total}: last lr {} is not ~0", lrs[total - 1]);
        }
    }
    for (frac, total, warmup) in [(0.07, 100, 7), (0.07, 300, 21), (0.04, 2501, 101), (0.1, 30, 3)] {
        let peak = rng.random_range(1e-5..1e-1);
        let top = lr_at(warmup - 1, total, peak, frac);
        assert!((top - peak).abs() <= tol * peak, "{frac} of {total}: {top}, not the peak, at step {}", warmup - 1);
        assert!(lr_at(warmup - 2, total, peak, frac) < peak, "{frac} of {total}: warmup ends at step {}", warmup - 1);
    }
}

/// One AdamW step in plain scalars (PyTorch's AdamW): moments, bias correction, decoupled
/// weight decay `p -= lr * wd * p`.
struct ScalarAdamW {
    m: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
    t: i32,
}

impl ScalarAdamW {
    fn step(&mut self, c: &AdamWConfig, params: &mut [Vec<f64>], grads: &[Vec<f64>], lr: f64) {
        self.t += 1;
        for (i, (p, g)) in params.iter_mut().zip(grads).enumerate() {
            for k in 0..p.len() {
                let m = &mut self.m[i][k];
                let v = &mut self.v[i][k];
                *m = c.beta1 * *m + (1.0 - c.beta1) * g[k];
                *v = c.beta2 * *v + (1.0 - c.beta2) * g[k] * g[k];
                let m_hat = *m / (1.0 - c.beta1.powi(self.t));
                let v_hat = *v / (1.0 - c.beta2.powi(self.t));
                let decayed = p[k] - lr * c.weight_decay * p[k];
                p[k] = decayed - lr * m_hat / (v_hat.sqrt() + c.eps);
            }
        }
    }
}

/// Proves `AdamW::step` over 6 steps (random parameters, fresh random gradients of varying
/// scale, a different lr per step) equals a scalar AdamW with bias correction and decoupled
/// weight decay, for weight decay 0 and 0.1: both the parameters and each step's update.
#[rstest]
#[case(0.0, 11)]
#[case(0.1, 12)]
fn adamw_matches_scalar(#[case] weight_decay: f64, #[case] seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let params = random_params(&mut rng);
    let config = AdamWConfig {
        lr: 0.05,
        beta1: rng.random_range(0.8..0.95),
        beta2: rng.random_range(0.95..0.999),
        eps: 1e-8,
        weight_decay,
    };
    let mut adamw = AdamW::new(&params, config.clone()).unwrap();
    let mut want: Vec<Vec<f64>> = params.iter().map(|(_, p)| values(p)).collect();
    let mut scalar = ScalarAdamW {
        m: want.iter().map(|p| vec![0.0; p.len()]).collect(),
        v: want.iter().map(|p| vec![0.0; p.len()]).collect(),
        t: 0,
    };
    for step in 0..6 {
        let lr = config.lr * rng.random_range(0.2..1.0);
        let grads = random_grads(&params, rng.random_range(0.01..3.0), &mut rng);
        let before: Vec<Tensor> = params.iter().map(|(_, p)| p.as_tensor().copy().unwrap()).collect();
        let want_before = want.clone();
        adamw.step(&params, &grads, lr).unwrap();
        let grad_values: Vec<Vec<f64>> = grads.iter().map(values).collect();
        scalar.step(&config, &mut want, &grad_values, lr);
        for (i, (name, p)) in params.iter().enumerate() {
            let shape = p.dims();
            let want_p = Tensor::from_vec(want[i].clone(), shape, &Device::Cpu).unwrap();
            assert_close(&format!("step {step} {name}"), p.as_tensor(), &want_p, ORACLE_F64);
            let delta = (p.as_tensor() - &before[i]).unwrap();
            let want_delta: Vec<f64> = want[i].iter().zip(&want_before[i]).map(|(a, b)| a - b).collect();
            let want_delta = Tensor::from_vec(want_delta, shape, &Device::Cpu).unwrap();
            assert_close(&format!("step {step} update of {name}"), &delta, &want_delta, ORACLE_F64);
        }
    }
}

/// Proves that clipping above `max_norm` scales every gradient by one common factor so that
/// the global norm becomes `max_norm` (within PyTorch's 1e-6 guard), and returns the norm
/// before clipping; and that gradients below `max_norm` are left bit for bit unchanged.
#[test]
fn clip_grad_norm_scales_or_keeps() {
    for seed in 0..8u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(100 + seed);
        let params = random_params(&mut rng);
        let max_norm = rng.random_range(1.0..3.0);

        // Above: the norm is 2-50 times max_norm.
        let grads = random_grads(&params, 1.0, &mut rng);
        let scale = max_norm * rng.random_range(2.0..50.0) / global_norm(&grads);
        let grads: Vec<Tensor> = grads.iter().map(|g| g.affine(scale, 0.0).unwrap()).collect();
        let norm = global_norm(&grads);
        let mut clipped = grads.clone();
        let returned = clip_grad_norm(&params, &mut clipped, max_norm).unwrap();
        assert!(
            (returned - norm).abs() <= ORACLE_F64.rel * norm,
            "seed {seed}: returned norm {returned}, gradients have {norm}"
        );
        let after = global_norm(&clipped);
        assert!(
            after <= max_norm && (after - max_norm).abs() <= CLIP_NORM.rel * max_norm,
            "seed {seed}: clipped norm {after}, max_norm {max_norm} ({})",
            CLIP_NORM.reason
        );
        let factor = after / norm;
        for ((name, _), (g, c)) in params.iter().zip(grads.iter().zip(&clipped)) {
            let want = g.affine(factor, 0.0).unwrap();
            assert_close(&format!("seed {seed}: clipped {name}"), c, &want, ORACLE_F64);
        }

        // Below: the norm is 0.1-0.99 times max_norm.
        let grads = random_grads(&params, 1.0, &mut rng);
        let scale = max_norm * rng.random_range(0.1..0.99) / global_norm(&grads);
        let grads: Vec<Tensor> = grads.iter().map(|g| g.affine(scale, 0.0).unwrap()).collect();
        let mut kept = grads.clone();
        let returned = clip_grad_norm(&params, &mut kept, max_norm).unwrap();
        assert!((returned - global_norm(&grads)).abs() <= ORACLE_F64.rel * returned);
        for ((name, _), (g, k)) in params.iter().zip(grads.iter().zip(&kept)) {
            assert_eq!(values(g), values(k), "seed {seed}: {name} changed below max_norm");
        }
    }
}

/// Proves that a NaN (or an Inf) anywhere in one gradient makes clipping fail with an error
/// naming that parameter, not a panic and not a NaN-scaled update.
#[test]
fn clip_grad_norm_names_nan_tensor() {
    for seed in 0..6u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(200 + seed);
        let params = random_params(&mut rng);
        let mut grads = random_grads(&params, 1.0, &mut rng);
        let bad = rng.random_range(0..params.len());
        let mut vals = values(&grads[bad]);
        let at = rng.random_range(0..vals.len());
        vals[at] = if seed % 2 == 0 { f64::NAN } else { f64::INFINITY };
        grads[bad] = Tensor::from_vec(vals, grads[bad].dims(), &Device::Cpu).unwrap();
        let err = clip_grad_norm(&params, &mut grads, 1.0).expect_err("clipping accepted a non-finite gradient");
        let name = &params[bad].0;
        assert!(err.to_string().contains(name.as_str()), "seed {seed}: error does not name {name}: {err}");
    }
}

/// A tiny Qwen3 target (hidden 16, 2 layers, vocab 16), a 1-layer drafter with blocks of 4,
/// and `n_rows` rows sampled from the target (4 prompt tokens, 12 generated, loss on those).
fn tiny_setup(seed: u64, n_rows: usize) -> (TargetModel, Drafter, Vec<TrainRow>) {
    let config = TargetConfig {
        arch: TargetArch::Qwen3,
        dims: ModelDims {
            hidden_size: 16,
            intermediate_size: 32,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 8,
            vocab_size: 16,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            max_position_embeddings: 256,
            layer_kinds: vec![AttnKind::Full; 2],
        },
        tie_word_embeddings: false,
        rope_scaling: RopeScaling::Default,
    };
    let target = TargetModel::random(config.clone(), seed, 0.5, DType::F32).unwrap();
    let mut draft_config = DraftConfig::for_target(&config, 1, 4, 15, 2);
    draft_config.dims.layer_kinds = vec![AttnKind::Sliding { window: 8 }];
    let mut rng = ChaCha8Rng::seed_from_u64(seed + 1);
    let rows = generate_rows(&target, &draft_config, n_rows, 4, 12, 0.5, &mut rng).unwrap();
    let drafter = Drafter::init(draft_config, seed + 2, DType::F32).unwrap();
    (target, drafter, rows)
}

/// The loss over every anchor candidate of `rows` (deterministic: all candidates are drawn).
fn full_loss(drafter: &Drafter, target: &TargetModel, rows: &[TrainRow], gamma: f64) -> f64 {
    let refs: Vec<&TrainRow> = rows.iter().collect();
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let (loss, _) = batch_loss(drafter, &target.frozen_head(), &refs, 64, gamma, &mut rng).unwrap();
    loss.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
}

fn train_options(steps: usize, seed: u64) -> TrainOptions {
    TrainOptions {
        steps,
        rows_per_step: 2,
        max_anchors: 6,
        optimizer: AdamWConfig { lr: 1e-2, ..AdamWConfig::default() },
        gamma: default_gamma(4),
        seed,
        ..TrainOptions::default()
    }
}

/// Proves that `train` learns: on a fixed tiny data set sampled from the target, 50 steps at
/// lr 1e-2 bring the loss over all anchors well below its value at init; every step reports a
/// finite loss, the scheduled lr and a positive weight.
#[test]
fn train_lowers_the_loss() {
    for seed in [1u64, 2] {
        let (target, drafter, rows) = tiny_setup(seed, 4);
        let opts = train_options(50, seed);
        let before = full_loss(&drafter, &target, &rows, opts.gamma);
        let calls = Cell::new(0);
        let reports = train(&drafter, &target.frozen_head(), &rows, &opts, |_| calls.set(calls.get() + 1)).unwrap();
        let after = full_loss(&drafter, &target, &rows, opts.gamma);
        assert_eq!(reports.len(), 50);
        assert_eq!(calls.get(), 50, "on_step not called once per step");
        for r in &reports {
            assert!(r.loss.is_finite() && r.weight > 0.0 && r.grad_norm > 0.0, "{r:?}");
            assert_eq!(r.lr, lr_at(r.step, 50, 1e-2, opts.warmup_frac));
        }
        assert!(after < 0.6 * before, "seed {seed}: loss {before} at init, {after} after 50 steps");
    }
}

/// Proves that a NaN in one row's features stops training with an error naming the step at
/// which that row was first used (the steps before it complete), not a panic.
#[test]
fn train_nan_features_names_the_step() {
    let (target, _, clean) = tiny_setup(3, 4);
    let mut saw_later_step = false;
    for seed in 0..6u64 {
        let (_, drafter, _) = tiny_setup(3, 0);
        let mut rng = ChaCha8Rng::seed_from_u64(300 + seed);
        let mut rows = clean.clone();
        let bad = rng.random_range(0..rows.len());
        let (s, f) = rows[bad].features.dims2().unwrap();
        let mut vals = values(&rows[bad].features);
        vals[rng.random_range(0..s * f)] = f64::NAN;
        rows[bad].features = Tensor::from_vec(vals, (s, f), &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
        let mut opts = train_options(8, seed);
        opts.rows_per_step = 1;
        let done = Cell::new(0usize);
        let result = train(&drafter, &target.frozen_head(), &rows, &opts, |r| {
            assert_eq!(r.step, done.get());
            done.set(done.get() + 1)
        });
        let err = match result {
            Ok(_) => panic!("seed {seed}: training on NaN features succeeded"),
            Err(e) => e.to_string(),
        };
        let step = done.get();
        assert!(step < 4, "seed {seed}: the NaN row is used in the first epoch, not step {step}");
        assert!(err.contains(&format!("step {step}")), "seed {seed}: {step} steps completed but the error says: {err}");
        saw_later_step |= step > 0;
    }
    assert!(saw_later_step, "the NaN row always came first: step naming not exercised past 0");
}
