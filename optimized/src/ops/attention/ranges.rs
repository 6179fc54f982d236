//! The attention plan: O(number of row groups) metadata from which every query row's visible
//! keys follow as two half-open intervals, so kernels skip whole tiles instead of testing a
//! mask per element (DESIGN.md, "Exploit DFlash's structure").
//!
//! Query rows come in groups of `group_rows` consecutive rows (a DFlash block of `B` rows, or
//! `group_rows` consecutive positions of a causal sequence). Row `r` of group `g` sees
//! - the context interval `[max(ctx_lo, win_base + r + 1 - W), ctx_hi + r * hi_step)`
//!   (`W` = the sliding window, infinite for full attention), and
//! - the block interval `[blk_lo, blk_lo + (r + 1 if causal_in_block else blk_len))`, or nothing
//!   when `blk_len == 0`.

use crate::{Error, Result};
use dflash_reference::config::AttnKind;
use dflash_reference::mask::BlockLayout;

/// One group of consecutive query rows; all fields are key indices or counts (`u32` so that the
/// array is handed to a kernel as is).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RowGroup {
    /// Lowest visible context key of every row (document start).
    pub ctx_lo: u32,
    /// One past the highest visible context key of row 0.
    pub ctx_hi: u32,
    /// How much `ctx_hi` grows per row (1 for causal attention, 0 for DFlash blocks).
    pub hi_step: u32,
    /// Position of row 0 for the sliding window: row `r` sees no key below `win_base + r + 1 - W`.
    pub win_base: u32,
    /// First key of the group's own block.
    pub blk_lo: u32,
    /// Keys in the group's own block (0: none).
    pub blk_len: u32,
}

/// The plan of one attention call.
#[derive(Clone, Debug, PartialEq)]
pub struct KeyRanges {
    pub num_queries: usize,
    pub num_keys: usize,
    /// Rows per group; the last group may be cut short by `num_queries`.
    pub group_rows: usize,
    /// Sliding window `W`, or `None` for full attention.
    pub window: Option<usize>,
    /// Whether row `r` sees only the first `r + 1` keys of its block (sliding DFlash layers).
    pub causal_in_block: bool,
    pub groups: Vec<RowGroup>,
}

fn to_u32(what: &str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::invalid(what, format!("{n} does not fit in 32 bits")))
}

impl KeyRanges {
    /// The plan of a DFlash layer of `kind` over `layout` (spec section 2): block `j` is one
    /// group of `B` rows seeing the context `[doc start, a_j)` and its own block. Packed
    /// documents must be contiguous runs of one id.
    pub fn dflash(layout: &BlockLayout, kind: AttnKind) -> Result<Self> {
        let (s, b) = (layout.context_len, layout.block_size);
        let doc_start = document_starts(layout.doc_ids.as_deref())?;
        let groups = layout
            .anchors
            .iter()
            .zip(&layout.keep)
            .enumerate()
            .map(|(j, (&a, &keep))| {
                if !keep {
                    return Ok(RowGroup::default());
                }
                let (lo, hi) = match (&layout.doc_ids, &doc_start) {
                    (Some(doc), Some(start)) if doc[a] == -1 => (0, 0),
                    (Some(_), Some(start)) => (start[a], a),
                    _ => (0, a),
                };
                Ok(RowGroup {
                    ctx_lo: to_u32("context start", lo)?,
                    ctx_hi: to_u32("anchor", hi)?,
                    hi_step: 0,
                    win_base: to_u32("anchor", a)?,
                    blk_lo: to_u32("block start", s + j * b)?,
                    blk_len: to_u32("block size", b)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let window = match kind {
            AttnKind::Full => None,
            AttnKind::Sliding { window } => Some(window),
        };
        Ok(KeyRanges {
            num_queries: layout.num_queries(),
            num_keys: layout.num_keys(),
            group_rows: b,
            window,
            causal_in_block: window.is_some(),
            groups,
        })
    }

    /// The causal plan of a sequence of `t` positions (the target's training rows), in groups of
    /// `group_rows` positions.
    pub fn causal(t: usize, kind: AttnKind, group_rows: usize) -> Result<Self> {
        Self::causal_after(0, t, kind, group_rows)
    }

    /// The causal plan of `t` new positions after `past` cached ones (decoding, spec section 4):
    /// query `r` sits at position `past + r` and sees keys `[0, past + r + 1)` (within the
    /// window), the keys being the cache's `past + t` positions.
    pub fn causal_after(past: usize, t: usize, kind: AttnKind, group_rows: usize) -> Result<Self> {
        if group_rows == 0 {
            return Err(Error::invalid("group_rows", "must be at least 1"));
        }
        let groups = (0..t.div_ceil(group_rows))
            .map(|g| {
                let first = past + g * group_rows;
                Ok(RowGroup {
                    ctx_lo: 0,
                    ctx_hi: to_u32("position", first + 1)?,
                    hi_step: 1,
                    win_base: to_u32("position", first)?,
                    blk_lo: 0,
                    blk_len: 0,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let window = match kind {
            AttnKind::Full => None,
            AttnKind::Sliding { window } => Some(window),
        };
        let num_keys = past.checked_add(t).ok_or_else(|| Error::invalid("past", "past + t overflows"))?;
        Ok(KeyRanges { num_queries: t, num_keys, group_rows, window, causal_in_block: false, groups })
    }

    /// Positions per row group of a causal plan for `group_size` query heads per K/V head: the
    /// most whose rows (positions x group size) fill one CTA of the kernels (two warpgroups of
    /// `WG_ROWS`), so that the heads sharing a K/V head share each K/V tile.
    pub fn causal_group_rows(group_size: usize) -> usize {
        (2 * crate::ops::constants::WG_ROWS / group_size.max(1)).max(1)
    }

    /// The two key intervals `[lo, hi)` (context, block) that query `q` sees; either may be empty.
    pub fn row_intervals(&self, q: usize) -> [(usize, usize); 2] {
        let g = &self.groups[q / self.group_rows];
        let r = q % self.group_rows;
        let hi = g.ctx_hi as usize + r * g.hi_step as usize;
        let mut lo = g.ctx_lo as usize;
        if let Some(w) = self.window {
            lo = lo.max((g.win_base as usize + r + 1).saturating_sub(w));
        }
        let blk_lo = g.blk_lo as usize;
        let blk_len = if g.blk_len == 0 {
            0
        } else if self.causal_in_block {
            (r + 1).min(g.blk_len as usize)
        } else {
            g.blk_len as usize
        };
        [(lo, hi.max(lo)), (blk_lo, blk_lo + blk_len)]
    }

    /// Whether query `q` sees key `k`.
    pub fn allow(&self, q: usize, k: usize) -> bool {
        self.row_intervals(q).iter().any(|&(lo, hi)| lo <= k && k < hi)
    }

    /// The rows of group `g`: `[first, end)`, cut short by `num_queries`.
    pub fn group_row_range(&self, g: usize) -> (usize, usize) {
        let first = g * self.group_rows;
        (first, (first + self.group_rows).min(self.num_queries))
    }

    /// The key span `[lo, hi)` covering every key any row of group `g` sees, as the context span
    /// and the block span; empty spans are `(0, 0)`.
    pub fn group_spans(&self, g: usize) -> [(usize, usize); 2] {
        let (first, end) = self.group_row_range(g);
        let mut spans = [(usize::MAX, 0), (usize::MAX, 0)];
        for q in first..end {
            for (span, (lo, hi)) in spans.iter_mut().zip(self.row_intervals(q)) {
                if lo < hi {
                    *span = (span.0.min(lo), span.1.max(hi));
                }
            }
        }
        spans.map(|(lo, hi)| if lo < hi { (lo, hi) } else { (0, 0) })
    }

    /// For each KV tile of `tile_k` keys, the range `[first, end)` of groups that may see a key
    /// in it (a superset of the exact set; `(0, 0)` when none): the inverse plan that the
    /// key-major backward walks.
    pub fn kv_tile_group_ranges(&self, tile_k: usize) -> Vec<(u32, u32)> {
        let mut ranges = vec![(u32::MAX, 0u32); self.num_keys.div_ceil(tile_k)];
        for g in 0..self.groups.len() {
            for (lo, hi) in self.group_spans(g) {
                for range in &mut ranges[lo / tile_k..hi.div_ceil(tile_k)] {
                    *range = (range.0.min(g as u32), range.1.max(g as u32 + 1));
                }
            }
        }
        ranges.into_iter().map(|(first, end)| if first < end { (first, end) } else { (0, 0) }).collect()
    }

    /// Number of allowed (query, key) pairs: the useful work is `4 * d * heads * pairs` FLOPs.
    pub fn allowed_pairs(&self) -> u64 {
        (0..self.num_queries).map(|q| self.row_intervals(q).iter().map(|(lo, hi)| (hi - lo) as u64).sum::<u64>()).sum()
    }
}

/// For each context key, the first index of its document run, if documents are given; fails
/// when a document id reappears after another (documents must be contiguous).
fn document_starts(doc_ids: Option<&[i64]>) -> Result<Option<Vec<usize>>> {
    let Some(doc) = doc_ids else { return Ok(None) };
    let mut starts = Vec::with_capacity(doc.len());
    let mut seen = std::collections::HashSet::new();
    for (k, &d) in doc.iter().enumerate() {
        if k > 0 && doc[k - 1] == d {
            starts.push(starts[k - 1]);
            continue;
        }
        if d != -1 && !seen.insert(d) {
            return Err(Error::invalid("doc_ids", format!("document {d} is not contiguous (seen again at token {k})")));
        }
        starts.push(k);
    }
    Ok(Some(starts))
}
