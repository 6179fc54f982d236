//! Insta snapshots of small results that are read by eye: training-mask layouts as ASCII grids
//! (spec section 2) and decayed-CE losses on fixed seeds (spec section 3). In CI (`CI=true`) a
//! mismatch fails; locally `INSTA_UPDATE=always` rewrites the `.snap` files for review.

use candle_core::DType;
use dflash_conformance::setups::random_draft_case;
use dflash_reference::anchors::sample_anchors;
use dflash_reference::builtin::{random_prompt, tiny_draft_config, tiny_target};
use dflash_reference::config::AttnKind;
use dflash_reference::data::TrainRow;
use dflash_reference::drafter::{DraftInput, Drafter};
use dflash_reference::loss::{decayed_ce, default_gamma, BlockTargets};
use dflash_reference::mask::BlockLayout;
use dflash_reference::target::Target;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The mask of `layout` for `kind` as a grid: one row per query (`j` block, `o` offset, `p`
/// position, `x` when the block has keep = false), one char per key ('#' allowed, '.' not),
/// `|` between the context keys and the block keys, a space between blocks.
fn render(layout: &BlockLayout, kind: AttnKind) -> String {
    let (s, b) = (layout.context_len, layout.block_size);
    let n = layout.anchors.len();
    let label_width = 14;
    let mut out = String::from("rows: block j, offset o, token index p = a_j + o, x = keep false; '#' = may attend\n");
    let ctx_header: String = (0..s).map(|k| char::from(b'0' + (k % 10) as u8)).collect();
    let block_header: Vec<String> =
        (0..n).map(|_| (0..b).map(|o| char::from(b'0' + (o % 10) as u8)).collect()).collect();
    out += &format!(
        "{:label_width$}{ctx_header} | {}   (context key k | block key offsets o')\n",
        "",
        block_header.join(" ")
    );
    if let Some(docs) = &layout.doc_ids {
        let doc_row: String =
            docs.iter().map(|&d| if d < 0 { '-' } else { char::from(b'0' + (d % 10) as u8) }).collect();
        out += &format!("{:label_width$}{doc_row}   (document of each context key, - = padding)\n", "");
    }
    for q in 0..layout.num_queries() {
        let (j, o) = (q / b, q % b);
        let label = format!("j{j} o{o} p{}{}", layout.anchors[j] + o, if layout.keep[j] { "" } else { " x" });
        let cell = |k: usize| if layout.allow(kind, q, k) { '#' } else { '.' };
        let ctx: String = (0..s).map(cell).collect();
        let blocks: Vec<String> = (0..n).map(|j2| (0..b).map(|o2| cell(s + j2 * b + o2)).collect()).collect();
        out += &format!("{label:label_width$}{ctx} | {}\n", blocks.join(" "));
    }
    out
}

/// Proves the full-attention mask with 3 anchors (the middle one keep = false) by eye: each kept
/// block sees the context strictly before its anchor and its whole own block, nothing else; the
/// dropped block sees nothing.
#[test]
fn mask_full_with_dropped_block() {
    let layout = BlockLayout::new(8, 3, vec![1, 3, 5], vec![true, false, true], None).unwrap();
    insta::assert_snapshot!("mask_full_dropped", render(&layout, AttnKind::Full));
}

/// Proves the sliding-window mask (W = 3) by eye: offset o of anchor a sees context keys in
/// `[a + o - 2, a)` and the block keys o' <= o of its own block.
#[test]
fn mask_sliding_window_3() {
    let layout = BlockLayout::new(9, 4, vec![2, 6], vec![true, true], None).unwrap();
    insta::assert_snapshot!("mask_sliding_w3", render(&layout, AttnKind::Sliding { window: 3 }));
}

/// Proves the packed-row mask by eye (full attention): 2 documents and a padded tail; context
/// keys are visible only in the anchor's own document, strictly before it; an anchor on padding
/// sees no context at all, only its own block.
#[test]
fn mask_packed_two_documents() {
    let docs = vec![0, 0, 0, 0, 1, 1, 1, 1, -1, -1];
    let layout = BlockLayout::new(10, 3, vec![2, 4, 6, 8], vec![true; 4], Some(docs)).unwrap();
    insta::assert_snapshot!("mask_packed", render(&layout, AttnKind::Full));
}

/// `x` with 6 significant digits, so last-bit differences across CPUs do not change it.
fn sig6(x: f64) -> String {
    format!("{x:.5e}")
}

/// Proves that the decayed-CE loss and its weight sum of fixed random cases (f64) do not
/// drift: any change to the drafter forward, the mask, the labels or the decay weights shows
/// up as a changed snapshot.
#[test]
fn decayed_ce_losses() {
    let mut lines = Vec::new();
    for seed in 1..=4u64 {
        let case = random_draft_case(seed, DType::F64).unwrap();
        let b = case.drafter.config.block_size;
        let input = DraftInput::training(&case.row, &case.anchors, b).unwrap();
        let logits = case.drafter.forward(&case.head, &input).unwrap();
        let targets = BlockTargets::new(&case.row.tokens, &case.row.loss_mask, &case.anchors, b, case.gamma);
        let loss = decayed_ce(&logits, &targets).unwrap().to_scalar::<f64>().unwrap();
        lines.push(format!(
            "random_draft_case({seed}): S={} B={b} anchors={:?} keep={:?} gamma={} loss={} sum_w={}",
            case.row.len(),
            case.anchors.positions,
            case.anchors.keep,
            sig6(case.gamma),
            sig6(loss),
            sig6(targets.total_weight()),
        ));
    }

    // Drafter::init for the built-in tiny target, on target features of a random sequence.
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let target = tiny_target(3, DType::F64).unwrap();
    let target_config = target.config.clone();
    let config = tiny_draft_config(&target_config);
    let b = config.block_size;
    let tokens = random_prompt(24, target_config.dims.vocab_size, config.mask_token_id, &mut rng);
    let features = target.features(&tokens, &config.target_layer_ids).unwrap();
    let loss_mask: Vec<bool> = (0..tokens.len()).map(|i| i >= 4).collect();
    let row = TrainRow::single(tokens, loss_mask, features).unwrap();
    let anchors = sample_anchors(&row.loss_mask, 6, &mut rng);
    let drafter = Drafter::init(config, 9, DType::F64).unwrap();
    let logits = drafter.forward(&target.frozen_head(), &DraftInput::training(&row, &anchors, b).unwrap()).unwrap();
    let gamma = default_gamma(b);
    let targets = BlockTargets::new(&row.tokens, &row.loss_mask, &anchors, b, gamma);
    let loss = decayed_ce(&logits, &targets).unwrap().to_scalar::<f64>().unwrap();
    lines.push(format!(
        "Drafter::init tiny: S={} B={b} anchors={:?} gamma={} loss={} sum_w={}",
        row.len(),
        anchors.positions,
        sig6(gamma),
        sig6(loss),
        sig6(targets.total_weight()),
    ));
    insta::assert_snapshot!("decayed_ce_losses", lines.join("\n"));
}
