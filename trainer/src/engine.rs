//! [`StepEngine`]: what the run loop asks of whatever computes a training step. One step takes
//! the rows of its micro-batches, draws their anchors from the run's RNG (row by row, in
//! order), computes the loss and gradients, and, unless a loss or gradient is NaN or Inf,
//! clips and applies AdamW. The CPU engines ([`CpuEngine`]: the reference's autograd, or the
//! GPU step's driver on the CPU twins) are the two engines today; a GPU engine implements the
//! same trait (its state is downloaded for checkpoints and uploaded on resume).

use candle_core::{DType, Tensor};
use dflash_optimized::memory::step::Checkpointing;
use dflash_optimized::train::gradients::HostGradients;
use dflash_reference::data::TrainRow;
use dflash_reference::drafter::{Drafter, FrozenHead};
use dflash_reference::eval::BlockStats;
use dflash_reference::optim::{clip_grad_norm, collect_grads, AdamW, AdamWConfig};
use dflash_reference::speculative::argmax_rows;
use dflash_reference::train::{batch_loss_with_stats, GradientSource, PreparedRow};
use rand_chacha::ChaCha8Rng;

use crate::config::StepKind;
use crate::error::{Error, Result};

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

/// A training step's executor.
pub trait StepEngine {
    /// A short name for messages (`reference`, `host`, ...).
    fn name(&self) -> String;
    /// Runs one step (see the module doc); draws anchors from `rng`.
    fn step(&mut self, batch: &StepBatch, rng: &mut ChaCha8Rng) -> Result<StepOutcome>;
    /// The weights and optimizer state, for a checkpoint.
    fn state(&self) -> Result<EngineState>;
    /// Restores what [`StepEngine::state`] returned.
    fn restore(&mut self, state: &EngineState) -> Result<()>;
    /// The drafter with the current weights (for evaluation and saving).
    fn drafter(&mut self) -> Result<&Drafter>;
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
        Ok(CpuEngine { drafter, head, adamw, source })
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
            return Ok(StepOutcome { loss, weight, grad_norm: f64::NAN, non_finite, stats });
        }
        let params = self.drafter.named_params();
        let grad_norm = clip_grad_norm(params, &mut grads, batch.clip_norm)?;
        self.adamw.step(params, &grads, batch.lr)?;
        Ok(StepOutcome { loss, weight, grad_norm, non_finite: None, stats })
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
}

/// The engine of the optimized step on a backend (`Cuda` on the GPU; `Host` on the CPU twins):
/// the drafter's compute weights, fp32 masters and AdamW moments live on the backend
/// (`DrafterStep` with its optimizer regions, `DeviceAdamW`); each row's gradient, scaled by
/// the step's total weight, is accumulated there, then clipped and applied. Rows must share one
/// length (packed rows, or the built-in rows): the step is laid out for it on first use.
/// Per-offset accuracy is not measured on this engine yet (`stats` is `None`).
pub struct DeviceEngine<B: dflash_optimized::backend::Backend> {
    make: Box<dyn Fn() -> dflash_optimized::Result<B>>,
    config: dflash_reference::config::DraftConfig,
    head: FrozenHead,
    optimizer: AdamWConfig,
    policy: Checkpointing,
    /// The drafter's init, until the step exists (then its weights live on the backend).
    init: Option<Drafter>,
    step: Option<(DrafterStep<B>, DeviceAdamW)>,
    /// The drafter as of the last [`StepEngine::drafter`] call.
    host_copy: Option<Drafter>,
    /// Moments and step count restored before the step existed (applied when it is made).
    pending: Option<EngineState>,
}

use dflash_optimized::backend::download;
use dflash_optimized::model::drafter_step::DrafterStep;
use dflash_optimized::train::adamw::DeviceAdamW;

impl<B: dflash_optimized::backend::Backend> DeviceEngine<B> {
    /// An engine training `drafter` (its init) against the frozen `head`, on backends `make`
    /// returns, under the checkpointing `policy`.
    pub fn new(
        make: impl Fn() -> dflash_optimized::Result<B> + 'static,
        drafter: Drafter,
        head: FrozenHead,
        optimizer: AdamWConfig,
        policy: Checkpointing,
    ) -> Self {
        DeviceEngine {
            make: Box::new(make),
            config: drafter.config.clone(),
            head,
            optimizer,
            policy,
            init: Some(drafter),
            step: None,
            host_copy: None,
            pending: None,
        }
    }

    /// The step for rows of `s` tokens and `n` anchors, made (and loaded) on first use.
    fn step_for(&mut self, s: usize, n: usize) -> Result<&mut (DrafterStep<B>, DeviceAdamW)> {
        if let Some((step, _)) = &self.step {
            let have = (step.shape.context_len, step.shape.num_anchors);
            if have != (s, n) {
                return Err(Error::option(
                    "rows",
                    format!("a row of {s} tokens x {n} anchors; this engine was laid out for {have:?} (rows must share one length)"),
                ));
            }
        } else {
            let shape =
                dflash_optimized::memory::step::StepShape { context_len: s, num_anchors: n, lm_chunk_rows: 1024 };
            let mut step = DrafterStep::new((self.make)()?, &self.config, shape, self.policy, true)?;
            step.load_lm_head(&self.head)?;
            let drafter = self.init.take().ok_or_else(|| Error::option("engine", "no drafter weights to load"))?;
            step.load_weights(&drafter)?;
            let mut adam = DeviceAdamW::new(&step, self.optimizer.clone())?;
            if let Some(state) = self.pending.take() {
                upload_moments(&step, &mut adam, &state)?;
            }
            self.step = Some((step, adam));
        }
        Ok(self.step.as_mut().expect("made above"))
    }

    /// The optimizer regions' values (master, m, v) per parameter, as f32 tensors.
    fn download_state(&self) -> Result<Option<EngineState>> {
        let Some((step, adam)) = &self.step else { return Ok(None) };
        let opt = step.layout.optimizer.ok_or_else(|| Error::option("engine", "the step has no optimizer regions"))?;
        let n = step.num_params();
        type Acc<B> = <<B as dflash_optimized::backend::Backend>::Elem as dflash_optimized::ops::Elem>::Acc;
        let get = |r| -> Result<Vec<f64>> {
            let v: Vec<Acc<B>> = download(step.backend(), step.addr(r), n)?;
            Ok(v.into_iter().map(dflash_optimized::ops::Real::to_f64).collect())
        };
        let (p, m, v) = (get(opt.master)?, get(opt.adam_m)?, get(opt.adam_v)?);
        let split = |all: &[f64]| -> Result<Vec<Tensor>> {
            step.slots()
                .iter()
                .map(|s| {
                    let t = Tensor::from_vec(
                        all[s.offset..s.offset + s.len].to_vec(),
                        s.shape.as_slice(),
                        &candle_core::Device::Cpu,
                    )?;
                    Ok(t.to_dtype(DType::F32)?)
                })
                .collect()
        };
        Ok(Some(EngineState {
            names: step.slots().iter().map(|s| s.name.clone()).collect(),
            params: split(&p)?,
            m: split(&m)?,
            v: split(&v)?,
            t: adam.step_count(),
        }))
    }
}

impl<B: dflash_optimized::backend::Backend> StepEngine for DeviceEngine<B> {
    fn name(&self) -> String {
        "device".into()
    }

    fn step(&mut self, batch: &StepBatch, rng: &mut ChaCha8Rng) -> Result<StepOutcome> {
        // Every row's anchors first, in order (as the CPU engines draw them), then the total weight.
        let b = self.config.block_size;
        let mut prepared = Vec::new();
        for rows in &batch.micro_batches {
            for row in rows {
                prepared.push(PreparedRow::new(row, batch.anchors, b, batch.gamma, rng)?);
            }
        }
        let total: f64 = prepared.iter().map(|p| p.targets.total_weight()).sum();
        self.host_copy = None;
        let head = self.head.clone();
        let mut loss = 0.0;
        let mut failed: Option<String> = None;
        for p in prepared.iter().filter(|p| p.targets.total_weight() > 0.0) {
            let (step, adam) = self.step_for(p.input.layout.context_len, p.input.layout.anchors.len())?;
            step.set_input(&p.input, &head, &p.targets)?;
            match step.step(1.0 / total) {
                Ok(l) => loss += l.loss * l.total_weight / total,
                Err(dflash_optimized::Error::NonFinite { what, .. }) => {
                    failed = Some(what);
                    break;
                }
                Err(e) => return Err(e.into()),
            }
            adam.accumulate(step)?;
        }
        let Some((step, adam)) = &mut self.step else {
            return Ok(StepOutcome { loss: 0.0, weight: 0.0, grad_norm: 0.0, non_finite: None, stats: None });
        };
        if failed.is_none() {
            match adam.update(step, batch.lr, batch.clip_norm) {
                Ok(grad_norm) => {
                    return Ok(StepOutcome { loss, weight: total, grad_norm, non_finite: None, stats: None })
                }
                Err(dflash_optimized::Error::NonFinite { what, .. }) => failed = Some(what),
                Err(e) => return Err(e.into()),
            }
        }
        adam.discard(step)?;
        let loss = if failed.as_deref().is_some_and(|w| w.starts_with("loss")) { f64::NAN } else { loss };
        Ok(StepOutcome { loss, weight: total, grad_norm: f64::NAN, non_finite: failed, stats: None })
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
}

/// Uploads a checkpoint's AdamW moments into `step`'s optimizer regions and its step count.
fn upload_moments<B: dflash_optimized::backend::Backend>(
    step: &DrafterStep<B>,
    adam: &mut DeviceAdamW,
    state: &EngineState,
) -> Result<()> {
    type Acc<B> = <<B as dflash_optimized::backend::Backend>::Elem as dflash_optimized::ops::Elem>::Acc;
    let opt = step.layout.optimizer.ok_or_else(|| Error::option("engine", "no optimizer regions"))?;
    for (region, tensors) in [(opt.adam_m, &state.m), (opt.adam_v, &state.v)] {
        let mut values: Vec<Acc<B>> = Vec::with_capacity(step.num_params());
        for t in tensors {
            let flat = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
            values.extend(flat.into_iter().map(<Acc<B> as dflash_optimized::ops::Real>::from_f64));
        }
        if values.len() != step.num_params() {
            return Err(Error::option(
                "checkpoint",
                format!("{} moments for {} parameters", values.len(), step.num_params()),
            ));
        }
        // SAFETY: plain-old-data values viewed as their bytes.
        let bytes =
            unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(&values[..])) };
        step.backend().upload(step.addr(region), bytes)?;
    }
    adam.set_step_count(state.t);
    Ok(())
}
