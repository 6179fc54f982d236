//! [`StepEngine`]: what the run loop asks of whatever computes a training step. One step takes
//! the rows of its micro-batches, draws their anchors from the run's RNG (row by row, in
//! order), computes the loss and gradients, and, unless a loss or gradient is NaN or Inf,
//! clips and applies AdamW. The CPU engines ([`CpuEngine`]: the reference's autograd, or the
//! GPU step's driver on the CPU twins), and [`DeviceEngine`]: the optimized step on a backend
//! (the GPU, or the twins), its state downloaded for checkpoints and uploaded on resume, the
//! target's forward online when [`Frozen::Target`]. `dist::DataParallel` runs several.

use candle_core::{DType, Tensor};
use dflash_optimized::backend::{download, Allocation, Backend};
use dflash_optimized::flops::step_model_flops;
use dflash_optimized::memory::step::{
    fastest_fitting, optimizer_shard, Checkpointing, OptimizerShape, StepLayout, StepShape,
};
use dflash_optimized::model::drafter_step::{grad_buckets, DrafterStep};
use dflash_optimized::model::TargetFeatures;
use dflash_optimized::ops::attention::ranges::KeyRanges;
use dflash_optimized::ops::{bytes_of, stored, with_stored, Elem, Real};
use dflash_optimized::train::adamw::DeviceAdamW;
use dflash_optimized::train::gradients::HostGradients;
use dflash_reference::config::DraftConfig;
use dflash_reference::data::Row;
use dflash_reference::data::TrainRow;
use dflash_reference::drafter::{Drafter, FrozenHead};
use dflash_reference::eval::{evaluate_rows, BlockStats, EvalReport, Evaluation};
use dflash_reference::optim::{clip_grad_norm, collect_grads, AdamW, AdamWConfig};
use dflash_reference::speculative::argmax_rows;
use dflash_reference::train::{batch_loss_with_stats, GradientSource, PreparedRow};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::config::StepKind;
use crate::dist::feed::{FedFeatures, FeedEnd};
use crate::dist::reduce::{Abort, GradReduce};
use crate::error::{Error, Result};
use crate::rows::RowSource;

/// One optimizer step's work.
pub struct StepBatch<'a> {
    /// 0-based step index (for messages).
    pub step: usize,
    /// The rows of each micro-batch, accumulated into one update.
    pub micro_batches: Vec<Vec<&'a TrainRow>>,
    pub anchors: usize,
    pub gamma: f64,
    pub lr: f64,
    pub clip_norm: f64,
    /// Whether to measure per-offset accuracy and tau_hat on this step's blocks.
    pub want_stats: bool,
}

impl StepBatch<'_> {
    /// The options of the step without its rows (to give it other rows).
    pub fn clone_options(&self) -> StepBatch<'static> {
        StepBatch {
            step: self.step,
            micro_batches: Vec::new(),
            anchors: self.anchors,
            gamma: self.gamma,
            lr: self.lr,
            clip_norm: self.clip_norm,
            want_stats: self.want_stats,
        }
    }
}

/// What one step did.
#[derive(Clone, Debug)]
pub struct StepOutcome {
    /// `sum w*CE / sum w` over the step's rows.
    pub loss: f64,
    /// `sum w` over the step's rows.
    pub weight: f64,
    /// Global gradient norm before clipping (NaN when skipped).
    pub grad_norm: f64,
    /// The first non-finite value's tensor (`loss` or `gradient of NAME`): no update was applied.
    pub non_finite: Option<String>,
    /// Accuracy and tau_hat of the step's blocks (with the weights before the update), when asked.
    pub stats: Option<BlockStats>,
    /// Model FLOPs of the step (drafter and, online, the target's forward; 0 when not counted):
    /// `dflash_optimized::flops`.
    pub flops: f64,
    /// The device memory the step and the target's forward were planned to take (bytes).
    pub device_bytes: Option<u64>,
    /// With target workers (`dist::feed`): the seconds the drafter workers waited for the
    /// rows' features, and the seconds the target workers then waited for the drafters' step.
    pub waits: Option<(f64, f64)>,
}

/// Everything of an engine that exact resumption needs: fp32 master weights and AdamW moments
/// (in the drafter's parameter order) and AdamW's step count.
#[derive(Clone, Debug)]
pub struct EngineState {
    pub names: Vec<String>,
    pub params: Vec<Tensor>,
    pub m: Vec<Tensor>,
    pub v: Vec<Tensor>,
    pub t: i32,
}

impl EngineState {
    /// The first difference from `other`, bitwise (the step count, then each tensor of the
    /// weights and the two moments, named), or `None` when the two are the same state.
    pub fn first_difference(&self, other: &EngineState) -> Result<Option<String>> {
        if self.t != other.t {
            return Ok(Some(format!("step count {} vs {}", self.t, other.t)));
        }
        let bits = |t: &Tensor| -> Result<Vec<u32>> {
            Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
        };
        let fields = [("params", &self.params, &other.params), ("m", &self.m, &other.m), ("v", &self.v, &other.v)];
        for (field, x, y) in fields {
            for ((name, p), q) in self.names.iter().zip(x).zip(y) {
                if bits(p)? != bits(q)? {
                    return Ok(Some(format!("{field} {name}")));
                }
            }
        }
        Ok(None)
    }

    /// The whole state from the states of workers whose optimizer state was sharded: parameter
    /// `i` of the flat vector (in parameter order) from the worker whose shard holds it.
    pub fn join(states: &[EngineState], shards: &[(usize, usize)]) -> Result<EngineState> {
        let first = states.first().ok_or_else(|| Error::option("shard_optimizer", "no worker states"))?;
        let flat = |ts: &[Tensor]| -> Result<Vec<f32>> {
            let mut v = Vec::new();
            for t in ts {
                v.extend(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
            }
            Ok(v)
        };
        let pick = |field: fn(&EngineState) -> &Vec<Tensor>| -> Result<Vec<Tensor>> {
            let mut all = Vec::new();
            for (state, &(lo, hi)) in states.iter().zip(shards) {
                all.extend_from_slice(&flat(field(state))?[lo..hi]);
            }
            let mut rest = all.as_slice();
            field(first)
                .iter()
                .map(|t| {
                    let (mine, next) = rest.split_at(t.elem_count());
                    rest = next;
                    Ok(Tensor::from_vec(mine.to_vec(), t.dims(), &candle_core::Device::Cpu)?)
                })
                .collect()
        };
        Ok(EngineState {
            names: first.names.clone(),
            params: pick(|s| &s.params)?,
            m: pick(|s| &s.m)?,
            v: pick(|s| &s.v)?,
            t: first.t,
        })
    }
}

/// The shards of `config`'s flat parameters over `workers` drafter workers
/// (`memory::step::optimizer_shard`).
pub fn optimizer_shards(config: &DraftConfig, workers: usize) -> Vec<(usize, usize)> {
    let params = dflash_optimized::model::drafter_step::param_slots(config).iter().map(|s| s.len).sum();
    (0..workers).map(|k| optimizer_shard(params, k, workers)).collect()
}

/// A training step's executor.
pub trait StepEngine {
    /// A short name for messages (`reference`, `host`, ...).
    fn name(&self) -> String;
    /// The checkpointing policy the step was laid out with, where the engine chooses one (the
    /// device engine, once it has stepped).
    fn checkpointing(&self) -> Option<Checkpointing> {
        None
    }
    /// Which of a step's `rows` rows (in the step's order, micro-batch after micro-batch) this
    /// engine steps with their features; the others' tokens and masks alone draw their anchors
    /// (a process of several steps its part: [`crate::dist::DataParallel`]).
    fn own_rows(&self, rows: usize) -> std::ops::Range<usize> {
        0..rows
    }
    /// Runs one step (see the module doc); draws anchors from `rng`.
    fn step(&mut self, batch: &StepBatch, rng: &mut ChaCha8Rng) -> Result<StepOutcome>;
    /// The weights and optimizer state, for a checkpoint.
    fn state(&self) -> Result<EngineState>;
    /// Restores what [`StepEngine::state`] returned.
    fn restore(&mut self, state: &EngineState) -> Result<()>;
    /// The drafter with the current weights (for evaluation and saving).
    fn drafter(&mut self) -> Result<&Drafter>;
    /// Loss, accuracy and tau_hat of the current weights on `rows`, anchors drawn from `seed`
    /// (the same every call), as `dflash_reference::eval::evaluate` defines them.
    fn evaluate(&mut self, rows: &dyn RowSource, max_anchors: usize, gamma: f64, seed: u64) -> Result<EvalReport>;
}

enum Source {
    Reference,
    Host(HostGradients<f32>),
}

/// The CPU engines: the reference drafter's weights and AdamW, with gradients from candle
/// autograd or from the GPU step's driver on the CPU twins.
pub struct CpuEngine {
    drafter: Drafter,
    head: FrozenHead,
    adamw: AdamW,
    source: Source,
    /// The host step's checkpointing policy (none for the reference step).
    policy: Option<Checkpointing>,
}

impl CpuEngine {
    pub fn new(drafter: Drafter, head: FrozenHead, optimizer: AdamWConfig, kind: StepKind) -> Result<Self> {
        let adamw = AdamW::new(drafter.named_params(), optimizer)?;
        let source = match kind {
            StepKind::Reference => Source::Reference,
            StepKind::Host => Source::Host(HostGradients::new(Checkpointing::PerLayer, 256)),
            StepKind::Gpu => {
                return Err(Error::option("step", "`gpu` runs on the device engine (DeviceEngine), not on the CPU"))
            }
        };
        let policy = (kind == StepKind::Host).then_some(Checkpointing::PerLayer);
        Ok(CpuEngine { drafter, head, adamw, source, policy })
    }

    /// The host step under checkpointing `policy` (per-layer unless set; the same gradients
    /// under every policy); the reference step is left as it is.
    pub fn with_checkpointing(mut self, policy: Checkpointing) -> Self {
        if let Source::Host(_) = self.source {
            self.source = Source::Host(HostGradients::new(policy, 256));
            self.policy = Some(policy);
        }
        self
    }

    /// Loss, weight and gradients of one micro-batch (and its block stats when asked).
    fn micro_batch(
        &mut self,
        rows: &[&TrainRow],
        batch: &StepBatch,
        rng: &mut ChaCha8Rng,
    ) -> Result<(f64, f64, Vec<Tensor>, Option<BlockStats>)> {
        let b = self.drafter.config.block_size;
        match &mut self.source {
            Source::Reference => {
                let mut stats = batch.want_stats.then(|| BlockStats::new(b));
                let (loss, total) = batch_loss_with_stats(
                    &self.drafter,
                    &self.head,
                    rows,
                    batch.anchors,
                    batch.gamma,
                    rng,
                    stats.as_mut(),
                )?;
                let grads = collect_grads(self.drafter.named_params(), &loss.backward()?)?;
                Ok((loss.to_dtype(DType::F64)?.to_scalar::<f64>()?, total, grads, stats))
            }
            Source::Host(host) => {
                let replay = batch.want_stats.then(|| rng.clone());
                let g = host.batch_gradients(&self.drafter, &self.head, rows, batch.anchors, batch.gamma, rng)?;
                let stats = match replay {
                    Some(mut replay) => {
                        let mut stats = BlockStats::new(b);
                        for row in rows {
                            let p = PreparedRow::new(row, batch.anchors, b, batch.gamma, &mut replay)?;
                            stats.add(&argmax_rows(&self.drafter.forward(&self.head, &p.input)?)?, &p.targets);
                        }
                        Some(stats)
                    }
                    None => None,
                };
                Ok((g.loss, g.weight, g.grads, stats))
            }
        }
    }
}

/// The first tensor of `grads` holding NaN or Inf, named `gradient of NAME`.
pub fn first_non_finite(drafter: &Drafter, grads: &[Tensor]) -> Result<Option<String>> {
    for ((name, _), g) in drafter.named_params().iter().zip(grads) {
        let sq = g.sqr()?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        if !sq.is_finite() {
            return Ok(Some(format!("gradient of {name}")));
        }
    }
    Ok(None)
}

impl StepEngine for CpuEngine {
    fn name(&self) -> String {
        match self.source {
            Source::Reference => "reference".into(),
            Source::Host(_) => "host".into(),
        }
    }

    fn checkpointing(&self) -> Option<Checkpointing> {
        self.policy
    }

    fn step(&mut self, batch: &StepBatch, rng: &mut ChaCha8Rng) -> Result<StepOutcome> {
        let mut parts = Vec::with_capacity(batch.micro_batches.len());
        for rows in &batch.micro_batches {
            parts.push(self.micro_batch(rows, batch, rng)?);
        }
        let mut stats: Option<BlockStats> = None;
        for (_, _, _, s) in &parts {
            if let Some(s) = s {
                match &mut stats {
                    Some(acc) => acc.merge(s),
                    None => stats = Some(s.clone()),
                }
            }
        }
        // One micro-batch is used as it is (the reference loop's step); several are combined
        // with each one's share of the total weight.
        let (loss, weight, mut grads) = if parts.len() == 1 {
            let (loss, weight, grads, _) = parts.pop().expect("one part");
            (loss, weight, grads)
        } else {
            let total: f64 = parts.iter().map(|p| p.1).sum();
            let mut loss = 0.0;
            let mut grads: Vec<Tensor> = Vec::new();
            for (part_loss, part_weight, part_grads, _) in parts {
                if part_weight == 0.0 {
                    continue;
                }
                let share = part_weight / total;
                loss += share * part_loss;
                if grads.is_empty() {
                    grads = part_grads.iter().map(|g| g.affine(share, 0.0)).collect::<candle_core::Result<_>>()?;
                } else {
                    for (g, pg) in grads.iter_mut().zip(part_grads) {
                        *g = (&*g + pg.affine(share, 0.0)?)?;
                    }
                }
            }
            if grads.is_empty() {
                grads = self
                    .drafter
                    .named_params()
                    .iter()
                    .map(|(_, v)| v.as_tensor().zeros_like())
                    .collect::<candle_core::Result<_>>()?;
            }
            (loss, total, grads)
        };
        let non_finite =
            if loss.is_finite() { first_non_finite(&self.drafter, &grads)? } else { Some("loss".to_string()) };
        if non_finite.is_some() {
            return Ok(StepOutcome {
                loss,
                weight,
                grad_norm: f64::NAN,
                non_finite,
                stats,
                flops: 0.0,
                device_bytes: None,
                waits: None,
            });
        }
        let params = self.drafter.named_params();
        let grad_norm = clip_grad_norm(params, &mut grads, batch.clip_norm)?;
        self.adamw.step(params, &grads, batch.lr)?;
        Ok(StepOutcome {
            loss,
            weight,
            grad_norm,
            non_finite: None,
            stats,
            flops: 0.0,
            device_bytes: None,
            waits: None,
        })
    }

    fn state(&self) -> Result<EngineState> {
        let params = self.drafter.named_params();
        let (m, v) = self.adamw.moments();
        Ok(EngineState {
            names: params.iter().map(|(n, _)| n.clone()).collect(),
            // A deep copy: the optimizer updates the parameters' storage in place.
            params: params
                .iter()
                .map(|(_, p)| p.as_tensor().copy()?.to_dtype(DType::F32))
                .collect::<candle_core::Result<_>>()?,
            m: m.to_vec(),
            v: v.to_vec(),
            t: self.adamw.step_count(),
        })
    }

    fn restore(&mut self, state: &EngineState) -> Result<()> {
        let params = self.drafter.named_params();
        let names: Vec<&String> = params.iter().map(|(n, _)| n).collect();
        if state.names.iter().collect::<Vec<_>>() != names {
            return Err(Error::option("checkpoint", "its parameters are not the drafter's (names or order differ)"));
        }
        for ((name, var), saved) in params.iter().zip(&state.params) {
            if saved.dims() != var.dims() {
                return Err(Error::option(
                    "checkpoint",
                    format!("tensor `{name}`: shape {:?}, expected {:?}", saved.dims(), var.dims()),
                ));
            }
            var.set(&saved.to_dtype(var.dtype())?)?;
        }
        self.adamw.restore(state.m.clone(), state.v.clone(), state.t)?;
        Ok(())
    }

    fn drafter(&mut self) -> Result<&Drafter> {
        Ok(&self.drafter)
    }

    fn evaluate(&mut self, rows: &dyn RowSource, max_anchors: usize, gamma: f64, seed: u64) -> Result<EvalReport> {
        let rows = (0..rows.len()).map(|i| rows.row(i));
        evaluate_rows(&self.drafter, &self.head, rows, max_anchors, gamma, seed)
    }
}

/// The frozen tables a [`DeviceEngine`]'s step reads, and where its rows' features come from.
pub enum Frozen<B: Backend> {
    /// On the host, with features in the rows: the LM head is uploaded into the step and the
    /// embedding table into a device copy the block embeddings are gathered from.
    Host(FrozenHead),
    /// The target's forward (dense or hybrid) on the same device computes each row's features;
    /// its embedding table and LM head are the step's (no second copy). Rows carry `[S, 0]`
    /// features.
    Target(Box<dyn TargetFeatures<Backend = B>>),
}

/// The engine of the optimized step on a backend (`Cuda` on the GPU; `Host` on the CPU twins):
/// the drafter's compute weights, fp32 masters and AdamW moments live on the backend
/// (`DrafterStep` with its optimizer regions, `DeviceAdamW`); each row's gradient, scaled by
/// the step's total weight, is accumulated there (one row per update: read as it is), then
/// clipped and applied. Rows must share one length (packed rows, or the built-in rows): the
/// step is laid out for it on first use. With [`Frozen::Target`] the target runs on the device
/// row by row (online features).
pub struct DeviceEngine<B: Backend> {
    make: Box<dyn Fn() -> dflash_optimized::Result<B>>,
    config: DraftConfig,
    frozen: Frozen<B>,
    optimizer: AdamWConfig,
    /// The checkpointing policies to lay the step out with, fastest first: the first that fits
    /// the device's free memory ([`fastest_fitting`]).
    policies: Vec<Checkpointing>,
    /// The drafter's init, until the step exists (then its weights live on the backend).
    init: Option<Drafter>,
    step: Option<(DrafterStep<B>, DeviceAdamW)>,
    /// The drafter as of the last [`StepEngine::drafter`] call.
    host_copy: Option<Drafter>,
    /// Moments and step count restored before the step existed (applied when it is made).
    pending: Option<EngineState>,
    /// With [`Frozen::Host`]: the embedding table `[V, H]` (stored) on the device, the block
    /// embeddings gathered from it (made on the first row).
    embed_table: Option<B::Alloc>,
    /// With [`Frozen::Host`]: target workers' slots hold each row's features.
    feed: Option<FeedEnd>,
    /// The all-reduce of the accumulated gradients over the drafter workers, on the device,
    /// bucket by bucket ([`grad_buckets`]).
    reduce: Option<Box<dyn GradReduce>>,
    /// The gradient buckets, with a reduction group.
    buckets: Vec<std::ops::Range<usize>>,
    /// How many buckets' sums this step has started (during its last row's backward).
    buckets_started: usize,
    /// With the optimizer state sharded: (this worker, the workers).
    shard: Option<(usize, usize)>,
    /// Whether the step keeps an fp32 gradient accumulator (several rows per update, or
    /// gradients summed with other workers'); without, AdamW reads the step's own gradients.
    accumulator: bool,
}

impl<B: Backend> DeviceEngine<B> {
    /// An engine training `drafter` (its init) against the frozen tables `frozen`, on backends
    /// `make` returns, under the first checkpointing policy of `policies` (fastest first) whose
    /// step fits the device's free memory when it is laid out.
    pub fn new(
        make: impl Fn() -> dflash_optimized::Result<B> + 'static,
        drafter: Drafter,
        frozen: Frozen<B>,
        optimizer: AdamWConfig,
        policies: &[Checkpointing],
    ) -> Self {
        DeviceEngine {
            make: Box::new(make),
            config: drafter.config.clone(),
            frozen,
            optimizer,
            policies: policies.to_vec(),
            init: Some(drafter),
            step: None,
            host_copy: None,
            pending: None,
            embed_table: None,
            feed: None,
            reduce: None,
            buckets: Vec::new(),
            buckets_started: 0,
            shard: None,
            accumulator: false,
        }
    }

    /// The same engine taking `rows` rows per update (micro-batches times rows per micro-batch):
    /// more than one needs the fp32 gradient accumulator, which one row per update goes without
    /// (4 bytes per parameter less on the device, and no pass over it per row).
    pub fn with_rows_per_update(mut self, rows: usize) -> Self {
        self.accumulator |= rows > 1;
        self
    }

    /// The same engine keeping the fp32 gradient accumulator whatever its rows per update (a
    /// data-parallel worker whose gradients are summed outside it: [`DeviceEngine::accumulated`]).
    pub fn with_accumulator(mut self) -> Self {
        self.accumulator = true;
        self
    }

    /// Whether the step adds gradients up (several rows per update, or several workers).
    fn accumulates(&self) -> bool {
        self.accumulator || self.reduce.is_some() || self.shard.is_some()
    }

    /// The step's gradient accumulator; fails naming the builder when it has none.
    fn accumulator(step: &DrafterStep<B>) -> Result<dflash_optimized::memory::Region> {
        step.accumulator()?.ok_or_else(|| {
            Error::option("engine", "no gradient accumulator (one row per update): make it `with_accumulator`")
        })
    }

    /// The same engine holding the masters and AdamW moments of its shard of the parameters
    /// only (`memory::step::optimizer_shard(P, k, workers)`): it updates its shard, and the
    /// workers gather each other's updated weights through the reduction group (needs
    /// [`DeviceEngine::with_reduce`]). Divides the masters' and moments' memory by the worker count.
    pub fn with_sharded_optimizer(mut self, k: usize, workers: usize) -> Self {
        self.shard = Some((k, workers));
        self
    }

    /// Every worker's shard of the flat parameters, when sharded.
    fn shards(&self) -> Option<Vec<(usize, usize)>> {
        self.shard.map(|(_, n)| optimizer_shards(&self.config, n))
    }

    /// The same engine fed by target workers: rows carry `[S, 0]` features and each row's
    /// features are copied into the step from the slot `feed` gives (on this device, or peer to
    /// peer from another) (needs [`Frozen::Host`]).
    pub fn with_feed(mut self, feed: FeedEnd) -> Self {
        self.feed = Some(feed);
        self
    }

    /// The same engine summing its accumulated gradients with the other drafter workers'
    /// through `reduce` (needs an fp32 accumulator: the GPU's, or `Host<f32>`).
    pub fn with_reduce(mut self, reduce: Box<dyn GradReduce>) -> Self {
        self.reduce = Some(reduce);
        self.buckets = grad_buckets(&self.config);
        self
    }

    /// Sums the accumulated gradients over the reduction group (the buckets whose sums the
    /// step's backward has not started, in order; then waits for all), making the step for rows
    /// of `(s, n)` first if needed; `false` without a group.
    pub fn reduce_on_device(&mut self, (s, n): (usize, usize)) -> Result<bool> {
        if self.reduce_group()?.is_none() {
            return Ok(false);
        }
        self.ensure_step(s, n)?;
        let (step, _) = self.step.as_ref().expect("made above");
        let reduce = self.reduce.as_ref().expect("checked");
        let acc = step.addr(Self::accumulator(step)?);
        let started = std::mem::take(&mut self.buckets_started);
        for b in &self.buckets[started..] {
            reduce.all_reduce_sum_f32(acc + 4 * b.start as u64, b.len())?;
        }
        reduce.wait()?;
        Ok(true)
    }

    /// The reduction group, if any: it sums f32, so it needs an fp32 gradient accumulator.
    fn reduce_group(&self) -> Result<Option<&dyn GradReduce>> {
        match self.reduce.as_deref() {
            Some(_) if std::mem::size_of::<Acc<B>>() != 4 => {
                Err(Error::option("engine", "a reduction group needs an fp32 gradient accumulator"))
            }
            group => Ok(group),
        }
    }

    /// Aborts the reduction group (another worker failed), if any.
    pub fn abort(&self) -> Option<Abort> {
        self.reduce.as_ref().map(|r| r.abort())
    }

    /// The next fed row's features (the row must be `row`), when fed.
    fn next_fed(&mut self, row: &TrainRow) -> Result<Option<FedFeatures>> {
        match &mut self.feed {
            None => Ok(None),
            Some(feed) => feed.next(&row.tokens).map(Some),
        }
    }

    /// The frozen tables back (the target's forward, for another engine), the step dropped.
    pub fn into_frozen(self) -> Frozen<B> {
        self.frozen
    }

    /// Makes (and loads) the step for rows of `s` tokens and `n` anchors on first use; refuses
    /// another shape later.
    pub fn ensure_step(&mut self, s: usize, n: usize) -> Result<()> {
        if let Some((step, _)) = &self.step {
            let have = (step.shape.context_len, step.shape.num_anchors);
            if have != (s, n) {
                return Err(Error::option(
                    "rows",
                    format!("a row of {s} tokens x {n} anchors; this engine was laid out for {have:?} (rows must share one length)"),
                ));
            }
            return Ok(());
        }
        let shape = StepShape { context_len: s, num_anchors: n, lm_chunk_rows: 1024 };
        let shard = match (self.shards(), self.shard) {
            (Some(all), Some((k, _))) => all[k],
            _ => (0, dflash_optimized::model::drafter_step::param_slots(&self.config).iter().map(|s| s.len).sum()),
        };
        let optimizer = Some(OptimizerShape { shard, accumulate: self.accumulates() });
        let dev = (self.make)()?;
        let own_head = matches!(self.frozen, Frozen::Host(_));
        let widths = (B::Elem::BYTES as u64, <Acc<B> as Real>::BYTES as u64);
        let (available, beside) = (dev.available_bytes()?, self.beside_step_bytes());
        let step_bytes =
            |p| Ok(StepLayout::with_head(&self.config, shape, p, optimizer, widths, own_head)?.total_bytes());
        let policy = fastest_fitting(&self.policies, available, beside, step_bytes)?;
        // A step that does not fit is refused by its layout, naming its largest items; one that
        // fits without what goes beside it is refused here, before either is allocated.
        let need = step_bytes(policy)?;
        if need <= available && need.saturating_add(beside) > available {
            use crate::metrics::size_text;
            return Err(Error::option(
                "checkpointing",
                format!(
                    "the step ({} checkpointing: {}) and the embedding table beside it ({}) need {}; {} has {} free",
                    policy.name(),
                    size_text(need),
                    size_text(beside),
                    size_text(need.saturating_add(beside)),
                    dev.name(),
                    size_text(available)
                ),
            ));
        }
        let mut step = match &self.frozen {
            Frozen::Host(head) => {
                let mut step = DrafterStep::with_head(dev, &self.config, shape, policy, optimizer, None)?;
                step.load_lm_head(head)?;
                step
            }
            Frozen::Target(forward) => {
                let head = forward.frozen_tables().1.ok_or_else(|| {
                    Error::option("target", "the target's forward holds no LM head to share (made without it)")
                })?;
                DrafterStep::with_head(dev, &self.config, shape, policy, optimizer, Some(head))?
            }
        };
        let drafter = self.init.take().ok_or_else(|| Error::option("engine", "no drafter weights to load"))?;
        step.load_weights(&drafter)?;
        let mut adam = DeviceAdamW::new(&step, self.optimizer.clone())?;
        if let Some(state) = self.pending.take() {
            upload_moments(&step, &mut adam, &state)?;
        }
        self.step = Some((step, adam));
        Ok(())
    }

    /// Puts `row`'s input into the step (running the target first when online); when fed, its
    /// features come from `fed`'s slot (copied into the step's input, from another device peer
    /// to peer), and the slot goes back once they are; returns the model FLOPs of the target's
    /// forward (0 offline).
    fn set_row(&mut self, row: &TrainRow, p: &PreparedRow, fed: Option<FedFeatures>) -> Result<f64> {
        self.ensure_step(p.input.layout.context_len, p.input.layout.anchors.len())?;
        let (step, _) = self.step.as_mut().expect("made above");
        match &mut self.frozen {
            Frozen::Host(head) => {
                let z = step.layout.dims;
                if self.embed_table.is_none() {
                    let dev = step.backend();
                    let embed: Vec<B::Elem> = stored(&head.embed)?;
                    let table = dev.alloc("embedding table", std::mem::size_of_val(&embed[..]))?;
                    dev.upload(table.ptr(), bytes_of(&embed))?;
                    self.embed_table = Some(table);
                }
                let embed = self.embed_table.as_ref().expect("made above").ptr();
                let (features, bytes) = (step.input_features(), z.s * z.fw * B::Elem::BYTES);
                match &fed {
                    Some(fed) if fed.copy => step.backend().copy_from_peer(features, fed.addr, bytes)?,
                    Some(fed) => {
                        step.backend().copy(features, fed.addr, bytes)?;
                        step.backend().synchronize()?;
                    }
                    None if row.features.dims() != [z.s, z.fw] => {
                        return Err(Error::option(
                            "features",
                            format!("shape {:?}, the step expects [{}, {}]", row.features.dims(), z.s, z.fw),
                        ))
                    }
                    None => with_stored::<B::Elem, _>(&row.features, |v| step.backend().upload(features, bytes_of(v)))?,
                }
                step.set_input_after_features(embed, &p.input, &p.targets)?;
                // The slot goes back here, its features copied (and waited for).
                Ok(fed.map_or(0.0, |f| f.flops))
            }
            Frozen::Target(_) if fed.is_some() => {
                Err(Error::option("engine", "fed features with an engine that runs its own target"))
            }
            Frozen::Target(forward) => {
                let plain = Row {
                    tokens: row.tokens.clone(),
                    loss_mask: row.loss_mask.clone(),
                    doc_ids: row.doc_ids.clone().unwrap_or_else(|| vec![0; row.len()]),
                    positions: row.positions.clone(),
                };
                forward.run(&[&plain])?;
                let (embed, _) = forward.frozen_tables();
                step.set_input_device(forward.features_addr(), embed, &p.input, &p.targets)?;
                Ok(forward.row_flops(&plain.doc_ids))
            }
        }
    }

    /// The device memory planned for the step and the target's forward (or the host-frozen
    /// engine's embedding table); `None` before the step is laid out.
    pub fn planned_bytes(&self) -> Option<u64> {
        let step = &self.step.as_ref()?.0;
        let beside = match &self.frozen {
            Frozen::Host(_) => self.beside_step_bytes(),
            Frozen::Target(forward) => forward.allocated_bytes(),
        };
        Some(step.planned_peak().saturating_add(beside))
    }

    /// What a [`Frozen::Host`] engine allocates on the device after its step: the embedding
    /// table (a row's features go straight into the step's input); 0 online (the target's
    /// forward is allocated already).
    fn beside_step_bytes(&self) -> u64 {
        let Frozen::Host(head) = &self.frozen else { return 0 };
        (head.embed.elem_count() as u64).saturating_mul(B::Elem::BYTES as u64)
    }

    /// The checkpointing policy of the step (`None` until it is laid out, on the first row).
    pub fn policy(&self) -> Option<Checkpointing> {
        self.step.as_ref().map(|(step, _)| step.layout.policy)
    }

    /// Accumulates the gradients of `rows` (prepared in the run's order), each row's scaled by
    /// `1 / total` (the step's total weight, over every worker's rows), recording the block
    /// stats when asked; a non-finite loss stops at its row (`Share::failed`).
    pub fn accumulate_rows(
        &mut self,
        rows: &[(&TrainRow, &PreparedRow)],
        total: f64,
        want_stats: bool,
    ) -> Result<Share> {
        self.host_copy = None;
        let weighted = rows.iter().filter(|(_, p)| p.targets.total_weight() > 0.0).count();
        if weighted > 1 && !self.accumulates() {
            return Err(Error::option(
                "rows_per_step",
                format!("{weighted} rows in one update; this engine was made for one (`with_rows_per_update`)"),
            ));
        }
        let b = self.config.block_size;
        let stats = want_stats.then(|| BlockStats::new(b));
        let mut share = Share { loss: 0.0, flops: 0.0, stats, failed: None, waited: 0.0 };
        let result = self.accumulate_into(rows, total, &mut share);
        self.close_feed_on_error(&result);
        share.waited = self.feed.as_mut().map_or(0.0, FeedEnd::take_waited);
        result.map(|()| share)
    }

    fn accumulate_into(&mut self, rows: &[(&TrainRow, &PreparedRow)], total: f64, share: &mut Share) -> Result<()> {
        let mut stepped = false;
        self.reduce_group()?;
        let last = rows.iter().rposition(|(_, p)| p.targets.total_weight() > 0.0);
        let mut rows = rows.iter().enumerate();
        while let Some((i, (row, p))) = rows.next() {
            // Fed rows come in the order queued: every row, weighted or not.
            let fed = self.next_fed(row)?;
            if p.targets.total_weight() == 0.0 {
                continue;
            }
            let flops = self.set_row(row, p, fed)?;
            share.flops += flops + step_flops(&self.config, p)?;
            let (step, adam) = self.step.as_mut().expect("made by set_row");
            stepped = true;
            step.set_record_predictions(share.stats.is_some());
            // With a reduction group, the last row's backward accumulates each bucket as it
            // finishes it and starts its sum with the other workers' while the rest runs.
            let overlap = self.reduce.as_deref().filter(|_| Some(i) == last);
            let mut sum_failed = None;
            let stepped_row = match overlap {
                None => step.step(1.0 / total),
                Some(reduce) => {
                    let (acc, buckets, started) = (Self::accumulator(step)?, &self.buckets, &mut self.buckets_started);
                    let mut done = |s: &DrafterStep<B>, k: usize| {
                        adam.accumulate_range(s, buckets[k].clone())?;
                        let at = s.addr(acc) + 4 * buckets[k].start as u64;
                        if let Err(e) = reduce.all_reduce_sum_f32(at, buckets[k].len()) {
                            sum_failed = Some(e);
                            return Err(dflash_optimized::Error::invalid("gradient sums", "stopped"));
                        }
                        *started = k + 1;
                        Ok(())
                    };
                    step.step_with(1.0 / total, &mut done)
                }
            };
            if let Some(e) = sum_failed {
                return Err(e);
            }
            match stepped_row {
                Ok(l) => share.loss += l.loss * l.total_weight / total,
                Err(dflash_optimized::Error::NonFinite { what, .. }) => {
                    share.failed = Some(what);
                    // The rows left were queued for this worker: take them off the feed.
                    for (_, (row, _)) in rows {
                        self.next_fed(row)?;
                    }
                    break;
                }
                Err(e) => return Err(e.into()),
            }
            if let Some(stats) = &mut share.stats {
                stats.add(&step.predictions()?, &p.targets);
            }
            if overlap.is_none() {
                adam.accumulate(step)?;
            }
        }
        // An update of no weighted row applies zero gradients, as an emptied accumulator holds:
        // without one, the step's gradients (of an earlier row, or an evaluation) are cleared.
        if let (false, false, Some((step, _))) = (stepped, self.accumulates(), &self.step) {
            step.zero(step.layout.grads)?;
        }
        Ok(())
    }

    /// After an error the rows still queued for this engine will never be read: dropping the
    /// feed gives their slots back (the target workers go on) and fails every later fed row.
    fn close_feed_on_error<T>(&mut self, result: &Result<T>) {
        if result.is_err() {
            self.feed = None;
        }
    }

    /// Clips and applies the accumulated gradients: `Ok(norm)`, or `Err(tensor)` when a
    /// gradient is not finite (nothing applied). Either way the accumulator (if any) is left
    /// empty.
    pub fn apply(&mut self, lr: f64, clip_norm: f64) -> Result<std::result::Result<f64, String>> {
        let shards = self.shards();
        let Some((step, adam)) = &mut self.step else { return Ok(Ok(0.0)) };
        match adam.update(step, lr, clip_norm) {
            Ok(norm) => {
                if let Some(shards) = shards {
                    let reduce = self.reduce.as_ref().ok_or_else(|| {
                        Error::option("shard_optimizer", "a sharded optimizer state needs a reduction group")
                    })?;
                    reduce.all_gather_shards(step.addr(step.layout.weights), B::Elem::BYTES, &shards)?;
                }
                Ok(Ok(norm))
            }
            Err(dflash_optimized::Error::NonFinite { what, .. }) => {
                adam.discard(step)?;
                Ok(Err(what))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Drops the accumulated gradients (a step skipped on some worker).
    pub fn discard(&mut self) -> Result<()> {
        if let Some((step, adam)) = &self.step {
            adam.discard(step)?;
        }
        Ok(())
    }

    /// The accumulated gradients (flat, in the arithmetic type, as f64); empty before the step
    /// exists.
    pub fn accumulated(&self) -> Result<Vec<f64>> {
        let Some((step, _)) = &self.step else { return Ok(Vec::new()) };
        let v: Vec<Acc<B>> = download(step.backend(), step.addr(Self::accumulator(step)?), step.num_params())?;
        Ok(v.into_iter().map(Real::to_f64).collect())
    }

    /// Replaces the accumulated gradients (the all-reduced sum); makes the step for rows of `s`
    /// tokens and `n` anchors first if it does not exist.
    pub fn set_accumulated(&mut self, (s, n): (usize, usize), values: &[f64]) -> Result<()> {
        self.ensure_step(s, n)?;
        let (step, _) = self.step.as_ref().expect("made above");
        let acc = Self::accumulator(step)?;
        if values.len() != step.num_params() {
            return Err(Error::option(
                "gradients",
                format!("{} values for {} parameters", values.len(), step.num_params()),
            ));
        }
        let values: Vec<Acc<B>> = values.iter().map(|&x| <Acc<B> as Real>::from_f64(x)).collect();
        step.backend().upload(step.addr(acc), bytes_of(&values))?;
        Ok(())
    }

    /// The optimizer regions' values (master, m, v) per parameter, as f32 tensors.
    fn download_state(&self) -> Result<Option<EngineState>> {
        let Some((step, adam)) = &self.step else { return Ok(None) };
        let opt = step.layout.optimizer.ok_or_else(|| Error::option("engine", "the step has no optimizer regions"))?;
        // A shard's values in place, zero elsewhere (`EngineState::join` takes each shard);
        // converted once, straight to the f32 of the tensors (a checkpoint of a 1B-parameter
        // drafter moves 12 GB here).
        let (n, (lo, hi)) = (step.num_params(), opt.shard);
        let get = |r| -> Result<Vec<f32>> {
            let v: Vec<Acc<B>> = download(step.backend(), step.addr(r), hi - lo)?;
            let mut all = vec![0f32; n];
            all[lo..hi].iter_mut().zip(v).for_each(|(a, x)| *a = x.to_f64() as f32);
            Ok(all)
        };
        let (p, m, v) = (get(opt.master)?, get(opt.adam_m)?, get(opt.adam_v)?);
        let split = |all: Vec<f32>| -> Result<Vec<Tensor>> {
            step.slots()
                .iter()
                .map(|s| {
                    let values = all[s.offset..s.offset + s.len].to_vec();
                    Ok(Tensor::from_vec(values, s.shape.as_slice(), &candle_core::Device::Cpu)?)
                })
                .collect()
        };
        Ok(Some(EngineState {
            names: step.slots().iter().map(|s| s.name.clone()).collect(),
            params: split(p)?,
            m: split(m)?,
            v: split(v)?,
            t: adam.step_count(),
        }))
    }
}

/// The backend's accumulation type (fp32 on the GPU).
type Acc<B> = <<B as Backend>::Elem as Elem>::Acc;

/// Model FLOPs of the drafter's step on `p`: its document tokens and kept blocks (padding is no
/// model work), weighted rows and allowed attention pairs.
fn step_flops(config: &DraftConfig, p: &PreparedRow) -> Result<f64> {
    let layout = &p.input.layout;
    let tokens = layout.doc_ids.as_ref().map_or(layout.context_len, |d| d.iter().filter(|&&id| id >= 0).count());
    let shape =
        StepShape { context_len: tokens, num_anchors: layout.keep.iter().filter(|&&k| k).count(), lm_chunk_rows: 1 };
    let weighted = p.targets.weights.iter().filter(|&&w| w > 0.0).count();
    // The allowed pairs of each distinct layer kind, counted once (full layers share one plan).
    let mut per_kind: Vec<(dflash_reference::config::AttnKind, u64)> = Vec::new();
    let mut pairs = Vec::with_capacity(config.dims.layer_kinds.len());
    for &kind in &config.dims.layer_kinds {
        let count = match per_kind.iter().find(|(k, _)| *k == kind) {
            Some(&(_, count)) => count,
            None => {
                let count = KeyRanges::dflash(&p.input.layout, kind)?.allowed_pairs();
                per_kind.push((kind, count));
                count
            }
        };
        pairs.push(count);
    }
    Ok(step_model_flops(config, shape, weighted, &pairs))
}

/// What one engine's rows added to a step: their share of the loss, their model FLOPs, their
/// block stats, the first non-finite tensor, and the seconds it waited for fed features.
#[derive(Clone, Debug)]
pub struct Share {
    pub loss: f64,
    pub flops: f64,
    pub stats: Option<BlockStats>,
    pub failed: Option<String>,
    /// Seconds the engine waited for fed features ([`crate::dist::feed`]).
    pub waited: f64,
}

impl Share {
    /// Adds another engine's share (same step).
    pub fn merge(&mut self, other: Share) {
        self.loss += other.loss;
        self.flops += other.flops;
        self.waited += other.waited;
        if let (Some(a), Some(b)) = (&mut self.stats, &other.stats) {
            a.merge(b);
        }
        self.failed = self.failed.take().or(other.failed);
    }

    /// The step's outcome over `total` weight: `update` is the applied update's gradient norm (or
    /// the non-finite gradient), `None` when a loss was not finite.
    pub fn outcome(
        self,
        total: f64,
        update: Option<std::result::Result<f64, String>>,
        device_bytes: Option<u64>,
    ) -> StepOutcome {
        let (grad_norm, non_finite) = match (update, self.failed) {
            (_, Some(what)) => (f64::NAN, Some(what)),
            (Some(Ok(norm)), None) => (norm, None),
            (Some(Err(what)), None) => (f64::NAN, Some(what)),
            (None, None) => (f64::NAN, Some("loss".into())),
        };
        let loss = if non_finite.as_deref().is_some_and(|w| w.starts_with("loss")) { f64::NAN } else { self.loss };
        StepOutcome {
            loss,
            weight: total,
            grad_norm,
            non_finite,
            stats: self.stats,
            flops: self.flops,
            device_bytes,
            waits: (self.waited > 0.0).then_some((self.waited, 0.0)),
        }
    }
}

/// Every row of `batch` with its anchors drawn from `rng` in order (as the CPU engines draw
/// them), and the step's total weight.
pub fn prepare_rows<'a>(
    batch: &StepBatch<'a>,
    block_size: usize,
    rng: &mut ChaCha8Rng,
) -> Result<(Vec<(&'a TrainRow, PreparedRow)>, f64)> {
    let mut prepared = Vec::new();
    for rows in &batch.micro_batches {
        for &row in rows {
            prepared.push((row, PreparedRow::new(row, batch.anchors, block_size, batch.gamma, rng)?));
        }
    }
    let total = prepared.iter().map(|(_, p)| p.targets.total_weight()).sum();
    Ok((prepared, total))
}

impl<B: Backend> StepEngine for DeviceEngine<B> {
    fn name(&self) -> String {
        match self.frozen {
            Frozen::Host(_) if self.feed.is_some() => format!("optimized on the {}, fed by target workers", B::KIND),
            Frozen::Host(_) => format!("optimized on the {}", B::KIND),
            Frozen::Target(_) => format!("optimized on the {}, online target", B::KIND),
        }
    }

    fn checkpointing(&self) -> Option<Checkpointing> {
        self.policy()
    }

    fn step(&mut self, batch: &StepBatch, rng: &mut ChaCha8Rng) -> Result<StepOutcome> {
        let (prepared, total) = prepare_rows(batch, self.config.block_size, rng)?;
        let rows: Vec<(&TrainRow, &PreparedRow)> = prepared.iter().map(|(r, p)| (*r, p)).collect();
        let share = self.accumulate_rows(&rows, total, batch.want_stats)?;
        let update = match share.failed.is_some() {
            true => {
                self.discard()?;
                None
            }
            false => Some(self.apply(batch.lr, batch.clip_norm)?),
        };
        Ok(share.outcome(total, update, self.planned_bytes()))
    }

    fn state(&self) -> Result<EngineState> {
        if let Some(state) = self.download_state()? {
            return Ok(state);
        }
        // Not stepped yet: the init, with zero moments.
        let d = self.init.as_ref().ok_or_else(|| Error::option("engine", "no drafter weights"))?;
        let params: Vec<Tensor> = d
            .named_params()
            .iter()
            .map(|(_, p)| p.as_tensor().to_dtype(DType::F32))
            .collect::<candle_core::Result<_>>()?;
        let zeros = params.iter().map(|p| p.zeros_like()).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(EngineState {
            names: d.named_params().iter().map(|(n, _)| n.clone()).collect(),
            params,
            m: zeros.clone(),
            v: zeros,
            t: 0,
        })
    }

    fn restore(&mut self, state: &EngineState) -> Result<()> {
        let shapes = dflash_reference::drafter::param_shapes(&self.config);
        if state.names.len() != shapes.len() || state.names.iter().zip(&shapes).any(|(a, (b, _))| a != b) {
            return Err(Error::option("checkpoint", "its parameters are not the drafter's (names or order differ)"));
        }
        let mut i = 0;
        let drafter = Drafter::from_fn(self.config.clone(), |_, _| {
            i += 1;
            Ok(state.params[i - 1].clone())
        })?;
        match &mut self.step {
            None => {
                self.init = Some(drafter);
                self.pending = Some(state.clone());
            }
            Some((step, adam)) => {
                step.load_weights(&drafter)?;
                upload_moments(step, adam, state)?;
            }
        }
        self.host_copy = None;
        Ok(())
    }

    fn drafter(&mut self) -> Result<&Drafter> {
        if self.step.is_none() {
            return self.init.as_ref().ok_or_else(|| Error::option("engine", "no drafter weights"));
        }
        if self.host_copy.is_none() {
            let state = self.download_state()?.expect("stepped");
            let mut i = 0;
            self.host_copy = Some(Drafter::from_fn(self.config.clone(), |_, _| {
                i += 1;
                Ok(state.params[i - 1].clone())
            })?);
        }
        Ok(self.host_copy.as_ref().expect("made above"))
    }

    /// Each row through the step with predictions recorded and no update (its gradients are
    /// overwritten by the next step and never accumulated).
    fn evaluate(&mut self, rows: &dyn RowSource, max_anchors: usize, gamma: f64, seed: u64) -> Result<EvalReport> {
        let result = self.evaluate_rows(rows, max_anchors, gamma, seed);
        self.close_feed_on_error(&result);
        if let Some(feed) = &mut self.feed {
            feed.take_waited();
        }
        result
    }
}

impl<B: Backend> DeviceEngine<B> {
    fn evaluate_rows(&mut self, rows: &dyn RowSource, max_anchors: usize, gamma: f64, seed: u64) -> Result<EvalReport> {
        let b = self.config.block_size;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut eval = Evaluation::new(b);
        for i in 0..rows.len() {
            let row = rows.row(i)?;
            let fed = self.next_fed(&row)?;
            let p = PreparedRow::new(&row, max_anchors, b, gamma, &mut rng)?;
            if p.targets.total_weight() == 0.0 {
                continue;
            }
            self.set_row(&row, &p, fed)?;
            let (step, _) = self.step.as_mut().expect("made by set_row");
            step.set_record_predictions(true);
            // A non-finite loss is the evaluation's to report (NaN), not an error that ends the
            // run (the reference's evaluation reports it the same way).
            let ce_sum = match step.step(1.0) {
                Ok(l) => l.loss * l.total_weight,
                Err(dflash_optimized::Error::NonFinite { .. }) => f64::NAN,
                Err(e) => return Err(e.into()),
            };
            eval.add(ce_sum, &step.predictions()?, &p.targets);
        }
        if let Some((step, _)) = self.step.as_mut() {
            step.set_record_predictions(false);
        }
        Ok(eval.report())
    }
}

/// Uploads a checkpoint's AdamW moments into `step`'s optimizer regions and its step count.
fn upload_moments<B: Backend>(step: &DrafterStep<B>, adam: &mut DeviceAdamW, state: &EngineState) -> Result<()> {
    let opt = step.layout.optimizer.ok_or_else(|| Error::option("engine", "no optimizer regions"))?;
    for (region, tensors) in [(opt.adam_m, &state.m), (opt.adam_v, &state.v)] {
        let mut values: Vec<Acc<B>> = Vec::with_capacity(step.num_params());
        for t in tensors {
            let flat = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
            values.extend(flat.into_iter().map(<Acc<B> as Real>::from_f64));
        }
        if values.len() != step.num_params() {
            return Err(Error::option(
                "checkpoint",
                format!("{} moments for {} parameters", values.len(), step.num_params()),
            ));
        }
        let values = &values[opt.shard.0..opt.shard.1];
        // SAFETY: plain-old-data values viewed as their bytes.
        let bytes = unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values)) };
        step.backend().upload(step.addr(region), bytes)?;
    }
    adam.set_step_count(state.t);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row's padding (tail tokens of document -1, blocks kept false) adds no model FLOPs: the
    /// same document with and without it, anchored alike, counts the same.
    #[test]
    fn padding_is_no_model_work() {
        let config = crate::builtin::draft_config(&crate::config::RunConfig::builtin());
        let width = config.num_features() * config.dims.hidden_size;
        let mut rng = ChaCha8Rng::seed_from_u64(rand::random());
        let (len, pad) = (rand::Rng::random_range(&mut rng, 24..48), rand::Rng::random_range(&mut rng, 1..16));
        let row = |pad: usize| {
            let s = len + pad;
            let tokens = (0..s).map(|i| (i * 7 % 90) as u32).collect();
            let loss_mask = (0..s).map(|i| (4..len).contains(&i)).collect();
            let doc_ids = Some((0..s).map(|i| if i < len { 0 } else { -1 }).collect());
            let positions = (0..s).map(|i| if i < len { i } else { 0 }).collect();
            let features = Tensor::randn(0f32, 1.0, (s, width), &candle_core::Device::Cpu).unwrap();
            TrainRow { tokens, loss_mask, doc_ids, positions, features }
        };
        let flops = |pad: usize, seed: u64| {
            let mut draw = ChaCha8Rng::seed_from_u64(seed);
            let prepared = PreparedRow::new(&row(pad), 64, config.block_size, 7.0, &mut draw).unwrap();
            assert!(prepared.input.layout.keep.iter().any(|&k| !k), "blocks of padding expected");
            step_flops(&config, &prepared).unwrap()
        };
        let seed = rand::random();
        assert_eq!(flops(pad, seed), flops(0, seed), "{len} tokens and {pad} of padding");
    }
}
