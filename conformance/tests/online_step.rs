//! The online path on the CPU twins: the target's forward (`TargetForward<Host<f64>>`) writes a
//! packed row's features; the drafter's step (`DrafterStep<Host<f64>>`) reads them, the target's
//! embedding table and its LM head where they lie (no host round trip, no second LM head); its
//! loss and every parameter gradient equal the reference's (features from
//! `TargetModel::row_features`, candle autograd) on the same anchors.

use candle_core::{DType, Device, Tensor};
use dflash_conformance::gpu_step::rel_error;
use dflash_conformance::setups::random_target_config;
use dflash_conformance::target_cases::packed_row;
use dflash_conformance::tolerance::STEP_F64;
use dflash_optimized::backend::host::Host;
use dflash_optimized::memory::step::{Checkpointing, StepShape};
use dflash_optimized::model::drafter_step::DrafterStep;
use dflash_optimized::model::target_forward::TargetForward;
use dflash_reference::config::DraftConfig;
use dflash_reference::data::TrainRow;
use dflash_reference::drafter::{random_normal, Drafter};
use dflash_reference::target::TargetModel;
use dflash_reference::train::{Autograd, GradientSource, PreparedRow};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[test]
fn the_online_step_matches_the_reference() {
    for seed in 0..4u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let target_config = random_target_config(&mut rng);
        let (v, layers) = (target_config.dims.vocab_size, target_config.dims.num_layers());
        let mut config = DraftConfig::for_target(&target_config, 2, rng.random_range(2..=4), (v - 1) as u32, 2);
        config.target_layer_ids = vec![layers - 1, 0];
        let target = TargetModel::random(target_config.clone(), seed, 0.3, DType::F64).expect("target");
        let drafter = Drafter::from_fn(config.clone(), |_, shape| {
            let t = random_normal(shape, 0.3, &mut rng, DType::F64)?;
            Ok(if shape.len() == 1 { t.affine(1.0, 1.0)? } else { t })
        })
        .expect("drafter");
        let row = packed_row(&[rng.random_range(3..9), rng.random_range(2..7)], rng.random_range(0..3), v, &mut rng);
        let (s, n, gamma) = (row.tokens.len(), rng.random_range(1..=4), 3.0);
        let anchors_seed = seed + 100;

        // The reference: features on the host, autograd.
        let features = target.row_features(&row, &config.target_layer_ids).expect("features");
        let reference_row = TrainRow::from_row(row.clone(), features).expect("row");
        let head = target.frozen_head();
        let want = Autograd
            .batch_gradients(&drafter, &head, &[&reference_row], n, gamma, &mut ChaCha8Rng::seed_from_u64(anchors_seed))
            .expect("reference gradients");

        // Online: the target's features and tables stay where the forward put them.
        let mut forward = TargetForward::new(Host::<f64>::default(), &target_config, &config.target_layer_ids, s, true)
            .expect("forward");
        forward.load_weights(|name, _| target.weight(name)).expect("weights");
        forward.run(&[&row]).expect("target forward");
        let (embed, lm_head) = forward.frozen_tables();
        let online_row = TrainRow::from_row(row.clone(), Tensor::zeros((s, 0), DType::F64, &Device::Cpu).unwrap())
            .expect("row without host features");
        let prepared =
            PreparedRow::new(&online_row, n, config.block_size, gamma, &mut ChaCha8Rng::seed_from_u64(anchors_seed))
                .expect("prepared");
        let shape = StepShape { context_len: s, num_anchors: prepared.anchors.positions.len(), lm_chunk_rows: 5 };
        let mut step =
            DrafterStep::with_head(Host::<f64>::default(), &config, shape, Checkpointing::PerLayer, None, lm_head)
                .expect("step");
        assert!(step.layout.lm_head.is_none(), "the step holds no second LM head");
        step.load_weights(&drafter).expect("drafter weights");
        step.set_input_device(forward.features_addr(), embed, &prepared.input, &prepared.targets).expect("input");
        let total = prepared.targets.total_weight();
        let got = step.step(1.0 / total.max(f64::MIN_POSITIVE)).expect("step");
        assert!(
            rel_error(&[got.loss], &[want.loss]) <= STEP_F64.rel,
            "seed {seed}: loss {} vs {}",
            got.loss,
            want.loss
        );
        let grads = step.grads_to_host().expect("grads");
        for ((name, var), g) in drafter.named_params().iter().zip(&want.grads) {
            let ours = &grads.iter().find(|(n, _)| n == name).expect("every parameter").1;
            let theirs = g.flatten_all().unwrap().to_vec1::<f64>().unwrap();
            let err = rel_error(ours, &theirs);
            assert!(err <= STEP_F64.rel, "seed {seed}: {name} {:?}: gradient error {err:.2e}", var.dims());
        }
    }
}
