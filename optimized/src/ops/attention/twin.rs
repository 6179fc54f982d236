//! The CPU twin of the fused attention kernels: the same tiling, tile classification and online
//! softmax, in f32 or f64, with no mask, no score matrix and no K/V expanded to the query heads
//! (DESIGN.md, "Never materialise what the kernel can stream").
//!
//! Forward, query-major: for each row group and KV head, the group's rows times that KV head's
//! query heads walk the group's KV tiles (of `forward_tile_k(d)` keys, as the kernel) once (full
//! tiles without a per-key test), keeping a running max `m`, sum `l` and output accumulator per
//! row. Backward: `Dsum = rowsum(dout * out)`, then key-major for dK and dV (each KV tile of
//! `TILE_K` keys walks the groups of `kv_tile_group_ranges`), then query-major for dQ (tiles of
//! `TILE_K`). All arithmetic, accumulation included, runs in the element type.

use super::ranges::KeyRanges;
pub use super::AttnShape;
use crate::ops::constants::{forward_tile_k, MAX_FORWARD_TILE_K, RESCALE_SLACK_LOG2, TILE_K};
use crate::ops::Real;
use crate::{Error, Result};

/// How the rows of a group see a KV tile that they visit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileKind {
    /// Every row sees every key of the tile: no per-key test.
    Full,
    /// Some rows see some keys: each key is tested against the row's intervals.
    Partial,
}

/// The keys `[lo, hi)` of KV tile `t` of `tile_k` keys.
fn tile_keys(plan: &KeyRanges, t: usize, tile_k: usize) -> (usize, usize) {
    (t * tile_k, ((t + 1) * tile_k).min(plan.num_keys))
}

/// How group `g` sees KV tile `t` (of `tile_k` keys), or `None` when no row of it sees any key
/// there. A row's two intervals are disjoint (context keys lie below the block; causal plans have
/// no block), so the keys a row sees in the tile are the sum of the two overlaps.
pub fn tile_kind(plan: &KeyRanges, g: usize, t: usize, tile_k: usize) -> Option<TileKind> {
    let (k0, k1) = tile_keys(plan, t, tile_k);
    let (first, end) = plan.group_row_range(g);
    let (mut any, mut all) = (false, true);
    for q in first..end {
        let seen: usize = plan.row_intervals(q).iter().map(|&(lo, hi)| hi.min(k1).saturating_sub(lo.max(k0))).sum();
        any |= seen > 0;
        all &= seen == k1 - k0;
    }
    match (any, all) {
        (false, _) => None,
        (true, true) => Some(TileKind::Full),
        (true, false) => Some(TileKind::Partial),
    }
}

/// The KV tiles (of `tile_k` keys) group `g` visits with their kinds, ascending and each once:
/// the union of the tiles overlapping its context span and its block span, less the tiles no row
/// of it sees.
pub fn group_tiles(plan: &KeyRanges, g: usize, tile_k: usize) -> impl Iterator<Item = (usize, TileKind)> + '_ {
    let [a, b] = plan.group_spans(g).map(|(lo, hi)| lo / tile_k..hi.div_ceil(tile_k));
    let (first, second) = if a.start <= b.start { (a, b) } else { (b, a) };
    let second = second.start.max(first.end)..second.end;
    first.chain(second).filter_map(move |t| tile_kind(plan, g, t, tile_k).map(|kind| (t, kind)))
}

/// The keys of `[k0, k1)` that a row with `intervals` (`row_intervals`) sees, in a tile of `kind`.
fn row_keys(kind: TileKind, intervals: [(usize, usize); 2], k0: usize, k1: usize) -> impl Iterator<Item = usize> {
    (k0..k1).filter(move |&k| kind == TileKind::Full || intervals.iter().any(|&(lo, hi)| lo <= k && k < hi))
}

/// The rows `(query, head)` of group `g` under KV head `kh`: the group's queries times the
/// query heads of `kh`, query-major.
fn group_rows(plan: &KeyRanges, shape: AttnShape, g: usize, kh: usize) -> impl Iterator<Item = (usize, usize)> {
    let group = shape.num_heads / shape.num_kv_heads;
    let (first, end) = plan.group_row_range(g);
    (first..end).flat_map(move |q| (kh * group..(kh + 1) * group).map(move |h| (q, h)))
}

fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).fold(T::ZERO, |acc, (&x, &y)| acc + x * y)
}

/// `y += a * x`.
fn axpy<T: Real>(y: &mut [T], a: T, x: &[T]) {
    y.iter_mut().zip(x).for_each(|(y, &x)| *y += a * x);
}

/// Checks the shape and that each `(name, length, shape)` tensor holds the elements its shape says.
fn check(shape: AttnShape, tensors: &[(&str, usize, &[usize])]) -> Result<()> {
    let AttnShape { num_heads: nh, num_kv_heads: nkv, head_dim: d } = shape;
    if nkv == 0 || nh % nkv != 0 || d == 0 {
        return Err(Error::invalid("shape", format!("{nh} heads over {nkv} KV heads of size {d}")));
    }
    for &(name, len, dims) in tensors {
        if len != dims.iter().product::<usize>() {
            return Err(Error::invalid(name, format!("{len} elements for shape {dims:?}")));
        }
    }
    Ok(())
}

/// Attention under `plan`: q `[Q, nh, d]`, k and v `[K, nkv, d]` -> (out `[Q, nh, d]`, lse
/// `[nh, Q]`, the log-sum-exp of the scaled scores). Rows that see nothing: out 0, lse -inf.
pub fn attention_forward<T: Real>(
    plan: &KeyRanges,
    shape: AttnShape,
    q: &[T],
    k: &[T],
    v: &[T],
    scale: f64,
) -> Result<(Vec<T>, Vec<T>)> {
    let AttnShape { num_heads: nh, num_kv_heads: nkv, head_dim: d } = shape;
    let (nq, nk) = (plan.num_queries, plan.num_keys);
    check(shape, &[("q", q.len(), &[nq, nh, d]), ("k", k.len(), &[nk, nkv, d]), ("v", v.len(), &[nk, nkv, d])])?;
    let scale = T::from_f64(scale);
    // The running max moves only past this (the kernel's RESCALE_SLACK_LOG2, natural units).
    let slack = T::from_f64(RESCALE_SLACK_LOG2 as f64 * std::f64::consts::LN_2);
    let mut out = vec![T::ZERO; nq * nh * d];
    let mut lse = vec![T::NEG_INFINITY; nh * nq];
    let rows_max = plan.group_rows * (nh / nkv);
    let (mut m, mut l, mut acc) = (Vec::with_capacity(rows_max), Vec::with_capacity(rows_max), Vec::new());
    let tile_k = forward_tile_k(d);
    let mut s = [T::ZERO; MAX_FORWARD_TILE_K];
    for g in 0..plan.groups.len() {
        for kh in 0..nkv {
            let rows = group_rows(plan, shape, g, kh).count();
            m.clear();
            m.resize(rows, T::NEG_INFINITY);
            l.clear();
            l.resize(rows, T::ZERO);
            acc.clear();
            acc.resize(rows * d, T::ZERO);
            for (t, kind) in group_tiles(plan, g, tile_k) {
                let (k0, k1) = tile_keys(plan, t, tile_k);
                for (i, (qi, h)) in group_rows(plan, shape, g, kh).enumerate() {
                    let intervals = plan.row_intervals(qi);
                    let q_row = &q[(qi * nh + h) * d..][..d];
                    let mut tile_max = None;
                    for key in row_keys(kind, intervals, k0, k1) {
                        let sk = scale * dot(q_row, &k[(key * nkv + kh) * d..][..d]);
                        s[key - k0] = sk;
                        tile_max = Some(match tile_max {
                            Some(mx) if mx >= sk => mx,
                            _ => sk,
                        });
                    }
                    let Some(tile_max) = tile_max else { continue };
                    let m_new = if tile_max > m[i] + slack { tile_max } else { m[i] };
                    let alpha = (m[i] - m_new).exp();
                    let acc_row = &mut acc[i * d..][..d];
                    acc_row.iter_mut().for_each(|a| *a = *a * alpha);
                    l[i] = l[i] * alpha;
                    for key in row_keys(kind, intervals, k0, k1) {
                        let p = (s[key - k0] - m_new).exp();
                        l[i] += p;
                        axpy(acc_row, p, &v[(key * nkv + kh) * d..][..d]);
                    }
                    m[i] = m_new;
                }
            }
            for (i, (qi, h)) in group_rows(plan, shape, g, kh).enumerate() {
                if l[i] > T::ZERO {
                    let out_row = &mut out[(qi * nh + h) * d..][..d];
                    out_row.iter_mut().zip(&acc[i * d..][..d]).for_each(|(o, &a)| *o = a / l[i]);
                    lse[h * nq + qi] = m[i] + l[i].ln();
                }
            }
        }
    }
    Ok((out, lse))
}

/// Gradients of attention under `plan` from the forward's `out` and `lse` and the output
/// gradient `dout` `[Q, nh, d]` -> (dq `[Q, nh, d]`, dk `[K, nkv, d]`, dv `[K, nkv, d]`).
/// Rows that see nothing get zero dq and contribute nothing.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Real>(
    plan: &KeyRanges,
    shape: AttnShape,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &[T],
    lse: &[T],
    dout: &[T],
    scale: f64,
) -> Result<(Vec<T>, Vec<T>, Vec<T>)> {
    let AttnShape { num_heads: nh, num_kv_heads: nkv, head_dim: d } = shape;
    let (nq, nk) = (plan.num_queries, plan.num_keys);
    check(
        shape,
        &[
            ("q", q.len(), &[nq, nh, d]),
            ("k", k.len(), &[nk, nkv, d]),
            ("v", v.len(), &[nk, nkv, d]),
            ("out", out.len(), &[nq, nh, d]),
            ("lse", lse.len(), &[nh, nq]),
            ("dout", dout.len(), &[nq, nh, d]),
        ],
    )?;
    let scale = T::from_f64(scale);
    let mut dsum = vec![T::ZERO; nh * nq];
    for qi in 0..nq {
        for h in 0..nh {
            let row = (qi * nh + h) * d;
            dsum[h * nq + qi] = dot(&dout[row..][..d], &out[row..][..d]);
        }
    }
    // `p` and `ds` of row (qi, h) and key `key` under KV head `kh`.
    let p_ds = |qi: usize, h: usize, kh: usize, key: usize| {
        let (row, kv_row) = ((qi * nh + h) * d, (key * nkv + kh) * d);
        let p = (scale * dot(&q[row..][..d], &k[kv_row..][..d]) - lse[h * nq + qi]).exp();
        let dp = dot(&dout[row..][..d], &v[kv_row..][..d]);
        (p, p * (dp - dsum[h * nq + qi]))
    };

    let (mut dk, mut dv) = (vec![T::ZERO; nk * nkv * d], vec![T::ZERO; nk * nkv * d]);
    for (t, &(g_first, g_end)) in plan.kv_tile_group_ranges(TILE_K).iter().enumerate() {
        let (k0, k1) = tile_keys(plan, t, TILE_K);
        for kh in 0..nkv {
            for g in g_first as usize..g_end as usize {
                let Some(kind) = tile_kind(plan, g, t, TILE_K) else { continue };
                for (qi, h) in group_rows(plan, shape, g, kh) {
                    let row = (qi * nh + h) * d;
                    for key in row_keys(kind, plan.row_intervals(qi), k0, k1) {
                        let (p, ds) = p_ds(qi, h, kh, key);
                        let kv_row = (key * nkv + kh) * d;
                        axpy(&mut dv[kv_row..][..d], p, &dout[row..][..d]);
                        axpy(&mut dk[kv_row..][..d], scale * ds, &q[row..][..d]);
                    }
                }
            }
        }
    }

    let mut dq = vec![T::ZERO; nq * nh * d];
    for g in 0..plan.groups.len() {
        for kh in 0..nkv {
            for (t, kind) in group_tiles(plan, g, TILE_K) {
                let (k0, k1) = tile_keys(plan, t, TILE_K);
                for (qi, h) in group_rows(plan, shape, g, kh) {
                    let dq_row = &mut dq[(qi * nh + h) * d..][..d];
                    for key in row_keys(kind, plan.row_intervals(qi), k0, k1) {
                        let (_, ds) = p_ds(qi, h, kh, key);
                        axpy(dq_row, scale * ds, &k[(key * nkv + kh) * d..][..d]);
                    }
                }
            }
        }
    }
    Ok((dq, dk, dv))
}
