//! The drafter step as a gradient source of the reference's training loop
//! (`dflash_reference::train::train_with`): the same loop, anchors, clipping and AdamW as the
//! reference, with each row's gradients from the step on the CPU twins ([`HostGradients`]).

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use dflash_reference::data::TrainRow;
use dflash_reference::drafter::{DraftInput, Drafter, FrozenHead};
use dflash_reference::loss::BlockTargets;
use dflash_reference::train::{BatchGradients, GradientSource, PreparedRow};
use rand_chacha::ChaCha8Rng;

use crate::backend::host::Host;
use crate::memory::step::{Checkpointing, StepShape};
use crate::model::drafter_step::{DrafterStep, Grads};
use crate::ops::Elem;
use crate::Result;

/// Gradients of the step on the CPU storing `E`, under `policy`: one step per row shape
/// (context length, anchors), made on first use and reused.
pub struct HostGradients<E: Elem> {
    pub policy: Checkpointing,
    pub lm_chunk_rows: usize,
    steps: HashMap<(usize, usize), DrafterStep<Host<E>>>,
}

impl<E: Elem> HostGradients<E> {
    pub fn new(policy: Checkpointing, lm_chunk_rows: usize) -> Self {
        HostGradients { policy, lm_chunk_rows, steps: HashMap::new() }
    }

    /// The mean loss of one row and its gradients, as the drafter's tensors.
    fn row(
        &mut self,
        drafter: &Drafter,
        head: &FrozenHead,
        input: &DraftInput,
        targets: &BlockTargets,
    ) -> Result<(f64, Vec<Tensor>)> {
        let key = (input.layout.context_len, input.layout.anchors.len());
        let step = match self.steps.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let shape = StepShape { context_len: key.0, num_anchors: key.1, lm_chunk_rows: self.lm_chunk_rows };
                let mut step = DrafterStep::new(Host::<E>::default(), &drafter.config, shape, self.policy, false)?;
                step.load_lm_head(head)?;
                e.insert(step)
            }
        };
        step.load_weights(drafter)?;
        step.set_input(input, head, targets)?;
        let loss = step.step(1.0 / targets.total_weight())?.loss;
        step.grad_sum_squares(Grads::Step)?;
        let grads = step
            .grads_to_host()?
            .into_iter()
            .zip(drafter.named_params())
            .map(|((_, g), (_, var))| Ok(Tensor::from_vec(g, var.dims(), &Device::Cpu)?.to_dtype(var.dtype())?))
            .collect::<Result<Vec<_>>>()?;
        Ok((loss, grads))
    }
}

impl<E: Elem> GradientSource for HostGradients<E> {
    /// Row by row, then combined with each row's share of the batch weight, so that the loss is
    /// `sum_rows sum w*CE / sum_rows sum w` as in the reference; rows without weight add nothing.
    fn batch_gradients(
        &mut self,
        drafter: &Drafter,
        head: &FrozenHead,
        rows: &[&TrainRow],
        max_anchors: usize,
        gamma: f64,
        rng: &mut ChaCha8Rng,
    ) -> dflash_reference::Result<BatchGradients> {
        let b = drafter.config.block_size;
        let mut per_row = Vec::with_capacity(rows.len());
        for r in rows {
            let PreparedRow { targets, input, .. } = PreparedRow::new(r, max_anchors, b, gamma, rng)?;
            let weight = targets.total_weight();
            if weight > 0.0 {
                per_row.push((weight, self.row(drafter, head, &input, &targets)?));
            }
        }
        let total: f64 = per_row.iter().map(|(w, _)| w).sum();
        let mut loss = 0.0;
        let mut grads: Vec<_> = drafter
            .named_params()
            .iter()
            .map(|(_, v)| v.as_tensor().zeros_like())
            .collect::<candle_core::Result<_>>()?;
        for (weight, (row_loss, row_grads)) in per_row {
            let share = weight / total;
            loss += share * row_loss;
            for (g, row_grad) in grads.iter_mut().zip(row_grads) {
                *g = (&*g + row_grad.affine(share, 0.0)?)?;
            }
        }
        Ok(BatchGradients { loss, weight: total, grads })
    }
}
