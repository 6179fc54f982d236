//! One training row: tokens, loss mask, packed-document layout and target features.

use candle_core::Tensor;

use crate::error::{Error, Result};

/// One row of training data (length `S`).
#[derive(Clone, Debug)]
pub struct TrainRow {
    /// `x[0..S)`.
    pub tokens: Vec<u32>,
    /// `m[0..S)`: true on tokens to learn.
    pub loss_mask: Vec<bool>,
    /// Document id per token (`-1` = padding) when several documents are packed; `None` = one.
    pub doc_ids: Option<Vec<i64>>,
    /// RoPE position per token (restarts at 0 in each packed document).
    pub positions: Vec<usize>,
    /// Target features at the drafter's `target_layer_ids`, concatenated: `[S, F*H]`.
    pub features: Tensor,
}

impl TrainRow {
    /// A row of one document (positions `0..S`); checks that the lengths agree.
    pub fn single(tokens: Vec<u32>, loss_mask: Vec<bool>, features: Tensor) -> Result<Self> {
        let positions = (0..tokens.len()).collect();
        let row = TrainRow { tokens, loss_mask, doc_ids: None, positions, features };
        row.validate()?;
        Ok(row)
    }

    /// `S`.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the row has no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Checks that every per-token field has `S` entries.
    pub fn validate(&self) -> Result<()> {
        let s = self.len();
        let check = |what: &str, n: usize| {
            if n == s {
                Ok(())
            } else {
                Err(Error::invalid(what, format!("{n} entries for {s} tokens")))
            }
        };
        check("loss_mask", self.loss_mask.len())?;
        check("positions", self.positions.len())?;
        check("features rows", self.features.dim(0)?)?;
        if let Some(docs) = &self.doc_ids {
            check("doc_ids", docs.len())?;
        }
        Ok(())
    }
}
