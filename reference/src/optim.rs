//! AdamW with decoupled weight decay, the warmup + cosine schedule and global grad-norm
//! clipping of spec section 3.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::error::{Error, Result};

/// AdamW hyper-parameters; defaults are the spec's recipe.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamWConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { lr: 6e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }
}

/// Learning rate at `step` (0-based) of `total`: linear warmup over `ceil(warmup_frac*total)`
/// steps to `peak` (the product's rounding error aside: 7% of 100 is 7 steps), then cosine to 0
/// at the last step (a single step after the warmup is that last step).
pub fn lr_at(step: usize, total: usize, peak: f64, warmup_frac: f64) -> f64 {
    let steps = warmup_frac * total as f64;
    let warmup = ((steps - steps * 1e-12).ceil() as usize).max(1);
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let progress = match total.saturating_sub(warmup + 1) {
        0 => 1.0,
        span => ((step - warmup) as f64 / span as f64).min(1.0),
    };
    peak * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// The gradient of each parameter, in the parameters' order (zeros where autograd gave none).
pub fn collect_grads(params: &[(String, Var)], grads: &GradStore) -> Result<Vec<Tensor>> {
    params
        .iter()
        .map(|(_, v)| match grads.get(v.as_tensor()) {
            Some(g) => Ok(g.clone()),
            None => Ok(v.as_tensor().zeros_like()?),
        })
        .collect()
}

/// The global L2 norm of `grads`; fails naming the first tensor holding NaN or Inf.
pub fn global_grad_norm(params: &[(String, Var)], grads: &[Tensor]) -> Result<f64> {
    let mut sum = 0.0;
    for ((name, _), g) in params.iter().zip(grads) {
        let sq = g.sqr()?.sum_all()?.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        if !sq.is_finite() {
            return Err(Error::invalid(format!("gradient of {name}"), "holds NaN or Inf"));
        }
        sum += sq;
    }
    Ok(sum.sqrt())
}

/// Scales `grads` so that their global norm is at most `max_norm`; returns the norm before.
pub fn clip_grad_norm(params: &[(String, Var)], grads: &mut [Tensor], max_norm: f64) -> Result<f64> {
    let norm = global_grad_norm(params, grads)?;
    if norm > max_norm {
        let scale = max_norm / (norm + 1e-6);
        for g in grads.iter_mut() {
            *g = g.affine(scale, 0.0)?;
        }
    }
    Ok(norm)
}

/// AdamW state: first and second moments per parameter, and the step count.
pub struct AdamW {
    pub config: AdamWConfig,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    t: i32,
}

impl AdamW {
    /// Zero moments for `params`.
    pub fn new(params: &[(String, Var)], config: AdamWConfig) -> Result<Self> {
        let zeros = params.iter().map(|(_, v)| Ok(v.as_tensor().zeros_like()?)).collect::<Result<Vec<_>>>()?;
        Ok(AdamW { config, m: zeros.clone(), v: zeros, t: 0 })
    }

    /// The first and second moments, in the parameters' order.
    pub fn moments(&self) -> (&[Tensor], &[Tensor]) {
        (&self.m, &self.v)
    }

    /// Updates done so far (the bias corrections' `t`).
    pub fn step_count(&self) -> i32 {
        self.t
    }

    /// Restores the moments and step count saved by [`AdamW::moments`] and [`AdamW::step_count`]
    /// (exact resumption); each moment must have its parameter's shape and dtype.
    pub fn restore(&mut self, m: Vec<Tensor>, v: Vec<Tensor>, t: i32) -> Result<()> {
        for (what, saved) in [("m", &m), ("v", &v)] {
            if saved.len() != self.m.len() {
                return Err(Error::invalid(
                    format!("AdamW {what}"),
                    format!("{} moments for {} parameters", saved.len(), self.m.len()),
                ));
            }
            for (i, (s, current)) in saved.iter().zip(&self.m).enumerate() {
                if s.dims() != current.dims() || s.dtype() != current.dtype() {
                    return Err(Error::invalid(
                        format!("AdamW {what}[{i}]"),
                        format!("{:?} {:?}, expected {:?} {:?}", s.dims(), s.dtype(), current.dims(), current.dtype()),
                    ));
                }
            }
        }
        if t < 0 {
            return Err(Error::invalid("AdamW step count", format!("{t} is negative")));
        }
        (self.m, self.v, self.t) = (m, v, t);
        Ok(())
    }

    /// One update with learning rate `lr`:
    /// `p -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)`.
    pub fn step(&mut self, params: &[(String, Var)], grads: &[Tensor], lr: f64) -> Result<()> {
        self.t += 1;
        let c = &self.config;
        let (bc1, bc2) = (1.0 - c.beta1.powi(self.t), 1.0 - c.beta2.powi(self.t));
        for (i, ((_, p), g)) in params.iter().zip(grads).enumerate() {
            self.m[i] = (self.m[i].affine(c.beta1, 0.0)? + g.affine(1.0 - c.beta1, 0.0)?)?;
            self.v[i] = (self.v[i].affine(c.beta2, 0.0)? + g.sqr()?.affine(1.0 - c.beta2, 0.0)?)?;
            let m_hat = self.m[i].affine(1.0 / bc1, 0.0)?;
            let denom = self.v[i].affine(1.0 / bc2, 0.0)?.sqrt()?.affine(1.0, c.eps)?;
            let update = ((m_hat / denom)? + p.as_tensor().affine(c.weight_decay, 0.0)?)?;
            p.set(&(p.as_tensor() - update.affine(lr, 0.0)?)?)?;
        }
        Ok(())
    }
}
