//! The tokenized form of a data set, cached in one file so that later epochs and resumed runs
//! never tokenize again. Layout: magic, the 32-byte key, each document's tokens (`u32` LE) and
//! loss mask (bits), the index (per document: offset `u64`, length `u32`, file `u32`, the
//! content hash of its conversation's line `u64`), the stats (JSON), and a footer (index offset,
//! document count, stats offset and length as `u64`, the sha256 of every byte between the key
//! and the footer, magic). Written to a temporary name,
//! synced, then renamed; opened only when its key (the tokenizer, template, options and data
//! files) matches, else rebuilt, and only when its bytes match their sha256 (else an error).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::mask::Document;
use crate::stats::Stats;

const MAGIC: &[u8; 8] = b"DFTOK\x00\x00\x03";
const FOOTER: usize = 4 * 8 + 32 + 8;
const ENTRY: usize = 24;

/// sha256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// A conversation's content hash: the first 8 bytes of the sha256 of its line (the text read,
/// without its line ending), little-endian. Equal lines hash equal, in any file or position.
pub fn content_hash(line: &str) -> u64 {
    u64::from_le_bytes(sha256(line.as_bytes())[..8].try_into().expect("8 bytes"))
}

/// The key of a cache: a hash of everything its documents depend on.
#[derive(Default)]
pub struct KeyBuilder(Sha256);

impl KeyBuilder {
    /// Adds one named part.
    pub fn add(&mut self, name: &str, value: &[u8]) -> &mut Self {
        for part in [name.as_bytes(), value] {
            self.0.update((part.len() as u64).to_le_bytes());
            self.0.update(part);
        }
        self
    }

    /// Adds a data file by its canonical path (the same file however it is named: `features`
    /// given a relative path and `train` the absolute one share the key), size and
    /// modification time.
    pub fn add_file(&mut self, file: &Path) -> Result<&mut Self> {
        let meta = std::fs::metadata(file).map_err(|e| Error::io(file, e))?;
        let mtime = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
        let path = std::fs::canonicalize(file).map_err(|e| Error::io(file, e))?;
        let stamp = format!("{} {} {:?}", path.display(), meta.len(), mtime);
        Ok(self.add("file", stamp.as_bytes()))
    }

    pub fn finish(&self) -> [u8; 32] {
        self.0.clone().finalize().into()
    }
}

/// `path`'s temporary name for writer `n` of process `pid` on machine `host`:
/// `NAME.tmp.HOST.PID.N`.
fn tmp_name(path: &Path, host: &str, pid: u32, n: u64) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp.{host}.{pid}.{n}"));
    path.with_file_name(name)
}

/// Removes `path`'s temporary files left by processes of machine `host` that no longer run
/// (where `/proc` says; none elsewhere, nor of other machines). Errors are ignored: a leftover
/// only takes space.
fn remove_dead_writers(path: &Path, host: &str) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else { return };
    let prefix = format!("{}.tmp.{host}.", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(if dir.as_os_str().is_empty() { Path::new(".") } else { dir }) else {
        return;
    };
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        // PID.N after the prefix (a host name with dots has its own prefix).
        let Some((pid, n)) = file.strip_prefix(&prefix).and_then(|rest| rest.split_once('.')) else { continue };
        let alive = Path::new("/proc").join(pid).exists() || !Path::new("/proc/self").exists();
        if pid.parse::<u32>().is_ok() && n.parse::<u64>().is_ok() && !alive {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Writes a cache: documents streamed in, then [`CacheWriter::finish`] renames it into place.
/// Each writer has a temporary name of its own (machine, process id and a counter), so processes
/// that tokenize the same data at once (the ranks of a run, started with the same options) each
/// rename a whole file into place; the temporary files of this machine's writers that died are
/// removed.
pub struct CacheWriter {
    path: PathBuf,
    tmp: PathBuf,
    out: BufWriter<File>,
    offset: u64,
    index: Vec<u8>,
    /// Of every byte after the key.
    checksum: Sha256,
}

impl CacheWriter {
    pub fn create(path: &Path, key: &[u8; 32]) -> Result<Self> {
        static WRITERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let host = crate::lock::host_name();
        if let Some(host) = &host {
            remove_dead_writers(path, host);
        }
        let n = WRITERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = tmp_name(path, host.as_deref().unwrap_or("unknown-host"), std::process::id(), n);
        let file = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        let mut w = CacheWriter {
            path: path.to_owned(),
            tmp,
            out: BufWriter::with_capacity(1 << 20, file),
            offset: 0,
            index: vec![],
            checksum: Sha256::new(),
        };
        w.write(MAGIC)?;
        w.write(key)?;
        w.checksum = Sha256::new();
        Ok(w)
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.out.write_all(bytes).map_err(|e| Error::io(&self.tmp, e))?;
        self.checksum.update(bytes);
        self.offset += bytes.len() as u64;
        Ok(())
    }

    /// Appends one document of data file number `file` whose conversation's line hashes to
    /// `content` (one conversation may give several documents, one per turn).
    pub fn push(&mut self, doc: &Document, file: u32, content: u64) -> Result<()> {
        self.index.extend(self.offset.to_le_bytes());
        self.index.extend((doc.tokens.len() as u32).to_le_bytes());
        self.index.extend(file.to_le_bytes());
        self.index.extend(content.to_le_bytes());
        let mut bytes = Vec::with_capacity(doc.tokens.len() * 4 + doc.tokens.len().div_ceil(8));
        bytes.extend(doc.tokens.iter().flat_map(|t| t.to_le_bytes()));
        bytes.extend(
            doc.loss_mask.chunks(8).map(|c| c.iter().enumerate().fold(0u8, |b, (i, &m)| b | (u8::from(m) << i))),
        );
        self.write(&bytes)
    }

    /// Writes the index, stats and footer, syncs and renames the file into place.
    pub fn finish(mut self, stats: &Stats) -> Result<()> {
        let index_offset = self.offset;
        let n_docs = (self.index.len() / ENTRY) as u64;
        let index = std::mem::take(&mut self.index);
        self.write(&index)?;
        let stats_json = serde_json::to_vec(stats).expect("stats serialise");
        let stats_offset = self.offset;
        self.write(&stats_json)?;
        let mut footer = Vec::with_capacity(FOOTER);
        for v in [index_offset, n_docs, stats_offset, stats_json.len() as u64] {
            footer.extend(v.to_le_bytes());
        }
        footer.extend(self.checksum.clone().finalize());
        footer.extend(MAGIC);
        self.write(&footer)?;
        let file = self.out.into_inner().map_err(|e| Error::io(&self.tmp, e.into_error()))?;
        file.sync_all().map_err(|e| Error::io(&self.tmp, e))?;
        std::fs::rename(&self.tmp, &self.path).map_err(|e| Error::io(&self.path, e))?;
        if let Some(dir) = self.path.parent() {
            File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io(dir, e))?;
        }
        Ok(())
    }
}

/// An opened cache: the index in memory, documents read on demand.
pub struct Cache {
    path: PathBuf,
    file: File,
    /// Per document: offset, length, data file number, content hash of its conversation.
    index: Vec<(u64, u32, u32, u64)>,
    pub stats: Stats,
    /// The key it was opened with: a hash of the tokenizer, template, options and data files.
    pub key: [u8; 32],
}

impl Cache {
    /// Opens `path` if it exists and carries `key`; `Ok(None)` when it must be rebuilt.
    pub fn open(path: &Path, key: &[u8; 32]) -> Result<Option<Self>> {
        let Ok(file) = File::open(path) else { return Ok(None) };
        let corrupt = |what: &str| Error::field(path, "cache", format!("{what}; delete the file to rebuild it"));
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        if len < (MAGIC.len() + 32 + FOOTER) as u64 {
            return Ok(None);
        }
        let read = |offset: u64, n: usize| -> Result<Vec<u8>> {
            let mut buf = vec![0; n];
            file.read_exact_at(&mut buf, offset).map_err(|e| Error::io(path, e))?;
            Ok(buf)
        };
        let head = read(0, MAGIC.len() + 32)?;
        if &head[..8] != MAGIC || head[8..] != key[..] {
            return Ok(None);
        }
        let footer = read(len - FOOTER as u64, FOOTER)?;
        if &footer[64..] != MAGIC {
            return Err(corrupt("no footer (a partial write?)"));
        }
        let word = |i: usize| u64::from_le_bytes(footer[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        let (index_offset, n_docs, stats_offset, stats_len) = (word(0), word(1), word(2), word(3));
        let entries = n_docs.checked_mul(ENTRY as u64).and_then(|b| index_offset.checked_add(b));
        let end = stats_offset.checked_add(stats_len).and_then(|b| b.checked_add(FOOTER as u64));
        if entries != Some(stats_offset) || end != Some(len) {
            return Err(corrupt("inconsistent footer"));
        }
        // Every byte between the key and the footer against the sha256 the writer recorded.
        let mut checksum = Sha256::new();
        let mut buf = vec![0; 1 << 20];
        let (mut at, end) = ((MAGIC.len() + 32) as u64, len - FOOTER as u64);
        while at < end {
            let n = buf.len().min((end - at) as usize);
            file.read_exact_at(&mut buf[..n], at).map_err(|e| Error::io(path, e))?;
            checksum.update(&buf[..n]);
            at += n as u64;
        }
        if checksum.finalize()[..] != footer[32..64] {
            return Err(corrupt("its bytes do not match the sha256 written with them (the file was changed)"));
        }
        let index = read(index_offset, n_docs as usize * ENTRY)?
            .chunks(ENTRY)
            .map(|e| {
                let u32_at = |i: usize| u32::from_le_bytes(e[i..i + 4].try_into().expect("4 bytes"));
                let u64_at = |i: usize| u64::from_le_bytes(e[i..i + 8].try_into().expect("8 bytes"));
                (u64_at(0), u32_at(8), u32_at(12), u64_at(16))
            })
            .collect();
        let stats =
            serde_json::from_slice(&read(stats_offset, stats_len as usize)?).map_err(|e| corrupt(&e.to_string()))?;
        Ok(Some(Cache { path: path.to_owned(), file, index, stats, key: *key }))
    }

    /// Number of documents.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// The data file number of document `i`.
    pub fn file_of(&self, i: usize) -> u32 {
        self.index[i].2
    }

    /// The content hash of document `i`'s conversation (its line's, [`content_hash`]).
    pub fn content_of(&self, i: usize) -> u64 {
        self.index[i].3
    }

    /// Tokens of document `i`.
    pub fn doc_len(&self, i: usize) -> usize {
        self.index[i].1 as usize
    }

    /// Reads document `i`.
    pub fn document(&self, i: usize) -> Result<Document> {
        let (offset, n, _, _) = self.index[i];
        let n = n as usize;
        let mut buf = vec![0; n * 4 + n.div_ceil(8)];
        self.file.read_exact_at(&mut buf, offset).map_err(|e| Error::io(&self.path, e))?;
        let tokens = buf[..n * 4].chunks(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
        let loss_mask = (0..n).map(|k| buf[n * 4 + k / 8] >> (k % 8) & 1 == 1).collect();
        Ok(Document { tokens, loss_mask })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn doc(rng: &mut rand_chacha::ChaCha8Rng) -> Document {
        let n = rng.random_range(3..40);
        Document {
            tokens: (0..n).map(|_| rng.random_range(0..1000)).collect(),
            loss_mask: (0..n).map(|_| rng.random()).collect(),
        }
    }

    /// Two writers of the same cache at once (two ranks tokenizing the same data): each writes a
    /// file of its own and renames it whole, so the cache is one writer's, never a mix; a dead
    /// process's leftover is removed, a live one's kept, another machine's kept.
    #[test]
    fn concurrent_writers_leave_a_whole_cache() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("docs.cache");
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::rng().random());
        let host = crate::lock::host_name().expect("Linux names its host");
        let dead = tmp_name(&path, &host, u32::MAX - 1, 0);
        let live = tmp_name(&path, &host, std::process::id(), 1 << 40);
        // A process of another machine sharing the folder: its id means nothing here.
        let elsewhere = tmp_name(&path, &format!("other.{host}"), u32::MAX - 1, 0);
        for (file, text) in [(&dead, "half"), (&live, "in progress"), (&elsewhere, "another machine's")] {
            std::fs::write(file, text).unwrap();
        }
        let key = [7u8; 32];
        let (mut a, mut b) = (CacheWriter::create(&path, &key).unwrap(), CacheWriter::create(&path, &key).unwrap());
        assert!(!dead.exists() && live.exists(), "the dead writer's file goes, the live one's stays");
        assert!(elsewhere.exists(), "another machine's writer is never judged by this one's processes");
        let docs: Vec<Document> = (0..6).map(|_| doc(&mut rng)).collect();
        for (i, d) in docs.iter().enumerate() {
            a.push(d, 0, i as u64).unwrap();
            b.push(d, 0, i as u64).unwrap();
        }
        b.finish(&Stats::default()).unwrap();
        a.finish(&Stats::default()).unwrap();
        let cache = Cache::open(&path, &key).unwrap().expect("a whole cache");
        assert_eq!(cache.len(), docs.len());
        for (i, d) in docs.iter().enumerate() {
            assert_eq!(cache.document(i).unwrap().tokens, d.tokens);
        }
    }

    /// A data file's part of a key is the file's, whatever path names it (relative, absolute,
    /// through `..`).
    #[test]
    fn a_file_keys_the_same_by_any_path() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("d");
        std::fs::create_dir(&dir).unwrap();
        let file = dir.join("data.jsonl");
        std::fs::write(&file, format!("{}\n", rand::rng().random::<u64>())).unwrap();
        let key = |p: &Path| KeyBuilder::default().add_file(p).unwrap().finish();
        let cwd = std::env::current_dir().unwrap();
        let relative = pathdiff(&file, &cwd);
        assert_eq!(key(&file), key(&dir.join("../d/data.jsonl")));
        assert_eq!(key(&file), key(&relative), "{}", relative.display());
        let other = dir.join("other.jsonl");
        std::fs::copy(&file, &other).unwrap();
        assert_ne!(key(&file), key(&other), "another file");
    }

    /// `to` relative to `from` (both absolute): `..` up to their common prefix, then down.
    fn pathdiff(to: &Path, from: &Path) -> PathBuf {
        let (to, from): (Vec<_>, Vec<_>) = (to.components().collect(), from.components().collect());
        let common = to.iter().zip(&from).take_while(|(a, b)| a == b).count();
        let mut p = PathBuf::new();
        (common..from.len()).for_each(|_| p.push(".."));
        to[common..].iter().for_each(|c| p.push(c));
        p
    }

    /// A cache whose bytes changed after it was written (a token, the index or the stats; the
    /// length and footer intact) is refused naming the file, not read as other documents.
    #[test]
    fn a_changed_byte_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("docs.cache");
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::rng().random());
        let key = [9u8; 32];
        let mut w = CacheWriter::create(&path, &key).unwrap();
        for i in 0..5 {
            w.push(&doc(&mut rng), 0, i).unwrap();
        }
        w.finish(&Stats::default()).unwrap();
        let whole = std::fs::read(&path).unwrap();
        assert!(Cache::open(&path, &key).unwrap().is_some());
        let body = MAGIC.len() + 32..whole.len() - FOOTER;
        for _ in 0..8 {
            let mut bytes = whole.clone();
            bytes[rng.random_range(body.clone())] ^= 1 << rng.random_range(0..8);
            std::fs::write(&path, &bytes).unwrap();
            let err = Cache::open(&path, &key).err().expect("a changed cache must not open").to_string();
            assert!(err.contains("docs.cache") && err.contains("do not match the sha256"), "{err}");
        }
    }
}
