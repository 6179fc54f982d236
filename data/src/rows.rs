//! Documents to training rows (spec section 6): truncation at the maximum length, the filter
//! of documents without an anchor candidate (2 consecutive supervised tokens), and the two row
//! layouts: packing several documents into rows of `S` tokens (document ids `0, 1, ...`,
//! positions restarting at 0, padding `-1` at the end) or one document per row.

use dflash_reference::anchors::anchor_candidates;
use dflash_reference::data::Row;

use crate::mask::Document;

/// Truncates `doc` to `max_len` tokens; returns whether anything was cut.
pub fn truncate(doc: &mut Document, max_len: usize) -> bool {
    let cut = doc.tokens.len() > max_len;
    doc.tokens.truncate(max_len);
    doc.loss_mask.truncate(max_len);
    cut
}

/// Whether `doc` has an anchor candidate (`m[a] = m[a+1] = 1`); documents without one teach
/// nothing and are filtered.
pub fn has_anchor_candidate(doc: &Document) -> bool {
    !anchor_candidates(&doc.loss_mask).is_empty()
}

/// How documents are laid out in rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packing {
    /// Rows of exactly `seq_len` tokens holding whole documents in order, the tail padded.
    Packed { seq_len: usize, pad_id: u32 },
    /// One document per row, of the document's length.
    OnePerRow,
}

/// Lays out `docs` (each at most `seq_len` tokens when packed) in order into rows; an error
/// reading a document is passed on as the next item.
pub struct RowBuilder<I: Iterator> {
    docs: std::iter::Peekable<I>,
    packing: Packing,
}

impl<E, I: Iterator<Item = Result<Document, E>>> RowBuilder<I> {
    pub fn new(docs: I, packing: Packing) -> Self {
        RowBuilder { docs: docs.peekable(), packing }
    }
}

fn push_doc(row: &mut Row, doc: Document, id: i64) {
    row.positions.extend(0..doc.tokens.len());
    row.doc_ids.extend(std::iter::repeat_n(id, doc.tokens.len()));
    row.tokens.extend(doc.tokens);
    row.loss_mask.extend(doc.loss_mask);
}

impl<E, I: Iterator<Item = Result<Document, E>>> Iterator for RowBuilder<I> {
    type Item = Result<Row, E>;

    fn next(&mut self) -> Option<Self::Item> {
        let first = match self.docs.next()? {
            Ok(doc) => doc,
            Err(e) => return Some(Err(e)),
        };
        let mut row = Row { tokens: vec![], loss_mask: vec![], doc_ids: vec![], positions: vec![] };
        push_doc(&mut row, first, 0);
        if let Packing::Packed { seq_len, pad_id } = self.packing {
            let mut id = 1;
            while let Some(Ok(doc)) =
                self.docs.next_if(|d| d.as_ref().is_ok_and(|d| row.tokens.len() + d.tokens.len() <= seq_len))
            {
                push_doc(&mut row, doc, id);
                id += 1;
            }
            let pad = seq_len.saturating_sub(row.tokens.len());
            row.tokens.extend(std::iter::repeat_n(pad_id, pad));
            row.loss_mask.extend(std::iter::repeat_n(false, pad));
            row.doc_ids.extend(std::iter::repeat_n(-1, pad));
            row.positions.extend(std::iter::repeat_n(0, pad));
        }
        Some(Ok(row))
    }
}
