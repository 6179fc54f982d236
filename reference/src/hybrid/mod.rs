//! The hybrid target of spec section 10: Qwen3.5 / Qwen3.6, a decoder stack whose layers are
//! GatedDeltaNet linear attention ([`gdn`]) or gated full attention ([`layers`]), each followed
//! by a SwiGLU MLP, with zero-centred RMSNorms, giving logits and the hidden states at chosen
//! layers (layer id `l` = the output of decoder layer `l`, before the final norm), like
//! [`crate::target::TargetModel`].
//!
//! - [`config`]: the HF `config.json`, text (`Qwen3_5ForCausalLM`) or multimodal wrapper;
//! - [`gdn`]: the GatedDeltaNet layer, recurrent and chunked;
//! - [`layers`]: the zero-centred norm and the gated attention layer.

pub mod config;
pub mod gdn;
pub mod layers;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::config::DraftConfig;
use crate::data::Row;
use crate::drafter::{random_normal, FrozenHead};
use crate::error::{Error, Result};
use crate::io::{save_weights_f32, WeightSet};
use crate::ops::{linear, rope_tables, swiglu};
use crate::target::{Target, TargetOutput};
pub use config::{HybridConfig, HybridLayerKind, HybridLayout};
pub use gdn::GdnForm;
use gdn::{gdn_layer, segment_starts, GdnWeights};
use layers::{gated_attention, packed_causal_mask, zero_centred_rms_norm, AttnWeights};

/// HF key (text layout, `model.*`) and shape of every weight of a hybrid target with `config`
/// (no `lm_head` when tied).
pub fn hybrid_param_shapes(config: &HybridConfig) -> Vec<(String, Vec<usize>)> {
    let c = config;
    let (h, i, v, d, g) = (c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim, &c.gdn);
    let mut shapes = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for (l, kind) in c.layer_kinds.iter().enumerate() {
        let p = |name: &str, shape: Vec<usize>| (format!("model.layers.{l}.{name}"), shape);
        shapes.extend([
            p("input_layernorm.weight", vec![h]),
            p("post_attention_layernorm.weight", vec![h]),
            p("mlp.gate_proj.weight", vec![i, h]),
            p("mlp.up_proj.weight", vec![i, h]),
            p("mlp.down_proj.weight", vec![h, i]),
        ]);
        match kind {
            HybridLayerKind::Linear => shapes.extend([
                p("linear_attn.in_proj_qkv.weight", vec![g.conv_dim(), h]),
                p("linear_attn.in_proj_z.weight", vec![g.value_dim(), h]),
                p("linear_attn.in_proj_b.weight", vec![g.num_value_heads, h]),
                p("linear_attn.in_proj_a.weight", vec![g.num_value_heads, h]),
                p("linear_attn.conv1d.weight", vec![g.conv_dim(), 1, g.conv_kernel]),
                p("linear_attn.A_log", vec![g.num_value_heads]),
                p("linear_attn.dt_bias", vec![g.num_value_heads]),
                p("linear_attn.norm.weight", vec![g.value_head_dim]),
                p("linear_attn.out_proj.weight", vec![h, g.value_dim()]),
            ]),
            HybridLayerKind::Full => shapes.extend([
                p("self_attn.q_proj.weight", vec![c.num_heads * 2 * d, h]),
                p("self_attn.k_proj.weight", vec![c.num_kv_heads * d, h]),
                p("self_attn.v_proj.weight", vec![c.num_kv_heads * d, h]),
                p("self_attn.o_proj.weight", vec![h, c.num_heads * d]),
                p("self_attn.q_norm.weight", vec![d]),
                p("self_attn.k_norm.weight", vec![d]),
            ]),
        }
    }
    shapes.push(("model.norm.weight".to_string(), vec![h]));
    if !c.tie_word_embeddings {
        shapes.push(("lm_head.weight".to_string(), vec![v, h]));
    }
    shapes
}

/// The std of the random conv taps: about `1/sqrt(K)` for the published `K = 4`, so the conv keeps
/// the scale of its input.
const RANDOM_CONV_STD: f64 = 0.5;
/// The std of random norm weights around their centre (0 for the zero-centred norms, 1 for the
/// GDN output norm): nonzero, so that a norm missing (or wrongly adding) its `1 +` shows.
const RANDOM_NORM_STD: f64 = 0.1;
/// The std of random `A_log` and `dt_bias` (init 0-ish and 1): decays `exp(g)` spread over (0, 1).
const RANDOM_DECAY_STD: f64 = 0.5;

/// A hybrid target model's weights, keyed by their text-layout HF names.
pub struct HybridModel {
    pub config: HybridConfig,
    weights: HashMap<String, Tensor>,
    /// Checkpoint tensors the text model does not use, by name.
    ignored: Vec<String>,
}

impl HybridModel {
    /// Builds every weight from `make(name, shape)` (text-layout names); `dtype` f32 or f64.
    pub fn from_fn(config: HybridConfig, mut make: impl FnMut(&str, &[usize]) -> Result<Tensor>) -> Result<Self> {
        let weights: HashMap<String, Tensor> = hybrid_param_shapes(&config)
            .into_iter()
            .map(|(name, shape)| Ok((name.clone(), make(&name, &shape)?)))
            .collect::<Result<_>>()?;
        if let Some((name, t)) = weights.iter().find(|(_, t)| !matches!(t.dtype(), DType::F32 | DType::F64)) {
            return Err(Error::invalid(name, format!("dtype {:?}: the reference computes in f32 or f64", t.dtype())));
        }
        Ok(HybridModel { config, weights, ignored: Vec::new() })
    }

    /// A random model, seeded: matrices normal(0, `std`), conv taps normal(0, 0.5), zero-centred
    /// norm weights normal(0, 0.1), the GDN output norm 1 + normal(0, 0.1), `A_log` and `dt_bias`
    /// normal(0, 0.5).
    pub fn random(config: HybridConfig, seed: u64, std: f64, dtype: DType) -> Result<Self> {
        Self::random_with(config, seed, dtype, |_| std)
    }

    /// [`Self::random`] with the std of each matrix (embedding, LM head, projections) by its
    /// name.
    pub fn random_with(config: HybridConfig, seed: u64, dtype: DType, std_of: impl Fn(&str) -> f64) -> Result<Self> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        Self::from_fn(config, |name, shape| {
            let (std, centre) = if name.ends_with("linear_attn.norm.weight") {
                (RANDOM_NORM_STD, 1.0)
            } else if name.ends_with("norm.weight") {
                (RANDOM_NORM_STD, 0.0)
            } else if name.ends_with("A_log") || name.ends_with("dt_bias") {
                (RANDOM_DECAY_STD, 0.0)
            } else if name.ends_with("conv1d.weight") {
                (RANDOM_CONV_STD, 0.0)
            } else {
                (std_of(name), 0.0)
            };
            Ok(random_normal(shape, std, &mut rng, dtype)?.affine(1.0, centre)?)
        })
    }

    /// Loads `config.json` and the safetensors weights (one file or an index of shards) from
    /// `dir`; bf16, f16 and f32 weights are converted to `dtype` (f32 or f64). In the wrapper
    /// layout the weights are read from `model.language_model.*`. Tensors of the
    /// multi-token-prediction head (`mtp.*`) and the vision tower (`model.visual.*`), and the
    /// `lm_head.weight` of a tied model, are not loaded; [`Self::ignored_weights`] lists them. Any
    /// other tensor the model does not have is an error naming it.
    pub fn load(dir: &Path, dtype: DType) -> Result<Self> {
        let config = HybridConfig::from_file(&dir.join("config.json"))?;
        let ignored = config.check_checkpoint(dir)?;
        let set = WeightSet::load_dir(dir)?;
        let layout = config.layout;
        let mut model = Self::from_fn(config, |name, shape| set.get(&layout.checkpoint_name(name), shape, dtype))?;
        model.ignored = ignored;
        Ok(model)
    }

    /// The checkpoint tensors [`Self::load`] left out (`mtp.*`, `model.visual.*`, a tied
    /// model's `lm_head.weight`), sorted.
    pub fn ignored_weights(&self) -> &[String] {
        &self.ignored
    }

    /// Saves `config.json` and `model.safetensors` (f32) into `dir` in the text layout
    /// (`Qwen3_5ForCausalLM`), each atomically.
    pub fn save(&self, dir: &Path) -> Result<()> {
        save_weights_f32(dir, &self.weights)?;
        self.config.save(&dir.join("config.json"))
    }

    /// The weight `name` (text-layout HF key), or an error naming it.
    pub fn weight(&self, name: &str) -> Result<Tensor> {
        self.weights.get(name).cloned().ok_or_else(|| Error::invalid(name, "no such weight in the hybrid target"))
    }

    fn w(&self, name: &str) -> &Tensor {
        &self.weights[name]
    }

    /// Causal forward over one document `tokens` (positions `0..T`), the delta rule in its
    /// recurrent form: logits `[T, V]` and the outputs `[T, H]` of the decoder layers `capture`.
    pub fn forward(&self, tokens: &[u32], capture: &[usize]) -> Result<TargetOutput> {
        self.forward_with(tokens, capture, GdnForm::Recurrent)
    }

    /// [`Self::forward`] with the delta rule in `form`.
    pub fn forward_with(&self, tokens: &[u32], capture: &[usize], form: GdnForm) -> Result<TargetOutput> {
        let positions: Vec<usize> = (0..tokens.len()).collect();
        self.run(tokens, &vec![0; tokens.len()], &positions, capture, form)
    }

    /// The forward over a packed row `[S]`: at each document start the conv window and the
    /// recurrent state restart from zero, attention sees only its own document, RoPE uses the
    /// row's positions; so each document's outputs equal it run alone. Padding rows are zero.
    pub fn row_forward(&self, row: &Row, capture: &[usize], form: GdnForm) -> Result<TargetOutput> {
        row.validate()?;
        let out = self.run(&row.tokens, &row.doc_ids, &row.positions, capture, form)?;
        let keep: Vec<f64> = row.doc_ids.iter().map(|&d| f64::from(u8::from(d >= 0))).collect();
        let keep = Tensor::from_vec(keep, (row.tokens.len(), 1), &Device::Cpu)?.to_dtype(out.logits.dtype())?;
        Ok(TargetOutput {
            logits: out.logits.broadcast_mul(&keep)?,
            hidden: out.hidden.iter().map(|h| Ok(h.broadcast_mul(&keep)?)).collect::<Result<_>>()?,
        })
    }

    /// The drafter's context features of a packed row `[S, F*H]`: the outputs of `layer_ids`
    /// concatenated per token (recurrent form), padding rows zero.
    pub fn row_features(&self, row: &Row, layer_ids: &[usize]) -> Result<Tensor> {
        Ok(Tensor::cat(&self.row_forward(row, layer_ids, GdnForm::Recurrent)?.hidden, 1)?)
    }

    /// The decoder stack over `tokens` with document ids `doc_ids` (a new document wherever the
    /// id changes) and RoPE positions `positions`.
    fn run(
        &self,
        tokens: &[u32],
        doc_ids: &[i64],
        positions: &[usize],
        capture: &[usize],
        form: GdnForm,
    ) -> Result<TargetOutput> {
        let c = &self.config;
        let (t, eps) = (tokens.len(), c.rms_norm_eps);
        if t == 0 {
            return Err(Error::invalid("tokens", "no tokens"));
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(Error::invalid("tokens", format!("token id {bad} is not below vocab_size {}", c.vocab_size)));
        }
        if let Some(&bad) = capture.iter().find(|&&l| l >= c.num_layers()) {
            return Err(Error::invalid(
                "target_layer_ids",
                format!("layer {bad} is out of range for {} target layers", c.num_layers()),
            ));
        }
        let embed = self.w("model.embed_tokens.weight");
        let mut x = embed.index_select(&Tensor::from_vec(tokens.to_vec(), t, &Device::Cpu)?, 0)?; // [T, H]
        let starts = segment_starts(doc_ids);
        let mask = packed_causal_mask(doc_ids);
        let (cos, sin) = rope_tables(positions, c.rope.rotary_dim, c.rope.theta, embed.dtype())?;
        let mut layer_outputs = Vec::with_capacity(c.num_layers());
        for (l, kind) in c.layer_kinds.iter().enumerate() {
            let w = |name: &str| self.w(&format!("model.layers.{l}.{name}"));
            let xn = zero_centred_rms_norm(&x, w("input_layernorm.weight"), eps)?;
            let mixed = match kind {
                HybridLayerKind::Linear => {
                    let weights = GdnWeights {
                        in_proj_qkv: w("linear_attn.in_proj_qkv.weight"),
                        in_proj_z: w("linear_attn.in_proj_z.weight"),
                        in_proj_b: w("linear_attn.in_proj_b.weight"),
                        in_proj_a: w("linear_attn.in_proj_a.weight"),
                        conv1d: w("linear_attn.conv1d.weight"),
                        a_log: w("linear_attn.A_log"),
                        dt_bias: w("linear_attn.dt_bias"),
                        norm: w("linear_attn.norm.weight"),
                        out_proj: w("linear_attn.out_proj.weight"),
                    };
                    gdn_layer(&xn, &weights, &c.gdn, eps, &starts, form)?
                }
                HybridLayerKind::Full => {
                    let weights = AttnWeights {
                        q_proj: w("self_attn.q_proj.weight"),
                        k_proj: w("self_attn.k_proj.weight"),
                        v_proj: w("self_attn.v_proj.weight"),
                        o_proj: w("self_attn.o_proj.weight"),
                        q_norm: w("self_attn.q_norm.weight"),
                        k_norm: w("self_attn.k_norm.weight"),
                    };
                    gated_attention(&xn, &weights, c, &cos, &sin, &mask)?
                }
            };
            x = (x + mixed)?;
            let xn = zero_centred_rms_norm(&x, w("post_attention_layernorm.weight"), eps)?;
            x = (&x + swiglu(&xn, w("mlp.gate_proj.weight"), w("mlp.up_proj.weight"), w("mlp.down_proj.weight"))?)?;
            layer_outputs.push(x.clone());
        }
        let lm_head = if c.tie_word_embeddings { embed } else { self.w("lm_head.weight") };
        let logits = linear(&zero_centred_rms_norm(&x, self.w("model.norm.weight"), eps)?, lm_head)?;
        let hidden = capture.iter().map(|&l| layer_outputs[l].clone()).collect();
        Ok(TargetOutput { logits, hidden })
    }
}

impl Target for HybridModel {
    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }
    fn hidden_size(&self) -> usize {
        self.config.hidden_size
    }
    fn num_layers(&self) -> usize {
        self.config.num_layers()
    }
    fn forward(&self, tokens: &[u32], capture: &[usize]) -> Result<TargetOutput> {
        HybridModel::forward(self, tokens, capture)
    }
    fn row_features(&self, row: &Row, layer_ids: &[usize]) -> Result<Tensor> {
        HybridModel::row_features(self, row, layer_ids)
    }
    fn frozen_head(&self) -> FrozenHead {
        let embed = self.w("model.embed_tokens.weight").clone();
        let lm_head = if self.config.tie_word_embeddings { embed.clone() } else { self.w("lm_head.weight").clone() };
        FrozenHead { embed, lm_head }
    }
    /// The drafter of a hybrid is a Qwen3-layout stack of its own heads (spec section 10): it
    /// shares the hidden size, the vocabulary and the layer count its features come from.
    fn check_drafter(&self, drafter: &DraftConfig) -> Result<()> {
        self.config.check_drafter(drafter)
    }
}

#[cfg(test)]
mod tests;
