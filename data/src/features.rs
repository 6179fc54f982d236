//! The offline feature cache (spec section 8): the target's features of every document of a data
//! set, so that training needs no target. One entry per document of the tokenized data set, in
//! its order (documents are isolated in packed rows, so a document's features do not depend on
//! the row it is packed into: the trainer packs cached documents per epoch as it packs tokens).
//!
//! Layout of `CACHE/`:
//! - `shard-NNNNN.safetensors`: consecutive documents; tensors `features` bf16 `[t, F*H]`,
//!   `tokens` u32 `[t]`, `loss_mask` u8 `[t]`, `doc_ids` i64 `[t]` (the data set's document
//!   index), `positions` u32 `[t]` (from 0 per document) and `doc_offsets` i64 `[docs + 1]`
//!   (token offsets of the documents in the shard). Memory-mappable: data offsets are 8-aligned.
//! - `index.json`: the format, the provenance (hashes of what the features depend on), the
//!   feature width, and each complete shard (documents, tokens, bytes).
//!
//! Nothing half-written is ever listed: a shard is written under `.tmp`, synced, renamed and its
//! folder synced, then the index is rewritten the same way. A killed writer resumes after the
//! last listed shard (shard boundaries are a function of the documents and the shard size),
//! writing again a listed shard whose size differs from the index and those after it; the
//! reader refuses such a shard by name.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The format tag of `index.json` and of every shard's metadata.
pub const FORMAT: &str = "dflash-features-1";
/// Bytes of metadata per token in a shard: token u32, mask u8, document i64, position u32.
pub const META_BYTES_PER_TOKEN: u64 = 4 + 1 + 8 + 4;

/// sha256 of the bytes of `files` one after another, hex, read in blocks (a checkpoint's weights
/// may be many GB).
fn files_hash(files: &[PathBuf]) -> Result<String> {
    use sha2::Digest;
    use std::io::Read;
    let (mut hasher, mut block) = (sha2::Sha256::new(), vec![0u8; 1 << 22]);
    for file in files {
        let mut f = File::open(file).map_err(|e| Error::io(file, e))?;
        loop {
            let n = f.read(&mut block).map_err(|e| Error::io(file, e))?;
            if n == 0 {
                break;
            }
            hasher.update(&block[..n]);
        }
    }
    Ok(hex(&hasher.finalize()))
}

/// The target's weight files: the shards its `model.safetensors.index.json` names (each once, by
/// name), or its single `model.safetensors`.
fn weight_files(target: &Path) -> Result<Vec<PathBuf>> {
    let index = target.join("model.safetensors.index.json");
    if !index.is_file() {
        return Ok(vec![target.join("model.safetensors")]);
    }
    let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::field(&index, "(the file)", e.to_string()))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::field(&index, "weight_map", "missing, or not an object"))?;
    let mut names = std::collections::BTreeSet::new();
    for (tensor, file) in map {
        let file =
            file.as_str().ok_or_else(|| Error::field(&index, format!("weight_map.{tensor}"), "not a file name"))?;
        names.insert(file.to_string());
    }
    Ok(names.into_iter().map(|name| target.join(name)).collect())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The provenance of a cache of the target in `target` tapping `layer_ids` over the data set of
/// key `data_key` (the tokenized cache's: tokenizer, template, options, files): sha256 of the
/// target's `config.json` and of its weights (every shard its index names, in name order, as one
/// stream; or the single `model.safetensors`). `xtask/scripts/features_transformers.py` computes
/// the same.
pub fn provenance(target: &Path, layer_ids: &[usize], data_key: &[u8; 32]) -> Result<BTreeMap<String, String>> {
    let ids: Vec<String> = layer_ids.iter().map(|l| l.to_string()).collect();
    Ok(BTreeMap::from([
        ("target_config".to_string(), files_hash(&[target.join("config.json")])?),
        ("target_weights".to_string(), files_hash(&weight_files(target)?)?),
        ("data".to_string(), hex(data_key)),
        ("layer_ids".to_string(), ids.join(",")),
    ]))
}

/// Writes the documents of `cache` to `file` as jsonl for the transformers writer: a header line
/// `{"dflash_documents": 1, "data": <key hex>, "documents": N, "tokens": T}`, then one
/// `{"input_ids": [...], "loss_mask": [0|1, ...]}` per document, in order. Returns (N, T).
pub fn export_documents(cache: &crate::cache::Cache, file: &Path) -> Result<(usize, u64)> {
    let tokens: u64 = (0..cache.len()).map(|i| cache.doc_len(i) as u64).sum();
    // Streamed, one document at a time: a data set of a billion tokens is gigabytes of text.
    write_synced(file, |w| {
        let header = serde_json::json!({"dflash_documents": 1, "data": hex(&cache.key), "documents": cache.len(), "tokens": tokens});
        writeln!(w, "{header}").map_err(|e| Error::io(file, e))?;
        for i in 0..cache.len() {
            let doc = cache.document(i)?;
            let mask: Vec<u8> = doc.loss_mask.iter().map(|&m| u8::from(m)).collect();
            let line = serde_json::json!({"input_ids": doc.tokens, "loss_mask": mask});
            writeln!(w, "{line}").map_err(|e| Error::io(file, e))?;
        }
        Ok(())
    })?;
    Ok((cache.len(), tokens))
}

/// One complete shard.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub file: String,
    /// Index of its first document, and how many it holds.
    pub first_doc: usize,
    pub docs: usize,
    pub tokens: u64,
    /// The file's size.
    pub bytes: u64,
}

/// `index.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeatureIndex {
    pub format: String,
    /// What the features depend on, by name: target config and weights, tokenizer, template,
    /// data files and options, layer ids, max length (hex sha256 or the value).
    pub provenance: BTreeMap<String, String>,
    pub hidden_size: usize,
    pub layer_ids: Vec<usize>,
    /// Features start a new shard once a shard holds this many feature bytes.
    pub shard_bytes: u64,
    /// Documents of the data set, and their tokens.
    pub documents: usize,
    pub tokens: u64,
    pub shards: Vec<ShardEntry>,
}

impl FeatureIndex {
    /// Feature width `F*H`.
    pub fn feature_width(&self) -> usize {
        self.layer_ids.len() * self.hidden_size
    }

    /// Whether every document is in a listed shard.
    pub fn complete(&self) -> bool {
        self.shards.iter().map(|s| s.docs).sum::<usize>() == self.documents
    }

    /// The first document no listed shard holds.
    pub fn next_doc(&self) -> usize {
        self.shards.last().map_or(0, |s| s.first_doc + s.docs)
    }

    /// Bytes of a complete cache of `tokens` tokens at this width (shard headers aside).
    pub fn estimate_bytes(tokens: u64, feature_width: usize) -> u64 {
        tokens.saturating_mul(2 * feature_width as u64 + META_BYTES_PER_TOKEN)
    }

    /// Reads and parses an `index.json`.
    pub fn read(file: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(file).map_err(|e| Error::io(file, e))?;
        let index: FeatureIndex = serde_json::from_str(&text)
            .map_err(|e| Error::field(file, "index", format!("line {} column {}: {e}", e.line(), e.column())))?;
        if index.format != FORMAT {
            return Err(Error::field(file, "format", format!("`{}`; this build reads `{FORMAT}`", index.format)));
        }
        // The shards: files of the cache's own folder, holding consecutive documents from 0.
        let mut next = 0;
        for (k, shard) in index.shards.iter().enumerate() {
            let plain = Path::new(&shard.file).file_name().is_some_and(|n| n == shard.file.as_str());
            if !plain || shard.file == ".." {
                let why = format!("`{}` is not a file name in the cache's folder", shard.file);
                return Err(Error::field(file, format!("shards[{k}].file"), why));
            }
            if shard.first_doc != next {
                let why = format!("{}, where the shards before it end at document {next}", shard.first_doc);
                return Err(Error::field(file, format!("shards[{k}].first_doc"), why));
            }
            next = shard.first_doc.saturating_add(shard.docs);
        }
        if next > index.documents {
            let why = format!("{}, fewer than its shards hold ({next})", index.documents);
            return Err(Error::field(file, "documents", why));
        }
        Ok(index)
    }

    fn write(&self, dir: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(|e| Error::field(dir, "index", e.to_string()))?;
        let file = dir.join("index.json");
        write_synced(&file, |w| w.write_all(text.as_bytes()).map_err(|e| Error::io(&file, e)))
    }

    /// What can be checked of the cache in `dir` (this index) against `target` before the data
    /// is tokenized or the target's weights hashed: every document written, the target's hidden
    /// size, and the hash of its `config.json`. Errors name the cache and what differs.
    pub fn check_early(&self, dir: &Path, target: &Path, hidden_size: usize) -> Result<()> {
        let file = dir.join("index.json");
        if !self.complete() {
            let why = format!(
                "{} of {} documents written (an unfinished `cargo xtask features` run: run it again to finish)",
                self.next_doc(),
                self.documents
            );
            return Err(Error::field(&file, "shards", why));
        }
        if self.hidden_size != hidden_size {
            let why = format!("{}, the target's is {hidden_size} (a cache of another target)", self.hidden_size);
            return Err(Error::field(&file, "hidden_size", why));
        }
        let mut want = self.provenance.clone();
        want.insert("target_config".into(), files_hash(&[target.join("config.json")])?);
        match self.provenance_mismatch(&want, &file, "") {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The first provenance entry that differs from `want`, as an error on `file` naming the
    /// entry, both values and what the entry covers, then `advice`.
    pub fn provenance_mismatch(&self, want: &BTreeMap<String, String>, file: &Path, advice: &str) -> Option<Error> {
        let names: std::collections::BTreeSet<&String> = self.provenance.keys().chain(want.keys()).collect();
        names.into_iter().find_map(|k| {
            let (a, b) = (self.provenance.get(k), want.get(k));
            let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "(none)".into());
            let covers = match k.as_str() {
                "target_config" => "the target's config.json",
                "target_weights" => "the target's weight files",
                "data" => {
                    "the tokenized data: the data files, tokenizer, chat template, special tokens and end-of-turn ids, thinking, system prompt, max_len and the version of the data pipeline's key"
                }
                "layer_ids" => "the target layers tapped",
                _ => "an entry this version does not know",
            };
            (a != b).then(|| {
                Error::field(
                    file,
                    format!("provenance.{k}"),
                    format!("the cache was made from {}, this run uses {} ({covers} differ){advice}", show(a), show(b)),
                )
            })
        })
    }
}

/// Writes `file` through `fill` under a temporary name, syncs, renames, and syncs the folder.
fn write_synced(file: &Path, fill: impl FnOnce(&mut std::io::BufWriter<File>) -> Result<()>) -> Result<()> {
    let tmp = tmp_name(file);
    let mut w = std::io::BufWriter::new(File::create(&tmp).map_err(|e| Error::io(&tmp, e))?);
    fill(&mut w)?;
    let f = w.into_inner().map_err(|e| Error::io(&tmp, e.into_error()))?;
    f.sync_all().map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, file).map_err(|e| Error::io(file, e))?;
    sync_folder(file)
}

/// Syncs the folder holding `file` (a rename is durable only once its folder is): the current
/// folder for a bare file name.
fn sync_folder(file: &Path) -> Result<()> {
    let dir = file.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io(dir, e))
}

fn tmp_name(file: &Path) -> PathBuf {
    let mut name = file.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".tmp");
    file.with_file_name(name)
}

/// One document's entry: its tokens and loss mask, and its features `[len, F*H]` as bf16 bits.
pub struct Entry<'a> {
    pub tokens: &'a [u32],
    pub loss_mask: &'a [bool],
    pub features: &'a [u16],
}

/// Writes a cache, resuming one whose provenance matches.
pub struct FeatureWriter {
    dir: PathBuf,
    pub index: FeatureIndex,
    /// The shard being filled: its first document and its buffers.
    first_doc: usize,
    features: Vec<u16>,
    tokens: Vec<u32>,
    mask: Vec<u8>,
    doc_offsets: Vec<i64>,
    /// Why a listed shard is written again (lost or cut short), to tell the user.
    pub rewritten: Option<String>,
}

impl FeatureWriter {
    /// Opens `dir` for `index` (whose `shards` is ignored): a new cache, or the one there when its
    /// provenance, width and shard size match, continuing after its last complete shard (a listed
    /// shard missing or of another size is written again, with those after it: `rewritten` says
    /// why). Fails, naming the differing entry, when a cache of other provenance is there, or
    /// when another process writes it (its lock, [`crate::lock`]); its own leftover temporary
    /// files are removed.
    pub fn open(dir: &Path, mut index: FeatureIndex) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        crate::lock::lock_folder(dir, "out")?;
        let file = dir.join("index.json");
        index.format = FORMAT.to_string();
        index.shards.clear();
        let old = match file.exists() {
            true => Some(FeatureIndex::read(&file)?),
            false => None,
        };
        let mut rewritten = None;
        // A cache begun with no shard written holds nothing to keep: begun again for this run.
        if let Some(old) = old.filter(|old| !old.shards.is_empty()) {
            if let Some(mismatch) =
                old.provenance_mismatch(&index.provenance, &file, "; choose another --out, or delete this cache")
            {
                return Err(mismatch);
            }
            let differ: Vec<String> = [
                ("hidden_size", old.hidden_size.to_string(), index.hidden_size.to_string()),
                ("layer_ids", format!("{:?}", old.layer_ids), format!("{:?}", index.layer_ids)),
                ("shard_bytes (--shard-gb)", old.shard_bytes.to_string(), index.shard_bytes.to_string()),
                ("documents", old.documents.to_string(), index.documents.to_string()),
                ("tokens", old.tokens.to_string(), index.tokens.to_string()),
            ]
            .into_iter()
            .filter(|(_, then, now)| then != now)
            .map(|(name, then, now)| format!("{name} {then} in the cache, {now} now"))
            .collect();
            if !differ.is_empty() {
                return Err(Error::field(
                    &file,
                    "index",
                    format!("{}: the same options continue it, or choose another --out", differ.join("; ")),
                ));
            }
            index.shards = old.shards;
            // A shard lost or cut short (a crash before the file system kept it, a copy that
            // stopped): it and the shards after it are written again (their contents are a
            // function of the documents and the shard size).
            if let Some(k) = index.shards.iter().position(|s| shard_size_mismatch(dir, s).is_some()) {
                let why = shard_size_mismatch(dir, &index.shards[k]).expect("a mismatch");
                let name = dir.join(&index.shards[k].file);
                for shard in index.shards.drain(k..) {
                    let path = dir.join(&shard.file);
                    match std::fs::remove_file(&path) {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&path, e)),
                        _ => {}
                    }
                }
                let from = index.next_doc();
                rewritten = Some(format!("{}: {why}; writing it again from document {from}", name.display()));
            }
        }
        // The writer's own temporaries only (a shard's, the index's): nothing else of the folder.
        for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
            let path = entry.map_err(|e| Error::io(dir, e))?.path();
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            if name == "index.json.tmp" || (name.starts_with("shard-") && name.ends_with(".safetensors.tmp")) {
                std::fs::remove_file(&path).map_err(|e| Error::io(&path, e))?;
            }
        }
        index.write(dir)?;
        let first_doc = index.next_doc();
        Ok(FeatureWriter {
            dir: dir.to_path_buf(),
            index,
            first_doc,
            features: vec![],
            tokens: vec![],
            mask: vec![],
            doc_offsets: vec![0],
            rewritten,
        })
    }

    /// The next document to push (the first not in a complete shard, then onwards).
    pub fn next_doc(&self) -> usize {
        self.first_doc + self.doc_offsets.len() - 1
    }

    /// Appends the next document; completes the shard once it holds `shard_bytes` of features.
    pub fn push(&mut self, e: Entry) -> Result<()> {
        let (n, fw) = (e.tokens.len(), self.index.feature_width());
        if e.loss_mask.len() != n || e.features.len() != n * fw {
            return Err(Error::field(
                &self.dir,
                format!("document {}", self.next_doc()),
                format!(
                    "{n} tokens, {} mask entries, {} feature values (width {fw})",
                    e.loss_mask.len(),
                    e.features.len()
                ),
            ));
        }
        // bf16 with every exponent bit set: NaN or Inf (a target's non-finite weight).
        if let Some(at) = e.features.iter().position(|&b| b & 0x7f80 == 0x7f80) {
            return Err(Error::field(
                &self.dir,
                format!("document {}", self.next_doc()),
                format!(
                    "the target's features hold NaN or Inf (token {}, value {}): its weights or config",
                    at / fw,
                    at % fw
                ),
            ));
        }
        self.features.extend_from_slice(e.features);
        self.tokens.extend_from_slice(e.tokens);
        self.mask.extend(e.loss_mask.iter().map(|&m| u8::from(m)));
        self.doc_offsets.push(self.tokens.len() as i64);
        if (self.features.len() as u64) * 2 >= self.index.shard_bytes || self.next_doc() == self.index.documents {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes the shard being filled (if any) and lists it in the index.
    fn flush(&mut self) -> Result<()> {
        let docs = self.doc_offsets.len() - 1;
        if docs == 0 {
            return Ok(());
        }
        let name = format!("shard-{:05}.safetensors", self.index.shards.len());
        let path = self.dir.join(&name);
        let mut doc_ids = Vec::with_capacity(self.tokens.len());
        let mut positions = Vec::with_capacity(self.tokens.len());
        for (d, w) in self.doc_offsets.windows(2).enumerate() {
            for p in 0..(w[1] - w[0]) {
                doc_ids.push((self.first_doc + d) as i64);
                positions.push(p as u32);
            }
        }
        let t = self.tokens.len();
        let fw = self.index.feature_width();
        let tensors: Vec<(&str, &str, Vec<usize>, &[u8])> = vec![
            ("features", "BF16", vec![t, fw], bytes(&self.features)),
            ("doc_ids", "I64", vec![t], bytes(&doc_ids)),
            ("doc_offsets", "I64", vec![docs + 1], bytes(&self.doc_offsets)),
            ("tokens", "U32", vec![t], bytes(&self.tokens)),
            ("positions", "U32", vec![t], bytes(&positions)),
            ("loss_mask", "U8", vec![t], &self.mask),
        ];
        let file_bytes =
            write_safetensors(&path, &tensors, &[("format", FORMAT), ("first_doc", &self.first_doc.to_string())])?;
        self.index.shards.push(ShardEntry {
            file: name,
            first_doc: self.first_doc,
            docs,
            tokens: t as u64,
            bytes: file_bytes,
        });
        self.index.write(&self.dir)?;
        self.first_doc += docs;
        self.features.clear();
        self.tokens.clear();
        self.mask.clear();
        self.doc_offsets = vec![0];
        Ok(())
    }

    /// Completes the last shard; the cache must hold every document.
    pub fn finish(mut self) -> Result<FeatureIndex> {
        self.flush()?;
        if !self.index.complete() {
            return Err(Error::field(
                self.dir.join("index.json"),
                "documents",
                format!("{} of {} documents written", self.index.next_doc(), self.index.documents),
            ));
        }
        Ok(self.index)
    }
}

fn bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data values viewed as their bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// Writes a safetensors file (8-aligned header, tensors in the given order) under a temporary
/// name, synced and renamed; its size.
fn write_safetensors(path: &Path, tensors: &[(&str, &str, Vec<usize>, &[u8])], meta: &[(&str, &str)]) -> Result<u64> {
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        serde_json::Value::Object(meta.iter().map(|(k, v)| (k.to_string(), (*v).into())).collect()),
    );
    let mut offset = 0usize;
    for (name, dtype, shape, data) in tensors {
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + data.len()]}),
        );
        offset += data.len();
    }
    let mut text = serde_json::to_string(&header).map_err(|e| Error::field(path, "header", e.to_string()))?;
    while (8 + text.len()) % 8 != 0 {
        text.push(' ');
    }
    let tmp = tmp_name(path);
    let mut f = std::io::BufWriter::new(File::create(&tmp).map_err(|e| Error::io(&tmp, e))?);
    let io = |e| Error::io(&tmp, e);
    f.write_all(&(text.len() as u64).to_le_bytes()).map_err(io)?;
    f.write_all(text.as_bytes()).map_err(io)?;
    for (_, _, _, data) in tensors {
        f.write_all(data).map_err(io)?;
    }
    let f = f.into_inner().map_err(|e| Error::io(&tmp, e.into_error()))?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
    sync_folder(path)?;
    Ok((8 + text.len() + offset) as u64)
}

/// Bytes free for an unprivileged writer on the file system holding `dir` (or its nearest
/// existing ancestor).
pub fn free_bytes(dir: &Path) -> Result<u64> {
    let mut at = dir;
    while !at.exists() {
        at = at.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    }
    let c = std::ffi::CString::new(at.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::field(at, "path", "contains a NUL byte"))?;
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a statvfs struct to fill.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(Error::io(at, std::io::Error::last_os_error()));
    }
    Ok(s.f_bavail as u64 * s.f_frsize as u64)
}

/// Why `shard`'s file is not the one the index lists: missing, or of another size.
fn shard_size_mismatch(dir: &Path, shard: &ShardEntry) -> Option<String> {
    match std::fs::metadata(dir.join(&shard.file)) {
        Err(e) => Some(format!("cannot be read ({e})")),
        Ok(m) if m.len() != shard.bytes => {
            Some(format!("{} bytes but the index lists {} (truncated or rewritten)", m.len(), shard.bytes))
        }
        Ok(_) => None,
    }
}

fn check_shard_size(dir: &Path, shard: &ShardEntry) -> Result<()> {
    match shard_size_mismatch(dir, shard) {
        Some(why) => Err(Error::field(
            dir.join(&shard.file),
            "size",
            format!("{why}; rerun `cargo xtask features` with this cache's options to write it again"),
        )),
        None => Ok(()),
    }
}

/// One shard, memory-mapped, with its tensors located.
struct Shard {
    map: memmap2::Mmap,
    first_doc: usize,
    /// Byte ranges of each tensor in `map`.
    features: (usize, usize),
    tokens: (usize, usize),
    mask: (usize, usize),
    doc_offsets: Vec<i64>,
}

/// A complete cache, opened by mmap: each document's tokens, mask and features.
pub struct FeatureCache {
    pub dir: PathBuf,
    pub index: FeatureIndex,
    shards: Vec<Shard>,
}

/// One cached document.
pub struct CachedDoc<'a> {
    pub tokens: Vec<u32>,
    pub loss_mask: Vec<bool>,
    /// `[len, F*H]` bf16 bits.
    pub features: &'a [u16],
}

impl FeatureCache {
    /// Opens the complete cache in `dir`, checking every shard's size and header; with `want`,
    /// also that its provenance is the run's (naming the first entry that differs).
    pub fn open(dir: &Path, want: Option<&BTreeMap<String, String>>) -> Result<Self> {
        let file = dir.join("index.json");
        let index = FeatureIndex::read(&file)?;
        let advice = "; make this run's cache with `cargo xtask features` (to another --out, or delete this one)";
        if let Some(mismatch) = want.and_then(|w| index.provenance_mismatch(w, &file, advice)) {
            return Err(mismatch);
        }
        if !index.complete() {
            return Err(Error::field(
                &file,
                "shards",
                format!(
                    "{} of {} documents written; rerun `xtask features` to finish it",
                    index.next_doc(),
                    index.documents
                ),
            ));
        }
        let shards = index.shards.iter().map(|s| open_shard(dir, s, index.feature_width())).collect::<Result<_>>()?;
        Ok(FeatureCache { dir: dir.to_path_buf(), index, shards })
    }

    /// Number of documents.
    pub fn len(&self) -> usize {
        self.index.documents
    }

    pub fn is_empty(&self) -> bool {
        self.index.documents == 0
    }

    /// Document `i`.
    pub fn doc(&self, i: usize) -> Result<CachedDoc<'_>> {
        let s = self
            .shards
            .iter()
            .find(|s| i >= s.first_doc && i < s.first_doc + s.doc_offsets.len() - 1)
            .ok_or_else(|| Error::field(&self.dir, "documents", format!("no document {i} (of {})", self.len())))?;
        let d = i - s.first_doc;
        let (a, b) = (s.doc_offsets[d] as usize, s.doc_offsets[d + 1] as usize);
        let fw = self.index.feature_width();
        let slice =
            |(lo, _): (usize, usize), from: usize, to: usize, width: usize| &s.map[lo + from * width..lo + to * width];
        let tokens = slice(s.tokens, a, b, 4).chunks(4).map(|c| u32::from_le_bytes(c.try_into().expect("4"))).collect();
        let loss_mask = slice(s.mask, a, b, 1).iter().map(|&m| m != 0).collect();
        let raw = slice(s.features, a * fw, b * fw, 2);
        if !(raw.as_ptr() as usize).is_multiple_of(2) {
            return Err(Error::field(&self.dir, "features", "not 2-byte aligned in its shard"));
        }
        // SAFETY: `raw` is 2-byte aligned (checked) and holds whole u16 values.
        let features = unsafe { std::slice::from_raw_parts(raw.as_ptr() as *const u16, raw.len() / 2) };
        Ok(CachedDoc { tokens, loss_mask, features })
    }
}

fn open_shard(dir: &Path, entry: &ShardEntry, fw: usize) -> Result<Shard> {
    check_shard_size(dir, entry)?;
    let path = dir.join(&entry.file);
    let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
    // SAFETY: the cache's files are written once (temporary name, then rename) and never modified.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
    let bad = |m: String| Error::field(&path, "header", m);
    let n = u64::from_le_bytes(map.get(..8).ok_or_else(|| bad("shorter than 8 bytes".into()))?.try_into().expect("8"))
        as usize;
    let data = n.checked_add(8).filter(|&d| d <= map.len()).ok_or_else(|| bad("truncated".into()))?;
    let header: serde_json::Value = serde_json::from_slice(&map[8..data]).map_err(|e| bad(e.to_string()))?;
    // A tensor's byte range: inside the file and exactly its shape's size in its dtype.
    let locate = |name: &str, dtype: &str, width: usize, shape: &[usize]| -> Result<(usize, usize)> {
        let t = &header[name];
        if t["dtype"] != dtype || t["shape"] != serde_json::json!(shape) {
            return Err(bad(format!("tensor `{name}`: {} {}, expected {dtype} {shape:?}", t["dtype"], t["shape"])));
        }
        let off = |i: usize| t["data_offsets"][i].as_u64().and_then(|o| usize::try_from(o).ok()?.checked_add(data));
        let bytes = shape.iter().try_fold(width, |acc, &d| acc.checked_mul(d));
        match (off(0), off(1)) {
            (Some(a), Some(b)) if a <= b && b <= map.len() && Some(b - a) == bytes => Ok((a, b)),
            (Some(a), Some(b)) if a <= b && b <= map.len() => Err(bad(format!(
                "tensor `{name}`: data offsets span {} bytes, its shape {shape:?} of {dtype} needs {}",
                b - a,
                bytes.map_or("more than the address space".into(), |n| n.to_string())
            ))),
            _ => Err(bad(format!("tensor `{name}`: data offsets outside the file"))),
        }
    };
    let (t, docs) = (entry.tokens as usize, entry.docs);
    let offsets = locate("doc_offsets", "I64", 8, &[docs + 1])?;
    let doc_offsets: Vec<i64> =
        map[offsets.0..offsets.1].chunks(8).map(|c| i64::from_le_bytes(c.try_into().expect("8"))).collect();
    if doc_offsets.first() != Some(&0)
        || doc_offsets.last() != Some(&(t as i64))
        || doc_offsets.windows(2).any(|w| w[0] > w[1])
    {
        return Err(bad("doc_offsets are not increasing from 0 to the token count".into()));
    }
    Ok(Shard {
        features: locate("features", "BF16", 2, &[t, fw])?,
        tokens: locate("tokens", "U32", 4, &[t])?,
        mask: locate("loss_mask", "U8", 1, &[t])?,
        doc_offsets,
        first_doc: entry.first_doc,
        map,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use sha2::Digest;

    fn random_bytes(rng: &mut rand_chacha::ChaCha8Rng, n: usize) -> Vec<u8> {
        (0..n).map(|_| rng.random()).collect()
    }

    /// The weights' hash covers every shard's bytes (a cache of another checkpoint of the same
    /// architecture, whose index is identical, is another provenance), each shard once; a single
    /// `model.safetensors` hashes as its own sha256.
    #[test]
    fn the_weights_hash_covers_every_shard() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::rng().random());
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path();
        std::fs::write(t.join("config.json"), b"{}").unwrap();
        let index = r#"{"metadata": {}, "weight_map": {"a": "m-2.safetensors", "b": "m-1.safetensors", "c": "m-2.safetensors"}}"#;
        std::fs::write(t.join("model.safetensors.index.json"), index).unwrap();
        let (one, two) = (random_bytes(&mut rng, 5000), random_bytes(&mut rng, 3000));
        std::fs::write(t.join("m-1.safetensors"), &one).unwrap();
        std::fs::write(t.join("m-2.safetensors"), &two).unwrap();
        let key = [3u8; 32];
        let sharded = provenance(t, &[1, 2], &key).unwrap();
        let expected = hex(&sha2::Sha256::new().chain_update(&one).chain_update(&two).finalize());
        assert_eq!(sharded["target_weights"], expected, "the shards in name order, each once");

        let mut changed = two.clone();
        changed[1234] ^= 1;
        std::fs::write(t.join("m-2.safetensors"), &changed).unwrap();
        assert_ne!(provenance(t, &[1, 2], &key).unwrap()["target_weights"], sharded["target_weights"]);

        std::fs::remove_file(t.join("model.safetensors.index.json")).unwrap();
        std::fs::write(t.join("model.safetensors"), &one).unwrap();
        let single = provenance(t, &[1, 2], &key).unwrap();
        assert_eq!(single["target_weights"], hex(&sha2::Sha256::digest(&one)));

        std::fs::write(t.join("model.safetensors.index.json"), r#"{"weight_map": {"a": 3}}"#).unwrap();
        let err = provenance(t, &[1, 2], &key).unwrap_err().to_string();
        assert!(err.contains("model.safetensors.index.json") && err.contains("weight_map.a"), "{err}");
    }
}
