//! What the pipeline did: counts of records, documents, tokens, supervised tokens, truncations,
//! and every skip or filter by reason with the first few examples (file and line).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{Skip, SkipReason};

/// Examples of skips kept for the summary.
pub const MAX_EXAMPLES: usize = 8;

/// Counts of one tokenizing pass (stored in the cache with the documents).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Non-blank lines read.
    pub lines: usize,
    /// Lines that gave at least one document.
    pub conversations: usize,
    /// Conversations whose template rewrote earlier turns (one document per assistant turn).
    pub per_turn_conversations: usize,
    /// Assistant turns with no end-of-turn token (`eos_token` and `generation_config.json`'s
    /// `eos_token_id` name none of their tokens), supervised through the end of their render.
    #[serde(default)]
    pub unended_turns: usize,
    /// Documents kept (after the filter).
    pub documents: usize,
    /// Documents cut at the maximum length.
    pub truncated: usize,
    /// Tokens and supervised tokens of the kept documents.
    pub tokens: usize,
    pub supervised_tokens: usize,
    /// Skipped lines and filtered documents per reason.
    pub skipped: BTreeMap<SkipReason, usize>,
    /// The first [`MAX_EXAMPLES`] skips: `file:line: reason: message`.
    pub examples: Vec<String>,
}

impl Stats {
    /// Counts one skip, keeping it as an example while there is room.
    pub fn skip(&mut self, file: &str, line: usize, skip: &Skip) {
        *self.skipped.entry(skip.reason).or_default() += 1;
        if self.examples.len() < MAX_EXAMPLES {
            self.examples.push(format!("{file}:{line}: {skip}"));
        }
    }

    /// All skips and filters.
    pub fn total_skipped(&self) -> usize {
        self.skipped.values().sum()
    }

    /// What the turns without an end-of-turn token mean, when there are any.
    pub fn unended_warning(&self) -> Option<String> {
        (self.unended_turns > 0).then(|| {
            format!(
                "warning: {} assistant turns have no end-of-turn token (eos_token and generation_config.json's eos_token_id name none of their tokens): each is supervised through the end of its render, the template's text after the turn included",
                self.unended_turns
            )
        })
    }

    /// `reason: count` for each reason that happened.
    pub fn skip_summary(&self) -> String {
        let parts: Vec<String> = self.skipped.iter().map(|(r, n)| format!("{}: {n}", r.describe())).collect();
        parts.join("; ")
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "lines:              {}", self.lines)?;
        writeln!(
            f,
            "conversations:      {} ({} as one row per assistant turn)",
            self.conversations, self.per_turn_conversations
        )?;
        writeln!(f, "documents:          {}", self.documents)?;
        writeln!(f, "tokens:             {}", self.tokens)?;
        let pct = 100.0 * self.supervised_tokens as f64 / self.tokens.max(1) as f64;
        writeln!(f, "supervised tokens:  {} ({pct:.1}%)", self.supervised_tokens)?;
        writeln!(f, "truncated:          {}", self.truncated)?;
        if let Some(warning) = self.unended_warning() {
            writeln!(f, "{warning}")?;
        }
        write!(f, "skipped or filtered: {}", self.total_skipped())?;
        for (reason, n) in &self.skipped {
            write!(f, "\n  {n:>8}  {}", reason.describe())?;
        }
        for example in &self.examples {
            write!(f, "\n  e.g. {example}")?;
        }
        Ok(())
    }
}

/// The rows of one pass: how many, and how full.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowCounts {
    pub rows: usize,
    /// Tokens of documents (not padding).
    pub tokens: usize,
    pub supervised_tokens: usize,
}

impl RowCounts {
    /// Adds one row.
    pub fn add(&mut self, row: &dflash_reference::data::Row) {
        self.rows += 1;
        self.tokens += row.doc_ids.iter().filter(|&&d| d >= 0).count();
        self.supervised_tokens += row.loss_mask.iter().filter(|&&m| m).count();
    }

    /// Packing efficiency: document tokens / the token slots of the rows as training lays them
    /// out, each padded to `seq_len` (packed or one document per row).
    pub fn efficiency(&self, seq_len: usize) -> f64 {
        self.tokens as f64 / (self.rows * seq_len).max(1) as f64
    }
}
