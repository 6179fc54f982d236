//! The decayed cross-entropy of spec section 3.

use candle_core::{Device, Tensor, D};

use crate::anchors::Anchors;
use crate::error::{Error, Result};
use crate::ops::logsumexp;

/// The spec's decay `gamma` for a block size: 7 for 16, 5 for 10, 4 for 8; other sizes scale
/// 16's value linearly (`7B/16`).
pub fn default_gamma(block_size: usize) -> f64 {
    match block_size {
        16 => 7.0,
        10 => 5.0,
        8 => 4.0,
        b => 7.0 * b as f64 / 16.0,
    }
}

/// Label and loss weight of every block row `[N*B]`.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockTargets {
    /// `y_{j,o} = x[a_j + o]`; 0 where `a_j + o >= S` (its weight is 0).
    pub labels: Vec<u32>,
    /// `keep[j] * [a_j+o < S] * m[a_j+o] * exp(-(o-1)/gamma)` for `o >= 1`; 0 at `o = 0`.
    pub weights: Vec<f64>,
}

impl BlockTargets {
    /// The targets of a row's blocks.
    pub fn new(tokens: &[u32], loss_mask: &[bool], anchors: &Anchors, block_size: usize, gamma: f64) -> Self {
        let s = tokens.len();
        let mut labels = Vec::with_capacity(anchors.positions.len() * block_size);
        let mut weights = Vec::with_capacity(labels.capacity());
        for (&a, &keep) in anchors.positions.iter().zip(&anchors.keep) {
            for o in 0..block_size {
                let p = a + o;
                labels.push(if p < s { tokens[p] } else { 0 });
                let valid = o >= 1 && keep && p < s && loss_mask[p];
                weights.push(if valid { (-((o - 1) as f64) / gamma).exp() } else { 0.0 });
            }
        }
        BlockTargets { labels, weights }
    }

    /// Zeroes the weight of the block rows whose label lies in another document than their
    /// anchor (`doc_ids` per token of a packed row): the next conversation, which the block
    /// cannot see, is not a target.
    pub fn restrict_to_documents(&mut self, doc_ids: &[i64], anchors: &Anchors, block_size: usize) {
        for (j, &a) in anchors.positions.iter().enumerate() {
            for o in 0..block_size {
                if doc_ids.get(a + o).is_some_and(|&d| d != doc_ids[a]) {
                    self.weights[j * block_size + o] = 0.0;
                }
            }
        }
    }

    /// `sum w`.
    pub fn total_weight(&self) -> f64 {
        self.weights.iter().sum()
    }
}

/// `sum_r w_r * CE(logits_r, y_r)`, a scalar; logits `[R, V]`.
pub fn weighted_ce_sum(logits: &Tensor, targets: &BlockTargets) -> Result<Tensor> {
    let rows = logits.dim(0)?;
    if targets.labels.len() != rows {
        return Err(Error::invalid("targets", format!("{} labels for {rows} logit rows", targets.labels.len())));
    }
    let labels = Tensor::from_vec(targets.labels.clone(), (rows, 1), &Device::Cpu)?;
    let weights = Tensor::from_vec(targets.weights.clone(), rows, &Device::Cpu)?.to_dtype(logits.dtype())?;
    let picked = logits.gather(&labels, D::Minus1)?.squeeze(D::Minus1)?;
    let ce = (logsumexp(logits)?.squeeze(D::Minus1)? - picked)?;
    Ok((ce * weights)?.sum_all()?)
}

/// `L = sum w*CE / sum w` for one row's blocks; 0 when no row carries weight.
pub fn decayed_ce(logits: &Tensor, targets: &BlockTargets) -> Result<Tensor> {
    let total = targets.total_weight();
    let sum = weighted_ce_sum(logits, targets)?;
    if total == 0.0 {
        return Ok(sum.zeros_like()?);
    }
    Ok(sum.affine(1.0 / total, 0.0)?)
}
