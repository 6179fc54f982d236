//! Packing, epochs and per-document anchors under proptest (spec sections 2 and 6): every
//! supervised token of every kept document appears exactly once per epoch; documents never see
//! each other in attention (the reference mask predicate on the rows' layouts); positions
//! restart per document; anchors are shared among documents in proportion to their candidates.

use dflash_data::epoch::{epoch_order, held_out};
use dflash_data::mask::Document;
use dflash_data::rows::{Packing, RowBuilder};
use dflash_reference::anchors::{anchor_candidates, proportional_shares, sample_anchors, sample_anchors_per_document};
use dflash_reference::config::AttnKind;
use dflash_reference::data::Row;
use dflash_reference::loss::BlockTargets;
use dflash_reference::mask::BlockLayout;
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Documents of `1..=max_len` tokens; token ids are unique across all documents, so a token
/// identifies where it came from.
fn documents(max_len: usize) -> impl Strategy<Value = Vec<Document>> {
    prop::collection::vec(prop::collection::vec(any::<bool>(), 1..=max_len), 1..30).prop_map(|masks| {
        let mut next = 0u32;
        masks
            .into_iter()
            .map(|loss_mask| {
                let tokens = (next..next + loss_mask.len() as u32).collect();
                next += loss_mask.len() as u32;
                Document { tokens, loss_mask }
            })
            .collect()
    })
}

fn build(docs: &[Document], order: &[usize], packing: Packing) -> Vec<Row> {
    let items = order.iter().map(|&i| Ok::<_, ()>(docs[i].clone()));
    RowBuilder::new(items, packing).collect::<Result<_, _>>().expect("rows")
}

/// The documents of a row as `(doc id, start, end)`.
fn spans(row: &Row) -> Vec<(i64, usize, usize)> {
    let mut out: Vec<(i64, usize, usize)> = vec![];
    for (i, &d) in row.doc_ids.iter().enumerate() {
        match out.last_mut() {
            Some(s) if s.0 == d => s.2 = i + 1,
            _ => out.push((d, i, i + 1)),
        }
    }
    out.retain(|s| s.0 != -1);
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Packed rows are exactly `S` long, valid (ids count up, positions restart, padding last and
    /// unsupervised), and hold every document once, whole, in epoch order: so every supervised
    /// token appears exactly once per epoch.
    #[test]
    fn packing_keeps_every_supervised_token_once(
        seq_len in 4usize..48, seed in any::<u64>(), epoch in 0u64..6, docs in documents(4),
    ) {
        let docs: Vec<Document> = docs.into_iter().filter(|d| d.tokens.len() <= seq_len).collect();
        let all: Vec<usize> = (0..docs.len()).collect();
        let order = epoch_order(&all, seed, epoch);
        prop_assert_eq!(&order, &epoch_order(&all, seed, epoch), "the order is a function of (seed, epoch)");
        let rows = build(&docs, &order, Packing::Packed { seq_len, pad_id: u32::MAX });
        let mut seen = vec![];
        for row in &rows {
            row.validate().expect("valid row");
            prop_assert_eq!(row.tokens.len(), seq_len);
            for (d, start, end) in spans(row) {
                prop_assert!(row.positions[start..end].iter().enumerate().all(|(k, &p)| p == k), "positions restart in doc {}", d);
                let doc = docs.iter().position(|doc| doc.tokens[0] == row.tokens[start]).expect("a known document");
                prop_assert_eq!(&row.tokens[start..end], &docs[doc].tokens[..], "whole documents");
                prop_assert_eq!(&row.loss_mask[start..end], &docs[doc].loss_mask[..]);
                seen.push(doc);
            }
        }
        prop_assert_eq!(seen, order, "each document once, in epoch order");
    }

    /// One document per row: each row is one document, positions `0..n`.
    #[test]
    fn one_per_row_is_one_document_per_row(docs in documents(12), seed in any::<u64>()) {
        let order = epoch_order(&(0..docs.len()).collect::<Vec<_>>(), seed, 0);
        let rows = build(&docs, &order, Packing::OnePerRow);
        prop_assert_eq!(rows.len(), docs.len());
        for (row, &i) in rows.iter().zip(&order) {
            row.validate().expect("valid row");
            prop_assert_eq!(&row.tokens, &docs[i].tokens);
            prop_assert!(row.doc_ids.iter().all(|&d| d == 0));
        }
    }

    /// In every packed row, with anchors drawn per document, no query of a block ever attends
    /// to a context key of another document or of padding (the reference mask predicate, full
    /// and sliding layers), and no block row is weighted on a label of another document.
    #[test]
    fn documents_never_cross_in_attention(
        seq_len in 6usize..40, seed in any::<u64>(), n_max in 1usize..12, block in 2usize..6, docs in documents(16),
    ) {
        let docs: Vec<Document> = docs.into_iter().filter(|d| d.tokens.len() <= seq_len).collect();
        let order: Vec<usize> = (0..docs.len()).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for row in build(&docs, &order, Packing::Packed { seq_len, pad_id: 0 }) {
            let anchors = sample_anchors_per_document(&row.loss_mask, &row.doc_ids, n_max, &mut rng);
            let layout = BlockLayout::new(row.tokens.len(), block, anchors.positions.clone(), anchors.keep.clone(), Some(row.doc_ids.clone()))
                .expect("layout");
            for kind in [AttnKind::Full, AttnKind::Sliding { window: 5 }] {
                for q in 0..layout.num_queries() {
                    let a = layout.anchors[q / block];
                    for k in 0..row.tokens.len() {
                        if layout.allow(kind, q, k) {
                            prop_assert!(row.doc_ids[k] == row.doc_ids[a] && row.doc_ids[k] != -1, "query {} sees key {} of another document", q, k);
                        }
                    }
                }
            }
            let mut targets = BlockTargets::new(&row.tokens, &row.loss_mask, &anchors, block, 4.0);
            targets.restrict_to_documents(&row.doc_ids, &anchors, block);
            for (r, &w) in targets.weights.iter().enumerate() {
                let (a, o) = (anchors.positions[r / block], r % block);
                if w > 0.0 {
                    prop_assert_eq!(row.doc_ids[a + o], row.doc_ids[a], "a weighted label of another document");
                }
            }
        }
    }

    /// Each document gets the floor or the ceiling of its proportional share of the anchors
    /// (its candidates / all candidates), the shares add up to `min(n_max, candidates)`, every
    /// anchor is a candidate inside its document, and a one-document row draws exactly what the
    /// whole-row draw does.
    #[test]
    fn anchors_are_proportional_per_document(
        seq_len in 6usize..60, seed in any::<u64>(), n_max in 1usize..40, docs in documents(30),
    ) {
        let docs: Vec<Document> = docs.into_iter().filter(|d| d.tokens.len() <= seq_len).collect();
        let order: Vec<usize> = (0..docs.len()).collect();
        for row in build(&docs, &order, Packing::Packed { seq_len, pad_id: 0 }) {
            let doc_spans = spans(&row);
            let counts: Vec<usize> = doc_spans.iter().map(|&(_, s, e)| anchor_candidates(&row.loss_mask[s..e]).len()).collect();
            let total: usize = counts.iter().sum();
            let n = n_max.min(total);
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let anchors = sample_anchors_per_document(&row.loss_mask, &row.doc_ids, n_max, &mut rng);
            prop_assert_eq!(anchors.num_kept(), n);
            prop_assert_eq!(anchors.positions.len(), n_max);
            for (d, &(_, s, e)) in doc_spans.iter().enumerate() {
                let got = anchors.positions.iter().zip(&anchors.keep).filter(|&(&a, &k)| k && a >= s && a < e).count();
                let quota = n as f64 * counts[d] as f64 / total.max(1) as f64;
                prop_assert!((got as f64 - quota).abs() < 1.0, "doc {}: {} anchors for a quota of {:.2}", d, got, quota);
                prop_assert!(got <= counts[d]);
            }
            for (&a, _) in anchors.positions.iter().zip(&anchors.keep).filter(|(_, &k)| k) {
                prop_assert!(row.loss_mask[a] && row.loss_mask[a + 1] && row.doc_ids[a] == row.doc_ids[a + 1]);
            }
            if doc_spans.len() == 1 {
                let mut a = ChaCha8Rng::seed_from_u64(seed);
                let mut b = ChaCha8Rng::seed_from_u64(seed);
                prop_assert_eq!(
                    sample_anchors_per_document(&row.loss_mask, &row.doc_ids, n_max, &mut a),
                    sample_anchors(&row.loss_mask, n_max, &mut b)
                );
            }
        }
    }

    /// The largest-remainder shares: floor or ceiling of each quota, summing to `n`.
    #[test]
    fn proportional_shares_are_floor_or_ceiling(counts in prop::collection::vec(0usize..50, 1..12), pick in 0.0f64..=1.0) {
        let total: usize = counts.iter().sum();
        let n = (total as f64 * pick).floor() as usize;
        let shares = proportional_shares(&counts, n);
        prop_assert_eq!(shares.iter().sum::<usize>(), n);
        for (&s, &c) in shares.iter().zip(&counts) {
            let quota = n as f64 * c as f64 / total.max(1) as f64;
            prop_assert!(s as f64 >= quota.floor() && s as f64 <= quota.ceil() && s <= c, "share {} of quota {}", s, quota);
        }
    }

    /// The held-out split holds out `fraction` of conversations (within 5 standard deviations of
    /// the binomial count over 20,000 random contents), none at 0, and a larger fraction holds
    /// out a superset.
    #[test]
    fn held_out_is_the_fraction_of_contents(fraction in 0.0f64..0.5, seed in any::<u64>(), first in any::<u64>()) {
        let n = 20_000u64;
        let contents: Vec<u64> = (0..n).map(|i| first.wrapping_add(i.wrapping_mul(0x2545_f491_4f6c_dd1d))).collect();
        let held = contents.iter().filter(|&&c| held_out(c, fraction, seed)).count() as f64;
        let sd = (n as f64 * fraction * (1.0 - fraction)).sqrt();
        prop_assert!((held - n as f64 * fraction).abs() <= 5.0 * sd + 1.0, "{} held of {} at {}", held, n, fraction);
        for &c in contents.iter().take(200) {
            prop_assert!(!held_out(c, 0.0, seed));
            prop_assert!(!held_out(c, fraction, seed) || held_out(c, fraction + 0.1, seed));
        }
    }
}

/// Different epochs give different orders (for more than a handful of documents).
#[test]
fn epochs_reshuffle() {
    let docs: Vec<usize> = (0..50).collect();
    assert_ne!(epoch_order(&docs, 7, 0), epoch_order(&docs, 7, 1));
    assert_ne!(epoch_order(&docs, 7, 0), epoch_order(&docs, 8, 0));
}

mod pipeline {
    //! The whole pipeline on files: every supervised token of every kept document once per
    //! epoch (train and held-out together), gzip = plain, ShareGPT = OpenAI, the system-prompt
    //! option, a held-out file, and the tokenized cache reused until a key part changes.

    use std::collections::BTreeSet;
    use std::io::Write;
    use std::path::{Path, PathBuf};

    use dflash_conformance::fixtures_dir;
    use dflash_data::target::TargetTokenizer;
    use dflash_data::{DataOptions, Dataset, HeldOut};
    use dflash_reference::data::Row;
    use proptest::prelude::*;

    fn tokenizer() -> TargetTokenizer {
        TargetTokenizer::load(&fixtures_dir().join("data/tokenizer-qwen")).expect("fixture tokenizer")
    }

    fn write(path: &Path, text: &str, gzip: bool) -> PathBuf {
        let file = std::fs::File::create(path).expect("create");
        if gzip {
            let mut enc = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
            enc.write_all(text.as_bytes()).and_then(|_| enc.finish().map(|_| ())).expect("gzip");
        } else {
            std::io::BufWriter::new(file).write_all(text.as_bytes()).expect("write");
        }
        path.to_owned()
    }

    fn all_rows(data: &Dataset, epoch: u64) -> Vec<Row> {
        data.epoch(epoch).chain(data.held_out_rows()).collect::<dflash_data::Result<_>>().expect("rows")
    }

    /// Supervised tokens per document, in document order.
    fn supervised(rows: &[Row]) -> Vec<Vec<u32>> {
        let mut docs = vec![];
        for row in rows {
            let mut current: Option<i64> = None;
            for i in 0..row.tokens.len() {
                if row.doc_ids[i] != current.unwrap_or(-2) && row.doc_ids[i] >= 0 {
                    docs.push(vec![]);
                    current = Some(row.doc_ids[i]);
                }
                if row.loss_mask[i] {
                    docs.last_mut().expect("a document").push(row.tokens[i]);
                }
            }
        }
        docs.sort();
        docs
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]

        /// Pre-tokenized documents (some filtered, some truncated) through files and the cache:
        /// each epoch's rows hold the supervised tokens of every kept (truncated) document
        /// exactly once, whatever the seed, epoch and held-out fraction.
        #[test]
        fn every_supervised_token_once_per_epoch(
            docs in prop::collection::vec(prop::collection::vec((1u32..700, any::<bool>()), 1..40), 1..25),
            max_len in 4usize..32, seed in any::<u64>(), epoch in 0u64..4, held in 0.0f64..0.4, gzip in any::<bool>(),
        ) {
            let tmp = tempfile::tempdir().unwrap();
            let lines: String = docs.iter().map(|d| {
                let ids: Vec<String> = d.iter().map(|(t, _)| t.to_string()).collect();
                let mask: Vec<&str> = d.iter().map(|(_, m)| if *m { "1" } else { "0" }).collect();
                format!("{{\"input_ids\": [{}], \"loss_mask\": [{}]}}\n", ids.join(","), mask.join(","))
            }).collect();
            let file = write(&tmp.path().join("d.jsonl.gz"), &lines, gzip);
            let opts = DataOptions { max_len, seed, held_out: HeldOut::Fraction(held), ..DataOptions::new(tmp.path().join("cache")) };
            let mut want: Vec<Vec<u32>> = docs.iter().filter_map(|d| {
                let d = &d[..d.len().min(max_len)];
                d.windows(2).any(|w| w[0].1 && w[1].1).then(|| d.iter().filter(|(_, m)| *m).map(|(t, _)| *t).collect())
            }).collect();
            want.sort();
            match Dataset::prepare(&tokenizer(), &[file], &opts) {
                Ok(data) => {
                    prop_assert_eq!(data.stats().documents, want.len());
                    let rows = all_rows(&data, epoch);
                    for row in &rows {
                        row.validate().expect("valid row");
                        prop_assert_eq!(row.tokens.len(), max_len);
                    }
                    prop_assert_eq!(supervised(&rows), want);
                }
                // A few documents may all fall on the held-out side of the content split.
                Err(e) => prop_assert!(
                    want.is_empty() || (held > 0.0 && e.to_string().contains("every document is held out")),
                    "{}",
                    e
                ),
            }
        }
    }

    const CHAT: &str = r#"{"messages": [{"role": "user", "content": "Is 2^10 greater than 1000?"}, {"role": "assistant", "content": "Yes: 2^10 = 1024 > 1000."}]}"#;
    const SHAREGPT: &str = r#"{"conversations": [{"from": "human", "value": "Is 2^10 greater than 1000?"}, {"from": "gpt", "value": "Yes: 2^10 = 1024 > 1000."}]}"#;

    fn one_row(tmp: &Path, name: &str, line: &str, opts: &DataOptions) -> Row {
        let file = write(&tmp.join(name), &format!("{line}\n"), false);
        let opts = DataOptions { cache_dir: tmp.join(format!("cache-{name}")), ..opts.clone() };
        let data = Dataset::prepare(&tokenizer(), &[file], &opts).expect("prepare");
        let row = data.epoch(0).next().expect("a row").expect("row");
        row
    }

    #[test]
    fn sharegpt_equals_openai_and_the_system_prompt_is_added() {
        let tmp = tempfile::tempdir().unwrap();
        let opts = DataOptions { held_out: HeldOut::Fraction(0.0), packing: false, ..DataOptions::new("") };
        assert_eq!(one_row(tmp.path(), "a", CHAT, &opts), one_row(tmp.path(), "b", SHAREGPT, &opts));
        let with_system = DataOptions {
            render: dflash_data::mask::RenderOptions { system_prompt: Some("Be brief.".into()), thinking: false },
            ..opts
        };
        let row = one_row(tmp.path(), "c", CHAT, &with_system);
        let text = tokenizer().decode(&row.tokens);
        assert!(text.starts_with("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user"), "{text}");
    }

    #[test]
    fn a_held_out_file_is_the_held_out_split() {
        let tmp = tempfile::tempdir().unwrap();
        let train = write(&tmp.path().join("train.jsonl"), &format!("{CHAT}\n{CHAT}\n{CHAT}\n"), false);
        let eval = write(&tmp.path().join("eval.jsonl"), &format!("{SHAREGPT}\n"), false);
        let opts = DataOptions {
            held_out: HeldOut::Files(vec![eval]),
            packing: false,
            ..DataOptions::new(tmp.path().join("c"))
        };
        let data = Dataset::prepare(&tokenizer(), std::slice::from_ref(&train), &opts).expect("prepare");
        assert_eq!((data.train.len(), data.held_out.len(), data.held_out_duplicates), (3, 1, 0));
        // A held-out file holding a conversation of the data: that conversation is never trained
        // on (its copies neither); held-out files holding every one of them are refused.
        let mixed = write(&tmp.path().join("mixed.jsonl"), &format!("{CHAT}\n{SHAREGPT}\n{CHAT}\n"), false);
        let eval = write(&tmp.path().join("eval2.jsonl"), &format!("{CHAT}\n"), false);
        let opts = DataOptions { held_out: HeldOut::Files(vec![eval]), ..opts };
        let data = Dataset::prepare(&tokenizer(), &[mixed], &opts).expect("prepare");
        assert_eq!((data.train.len(), data.held_out.len(), data.held_out_duplicates), (1, 1, 2));
        let err = Dataset::prepare(&tokenizer(), &[train], &opts).err().expect("no training document").to_string();
        assert!(err.contains("every document of the data files (3) is also in the held-out files"), "{err}");
    }

    /// The held-out fraction is of conversations: the documents of a conversation made one per
    /// turn (which share their prefixes), and the copies of a repeated line, are all on one side.
    #[test]
    fn a_conversation_is_held_out_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let file = fixtures_dir().join("data/conversations.jsonl");
        for seed in 0..4 {
            let opts =
                DataOptions { seed, held_out: HeldOut::Fraction(0.3), ..DataOptions::new(tmp.path().join("cache")) };
            let data = Dataset::prepare(&tokenizer(), std::slice::from_ref(&file), &opts).expect("prepare");
            let side = |docs: &[usize]| {
                docs.iter().map(|&d| data.cache.content_of(d)).collect::<std::collections::BTreeSet<_>>()
            };
            let (train, held) = (side(&data.train), side(&data.held_out));
            // The fixture repeats a few conversations: a repeated line is one content.
            let text = std::fs::read_to_string(&file).unwrap();
            let distinct: BTreeSet<u64> = text.lines().map(dflash_data::cache::content_hash).collect();
            assert_eq!(data.stats().conversations, 50);
            assert_eq!(train.len() + held.len(), distinct.len());
            assert!(
                (5..=25).contains(&held.len()),
                "seed {seed}: {} of {} contents at 30%",
                held.len(),
                distinct.len()
            );
            assert!(train.is_disjoint(&held), "seed {seed}: a conversation on both sides");
            assert!(data.held_out.len() > held.len(), "some held-out conversations are one row per turn");
        }
    }

    /// A conversation's side is its own: more data (another file, lines before it) or an option
    /// that drops other conversations never moves it, and a line given twice is on one side.
    #[test]
    fn a_conversation_keeps_its_side_whatever_else_the_data_holds() {
        let tmp = tempfile::tempdir().unwrap();
        let lines = std::fs::read_to_string(fixtures_dir().join("data/conversations.jsonl")).unwrap();
        let lines: Vec<&str> = lines.lines().filter(|l| !l.trim().is_empty()).collect();
        let seed = rand::Rng::random(&mut rand::rng());
        let (half, rest) = lines.split_at(lines.len() / 2);
        let sides = |files: &[(&str, Vec<&str>)], cache: &str| {
            let paths: Vec<PathBuf> =
                files.iter().map(|(name, l)| write(&tmp.path().join(name), &(l.join("\n") + "\n"), false)).collect();
            let opts =
                DataOptions { seed, held_out: HeldOut::Fraction(0.4), ..DataOptions::new(tmp.path().join(cache)) };
            let data = Dataset::prepare(&tokenizer(), &paths, &opts).expect("prepare");
            let contents = |docs: &[usize]| docs.iter().map(|&d| data.cache.content_of(d)).collect::<BTreeSet<u64>>();
            (contents(&data.train), contents(&data.held_out))
        };
        let alone = sides(&[("half.jsonl", half.to_vec())], "a");
        let mut reordered: Vec<&str> = rest.to_vec();
        reordered.extend(half);
        reordered.push(half[0]);
        let with_more = sides(&[("more.jsonl", reordered), ("other.jsonl", rest.to_vec())], "b");
        assert!(!alone.1.is_empty() && !alone.0.is_empty(), "both sides hold some of the half");
        assert!(alone.0.is_subset(&with_more.0) && alone.1.is_subset(&with_more.1), "a conversation moved");
        assert!(with_more.0.is_disjoint(&with_more.1), "a repeated line on both sides");
    }

    /// The second run opens the cache (no tokenizing) and gives the same rows; a changed data
    /// file or option rebuilds it.
    #[test]
    fn the_tokenized_cache_is_reused_until_its_key_changes() {
        let tmp = tempfile::tempdir().unwrap();
        let lines = format!("{CHAT}\n{SHAREGPT}\n{CHAT}\n");
        let file = write(&tmp.path().join("d.jsonl"), &lines, false);
        let opts = DataOptions { held_out: HeldOut::Fraction(0.0), ..DataOptions::new(tmp.path().join("cache")) };
        let tok = tokenizer();
        let first = Dataset::prepare(&tok, std::slice::from_ref(&file), &opts).expect("first");
        assert!(first.tokenized);
        let again = Dataset::prepare(&tok, std::slice::from_ref(&file), &opts).expect("again");
        assert!(!again.tokenized, "the cache is reused");
        assert_eq!(all_rows(&first, 1), all_rows(&again, 1));
        assert_eq!(first.stats(), again.stats());
        let thinking = DataOptions {
            render: dflash_data::mask::RenderOptions { thinking: true, system_prompt: None },
            ..opts.clone()
        };
        assert!(Dataset::prepare(&tok, std::slice::from_ref(&file), &thinking).expect("thinking").tokenized);
        std::thread::sleep(std::time::Duration::from_millis(20));
        write(&file, &format!("{lines}{CHAT}\n"), false);
        let changed = Dataset::prepare(&tok, &[file], &opts).expect("changed");
        assert!(changed.tokenized);
        assert_eq!(changed.stats().documents, 4);
    }
}
