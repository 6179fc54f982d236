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
    padded(sample(rng, candidates.len(), n).into_iter().map(|i| candidates[i]).collect(), n_max)
}

/// Drawn anchor positions, sorted and padded to `n_max` with `keep = false`.
fn padded(mut positions: Vec<usize>, n_max: usize) -> Anchors {
    positions.sort_unstable();
    let pad = positions.last().copied().unwrap_or(0);
    let mut keep = vec![true; positions.len()];
    positions.resize(n_max, pad);
    keep.resize(n_max, false);
    Anchors { positions, keep }
}

/// The anchors of a packed row (document id per token, `-1` = padding): candidates need
/// `m[a] = m[a+1] = 1` inside one document; the `n = min(n_max, candidates)` anchors are shared
/// among documents in proportion to their candidates (largest remainder: document `d` with `c_d`
/// of `C` candidates gets `floor(n c_d / C)` or one more, so a short conversation gets its share),
/// then drawn uniformly without replacement within each document, sorted, padded with
/// `keep = false`. A row of one document draws exactly what [`sample_anchors`] draws.
pub fn sample_anchors_per_document(loss_mask: &[bool], doc_ids: &[i64], n_max: usize, rng: &mut impl Rng) -> Anchors {
    let mut docs: Vec<(i64, Vec<usize>)> = Vec::new();
    for a in anchor_candidates(loss_mask) {
        let doc = doc_ids[a];
        if doc == -1 || doc_ids[a + 1] != doc {
            continue;
        }
        match docs.last_mut() {
            Some((d, list)) if *d == doc => list.push(a),
            _ => docs.push((doc, vec![a])),
        }
    }
    let counts: Vec<usize> = docs.iter().map(|(_, c)| c.len()).collect();
    let shares = proportional_shares(&counts, n_max.min(counts.iter().sum()));
    let mut positions = Vec::with_capacity(n_max);
    for ((_, candidates), &n) in docs.iter().zip(&shares) {
        positions.extend(sample(rng, candidates.len(), n).into_iter().map(|i| candidates[i]));
    }
    padded(positions, n_max)
}

/// `n` split in proportion to `counts` (sum >= `n`) by largest remainder: each share is the floor
/// or the ceiling of `n * count / total`, never above its count; ties go to the earlier entry.
pub fn proportional_shares(counts: &[usize], n: usize) -> Vec<usize> {
    let total: usize = counts.iter().sum();
    if total == 0 {
        return vec![0; counts.len()];
    }
    let mut shares: Vec<usize> = counts.iter().map(|&c| n * c / total).collect();
    let mut order: Vec<usize> = (0..counts.len()).collect();
    order.sort_by_key(|&d| std::cmp::Reverse(n * counts[d] % total));
    let missing = n - shares.iter().sum::<usize>();
    for &d in order.iter().take(missing) {
        shares[d] += 1;
    }
    shares
}
