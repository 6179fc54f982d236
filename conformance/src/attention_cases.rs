//! Attention test and benchmark cases shared by the GPU conformance run (`cargo xtask
//! gpu-conformance`), the attention benchmark (`cargo xtask bench attention`) and the CPU tests:
//! a case is a layout (DFlash blocks over a context, or a causal sequence), an attention kind and
//! head shapes, from which the [`KeyRanges`] and the random inputs follow deterministically.
//!
//! Tensors of a case, row-major as the kernels and the CPU twin take them: `q`, `dO`, `out`, `dq`
//! `[Q, num_heads, head_dim]`, `k`, `v`, `dk`, `dv` `[K, num_kv_heads, head_dim]` (bf16 on the GPU),
//! logsumexp `[num_heads, Q]` (f32), with `Q` = [`KeyRanges::num_queries`] and `K` =
//! [`KeyRanges::num_keys`].

use dflash_optimized::{Error, Result};
use dflash_reference::config::AttnKind;
use dflash_reference::mask::BlockLayout;
use rand::seq::index::sample;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use dflash_optimized::ops::attention::ranges::KeyRanges;

/// Relative error `‖x − ref‖ / ‖ref‖` below which a bf16 CUDA tensor passes conformance (per
/// tensor: out, dQ, dK, dV); NaN never passes.
pub const BF16_TOLERANCE: f64 = 1e-2;

/// `||got - want|| / ||want||` (`||got||` when `want` is zero); infinity when either holds NaN
/// or Inf, so that NaN never passes.
pub fn rel_error(got: &[f64], want: &[f64]) -> f64 {
    if got.len() != want.len() || got.iter().chain(want).any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let norm = |x: &mut dyn Iterator<Item = f64>| x.map(|e| e * e).sum::<f64>().sqrt();
    let diff = norm(&mut got.iter().zip(want).map(|(a, b)| a - b));
    let reference = norm(&mut want.iter().copied());
    if reference == 0.0 {
        norm(&mut got.iter().copied())
    } else {
        diff / reference
    }
}

/// Where the query rows and keys of a case come from.
#[derive(Clone, Debug, PartialEq)]
pub enum CaseLayout {
    /// DFlash training attention (spec section 2): `n_anchors` blocks of `block` rows over a
    /// context of `s` keys; queries `n_anchors * block`, keys `s + n_anchors * block`.
    DFlash {
        /// `S`, context keys.
        s: usize,
        /// `B`, rows per block.
        block: usize,
        /// `N`, blocks (anchors).
        n_anchors: usize,
        /// Lengths of the packed documents in order; empty: the whole row is one document (no
        /// document ids). When not empty, `docs` and `padding` add up to `s`.
        docs: Vec<usize>,
        /// Padding tokens (document id `-1`) after the documents; only with `docs`.
        padding: usize,
        /// Whether block `n_anchors / 2` is a padding block (`keep = false`, sees nothing).
        drop_block: bool,
        /// Seed of the anchors: `n_anchors` distinct positions in `1..s`, sorted, none on padding.
        seed: u64,
    },
    /// Causal attention over `t` positions (the target, inference), planned in groups of
    /// `group_rows` rows.
    Causal { t: usize, group_rows: usize },
}

/// One attention case: layout, kind and head shapes.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnCase {
    /// Short unique name (in reports and the attestation).
    pub name: String,
    pub kind: AttnKind,
    pub layout: CaseLayout,
    /// Query heads; a multiple of `num_kv_heads` (GQA groups of `num_heads / num_kv_heads`).
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Seed of the random inputs `q`, `k`, `v` and the output gradient `dO`.
    pub seed: u64,
}

/// Relative errors of one CUDA run against the reference, per tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CaseErrors {
    pub out: f64,
    pub dq: f64,
    pub dk: f64,
    pub dv: f64,
}

impl CaseErrors {
    /// Whether every tensor is below [`BF16_TOLERANCE`] (false when any error is NaN).
    pub fn pass(&self) -> bool {
        [self.out, self.dq, self.dk, self.dv].iter().all(|&e| e < BF16_TOLERANCE)
    }
}

impl AttnCase {
    /// A DFlash case of blocks of 16 rows, one document, no padding block; anchor seed 0, input
    /// seed 1.
    pub fn dflash(name: &str, kind: AttnKind, s: usize, n_anchors: usize, heads: (usize, usize), d: usize) -> Self {
        AttnCase {
            name: name.to_string(),
            kind,
            layout: CaseLayout::DFlash {
                s,
                block: 16,
                n_anchors,
                docs: Vec::new(),
                padding: 0,
                drop_block: false,
                seed: 0,
            },
            num_heads: heads.0,
            num_kv_heads: heads.1,
            head_dim: d,
            seed: 1,
        }
    }

    /// A causal case over `t` positions in groups of 32 rows (32 rows times a GQA group of up to
    /// 4 query heads fill one 128-row CTA of the kernels); input seed 1.
    pub fn causal(name: &str, kind: AttnKind, t: usize, heads: (usize, usize), d: usize) -> Self {
        AttnCase {
            name: name.to_string(),
            kind,
            layout: CaseLayout::Causal { t, group_rows: 32 },
            num_heads: heads.0,
            num_kv_heads: heads.1,
            head_dim: d,
            seed: 1,
        }
    }

    /// The DFlash block layout (anchors drawn from the layout's seed), or `None` for a causal case.
    pub fn block_layout(&self) -> Result<Option<BlockLayout>> {
        match self.layout {
            CaseLayout::Causal { .. } => Ok(None),
            CaseLayout::DFlash { .. } => self.draw_block_layout().map(Some),
        }
    }

    /// The attention plan of the case.
    pub fn ranges(&self) -> Result<KeyRanges> {
        if self.num_heads == 0 || self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(Error::invalid(
                format!("case `{}`: heads", self.name),
                format!("{} query heads are not a multiple of {} KV heads", self.num_heads, self.num_kv_heads),
            ));
        }
        if self.head_dim == 0 {
            return Err(Error::invalid(format!("case `{}`: head_dim", self.name), "must be at least 1"));
        }
        match self.layout {
            CaseLayout::Causal { t, group_rows } => KeyRanges::causal(t, self.kind, group_rows),
            CaseLayout::DFlash { .. } => KeyRanges::dflash(&self.draw_block_layout()?, self.kind),
        }
    }

    fn draw_block_layout(&self) -> Result<BlockLayout> {
        let what = |field: &str| format!("case `{}`: {field}", self.name);
        let CaseLayout::DFlash { s, block, n_anchors, ref docs, padding, drop_block, seed } = self.layout else {
            return Err(Error::invalid(what("layout"), "a causal case has no DFlash blocks"));
        };
        let doc_ids = if docs.is_empty() {
            if padding != 0 {
                return Err(Error::invalid(what("padding"), "padding needs explicit `docs` lengths"));
            }
            None
        } else {
            let total = docs.iter().sum::<usize>() + padding;
            if total != s || docs.contains(&0) {
                return Err(Error::invalid(
                    what("docs"),
                    format!(
                        "document lengths {docs:?} (none may be 0) plus {padding} padding make {total}, not S = {s}"
                    ),
                ));
            }
            let ids = docs.iter().enumerate().flat_map(|(i, &len)| std::iter::repeat_n(i as i64, len));
            Some(ids.chain(std::iter::repeat_n(-1, padding)).collect::<Vec<i64>>())
        };
        let candidates: Vec<usize> = (1..s).filter(|&a| doc_ids.as_ref().is_none_or(|ids| ids[a] != -1)).collect();
        if n_anchors == 0 || n_anchors > candidates.len() {
            return Err(Error::invalid(
                what("n_anchors"),
                format!("{n_anchors} anchors: need 1 to {} (distinct positions in 1..S off padding)", candidates.len()),
            ));
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut anchors: Vec<usize> =
            sample(&mut rng, candidates.len(), n_anchors).into_iter().map(|i| candidates[i]).collect();
        anchors.sort_unstable();
        let mut keep = vec![true; n_anchors];
        if drop_block {
            keep[n_anchors / 2] = false;
        }
        Ok(BlockLayout::new(s, block, anchors, keep, doc_ids)?)
    }
}

/// The cases of the GPU conformance run: odd sizes, N = 1, a padding block, S not a multiple of
/// 64, a window larger than S, several documents (with padding), a real sliding window, GQA 32/8
/// with d = 128, and causal full and sliding attention.
pub fn conformance_cases() -> Vec<AttnCase> {
    use AttnKind::{Full, Sliding};
    let with_docs = |mut case: AttnCase, docs: Vec<usize>, pad: usize, drop: bool| {
        if let CaseLayout::DFlash { docs: d, padding, drop_block, .. } = &mut case.layout {
            (*d, *padding, *drop_block) = (docs, pad, drop);
        }
        case
    };
    let causal_groups = |mut case: AttnCase, rows: usize| {
        if let CaseLayout::Causal { group_rows, .. } = &mut case.layout {
            *group_rows = rows;
        }
        case
    };
    let mut odd = AttnCase::dflash("odd-sizes", Full, 301, 7, (6, 2), 64);
    odd.seed = 7;
    vec![
        odd,
        AttnCase::dflash("single-anchor", Full, 200, 1, (4, 1), 128),
        with_docs(AttnCase::dflash("padding-block", Full, 500, 12, (8, 2), 128), Vec::new(), 0, true),
        AttnCase::dflash("s-not-multiple-of-64", Full, 1000, 20, (8, 2), 128),
        AttnCase::dflash("window-larger-than-s", Sliding { window: 4096 }, 700, 16, (8, 2), 128),
        AttnCase::dflash("sliding-window", Sliding { window: 128 }, 1000, 24, (8, 2), 128),
        with_docs(AttnCase::dflash("documents", Full, 1024, 32, (8, 2), 128), vec![300, 17, 450, 200], 57, true),
        with_docs(
            AttnCase::dflash("documents-sliding", Sliding { window: 100 }, 1024, 32, (8, 2), 128),
            vec![300, 17, 450, 200],
            57,
            false,
        ),
        AttnCase::dflash("gqa-32-8-d128", Full, 2048, 64, (32, 8), 128),
        AttnCase::causal("causal-full", Full, 1000, (8, 2), 128),
        AttnCase::causal("causal-sliding", Sliding { window: 256 }, 1500, (8, 2), 128),
        // 24 rows x 4 heads: 96-row groups over two warpgroups, row splits by a non-power of two.
        causal_groups(AttnCase::causal("causal-96-row-groups", Full, 700, (8, 2), 64), 24),
    ]
}

/// The four cases of the anchor table in GPU.md (the project's H200 notes): bf16, 32 query heads, 8 KV heads,
/// d = 128, B = 16, random sorted anchors.
pub fn bench_cases() -> Vec<AttnCase> {
    use AttnKind::{Full, Sliding};
    vec![
        AttnCase::dflash("S=8192 N=128", Full, 8192, 128, (32, 8), 128),
        AttnCase::dflash("S=3072 N=512", Full, 3072, 512, (32, 8), 128),
        AttnCase::dflash("S=8000 N=512", Full, 8000, 512, (32, 8), 128),
        AttnCase::dflash("sliding W=2048 S=8192 N=128", Sliding { window: 2048 }, 8192, 128, (32, 8), 128),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_case_builds_its_plan() {
        for case in conformance_cases().iter().chain(&bench_cases()) {
            let plan = case.ranges().unwrap_or_else(|e| panic!("{}: {e}", case.name));
            assert!(plan.allowed_pairs() > 0, "{}", case.name);
        }
    }

    #[test]
    fn anchors_are_sorted_distinct_in_range_and_off_padding() {
        for case in conformance_cases() {
            let Some(layout) = case.block_layout().unwrap() else { continue };
            assert!(layout.anchors.windows(2).all(|w| w[0] < w[1]), "{}", case.name);
            for &a in &layout.anchors {
                assert!(a >= 1 && a < layout.context_len, "{}: anchor {a}", case.name);
                assert!(layout.doc_ids.as_ref().is_none_or(|ids| ids[a] != -1), "{}: anchor {a} on padding", case.name);
            }
        }
    }

    #[test]
    fn cases_cover_the_required_shapes() {
        let cases = conformance_cases();
        let layouts: Vec<_> = cases.iter().map(|c| (c, c.block_layout().unwrap())).collect();
        let dflash = || layouts.iter().filter_map(|(c, l)| l.as_ref().map(|l| (*c, l)));
        assert!(dflash().any(|(_, l)| l.anchors.len() == 1), "N = 1");
        assert!(dflash().any(|(_, l)| l.keep.contains(&false)), "a padding block");
        assert!(dflash().any(|(_, l)| l.context_len % 64 != 0), "S not a multiple of 64");
        assert!(dflash().any(|(c, l)| matches!(c.kind, AttnKind::Sliding { window } if window > l.context_len)));
        assert!(dflash().any(|(_, l)| l.doc_ids.as_ref().is_some_and(|ids| ids.iter().max() > Some(&1))), "documents");
        assert!(cases.iter().any(|c| (c.num_heads, c.num_kv_heads, c.head_dim) == (32, 8, 128)), "GQA 32/8 d128");
        for kind in [AttnKind::Full, AttnKind::Sliding { window: 256 }] {
            assert!(cases.iter().any(|c| c.kind == kind && matches!(c.layout, CaseLayout::Causal { .. })), "{kind:?}");
        }
        let mut names: Vec<_> = cases.iter().map(|c| &c.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), cases.len(), "case names are unique");
    }

    #[test]
    fn bad_cases_are_errors_naming_the_case() {
        let mut case = AttnCase::dflash("bad", AttnKind::Full, 10, 20, (4, 2), 64);
        assert!(case.ranges().unwrap_err().to_string().contains("case `bad`"));
        case.layout = CaseLayout::DFlash {
            s: 10,
            block: 4,
            n_anchors: 2,
            docs: vec![3, 3],
            padding: 1,
            drop_block: false,
            seed: 0,
        };
        assert!(case.ranges().unwrap_err().to_string().contains("docs"));
        case.num_kv_heads = 3;
        assert!(case.ranges().unwrap_err().to_string().contains("heads"));
    }
}
