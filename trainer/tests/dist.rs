//! Data parallelism on the CPU (`DataParallel` over `DeviceEngine<Host<f32>>` workers, one
//! thread each; gradients summed on the host in worker order, or where they live through the
//! in-process group that is NCCL's twin): 2 and 3 workers train like 1 with the same rows per
//! step; a checkpoint of a 2-worker run resumes on 1 and on 3 workers with the same next losses;
//! target workers feeding the drafter workers' slots train like the rows' own features; a
//! drafter or target worker that fails mid-run stops the run with its error, naming it, also
//! while the others wait in the all-reduce.

use std::sync::Arc;
use std::time::Duration;

use dflash_optimized::backend::host::Host;
use dflash_optimized::backend::{Allocation, Backend};
use dflash_optimized::memory::step::Checkpointing;
use dflash_optimized::ops::{bytes_of, stored};
use dflash_reference::data::TrainRow;
use dflash_reference::eval::EvalReport;
use dflash_reference::train::PreparedRow;
use dflash_trainer::builtin::{self, BuiltinSetup};
use dflash_trainer::config::RunConfig;
use dflash_trainer::dist::feed::{FeedEnd, FeedPool, MakeSlotFill, SlotFill};
use dflash_trainer::dist::reduce::{Abort, GradReduce, HostGroup};
use dflash_trainer::dist::{DataParallel, MakeReplica, Replica};
use dflash_trainer::engine::{DeviceEngine, EngineState, Frozen, Share, StepBatch, StepEngine};
use dflash_trainer::rows::RowSource;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The workers' f32 accumulators are summed per worker, then across workers: the same terms in
/// another grouping (f32 rounding ~6e-8 per add over a few rows), not bitwise. Losses.
const DP_F32: f64 = 1e-6;
/// Weights after a few updates, relative to the largest weight: AdamW's update direction
/// m / sqrt(v) carries the gradients' grouping error, amplified on elements whose gradient is
/// small against its own history (measured 1.0e-6 after 6 steps of 2 or 3 workers).
const DP_WEIGHTS_F32: f64 = 1e-5;

fn config() -> RunConfig {
    RunConfig { rows: 8, eval_rows: 1, tau_prompts: 1, continuation_len: 24, anchors: 6, ..RunConfig::builtin() }
}

/// A data-parallel worker's engine: its gradients are summed with the others' (an accumulator).
fn engine(setup: &BuiltinSetup, c: &RunConfig) -> DeviceEngine<Host<f32>> {
    let drafter = builtin::init_drafter(c, &setup.draft_config).expect("drafter");
    DeviceEngine::new(
        || Ok(Host::<f32>::default()),
        drafter,
        Frozen::Host(setup.target.frozen_head()),
        builtin::adamw_config(c),
        &[Checkpointing::PerLayer],
    )
    .with_accumulator()
}

/// `count` workers, each with the built-in setup's engine (made in its thread).
fn workers(count: usize, setup: &Arc<BuiltinSetup>, c: &RunConfig) -> DataParallel {
    let (setup2, c2) = (setup.clone(), c.clone());
    let make: Arc<MakeReplica> = Arc::new(move |_| Ok(Box::new(engine(&setup2, &c2)) as Box<dyn Replica>));
    DataParallel::new(count, setup.draft_config.clone(), make).expect("workers")
}

/// The same, each engine summing its gradients through one rank of an in-process group and
/// fed by `ends` when given.
fn grouped(count: usize, setup: &Arc<BuiltinSetup>, c: &RunConfig, ends: Vec<FeedEnd>) -> DataParallel {
    let ranks = std::sync::Mutex::new(HostGroup::ranks(count).into_iter().map(Some).collect::<Vec<_>>());
    let ends = std::sync::Mutex::new(ends.into_iter().map(Some).collect::<Vec<_>>());
    let (setup2, c2) = (setup.clone(), c.clone());
    let make: Arc<MakeReplica> = Arc::new(move |k| {
        let rank = ranks.lock().unwrap()[k].take().expect("one rank per worker");
        let mut e = engine(&setup2, &c2).with_reduce(Box::new(rank));
        if let Some(end) = ends.lock().unwrap().get_mut(k).and_then(Option::take) {
            e = e.with_feed(end);
        }
        Ok(Box::new(e) as Box<dyn Replica>)
    });
    DataParallel::new(count, setup.draft_config.clone(), make).expect("workers")
}

/// `count` grouped workers sharding the optimizer state over themselves.
fn sharded(count: usize, setup: &Arc<BuiltinSetup>, c: &RunConfig) -> DataParallel {
    let ranks = std::sync::Mutex::new(HostGroup::ranks(count).into_iter().map(Some).collect::<Vec<_>>());
    let (setup2, c2) = (setup.clone(), c.clone());
    let make: Arc<MakeReplica> = Arc::new(move |k| {
        let rank = ranks.lock().unwrap()[k].take().expect("one rank per worker");
        let e = engine(&setup2, &c2).with_reduce(Box::new(rank)).with_sharded_optimizer(k, count);
        Ok(Box::new(e) as Box<dyn Replica>)
    });
    DataParallel::new(count, setup.draft_config.clone(), make).expect("workers").with_sharded_optimizer()
}

/// A target worker's twin for the built-in rows: a row's features (looked up by its tokens)
/// copied into a host slot, as a target's forward would write them.
struct Lookup {
    setup: Arc<BuiltinSetup>,
    dev: Host<f32>,
    slots: Vec<<Host<f32> as Backend>::Alloc>,
}

impl SlotFill for Lookup {
    fn fill(&mut self, slot: usize, row: &dflash_reference::data::Row) -> dflash_trainer::Result<(u64, f64)> {
        let rows = self.setup.data.iter().chain(&self.setup.held_out);
        let r = rows.into_iter().find(|r| r.tokens == row.tokens).expect("a built-in row");
        let values: Vec<f32> = stored(&r.features)?;
        let dst = self.slots[slot].ptr();
        self.dev.upload(dst, bytes_of(&values))?;
        Ok((dst, 0.0))
    }
}

/// A [`Lookup`] with `count` slots.
fn lookup(setup: &Arc<BuiltinSetup>, count: usize) -> dflash_trainer::Result<Box<dyn SlotFill>> {
    let dev = Host::<f32>::default();
    let bytes = setup.data[0].features.elem_count() * 4;
    let slots = (0..count).map(|i| dev.alloc(&format!("slot {i}"), bytes)).collect::<Result<Vec<_>, _>>()?;
    Ok(Box::new(Lookup { setup: setup.clone(), dev, slots }))
}

/// [`Lookup`] target workers on the (labelled) devices `targets` feeding drafter workers on
/// `drafters`: a slot on another device than its drafter's is copied peer to peer.
fn lookup_feed(targets: &[usize], drafters: &[usize], setup: &Arc<BuiltinSetup>) -> (FeedPool, Vec<FeedEnd>) {
    let setup = setup.clone();
    let make: Arc<MakeSlotFill> = Arc::new(move |_, count| lookup(&setup, count));
    FeedPool::new(targets, drafters, make).expect("feed")
}

/// Step `step`'s batch: 4 rows of the data, as one micro-batch.
fn batch<'a>(setup: &'a BuiltinSetup, step: usize, c: &RunConfig) -> StepBatch<'a> {
    let n = setup.data.len();
    StepBatch {
        step,
        micro_batches: vec![(0..4).map(|i| &setup.data[(4 * step + i) % n]).collect()],
        anchors: c.anchors,
        gamma: c.gamma_for(setup.draft_config.block_size),
        lr: 3e-3,
        clip_norm: 1.0,
        want_stats: step.is_multiple_of(2),
    }
}

fn losses(
    engine: &mut dyn StepEngine,
    setup: &BuiltinSetup,
    c: &RunConfig,
    steps: std::ops::Range<usize>,
    rng: &mut ChaCha8Rng,
) -> Vec<f64> {
    steps.map(|s| engine.step(&batch(setup, s, c), rng).expect("step").loss).collect()
}

fn close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len());
    for (s, (x, y)) in a.iter().zip(b).enumerate() {
        let rel = (x - y).abs() / y.abs();
        assert!(rel <= DP_F32, "{what}: step {s}: {x} vs {y} (rel {rel:.2e})");
    }
}

#[test]
fn two_and_three_workers_train_like_one() {
    let c = config();
    let setup = Arc::new(builtin::setup(&c).expect("setup"));
    let mut one = engine(&setup, &c);
    let want = losses(&mut one, &setup, &c, 0..6, &mut ChaCha8Rng::seed_from_u64(4));
    for count in [2, 3] {
        let mut dp = workers(count, &setup, &c);
        let got = losses(&mut dp, &setup, &c, 0..6, &mut ChaCha8Rng::seed_from_u64(4));
        close(&got, &want, &format!("{count} workers"));
        // The weights too (from worker 0; every replica applies the same update).
        close_weights(&dp.state().unwrap(), &StepEngine::state(&one).unwrap(), &format!("{count} workers"));
    }
}

/// Every weight of `a` within [`DP_WEIGHTS_F32`] of `b`'s (max error over max magnitude).
fn close_weights(a: &EngineState, b: &EngineState, what: &str) {
    for ((name, x), y) in a.names.iter().zip(&a.params).zip(&b.params) {
        let (x, y) =
            (x.flatten_all().unwrap().to_vec1::<f32>().unwrap(), y.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        let err = x.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
        let scale = y.iter().map(|q| q.abs()).fold(0.0f32, f32::max);
        assert!(f64::from(err / scale) <= DP_WEIGHTS_F32, "{what}: {name}: {err:.2e} of {scale:.2e}");
    }
}

#[test]
fn a_two_worker_checkpoint_resumes_on_one_and_three_workers() {
    let c = config();
    let setup = Arc::new(builtin::setup(&c).expect("setup"));
    let mut two = workers(2, &setup, &c);
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    losses(&mut two, &setup, &c, 0..3, &mut rng);
    let (state, rng_3) = (two.state().unwrap(), rng.clone());
    let want = losses(&mut two, &setup, &c, 3..6, &mut rng);
    for count in [1, 3] {
        let mut resumed = workers(count, &setup, &c);
        resumed.restore(&state).unwrap();
        let got = losses(&mut resumed, &setup, &c, 3..6, &mut rng_3.clone());
        close(&got, &want, &format!("resumed on {count}"));
    }
}

/// A replica that fails at its `fail_at`-th accumulation (with an error, or a panic).
struct Failing {
    inner: DeviceEngine<Host<f32>>,
    calls: usize,
    fail_at: usize,
    panics: bool,
}

impl Replica for Failing {
    fn accumulate_rows(
        &mut self,
        rows: &[(&TrainRow, &PreparedRow)],
        total: f64,
        want: bool,
    ) -> dflash_trainer::Result<Share> {
        self.calls += 1;
        if self.calls == self.fail_at && self.panics {
            panic!("index out of bounds (injected)");
        }
        if self.calls == self.fail_at {
            return Err(dflash_trainer::Error::option("device", "out of memory (injected)"));
        }
        Replica::accumulate_rows(&mut self.inner, rows, total, want)
    }
    fn accumulated(&self) -> dflash_trainer::Result<Vec<f64>> {
        Replica::accumulated(&self.inner)
    }
    fn set_accumulated(&mut self, shape: (usize, usize), values: &[f64]) -> dflash_trainer::Result<()> {
        Replica::set_accumulated(&mut self.inner, shape, values)
    }
    fn apply(&mut self, lr: f64, clip: f64) -> dflash_trainer::Result<std::result::Result<f64, String>> {
        Replica::apply(&mut self.inner, lr, clip)
    }
    fn discard(&mut self) -> dflash_trainer::Result<()> {
        Replica::discard(&mut self.inner)
    }
    fn state(&self) -> dflash_trainer::Result<EngineState> {
        Replica::state(&self.inner)
    }
    fn restore(&mut self, state: &EngineState) -> dflash_trainer::Result<()> {
        Replica::restore(&mut self.inner, state)
    }
    fn evaluate(
        &mut self,
        rows: &dyn RowSource,
        n: usize,
        gamma: f64,
        seed: u64,
    ) -> dflash_trainer::Result<EvalReport> {
        Replica::evaluate(&mut self.inner, rows, n, gamma, seed)
    }
    fn reduce_on_device(&mut self, shape: (usize, usize)) -> dflash_trainer::Result<bool> {
        Replica::reduce_on_device(&mut self.inner, shape)
    }
    fn abort(&self) -> Option<Abort> {
        Replica::abort(&self.inner)
    }
}

#[test]
fn a_failing_worker_stops_the_run_with_its_error() {
    let c = config();
    let setup = Arc::new(builtin::setup(&c).expect("setup"));
    let (setup2, c2) = (setup.clone(), c.clone());
    let make: Arc<MakeReplica> = Arc::new(move |k| {
        let inner = engine(&setup2, &c2);
        Ok(match k {
            1 => Box::new(Failing { inner, calls: 0, fail_at: 3, panics: false }) as Box<dyn Replica>,
            _ => Box::new(inner),
        })
    });
    let mut dp = DataParallel::new(2, setup.draft_config.clone(), make).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for s in 0..2 {
        dp.step(&batch(&setup, s, &c), &mut rng).expect("the first steps run");
    }
    let message = dp.step(&batch(&setup, 2, &c), &mut rng).unwrap_err().to_string();
    assert!(message.contains("drafter worker 1") && message.contains("out of memory (injected)"), "{message}");
    // A worker whose engine cannot be made is named before any step.
    let (setup3, c3) = (setup.clone(), c.clone());
    let make: Arc<MakeReplica> = Arc::new(move |k| match k {
        2 => Err(dflash_trainer::Error::option("device", "no such GPU")),
        _ => Ok(Box::new(engine(&setup3, &c3)) as Box<dyn Replica>),
    });
    let message = DataParallel::new(3, setup.draft_config.clone(), make).err().expect("refused").to_string();
    assert!(message.contains("drafter worker 2") && message.contains("no such GPU"), "{message}");
}

/// The in-process group (NCCL's twin) sums where the gradients live: 2 and 3 workers train like
/// 1, and like the host-summed workers; the workers report the policy their steps took.
#[test]
fn workers_reducing_in_their_group_train_like_one() {
    let c = config();
    let setup = Arc::new(builtin::setup(&c).expect("setup"));
    let want = losses(&mut engine(&setup, &c), &setup, &c, 0..5, &mut ChaCha8Rng::seed_from_u64(6));
    for count in [1, 2, 3] {
        let mut dp = grouped(count, &setup, &c, Vec::new());
        assert_eq!(dp.checkpointing(), None, "no step laid out before the first rows");
        let got = losses(&mut dp, &setup, &c, 0..5, &mut ChaCha8Rng::seed_from_u64(6));
        close(&got, &want, &format!("{count} workers in a group"));
        // The policy worker 0's step took, for the run's summary.
        assert_eq!(dp.checkpointing(), Some(Checkpointing::PerLayer), "{count} workers");
    }
}

/// A [`HostRank`] that logs each sum it is asked for (the bucket's address and length, and
/// whether it came during `accumulate_rows`) and each wait (`None`).
struct Logged {
    rank: dflash_trainer::dist::reduce::HostRank,
    in_rows: Arc<std::sync::atomic::AtomicBool>,
    log: std::sync::mpsc::Sender<Option<(u64, usize, bool)>>,
}

impl GradReduce for Logged {
    fn all_reduce_sum_f32(&self, addr: u64, count: usize) -> dflash_trainer::Result<()> {
        let during = self.in_rows.load(std::sync::atomic::Ordering::SeqCst);
        self.log.send(Some((addr, count, during))).unwrap();
        self.rank.all_reduce_sum_f32(addr, count)
    }
    fn wait(&self) -> dflash_trainer::Result<()> {
        self.log.send(None).unwrap();
        Ok(())
    }
    fn abort(&self) -> Abort {
        self.rank.abort()
    }
}

/// The gradient sums overlap the backward: a worker with rows starts every bucket's sum
/// (`grad_buckets`: from the last parameters to the first) during its last row's backward and
/// waits for them once; a worker without rows sums the same buckets in the same order when it
/// reduces. Summed bucket by bucket, 2 workers give bitwise the losses and weights of 2 workers
/// whose whole accumulators the host adds (two f32 terms: one correctly rounded sum either way).
#[test]
fn workers_sum_their_gradient_buckets_during_the_backward() {
    use dflash_optimized::model::drafter_step::grad_buckets;
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let c = config();
    let setup = Arc::new(builtin::setup(&c).expect("setup"));
    let buckets: Vec<(usize, usize)> =
        grad_buckets(&setup.draft_config).into_iter().map(|b| (b.start, b.len())).collect();
    let (in_rows, idle) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let ((log_0, logged_0), (log_1, logged_1)) = (std::sync::mpsc::channel(), std::sync::mpsc::channel());
    let mut ranks = HostGroup::ranks(2).into_iter();
    let rank_0 = Logged { rank: ranks.next().unwrap(), in_rows: in_rows.clone(), log: log_0 };
    let rank_1 = Logged { rank: ranks.next().unwrap(), in_rows: idle, log: log_1 };
    let step = batch(&setup, 0, &c);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let (rows, total) = dflash_trainer::engine::prepare_rows(&step, setup.draft_config.block_size, &mut rng).unwrap();
    let refs: Vec<_> = rows.iter().map(|(r, p)| (*r, p)).collect();
    let shape = (rows[0].0.len(), c.anchors);
    // Worker 0 steps every row, worker 1 (no rows) reduces: one thread each, as in a run.
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut worker_0 = engine(&setup, &c).with_reduce(Box::new(rank_0));
            in_rows.store(true, SeqCst);
            worker_0.accumulate_rows(&refs, total, false).expect("rows");
            in_rows.store(false, SeqCst);
            worker_0.reduce_on_device(shape).expect("reduce");
        });
        let mut worker_1 = engine(&setup, &c).with_reduce(Box::new(rank_1));
        worker_1.accumulate_rows(&[], total, false).expect("no rows");
        worker_1.reduce_on_device(shape).expect("reduce");
    });
    // Each worker's sums as (offset in its accumulator, length, during its rows), then its wait.
    let sums = |log: std::sync::mpsc::Receiver<Option<(u64, usize, bool)>>| {
        let log: Vec<_> = log.try_iter().collect();
        assert_eq!(log.last(), Some(&None), "the wait comes last");
        let sums: Vec<_> = log.into_iter().flatten().collect();
        let base = sums.iter().map(|s| s.0).min().unwrap();
        sums.into_iter().map(|(a, n, during)| (((a - base) / 4) as usize, n, during)).collect::<Vec<_>>()
    };
    let with = |during: bool| buckets.iter().map(|&(o, n)| (o, n, during)).collect::<Vec<_>>();
    assert_eq!(sums(logged_0), with(true), "worker 0: every bucket during its rows, in the backward's order");
    assert_eq!(sums(logged_1), with(false), "worker 1: the same buckets in the same order when it reduces");
    // Bitwise the host's sums of the whole accumulators.
    let mut host = workers(2, &setup, &c);
    let mut grouped = grouped(2, &setup, &c, Vec::new());
    let (a, b) = (
        losses(&mut host, &setup, &c, 0..4, &mut ChaCha8Rng::seed_from_u64(7)),
        losses(&mut grouped, &setup, &c, 0..4, &mut ChaCha8Rng::seed_from_u64(7)),
    );
    assert_eq!(a, b, "losses");
    let (x, y) = (host.state().unwrap(), grouped.state().unwrap());
    assert_eq!(x.first_difference(&y).unwrap(), None, "weights and moments");
}

/// Target workers feeding the drafter workers' slots (rows queued interleaved, slots given back
/// after each step): the same features as the rows carry, so 1 target + 1 drafter worker gives
/// the one engine's losses bitwise, and 2 targets + 2 drafters (and 1 target + 2 drafters, its
/// weights too) within the grouping bound; the train steps say how long each side waited.
#[test]
fn fed_workers_train_like_the_rows_own_features() {
    let c = config();
    let setup = Arc::new(builtin::setup(&c).expect("setup"));
    let want = losses(&mut engine(&setup, &c), &setup, &c, 0..5, &mut ChaCha8Rng::seed_from_u64(2));
    let (pool, ends) = lookup_feed(&[0], &[0], &setup);
    let mut one = grouped(1, &setup, &c, ends).with_feed(pool);
    let got = losses(&mut one, &setup, &c, 0..5, &mut ChaCha8Rng::seed_from_u64(2));
    assert_eq!(got, want, "1 target + 1 drafter worker");
    assert!(one.name().contains("fed by 1 target workers"), "{}", one.name());
    let (pool, ends) = lookup_feed(&[0, 0], &[0, 0], &setup);
    let mut two = grouped(2, &setup, &c, ends).with_feed(pool);
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let mut got = Vec::new();
    for s in 0..5 {
        let outcome = two.step(&batch(&setup, s, &c), &mut rng).expect("step");
        let (drafters, targets) = outcome.waits.expect("a fed step reports its waits");
        assert!(drafters >= 0.0 && targets >= 0.0);
        got.push(outcome.loss);
    }
    close(&got, &want, "2 target + 2 drafter workers");
    // 1 target worker feeding 2 drafter workers: the one engine's losses and weights.
    let mut single = engine(&setup, &c);
    losses(&mut single, &setup, &c, 0..5, &mut ChaCha8Rng::seed_from_u64(2));
    let (pool, ends) = lookup_feed(&[0], &[0, 0], &setup);
    let mut fed = grouped(2, &setup, &c, ends).with_feed(pool);
    let got = losses(&mut fed, &setup, &c, 0..5, &mut ChaCha8Rng::seed_from_u64(2));
    close(&got, &want, "1 target + 2 drafter workers");
    close_weights(&fed.state().unwrap(), &StepEngine::state(&single).unwrap(), "1 target + 2 drafter workers");
    // Evaluation on worker 0 reads fed rows too: the same report as the one engine's.
    let held: &dyn RowSource = &setup.held_out;
    let (a, b) = (two.evaluate(held, 6, 4.0, 1).unwrap(), {
        let mut e = engine(&setup, &c);
        StepEngine::restore(&mut e, &two.state().unwrap()).unwrap();
        StepEngine::evaluate(&mut e, held, 6, 4.0, 1).unwrap()
    });
    assert!((a.loss - b.loss).abs() <= DP_F32 * b.loss.abs(), "{} vs {}", a.loss, b.loss);
}

/// Target workers on other devices than their drafter workers': each slot is copied peer to
/// peer into the drafter's step and given back before the step. The same features, so a target on device 1
/// feeding a drafter on device 0 gives the one engine's losses and evaluation bitwise, and
/// targets on devices 0 and 1 feeding drafters on 0 and 1 (each drafter copying some slots on
/// its device, others from the other) the same within the grouping bound.
#[test]
fn workers_fed_from_other_devices_train_like_the_rows_own_features() {
    let c = config();
    let setup = Arc::new(builtin::setup(&c).expect("setup"));
    let mut alone = engine(&setup, &c);
    let want = losses(&mut alone, &setup, &c, 0..5, &mut ChaCha8Rng::seed_from_u64(3));
    let (pool, ends) = lookup_feed(&[1], &[0], &setup);
    assert!(ends[0].copies(), "a slot on device 1 is copied from another device");
    let mut apart = grouped(1, &setup, &c, ends).with_feed(pool);
    assert_eq!(losses(&mut apart, &setup, &c, 0..5, &mut ChaCha8Rng::seed_from_u64(3)), want, "copied");
    let held: &dyn RowSource = &setup.held_out;
    let (a, b) = (apart.evaluate(held, 6, 4.0, 1).unwrap(), StepEngine::evaluate(&mut alone, held, 6, 4.0, 1).unwrap());
    assert_eq!(a.loss, b.loss, "evaluation from copied slots");
    let (pool, ends) = lookup_feed(&[0, 1], &[0, 1], &setup);
    assert!(ends.iter().all(FeedEnd::copies), "each drafter has a target on another device");
    let mut mixed = grouped(2, &setup, &c, ends).with_feed(pool);
    close(&losses(&mut mixed, &setup, &c, 0..5, &mut ChaCha8Rng::seed_from_u64(3)), &want, "mixed");
}

/// A drafter worker that fails while the others wait in the group's all-reduce: the run stops
/// at once with its error (the others' reductions aborted, no hang).
/// A worker that fails (with an error, or a panic) while the others wait in their group's
/// reduction stops the step at once, with its message.
#[test]
fn a_failing_worker_stops_the_group_at_once() {
    a_failing_worker_stops_the_group(false);
}

#[test]
fn a_panicking_worker_stops_the_group_at_once() {
    a_failing_worker_stops_the_group(true);
}

fn a_failing_worker_stops_the_group(panics: bool) {
    let c = config();
    let setup = Arc::new(builtin::setup(&c).expect("setup"));
    let ranks = std::sync::Mutex::new(HostGroup::ranks(3).into_iter().map(Some).collect::<Vec<_>>());
    let (setup2, c2) = (setup.clone(), c.clone());
    let make: Arc<MakeReplica> = Arc::new(move |k| {
        let rank = ranks.lock().unwrap()[k].take().expect("one rank per worker");
        let inner = engine(&setup2, &c2).with_reduce(Box::new(rank));
        Ok(match k {
            2 => Box::new(Failing { inner, calls: 0, fail_at: 2, panics }) as Box<dyn Replica>,
            _ => Box::new(inner),
        })
    });
    let mut dp = DataParallel::new(3, setup.draft_config.clone(), make).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    dp.step(&batch(&setup, 0, &c), &mut rng).expect("the first step runs");
    let started = std::time::Instant::now();
    let message = dp.step(&batch(&setup, 1, &c), &mut rng).unwrap_err().to_string();
    let injected = match panics {
        true => "panicked: index out of bounds (injected)",
        false => "out of memory (injected)",
    };
    assert!(message.contains("drafter worker 2") && message.contains(injected), "{message}");
    assert!(started.elapsed().as_secs() < 10, "stopped after {:?}", started.elapsed());
    // Nothing more is sent to workers that may be mid-command.
    let again = dp.step(&batch(&setup, 2, &c), &mut rng).unwrap_err().to_string();
    assert!(again.contains("earlier error"), "{again}");
}

/// A target worker that fails stops the step with its error, naming it; so does one whose
/// forward cannot be made, before any step.
#[test]
fn a_failing_target_worker_stops_the_run_with_its_error() {
    struct Broken;
    impl SlotFill for Broken {
        fn fill(&mut self, _: usize, _: &dflash_reference::data::Row) -> dflash_trainer::Result<(u64, f64)> {
            Err(dflash_trainer::Error::option("target", "the forward failed (injected)"))
        }
    }
    let c = config();
    let setup = Arc::new(builtin::setup(&c).expect("setup"));
    // Target worker 1 fails; target worker 0 works: the error names 1, whichever drafter says it.
    let setup2 = setup.clone();
    let make: Arc<MakeSlotFill> = Arc::new(move |t, count| match t {
        1 => Ok(Box::new(Broken) as _),
        _ => lookup(&setup2, count),
    });
    let (pool, ends) = FeedPool::new(&[0, 0], &[0, 0], make).unwrap();
    let mut dp = grouped(2, &setup, &c, ends).with_feed(pool);
    let message = dp.step(&batch(&setup, 0, &c), &mut ChaCha8Rng::seed_from_u64(0)).unwrap_err().to_string();
    assert!(message.contains("target worker 1") && message.contains("the forward failed (injected)"), "{message}");
    let make: Arc<MakeSlotFill> = Arc::new(|t, _| match t {
        1 => Err(dflash_trainer::Error::option("device", "no such GPU")),
        _ => Ok(Box::new(Broken) as _),
    });
    let message = FeedPool::new(&[0, 0], &[0], make).err().expect("refused").to_string();
    assert!(message.contains("target worker 1") && message.contains("no such GPU"), "{message}");
}

/// A target worker that panics stops the step with its message; one stuck on its device (its
/// forward never returns) stops it at the drafters' timeout, naming them, and the engine is
/// dropped without waiting for the stuck thread.
#[test]
fn a_panicking_or_stuck_target_worker_stops_the_run() {
    struct Panics;
    impl SlotFill for Panics {
        fn fill(&mut self, _: usize, _: &dflash_reference::data::Row) -> dflash_trainer::Result<(u64, f64)> {
            panic!("the kernel's index out of bounds (injected)")
        }
    }
    struct Stuck;
    impl SlotFill for Stuck {
        fn fill(&mut self, _: usize, _: &dflash_reference::data::Row) -> dflash_trainer::Result<(u64, f64)> {
            loop {
                std::thread::park();
            }
        }
    }
    let c = config();
    let setup = Arc::new(builtin::setup(&c).expect("setup"));
    let make: Arc<MakeSlotFill> = Arc::new(|_, _| Ok(Box::new(Panics) as _));
    let (pool, ends) = FeedPool::new(&[0], &[0, 0], make).unwrap();
    let mut dp = grouped(2, &setup, &c, ends).with_feed(pool);
    let message = dp.step(&batch(&setup, 0, &c), &mut ChaCha8Rng::seed_from_u64(0)).unwrap_err().to_string();
    assert!(message.contains("target worker 0") && message.contains("panicked: the kernel's index"), "{message}");

    let timeout = Duration::from_millis(rand::rng().random_range(500..1500));
    let make: Arc<MakeSlotFill> = Arc::new(|_, _| Ok(Box::new(Stuck) as _));
    let (pool, ends) = FeedPool::new(&[0], &[0, 0], make).unwrap();
    let mut dp = grouped(2, &setup, &c, ends).with_feed(pool).with_timeout(timeout);
    let started = std::time::Instant::now();
    let message = dp.step(&batch(&setup, 0, &c), &mut ChaCha8Rng::seed_from_u64(0)).unwrap_err().to_string();
    assert!(message.contains("drafter workers [0, 1]") && message.contains("no answer within"), "{message}");
    drop(dp);
    let took = started.elapsed();
    assert!(took >= timeout && took < timeout + Duration::from_secs(5), "{took:?} for a timeout of {timeout:?}");
}

/// The pipeline's balance from its waits: 1 target worker and 2 drafter workers over 10 s, the
/// drafters idle half their time and the target never: per row the target is busy as long as a
/// drafter (10 s over R rows against 2 x 5 s over R rows), so 1 target worker per drafter worker
/// balances them; with both sides busy, and with the targets idle, the advice says so.
#[test]
fn the_pipeline_balance_comes_from_both_sides_waits() {
    use dflash_trainer::dist::feed::balance;
    let (ratio, line) = balance((10.0, 0.0), 10.0, 1, 2).expect("a balance");
    assert!((ratio - 1.0).abs() < 1e-12, "{ratio}");
    assert!(line.contains("waited 50%") && line.contains("more target workers"), "{line}");
    let (ratio, line) = balance((0.2, 0.3), 10.0, 2, 2).unwrap();
    assert!((ratio - 2.0 * 0.985 / (2.0 * 0.99)).abs() < 1e-12 && line.contains("both sides are busy"), "{line}");
    let (ratio, line) = balance((0.0, 12.0), 10.0, 2, 1).unwrap();
    assert!((ratio - 2.0 * 0.4).abs() < 1e-12 && line.contains("fewer target workers"), "{ratio} {line}");
    assert!(balance((0.0, 0.0), 0.0, 1, 1).is_none());
}

/// The AdamW state sharded over 2 and 3 workers: each updates its shard of the same all-reduced
/// gradients with the same per-element arithmetic and the same global norm, then the workers
/// gather the weights, so losses and the joined state (masters, moments) are bitwise those of
/// the unsharded workers; a sharded checkpoint resumes unsharded and on another count.
#[test]
fn sharded_optimizer_state_trains_like_the_whole() {
    let c = config();
    let setup = Arc::new(builtin::setup(&c).expect("setup"));
    for count in [2, 3] {
        let (mut whole, mut split) = (grouped(count, &setup, &c, Vec::new()), sharded(count, &setup, &c));
        let want = losses(&mut whole, &setup, &c, 0..4, &mut ChaCha8Rng::seed_from_u64(9));
        let got = losses(&mut split, &setup, &c, 0..4, &mut ChaCha8Rng::seed_from_u64(9));
        assert_eq!(got, want, "{count} sharded workers");
        let difference = split.state().unwrap().first_difference(&whole.state().unwrap()).unwrap();
        assert_eq!(difference, None, "{count} sharded workers: every tensor, bitwise");
    }
    // A 2-worker sharded run's state at step 3, resumed whole on 2 and sharded on 3 workers.
    let mut two = sharded(2, &setup, &c);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    losses(&mut two, &setup, &c, 0..3, &mut rng);
    let (state, rng_3) = (two.state().unwrap(), rng.clone());
    let want = losses(&mut two, &setup, &c, 3..5, &mut rng);
    let mut whole = grouped(2, &setup, &c, Vec::new());
    whole.restore(&state).unwrap();
    assert_eq!(losses(&mut whole, &setup, &c, 3..5, &mut rng_3.clone()), want, "resumed whole on 2");
    let mut three = sharded(3, &setup, &c);
    three.restore(&state).unwrap();
    close(&losses(&mut three, &setup, &c, 3..5, &mut rng_3.clone()), &want, "resumed sharded on 3");
}

/// Every process's workers' parts of a step's rows, by `part_range`: contiguous, in rank order,
/// covering the rows once, each part of `n / parts` rows or one more (the first ones); alone, a
/// data-parallel engine owns every row.
#[test]
fn the_processes_parts_cover_the_rows_once() {
    let mut rng = rand::rng();
    for _ in 0..200 {
        let (n, local, world) = (rng.random_range(0..100), rng.random_range(1..5), rng.random_range(1..5));
        let parts = local * world;
        let mut next = 0;
        for rank in 0..world {
            let range = dflash_trainer::dist::part_range(n, parts, rank * local..(rank + 1) * local);
            assert_eq!(range.start, next, "n {n}, {local} x {world}, rank {rank}");
            let sizes: Vec<usize> = (rank * local..(rank + 1) * local)
                .map(|k| dflash_trainer::dist::part_range(n, parts, k..k + 1).len())
                .collect();
            assert!(sizes.iter().all(|&s| s == n / parts || s == n / parts + 1), "{sizes:?}");
            assert_eq!(sizes.iter().sum::<usize>(), range.len());
            next = range.end;
        }
        assert_eq!(next, n, "n {n}, {local} x {world}");
    }
    let c = config();
    let setup = Arc::new(builtin::setup(&c).expect("setup"));
    assert_eq!(workers(2, &setup, &c).own_rows(9), 0..9);
}
