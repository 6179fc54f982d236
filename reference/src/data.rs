//! One training row: tokens, loss mask, packed-document layout and target features.
//! [`Row`] is what the data pipeline makes (spec section 6) and what both the target forward and
//! the drafter step consume; [`TrainRow`] is a row with its target features.

use candle_core::Tensor;

use crate::error::{Error, Result};

/// One row of `S` tokens: one conversation, or several packed ones (spec section 6).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    /// `x[0..S)`.
    pub tokens: Vec<u32>,
    /// `m[0..S)`: true on tokens to learn.
    pub loss_mask: Vec<bool>,
    /// Document id per token: `0, 1, ...` in packing order, `-1` = padding (at the end).
    pub doc_ids: Vec<i64>,
    /// RoPE position per token, restarting at 0 in each document (0 on padding).
    pub positions: Vec<usize>,
}

impl Row {
    /// Checks the layout: every per-token field has `S` entries, document ids count up from 0
    /// in runs with padding only at the end, positions restart at 0 in each document, and
    /// padding is never supervised.
    pub fn validate(&self) -> Result<()> {
        let s = self.tokens.len();
        for (what, n) in
            [("loss_mask", self.loss_mask.len()), ("doc_ids", self.doc_ids.len()), ("positions", self.positions.len())]
        {
            if n != s {
                return Err(Error::invalid(what, format!("{n} entries for {s} tokens")));
            }
        }
        for i in 0..s {
            let (doc, prev) = (self.doc_ids[i], if i == 0 { None } else { Some(self.doc_ids[i - 1]) });
            let want_pos = match prev {
                _ if doc == -1 => 0,
                Some(p) if p == doc => self.positions[i - 1] + 1,
                Some(p) if p + 1 == doc && p >= 0 => 0,
                None if doc == 0 => 0,
                _ => return Err(Error::invalid("doc_ids", format!("id {doc} at token {i} after {prev:?}"))),
            };
            if self.positions[i] != want_pos {
                return Err(Error::invalid(
                    "positions",
                    format!("{} at token {i}, {want_pos} expected", self.positions[i]),
                ));
            }
            if doc == -1 && self.loss_mask[i] {
                return Err(Error::invalid("loss_mask", format!("padding token {i} is supervised")));
            }
        }
        Ok(())
    }
}

/// One row of training data (length `S`).
/// The token ranges of the documents of a row's `doc_ids` (maximal runs of one id; padding, id
/// -1, belongs to none), in order.
pub fn document_runs(doc_ids: &[i64]) -> Vec<std::ops::Range<usize>> {
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    for (k, &d) in doc_ids.iter().enumerate() {
        match runs.last_mut() {
            Some(run) if d != -1 && run.end == k && doc_ids[run.start] == d => run.end = k + 1,
            _ if d != -1 => runs.push(k..k + 1),
            _ => {}
        }
    }
    runs
}

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

    /// A data pipeline's row with its target features `[S, F*H]`; checks both.
    pub fn from_row(row: Row, features: Tensor) -> Result<Self> {
        row.validate()?;
        let Row { tokens, loss_mask, doc_ids, positions } = row;
        let train_row = TrainRow { tokens, loss_mask, doc_ids: Some(doc_ids), positions, features };
        train_row.validate()?;
        Ok(train_row)
    }

    /// `S`.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Tokens of documents (`S` less the padding, whose document id is `-1`).
    pub fn document_tokens(&self) -> usize {
        self.doc_ids.as_ref().map_or(self.tokens.len(), |d| d.iter().filter(|&&id| id >= 0).count())
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
