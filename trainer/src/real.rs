//! A real run's setup: the user's target folder and jsonl data (and optionally a feature cache)
//! to the drafter's config and the rows, every file and cross-file contract checked before any
//! device work: the target's config, the drafter against it (hidden size, heads, vocab, layer
//! ids, mask token), the mask token absent from the data, the cache's provenance and layers.

use std::collections::BTreeMap;
use std::path::PathBuf;

use candle_core::DType;
use dflash_data::epoch::epoch_order;
use dflash_data::features::{provenance, FeatureCache};
use dflash_data::mask::RenderOptions;
use dflash_data::target::TargetTokenizer;
use dflash_data::{DataOptions, Dataset, HeldOut};
use dflash_optimized::backend::Backend;
use dflash_optimized::memory::hybrid::hybrid_drafter;
use dflash_optimized::model::hybrid_forward::HybridForward;
use dflash_optimized::model::target_forward::TargetForward;
use dflash_optimized::model::TargetFeatures;
use dflash_reference::config::{training_target_layer_ids, DraftConfig};
use dflash_reference::io::WeightSet;
use dflash_reference::target::TargetKind;

use crate::config::RunConfig;
use crate::error::{Error, Result};
use crate::rows::{DataRows, RowFeatures};

/// Features the spec's recipe draws from the target (spec section 1).
pub const DEFAULT_NUM_FEATURES: usize = 5;

/// Everything a real run reads, checked.
pub struct RealSetup {
    pub target_dir: PathBuf,
    /// The target's config: dense (Qwen3, Llama) or a Qwen3.5/3.6 hybrid.
    pub target_config: TargetKind,
    pub draft_config: DraftConfig,
    pub tokenizer: TargetTokenizer,
    pub dataset: Dataset,
    /// What the features are made from (`dflash_data::features::provenance`).
    pub provenance: BTreeMap<String, String>,
    /// The offline cache (`features`), provenance checked.
    pub cache: Option<FeatureCache>,
    /// Lines for the terminal (how the mask token and layers were chosen).
    pub notes: Vec<String>,
}

fn data_error(e: dflash_data::Error) -> Error {
    Error::option("data", e.to_string())
}

/// The data pipeline's options of `c`.
pub fn data_options(c: &RunConfig) -> DataOptions {
    let held_out = match c.held_out.parse::<f64>() {
        Ok(f) => HeldOut::Fraction(f),
        Err(_) => HeldOut::Files(vec![PathBuf::from(&c.held_out)]),
    };
    DataOptions {
        render: RenderOptions { thinking: c.thinking, system_prompt: c.system_prompt.clone() },
        max_len: c.max_len,
        packing: c.packing,
        held_out,
        seed: c.seed,
        progress: true,
        ..DataOptions::new(c.data_cache.clone().unwrap_or_else(|| c.out.join("data-cache")))
    }
}

/// Reads and checks the target folder, then `devices` (the run's devices exist), then the data
/// (tokenized once, then cached) and the feature cache of `c` (validated, with `target` set).
pub fn prepare(c: &RunConfig, devices: impl FnOnce() -> Result<()>) -> Result<RealSetup> {
    let target_dir = c.target.clone().ok_or_else(|| Error::option("target", "not set"))?;
    if !target_dir.is_dir() {
        return Err(Error::option("target", format!("{}: not a folder", target_dir.display())));
    }
    let config_file = target_dir.join("config.json");
    let target_config = TargetKind::from_file(&config_file)?;
    // A target known by its sizes only (an MoE): its features from a cache, no real tau.
    if let TargetKind::Dense(t) = &target_config {
        let refuse =
            |option: &str, what: &str| t.check_runs_here(what).map_err(|e| Error::option(option, e.to_string()));
        if c.features.is_none() {
            refuse("features", "training without `--features`")?;
        }
        if c.tau_prompts > 0 {
            refuse("tau_prompts", "the real tau")?;
        }
    }
    let layers = target_config.num_layers();
    target_config.check_row_len(c.max_len, &config_file).map_err(|why| Error::option("max_len", why))?;
    // The real tau decodes a prompt of a token at least, then up to `tau_tokens` and a block.
    let max = target_config.max_positions();
    if c.tau_prompts > 0 && c.tau_tokens.saturating_add(c.block_size) > max {
        return Err(Error::option(
            "tau_tokens",
            format!(
                "{}: with a block of {} past a prompt, beyond the target's {max} positions ({})",
                c.tau_tokens,
                c.block_size,
                config_file.display()
            ),
        ));
    }
    let mut notes = Vec::new();
    notes.extend(unused_note(&target_config.check_checkpoint(&target_dir)?));

    let cache_index = match &c.features {
        Some(dir) => {
            let features = |e: dflash_data::Error| Error::option("features", e.to_string());
            let index = dflash_data::features::FeatureIndex::read(&dir.join("index.json")).map_err(features)?;
            index.check_early(dir, &target_dir, target_config.hidden_size()).map_err(features)?;
            Some(index)
        }
        None => None,
    };
    let layer_ids = match (&c.target_layer_ids, &cache_index) {
        (Some(ids), Some(index)) if ids != &index.layer_ids => {
            return Err(Error::option(
                "target_layer_ids",
                format!("{ids:?}, but the feature cache holds layers {:?}", index.layer_ids),
            ))
        }
        (Some(ids), _) => ids.clone(),
        (None, Some(index)) => index.layer_ids.clone(),
        (None, None) => training_target_layer_ids(layers, DEFAULT_NUM_FEATURES),
    };
    dflash_reference::config::check_feature_layers(&layer_ids, layers)
        .map_err(|e| Error::option("target_layer_ids", format!("{e} ({})", config_file.display())))?;

    let tokenizer = TargetTokenizer::load(&target_dir).map_err(|e| Error::option("target", e.to_string()))?;
    let vocab = target_config.vocab_size();
    let mask = match c.mask_token_id {
        Some(id) => id,
        None => {
            let id = tokenizer.ids_end;
            if id >= vocab {
                return Err(Error::option(
                    "mask_token_id",
                    format!(
                        "the tokenizer uses every id of the target's vocab ({vocab}): set --mask-token-id to a token the data never holds"
                    ),
                ));
            }
            notes.push(format!("mask token: id {id}, the first past the tokenizer's vocabulary"));
            id as u32
        }
    };
    let mut draft_config = match &target_config {
        TargetKind::Dense(t) => DraftConfig::for_target(t, c.draft_layers, c.block_size, mask, layer_ids.len()),
        TargetKind::Hybrid(t) => {
            notes.push(
                "drafter: a Qwen3-layout stack of heads of 128 for the hybrid target (spec section 10): the last layer full, the others sliding (window 2048), RoPE theta 1e7"
                    .to_string(),
            );
            hybrid_drafter(t, (c.draft_layers, c.block_size, layer_ids.len()), mask)
                .map_err(|e| Error::option("target", e.to_string()))?
        }
    };
    draft_config.target_layer_ids = layer_ids.clone();
    target_config.check_drafter(&draft_config)?;

    devices()?;
    let files: Vec<PathBuf> = c.data.clone();
    let dataset = Dataset::prepare(&tokenizer, &files, &data_options(c)).map_err(data_error)?;
    if let Some(doc) =
        (0..dataset.cache.len()).find(|&i| dataset.cache.document(i).is_ok_and(|d| d.tokens.contains(&mask)))
    {
        return Err(Error::option(
            "mask_token_id",
            format!(
                "{mask} occurs in the data (document {doc} of {}): the drafter's mask token must never be a real token",
                dataset.cache.len()
            ),
        ));
    }
    let provenance =
        provenance(&target_dir, &layer_ids, &dataset.cache.key).map_err(|e| Error::option("target", e.to_string()))?;
    let cache = match &c.features {
        Some(dir) => {
            let cache =
                FeatureCache::open(dir, Some(&provenance)).map_err(|e| Error::option("features", e.to_string()))?;
            if cache.index.hidden_size != target_config.hidden_size() {
                return Err(Error::option(
                    "features",
                    format!(
                        "{}: hidden size {}, the target's is {}",
                        dir.display(),
                        cache.index.hidden_size,
                        target_config.hidden_size()
                    ),
                ));
            }
            if cache.len() != dataset.cache.len() {
                return Err(Error::option(
                    "features",
                    format!("{}: {} documents, the data has {}", dir.display(), cache.len(), dataset.cache.len()),
                ));
            }
            Some(cache)
        }
        None => None,
    };
    Ok(RealSetup { target_dir, target_config, draft_config, tokenizer, dataset, provenance, cache, notes })
}

impl RealSetup {
    /// The training rows (the documents in the order of the data set's epoch 0, packed once)
    /// and up to `c.eval_rows` held-out rows (none when nothing is held out), with features from
    /// `features` (the cache's when the run has one).
    pub fn rows<'a>(
        &'a self,
        c: &RunConfig,
        features: impl Fn() -> RowFeatures<'a>,
    ) -> Result<(DataRows<'a>, Option<DataRows<'a>>)> {
        let order = epoch_order(&self.dataset.train, self.dataset.seed, 0);
        let train = DataRows::new(&self.dataset, &order, c.max_len, usize::MAX, features(), self.provenance.clone())?;
        let held = match self.dataset.held_out.is_empty() {
            true => None,
            false => Some(DataRows::new(
                &self.dataset,
                &self.dataset.held_out,
                c.max_len,
                c.eval_rows,
                features(),
                self.provenance.clone(),
            )?),
        };
        Ok((train, held))
    }

    /// Up to `n` prompts for the real tau: held-out documents up to their first supervised token
    /// (what the target was asked before the answer the drafter learns to draft); each with
    /// `new_tokens` and the `B - 1` positions a last verify block reaches past them must fit the
    /// target's positions. None at all is an error naming `tau_prompts`.
    pub fn tau_prompts(&self, n: usize, new_tokens: usize) -> Result<Vec<Vec<u32>>> {
        let (max, b) = (self.target_config.max_positions(), self.draft_config.block_size);
        let mut prompts = Vec::new();
        for &d in &self.dataset.held_out {
            if prompts.len() == n {
                break;
            }
            let doc = self.dataset.cache.document(d).map_err(data_error)?;
            let first = doc.loss_mask.iter().position(|&m| m).unwrap_or(doc.tokens.len());
            // A verify step starts at most at first + new_tokens - 2 and its block covers B
            // positions from there: first + new_tokens + B - 1 positions are enough.
            if first.saturating_add(new_tokens).saturating_add(b - 1) > max {
                return Err(Error::option(
                    "tau_tokens",
                    format!(
                        "held-out prompt {} of {first} tokens + {new_tokens} new + the {} more positions a verify block of {b} reaches exceed the target's {max} positions",
                        prompts.len(),
                        b - 1
                    ),
                ));
            }
            if first > 0 {
                prompts.push(doc.tokens[..first].to_vec());
            }
        }
        if prompts.is_empty() && self.dataset.held_out.is_empty() {
            return Err(Error::option(
                "tau_prompts",
                format!(
                    "{n}, but no document is held out (`--held-out 0`, or a fraction that drew none of these {} conversations: each is held out by its own hash, so a small set may get none; a larger fraction, another --seed or a held-out file): `--tau-prompts 0` trains without the real tau",
                    self.dataset.stats().conversations
                ),
            ));
        }
        if prompts.is_empty() {
            return Err(Error::option(
                "tau_prompts",
                format!(
                    "{n}, but none of the {} held-out documents has a prompt before its first supervised token (conversations do; `text` and fully supervised rows do not): `--tau-prompts 0` trains without the real tau",
                    self.dataset.held_out.len()
                ),
            ));
        }
        Ok(prompts)
    }

    /// The features of rows for an engine: the cache's (in `dtype`) when the run has one,
    /// else `otherwise`.
    pub fn features<'a>(&'a self, dtype: DType, otherwise: RowFeatures<'a>) -> RowFeatures<'a> {
        match &self.cache {
            Some(cache) => RowFeatures::Cache(cache, dtype),
            None => otherwise,
        }
    }
}

/// The note that a checkpoint's tensors the text model does not use (`check_checkpoint`'s: a
/// Qwen3.5's multi-token-prediction head and vision tower) are left out, naming a few.
pub fn unused_note(unused: &[String]) -> Option<String> {
    let shown: Vec<&str> = unused.iter().take(3).map(String::as_str).collect();
    (!unused.is_empty()).then(|| {
        format!(
            "target: {} checkpoint tensors the text model does not use are left out ({}{})",
            unused.len(),
            shown.join(", "),
            if unused.len() > 3 { ", ..." } else { "" }
        )
    })
}

/// The target's forward on `dev` (dense or hybrid, as `target` says) for launches of up to
/// `max_len` tokens, tapping `layer_ids`, its weights read from `dir` as `dtype`. A dense forward
/// holds the LM head only `with_lm_head` (the step shares it); a hybrid's layout always holds it.
pub fn load_forward<B: Backend + 'static>(
    dev: B,
    target: &TargetKind,
    dir: &std::path::Path,
    layer_ids: &[usize],
    max_len: usize,
    (with_lm_head, dtype): (bool, DType),
) -> Result<Box<dyn TargetFeatures<Backend = B>>> {
    let weights = WeightSet::load_dir(dir)?;
    let get = |name: &str, shape: &[usize]| weights.get(&target.checkpoint_name(name), shape, dtype);
    Ok(match target {
        TargetKind::Dense(config) => {
            let mut f = TargetForward::new(dev, config, layer_ids, max_len, with_lm_head)?;
            f.load_weights(get)?;
            Box::new(f)
        }
        TargetKind::Hybrid(config) => {
            let mut f = HybridForward::new(dev, config, layer_ids, max_len)?;
            f.load_weights(get)?;
            Box::new(f)
        }
    })
}
