//! AdamW on the device (spec section 3): a step's bf16 gradients are accumulated in fp32
//! (gradient accumulation), then clipped by their global norm and applied to the fp32 master
//! weights, which are cast back to the bf16 compute weights. The CPU twin is
//! `dflash_reference::optim` (`AdamW::step`, `clip_grad_norm`); the kernels' twins are checked by
//! `xtask gpu-conformance`.

use dflash_reference::optim::AdamWConfig;
use dflash_reference::{Error, Result};

use super::backend::Backend;
use super::kernels::{AdamWArgs, StepOps};
use super::step::Step;

/// AdamW state on the device: the step count (the moments live in the step's `adam_m` and
/// `adam_v` buffers).
pub struct GpuAdamW {
    pub config: AdamWConfig,
    t: i32,
}

impl GpuAdamW {
    /// A fresh optimizer for `step`, which must have been made with its optimizer buffers.
    pub fn new<B: Backend>(step: &Step<B>, config: AdamWConfig) -> Result<Self> {
        if !step.has_buffer("master") {
            return Err(Error::invalid("optimizer", "the step was made without its optimizer buffers"));
        }
        Ok(GpuAdamW { config, t: 0 })
    }

    /// Adds the last step's gradients to the fp32 accumulator.
    pub fn accumulate<B: Backend>(&self, step: &Step<B>) -> Result<()> {
        let n = step.num_params();
        step.backend().ops().accumulate(step.buffer("grad_acc"), step.buffer("grads"), n)
    }

    /// One update with learning rate `lr` from the accumulated gradients, clipped to global norm
    /// `max_norm` (`max_norm / (norm + 1e-6)`, as the reference); zeroes the accumulator and
    /// returns the norm before clipping. Fails naming a gradient that holds NaN or Inf.
    pub fn update<B: Backend>(&mut self, step: &Step<B>, lr: f64, max_norm: f64) -> Result<f64> {
        let norm = step.grad_sum_squares("grad_acc")?.iter().sum::<f64>().sqrt();
        let grad_scale = if norm > max_norm { max_norm / (norm + 1e-6) } else { 1.0 };
        self.t += 1;
        let c = &self.config;
        let args = AdamWArgs {
            lr: lr as f32,
            beta1: c.beta1 as f32,
            beta2: c.beta2 as f32,
            eps: c.eps as f32,
            weight_decay: c.weight_decay as f32,
            bc1: (1.0 - c.beta1.powi(self.t)) as f32,
            bc2: (1.0 - c.beta2.powi(self.t)) as f32,
            grad_scale: grad_scale as f32,
        };
        let b = |key: &str| step.buffer(key);
        let buffers = (b("master"), b("grad_acc"), b("adam_m"), b("adam_v"), b("weights"));
        step.backend().ops().adamw_update(buffers, step.num_params(), args)?;
        step.zero_buffer("grad_acc")?;
        Ok(norm)
    }
}
