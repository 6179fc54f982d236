//! The DFlash training mask (spec section 2) as a predicate, the causal mask of the target,
//! and dense boolean builders of both (for tests and the dense attention).

use crate::config::AttnKind;
use crate::error::{Error, Result};

/// Where the drafted blocks of one row sit. Query axis: `N*B` rows, row `q` is block `q / B`,
/// offset `q % B`. Key axis: `S` context keys, then the `N*B` block tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockLayout {
    /// `S`, the number of context keys (tokens of the row).
    pub context_len: usize,
    /// `B`, tokens per block (anchor included).
    pub block_size: usize,
    /// `a_j`, sorted; `a_j < S` in training, `a_j == S` for the inference block after the context.
    pub anchors: Vec<usize>,
    /// `keep[j]`: block `j` is real (false for padding blocks, which see nothing).
    pub keep: Vec<bool>,
    /// Document id per context key (`-1` = padding), for packed rows; `None` = one document.
    pub doc_ids: Option<Vec<i64>>,
}

impl BlockLayout {
    /// Checks the invariants: one keep flag per anchor, anchors sorted and within the row, one
    /// document id per context key, anchors inside the row when documents are given.
    pub fn new(
        context_len: usize,
        block_size: usize,
        anchors: Vec<usize>,
        keep: Vec<bool>,
        doc_ids: Option<Vec<i64>>,
    ) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::invalid("block_size", "must be at least 1"));
        }
        if keep.len() != anchors.len() {
            return Err(Error::invalid("keep", format!("{} flags for {} anchors", keep.len(), anchors.len())));
        }
        if let Some(j) = (1..anchors.len()).find(|&j| anchors[j] < anchors[j - 1]) {
            return Err(Error::invalid("anchors", format!("not sorted at index {j}")));
        }
        let limit = if doc_ids.is_some() { context_len.saturating_sub(1) } else { context_len };
        if let Some(&a) = anchors.iter().find(|&&a| a > limit) {
            return Err(Error::invalid("anchors", format!("anchor {a} is outside the row of {context_len} tokens")));
        }
        if let Some(docs) = &doc_ids {
            if docs.len() != context_len {
                return Err(Error::invalid("doc_ids", format!("{} ids for {context_len} tokens", docs.len())));
            }
        }
        Ok(BlockLayout { context_len, block_size, anchors, keep, doc_ids })
    }

    /// `N*B`, the number of queries.
    pub fn num_queries(&self) -> usize {
        self.anchors.len() * self.block_size
    }

    /// `S + N*B`, the number of keys.
    pub fn num_keys(&self) -> usize {
        self.context_len + self.num_queries()
    }

    /// Whether query `q` may attend to key `k` in a layer of kind `kind` (spec section 2).
    pub fn allow(&self, kind: AttnKind, q: usize, k: usize) -> bool {
        let (s, b) = (self.context_len, self.block_size);
        let (j, o) = (q / b, q % b);
        let a = self.anchors[j];
        if !self.keep[j] {
            return false;
        }
        if k < s {
            let same_doc = match &self.doc_ids {
                Some(doc) => doc[k] == doc[a] && doc[a] != -1,
                None => true,
            };
            let in_range = match kind {
                AttnKind::Full => k < a,
                AttnKind::Sliding { window } => a + o < k + window && k < a,
            };
            same_doc && in_range
        } else {
            let (j2, o2) = ((k - s) / b, (k - s) % b);
            match kind {
                AttnKind::Full => j2 == j,
                AttnKind::Sliding { .. } => j2 == j && o2 <= o,
            }
        }
    }

    /// The dense boolean mask `[N*B, S+N*B]`, row-major.
    pub fn dense(&self, kind: AttnKind) -> Vec<bool> {
        let (nq, nk) = (self.num_queries(), self.num_keys());
        (0..nq).flat_map(|q| (0..nk).map(move |k| self.allow(kind, q, k))).collect()
    }
}

/// Whether query position `q` may attend to key position `k` in the target's causal attention.
pub fn causal_allow(kind: AttnKind, q: usize, k: usize) -> bool {
    match kind {
        AttnKind::Full => k <= q,
        AttnKind::Sliding { window } => k <= q && q < k + window,
    }
}

/// The dense causal mask `[T, T]`, row-major.
pub fn causal_dense(kind: AttnKind, t: usize) -> Vec<bool> {
    (0..t).flat_map(|q| (0..t).map(move |k| causal_allow(kind, q, k))).collect()
}
