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
use dflash_reference::config::{default_target_layer_ids, DraftConfig, TargetConfig};

use crate::config::RunConfig;
use crate::error::{Error, Result};
use crate::rows::{DataRows, RowFeatures};

/// Features the spec's recipe draws from the target (spec section 1).
pub const DEFAULT_NUM_FEATURES: usize = 5;

/// Everything a real run reads, checked.
pub struct RealSetup {
    pub target_dir: PathBuf,
    pub target_config: TargetConfig,
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

/// Reads and checks the target folder, the data (tokenized once, then cached) and the feature
/// cache of `c` (validated, with `target` set).
pub fn prepare(c: &RunConfig) -> Result<RealSetup> {
    let target_dir = c.target.clone().ok_or_else(|| Error::option("target", "not set"))?;
    if !target_dir.is_dir() {
        return Err(Error::option("target", format!("{}: not a folder", target_dir.display())));
    }
    let config_file = target_dir.join("config.json");
    let target_config = TargetConfig::from_file(&config_file)?;
    let layers = target_config.dims.num_layers();
    let mut notes = Vec::new();

    let cache_index = match &c.features {
        Some(dir) => Some(
            dflash_data::features::FeatureIndex::read(&dir.join("index.json"))
                .map_err(|e| Error::option("features", e.to_string()))?,
        ),
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
        (None, None) => default_target_layer_ids(layers, DEFAULT_NUM_FEATURES.min(layers)),
    };
    if let Some(&bad) = layer_ids.iter().find(|&&l| l >= layers) {
        return Err(Error::option(
            "target_layer_ids",
            format!("layer {bad} is out of range for the target's {layers} layers ({})", config_file.display()),
        ));
    }

    let tokenizer = TargetTokenizer::load(&target_dir).map_err(|e| Error::option("target", e.to_string()))?;
    let vocab = target_config.dims.vocab_size;
    let mask = match c.mask_token_id {
        Some(id) => id,
        None => {
            let id = tokenizer.tokenizer.get_vocab_size(true);
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
    let mut draft_config = DraftConfig::for_target(&target_config, c.draft_layers, c.block_size, mask, layer_ids.len());
    draft_config.target_layer_ids = layer_ids.clone();
    draft_config.check_target(&target_config)?;

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
            if cache.index.hidden_size != target_config.dims.hidden_size {
                return Err(Error::option(
                    "features",
                    format!(
                        "{}: hidden size {}, the target's is {}",
                        dir.display(),
                        cache.index.hidden_size,
                        target_config.dims.hidden_size
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
    /// (what the target was asked before the answer the drafter learns to draft).
    pub fn tau_prompts(&self, n: usize) -> Result<Vec<Vec<u32>>> {
        let mut prompts = Vec::new();
        for &d in &self.dataset.held_out {
            if prompts.len() == n {
                break;
            }
            let doc = self.dataset.cache.document(d).map_err(data_error)?;
            let first = doc.loss_mask.iter().position(|&m| m).unwrap_or(doc.tokens.len());
            if first > 0 {
                prompts.push(doc.tokens[..first].to_vec());
            }
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
