//! The engine of the optimized step (`DeviceEngine`, the GPU path's driver, here on the CPU twins
//! storing f32): its losses follow the CPU engine's (the same step on the twins, with the
//! reference's AdamW) step after step, and a state taken mid-run and restored into a fresh engine
//! continues with bitwise the same losses.

use dflash_optimized::backend::host::Host;
use dflash_optimized::memory::step::Checkpointing;
use dflash_optimized::ops::Elem;
use dflash_trainer::builtin;
use dflash_trainer::config::{RunConfig, StepKind};
use dflash_trainer::engine::{CpuEngine, DeviceEngine, Frozen, StepBatch, StepEngine};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn small_config() -> RunConfig {
    RunConfig { rows: 6, eval_rows: 1, tau_prompts: 1, continuation_len: 24, anchors: 6, ..RunConfig::builtin() }
}

/// Rows of one update in [`batch`].
const ROWS_PER_UPDATE: usize = 3;

fn batch<'a>(setup: &'a builtin::BuiltinSetup, step: usize, c: &RunConfig) -> StepBatch<'a> {
    let n = setup.data.len();
    StepBatch {
        step,
        micro_batches: vec![
            vec![&setup.data[step % n], &setup.data[(step + 1) % n]],
            vec![&setup.data[(step + 2) % n]],
        ],
        anchors: c.anchors,
        gamma: c.gamma_for(setup.draft_config.block_size),
        lr: 3e-3,
        clip_norm: 1.0,
        want_stats: false,
    }
}

/// [`batch`] with its first row alone: one row per update.
fn one_row<'a>(setup: &'a builtin::BuiltinSetup, step: usize, c: &RunConfig) -> StepBatch<'a> {
    StepBatch { micro_batches: vec![vec![&setup.data[step % setup.data.len()]]], ..batch(setup, step, c) }
}

/// An engine of the built-in setup on CPU backends reporting `available` bytes free, under the
/// first of `policies` that fits, one row per update.
fn engine_on<E: Elem + 'static>(
    setup: &builtin::BuiltinSetup,
    c: &RunConfig,
    available: u64,
    policies: &[Checkpointing],
) -> DeviceEngine<Host<E>> {
    let drafter = builtin::init_drafter(c, &setup.draft_config).expect("drafter");
    let frozen = Frozen::Host(setup.target.frozen_head());
    DeviceEngine::new(
        move || Ok(Host::<E>::with_available(available)),
        drafter,
        frozen,
        builtin::adamw_config(c),
        policies,
    )
}

/// The engine of [`batch`]'s updates (per-layer checkpointing).
fn device<E: Elem + 'static>(setup: &builtin::BuiltinSetup, c: &RunConfig) -> DeviceEngine<Host<E>> {
    engine_on(setup, c, u64::MAX, &[Checkpointing::PerLayer]).with_rows_per_update(ROWS_PER_UPDATE)
}

#[test]
fn the_device_engine_follows_the_cpu_engine() {
    let c = small_config();
    let setup = builtin::setup(&c).expect("setup");
    let drafter = builtin::init_drafter(&c, &setup.draft_config).expect("drafter");
    let mut cpu =
        CpuEngine::new(drafter, setup.target.frozen_head(), builtin::adamw_config(&c), StepKind::Host).unwrap();
    let mut dev = device::<f32>(&setup, &c);
    let (mut r1, mut r2) = (ChaCha8Rng::seed_from_u64(5), ChaCha8Rng::seed_from_u64(5));
    for step in 0..6 {
        let (a, b) = (
            cpu.step(&batch(&setup, step, &c), &mut r1).unwrap(),
            dev.step(&batch(&setup, step, &c), &mut r2).unwrap(),
        );
        let rel = (a.loss - b.loss).abs() / a.loss.abs();
        // f32 twins on both sides; the optimizers (reference AdamW vs the device AdamW's twin)
        // round differently in f32, which the later steps' losses carry.
        assert!(rel < 1e-4, "step {step}: loss {} (cpu) vs {} (device), rel {rel:.2e}", a.loss, b.loss);
        assert!((a.grad_norm - b.grad_norm).abs() / a.grad_norm < 1e-4, "step {step}: grad norm");
        assert_eq!(a.weight, b.weight, "step {step}: the same anchors give the same weight");
    }
    // The drafter it hands out holds the trained weights.
    let trained = dev.drafter().unwrap().param("fc.weight").clone();
    let init = builtin::init_drafter(&c, &setup.draft_config).unwrap().param("fc.weight").clone();
    assert!((trained - init).unwrap().abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0);
}

/// A state taken mid-run and restored continues with bitwise the same losses: into a fresh
/// engine (the state applied when its step is made) and into one that has already stepped on
/// other rows (as a resumed run's held-out evaluation does first), storing f32 and storing bf16
/// (the GPU's storage: the restored compute weights are the masters rounded as the update rounds them).
#[test]
fn a_restored_device_engine_continues_bitwise() {
    restored_continues_bitwise::<f32>();
    restored_continues_bitwise::<half::bf16>();
}

fn restored_continues_bitwise<E: Elem + 'static>() {
    let c = small_config();
    let setup = builtin::setup(&c).expect("setup");
    let mut whole = device::<E>(&setup, &c);
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let mut losses = Vec::new();
    let mut at_3 = None;
    for step in 0..6 {
        if step == 3 {
            at_3 = Some((whole.state().unwrap(), rng.clone()));
        }
        losses.push(whole.step(&batch(&setup, step, &c), &mut rng).unwrap().loss);
    }
    let (state, rng_3) = at_3.unwrap();
    for stepped_first in [false, true] {
        let mut resumed = device::<E>(&setup, &c);
        if stepped_first {
            let held: Vec<_> = setup.held_out.clone();
            resumed.evaluate(&held, c.anchors, 3.0, 1).unwrap();
        }
        resumed.restore(&state).unwrap();
        let mut rng = rng_3.clone();
        for (step, want) in losses.iter().enumerate().skip(3) {
            let got = resumed.step(&batch(&setup, step, &c), &mut rng).unwrap().loss;
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{}, stepped first {stepped_first}: step {step}: {got} vs {want}",
                std::any::type_name::<E>()
            );
        }
    }
}

/// The block stats of a step (per-offset hits and tau_hat's runs) from the step's recorded
/// predictions equal the CPU engine's (the reference drafter's argmax) on the same weights: a
/// drafter trained 40 steps first (so that predictions are right at several offsets), its state
/// restored into both engines.
#[test]
fn the_device_engine_counts_the_reference_drafters_predictions() {
    let c = small_config();
    let setup = builtin::setup(&c).expect("setup");
    let drafter = builtin::init_drafter(&c, &setup.draft_config).expect("drafter");
    let mut cpu =
        CpuEngine::new(drafter, setup.target.frozen_head(), builtin::adamw_config(&c), StepKind::Host).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for step in 0..40 {
        cpu.step(&batch(&setup, step, &c), &mut rng).unwrap();
    }
    let mut dev = device::<f32>(&setup, &c);
    dev.restore(&cpu.state().unwrap()).unwrap();
    let b = StepBatch { want_stats: true, ..batch(&setup, 40, &c) };
    let (want, got) = (
        cpu.step(&b, &mut rng.clone()).unwrap().stats.expect("stats"),
        dev.step(&b, &mut rng.clone()).unwrap().stats.expect("stats"),
    );
    assert_eq!(
        (&got.hits, &got.counts, got.run_sum, got.blocks),
        (&want.hits, &want.counts, want.run_sum, want.blocks)
    );
    assert!(want.hits[1..].iter().sum::<u64>() > 0, "the trained drafter predicts some tokens: {:?}", want.hits);
}

/// One row per update: the engine made for it (no gradient accumulator: AdamW reads the step's
/// own gradients) gives bitwise the losses and the state of the engine that accumulates them
/// (one stored value added to zero in the arithmetic type is exact), storing f32 and storing
/// bf16 (the GPU's storage); given two rows in one update, it refuses them naming the option.
#[test]
fn one_row_per_update_without_an_accumulator_is_bitwise_the_accumulated_update() {
    without_accumulator_is_bitwise::<f32>();
    without_accumulator_is_bitwise::<half::bf16>();
}

fn without_accumulator_is_bitwise<E: Elem + 'static>() {
    let c = small_config();
    let setup = builtin::setup(&c).expect("setup");
    let engine = || engine_on::<E>(&setup, &c, u64::MAX, &[Checkpointing::PerLayer]);
    let (mut direct, mut accumulated) = (engine(), engine().with_accumulator());
    let (mut r1, mut r2) = (ChaCha8Rng::seed_from_u64(3), ChaCha8Rng::seed_from_u64(3));
    let what = std::any::type_name::<E>();
    for step in 0..5 {
        let (a, b) = (
            direct.step(&one_row(&setup, step, &c), &mut r1).unwrap(),
            accumulated.step(&one_row(&setup, step, &c), &mut r2).unwrap(),
        );
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{what} step {step}: loss");
        assert_eq!(a.grad_norm.to_bits(), b.grad_norm.to_bits(), "{what} step {step}: gradient norm");
    }
    // An update of no weighted row applies zero gradients on both paths (the accumulator is
    // empty; the step's own gradients, of the last row, are cleared).
    let mut unweighted = setup.data[0].clone();
    unweighted.loss_mask.iter_mut().for_each(|m| *m = false);
    let none = StepBatch { micro_batches: vec![vec![&unweighted]], ..batch(&setup, 5, &c) };
    let (a, b) = (direct.step(&none, &mut r1).unwrap(), accumulated.step(&none, &mut r2).unwrap());
    assert_eq!((a.weight, b.weight), (0.0, 0.0), "{what}: no weighted row");
    let (a, b) = (direct.state().unwrap(), accumulated.state().unwrap());
    assert_eq!(a.first_difference(&b).unwrap(), None, "{what}: weights and moments");
    let err = direct.step(&batch(&setup, 6, &c), &mut r1).expect_err("three rows, no accumulator").to_string();
    assert!(err.contains("rows_per_step") && err.contains("3 rows"), "{err}");
}

/// `checkpointing = auto`: the engine lays its step out with the fastest policy that fits the
/// device's free memory with `POLICY_HEADROOM` to spare (none on an unbounded device, per-layer
/// on one just large enough for it), says which it took, and trains bitwise as the fixed
/// policy does (the policies' gradients are the same); a device too small for every policy is
/// refused naming the step's largest items.
#[test]
fn auto_checkpointing_takes_the_fastest_policy_that_fits() {
    use dflash_optimized::memory::step::{OptimizerShape, StepLayout, StepShape, POLICY_HEADROOM};
    use dflash_trainer::config::CheckpointingChoice;
    let c = small_config();
    let setup = builtin::setup(&c).expect("setup");
    let row = |step: usize| one_row(&setup, step, &c);
    let engine = |available: u64, policies: &[Checkpointing]| engine_on::<f32>(&setup, &c, available, policies);
    // The step's bytes under each policy for the rows' shape, and what the engine puts beside it
    // (the embedding table; a row's features go into the step's input).
    let (s, n) = (setup.data[0].len(), c.anchors);
    let shape = StepShape { context_len: s, num_anchors: n, lm_chunk_rows: 1024 };
    let params = dflash_optimized::model::drafter_step::param_slots(&setup.draft_config).iter().map(|s| s.len).sum();
    let bytes = |p: Checkpointing| {
        let optimizer = Some(OptimizerShape::whole(params, false));
        StepLayout::with_head(&setup.draft_config, shape, p, optimizer, (4, 4), true).expect("layout").total_bytes()
    };
    let d = &setup.draft_config;
    let beside = 4 * (d.dims.vocab_size * d.dims.hidden_size) as u64;
    assert!(bytes(Checkpointing::PerLayer) < bytes(Checkpointing::None), "per-layer keeps less");
    let auto = CheckpointingChoice::Auto.policies();
    let just_per_layer = bytes(Checkpointing::PerLayer) + beside + POLICY_HEADROOM;
    for (available, want) in [(u64::MAX, Checkpointing::None), (just_per_layer, Checkpointing::PerLayer)] {
        let mut chosen = engine(available, &auto);
        assert_eq!(chosen.checkpointing(), None, "not laid out before its first row");
        let mut fixed = engine(u64::MAX, &[want]);
        let (mut r1, mut r2) = (ChaCha8Rng::seed_from_u64(4), ChaCha8Rng::seed_from_u64(4));
        for step in 0..3 {
            let (a, b) = (chosen.step(&row(step), &mut r1).unwrap(), fixed.step(&row(step), &mut r2).unwrap());
            assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{available} bytes, step {step}");
        }
        assert_eq!(chosen.checkpointing(), Some(want), "{available} bytes");
    }
    let mut tiny = engine(bytes(Checkpointing::PerLayer) / 2, &auto);
    let err = tiny.step(&row(0), &mut ChaCha8Rng::seed_from_u64(4)).expect_err("no policy fits").to_string();
    assert!(err.contains("per-layer policy") && err.contains("AdamW moments"), "{err}");
    // The step fits, what goes beside it does not: refused before either is allocated.
    let mut short = engine(bytes(Checkpointing::PerLayer) + beside / 2, &auto);
    let err = short.step(&row(0), &mut ChaCha8Rng::seed_from_u64(4)).expect_err("beside does not fit").to_string();
    assert!(err.contains("per-layer checkpointing") && err.contains("embedding table beside it"), "{err}");
}
