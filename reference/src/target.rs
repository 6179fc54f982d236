//! The frozen target model: a dense Qwen3 or Llama decoder in HF format, giving logits and the
//! hidden states at chosen layers (layer id `l` = the output of decoder layer `l`, 0-indexed).

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::attention::dense_attention;
use crate::config::{DraftConfig, TargetConfig};
use crate::data::{document_runs, Row};
use crate::drafter::{is_norm, random_normal, FrozenHead};
use crate::error::{Error, Result};
use crate::hybrid::{HybridConfig, HybridLayerKind, HybridModel};
use crate::io::{check_checkpoint, save_weights_f32, WeightSet};
use crate::mask::causal_dense;
use crate::ops::{head_rms_norm, linear, rms_norm, rope, rope_tables_scaled, swiglu};

/// What a target folder's `config.json` holds: a dense Qwen3 or Llama model, or a Qwen3.5/3.6
/// hybrid (spec section 10; the text config, or the multimodal wrapper's `text_config`).
#[derive(Clone, Debug)]
pub enum TargetKind {
    Dense(TargetConfig),
    Hybrid(HybridConfig),
}

impl TargetKind {
    /// Reads `file`: a hybrid when it nests a `text_config` or its `model_type` is a Qwen3.5's,
    /// else a dense model (whose parser names what it does not support).
    pub fn from_file(file: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(file).map_err(|e| Error::io(file, e))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::invalid(file.display().to_string(), format!("not JSON: {e}")))?;
        // A Qwen3.5/3.6 hybrid by any of its marks: the multimodal wrapper, its model type, its
        // architecture, or GatedDeltaNet layers.
        let hybrid = value.get("text_config").is_some()
            || value["model_type"].as_str().is_some_and(|m| m.starts_with("qwen3_5"))
            || value["architectures"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x.as_str().is_some_and(|x| x.starts_with("Qwen3_5"))))
            || value["layer_types"]
                .as_array()
                .is_some_and(|l| l.iter().any(|x| x.as_str() == Some("linear_attention")));
        Ok(match hybrid {
            true => TargetKind::Hybrid(HybridConfig::from_file(file)?),
            false => TargetKind::Dense(TargetConfig::from_file(file)?),
        })
    }

    /// Whether rows of `tokens` tokens fit the target's positions; else why, naming `file`
    /// (the config read).
    pub fn check_row_len(&self, tokens: usize, file: &Path) -> std::result::Result<(), String> {
        match tokens <= self.max_positions() {
            true => Ok(()),
            false => Err(format!(
                "rows of {tokens} tokens exceed the target's {} positions (max_position_embeddings of {})",
                self.max_positions(),
                file.display()
            )),
        }
    }

    pub fn num_layers(&self) -> usize {
        match self {
            TargetKind::Dense(c) => c.dims.num_layers(),
            TargetKind::Hybrid(c) => c.num_layers(),
        }
    }

    pub fn hidden_size(&self) -> usize {
        match self {
            TargetKind::Dense(c) => c.dims.hidden_size,
            TargetKind::Hybrid(c) => c.hidden_size,
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            TargetKind::Dense(c) => c.dims.vocab_size,
            TargetKind::Hybrid(c) => c.vocab_size,
        }
    }

    /// The positions the target was trained for (`max_position_embeddings`).
    pub fn max_positions(&self) -> usize {
        match self {
            TargetKind::Dense(c) => c.dims.max_position_embeddings,
            TargetKind::Hybrid(c) => c.max_position_embeddings,
        }
    }

    /// The head size of the target's (full) attention layers.
    pub fn head_dim(&self) -> usize {
        match self {
            TargetKind::Dense(c) => c.dims.head_dim,
            TargetKind::Hybrid(c) => c.head_dim,
        }
    }

    /// One line: the architecture and its sizes.
    pub fn describe(&self) -> String {
        let (layers, hidden, vocab) = (self.num_layers(), self.hidden_size(), self.vocab_size());
        match self {
            TargetKind::Dense(c) => format!("{} ({layers} layers, hidden {hidden}, vocab {vocab})", c.arch.hf_name()),
            TargetKind::Hybrid(c) => {
                let linear = c.layer_kinds.iter().filter(|k| **k == HybridLayerKind::Linear).count();
                format!(
                    "Qwen3.5 hybrid ({layers} layers: {linear} GatedDeltaNet + {} gated attention, hidden {hidden}, vocab {vocab})",
                    layers - linear
                )
            }
        }
    }

    /// The checkpoint name of the text-model weight `name` (a wrapped hybrid's under
    /// `model.language_model.`).
    pub fn checkpoint_name(&self, name: &str) -> String {
        match self {
            TargetKind::Dense(_) => name.to_string(),
            TargetKind::Hybrid(c) => c.layout.checkpoint_name(name),
        }
    }

    /// Refuses a drafter that does not fit this target, naming both sides.
    pub fn check_drafter(&self, drafter: &DraftConfig) -> Result<()> {
        match self {
            TargetKind::Dense(c) => drafter.check_target(c),
            TargetKind::Hybrid(c) => c.check_drafter(drafter),
        }
    }

    /// Whether the LM head is the embedding table.
    pub fn tie_word_embeddings(&self) -> bool {
        match self {
            TargetKind::Dense(c) => c.tie_word_embeddings,
            TargetKind::Hybrid(c) => c.tie_word_embeddings,
        }
    }

    /// The frozen embedding table and LM head (the table when tied) from the weights `set`.
    pub fn frozen_head(&self, set: &WeightSet, dtype: DType) -> Result<FrozenHead> {
        let (v, h) = (self.vocab_size(), self.hidden_size());
        let embed = set.get(&self.checkpoint_name("model.embed_tokens.weight"), &[v, h], dtype)?;
        let lm_head = match self.tie_word_embeddings() {
            true => embed.clone(),
            false => set.get("lm_head.weight", &[v, h], dtype)?,
        };
        Ok(FrozenHead { embed, lm_head })
    }

    /// Checks the checkpoint in `dir` against this config from its safetensors headers alone:
    /// every weight the model has is there with its shape. Returns the checkpoint's tensors the
    /// model does not use, sorted (a dense checkpoint's extras; a hybrid's `mtp.*`,
    /// `model.visual.*` and a tied model's head); any other extra tensor of a hybrid is refused.
    pub fn check_checkpoint(&self, dir: &Path) -> Result<Vec<String>> {
        match self {
            // Only the tables of a target whose layers run elsewhere (features from a cache).
            TargetKind::Dense(c) if !c.arch.runs_here() => {
                let unused = check_checkpoint(dir, &table_shapes(c), |_| None)?;
                Ok(unused.into_iter().filter(|n| !n.starts_with("model.layers.") && n != "model.norm.weight").collect())
            }
            TargetKind::Dense(c) => check_checkpoint(dir, &target_param_shapes(c), |_| None),
            TargetKind::Hybrid(c) => c.check_checkpoint(dir),
        }
    }

    /// The reference model of the folder `dir` (whose config this is).
    pub fn load_model(&self, dir: &Path, dtype: DType) -> Result<Box<dyn Target>> {
        Ok(match self {
            TargetKind::Dense(_) => Box::new(TargetModel::load(dir, dtype)?),
            TargetKind::Hybrid(_) => Box::new(HybridModel::load(dir, dtype)?),
        })
    }
}

/// A frozen target as the reference runs it: the dense Qwen3/Llama [`TargetModel`], or the
/// Qwen3.5/3.6 hybrid (`hybrid::HybridModel`, spec section 10). Decoding, sampling the built-in
/// rows and their features go through it.
pub trait Target: Send + Sync {
    fn vocab_size(&self) -> usize;
    fn hidden_size(&self) -> usize;
    fn num_layers(&self) -> usize;
    /// Causal forward over one document `tokens` (positions `0..T`): logits `[T, V]` and the
    /// outputs `[T, H]` of the decoder layers `capture` (before the final norm).
    fn forward(&self, tokens: &[u32], capture: &[usize]) -> Result<TargetOutput>;
    /// The drafter's context features of a packed row `[S, F*H]` (each document alone,
    /// padding rows zero).
    fn row_features(&self, row: &Row, layer_ids: &[usize]) -> Result<Tensor>;
    /// The frozen embedding table and LM head the drafter shares.
    fn frozen_head(&self) -> FrozenHead;
    /// Refuses a drafter that does not fit this target, naming both sides.
    fn check_drafter(&self, drafter: &DraftConfig) -> Result<()>;
    /// The features of one document `[T, F*H]`: the outputs of `layer_ids` concatenated per token.
    fn features(&self, tokens: &[u32], layer_ids: &[usize]) -> Result<Tensor> {
        Ok(Tensor::cat(&self.forward(tokens, layer_ids)?.hidden, 1)?)
    }
}

impl Target for TargetModel {
    fn vocab_size(&self) -> usize {
        self.config.dims.vocab_size
    }
    fn hidden_size(&self) -> usize {
        self.config.dims.hidden_size
    }
    fn num_layers(&self) -> usize {
        self.config.dims.num_layers()
    }
    fn forward(&self, tokens: &[u32], capture: &[usize]) -> Result<TargetOutput> {
        TargetModel::forward(self, tokens, capture)
    }
    fn row_features(&self, row: &Row, layer_ids: &[usize]) -> Result<Tensor> {
        TargetModel::row_features(self, row, layer_ids)
    }
    fn frozen_head(&self) -> FrozenHead {
        TargetModel::frozen_head(self)
    }
    fn check_drafter(&self, drafter: &DraftConfig) -> Result<()> {
        drafter.check_target(&self.config)
    }
}

/// A target model's weights, keyed by their HF names.
pub struct TargetModel {
    pub config: TargetConfig,
    weights: HashMap<String, Tensor>,
}

/// What one target forward returns.
pub struct TargetOutput {
    /// `[T, V]`.
    pub logits: Tensor,
    /// One `[T, H]` per requested layer id, in request order.
    pub hidden: Vec<Tensor>,
}

/// HF key and shape of the embedding table and the LM head (none when tied) of `config`.
fn table_shapes(config: &TargetConfig) -> Vec<(String, Vec<usize>)> {
    let (v, h) = (config.dims.vocab_size, config.dims.hidden_size);
    let mut shapes = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    if !config.tie_word_embeddings {
        shapes.push(("lm_head.weight".to_string(), vec![v, h]));
    }
    shapes
}

/// HF key and shape of every weight of a target with `config` (no `lm_head` when tied).
pub fn target_param_shapes(config: &TargetConfig) -> Vec<(String, Vec<usize>)> {
    let c = &config.dims;
    let (h, d, i, v) = (c.hidden_size, c.head_dim, c.intermediate_size, c.vocab_size);
    let mut shapes = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for l in 0..c.num_layers() {
        let p = |name: &str, shape: Vec<usize>| (format!("model.layers.{l}.{name}"), shape);
        shapes.extend([
            p("input_layernorm.weight", vec![h]),
            p("self_attn.q_proj.weight", vec![c.num_heads * d, h]),
            p("self_attn.k_proj.weight", vec![c.num_kv_heads * d, h]),
            p("self_attn.v_proj.weight", vec![c.num_kv_heads * d, h]),
            p("self_attn.o_proj.weight", vec![h, c.num_heads * d]),
            p("post_attention_layernorm.weight", vec![h]),
            p("mlp.gate_proj.weight", vec![i, h]),
            p("mlp.up_proj.weight", vec![i, h]),
            p("mlp.down_proj.weight", vec![h, i]),
        ]);
        if config.arch.has_qk_norm() {
            shapes.extend([p("self_attn.q_norm.weight", vec![d]), p("self_attn.k_norm.weight", vec![d])]);
        }
    }
    shapes.push(("model.norm.weight".to_string(), vec![h]));
    if !config.tie_word_embeddings {
        shapes.push(("lm_head.weight".to_string(), vec![v, h]));
    }
    shapes
}

impl TargetModel {
    /// Builds every weight from `make(name, shape)`.
    pub fn from_fn(config: TargetConfig, mut make: impl FnMut(&str, &[usize]) -> Result<Tensor>) -> Result<Self> {
        config.check_runs_here("the reference target's layers")?;
        let weights = target_param_shapes(&config)
            .into_iter()
            .map(|(name, shape)| Ok((name.clone(), make(&name, &shape)?)))
            .collect::<Result<_>>()?;
        Ok(TargetModel { config, weights })
    }

    /// Loads `config.json` and the safetensors weights (one file or an index of shards) from
    /// `dir`; bf16, f16 and f32 weights are converted to `dtype`.
    pub fn load(dir: &Path, dtype: DType) -> Result<Self> {
        let config = TargetConfig::from_file(&dir.join("config.json"))?;
        let weights = WeightSet::load_dir(dir)?;
        Self::from_fn(config, |name, shape| weights.get(name, shape, dtype))
    }

    /// A random model: linears normal(0, `std`), norms 1 + normal(0, 0.1); seeded.
    pub fn random(config: TargetConfig, seed: u64, std: f64, dtype: DType) -> Result<Self> {
        Self::random_with(config, seed, dtype, |_| std)
    }

    /// A random model: each linear `name` normal(0, `std_of(name)`), norms 1 + normal(0, 0.1).
    pub fn random_with(config: TargetConfig, seed: u64, dtype: DType, std_of: impl Fn(&str) -> f64) -> Result<Self> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        Self::from_fn(config, |name, shape| {
            if is_norm(name) {
                return Ok(random_normal(shape, 0.1, &mut rng, dtype)?.affine(1.0, 1.0)?);
            }
            random_normal(shape, std_of(name), &mut rng, dtype)
        })
    }

    /// Saves `config.json` and `model.safetensors` (f32) into `dir`, each atomically.
    pub fn save(&self, dir: &Path) -> Result<()> {
        save_weights_f32(dir, &self.weights)?;
        self.config.save(&dir.join("config.json"))
    }

    /// The weight `name` (HF key), or an error naming it.
    pub fn weight(&self, name: &str) -> Result<Tensor> {
        self.weights.get(name).cloned().ok_or_else(|| Error::invalid(name, "no such weight in the target"))
    }

    fn w(&self, name: &str) -> &Tensor {
        &self.weights[name]
    }

    /// The frozen embedding table and LM head the drafter shares (tied heads share the table).
    pub fn frozen_head(&self) -> FrozenHead {
        let embed = self.w("model.embed_tokens.weight").clone();
        let lm_head = if self.config.tie_word_embeddings { embed.clone() } else { self.w("lm_head.weight").clone() };
        FrozenHead { embed, lm_head }
    }

    /// Causal forward over `tokens` (positions `0..T`): logits and the outputs of the decoder
    /// layers `capture` (before the final norm).
    pub fn forward(&self, tokens: &[u32], capture: &[usize]) -> Result<TargetOutput> {
        let c = &self.config.dims;
        let (t, eps) = (tokens.len(), c.rms_norm_eps);
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(Error::invalid("tokens", format!("token id {bad} is not below vocab_size {}", c.vocab_size)));
        }
        if let Some(&bad) = capture.iter().find(|&&l| l >= c.num_layers()) {
            return Err(Error::invalid(
                "target_layer_ids",
                format!("layer {bad} is out of range for {} target layers", c.num_layers()),
            ));
        }
        let dtype = self.w("model.embed_tokens.weight").dtype();
        let ids = Tensor::from_vec(tokens.to_vec(), t, &Device::Cpu)?;
        let mut x = self.w("model.embed_tokens.weight").index_select(&ids, 0)?; // [T, H]
        let positions: Vec<usize> = (0..t).collect();
        let (cos, sin) = rope_tables_scaled(&positions, c.head_dim, c.rope_theta, &self.config.rope_scaling, dtype)?;
        let mut layer_outputs = Vec::with_capacity(c.num_layers());
        for (l, &kind) in c.layer_kinds.iter().enumerate() {
            let w = |name: &str| self.w(&format!("model.layers.{l}.{name}"));
            let xn = rms_norm(&x, w("input_layernorm.weight"), eps)?;
            let (q, k) = (linear(&xn, w("self_attn.q_proj.weight"))?, linear(&xn, w("self_attn.k_proj.weight"))?);
            let (q, k) = match self.config.arch.has_qk_norm() {
                true => (
                    head_rms_norm(&q, c.num_heads, w("self_attn.q_norm.weight"), eps)?,
                    head_rms_norm(&k, c.num_kv_heads, w("self_attn.k_norm.weight"), eps)?,
                ),
                false => (q.reshape((t, c.num_heads, c.head_dim))?, k.reshape((t, c.num_kv_heads, c.head_dim))?),
            };
            let (q, k) = (rope(&q, &cos, &sin)?, rope(&k, &cos, &sin)?);
            let v = linear(&xn, w("self_attn.v_proj.weight"))?.reshape((t, c.num_kv_heads, c.head_dim))?;
            let attn = dense_attention(&q, &k, &v, &causal_dense(kind, t))?.reshape((t, c.num_heads * c.head_dim))?;
            x = (x + linear(&attn, w("self_attn.o_proj.weight"))?)?;
            let xn = rms_norm(&x, w("post_attention_layernorm.weight"), eps)?;
            x = (&x + swiglu(&xn, w("mlp.gate_proj.weight"), w("mlp.up_proj.weight"), w("mlp.down_proj.weight"))?)?;
            layer_outputs.push(x.clone());
        }
        let logits = linear(&rms_norm(&x, self.w("model.norm.weight"), eps)?, &self.frozen_head().lm_head)?;
        let hidden = capture.iter().map(|&l| layer_outputs[l].clone()).collect();
        Ok(TargetOutput { logits, hidden })
    }

    /// The features of a packed training row `[S, F*H]`: each document's tokens run through the
    /// target alone (positions from 0, seeing no other document), padding rows zero.
    pub fn row_features(&self, row: &Row, layer_ids: &[usize]) -> Result<Tensor> {
        row.validate()?;
        let width = layer_ids.len() * self.config.dims.hidden_size;
        let dtype = self.w("model.embed_tokens.weight").dtype();
        let mut out = Tensor::zeros((row.tokens.len(), width), dtype, &Device::Cpu)?;
        for run in document_runs(&row.doc_ids) {
            let features = self.features(&row.tokens[run.clone()], layer_ids)?;
            out = out.slice_assign(&[run, 0..width], &features)?;
        }
        Ok(out)
    }
}
