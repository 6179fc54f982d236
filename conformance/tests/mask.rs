//! Properties of the training mask (spec section 2) and the target's causal mask, each stated
//! in its own terms (sets of visible keys, distances, documents, relations between layer kinds)
//! rather than by re-evaluating the predicate's formula, plus one hand-worked layout.

use dflash_reference::config::AttnKind;
use dflash_reference::mask::{causal_allow, causal_dense, BlockLayout};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const CASES: u32 = 512;

/// A random layout plus a sliding window to test it with.
#[derive(Debug)]
struct Case {
    layout: BlockLayout,
    window: usize,
}

/// Random S, B, N, sorted anchors (repeats allowed, as padding repeats the last anchor), keep
/// flags, and either one document (anchors may sit at S, the inference block) or packed
/// documents of random lengths with an optional padded (-1) tail.
fn random_case(seed: u64) -> Case {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let s = rng.random_range(1..=20);
    let b = rng.random_range(1..=5);
    let n = rng.random_range(1..=5);
    let packed = rng.random_bool(0.6);
    let doc_ids = packed.then(|| {
        let pad = if rng.random_bool(0.5) { rng.random_range(0..=s / 3) } else { 0 };
        let mut doc = 0;
        (0..s)
            .map(|i| {
                if i >= s - pad {
                    -1
                } else {
                    if i > 0 && rng.random_bool(0.25) {
                        doc += 1;
                    }
                    doc
                }
            })
            .collect::<Vec<i64>>()
    });
    let max_anchor = if packed { s - 1 } else { s };
    let mut anchors: Vec<usize> = (0..n).map(|_| rng.random_range(0..=max_anchor)).collect();
    anchors.sort_unstable();
    let keep = (0..n).map(|_| rng.random_bool(0.75)).collect();
    let window = rng.random_range(1..=s + b + 2);
    let layout = BlockLayout::new(s, b, anchors, keep, doc_ids).expect("valid layout");
    Case { layout, window }
}

/// The attention kinds to check a layout with: full and the case's sliding window.
fn kinds(case: &Case) -> [AttnKind; 2] {
    [AttnKind::Full, AttnKind::Sliding { window: case.window }]
}

/// Context keys (`k < S`) that query `q` sees.
fn seen_context(l: &BlockLayout, kind: AttnKind, q: usize) -> Vec<usize> {
    (0..l.context_len).filter(|&k| l.allow(kind, q, k)).collect()
}

/// Block keys (`k >= S`) that query `q` sees, as (block, offset).
fn seen_block_keys(l: &BlockLayout, kind: AttnKind, q: usize) -> Vec<(usize, usize)> {
    let (s, b) = (l.context_len, l.block_size);
    (s..l.num_keys()).filter(|&k| l.allow(kind, q, k)).map(|k| ((k - s) / b, (k - s) % b)).collect()
}

/// The context keys of the anchor's own document that precede it: walking left from `a - 1`
/// while the document id stays `doc[a]` (all of `0..a` for a single document; nothing when the
/// anchor is padding).
fn own_document_prefix(l: &BlockLayout, a: usize) -> Vec<usize> {
    match &l.doc_ids {
        None => (0..a.min(l.context_len)).collect(),
        Some(doc) if doc[a] == -1 => vec![],
        Some(doc) => {
            let mut start = a;
            while start > 0 && doc[start - 1] == doc[a] {
                start -= 1;
            }
            (start..a).collect()
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    /// Proves the strict prefix: no query of block j ever sees a context key at or after its
    /// anchor, in particular never the anchor's own feature (the `<=` bug of spec 2), in full and
    /// sliding layers.
    #[test]
    fn context_is_a_strict_prefix_of_the_anchor(seed in any::<u64>()) {
        let c = random_case(seed);
        let l = &c.layout;
        for kind in kinds(&c) {
            for q in 0..l.num_queries() {
                let a = l.anchors[q / l.block_size];
                for k in seen_context(l, kind, q) {
                    prop_assert!(k < a, "{kind:?}: q {q} (anchor {a}) sees context key {k} in {c:?}");
                }
                if a < l.context_len {
                    prop_assert!(!l.allow(kind, q, a), "{kind:?}: q {q} sees its anchor's feature");
                }
            }
        }
    }

    /// Proves that blocks never see each other: every block key a query sees belongs to its
    /// own block.
    #[test]
    fn blocks_never_see_other_blocks(seed in any::<u64>()) {
        let c = random_case(seed);
        let l = &c.layout;
        for kind in kinds(&c) {
            for q in 0..l.num_queries() {
                for (j2, o2) in seen_block_keys(l, kind, q) {
                    prop_assert_eq!(j2, q / l.block_size, "{:?}: q {} sees offset {} of block {}", kind, q, o2, j2);
                }
            }
        }
    }

    /// Proves the in-block pattern of kept blocks: in full layers a query sees all B tokens of
    /// its block (bidirectional), in sliding layers exactly offsets 0..=o (the anchor token up
    /// to and including itself), whatever the window.
    #[test]
    fn own_block_is_bidirectional_in_full_and_causal_in_sliding(seed in any::<u64>()) {
        let c = random_case(seed);
        let l = &c.layout;
        let b = l.block_size;
        for q in 0..l.num_queries() {
            let (j, o) = (q / b, q % b);
            if !l.keep[j] {
                continue;
            }
            let full: Vec<usize> = seen_block_keys(l, AttnKind::Full, q).into_iter().map(|(_, o2)| o2).collect();
            prop_assert_eq!(full, (0..b).collect::<Vec<_>>(), "full: q {}", q);
            for window in [1, c.window, l.num_keys() + 7] {
                let sliding: Vec<usize> = seen_block_keys(l, AttnKind::Sliding { window }, q)
                    .into_iter()
                    .map(|(_, o2)| o2)
                    .collect();
                prop_assert_eq!(sliding, (0..=o).collect::<Vec<_>>(), "sliding {}: q {}", window, q);
            }
        }
    }

    /// Proves the full-layer context of a kept block is exactly its anchor's own document before
    /// the anchor (all of `0..a_j` for one document), and the sliding-layer context is exactly
    /// the part of it within distance `W-1` of the query's position `a_j+o` (the window holds W
    /// positions ending at the query itself): the keys `a_j+o-(W-1) <= k < a_j` of the document.
    /// Also checks the count: `min(max(W-1-o, 0), |prefix|)`, a contiguous range ending at `a_j-1`.
    #[test]
    fn context_is_the_document_prefix_cut_by_the_window(seed in any::<u64>()) {
        let c = random_case(seed);
        let l = &c.layout;
        let w = c.window;
        let b = l.block_size;
        for q in 0..l.num_queries() {
            let (j, o) = (q / b, q % b);
            if !l.keep[j] {
                continue;
            }
            let a = l.anchors[j];
            let prefix = own_document_prefix(l, a);
            prop_assert_eq!(&seen_context(l, AttnKind::Full, q), &prefix, "full: q {} of {:?}", q, c);
            let sliding = seen_context(l, AttnKind::Sliding { window: w }, q);
            let within: Vec<usize> = prefix.iter().copied().filter(|&k| a + o - k < w).collect();
            prop_assert_eq!(&sliding, &within, "sliding {}: q {} of {:?}", w, q, c);
            let expected_len = (w.saturating_sub(1 + o)).min(prefix.len());
            prop_assert_eq!(sliding.len(), expected_len);
            if let Some(&last) = sliding.last() {
                prop_assert_eq!(last, a - 1);
                prop_assert_eq!(sliding[0] + sliding.len(), a, "not contiguous");
            }
        }
    }

    /// Proves document isolation in packed rows: no query ever sees a context key of another
    /// document or of padding, and a block anchored in padding sees no context at all.
    #[test]
    fn documents_are_isolated(seed in any::<u64>()) {
        let c = random_case(seed);
        let l = &c.layout;
        let Some(doc) = &l.doc_ids else { return Ok(()) };
        for kind in kinds(&c) {
            for q in 0..l.num_queries() {
                let a = l.anchors[q / l.block_size];
                let seen = seen_context(l, kind, q);
                if doc[a] == -1 {
                    prop_assert!(seen.is_empty(), "{kind:?}: q {q} anchored in padding sees {seen:?}");
                }
                for k in seen {
                    prop_assert!(doc[k] != -1, "{kind:?}: q {q} sees padding key {k}");
                    prop_assert_eq!(doc[k], doc[a], "{:?}: q {} sees key {} of another document", kind, q, k);
                }
            }
        }
    }

    /// Proves that padding blocks (`keep = false`) see nothing at all, in every layer kind.
    #[test]
    fn dropped_blocks_see_nothing(seed in any::<u64>()) {
        let c = random_case(seed);
        let l = &c.layout;
        for kind in kinds(&c).into_iter().chain([AttnKind::Sliding { window: 1 }]) {
            for q in 0..l.num_queries() {
                if !l.keep[q / l.block_size] {
                    prop_assert!((0..l.num_keys()).all(|k| !l.allow(kind, q, k)), "{kind:?}: q {q}");
                }
            }
        }
    }

    /// Proves that a window of at least S+B positions cuts nothing: sliding layers then see the
    /// same context keys as full layers, for every query.
    #[test]
    fn wide_window_equals_full_on_context(seed in any::<u64>(), extra in 0usize..10) {
        let c = random_case(seed);
        let l = &c.layout;
        let window = l.context_len + l.block_size + extra;
        for q in 0..l.num_queries() {
            prop_assert_eq!(
                seen_context(l, AttnKind::Sliding { window }, q),
                seen_context(l, AttnKind::Full, q),
                "q {}", q
            );
        }
    }

    /// Proves the dense builder is the predicate: `[N*B, S+N*B]` row-major, equal to `allow`
    /// at every (q, k), for both kinds.
    #[test]
    fn dense_mask_equals_the_predicate(seed in any::<u64>()) {
        let c = random_case(seed);
        let l = &c.layout;
        let (nq, nk) = (l.num_queries(), l.num_keys());
        prop_assert_eq!(nq, l.anchors.len() * l.block_size);
        prop_assert_eq!(nk, l.context_len + nq);
        for kind in kinds(&c) {
            let dense = l.dense(kind);
            prop_assert_eq!(dense.len(), nq * nk);
            for q in 0..nq {
                for k in 0..nk {
                    prop_assert_eq!(dense[q * nk + k], l.allow(kind, q, k), "{:?} at ({}, {})", kind, q, k);
                }
            }
        }
    }

    /// Proves the target's causal mask: full layers see exactly keys `0..=q`; sliding layers
    /// exactly the last `min(W, q+1)` of them (`q-k < W`, the query itself included); a window
    /// of at least T equals full; the dense builder is the predicate row-major.
    #[test]
    fn causal_mask_is_causal_and_windowed(t in 1usize..24, window in 1usize..28) {
        let sliding = AttnKind::Sliding { window };
        let full_dense = causal_dense(AttnKind::Full, t);
        let sliding_dense = causal_dense(sliding, t);
        prop_assert_eq!(full_dense.len(), t * t);
        prop_assert_eq!(sliding_dense.len(), t * t);
        for q in 0..t {
            let full: Vec<usize> = (0..t).filter(|&k| causal_allow(AttnKind::Full, q, k)).collect();
            prop_assert_eq!(full, (0..=q).collect::<Vec<_>>());
            let seen: Vec<usize> = (0..t).filter(|&k| causal_allow(sliding, q, k)).collect();
            let first = (q + 1).saturating_sub(window);
            prop_assert_eq!(&seen, &(first..=q).collect::<Vec<_>>(), "window {}: q {}", window, q);
            prop_assert_eq!(seen.len(), window.min(q + 1));
            for k in 0..t {
                prop_assert_eq!(full_dense[q * t + k], causal_allow(AttnKind::Full, q, k));
                prop_assert_eq!(sliding_dense[q * t + k], causal_allow(sliding, q, k));
                if window >= t {
                    prop_assert_eq!(causal_allow(sliding, q, k), causal_allow(AttnKind::Full, q, k));
                }
            }
        }
    }
}

/// Proves the predicate on a layout worked by hand. S = 6 tokens in documents
/// `[0, 0, 0, 1, 1, -1]` (the last is padding), B = 2, anchors `[2, 4, 4]` with
/// keep `[true, true, false]`. Keys 0..6 are the context, 6..8 block 0, 8..10 block 1,
/// 10..12 block 2. Queries q = 2j + o:
/// - full: q0, q1 (anchor 2, doc 0) see context {0, 1} (strict prefix, doc 0) and keys {6, 7};
///   q2, q3 (anchor 4, doc 1) see context {3} (key 2 is doc 0) and keys {8, 9};
///   q4, q5 (keep = false) see nothing.
/// - sliding W = 2 (positions a+o-1 <= k < a): q0 (2+0-1 = 1) sees {1} and key 6 (o' <= 0);
///   q1 (2+1-1 = 2 = a) sees no context and keys {6, 7}; q2 (4+0-1 = 3) sees {3} and key 8;
///   q3 sees no context and keys {8, 9}; q4, q5 see nothing.
#[test]
fn hand_worked_layout() {
    let layout =
        BlockLayout::new(6, 2, vec![2, 4, 4], vec![true, true, false], Some(vec![0, 0, 0, 1, 1, -1])).expect("layout");
    let rows = |pairs: &[&[usize]]| -> Vec<bool> {
        pairs.iter().flat_map(|keys| (0..12).map(move |k| keys.contains(&k))).collect()
    };
    let full = rows(&[&[0, 1, 6, 7], &[0, 1, 6, 7], &[3, 8, 9], &[3, 8, 9], &[], &[]]);
    let sliding = rows(&[&[1, 6], &[6, 7], &[3, 8], &[8, 9], &[], &[]]);
    assert_eq!(layout.num_queries(), 6);
    assert_eq!(layout.num_keys(), 12);
    assert_eq!(layout.dense(AttnKind::Full), full);
    assert_eq!(layout.dense(AttnKind::Sliding { window: 2 }), sliding);
}
