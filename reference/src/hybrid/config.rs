//! The hybrid target's config (spec section 10), read from a Qwen3.5 / Qwen3.6 HF `config.json`:
//! either a text config (`model_type` `qwen3_5_text`, `Qwen3_5ForCausalLM`, weights under
//! `model.*`) or the multimodal wrapper (`model_type` `qwen3_5`,
//! `Qwen3_5ForConditionalGeneration`) whose `text_config` holds the text model and whose weights
//! sit under `model.language_model.*`.

use std::io::Write;
use std::path::Path;

use serde_json::{json, Value};

use crate::config::DraftConfig;
use crate::error::{Error, Result};
use crate::io::write_atomically;
use crate::json_fields::{read_json, Fields};

/// The token mixer of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HybridLayerKind {
    /// `linear_attention`: a GatedDeltaNet layer.
    Linear,
    /// `full_attention`: a gated, causal, GQA softmax attention layer.
    Full,
}

impl HybridLayerKind {
    /// The `layer_types` entry.
    pub fn hf_name(self) -> &'static str {
        match self {
            HybridLayerKind::Linear => "linear_attention",
            HybridLayerKind::Full => "full_attention",
        }
    }
}

/// Where the text model's weights sit in the checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HybridLayout {
    /// `Qwen3_5ForCausalLM`: `model.*` and `lm_head.weight`.
    Text,
    /// `Qwen3_5ForConditionalGeneration`: `model.language_model.*` and `lm_head.weight`.
    Wrapped,
}

impl HybridLayout {
    /// The checkpoint name of the text-model weight `name` (given in the text layout, `model.*`).
    pub fn checkpoint_name(self, name: &str) -> String {
        match (self, name.strip_prefix("model.")) {
            (HybridLayout::Wrapped, Some(rest)) => format!("model.language_model.{rest}"),
            _ => name.to_string(),
        }
    }

    /// Whether a checkpoint tensor belongs to a part of a Qwen3.5 checkpoint that the text model
    /// does not use: the multi-token-prediction head (`mtp.*`) or the vision tower (`model.visual.*`).
    pub fn is_ignored(checkpoint_name: &str) -> bool {
        checkpoint_name.starts_with("mtp.") || checkpoint_name.starts_with("model.visual.")
    }
}

/// The widest a hybrid layer's dimension (or product of head count and head size) may be: 2^24
/// values (the published hybrids' widest is the vocab, 248320), so that a weight's size, the
/// product of two, stays far inside 64 bits; sizes with a launch's tokens are checked products.
pub const MAX_WIDTH: usize = 1 << 24;

/// Dimensions of the GatedDeltaNet layers.
#[derive(Clone, Debug, PartialEq)]
pub struct GdnDims {
    /// `linear_conv_kernel_dim`: the depthwise causal conv's kernel width.
    pub conv_kernel: usize,
    /// `linear_num_key_heads` `H_k` (queries share the key heads).
    pub num_key_heads: usize,
    /// `linear_num_value_heads` `H_v`, a multiple of `H_k`.
    pub num_value_heads: usize,
    /// `linear_key_head_dim` `d_k`.
    pub key_head_dim: usize,
    /// `linear_value_head_dim` `d_v`.
    pub value_head_dim: usize,
}

impl GdnDims {
    /// `H_k * d_k`: the width of q and of k.
    pub fn key_dim(&self) -> usize {
        self.num_key_heads * self.key_head_dim
    }

    /// `H_v * d_v`: the width of v, z and the output.
    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }

    /// The conv1d channels: q, k and v (`2 * H_k * d_k + H_v * d_v`).
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Value heads per key head.
    pub fn group_size(&self) -> usize {
        self.num_value_heads / self.num_key_heads
    }
}

/// The RoPE of the full-attention layers: plain (`default`) frequencies on the first
/// `rotary_dim` dims of each head. The multimodal sections (`mrope_section`) only matter for
/// image and video positions; for text, whose three position rows are equal, it is plain RoPE.
#[derive(Clone, Debug, PartialEq)]
pub struct HybridRope {
    /// `rope_theta`.
    pub theta: f64,
    /// `partial_rotary_factor` (0.25 in the published configs; transformers' default when absent).
    pub partial_rotary_factor: f64,
    /// `head_dim * partial_rotary_factor`: the rotated dims (even); the rest pass through.
    pub rotary_dim: usize,
    /// `mrope_section`, if given: frequencies per temporal / height / width section, summing to
    /// `rotary_dim / 2`.
    pub mrope_section: Option<Vec<usize>>,
    /// `mrope_interleaved`, if given.
    pub mrope_interleaved: Option<bool>,
}

/// A Qwen3.5 / Qwen3.6 hybrid target's text config.
#[derive(Clone, Debug, PartialEq)]
pub struct HybridConfig {
    pub layout: HybridLayout,
    pub hidden_size: usize,
    /// The SwiGLU MLP's inner width.
    pub intermediate_size: usize,
    pub vocab_size: usize,
    /// One entry per decoder layer; its length is the number of layers.
    pub layer_kinds: Vec<HybridLayerKind>,
    pub gdn: GdnDims,
    /// The full-attention layers' head size.
    pub head_dim: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub rope: HybridRope,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
}

/// transformers' `full_attention_interval` when a config gives neither it nor `layer_types`.
pub const DEFAULT_FULL_ATTENTION_INTERVAL: usize = 4;
/// transformers' `Qwen3_5TextConfig` default of `partial_rotary_factor`.
pub const DEFAULT_PARTIAL_ROTARY_FACTOR: f64 = 0.25;
/// transformers' default `rope_theta`.
const DEFAULT_ROPE_THETA: f64 = 10000.0;

/// `full_attention_interval` as layer kinds: layer `i` is full attention iff `(i + 1) % interval == 0`.
pub fn interval_layer_kinds(num_layers: usize, interval: usize) -> Vec<HybridLayerKind> {
    (0..num_layers)
        .map(|i| if (i + 1) % interval == 0 { HybridLayerKind::Full } else { HybridLayerKind::Linear })
        .collect()
}

impl HybridConfig {
    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layer_kinds.len()
    }

    /// Query heads per K/V head of the full-attention layers.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Reads and validates a `config.json` (text or wrapper). A text config next to weights
    /// under the wrapper's names (`model.language_model.*`: a wrapper checkpoint with its text
    /// config only) reads them there, as transformers does.
    pub fn from_file(file: &Path) -> Result<Self> {
        let value = read_json(file)?;
        let mut config = Self::from_value(file, &value)?;
        let text_layout_weights = match config.layout {
            HybridLayout::Text => file.parent().and_then(|dir| crate::io::WeightSet::load_dir(dir).ok()),
            HybridLayout::Wrapped => None,
        };
        if let Some(weights) = text_layout_weights {
            let names = weights.shapes();
            let embed = "model.embed_tokens.weight";
            if !names.contains_key(embed) && names.contains_key(&HybridLayout::Wrapped.checkpoint_name(embed)) {
                config.layout = HybridLayout::Wrapped;
            }
        }
        Ok(config)
    }

    /// Validates a parsed `config.json`; `file` names the source in errors.
    pub fn from_value(file: &Path, value: &Value) -> Result<Self> {
        let top = Fields::top(file, value)?;
        match top.object("text_config")? {
            Some(text) => {
                check_names(&top, "qwen3_5", "Qwen3_5ForConditionalGeneration")?;
                check_names(&text, "qwen3_5_text", "Qwen3_5ForCausalLM")?;
                let mut config = Self::parse_text(&text, HybridLayout::Wrapped)?;
                // The wrapper's own `tie_word_embeddings` decides; a nested one must agree.
                if let Some(tied) = top.opt_bool("tie_word_embeddings")? {
                    if text.has("tie_word_embeddings") && tied != config.tie_word_embeddings {
                        return Err(top.error(
                            "tie_word_embeddings",
                            format!("{tied}, but text_config.tie_word_embeddings is {}", config.tie_word_embeddings),
                        ));
                    }
                    config.tie_word_embeddings = tied;
                }
                Ok(config)
            }
            None => {
                check_names(&top, "qwen3_5_text", "Qwen3_5ForCausalLM")?;
                Self::parse_text(&top, HybridLayout::Text)
            }
        }
    }

    fn parse_text(f: &Fields, layout: HybridLayout) -> Result<Self> {
        let hidden_size = f.positive("hidden_size")?;
        let num_heads = f.positive("num_attention_heads")?;
        let num_kv_heads = f.positive("num_key_value_heads")?;
        if num_heads % num_kv_heads != 0 {
            return Err(f.error(
                "num_key_value_heads",
                format!("{num_kv_heads} does not divide num_attention_heads {num_heads}"),
            ));
        }
        let head_dim = f.positive("head_dim")?;
        if head_dim % 2 != 0 {
            return Err(f.error("head_dim", format!("{head_dim} must be even (RoPE rotates halves)")));
        }
        let gdn = GdnDims {
            conv_kernel: f.positive("linear_conv_kernel_dim")?,
            num_key_heads: f.positive("linear_num_key_heads")?,
            num_value_heads: f.positive("linear_num_value_heads")?,
            key_head_dim: f.positive("linear_key_head_dim")?,
            value_head_dim: f.positive("linear_value_head_dim")?,
        };
        if !gdn.num_value_heads.is_multiple_of(gdn.num_key_heads) {
            return Err(f.error(
                "linear_num_value_heads",
                format!("{} is not a multiple of linear_num_key_heads {}", gdn.num_value_heads, gdn.num_key_heads),
            ));
        }
        if let Some(act) = f.opt_str("hidden_act")? {
            if act != "silu" {
                return Err(f.error("hidden_act", format!("unsupported activation `{act}` (only `silu`)")));
            }
        }
        if f.opt_bool("attention_bias")? == Some(true) {
            return Err(f.error("attention_bias", "biases are not supported"));
        }
        // transformers' Qwen3.5 attention always gates its output; a config saying otherwise
        // describes a model this layer is not.
        if f.opt_bool("attn_output_gate")? == Some(false) {
            return Err(f.error("attn_output_gate", "false is not supported (the Qwen3.5 attention always gates)"));
        }
        let rms_norm_eps = f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6);
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
            return Err(f.error("rms_norm_eps", format!("{rms_norm_eps} must be positive and finite")));
        }
        let (intermediate_size, vocab_size) = (f.positive("intermediate_size")?, f.positive("vocab_size")?);
        // Every width a layer's weights are made of, bounded (their products are plain ones).
        let (gdn_k, gdn_v) =
            (gdn.num_key_heads.checked_mul(gdn.key_head_dim), gdn.num_value_heads.checked_mul(gdn.value_head_dim));
        let widths = [
            ("hidden_size", Some(hidden_size)),
            ("intermediate_size", Some(intermediate_size)),
            ("vocab_size", Some(vocab_size)),
            ("num_attention_heads x head_dim x 2 (the gated query)", num_heads.checked_mul(head_dim).and_then(|w| w.checked_mul(2))),
            ("num_key_value_heads x head_dim", num_kv_heads.checked_mul(head_dim)),
            ("linear_num_key_heads x linear_key_head_dim", gdn_k),
            ("linear_num_value_heads x linear_value_head_dim", gdn_v),
            ("2 x linear_num_key_heads x linear_key_head_dim + linear_num_value_heads x linear_value_head_dim (the conv's channels)", gdn_k.and_then(|k| k.checked_mul(2)).zip(gdn_v).and_then(|(k, v)| k.checked_add(v))),
            ("linear_conv_kernel_dim", Some(gdn.conv_kernel)),
        ];
        if let Some((name, width)) = widths.iter().find(|(_, w)| w.is_none_or(|w| w > MAX_WIDTH)) {
            let is = width.map_or("overflows 64 bits".to_string(), |w| format!("is {w}"));
            let field = name.split(' ').find(|w| w.contains('_')).unwrap_or(name);
            return Err(f.error(field, format!("{name} {is}: a layer's widths may be at most {MAX_WIDTH} values")));
        }
        Ok(HybridConfig {
            layout,
            hidden_size,
            intermediate_size,
            vocab_size,
            layer_kinds: parse_layer_kinds(f)?,
            gdn,
            head_dim,
            num_heads,
            num_kv_heads,
            rope: parse_rope(f, head_dim)?,
            rms_norm_eps,
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            max_position_embeddings: match f.has("max_position_embeddings") {
                true => f.positive("max_position_embeddings")?,
                false => 32768,
            },
        })
    }

    /// The HF `config.json` value of the text model (`Qwen3_5ForCausalLM`), whatever the layout
    /// it was read from ([`super::HybridModel::save`] writes the text layout).
    pub fn to_value(&self) -> Value {
        let mut rope = json!({
            "rope_type": "default",
            "rope_theta": self.rope.theta,
            "partial_rotary_factor": self.rope.partial_rotary_factor,
        });
        if let Some(section) = &self.rope.mrope_section {
            rope["mrope_section"] = json!(section);
        }
        if let Some(interleaved) = self.rope.mrope_interleaved {
            rope["mrope_interleaved"] = json!(interleaved);
        }
        let layer_types: Vec<&str> = self.layer_kinds.iter().map(|k| k.hf_name()).collect();
        json!({
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers(),
            "layer_types": layer_types,
            "vocab_size": self.vocab_size,
            "linear_conv_kernel_dim": self.gdn.conv_kernel,
            "linear_num_key_heads": self.gdn.num_key_heads,
            "linear_num_value_heads": self.gdn.num_value_heads,
            "linear_key_head_dim": self.gdn.key_head_dim,
            "linear_value_head_dim": self.gdn.value_head_dim,
            "head_dim": self.head_dim,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "rope_parameters": rope,
            "attn_output_gate": true,
            "attention_bias": false,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
        })
    }

    /// Refuses a drafter that does not fit this target: a drafter of a hybrid is a Qwen3-layout
    /// stack of its own heads (spec section 10), sharing the hidden size, the vocabulary and the
    /// layer count its features come from.
    pub fn check_drafter(&self, drafter: &DraftConfig) -> Result<()> {
        drafter.check_sizes(
            &[
                ("hidden_size", drafter.dims.hidden_size, self.hidden_size),
                ("vocab_size", drafter.dims.vocab_size, self.vocab_size),
                ("num_target_layers", drafter.num_target_layers, self.num_layers()),
            ],
            self.vocab_size,
        )
    }

    /// Checks the checkpoint in `dir` against this config from its safetensors headers alone
    /// (`io::check_checkpoint`, names in this config's layout): returns the tensors the text model
    /// does not use (`mtp.*`, `model.visual.*`, a tied model's `lm_head.weight`), sorted; any
    /// other tensor it does not have is refused, naming it.
    pub fn check_checkpoint(&self, dir: &Path) -> Result<Vec<String>> {
        let expected: Vec<(String, Vec<usize>)> = super::hybrid_param_shapes(self)
            .into_iter()
            .map(|(name, shape)| (self.layout.checkpoint_name(&name), shape))
            .collect();
        let left_out = |n: &str| HybridLayout::is_ignored(n) || (self.tie_word_embeddings && n == "lm_head.weight");
        crate::io::check_checkpoint(dir, &expected, |n| {
            (!left_out(n)).then(|| format!("not a weight of this {:?}-layout Qwen3.5 text model", self.layout))
        })
    }

    /// Writes the text-layout `config.json` atomically.
    pub fn save(&self, file: &Path) -> Result<()> {
        let text =
            serde_json::to_string_pretty(&self.to_value()).map_err(|e| Error::invalid("config", e.to_string()))?;
        write_atomically(file, |w| w.write_all(text.as_bytes()))
    }
}

/// Checks `model_type` and `architectures` (each optional) of one level of the config.
fn check_names(f: &Fields, model_type: &str, architecture: &str) -> Result<()> {
    if let Some(found) = f.opt_str("model_type")? {
        if found != model_type {
            return Err(f.error("model_type", format!("`{found}` is not supported here (expected `{model_type}`)")));
        }
    }
    if let Some(archs) = f.opt_str_list("architectures")? {
        if archs.first().map(String::as_str) != Some(architecture) {
            return Err(f.error("architectures", format!("{archs:?}: expected [\"{architecture}\"]")));
        }
    }
    Ok(())
}

/// `layer_types`, or else `full_attention_interval` (default 4). When both are given they must agree.
fn parse_layer_kinds(f: &Fields) -> Result<Vec<HybridLayerKind>> {
    let num_layers = crate::config::num_layers(f)?;
    let interval = f.opt_usize("full_attention_interval")?;
    if interval == Some(0) {
        return Err(f.error("full_attention_interval", "must be at least 1"));
    }
    let Some(types) = f.opt_str_list("layer_types")? else {
        return Ok(interval_layer_kinds(num_layers, interval.unwrap_or(DEFAULT_FULL_ATTENTION_INTERVAL)));
    };
    if types.len() != num_layers {
        return Err(
            f.error("layer_types", format!("has {} entries but num_hidden_layers is {num_layers}", types.len()))
        );
    }
    let kinds = types
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            "linear_attention" => Ok(HybridLayerKind::Linear),
            "full_attention" => Ok(HybridLayerKind::Full),
            other => Err(f.error(
                &format!("layer_types[{i}]"),
                format!("unknown layer type `{other}` (expected linear_attention or full_attention)"),
            )),
        })
        .collect::<Result<Vec<_>>>()?;
    if let Some(interval) = interval {
        if interval_layer_kinds(num_layers, interval) != kinds {
            return Err(f.error(
                "full_attention_interval",
                format!("{interval} disagrees with layer_types (layer i is full iff (i+1) % interval == 0)"),
            ));
        }
    }
    Ok(kinds)
}

/// The RoPE fields: `rope_parameters` (transformers 5) or `rope_scaling` (older), and the
/// top-level `rope_theta`, `partial_rotary_factor`, `mrope_section`, `mrope_interleaved`. A field
/// given in two places must agree; a RoPE type other than `default` (or `mrope`, its older name
/// for the same frequencies) and any unknown key inside the RoPE object are refused, naming them.
fn parse_rope(f: &Fields, head_dim: usize) -> Result<HybridRope> {
    const KNOWN: [&str; 6] =
        ["rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"];
    let objects: Vec<Fields> = ["rope_parameters", "rope_scaling"]
        .iter()
        .map(|key| f.object(key))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect();
    // The type first: a scaling's own fields (YaRN's `factor`) are then named by their type.
    for sub in &objects {
        for kind_key in ["rope_type", "type"] {
            if let Some(kind) = sub.opt_str(kind_key)? {
                if kind != "default" && kind != "mrope" {
                    return Err(sub.error(
                        kind_key,
                        format!(
                            "unsupported RoPE type `{kind}` (the hybrid target implements `default` only: remove a \
                             long-context scaling block from the config to train at its native length)"
                        ),
                    ));
                }
            }
        }
        if let Some(unknown) = sub.keys().into_iter().find(|k| !KNOWN.contains(k)) {
            return Err(sub.error(unknown, "unknown RoPE field (not implemented for the hybrid target)"));
        }
    }
    // Every place a field may be given, the top level first; all that are given must agree.
    let places =
        |key: &str| -> Vec<&Fields> { std::iter::once(f).chain(objects.iter()).filter(|o| o.has(key)).collect() };
    let agreed_f64 = |key: &str| -> Result<Option<f64>> {
        let mut seen: Option<f64> = None;
        for o in places(key) {
            let v = o.f64(key)?;
            match seen {
                Some(prev) if prev != v => {
                    return Err(o.error(key, format!("{v} disagrees with {prev} given elsewhere in the config")))
                }
                _ => seen = Some(v),
            }
        }
        Ok(seen)
    };
    let theta = agreed_f64("rope_theta")?.unwrap_or(DEFAULT_ROPE_THETA);
    if !(theta.is_finite() && theta > 1.0) {
        let at = places("rope_theta").into_iter().last().unwrap_or(f);
        return Err(at.error("rope_theta", format!("{theta} must be finite and above 1")));
    }
    let factor = agreed_f64("partial_rotary_factor")?.unwrap_or(DEFAULT_PARTIAL_ROTARY_FACTOR);
    let at = places("partial_rotary_factor").into_iter().last().unwrap_or(f);
    let rotated = head_dim as f64 * factor;
    if !(factor > 0.0 && factor <= 1.0) || rotated.fract() != 0.0 || !(rotated as usize).is_multiple_of(2) {
        return Err(at.error(
            "partial_rotary_factor",
            format!("{factor}: head_dim {head_dim} * factor must be a positive even integer at most head_dim"),
        ));
    }
    let rotary_dim = rotated as usize;
    let mut mrope_section = None;
    for o in places("mrope_section") {
        let section = o.opt_usize_list("mrope_section")?.unwrap_or_default();
        if section.iter().sum::<usize>() != rotary_dim / 2 {
            return Err(o.error(
                "mrope_section",
                format!("{section:?} must sum to rotary_dim / 2 = {} (one entry per frequency)", rotary_dim / 2),
            ));
        }
        if mrope_section.as_ref().is_some_and(|prev| prev != &section) {
            return Err(
                o.error("mrope_section", format!("{section:?} disagrees with {mrope_section:?} given elsewhere"))
            );
        }
        mrope_section = Some(section);
    }
    let mut mrope_interleaved = None;
    for o in places("mrope_interleaved") {
        let v = o.opt_bool("mrope_interleaved")?;
        if mrope_interleaved.is_some() && mrope_interleaved != v {
            return Err(o.error("mrope_interleaved", "disagrees with the value given elsewhere"));
        }
        mrope_interleaved = v;
    }
    Ok(HybridRope { theta, partial_rotary_factor: factor, rotary_dim, mrope_section, mrope_interleaved })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> &'static Path {
        Path::new("config.json")
    }

    /// A small Qwen3.5 text config in the published shape (27B names, tiny sizes).
    fn text() -> Value {
        json!({
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "vocab_size": 96,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "full_attention_interval": 4,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1], "mrope_interleaved": true},
            "attn_output_gate": true, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
            "mamba_ssm_dtype": "float32",
        })
    }

    fn parse(value: &Value) -> Result<HybridConfig> {
        HybridConfig::from_value(file(), value)
    }

    /// The error text of parsing `value`, which must fail.
    fn refused(value: &Value) -> String {
        parse(value).expect_err("the config must be refused").to_string()
    }

    use HybridLayerKind::{Full, Linear};

    #[test]
    fn text_config_parses() {
        let c = parse(&text()).unwrap();
        assert_eq!(c.layout, HybridLayout::Text);
        assert_eq!(c.layer_kinds, [Linear, Linear, Linear, Full]);
        assert_eq!(
            c.gdn,
            GdnDims { conv_kernel: 4, num_key_heads: 2, num_value_heads: 4, key_head_dim: 8, value_head_dim: 16 }
        );
        assert_eq!((c.gdn.conv_dim(), c.gdn.group_size()), (2 * 16 + 64, 2));
        assert_eq!((c.head_dim, c.num_heads, c.num_kv_heads, c.group_size()), (32, 4, 2, 2));
        assert_eq!(
            c.rope,
            HybridRope {
                theta: 1e7,
                partial_rotary_factor: 0.25,
                rotary_dim: 8,
                mrope_section: Some(vec![2, 1, 1]),
                mrope_interleaved: Some(true)
            }
        );
        assert!(!c.tie_word_embeddings);
        // What `to_value` writes reads back the same.
        assert_eq!(parse(&c.to_value()).unwrap(), c);
    }

    #[test]
    fn wrapper_config_parses_the_nested_text_config() {
        let wrapped = json!({
            "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": text(), "vision_config": {"depth": 1}, "tie_word_embeddings": false,
        });
        let mut wrapped_text = wrapped.clone();
        wrapped_text["text_config"].as_object_mut().unwrap().remove("architectures");
        let c = parse(&wrapped_text).unwrap();
        assert_eq!(c.layout, HybridLayout::Wrapped);
        assert_eq!(HybridConfig { layout: HybridLayout::Text, ..c.clone() }, parse(&text()).unwrap());
        assert_eq!(
            c.layout.checkpoint_name("model.layers.0.linear_attn.A_log"),
            "model.language_model.layers.0.linear_attn.A_log"
        );
        assert_eq!(c.layout.checkpoint_name("lm_head.weight"), "lm_head.weight");
        // The nested architectures, if any, name the text model.
        assert_eq!(parse(&wrapped).unwrap(), c);
        let mut nested_wrong = wrapped.clone();
        nested_wrong["text_config"]["architectures"] = json!(["Qwen3NextForCausalLM"]);
        let err = refused(&nested_wrong);
        assert!(err.contains("`text_config.architectures`"), "{err}");
        let mut disagree = wrapped_text.clone();
        disagree["tie_word_embeddings"] = json!(true);
        let err = refused(&disagree);
        assert!(
            err.contains("`tie_word_embeddings`") && err.contains("text_config.tie_word_embeddings is false"),
            "{err}"
        );
        let mut moe = wrapped_text;
        moe["text_config"]["model_type"] = json!("qwen3_5_moe_text");
        assert!(refused(&moe).contains("text_config.model_type"));
    }

    #[test]
    fn interval_gives_the_layer_kinds() {
        let mut v = text();
        v.as_object_mut().unwrap().remove("layer_types");
        v["num_hidden_layers"] = json!(8);
        assert_eq!(parse(&v).unwrap().layer_kinds, [Linear, Linear, Linear, Full, Linear, Linear, Linear, Full]);
        v["full_attention_interval"] = json!(2);
        assert_eq!(parse(&v).unwrap().layer_kinds, [Linear, Full, Linear, Full, Linear, Full, Linear, Full]);
        v.as_object_mut().unwrap().remove("full_attention_interval");
        v["num_hidden_layers"] = json!(4);
        assert_eq!(parse(&v).unwrap().layer_kinds, [Linear, Linear, Linear, Full], "default interval 4");
    }

    #[test]
    fn bad_layer_fields_are_refused() {
        let cases: [(&str, Value, &str); 5] = [
            ("layer_types", json!(["linear_attention"]), "has 1 entries"),
            ("layer_types", json!(["linear_attention", "sliding_attention", "x", "y"]), "layer_types[1]"),
            ("full_attention_interval", json!(2), "disagrees with layer_types"),
            ("full_attention_interval", json!(0), "at least 1"),
            ("linear_num_value_heads", json!(3), "not a multiple of linear_num_key_heads"),
        ];
        for (key, value, want) in cases {
            let mut v = text();
            v[key] = value;
            let err = refused(&v);
            assert!(err.contains(&format!("`{}", key)) && err.contains(want) && err.contains("config.json"), "{err}");
        }
        for (key, value) in
            [("attn_output_gate", json!(false)), ("hidden_act", json!("gelu")), ("attention_bias", json!(true))]
        {
            let mut v = text();
            v[key] = value;
            assert!(refused(&v).contains(&format!("`{key}`")));
        }
        let mut v = text();
        v.as_object_mut().unwrap().remove("linear_key_head_dim");
        assert!(refused(&v).contains("`linear_key_head_dim`: missing"));
    }

    #[test]
    fn rope_fields_are_parsed_from_every_place() {
        // Legacy layout: theta and factor at the top level, no rope object.
        let mut v = text();
        let obj = v.as_object_mut().unwrap();
        obj.remove("rope_parameters");
        obj.insert("rope_theta".into(), json!(5e6));
        obj.insert("partial_rotary_factor".into(), json!(0.5));
        let rope = parse(&v).unwrap().rope;
        assert_eq!((rope.theta, rope.partial_rotary_factor, rope.rotary_dim), (5e6, 0.5, 16));
        // Absent everywhere: transformers' defaults (theta 1e4, factor 0.25).
        let mut v = text();
        v["rope_parameters"] = json!({"rope_type": "default"});
        let rope = parse(&v).unwrap().rope;
        assert_eq!((rope.theta, rope.partial_rotary_factor, rope.rotary_dim), (1e4, 0.25, 8));
        // An older multimodal `rope_scaling` naming the same frequencies `mrope`.
        let mut v = text();
        v["rope_scaling"] = json!({"type": "mrope", "mrope_section": [2, 1, 1]});
        assert_eq!(parse(&v).unwrap().rope.mrope_section, Some(vec![2, 1, 1]));
    }

    #[test]
    fn bad_or_unknown_rope_fields_are_refused() {
        let cases: [(Value, &str); 9] = [
            (json!({"rope_type": "yarn", "factor": 4.0}), "rope_parameters.rope_type`: unsupported RoPE type `yarn`"),
            (json!({"rope_type": "yarn"}), "rope_parameters.rope_type`: unsupported RoPE type `yarn`"),
            (json!({"type": "linear"}), "rope_parameters.type`: unsupported RoPE type `linear`"),
            (json!({"rope_theta": 1e7, "attention_factor": 1.0}), "rope_parameters.attention_factor`: unknown"),
            (json!({"partial_rotary_factor": 0.3}), "partial_rotary_factor`: 0.3"),
            (json!({"partial_rotary_factor": 0.0}), "partial_rotary_factor`: 0"),
            (json!({"partial_rotary_factor": 1.5}), "partial_rotary_factor`: 1.5"),
            (json!({"rope_theta": 0.5}), "rope_parameters.rope_theta`: 0.5 must be finite and above 1"),
            (json!({"mrope_section": [11, 11, 10]}), "rope_parameters.mrope_section`: [11, 11, 10] must sum to"),
        ];
        for (rope, want) in cases {
            let mut v = text();
            v["rope_parameters"] = rope;
            let err = refused(&v);
            assert!(err.contains(want) && err.contains("config.json"), "{err} (wanted {want})");
        }
        // The same field in two places must agree.
        let mut v = text();
        v["rope_theta"] = json!(1e6);
        assert!(refused(&v).contains("rope_parameters.rope_theta`: 10000000 disagrees with 1000000"));
        // Nested in the wrapper, the path says so.
        let mut t = text();
        t.as_object_mut().unwrap().remove("architectures");
        t["rope_parameters"]["beta_fast"] = json!(32);
        let err = refused(&json!({"model_type": "qwen3_5", "text_config": t}));
        assert!(err.contains("`text_config.rope_parameters.beta_fast`: unknown RoPE field"), "{err}");
    }
}
