//! The drafter step on the CPU (`backend::host::Host`): the GPU step's driver and typed layout
//! with the CPU twins of its kernels, storing bf16 (the GPU step's twin, its bound), f32 or f64
//! (1e-10), against the reference in f64 on inputs exact in the stored type, under every
//! checkpointing policy (identical gradients), with its heap peak from a counting allocator
//! against its layout.

use dflash_conformance::gpu_step::drafter_step_checks;
use dflash_conformance::heap::{CountingAllocator, HeapMeter};
use dflash_optimized::backend::host::Host;
use dflash_optimized::backend::Elem;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// The counting allocator sees every thread's heap: tests of this binary run one at a time, so a
/// measured peak is one step's even under `cargo test` (nextest already gives each its process).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `case`'s step on the CPU twins storing `E` (per-layer checkpointing, LM-head chunks of 16
/// rows) with the optimizer regions `optimizer`, loaded with the case's weights, LM head and row;
/// and the row's block targets.
fn loaded_step<E: Elem>(
    case: &dflash_conformance::setups::DraftCase,
    optimizer: Option<dflash_optimized::memory::step::OptimizerShape>,
) -> (dflash_optimized::model::drafter_step::DrafterStep<Host<E>>, dflash_reference::loss::BlockTargets) {
    use dflash_optimized::memory::step::{Checkpointing, StepShape};
    use dflash_optimized::model::drafter_step::DrafterStep;
    let (config, b) = (&case.drafter.config, case.drafter.config.block_size);
    let input = dflash_reference::drafter::DraftInput::training(&case.row, &case.anchors, b).expect("input");
    let targets =
        dflash_reference::loss::BlockTargets::new(&case.row.tokens, &case.row.loss_mask, &case.anchors, b, case.gamma);
    let shape = StepShape { context_len: case.row.len(), num_anchors: case.anchors.positions.len(), lm_chunk_rows: 16 };
    let mut step =
        DrafterStep::with_head(Host::<E>::default(), config, shape, Checkpointing::PerLayer, optimizer, None)
            .expect("step");
    step.load_weights(&case.drafter).expect("weights");
    step.load_lm_head(&case.head).expect("lm head");
    step.set_input(&input, &case.head, &targets).expect("input");
    (step, targets)
}

/// Heap the step holds besides its layout's allocation: the layout's per-layer regions and items,
/// the parameter slots and addresses (a few kB), and the key ranges' host copies; 64 KiB bounds
/// them.
const BOOKKEEPING_BYTES: u64 = 64 << 10;

fn check_drafter_step<E: Elem>(label: &str) {
    for seed in [1u64, 2, 3] {
        let checks =
            drafter_step_checks(seed, label, || Ok(Host::<E>::default()), &mut HeapMeter::default(), BOOKKEEPING_BYTES)
                .expect("the drafter step on the CPU");
        for c in &checks {
            println!("{} errors {:?} memory {:?}", c.name, c.errors, c.memory);
            assert!(
                c.pass(),
                "{}: errors {:?} (bound {}), memory (measured, planned) {:?}",
                c.name,
                c.errors,
                c.tolerance,
                c.memory
            );
        }
    }
}

#[test]
fn drafter_step_on_the_cpu_in_bf16_matches_the_reference_within_its_layout() {
    let _serial = one_at_a_time();
    check_drafter_step::<half::bf16>("cpu bf16 step");
}

#[test]
fn drafter_step_on_the_cpu_in_f32_matches_the_reference_within_its_layout() {
    let _serial = one_at_a_time();
    check_drafter_step::<f32>("cpu f32 step");
}

#[test]
fn drafter_step_on_the_cpu_in_f64_matches_the_reference_within_its_layout() {
    let _serial = one_at_a_time();
    check_drafter_step::<f64>("cpu f64 step");
}

/// `DeviceAdamW` on the CPU backend: two accumulated steps, clipped and applied to the fp32 master
/// weights, equal the reference's clipping and AdamW on the same gradients.
#[test]
fn device_adamw_accumulates_clips_and_updates_like_the_reference() {
    let _serial = one_at_a_time();
    use candle_core::{DType, Device, Tensor, Var};
    use dflash_conformance::gpu_step::rel_error;
    use dflash_conformance::setups::gpu_draft_case;
    use dflash_conformance::tolerance::ADAMW_F32;
    use dflash_optimized::backend::download;
    use dflash_optimized::memory::step::OptimizerShape;
    use dflash_optimized::model::drafter_step::param_slots;
    use dflash_optimized::train::adamw::DeviceAdamW;
    use dflash_reference::optim::{clip_grad_norm, AdamW, AdamWConfig};

    let case = gpu_draft_case(4, DType::F32).expect("case");
    let params = param_slots(&case.drafter.config).iter().map(|s| s.len).sum();
    let (mut step, targets) = loaded_step::<half::bf16>(&case, Some(OptimizerShape::whole(params, true)));
    let adam_config = AdamWConfig { lr: 1e-3, weight_decay: 0.01, ..AdamWConfig::default() };
    let mut adam = DeviceAdamW::new(&step, adam_config.clone()).expect("optimizer");
    // Two micro-steps accumulate (the second at half scale), as gradient accumulation does.
    let mut summed: Vec<Vec<f64>> = Vec::new();
    for scale in [1.0, 0.5] {
        step.step(scale / targets.total_weight()).expect("step");
        adam.accumulate(&step).expect("accumulate");
        let grads = step.grads_to_host().expect("grads");
        if summed.is_empty() {
            summed = grads.into_iter().map(|(_, g)| g).collect();
        } else {
            summed.iter_mut().zip(grads).for_each(|(s, (_, g))| s.iter_mut().zip(g).for_each(|(a, b)| *a += b));
        }
    }
    let max_norm = 1e-3; // below the gradients' norm: clipping acts
    let norm = adam.update(&step, 2e-3, max_norm).expect("update");

    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let before: Vec<Vec<f32>> = case.drafter.named_params().iter().map(|(_, v)| flat(v.as_tensor())).collect();
    let params: Vec<(String, Var)> = case
        .drafter
        .named_params()
        .iter()
        .map(|(n, v)| (n.clone(), Var::from_tensor(&v.as_tensor().copy().unwrap()).unwrap()))
        .collect();
    let mut grads: Vec<Tensor> = summed
        .iter()
        .zip(&params)
        .map(|(g, (_, v))| Tensor::from_vec(g.clone(), v.dims(), &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap())
        .collect();
    let want_norm = clip_grad_norm(&params, &mut grads, max_norm).expect("clip");
    assert!(want_norm > max_norm, "the test must exercise clipping");
    assert!(rel_error(&[norm], &[want_norm]) < ADAMW_F32.rel, "norm {norm} vs {want_norm}");
    let mut reference = AdamW::new(&params, adam_config).expect("reference optimizer");
    reference.step(&params, &grads, 2e-3).expect("reference step");

    let master_region = step.layout.optimizer.expect("optimizer regions").master;
    let master: Vec<f32> = download(step.backend(), step.addr(master_region), step.num_params()).expect("master");
    for (slot, (p0, (name, after))) in step.slots().iter().zip(before.iter().zip(&params)) {
        let want = flat(after.as_tensor());
        let got = &master[slot.offset..slot.offset + slot.len];
        let delta = |p: &[f32]| p.iter().zip(p0).map(|(a, b)| f64::from(a - b)).collect::<Vec<_>>();
        let err = rel_error(&delta(got), &delta(&want));
        assert!(err < ADAMW_F32.rel, "{name}: update relative error {err:.2e} ({})", ADAMW_F32.reason);
    }
}

/// A NaN in a weight is reported as a non-finite loss; a NaN that reaches only gradients (a
/// dropped block's rows: no loss and no other block sees them, but `0 * NaN` in the weight
/// gradients) is reported naming the parameter (the training loop names the step).
#[test]
fn nan_in_the_loss_or_a_gradient_is_reported_with_the_tensor() {
    let _serial = one_at_a_time();
    use candle_core::{DType, Tensor};
    use dflash_conformance::setups::gpu_draft_case;
    use dflash_optimized::backend::Backend;
    use dflash_optimized::memory::step::{Checkpointing, StepShape};
    use dflash_optimized::model::drafter_step::{DrafterStep, Grads};
    use dflash_reference::drafter::{DraftInput, Drafter};
    use dflash_reference::loss::BlockTargets;

    let case = gpu_draft_case(5, DType::F32).expect("case");
    let config = case.drafter.config.clone();
    let (b, h) = (config.block_size, config.dims.hidden_size);
    let mut anchors = case.anchors.clone();
    let dropped = anchors.keep.len() - 1;
    anchors.keep[dropped] = false;
    let input = DraftInput::training(&case.row, &anchors, b).expect("input");
    let targets = BlockTargets::new(&case.row.tokens, &case.row.loss_mask, &anchors, b, case.gamma);
    let shape = StepShape { context_len: case.row.len(), num_anchors: anchors.positions.len(), lm_chunk_rows: 8 };
    let new_step = |drafter: &Drafter| {
        let mut step =
            DrafterStep::new(Host::<half::bf16>::default(), &config, shape, Checkpointing::None, false).unwrap();
        step.load_weights(drafter).unwrap();
        step.load_lm_head(&case.head).unwrap();
        step.set_input(&input, &case.head, &targets).unwrap();
        step
    };

    // One NaN element in an up projection: the loss of the first step is NaN.
    let poisoned = Drafter::from_fn(config.clone(), |name, _| {
        let t = case.drafter.param(name).clone();
        if name != "layers.0.mlp.up_proj.weight" {
            return Ok(t);
        }
        let mut v = t.flatten_all()?.to_vec1::<f32>()?;
        v[0] = f32::NAN;
        Ok(Tensor::from_vec(v, t.dims(), t.device())?)
    })
    .unwrap();
    let err = new_step(&poisoned).step(1.0).expect_err("a NaN weight makes a NaN loss").to_string();
    assert!(err.starts_with("loss: ") && err.contains("NaN"), "{err}");

    // NaN block inputs in the dropped block: a finite loss, NaN weight gradients.
    let mut step = new_step(&case.drafter);
    let nan_rows = vec![half::bf16::NAN; b * h];
    // SAFETY: plain-old-data values viewed as their bytes.
    let bytes = unsafe { std::slice::from_raw_parts(nan_rows.as_ptr() as *const u8, nan_rows.len() * 2) };
    step.backend().upload(step.addr(step.layout.residual[0]) + (dropped * b * h * 2) as u64, bytes).unwrap();
    step.step(1.0).expect("the dropped block does not reach the loss");
    step.step(1.0).expect("nor in a second step");
    let err = step.grad_sum_squares(Grads::Step).expect_err("NaN gradients").to_string();
    assert!(err.starts_with("gradient of layers.") && err.contains("NaN"), "{err}");
}

/// The step's recorded predictions (`set_record_predictions`, `predictions`) on the CPU twins
/// storing `E` (f64 or f32, `tolerance` the step's bound), for random drafters and rows (several
/// anchors, `keep = false` blocks, every policy, LM-head chunks of 1 to 7 rows): on every weighted
/// block row the argmax of the reference drafter's logits in f64 on the same (storage-exact)
/// weights and inputs (`Drafter::forward` with the frozen head, as the CPU engine scores its
/// steps), `u32::MAX` on the others; and recording changes neither the loss nor any gradient
/// (bitwise). A near tie, reference logits closer than the step's bound, may go either way: such
/// rows are counted and held to the tie only (none are expected).
fn check_predictions<E: Elem>(storage: candle_core::DType, tolerance: dflash_conformance::tolerance::Tolerance) {
    use candle_core::DType;
    use dflash_conformance::gpu_step::rounded_to;
    use dflash_conformance::setups::gpu_draft_case;
    use dflash_optimized::memory::step::{Checkpointing, StepShape};
    use dflash_optimized::model::drafter_step::DrafterStep;
    use dflash_reference::drafter::DraftInput;
    use dflash_reference::loss::BlockTargets;
    use dflash_reference::speculative::argmax_rows;

    let (mut weighted, mut unweighted, mut near_ties) = (0, 0, 0);
    for seed in [21u64, 22, 23] {
        let case = rounded_to(gpu_draft_case(seed, DType::F64).expect("case"), storage).expect("rounded");
        let config = &case.drafter.config;
        let b = config.block_size;
        let input = DraftInput::training(&case.row, &case.anchors, b).expect("input");
        let targets = BlockTargets::new(&case.row.tokens, &case.row.loss_mask, &case.anchors, b, case.gamma);
        let logits = case.drafter.forward(&case.head, &input).expect("reference forward");
        let want = argmax_rows(&logits).expect("reference argmax");
        let logits: Vec<Vec<f64>> = logits.to_dtype(DType::F64).unwrap().to_vec2().unwrap();
        let shape = StepShape {
            context_len: case.row.len(),
            num_anchors: case.anchors.positions.len(),
            lm_chunk_rows: 1 + seed as usize % 7,
        };
        let policy = Checkpointing::ALL[seed as usize % 3];
        let label = format!("seed {seed} {} S={} Q={}", policy.name(), shape.context_len, want.len());
        let total = targets.total_weight();
        let run = |record: bool| {
            let mut step = DrafterStep::new(Host::<E>::default(), config, shape, policy, false).expect("step");
            step.load_weights(&case.drafter).expect("weights");
            step.load_lm_head(&case.head).expect("lm head");
            step.set_input(&input, &case.head, &targets).expect("input");
            step.set_record_predictions(record);
            let loss = step.step(1.0 / total).expect("step").loss;
            let grads: Vec<Vec<u64>> = step
                .grads_to_host()
                .expect("grads")
                .into_iter()
                .map(|(_, g)| g.into_iter().map(f64::to_bits).collect())
                .collect();
            let predictions = step.predictions();
            // A new input forgets the last step's predictions.
            step.set_input(&input, &case.head, &targets).expect("input");
            assert!(step.predictions().is_err(), "{label}: predictions of a previous input");
            (loss.to_bits(), grads, predictions)
        };
        let (loss_off, grads_off, none) = run(false);
        assert!(none.is_err(), "{label}: predictions without recording");
        let (loss_on, grads_on, predictions) = run(true);
        assert_eq!(loss_on, loss_off, "{label}: recording changed the loss");
        assert!(grads_on == grads_off, "{label}: recording changed a gradient");
        let predictions = predictions.expect("recorded predictions");
        assert_eq!(predictions.len(), want.len(), "{label}: one prediction per block row");
        for (r, (&got, &w)) in predictions.iter().zip(&want).enumerate() {
            if targets.weights[r] == 0.0 {
                assert_eq!(got, u32::MAX, "{label}: row {r} has no CE weight");
                unweighted += 1;
                continue;
            }
            weighted += 1;
            let z = &logits[r];
            let scale = z.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            let runner_up =
                z.iter().enumerate().filter(|&(i, _)| i != w as usize).fold(f64::MIN, |m, (_, &x)| m.max(x));
            if z[w as usize] - runner_up > tolerance.rel * scale {
                assert_eq!(got, w, "{label}: row {r}: the step predicts {got}, the reference {w}");
            } else {
                near_ties += 1;
                assert!(
                    z[w as usize] - z[got as usize] <= tolerance.rel * scale,
                    "{label}: row {r}: {got} is not in the reference's near tie at {w}"
                );
            }
        }
    }
    println!("{weighted} weighted rows, {unweighted} unweighted, {near_ties} near ties");
    assert!(weighted > 0 && unweighted > 0, "the cases must have rows of both kinds");
    assert!(near_ties * 100 <= weighted, "{near_ties} near ties in {weighted} rows");
}

#[test]
fn recorded_predictions_in_f64_are_the_reference_argmax_and_change_nothing() {
    let _serial = one_at_a_time();
    check_predictions::<f64>(candle_core::DType::F64, dflash_conformance::tolerance::STEP_F64);
}

#[test]
fn recorded_predictions_in_f32_are_the_reference_argmax_and_change_nothing() {
    let _serial = one_at_a_time();
    check_predictions::<f32>(candle_core::DType::F32, dflash_conformance::tolerance::STEP_F32);
}

/// One row per update without an accumulator: `DeviceAdamW` reads the step's own stored
/// gradients: two updates give bitwise the master weights, moments, stored weights and norms of
/// the accumulated path, storing bf16 (the GPU's storage) and f32.
#[test]
fn device_adamw_stored_updates_are_bitwise_the_accumulated_ones() {
    let _serial = one_at_a_time();
    stored_is_accumulated::<half::bf16>();
    stored_is_accumulated::<f32>();
}

fn stored_is_accumulated<E: Elem>() {
    use candle_core::DType;
    use dflash_conformance::setups::gpu_draft_case;
    use dflash_optimized::backend::{download, Backend};
    use dflash_optimized::memory::step::OptimizerShape;
    use dflash_optimized::model::drafter_step::param_slots;
    use dflash_optimized::train::adamw::DeviceAdamW;
    use dflash_reference::optim::AdamWConfig;

    let case = gpu_draft_case(5, DType::F32).expect("case");
    let run = |accumulate: bool| {
        let params = param_slots(&case.drafter.config).iter().map(|s| s.len).sum();
        let optimizer = OptimizerShape::whole(params, accumulate);
        let (mut step, targets) = loaded_step::<E>(&case, Some(optimizer));
        let mut adam = DeviceAdamW::new(&step, AdamWConfig { lr: 1e-3, weight_decay: 0.01, ..AdamWConfig::default() })
            .expect("optimizer");
        assert_eq!(adam.accumulates(), accumulate);
        let mut norms = Vec::new();
        for max_norm in [1e-3, 1e3] {
            step.step(1.0 / targets.total_weight()).expect("step");
            adam.accumulate(&step).expect("accumulate");
            norms.push(adam.update(&step, 2e-3, max_norm).expect("update").to_bits());
        }
        let opt = step.layout.optimizer.expect("optimizer regions");
        let acc = |r: dflash_optimized::memory::Region| -> Vec<u64> {
            let v: Vec<<E as Elem>::Acc> = download(step.backend(), step.addr(r), params).expect("download");
            v.into_iter().map(|x| dflash_optimized::ops::Real::to_f64(x).to_bits()).collect()
        };
        let stored: Vec<E> = download(step.backend(), step.addr(step.layout.weights), params).expect("weights");
        let stored: Vec<u64> = stored.into_iter().map(|x| x.to_f64().to_bits()).collect();
        step.backend().synchronize().expect("sync");
        (norms, acc(opt.master), acc(opt.adam_m), acc(opt.adam_v), stored)
    };
    let (own, accumulated) = (run(false), run(true));
    let what = std::any::type_name::<E>();
    assert_eq!(own.0, accumulated.0, "{what}: norms");
    assert!(own.1 == accumulated.1, "{what}: master weights");
    assert!(own.2 == accumulated.2 && own.3 == accumulated.3, "{what}: moments");
    assert!(own.4 == accumulated.4, "{what}: stored weights");
}

/// The gradient buckets (`grad_buckets`) cover every parameter once, from the last to the first
/// in the order the backward finishes them; accumulated as the backward calls each (as a
/// data-parallel worker does before summing it with the others'), on twins that run each
/// operation at once, they equal the whole step's accumulated gradients bitwise: no part of the
/// backward writes a bucket after it was called.
#[test]
fn gradient_buckets_accumulated_during_the_backward_are_the_whole_steps() {
    let _serial = one_at_a_time();
    use candle_core::DType;
    use dflash_conformance::setups::gpu_draft_case;
    use dflash_optimized::backend::download;
    use dflash_optimized::memory::step::OptimizerShape;
    use dflash_optimized::model::drafter_step::{grad_buckets, param_slots};
    use dflash_optimized::train::adamw::DeviceAdamW;
    use dflash_reference::optim::AdamWConfig;

    let case = gpu_draft_case(6, DType::F32).expect("case");
    let config = &case.drafter.config;
    let params: usize = param_slots(config).iter().map(|s| s.len).sum();
    let buckets = grad_buckets(config);
    assert_eq!(buckets.len(), config.dims.num_layers() + 2, "the final norm, each layer, then fc");
    assert_eq!((buckets[0].end, buckets.last().unwrap().start), (params, 0));
    assert!(buckets.windows(2).all(|w| w[1].end == w[0].start && !w[0].is_empty()), "{buckets:?}");
    let accumulated = |by_bucket: bool| -> Vec<u32> {
        let (mut step, targets) = loaded_step::<f32>(&case, Some(OptimizerShape::whole(params, true)));
        let adam = DeviceAdamW::new(&step, AdamWConfig::default()).expect("optimizer");
        let mut called = Vec::new();
        let scale = 1.0 / targets.total_weight();
        match by_bucket {
            true => {
                let mut done = |s: &_, i: usize| {
                    called.push(i);
                    adam.accumulate_range(s, buckets[i].clone())
                };
                step.step_with(scale, &mut done).expect("step");
                assert_eq!(called, (0..buckets.len()).collect::<Vec<_>>(), "each bucket once, in order");
            }
            false => {
                step.step(scale).expect("step");
                adam.accumulate(&step).expect("accumulate");
            }
        }
        let acc = step.accumulator().expect("layout").expect("an accumulator");
        let v: Vec<f32> = download(step.backend(), step.addr(acc), params).expect("download");
        assert!(v.iter().any(|&g| g != 0.0), "the row has gradients");
        v.into_iter().map(f32::to_bits).collect()
    };
    assert!(accumulated(true) == accumulated(false), "bucket by bucket vs the whole step");
}

/// The CPU twins, like a GPU, refuse a step larger than their memory (the host's available
/// memory) before allocating it, naming the device and the largest items: the 8B drafter's
/// step with a thousand layers needs terabytes.
#[test]
fn a_step_larger_than_the_host_memory_is_refused_before_allocating() {
    use dflash_optimized::memory::step::Checkpointing;
    use dflash_optimized::model::drafter_step::DrafterStep;
    let named = dflash_optimized::memory::named::named_configs().into_iter().next().expect("a named config");
    let mut config = named.config;
    let layers = rand::Rng::random_range(&mut rand::rng(), 1000..1100);
    config.dims.layer_kinds = vec![dflash_reference::config::AttnKind::Full; layers];
    let err = DrafterStep::new(Host::<f32>::default(), &config, named.shape, Checkpointing::PerLayer, false)
        .err()
        .expect("a step of terabytes is refused")
        .to_string();
    assert!(err.contains("the step needs") && err.contains("but CPU (") && err.contains("largest items"), "{err}");
}
