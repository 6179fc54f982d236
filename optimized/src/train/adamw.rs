//! AdamW on the step's backend (spec section 3): a step's stored gradients are accumulated in
//! the arithmetic type (gradient accumulation; with one row per update on one worker the
//! update reads the step's own stored gradients), then clipped by
//! their global norm and applied to the master weights, which are written back as the stored
//! compute weights. The reference is `dflash_reference::optim` (`AdamW::step`,
//! `clip_grad_norm`); the kernels' twins are checked by `xtask gpu-conformance`.

use dflash_reference::optim::AdamWConfig;

use crate::backend::Backend;
use crate::memory::step::{OptimizerRegions, UpdateGrads};
use crate::model::drafter_step::{DrafterStep, Grads};
use crate::ops::elementwise::{AdamWArgs, AdamWBuffers, ElementwiseOps};
use crate::ops::{Elem, Real};
use crate::{Error, Result};

/// AdamW state on the backend: the step count (the moments live in the step's optimizer regions,
/// for all parameters or for the step's shard of them).
pub struct DeviceAdamW {
    pub config: AdamWConfig,
    regions: OptimizerRegions,
    t: i32,
}

impl DeviceAdamW {
    /// A fresh optimizer for `step`, which must have been made with its optimizer regions.
    pub fn new<B: Backend>(step: &DrafterStep<B>, config: AdamWConfig) -> Result<Self> {
        let regions = step
            .layout
            .optimizer
            .ok_or_else(|| Error::invalid("optimizer", "the step was made without its optimizer regions"))?;
        Ok(DeviceAdamW { config, regions, t: 0 })
    }

    /// Whether the gradients of several steps are added up (else the update reads the last
    /// step's own: one row per update).
    pub fn accumulates(&self) -> bool {
        self.regions.grads.accumulator().is_some()
    }

    /// Adds the last step's gradients to the accumulator; without one, nothing (the update reads
    /// the step's gradients, which the next step overwrites).
    pub fn accumulate<B: Backend>(&self, step: &DrafterStep<B>) -> Result<()> {
        self.accumulate_range(step, 0..step.num_params())
    }

    /// [`DeviceAdamW::accumulate`] of the flat parameters `range` only (a gradient bucket).
    pub fn accumulate_range<B: Backend>(&self, step: &DrafterStep<B>, range: std::ops::Range<usize>) -> Result<()> {
        let Some(acc) = self.regions.grads.accumulator() else { return Ok(()) };
        let (stored, wide) = (<B::Elem as Elem>::BYTES, <<B::Elem as Elem>::Acc as Real>::BYTES);
        let (to, from) = (step.addr(acc) + (range.start * wide) as u64, step.addr(step.layout.grads));
        step.backend().ops().accumulate(to, from + (range.start * stored) as u64, range.len())
    }

    /// Drops the accumulated gradients (a skipped step).
    pub fn discard<B: Backend>(&self, step: &DrafterStep<B>) -> Result<()> {
        match self.regions.grads.accumulator() {
            Some(acc) => step.zero(acc),
            None => Ok(()),
        }
    }

    /// AdamW's step count (updates applied).
    pub fn step_count(&self) -> i32 {
        self.t
    }

    /// The step count restored from a checkpoint (the moments are restored in the step's regions).
    pub fn set_step_count(&mut self, t: i32) {
        self.t = t;
    }

    /// One update with learning rate `lr` from the accumulated gradients (or the step's own),
    /// clipped to global norm `max_norm` (`max_norm / (norm + 1e-6)`, as the
    /// reference); zeroes the accumulator and returns the norm before clipping. Fails naming a
    /// gradient that holds NaN or Inf.
    pub fn update<B: Backend>(&mut self, step: &DrafterStep<B>, lr: f64, max_norm: f64) -> Result<f64> {
        let norm = step.grad_sum_squares(Grads::Update)?.iter().sum::<f64>().sqrt();
        let grad_scale = if norm > max_norm { max_norm / (norm + 1e-6) } else { 1.0 };
        self.t += 1;
        let c = &self.config;
        let args = AdamWArgs {
            lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
            bc1: 1.0 - c.beta1.powi(self.t),
            bc2: 1.0 - c.beta2.powi(self.t),
            grad_scale,
        };
        // A sharded state updates its shard of the (whole, all-reduced) gradients only; the
        // other shards' stored weights come from their workers (`DeviceEngine`'s gather).
        let r = self.regions;
        let (lo, hi) = r.shard;
        let (stored, acc) = (<B::Elem as Elem>::BYTES, <<B::Elem as Elem>::Acc as Real>::BYTES);
        let (g, g_is_stored) = match r.grads {
            UpdateGrads::Accumulated(g) => (step.addr(g) + (lo * acc) as u64, false),
            UpdateGrads::Stored => (step.addr(step.layout.grads) + (lo * stored) as u64, true),
        };
        let buffers = AdamWBuffers {
            p: step.addr(r.master),
            g,
            g_is_stored,
            m: step.addr(r.adam_m),
            v: step.addr(r.adam_v),
            p_stored: step.addr(step.layout.weights) + (lo * stored) as u64,
        };
        step.backend().ops().adamw_update(buffers, hi - lo, args)?;
        if let Some(g) = r.grads.accumulator() {
            step.zero(g)?;
        }
        Ok(norm)
    }
}
