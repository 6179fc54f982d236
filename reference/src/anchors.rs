//! Anchor sampling (spec section 3): seeded, deterministic, re-drawn every step.

use rand::seq::index::sample;
use rand::Rng;

/// The anchors of one row, padded to `N_max` with `keep = false`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Anchors {
    /// Sorted anchor positions; padding entries repeat the last real anchor (0 if none).
    pub positions: Vec<usize>,
    pub keep: Vec<bool>,
}

impl Anchors {
    /// Number of real (kept) anchors.
    pub fn num_kept(&self) -> usize {
        self.keep.iter().filter(|&&k| k).count()
    }
}

/// Candidates `a <= S-2` with `m[a] = 1` and `m[a+1] = 1`.
pub fn anchor_candidates(loss_mask: &[bool]) -> Vec<usize> {
    (0..loss_mask.len().saturating_sub(1)).filter(|&a| loss_mask[a] && loss_mask[a + 1]).collect()
}

/// Draws up to `n_max` candidates uniformly without replacement, sorts them, and pads to
/// `n_max` with `keep = false`.
pub fn sample_anchors(loss_mask: &[bool], n_max: usize, rng: &mut impl Rng) -> Anchors {
    let candidates = anchor_candidates(loss_mask);
    let n = n_max.min(candidates.len());
    let mut positions: Vec<usize> = sample(rng, candidates.len(), n).into_iter().map(|i| candidates[i]).collect();
    positions.sort_unstable();
    let pad = positions.last().copied().unwrap_or(0);
    let mut keep = vec![true; n];
    positions.resize(n_max, pad);
    keep.resize(n_max, false);
    Anchors { positions, keep }
}
