//! Held-out evaluation of a drafter: the decayed CE, top-1 accuracy per block offset and the
//! expected acceptance length `tau_hat` (spec section 7).

use candle_core::DType;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::data::TrainRow;
use crate::drafter::{Drafter, FrozenHead};
use crate::error::Result;
use crate::loss::{weighted_ce_sum, BlockTargets};
use crate::speculative::argmax_rows;
use crate::train::PreparedRow;

/// What [`evaluate`] measured.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalReport {
    /// `sum w*CE / sum w` over all rows.
    pub loss: f64,
    /// Top-1 accuracy at each offset `o` (index `o`; offset 0 is never scored and stays 0),
    /// over block rows with a valid label.
    pub accuracy: Vec<f64>,
    /// `tau_hat = 1 + sum_{k=1}^{B-1} prod_{o<=k} correct_{j,o}`, averaged over the blocks
    /// ([`BlockStats::tau_hat`]).
    pub tau_hat: f64,
}

/// Per-offset hits and per-block runs of correct predictions, accumulated over blocks.
///
/// A block's run counts its offsets `1, 2, ...` while the prediction is correct and the slot is
/// valid (weight > 0): an invalid slot (a label past the row's end, outside the loss mask or in
/// another document) ends the run as a miss does. Blocks whose offset 1 is not valid (keep=false
/// padding, an anchor whose next token is unsupervised) are not counted.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockStats {
    pub block_size: usize,
    /// Correct predictions at each offset (index `o`; 0 stays 0), over valid slots.
    pub hits: Vec<u64>,
    /// Valid slots at each offset.
    pub counts: Vec<u64>,
    /// Sum over counted blocks of their run length (without the `1 +`).
    pub run_sum: u64,
    /// Blocks counted.
    pub blocks: u64,
}

impl BlockStats {
    /// Nothing counted yet.
    pub fn new(block_size: usize) -> Self {
        BlockStats { block_size, hits: vec![0; block_size], counts: vec![0; block_size], run_sum: 0, blocks: 0 }
    }

    /// Adds the blocks of one row: `predicted[r]` is the argmax of block row `r` (`j*B + o`).
    pub fn add(&mut self, predicted: &[u32], targets: &BlockTargets) {
        let b = self.block_size;
        for (j, block) in predicted.chunks(b).enumerate() {
            let mut run = 0;
            let mut running = targets.weights[j * b + 1] > 0.0;
            let counted = running;
            for (o, &p) in block.iter().enumerate().skip(1) {
                let r = j * b + o;
                let valid = targets.weights[r] > 0.0;
                let correct = valid && p == targets.labels[r];
                if valid {
                    self.counts[o] += 1;
                    self.hits[o] += u64::from(correct);
                }
                running &= correct;
                run += u64::from(running);
            }
            if counted {
                self.run_sum += run;
                self.blocks += 1;
            }
        }
    }

    /// Adds another accumulation (same block size).
    pub fn merge(&mut self, other: &BlockStats) {
        for o in 0..self.block_size {
            self.hits[o] += other.hits[o];
            self.counts[o] += other.counts[o];
        }
        self.run_sum += other.run_sum;
        self.blocks += other.blocks;
    }

    /// Top-1 accuracy at each offset (index `o`; 0 where nothing was counted).
    pub fn accuracy(&self) -> Vec<f64> {
        self.hits.iter().zip(&self.counts).map(|(&h, &c)| if c == 0 { 0.0 } else { h as f64 / c as f64 }).collect()
    }

    /// `1 + mean run length` over the counted blocks; 1 when none was counted.
    pub fn tau_hat(&self) -> f64 {
        1.0 + if self.blocks == 0 { 0.0 } else { self.run_sum as f64 / self.blocks as f64 }
    }
}

/// An evaluation accumulated row by row (by any engine): the weighted CE sum, the total weight
/// and the block stats.
#[derive(Clone, Debug)]
pub struct Evaluation {
    sum: f64,
    total: f64,
    stats: BlockStats,
}

impl Evaluation {
    /// Nothing added yet, for blocks of `block_size`.
    pub fn new(block_size: usize) -> Self {
        Evaluation { sum: 0.0, total: 0.0, stats: BlockStats::new(block_size) }
    }

    /// Adds one row: `ce_sum = sum w*CE` of its blocks and `predicted[r]`, the argmax of block
    /// row `r`.
    pub fn add(&mut self, ce_sum: f64, predicted: &[u32], targets: &BlockTargets) {
        self.sum += ce_sum;
        self.total += targets.total_weight();
        self.stats.add(predicted, targets);
    }

    /// The loss, accuracy and tau_hat over the rows added.
    pub fn report(&self) -> EvalReport {
        EvalReport {
            loss: self.sum / self.total.max(f64::MIN_POSITIVE),
            accuracy: self.stats.accuracy(),
            tau_hat: self.stats.tau_hat(),
        }
    }
}

/// Evaluates `drafter` on `rows` with anchors drawn from `seed` (the same every call).
pub fn evaluate(
    drafter: &Drafter,
    head: &FrozenHead,
    rows: &[TrainRow],
    max_anchors: usize,
    gamma: f64,
    seed: u64,
) -> Result<EvalReport> {
    evaluate_rows(drafter, head, rows.iter().cloned().map(Ok), max_anchors, gamma, seed)
}

/// [`evaluate`] over rows made one at a time.
pub fn evaluate_rows<E>(
    drafter: &Drafter,
    head: &FrozenHead,
    rows: impl IntoIterator<Item = std::result::Result<TrainRow, E>>,
    max_anchors: usize,
    gamma: f64,
    seed: u64,
) -> std::result::Result<EvalReport, E>
where
    E: From<crate::Error>,
{
    let b = drafter.config.block_size;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut eval = Evaluation::new(b);
    for row in rows {
        let PreparedRow { targets, input, .. } = PreparedRow::new(&row?, max_anchors, b, gamma, &mut rng)?;
        let logits = drafter.forward(head, &input)?;
        let ce = weighted_ce_sum(&logits, &targets).and_then(|t| Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?))?;
        eval.add(ce, &argmax_rows(&logits)?, &targets);
    }
    Ok(eval.report())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// tau_hat follows each block's run, not the product of the average accuracies: block A is
    /// right at offset 1 only, block B at offset 2 only; accuracy is 1/2 at both offsets (the
    /// average-accuracy formula would give 1 + 1/2 + 1/4 = 1.75), tau_hat is (2 + 1) / 2 = 1.5.
    #[test]
    fn tau_hat_is_the_mean_run_of_correct_offsets() {
        let targets = BlockTargets { labels: vec![9, 1, 2, 9, 3, 4], weights: vec![0.0, 1.0, 0.8, 0.0, 1.0, 0.8] };
        let mut stats = BlockStats::new(3);
        stats.add(&[0, 1, 7, 0, 7, 4], &targets);
        assert_eq!(stats.accuracy(), vec![0.0, 0.5, 0.5]);
        assert_eq!(stats.tau_hat(), 1.5);
        // An invalid slot ends the run; a block without a valid offset 1 is not counted.
        let targets = BlockTargets { labels: vec![9, 1, 2, 9, 3, 4], weights: vec![0.0, 1.0, 0.0, 0.0, 0.0, 0.0] };
        let mut stats = BlockStats::new(3);
        stats.add(&[0, 1, 2, 0, 3, 4], &targets);
        assert_eq!((stats.blocks, stats.run_sum), (1, 1));
        assert_eq!(stats.tau_hat(), 2.0);
    }
}
