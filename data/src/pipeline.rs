//! The whole pipeline: data files and a target folder to an indexed, cached, tokenized data set
//! and its rows per epoch. One streaming pass reads the files in bounded chunks (memory does
//! not grow with the data set), renders, tokenizes and masks each chunk on all cores (rayon),
//! truncates and filters, and streams the documents into the cache; a later run with the same
//! key opens the cache instead.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dflash_reference::data::Row;
use rayon::prelude::*;

use crate::cache::{content_hash, Cache, CacheWriter, KeyBuilder};
use crate::epoch::{epoch_order, held_out};
use crate::error::{Error, Result, Skip, SkipReason};
use crate::format::parse_record;
use crate::mask::{documents, Layout, RenderOptions, Rendered};
use crate::rows::{has_anchor_candidate, truncate, Packing, RowBuilder};
use crate::source::{Line, Lines};
use crate::stats::{RowCounts, Stats};
use crate::target::TargetTokenizer;

/// Lines tokenized together (on all cores) before their documents are written.
const CHUNK_LINES: usize = 1024;

/// Bumped when the cache's content or layout changes.
const CACHE_VERSION: &str = "5";

/// Where the held-out documents come from.
#[derive(Clone, Debug, PartialEq)]
pub enum HeldOut {
    /// This fraction of the conversations, drawn by the seed; a conversation's documents (one
    /// per turn) all go to one side, so no held-out turn shares a prefix with a training one.
    Fraction(f64),
    /// Every document of these files (and none of the training files).
    Files(Vec<PathBuf>),
}

/// Options of the pipeline; the defaults are the spec's recipe.
#[derive(Clone, Debug, PartialEq)]
pub struct DataOptions {
    pub render: RenderOptions,
    /// Documents are cut at this many tokens (3072).
    pub max_len: usize,
    /// Pack documents into rows of `max_len` tokens (default) or one per row.
    pub packing: bool,
    /// 5% of the conversations by default (all documents of a conversation on one side).
    pub held_out: HeldOut,
    /// Seeds the split and each epoch's order.
    pub seed: u64,
    /// Where the tokenized cache lives (next to the run's output).
    pub cache_dir: PathBuf,
    /// Show a progress bar (plain lines when not a terminal).
    pub progress: bool,
}

impl DataOptions {
    /// The defaults with the cache in `cache_dir`: thinking off, no system prompt, max length
    /// 3072, packing on, 5% held out, seed 0.
    pub fn new(cache_dir: impl Into<PathBuf>) -> Self {
        DataOptions {
            render: RenderOptions::default(),
            max_len: 3072,
            packing: true,
            held_out: HeldOut::Fraction(0.05),
            seed: 0,
            cache_dir: cache_dir.into(),
            progress: false,
        }
    }

    fn validate(&self) -> Result<()> {
        if self.max_len < 2 {
            return Err(Error::option(
                "max_len",
                format!("{}: at least 2 tokens are needed for an anchor", self.max_len),
            ));
        }
        if let HeldOut::Fraction(f) = self.held_out {
            if !(0.0..1.0).contains(&f) {
                return Err(Error::option("held_out", format!("{f}: a fraction in [0, 1) expected")));
            }
        }
        Ok(())
    }
}

/// A tokenized data set: the cache, the split, and the row layout.
pub struct Dataset {
    pub cache: Cache,
    pub train: Vec<usize>,
    pub held_out: Vec<usize>,
    pub packing: Packing,
    pub seed: u64,
    /// Whether this run tokenized (false: the cache was reused).
    pub tokenized: bool,
    /// Documents of the data files left out of training because a held-out file holds the same
    /// conversation (held-out figures would otherwise measure rows the drafter trained on).
    pub held_out_duplicates: usize,
}

impl Dataset {
    /// Tokenizes `files` (and held-out files) with the target's tokenizer, or opens the cache
    /// when its key matches. Fails when no document is left, naming the skips and filters.
    pub fn prepare(target: &TargetTokenizer, files: &[PathBuf], opts: &DataOptions) -> Result<Dataset> {
        opts.validate()?;
        if files.is_empty() {
            return Err(Error::option("data", "no data file given"));
        }
        let held_files = match &opts.held_out {
            HeldOut::Files(f) => f.clone(),
            HeldOut::Fraction(_) => vec![],
        };
        let all: Vec<PathBuf> = files.iter().chain(&held_files).cloned().collect();
        for f in &all {
            std::fs::metadata(f).map_err(|e| Error::io(f, e))?;
        }
        // A file given twice would train on its conversations twice (and a fraction's held-out
        // documents would have trained copies).
        for (i, f) in files.iter().enumerate() {
            let same = |g: &PathBuf| g.canonicalize().ok().is_some_and(|g| Some(g) == f.canonicalize().ok());
            if let Some(g) = files[..i].iter().find(|g| same(g)) {
                return Err(Error::option("data", format!("{} is given twice (also as {})", f.display(), g.display())));
            }
        }
        // A held-out file that is also training data would measure the drafter on what it trained on.
        for h in &held_files {
            let same = |f: &PathBuf| f.canonicalize().ok().is_some_and(|f| Some(f) == h.canonicalize().ok());
            if let Some(f) = files.iter().find(|f| same(f)) {
                return Err(Error::option(
                    "held_out",
                    format!(
                        "{} is also a --data file ({}): held-out documents must not be trained on",
                        h.display(),
                        f.display()
                    ),
                ));
            }
        }
        let key = cache_key(target, &all, opts)?;
        std::fs::create_dir_all(&opts.cache_dir).map_err(|e| Error::io(&opts.cache_dir, e))?;
        let path = opts.cache_dir.join("tokenized.bin");
        let (cache, tokenized) = match Cache::open(&path, &key)? {
            Some(cache) => (cache, false),
            None => {
                tokenize_all(target, &all, opts, &path, &key)?;
                (
                    Cache::open(&path, &key)?
                        .ok_or_else(|| Error::field(&path, "cache", "not readable after writing"))?,
                    true,
                )
            }
        };
        if cache.is_empty() && cache.stats.lines == 0 {
            let names: Vec<String> = all.iter().map(|f| f.display().to_string()).collect();
            return Err(Error::NoRows(format!(
                "the data files hold no lines (blank lines aside): {}",
                names.join(", ")
            )));
        }
        if cache.is_empty() {
            let examples: String = cache.stats.examples.iter().map(|e| format!("\n  e.g. {e}")).collect();
            return Err(Error::NoRows(format!(
                "every line was skipped or filtered ({}){examples}",
                cache.stats.skip_summary()
            )));
        }
        let (mut train, held_out): (Vec<usize>, Vec<usize>) = match &opts.held_out {
            HeldOut::Fraction(f) => (0..cache.len()).partition(|&i| !held_out(cache.content_of(i), *f, opts.seed)),
            HeldOut::Files(_) => (0..cache.len()).partition(|&i| (cache.file_of(i) as usize) < files.len()),
        };
        // A conversation in a held-out file is never trained on (a split copied out of the data
        // without trimming it): by content, as the fraction's split keeps a conversation whole.
        let before = train.len();
        if matches!(opts.held_out, HeldOut::Files(_)) {
            let held: std::collections::HashSet<u64> = held_out.iter().map(|&i| cache.content_of(i)).collect();
            train.retain(|&i| !held.contains(&cache.content_of(i)));
        }
        let held_out_duplicates = before - train.len();
        if let (HeldOut::Files(held_files), true) = (&opts.held_out, held_out.is_empty()) {
            let names: Vec<String> = held_files.iter().map(|f| f.display().to_string()).collect();
            return Err(Error::option(
                "held_out",
                format!("{}: no held-out document (every line skipped or filtered, or none)", names.join(", ")),
            ));
        }
        if train.is_empty() {
            return Err(Error::NoRows(match &opts.held_out {
                HeldOut::Fraction(_) => format!(
                    "every document is held out ({} conversations, each held out with probability `held_out`): more data, a smaller fraction, or a held-out file",
                    cache.stats.conversations
                ),
                HeldOut::Files(_) if held_out_duplicates > 0 => format!(
                    "every document of the data files ({held_out_duplicates}) is also in the held-out files"
                ),
                HeldOut::Files(_) => "the data files hold no document; only the held-out files do".into(),
            }));
        }
        let packing = if opts.packing {
            Packing::Packed { seq_len: opts.max_len, pad_id: target.pad_id }
        } else {
            Packing::OnePerRow
        };
        Ok(Dataset { cache, train, held_out, packing, seed: opts.seed, tokenized, held_out_duplicates })
    }

    /// The stats of the tokenizing pass.
    pub fn stats(&self) -> &Stats {
        &self.cache.stats
    }

    /// The rows of `docs` in that order.
    pub fn rows<'a>(&'a self, docs: Vec<usize>) -> impl Iterator<Item = Result<Row>> + 'a {
        RowBuilder::new(docs.into_iter().map(|i| self.cache.document(i)), self.packing)
    }

    /// The training rows of epoch `epoch` (documents in the order drawn from the seed and epoch).
    pub fn epoch(&self, epoch: u64) -> impl Iterator<Item = Result<Row>> + '_ {
        self.rows(epoch_order(&self.train, self.seed, epoch))
    }

    /// Counts the rows of `rows`.
    pub fn count(rows: impl Iterator<Item = Result<Row>>) -> Result<RowCounts> {
        let mut counts = RowCounts::default();
        for row in rows {
            counts.add(&row?);
        }
        Ok(counts)
    }

    /// The held-out rows (documents in file order).
    pub fn held_out_rows(&self) -> impl Iterator<Item = Result<Row>> + '_ {
        self.rows(self.held_out.clone())
    }
}

fn cache_key(target: &TargetTokenizer, files: &[PathBuf], opts: &DataOptions) -> Result<[u8; 32]> {
    let mut key = KeyBuilder::default();
    key.add("version", CACHE_VERSION.as_bytes())
        .add("tokenizer", &target.tokenizer_hash)
        .add("template", target.template.as_ref().map_or(&b""[..], |t| t.source.as_bytes()))
        .add("vocab", &(target.vocab_size as u64).to_le_bytes())
        .add("special tokens", serde_json::json!(target.special_tokens).to_string().as_bytes())
        .add("end ids", &target.end_ids.iter().flat_map(|id| id.to_le_bytes()).collect::<Vec<u8>>())
        .add("thinking", &[u8::from(opts.render.thinking)])
        .add("system", opts.render.system_prompt.as_deref().unwrap_or("\0none").as_bytes())
        .add("max_len", &(opts.max_len as u64).to_le_bytes());
    for f in files {
        key.add_file(f)?;
    }
    Ok(key.finish())
}

/// What one line became, and its content hash.
type LineResult = std::result::Result<(Rendered, u64), Skip>;

fn process(target: &TargetTokenizer, line: &Line, opts: &RenderOptions) -> LineResult {
    let text = line.text.as_ref().map_err(|e| Skip::new(SkipReason::MalformedLine, e.clone()))?;
    Ok((documents(target, parse_record(text)?, opts)?, content_hash(text)))
}

/// The streaming pass over every file into the cache at `path`.
fn tokenize_all(
    target: &TargetTokenizer,
    files: &[PathBuf],
    opts: &DataOptions,
    path: &Path,
    key: &[u8; 32],
) -> Result<()> {
    let total: u64 = files.iter().map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0)).sum();
    let read = Arc::new(AtomicU64::new(0));
    let progress = opts.progress.then(|| Progress::new(total));
    let mut writer = CacheWriter::create(path, key)?;
    let mut stats = Stats::default();
    for (file_no, file) in files.iter().enumerate() {
        let name = file.display().to_string();
        let mut lines = Lines::open(file, read.clone())?;
        loop {
            let chunk = lines.chunk(CHUNK_LINES)?;
            if chunk.is_empty() {
                break;
            }
            let results: Vec<LineResult> = chunk.par_iter().map(|line| process(target, line, &opts.render)).collect();
            for (line, result) in chunk.iter().zip(results) {
                stats.lines += 1;
                match result {
                    Err(skip) => stats.skip(&name, line.number, &skip),
                    Ok((Rendered { layout, docs, unended_turns }, content)) => {
                        let mut kept = false;
                        for mut doc in docs {
                            stats.truncated += usize::from(truncate(&mut doc, opts.max_len));
                            if !has_anchor_candidate(&doc) {
                                let skip =
                                    Skip::new(SkipReason::NoAnchorCandidate, format!("{} tokens", doc.tokens.len()));
                                stats.skip(&name, line.number, &skip);
                                continue;
                            }
                            kept = true;
                            stats.documents += 1;
                            stats.tokens += doc.tokens.len();
                            stats.supervised_tokens += doc.loss_mask.iter().filter(|&&m| m).count();
                            writer.push(&doc, file_no as u32, content)?;
                        }
                        stats.conversations += usize::from(kept);
                        stats.per_turn_conversations += usize::from(kept && layout == Layout::PerTurn);
                        stats.unended_turns += unended_turns;
                    }
                }
            }
            if let Some(p) = &progress {
                p.update(read.load(Ordering::Relaxed), stats.lines);
            }
        }
    }
    if let Some(p) = progress {
        p.finish(stats.lines);
    }
    writer.finish(&stats)
}

/// A progress bar on a terminal, a plain line every few seconds otherwise.
enum Progress {
    Bar(indicatif::ProgressBar),
    Lines { total: u64, started: Instant, last: std::cell::Cell<Instant> },
}

impl Progress {
    fn new(total: u64) -> Self {
        if std::io::stderr().is_terminal() {
            let bar = indicatif::ProgressBar::new(total);
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "tokenizing {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}",
            ) {
                bar.set_style(style);
            }
            Progress::Bar(bar)
        } else {
            let now = Instant::now();
            Progress::Lines { total, started: now, last: std::cell::Cell::new(now) }
        }
    }

    fn update(&self, bytes: u64, lines: usize) {
        match self {
            Progress::Bar(bar) => {
                bar.set_position(bytes);
                bar.set_message(format!("{lines} lines"));
            }
            Progress::Lines { total, started, last } => {
                if last.get().elapsed() >= Duration::from_secs(5) {
                    last.set(Instant::now());
                    let pct = 100.0 * bytes as f64 / (*total).max(1) as f64;
                    eprintln!(
                        "tokenizing: {pct:.0}% of {} MB, {lines} lines, {:.0}s",
                        total / 1_000_000,
                        started.elapsed().as_secs_f64()
                    );
                }
            }
        }
    }

    fn finish(self, lines: usize) {
        match self {
            Progress::Bar(bar) => bar.finish_with_message(format!("{lines} lines")),
            Progress::Lines { started, .. } => {
                eprintln!("tokenized {lines} lines in {:.1}s", started.elapsed().as_secs_f64())
            }
        }
    }
}
