//! The optimized steps as gradient sources of the training loop
//! (`dflash_reference::train::train_with`): the same loop, anchors, clipping and AdamW as the
//! reference, with gradients from the manual backward ([`ManualStep`], candle on the CPU) or
//! from the planned step on the CPU in f32 ([`PlannedCpuStep`]).

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use dflash_reference::anchors::sample_anchors;
use dflash_reference::data::TrainRow;
use dflash_reference::drafter::{DraftInput, Drafter, FrozenHead};
use dflash_reference::loss::BlockTargets;
use dflash_reference::train::{BatchGradients, GradientSource};
use dflash_reference::Result;
use rand_chacha::ChaCha8Rng;

use super::drafter_step::{drafter_step, Checkpointing, StepResult};
use super::planned::host::Host;
use super::planned::step::Step;
use crate::planner::StepShape;

/// Gradients of [`drafter_step`] under `policy`, the LM head in chunks of `lm_chunk_rows` rows.
pub struct ManualStep {
    pub policy: Checkpointing,
    pub lm_chunk_rows: usize,
}

/// Gradients of the planned step on the CPU, storing f32, under `policy`: one planned step per
/// row shape (context length, anchors), made on first use and reused.
pub struct PlannedCpuStep {
    pub policy: Checkpointing,
    pub lm_chunk_rows: usize,
    steps: HashMap<(usize, usize), Step<Host<f32>>>,
}

impl PlannedCpuStep {
    pub fn new(policy: Checkpointing, lm_chunk_rows: usize) -> Self {
        PlannedCpuStep { policy, lm_chunk_rows, steps: HashMap::new() }
    }

    /// The mean loss of one row and its gradients, as the drafter's tensors.
    fn row(
        &mut self,
        drafter: &Drafter,
        head: &FrozenHead,
        input: &DraftInput,
        targets: &BlockTargets,
    ) -> Result<StepResult> {
        let key = (input.layout.context_len, input.layout.anchors.len());
        if !self.steps.contains_key(&key) {
            let shape = StepShape { context_len: key.0, num_anchors: key.1, lm_chunk_rows: self.lm_chunk_rows };
            let mut step = Step::with_backend(Host::default(), &drafter.config, shape, self.policy, false)?;
            step.load_lm_head(head)?;
            self.steps.insert(key, step);
        }
        let step = self.steps.get_mut(&key).expect("inserted above");
        step.load_weights(drafter)?;
        step.set_input(input, head, targets)?;
        let loss = step.step(1.0 / targets.total_weight())?.loss;
        step.grad_sum_squares("grads")?;
        let grads = step
            .grads_to_host()?
            .into_iter()
            .zip(drafter.named_params())
            .map(|((name, g), (_, var))| {
                Ok((name, Tensor::from_vec(g, var.dims(), &Device::Cpu)?.to_dtype(var.dtype())?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(StepResult { loss, grads })
    }
}

/// Row by row, then combined with each row's share of the batch weight, so that the loss is
/// `sum_rows sum w*CE / sum_rows sum w` as in the reference; rows without weight add nothing.
fn batch_of_rows(
    drafter: &Drafter,
    rows: &[&TrainRow],
    max_anchors: usize,
    gamma: f64,
    rng: &mut ChaCha8Rng,
    mut row: impl FnMut(&DraftInput, &BlockTargets) -> Result<StepResult>,
) -> Result<BatchGradients> {
    let b = drafter.config.block_size;
    let mut per_row = Vec::with_capacity(rows.len());
    for r in rows {
        let anchors = sample_anchors(&r.loss_mask, max_anchors, rng);
        let targets = BlockTargets::new(&r.tokens, &r.loss_mask, &anchors, b, gamma);
        let input = DraftInput::training(r, &anchors, b)?;
        let weight = targets.total_weight();
        if weight > 0.0 {
            per_row.push((weight, row(&input, &targets)?));
        }
    }
    let total: f64 = per_row.iter().map(|(w, _)| w).sum();
    let mut loss = 0.0;
    let mut grads: Vec<_> =
        drafter.named_params().iter().map(|(_, v)| v.as_tensor().zeros_like()).collect::<candle_core::Result<_>>()?;
    for (weight, step) in per_row {
        let share = weight / total;
        loss += share * step.loss;
        for (g, (_, row_grad)) in grads.iter_mut().zip(step.grads) {
            *g = (&*g + row_grad.affine(share, 0.0)?)?;
        }
    }
    Ok(BatchGradients { loss, weight: total, grads })
}

impl GradientSource for ManualStep {
    fn batch_gradients(
        &mut self,
        drafter: &Drafter,
        head: &FrozenHead,
        rows: &[&TrainRow],
        max_anchors: usize,
        gamma: f64,
        rng: &mut ChaCha8Rng,
    ) -> Result<BatchGradients> {
        batch_of_rows(drafter, rows, max_anchors, gamma, rng, |input, targets| {
            drafter_step(drafter, head, input, targets, self.policy, self.lm_chunk_rows)
        })
    }
}

impl GradientSource for PlannedCpuStep {
    fn batch_gradients(
        &mut self,
        drafter: &Drafter,
        head: &FrozenHead,
        rows: &[&TrainRow],
        max_anchors: usize,
        gamma: f64,
        rng: &mut ChaCha8Rng,
    ) -> Result<BatchGradients> {
        batch_of_rows(drafter, rows, max_anchors, gamma, rng, |input, targets| self.row(drafter, head, input, targets))
    }
}
