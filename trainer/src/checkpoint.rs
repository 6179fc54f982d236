//! Checkpoints: `OUT/checkpoint-<step>/` holds the servable drafter (spec section 8:
//! `config.json` + `model.safetensors` in bf16 with the spec's key names) and the training
//! state of exact resumption: `training/training.safetensors` (fp32 master weights
//! `master.NAME`, AdamW moments `adam_m.NAME` / `adam_v.NAME`; in a folder of its own, since
//! vLLM and MLX load every `*.safetensors` beside `config.json` and refuse names they do not
//! know), `run.toml` (the resolved config) and `state.json`
//! (step, AdamW's step count, the data order, the RNG state, counters, provenance hashes and the
//! sha256 of every other file). `state.json` is written last and is the completion marker: a
//! folder without it, or whose files do not match its hashes, is never loaded.
//!
//! Writing: everything goes into `OUT/.checkpoint-<step>.tmp/`, each file synced; the folder is
//! synced and renamed, the parent synced; then `OUT/latest` (the folder's name) is replaced
//! atomically; only then are checkpoints beyond `keep_checkpoints` deleted.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use dflash_reference::config::DraftConfig;
use dflash_reference::data::TrainRow;
use dflash_reference::io::{save_safetensors, write_atomically};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::RunConfig;
use crate::engine::EngineState;
use crate::error::{Error, Result};

/// Version of the checkpoint layout written (format 1, read too, held the training state
/// beside the servable files).
pub const FORMAT: u32 = 2;

/// The training state's file in a checkpoint of `format` (1 or 2), relative to its folder.
pub fn training_file(format: u32) -> &'static str {
    match format {
        1 => "training.safetensors",
        _ => "training/training.safetensors",
    }
}

/// Test-only hook: when set to a number of milliseconds, checkpoint writing sleeps that long
/// between files, so that a test can kill the process while a checkpoint is half-written.
pub const PAUSE_ENV: &str = "DFLASH_TEST_PAUSE_IN_CHECKPOINT";

/// The state of a ChaCha8 generator: seed, stream and position in the stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    /// The 32-byte seed, hex.
    pub seed: String,
    pub stream: u64,
    /// The word position (u128), decimal.
    pub word_pos: String,
}

impl RngState {
    pub fn of(rng: &ChaCha8Rng) -> Self {
        RngState {
            seed: rng.get_seed().iter().map(|b| format!("{b:02x}")).collect(),
            stream: rng.get_stream(),
            word_pos: rng.get_word_pos().to_string(),
        }
    }

    /// The generator in exactly this state.
    pub fn restore(&self) -> std::result::Result<ChaCha8Rng, String> {
        if self.seed.len() != 64 {
            return Err(format!("rng seed `{}` is not 64 hex digits", self.seed));
        }
        let mut seed = [0u8; 32];
        for (i, byte) in seed.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&self.seed[2 * i..2 * i + 2], 16)
                .map_err(|_| format!("rng seed `{}` is not hex", self.seed))?;
        }
        let word_pos: u128 = self.word_pos.parse().map_err(|_| format!("rng word_pos `{}`", self.word_pos))?;
        let mut rng = ChaCha8Rng::from_seed(seed);
        rng.set_stream(self.stream);
        rng.set_word_pos(word_pos);
        Ok(rng)
    }
}

/// Where the run is in its data and counters: everything but the tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    pub format: u32,
    /// Steps done (the next step's index).
    pub step: usize,
    /// AdamW updates done (steps minus skipped ones).
    pub adam_t: i32,
    /// Shuffles of the data order done so far (the epoch in progress, 1-based once started).
    pub epoch: usize,
    /// Position in `order` of the next row.
    pub cursor: usize,
    /// The current epoch's permutation of the training rows.
    pub order: Vec<usize>,
    /// The generator of the data order and the anchors.
    pub rng: RngState,
    pub nonfinite_in_a_row: usize,
    pub nonfinite_total: usize,
    /// sha256 of the resolved config's TOML and of the training rows ([`data_sha256`]).
    pub config_sha256: String,
    pub data_sha256: String,
    /// sha256 of every other file of the checkpoint.
    pub files: BTreeMap<String, String>,
    /// The processes the run had (`world_size`; absent in checkpoints from before it was kept),
    /// which `run.toml` leaves out: a resumption on another count sums in other groups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processes: Option<usize>,
}

/// sha256 of `bytes`, hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// sha256 of a file's bytes, hex, read in blocks (a large drafter's training state is many GB).
fn file_sha256(file: &Path) -> Result<String> {
    let mut h = Sha256::new();
    let mut f = std::fs::File::open(file).map_err(|e| Error::io(file, e))?;
    std::io::copy(&mut f, &mut h).map_err(|e| Error::io(file, e))?;
    Ok(hex(&h.finalize()))
}

/// sha256 over every training row's tokens, loss mask, document ids, positions and features.
pub fn data_sha256(rows: &[TrainRow]) -> Result<String> {
    let mut h = Sha256::new();
    h.update((rows.len() as u64).to_le_bytes());
    for row in rows {
        h.update((row.len() as u64).to_le_bytes());
        row.tokens.iter().for_each(|t| h.update(t.to_le_bytes()));
        row.loss_mask.iter().for_each(|&m| h.update([u8::from(m)]));
        if let Some(docs) = &row.doc_ids {
            docs.iter().for_each(|d| h.update(d.to_le_bytes()));
        }
        row.positions.iter().for_each(|p| h.update((*p as u64).to_le_bytes()));
        let features = row.features.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        features.iter().for_each(|f| h.update(f.to_le_bytes()));
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The folder name of the checkpoint after `step` steps.
pub fn folder_name(step: usize) -> String {
    format!("checkpoint-{step}")
}

/// The step of a `checkpoint-<step>` folder name.
pub fn parse_folder_name(name: &str) -> Option<usize> {
    name.strip_prefix("checkpoint-")?.parse().ok()
}

fn pause() {
    if let Some(ms) = std::env::var(PAUSE_ENV).ok().and_then(|v| v.parse::<u64>().ok()) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

fn sync_path(path: &Path) -> Result<()> {
    std::fs::File::open(path).and_then(|f| f.sync_all()).map_err(|e| Error::io(path, e))
}

/// Writes the servable drafter folder into `dir` (existing): `config.json` and
/// `model.safetensors` in bf16 with the spec's keys, each synced.
pub fn write_servable(dir: &Path, config: &DraftConfig, state: &EngineState) -> Result<()> {
    config.save(&dir.join("config.json"), DType::BF16)?;
    pause();
    let tensors = state
        .names
        .iter()
        .zip(&state.params)
        .map(|(n, t)| Ok((n.clone(), t.to_dtype(DType::BF16)?)))
        .collect::<Result<HashMap<_, _>>>()?;
    let model = dir.join("model.safetensors");
    save_safetensors(&model, &tensors)?;
    sync_path(&model)
}

/// Writes `dir` as a complete servable drafter folder, atomically (a temporary folder renamed).
pub fn save_servable_folder(dir: &Path, config: &DraftConfig, state: &EngineState) -> Result<()> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = parent.join(format!(".{name}.tmp"));
    remove_dir_if_exists(&tmp)?;
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    write_servable(&tmp, config, state)?;
    sync_path(&tmp)?;
    remove_dir_if_exists(dir)?;
    std::fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))?;
    sync_path(parent)
}

fn remove_dir_if_exists(dir: &Path) -> Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(dir, e)),
        _ => Ok(()),
    }
}

/// Writes the checkpoint after `state.step` steps into `out`, points `OUT/latest` at it and
/// deletes the checkpoints beyond the newest `keep`. Returns its folder.
pub fn write_checkpoint(
    out: &Path,
    draft_config: &DraftConfig,
    engine: &EngineState,
    mut state: TrainState,
    config: &RunConfig,
    keep: usize,
) -> Result<PathBuf> {
    let name = folder_name(state.step);
    let tmp = out.join(format!(".{name}.tmp"));
    remove_dir_if_exists(&tmp)?;
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    write_servable(&tmp, draft_config, engine)?;
    pause();
    let mut tensors = HashMap::new();
    for (i, n) in engine.names.iter().enumerate() {
        tensors.insert(format!("master.{n}"), engine.params[i].to_dtype(DType::F32)?);
        tensors.insert(format!("adam_m.{n}"), engine.m[i].to_dtype(DType::F32)?);
        tensors.insert(format!("adam_v.{n}"), engine.v[i].to_dtype(DType::F32)?);
    }
    let training = tmp.join(training_file(FORMAT));
    let training_dir = training.parent().unwrap_or(&tmp);
    std::fs::create_dir_all(training_dir).map_err(|e| Error::io(training_dir, e))?;
    save_safetensors(&training, &tensors)?;
    sync_path(&training)?;
    sync_path(training_dir)?;
    pause();
    let toml = config.to_toml();
    write_atomically(&tmp.join("run.toml"), |f| f.write_all(toml.as_bytes()))?;
    pause();
    state.format = FORMAT;
    state.files.clear();
    for file in ["config.json", "model.safetensors", training_file(FORMAT), "run.toml"] {
        state.files.insert(file.into(), file_sha256(&tmp.join(file))?);
    }
    let json = serde_json::to_string_pretty(&state).map_err(|e| Error::checkpoint(&tmp, e.to_string()))?;
    write_atomically(&tmp.join("state.json"), |f| f.write_all(json.as_bytes()))?;
    sync_path(&tmp)?;
    let dir = out.join(&name);
    // A folder of this step left by a run that was killed after writing it and before `latest`.
    remove_dir_if_exists(&dir)?;
    std::fs::rename(&tmp, &dir).map_err(|e| Error::io(&dir, e))?;
    sync_path(out)?;
    write_atomically(&out.join("latest"), |f| f.write_all(format!("{name}\n").as_bytes()))?;
    sync_path(out)?;
    // The newest `keep`, this one first. A folder of a later step is not of this run's past (a
    // checkpoint that was not usable when it resumed from an earlier one): it goes too.
    let mut older: Vec<(usize, PathBuf)> =
        list_checkpoints(out)?.into_iter().filter(|(s, _)| *s != state.step).collect();
    older.sort_by_key(|c| std::cmp::Reverse(c.0));
    let later = older.iter().take_while(|(s, _)| *s > state.step).count();
    for (i, (_, old)) in older.into_iter().enumerate() {
        if i < later || i >= later + keep.saturating_sub(1) {
            remove_dir_if_exists(&old)?;
        }
    }
    Ok(dir)
}

/// The `checkpoint-<step>` folders of `out` (complete or not), unsorted.
pub fn list_checkpoints(out: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let entries = match std::fs::read_dir(out) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(out, e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(out, e))?;
        if let Some(step) = entry.file_name().to_str().and_then(parse_folder_name) {
            if entry.path().is_dir() {
                found.push((step, entry.path()));
            }
        }
    }
    Ok(found)
}

/// Leftover `.checkpoint-*.tmp` folders of `out` (checkpoints a killed run did not finish).
pub fn leftover_temporaries(out: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(out)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    name.starts_with(".checkpoint-") && name.ends_with(".tmp")
                })
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Reads `dir`'s `state.json` and checks every file it lists against its sha256; an error says
/// what is missing or corrupt.
pub fn verify(dir: &Path) -> Result<TrainState> {
    if !dir.is_dir() {
        return Err(Error::checkpoint(dir, "no such folder"));
    }
    let state_file = dir.join("state.json");
    let text = std::fs::read_to_string(&state_file)
        .map_err(|_| Error::checkpoint(dir, "no state.json (the checkpoint was not completed)"))?;
    let state: TrainState = serde_json::from_str(&text)
        .map_err(|e| Error::checkpoint(dir, format!("state.json is not a valid checkpoint state: {e}")))?;
    if !(1..=FORMAT).contains(&state.format) {
        return Err(Error::checkpoint(dir, format!("format {} (this trainer reads 1 to {FORMAT})", state.format)));
    }
    for file in ["config.json", "model.safetensors", training_file(state.format), "run.toml"] {
        let expected =
            state.files.get(file).ok_or_else(|| Error::checkpoint(dir, format!("state.json lists no {file}")))?;
        let path = dir.join(file);
        if !path.exists() {
            return Err(Error::checkpoint(dir, format!("{file} is missing")));
        }
        if &file_sha256(&path)? != expected {
            return Err(Error::checkpoint(dir, format!("{file} does not match its sha256 in state.json (corrupt)")));
        }
    }
    if state.step != dir.file_name().and_then(|n| n.to_str()).and_then(parse_folder_name).unwrap_or(usize::MAX) {
        return Err(Error::checkpoint(dir, format!("state.json is for step {}, not this folder's", state.step)));
    }
    if usize::try_from(state.adam_t).map_or(true, |t| t > state.step) {
        return Err(Error::checkpoint(
            dir,
            format!("state.json's adam_t {} is not an update count of {} steps", state.adam_t, state.step),
        ));
    }
    Ok(state)
}

/// A checkpoint chosen for resumption, with what was said about the others.
pub struct Found {
    pub dir: PathBuf,
    pub state: TrainState,
    /// Why `latest` or newer folders were not used (empty when `latest` was used).
    pub notes: Vec<String>,
}

/// Refuses a folder in `OUT/latest`'s place: the next checkpoint could not replace it, and its
/// checkpoints may be complete (neither resumed past nor replaced).
pub fn check_latest(out: &Path) -> Result<()> {
    match out.join("latest").is_dir() {
        true => {
            Err(Error::checkpoint(out, "`latest` is a folder, not the file naming the newest checkpoint: remove it"))
        }
        false => Ok(()),
    }
}

/// The checkpoint `OUT/latest` names if it is complete (or a complete one of a later step: a
/// run stopped between writing it and updating `latest`); otherwise the newest complete one (the
/// notes say why). Leftover `.tmp` folders are never considered.
pub fn find_resumable(out: &Path) -> Result<Found> {
    if !out.is_dir() {
        return Err(Error::checkpoint(
            out,
            "no such folder: `--resume` takes a run's --out (on several machines every rank reads rank 0's, \
             so it must be on a filesystem they share)",
        ));
    }
    let mut notes = Vec::new();
    let latest = out.join("latest");
    check_latest(out)?;
    match std::fs::read_to_string(&latest) {
        Ok(text) => {
            let name = text.trim();
            if parse_folder_name(name).is_none() {
                notes.push(format!("{}: `{name}` is not a checkpoint folder name", latest.display()));
            } else {
                let dir = out.join(name);
                match verify(&dir) {
                    Ok(state) => {
                        let mut later: Vec<(usize, PathBuf)> =
                            list_checkpoints(out)?.into_iter().filter(|(s, _)| *s > state.step).collect();
                        later.sort_by_key(|c| std::cmp::Reverse(c.0));
                        for (_, newer) in later {
                            if let Ok(state) = verify(&newer) {
                                notes.push(format!(
                                    "{} is complete and newer than {name}, which {} names (the run stopped before updating it)",
                                    newer.display(),
                                    latest.display()
                                ));
                                return Ok(Found { dir: newer, state, notes });
                            }
                        }
                        return Ok(Found { dir, state, notes });
                    }
                    Err(e) => notes.push(format!("{} names {name}, which is not usable: {e}", latest.display())),
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => notes.push(format!("{} is missing", latest.display())),
        Err(e) => notes.push(format!("{} is not readable: {e}", latest.display())),
    }
    let mut all = list_checkpoints(out)?;
    all.sort_by_key(|c| std::cmp::Reverse(c.0));
    for (_, dir) in all {
        match verify(&dir) {
            Ok(state) => {
                notes.push(format!("falling back to {}, the newest complete checkpoint", dir.display()));
                return Ok(Found { dir, state, notes });
            }
            Err(e) => notes.push(format!("skipping {e}")),
        }
    }
    Err(Error::checkpoint(
        out,
        format!(
            "no complete checkpoint to resume from ({}); a fresh run in this folder (`--overwrite` for a real run) replaces it",
            notes.join("; ")
        ),
    ))
}

/// The resolved config a checkpoint was written with (its `run.toml`).
pub fn load_config(dir: &Path) -> Result<RunConfig> {
    let file = dir.join("run.toml");
    let text = std::fs::read_to_string(&file).map_err(|e| Error::io(&file, e))?;
    toml::from_str(&text).map_err(|e| Error::ConfigFile { file, message: e.to_string() })
}

/// The engine state of the checkpoint `found`: master weights and moments of `names`, and its
/// `adam_t`.
pub fn load_engine_state(found: &Found, names: &[String]) -> Result<EngineState> {
    let (dir, name) = (&found.dir, training_file(found.state.format));
    let tensors = candle_core::safetensors::load(dir.join(name), &Device::Cpu)
        .map_err(|e| Error::checkpoint(dir, format!("{name}: {e}")))?;
    let get = |key: String| -> Result<Tensor> {
        tensors.get(&key).cloned().ok_or_else(|| Error::checkpoint(dir, format!("{name} has no `{key}`")))
    };
    let t = found.state.adam_t;
    let mut state = EngineState { names: names.to_vec(), params: Vec::new(), m: Vec::new(), v: Vec::new(), t };
    for n in names {
        state.params.push(get(format!("master.{n}"))?);
        state.m.push(get(format!("adam_m.{n}"))?);
        state.v.push(get(format!("adam_v.{n}"))?);
    }
    Ok(state)
}
