//! The optimized step as a gradient source of the training loop
//! (`dflash_reference::train::train_with`): the same loop, anchors, clipping and AdamW as the
//! reference, with gradients from the manual backward.

use dflash_reference::anchors::sample_anchors;
use dflash_reference::data::TrainRow;
use dflash_reference::drafter::{DraftInput, Drafter, FrozenHead};
use dflash_reference::loss::BlockTargets;
use dflash_reference::train::{BatchGradients, GradientSource};
use dflash_reference::Result;
use rand_chacha::ChaCha8Rng;

use super::drafter_step::{drafter_step, Checkpointing};

/// Gradients of [`drafter_step`] under `policy`, the LM head in chunks of `lm_chunk_rows` rows.
pub struct ManualStep {
    pub policy: Checkpointing,
    pub lm_chunk_rows: usize,
}

impl GradientSource for ManualStep {
    /// Row by row, then combined with each row's share of the batch weight, so that the loss is
    /// `sum_rows sum w*CE / sum_rows sum w` as in the reference.
    fn batch_gradients(
        &mut self,
        drafter: &Drafter,
        head: &FrozenHead,
        rows: &[&TrainRow],
        max_anchors: usize,
        gamma: f64,
        rng: &mut ChaCha8Rng,
    ) -> Result<BatchGradients> {
        let b = drafter.config.block_size;
        let mut per_row = Vec::with_capacity(rows.len());
        for row in rows {
            let anchors = sample_anchors(&row.loss_mask, max_anchors, rng);
            let targets = BlockTargets::new(&row.tokens, &row.loss_mask, &anchors, b, gamma);
            let input = DraftInput::training(row, &anchors, b)?;
            let weight = targets.total_weight();
            per_row.push((weight, drafter_step(drafter, head, &input, &targets, self.policy, self.lm_chunk_rows)?));
        }
        let total: f64 = per_row.iter().map(|(w, _)| w).sum();
        let mut loss = 0.0;
        let mut grads: Vec<_> = drafter
            .named_params()
            .iter()
            .map(|(_, v)| v.as_tensor().zeros_like())
            .collect::<candle_core::Result<_>>()?;
        for (weight, step) in per_row.into_iter().filter(|(w, _)| *w > 0.0) {
            let share = weight / total;
            loss += share * step.loss;
            for (g, (_, row_grad)) in grads.iter_mut().zip(step.grads) {
                *g = (&*g + row_grad.affine(share, 0.0)?)?;
            }
        }
        Ok(BatchGradients { loss, weight: total, grads })
    }
}
