//! The plain reference training loop: anchors re-drawn every step, decayed CE over a batch of
//! rows, autograd, global clipping, AdamW on the warmup + cosine schedule.

use candle_core::Tensor;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::anchors::{sample_anchors, sample_anchors_per_document, Anchors};
use crate::data::TrainRow;
use crate::drafter::{DraftInput, Drafter, FrozenHead};
use crate::error::{Error, Result};
use crate::eval::BlockStats;
use crate::loss::{weighted_ce_sum, BlockTargets};
use crate::optim::{clip_grad_norm, collect_grads, lr_at, AdamW, AdamWConfig};
use crate::speculative::argmax_rows;

/// Options of a training run; the defaults are the spec's recipe where it has one.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainOptions {
    pub steps: usize,
    pub rows_per_step: usize,
    /// `N_max`, anchors drawn per row.
    pub max_anchors: usize,
    pub optimizer: AdamWConfig,
    pub warmup_frac: f64,
    pub clip_norm: f64,
    /// Loss decay `gamma`.
    pub gamma: f64,
    pub seed: u64,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            steps: 1000,
            rows_per_step: 1,
            max_anchors: 512,
            optimizer: AdamWConfig::default(),
            warmup_frac: 0.04,
            clip_norm: 1.0,
            gamma: 7.0,
            seed: 0,
        }
    }
}

/// What one step did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    pub step: usize,
    pub loss: f64,
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Loss-weighted block rows (sum of weights) in the step.
    pub weight: f64,
}

/// One row's share of a step: its anchors, the labels and loss weights of its blocks, and the
/// drafter's input. Packed rows (with document ids) draw their anchors per document
/// ([`sample_anchors_per_document`]) and weigh no label of another document.
pub struct PreparedRow {
    pub anchors: Anchors,
    pub targets: BlockTargets,
    pub input: DraftInput,
}

impl PreparedRow {
    /// Draws `row`'s anchors (up to `max_anchors`) from `rng` and builds its targets and input.
    pub fn new(
        row: &TrainRow,
        max_anchors: usize,
        block_size: usize,
        gamma: f64,
        rng: &mut ChaCha8Rng,
    ) -> Result<Self> {
        let anchors = match &row.doc_ids {
            Some(docs) => sample_anchors_per_document(&row.loss_mask, docs, max_anchors, rng),
            None => sample_anchors(&row.loss_mask, max_anchors, rng),
        };
        let mut targets = BlockTargets::new(&row.tokens, &row.loss_mask, &anchors, block_size, gamma);
        if let Some(docs) = &row.doc_ids {
            targets.restrict_to_documents(docs, &anchors, block_size);
        }
        let input = DraftInput::training(row, &anchors, block_size)?;
        Ok(PreparedRow { anchors, targets, input })
    }
}

/// The batch loss `sum_rows sum w*CE / sum_rows sum w` of `rows`, with their anchors drawn from
/// `rng`; returns the loss tensor and the total weight.
pub fn batch_loss(
    drafter: &Drafter,
    head: &FrozenHead,
    rows: &[&TrainRow],
    max_anchors: usize,
    gamma: f64,
    rng: &mut ChaCha8Rng,
) -> Result<(Tensor, f64)> {
    batch_loss_with_stats(drafter, head, rows, max_anchors, gamma, rng, None)
}

/// [`batch_loss`], also adding every block's top-1 correctness to `stats` (per-offset accuracy
/// and tau_hat of the step's blocks) when given; the loss is the same either way.
pub fn batch_loss_with_stats(
    drafter: &Drafter,
    head: &FrozenHead,
    rows: &[&TrainRow],
    max_anchors: usize,
    gamma: f64,
    rng: &mut ChaCha8Rng,
    mut stats: Option<&mut BlockStats>,
) -> Result<(Tensor, f64)> {
    let b = drafter.config.block_size;
    let mut sum: Option<Tensor> = None;
    let mut total = 0.0;
    for row in rows {
        let PreparedRow { targets, input, .. } = PreparedRow::new(row, max_anchors, b, gamma, rng)?;
        let logits = drafter.forward(head, &input)?;
        let row_sum = weighted_ce_sum(&logits, &targets)?;
        total += targets.total_weight();
        if let Some(stats) = stats.as_deref_mut() {
            stats.add(&argmax_rows(&logits)?, &targets);
        }
        sum = Some(match sum {
            Some(s) => (s + row_sum)?,
            None => row_sum,
        });
    }
    let sum = sum.ok_or_else(|| Error::invalid("rows", "a step needs at least one row"))?;
    Ok((sum.affine(1.0 / total.max(f64::MIN_POSITIVE), 0.0)?, total))
}

/// The loss of one batch and the gradient of every trainable parameter (in `named_params` order).
pub struct BatchGradients {
    pub loss: f64,
    /// Sum of the loss weights of the batch.
    pub weight: f64,
    pub grads: Vec<Tensor>,
}

/// Where a training step gets its loss and gradients from: the reference's autograd
/// ([`Autograd`]) or an optimized step. Anchors are drawn from `rng`, row by row, in order, so
/// that every source trains on the same anchors for the same seed.
pub trait GradientSource {
    fn batch_gradients(
        &mut self,
        drafter: &Drafter,
        head: &FrozenHead,
        rows: &[&TrainRow],
        max_anchors: usize,
        gamma: f64,
        rng: &mut ChaCha8Rng,
    ) -> Result<BatchGradients>;
}

/// The reference's gradients: candle autograd of [`batch_loss`].
pub struct Autograd;

impl GradientSource for Autograd {
    fn batch_gradients(
        &mut self,
        drafter: &Drafter,
        head: &FrozenHead,
        rows: &[&TrainRow],
        max_anchors: usize,
        gamma: f64,
        rng: &mut ChaCha8Rng,
    ) -> Result<BatchGradients> {
        let (loss, weight) = batch_loss(drafter, head, rows, max_anchors, gamma, rng)?;
        let grads = collect_grads(drafter.named_params(), &loss.backward()?)?;
        Ok(BatchGradients { loss: loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?, weight, grads })
    }
}

/// Trains `drafter` on `data` for `opts.steps` steps with the reference's autograd, calling
/// `on_step` after each. Fails on a non-finite loss or gradient, naming the step (and the tensor).
pub fn train(
    drafter: &Drafter,
    head: &FrozenHead,
    data: &[TrainRow],
    opts: &TrainOptions,
    on_step: impl FnMut(&StepReport),
) -> Result<Vec<StepReport>> {
    train_with(drafter, head, data, opts, &mut Autograd, on_step)
}

/// [`train`] with the gradients of `source`.
pub fn train_with(
    drafter: &Drafter,
    head: &FrozenHead,
    data: &[TrainRow],
    opts: &TrainOptions,
    source: &mut impl GradientSource,
    mut on_step: impl FnMut(&StepReport),
) -> Result<Vec<StepReport>> {
    if data.is_empty() {
        return Err(Error::invalid("data", "no training rows"));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    let mut order: Vec<usize> = (0..data.len()).collect();
    let mut cursor = order.len();
    let params = drafter.named_params();
    let mut adamw = AdamW::new(params, opts.optimizer.clone())?;
    let mut reports = Vec::with_capacity(opts.steps);
    for step in 0..opts.steps {
        let mut rows = Vec::with_capacity(opts.rows_per_step);
        while rows.len() < opts.rows_per_step {
            if cursor == order.len() {
                order.shuffle(&mut rng);
                cursor = 0;
            }
            rows.push(&data[order[cursor]]);
            cursor += 1;
        }
        let batch = source
            .batch_gradients(drafter, head, &rows, opts.max_anchors, opts.gamma, &mut rng)
            .map_err(|e| Error::invalid(format!("step {step}"), e.to_string()))?;
        let (loss_value, weight, mut grads) = (batch.loss, batch.weight, batch.grads);
        if !loss_value.is_finite() {
            return Err(Error::invalid(format!("loss at step {step}"), format!("{loss_value}")));
        }
        let grad_norm = clip_grad_norm(params, &mut grads, opts.clip_norm)
            .map_err(|e| Error::invalid(format!("step {step}"), e.to_string()))?;
        let lr = lr_at(step, opts.steps, opts.optimizer.lr, opts.warmup_frac);
        adamw.step(params, &grads, lr)?;
        let report = StepReport { step, loss: loss_value, lr, grad_norm, weight };
        on_step(&report);
        reports.push(report);
    }
    Ok(reports)
}
