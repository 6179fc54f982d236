//! The drafter step on the CPU twins (manual backward per layer, no tape; `Host<f64>` and
//! `Host<f32>`) against the reference (candle autograd): the loss and every trainable
//! parameter's gradient, under every checkpointing policy, on random tiny configs with sliding
//! layers, packed documents and any LM-head chunk, and as the training loop's gradient source.

use candle_core::DType;
use dflash_conformance::gpu_step::rounded_to;
use dflash_conformance::setups::random_draft_case;
use dflash_conformance::tolerance::{assert_close, Tolerance, STEP_F32, STEP_F32_GRADS, STEP_F64};
use dflash_optimized::backend::host::Host;
use dflash_optimized::memory::step::{Checkpointing, StepShape};
use dflash_optimized::model::drafter_step::DrafterStep;
use dflash_optimized::ops::Elem;
use dflash_reference::drafter::DraftInput;
use dflash_reference::loss::{decayed_ce, BlockTargets};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The step storing `E` against the reference in f64 on inputs exact in `storage` (so only the
/// step's own arithmetic is measured; an f32 reference would add its own f32 log-softmax error,
/// ~1e-3 of a loss near 4e-4): the loss within `tol`, each gradient within `grad_tol`.
fn check_case<E: Elem>(seed: u64, storage: DType, (tol, grad_tol): (Tolerance, Tolerance)) {
    let case = rounded_to(random_draft_case(seed, DType::F64).expect("random case"), storage).expect("rounded");
    let b = case.drafter.config.block_size;
    let input = DraftInput::training(&case.row, &case.anchors, b).expect("input");
    let targets = BlockTargets::new(&case.row.tokens, &case.row.loss_mask, &case.anchors, b, case.gamma);
    let logits = case.drafter.forward(&case.head, &input).expect("reference forward");
    let loss = decayed_ce(&logits, &targets).expect("reference loss");
    let reference_grads = loss.backward().expect("reference backward");
    let reference_loss = loss.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();

    let rows = input.layout.num_queries();
    let chunk = ChaCha8Rng::seed_from_u64(seed).random_range(1..=rows + 2);
    let shape =
        StepShape { context_len: case.row.len(), num_anchors: case.anchors.positions.len(), lm_chunk_rows: chunk };
    let total = targets.total_weight();
    let mut per_policy = Vec::new();
    for policy in Checkpointing::ALL {
        let mut step =
            DrafterStep::new(Host::<E>::default(), &case.drafter.config, shape, policy, false).expect("step");
        step.load_weights(&case.drafter).expect("weights");
        step.load_lm_head(&case.head).expect("LM head");
        step.set_input(&input, &case.head, &targets).expect("input");
        let loss = step.step(if total > 0.0 { 1.0 / total } else { 0.0 }).expect("step").loss;
        let loss_err = (loss - reference_loss).abs() / reference_loss.abs().max(f64::MIN_POSITIVE);
        assert!(
            loss_err <= tol.rel || (reference_loss == 0.0 && loss == 0.0),
            "seed {seed} {policy:?}: loss {loss} vs reference {reference_loss} ({loss_err:.2e})"
        );
        let grads = step.grads_to_host().expect("grads");
        assert_eq!(grads.len(), case.drafter.named_params().len(), "one gradient per trainable parameter");
        for ((name, var), (got_name, got)) in case.drafter.named_params().iter().zip(&grads) {
            assert_eq!(name, got_name);
            let got = candle_core::Tensor::from_vec(got.clone(), var.dims(), &candle_core::Device::Cpu).unwrap();
            let want = reference_grads.get(var.as_tensor()).cloned().unwrap_or(var.as_tensor().zeros_like().unwrap());
            assert_close(&format!("seed {seed} {policy:?} grad {name}"), &got, &want, grad_tol);
        }
        per_policy.push(grads);
    }
    // Recomputing a checkpointed layer repeats the same operations: identical gradients.
    for other in &per_policy[1..] {
        assert!(per_policy[0] == *other, "seed {seed}: gradients differ between policies");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// f64: the step on the f64 twins equals autograd to f64 rounding (1e-10).
    #[test]
    fn step_matches_reference_f64(seed in any::<u64>()) {
        check_case::<f64>(seed, DType::F64, (STEP_F64, STEP_F64));
    }

    /// f32: the step on the f32 twins within 1e-4 (the loss) and 1e-3 (each gradient) of the
    /// f64 reference on f32-exact inputs.
    #[test]
    fn step_matches_reference_f32(seed in any::<u64>()) {
        check_case::<f32>(seed, DType::F32, (STEP_F32, STEP_F32_GRADS));
    }
}

/// Three packed rows of 6-16 tokens for `config`, from `seed`.
fn random_rows(
    config: &dflash_reference::config::DraftConfig,
    seed: u64,
    dtype: DType,
) -> Vec<dflash_reference::data::TrainRow> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let feature_dim = config.num_features() * config.dims.hidden_size;
    (0..3)
        .map(|_| {
            dflash_conformance::setups::random_packed_row(
                rng.random_range(6..=16),
                config.dims.vocab_size,
                feature_dim,
                &mut rng,
                dtype,
            )
        })
        .collect::<dflash_reference::Result<_>>()
        .expect("rows")
}

/// The training loop with the step's gradients (`Host<f64>`) follows the reference loop step for
/// step (same anchors, clipping and AdamW) in f64: losses and final parameters agree.
#[test]
fn training_with_the_step_follows_the_reference() {
    use dflash_optimized::train::gradients::HostGradients;
    use dflash_reference::drafter::Drafter;
    use dflash_reference::optim::AdamWConfig;
    use dflash_reference::train::{train_with, Autograd, TrainOptions};

    for seed in [3u64, 11, 29] {
        let case = random_draft_case(seed, DType::F64).expect("random case");
        let config = case.drafter.config.clone();
        let rows = random_rows(&config, seed, DType::F64);
        let copy = || Drafter::from_fn(config.clone(), |name, _| Ok(case.drafter.param(name).copy()?)).expect("copy");
        let (reference, optimized) = (copy(), copy());
        let opts = TrainOptions {
            steps: 6,
            rows_per_step: 2,
            max_anchors: 3,
            optimizer: AdamWConfig { lr: 1e-2, ..AdamWConfig::default() },
            gamma: case.gamma,
            seed,
            ..TrainOptions::default()
        };
        let a = train_with(&reference, &case.head, &rows, &opts, &mut Autograd, |_| {}).expect("reference training");
        let mut host = HostGradients::<f64>::new(Checkpointing::PerLayer, 3);
        let b = train_with(&optimized, &case.head, &rows, &opts, &mut host, |_| {}).expect("training on the step");
        for (ra, rb) in a.iter().zip(&b) {
            let err = (ra.loss - rb.loss).abs() / ra.loss.abs().max(f64::MIN_POSITIVE);
            assert!(err <= STEP_F64.rel, "seed {seed} step {}: loss {} vs {} ({err:.2e})", ra.step, ra.loss, rb.loss);
        }
        for ((name, va), (_, vb)) in reference.named_params().iter().zip(optimized.named_params()) {
            assert_close(&format!("seed {seed} trained {name}"), vb.as_tensor(), va.as_tensor(), STEP_F64);
        }
    }
}

/// The step on the CPU in f32 as the training loop's gradient source: the batch loss and every
/// batch gradient equal the reference's autograd in f32 on the same anchors (rows of different
/// shapes, each row's share of the batch weight).
#[test]
fn host_f32_batch_gradients_match_autograd() {
    use dflash_optimized::train::gradients::HostGradients;
    use dflash_reference::train::{Autograd, GradientSource};

    for seed in [5u64, 17, 23] {
        let case = random_draft_case(seed, DType::F32).expect("random case");
        let config = &case.drafter.config;
        let rows = random_rows(config, seed, DType::F32);
        let refs: Vec<_> = rows.iter().collect();
        let batch = |source: &mut dyn GradientSource| {
            let mut anchor_rng = ChaCha8Rng::seed_from_u64(seed ^ 1);
            source.batch_gradients(&case.drafter, &case.head, &refs, 3, case.gamma, &mut anchor_rng).expect("batch")
        };
        let want = batch(&mut Autograd);
        let got = batch(&mut HostGradients::<f32>::new(Checkpointing::Selective, 2));
        let loss_err = (got.loss - want.loss).abs() / want.loss.abs().max(f64::MIN_POSITIVE);
        assert!(loss_err <= STEP_F32.rel, "seed {seed}: loss {} vs {} ({loss_err:.2e})", got.loss, want.loss);
        assert_eq!(got.weight, want.weight, "seed {seed}: batch weight");
        for ((name, _), (g, w)) in case.drafter.named_params().iter().zip(got.grads.iter().zip(&want.grads)) {
            assert_close(&format!("seed {seed} batch grad {name}"), g, w, STEP_F32);
        }
    }
}
