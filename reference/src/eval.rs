//! Held-out evaluation of a drafter: the decayed CE and top-1 accuracy per block offset.

use candle_core::DType;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::data::TrainRow;
use crate::drafter::{Drafter, FrozenHead};
use crate::error::Result;
use crate::loss::weighted_ce_sum;
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
    let b = drafter.config.block_size;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (mut sum, mut total) = (0.0, 0.0);
    let (mut hits, mut counts) = (vec![0usize; b], vec![0usize; b]);
    for row in rows {
        let PreparedRow { targets, input, .. } = PreparedRow::new(row, max_anchors, b, gamma, &mut rng)?;
        let logits = drafter.forward(head, &input)?;
        sum += weighted_ce_sum(&logits, &targets)?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        total += targets.total_weight();
        for (r, predicted) in argmax_rows(&logits)?.into_iter().enumerate() {
            if targets.weights[r] > 0.0 {
                counts[r % b] += 1;
                hits[r % b] += usize::from(predicted == targets.labels[r]);
            }
        }
    }
    let accuracy = hits.iter().zip(&counts).map(|(&h, &c)| if c == 0 { 0.0 } else { h as f64 / c as f64 }).collect();
    Ok(EvalReport { loss: sum / total.max(f64::MIN_POSITIVE), accuracy })
}
