//! Reading jsonl data files line by line, plain or gzip (detected by its magic bytes), in
//! bounded chunks, counting the raw bytes read for the progress bar.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use flate2::read::MultiGzDecoder;

use crate::error::{Error, Result};

/// A reader that adds the bytes it reads to a shared counter.
struct Counting<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// One line of a data file: its 1-based number and text (newline removed), or why it is not
/// text.
pub struct Line {
    pub number: usize,
    pub text: std::result::Result<String, String>,
}

/// The longest line read (a conversation of a few thousand tokens is tens of KB; tokenizing a
/// line takes about 100 times its size in memory).
pub const MAX_LINE_BYTES: u64 = 16 << 20;

/// The lines of one file, plain or gzip.
pub struct Lines {
    file: PathBuf,
    reader: Box<dyn BufRead + Send>,
    number: usize,
}

impl Lines {
    /// Opens `file`; `count` grows by the raw (compressed) bytes read.
    pub fn open(file: &Path, count: Arc<AtomicU64>) -> Result<Self> {
        let mut raw = BufReader::new(File::open(file).map_err(|e| Error::io(file, e))?);
        let gzip = raw.fill_buf().map_err(|e| Error::io(file, e))?.starts_with(&[0x1f, 0x8b]);
        let counting = Counting { inner: raw, count };
        let reader: Box<dyn BufRead + Send> = if gzip {
            Box::new(BufReader::with_capacity(1 << 16, MultiGzDecoder::new(counting)))
        } else {
            Box::new(BufReader::with_capacity(1 << 16, counting))
        };
        Ok(Lines { file: file.to_owned(), reader, number: 0 })
    }

    /// Up to `max` non-blank lines; empty at the end of the file. A line longer than
    /// [`MAX_LINE_BYTES`] is not read into memory: it comes back as an error (skipped, counted).
    pub fn chunk(&mut self, max: usize) -> Result<Vec<Line>> {
        let mut lines = Vec::with_capacity(max);
        let mut buf = Vec::new();
        let io = |e| Error::io(&self.file, e);
        while lines.len() < max {
            buf.clear();
            let n = (&mut self.reader).take(MAX_LINE_BYTES + 1).read_until(b'\n', &mut buf).map_err(io)?;
            if n == 0 {
                break;
            }
            self.number += 1;
            if n as u64 > MAX_LINE_BYTES && buf.last() != Some(&b'\n') {
                // The rest of the line, read through and dropped.
                let mut rest = n as u64;
                loop {
                    let available = self.reader.fill_buf().map_err(io)?;
                    if available.is_empty() {
                        break;
                    }
                    let (used, end) = match available.iter().position(|&b| b == b'\n') {
                        Some(i) => (i + 1, true),
                        None => (available.len(), false),
                    };
                    self.reader.consume(used);
                    rest += used as u64;
                    if end {
                        break;
                    }
                }
                let text = Err(format!("a line of {rest} bytes, over the {} MiB limit", MAX_LINE_BYTES >> 20));
                lines.push(Line { number: self.number, text });
                continue;
            }
            // A byte order mark before the first line (editors on Windows write one) is not JSON.
            let body = match self.number {
                1 => buf.strip_prefix("\u{feff}".as_bytes()).unwrap_or(&buf),
                _ => &buf,
            };
            let text = match std::str::from_utf8(body) {
                Ok(t) if t.trim().is_empty() => continue,
                Ok(t) => Ok(t.trim_end_matches(['\n', '\r']).to_owned()),
                Err(e) => Err(format!("not UTF-8: {e}")),
            };
            lines.push(Line { number: self.number, text });
        }
        Ok(lines)
    }
}
