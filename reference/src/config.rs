//! Drafter and target configs, read from and written to HF `config.json` (spec section 1).

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::error::{Error, Result};
use crate::io::write_atomically;
use crate::json_fields::{read_json, Fields};
use std::io::Write;

/// The attention kind of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttnKind {
    /// `full_attention`.
    Full,
    /// `sliding_attention` with a window of `window` positions (the query's own included).
    Sliding { window: usize },
}

/// Dimensions shared by the target and the drafter (a Qwen3 / Llama decoder stack).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelDims {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    /// One entry per decoder layer; its length is the number of layers. All sliding layers
    /// share one window (HF's `config.json` has a single `sliding_window`).
    pub layer_kinds: Vec<AttnKind>,
}

impl ModelDims {
    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layer_kinds.len()
    }

    /// Query heads per K/V head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    fn parse(f: &Fields) -> Result<Self> {
        let hidden_size = f.positive("hidden_size")?;
        let num_layers = num_layers(f)?;
        let num_heads = f.positive("num_attention_heads")?;
        let num_kv_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(num_heads);
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(f.error(
                "num_key_value_heads",
                format!("{num_kv_heads} does not divide num_attention_heads {num_heads}"),
            ));
        }
        let head_dim = match f.opt_usize("head_dim")? {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(f.error("head_dim", "missing, and hidden_size is not a multiple of num_attention_heads"))
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(f.error("head_dim", format!("{head_dim} must be even and positive (RoPE rotates halves)")));
        }
        if let Some(act) = f.opt_str("hidden_act")? {
            if act != "silu" {
                return Err(f.error("hidden_act", format!("unsupported activation `{act}` (only `silu`)")));
            }
        }
        let max_position_embeddings = match f.has("max_position_embeddings") {
            true => f.positive("max_position_embeddings")?,
            false => 32768,
        };
        let rms_norm_eps = f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6);
        if rms_norm_eps <= 0.0 {
            return Err(f.error("rms_norm_eps", "must be positive"));
        }
        Ok(ModelDims {
            hidden_size,
            intermediate_size: f.positive("intermediate_size")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: f.positive("vocab_size")?,
            rms_norm_eps,
            rope_theta: parse_rope(f, max_position_embeddings)?.0,
            max_position_embeddings,
            layer_kinds: parse_layer_kinds(f, num_layers)?,
        })
    }

    fn write(&self, out: &mut Map<String, Value>) {
        let sliding_window = self.layer_kinds.iter().find_map(|k| match k {
            AttnKind::Sliding { window } => Some(*window),
            AttnKind::Full => None,
        });
        let layer_types: Vec<&str> = self
            .layer_kinds
            .iter()
            .map(|k| match k {
                AttnKind::Full => "full_attention",
                AttnKind::Sliding { .. } => "sliding_attention",
            })
            .collect();
        let fields = json!({
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers(),
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "layer_types": layer_types,
            "sliding_window": sliding_window,
            // transformers' Qwen3 keeps `sliding_window` only with `use_sliding_window` (else its
            // sliding layers run full attention); the window applies to the layers `layer_types`
            // names, `max_window_layers` counting them all, as the published drafters write it.
            "use_sliding_window": sliding_window.is_some(),
            "max_window_layers": self.num_layers(),
        });
        out.extend(fields.as_object().expect("json! object").clone());
    }
}

/// The RoPE scaling of a target config (`rope_scaling` in transformers 4, `rope_parameters` in 5),
/// as transformers computes it (`modeling_rope_utils`): each variant changes the inverse
/// frequencies `theta^(-2i/d)`, and yarn also scales cos and sin.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    Default,
    /// Every inverse frequency divided by `factor`.
    Linear {
        factor: f64,
    },
    /// Llama 3.1: wavelengths above `original / low_freq_factor` divided by `factor`, below
    /// `original / high_freq_factor` kept, smoothly interpolated between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN: interpolated (`/ factor`) and extrapolated frequencies blended by a linear ramp over
    /// the dims between the `beta_fast` and `beta_slow` correction dims; cos and sin scaled by
    /// `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        truncate: bool,
    },
}

impl RopeScaling {
    /// The `d/2` inverse frequencies for head dim `d` and base `theta`.
    pub fn inv_freq(&self, head_dim: usize, theta: f64) -> Vec<f64> {
        let d = head_dim as f64;
        let base: Vec<f64> = (0..head_dim / 2).map(|i| theta.powf(-2.0 * i as f64 / d)).collect();
        match *self {
            RopeScaling::Default => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
            RopeScaling::Yarn {
                factor, original_max_position_embeddings: old, beta_fast, beta_slow, truncate, ..
            } => {
                // The dim at which a frequency turns `rotations` times over the original context.
                let correction_dim =
                    |rotations: f64| d * (old / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
                if low == high {
                    high += 0.001;
                }
                base.iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        let extrapolation = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        f / factor * (1.0 - extrapolation) + f * extrapolation
                    })
                    .collect()
            }
        }
    }

    /// The factor cos and sin are multiplied by (1 except for yarn).
    pub fn attention_factor(&self) -> f64 {
        match *self {
            RopeScaling::Yarn { attention_factor, .. } => attention_factor,
            _ => 1.0,
        }
    }

    /// The `rope_scaling` object of a config file, or `None` for the default.
    fn to_value(&self) -> Option<Value> {
        match *self {
            RopeScaling::Default => None,
            RopeScaling::Linear { factor } => Some(json!({"rope_type": "linear", "factor": factor})),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                Some(json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": original_max_position_embeddings}))
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => Some(json!({"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": original_max_position_embeddings, "beta_fast": beta_fast,
                "beta_slow": beta_slow, "attention_factor": attention_factor, "truncate": truncate})),
        }
    }
}

/// `rope_theta` and the RoPE scaling: in `rope_scaling` (transformers 4, theta at the top level)
/// or `rope_parameters` (transformers 5, theta inside). A theta inside either object wins over
/// the top level's, as transformers reads it; two objects must agree on both. Variants other
/// than `default`, `linear`, `llama3` and `yarn` (and a partial rotary factor) are refused,
/// naming the key.
fn parse_rope(f: &Fields, max_position_embeddings: usize) -> Result<(f64, RopeScaling)> {
    // A factor at the top level too (transformers moves it into `rope_parameters`).
    let full_rotation = |f: &Fields| -> Result<()> {
        match f.opt_f64("partial_rotary_factor")? {
            Some(p) if p != 1.0 => {
                Err(f.error("partial_rotary_factor", format!("{p}: only 1 (full rotation) is supported")))
            }
            _ => Ok(()),
        }
    };
    full_rotation(f)?;
    let mut theta = f.opt_f64("rope_theta")?;
    let mut inner_theta: Option<(&str, f64)> = None;
    let mut scaling = RopeScaling::Default;
    let mut seen: Option<(&str, RopeScaling)> = None;
    for key in ["rope_scaling", "rope_parameters"] {
        let Some(sub) = f.object(key)? else { continue };
        if let Some(t) = sub.opt_f64("rope_theta")? {
            if let Some((first, earlier)) = inner_theta.filter(|&(_, earlier)| earlier != t) {
                return Err(sub.error("rope_theta", format!("{t} disagrees with `{first}.rope_theta` {earlier}")));
            }
            inner_theta = Some((key, t));
            theta = Some(t);
        }
        full_rotation(&sub)?;
        // The error names the key the file actually uses (`type` in older configs).
        let (kind_key, kind) = match (sub.opt_str("rope_type")?, sub.opt_str("type")?) {
            (Some(kind), _) => ("rope_type", kind),
            (None, Some(kind)) => ("type", kind),
            // A scaling factor without its type: which scaling it means is unknown.
            (None, None) if sub.has("factor") => {
                return Err(sub.error("rope_type", "missing beside `factor` (linear, llama3 or yarn?)"))
            }
            (None, None) => ("rope_type", "default"),
        };
        let positive = |name: &str| -> Result<f64> {
            let v = sub.f64(name)?;
            if v.is_finite() && v > 0.0 {
                Ok(v)
            } else {
                Err(sub.error(name, format!("{v} must be positive and finite")))
            }
        };
        let original = || -> Result<f64> {
            match sub.opt_f64("original_max_position_embeddings")? {
                Some(_) => positive("original_max_position_embeddings"),
                None => Ok(max_position_embeddings as f64),
            }
        };
        scaling = match kind {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear { factor: positive("factor")? },
            "llama3" => {
                let (low, high) = (positive("low_freq_factor")?, positive("high_freq_factor")?);
                if high <= low {
                    return Err(sub.error("high_freq_factor", format!("{high} must exceed low_freq_factor {low}")));
                }
                RopeScaling::Llama3 {
                    factor: positive("factor")?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: original()?,
                }
            }
            "yarn" => {
                let old = original()?;
                let factor = match sub.opt_f64("factor")? {
                    Some(_) => positive("factor")?,
                    None => max_position_embeddings as f64 / old,
                };
                let mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
                let attention_factor = match (
                    sub.opt_f64("attention_factor")?,
                    sub.opt_f64("mscale")?.filter(|&m| m != 0.0),
                    sub.opt_f64("mscale_all_dim")?.filter(|&m| m != 0.0),
                ) {
                    (Some(_), _, _) => positive("attention_factor")?,
                    (None, Some(m), Some(all)) => mscale(factor, m) / mscale(factor, all),
                    _ => mscale(factor, 1.0),
                };
                let beta = |name: &str, default: f64| -> Result<f64> {
                    Ok(match sub.opt_f64(name)? {
                        Some(v) if v != 0.0 => positive(name)?,
                        _ => default,
                    })
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: old,
                    beta_fast: beta("beta_fast", 32.0)?,
                    beta_slow: beta("beta_slow", 1.0)?,
                    attention_factor,
                    truncate: sub.opt_bool("truncate")?.unwrap_or(true),
                }
            }
            other => {
                return Err(sub.error(
                    kind_key,
                    format!("unsupported RoPE scaling `{other}` (supported: default, linear, llama3, yarn)"),
                ))
            }
        };
        // Both keys (transformers 4's and 5's): they must say the same.
        if let Some((first, earlier)) = seen.take().filter(|(_, earlier)| earlier != &scaling) {
            return Err(f.error(key, format!("{scaling:?} disagrees with `{first}`'s {earlier:?}")));
        }
        seen = Some((key, scaling.clone()));
    }
    let theta = theta.unwrap_or(10000.0);
    if !(theta.is_finite() && theta > 1.0) {
        return Err(f.error("rope_theta", format!("{theta} must be finite and above 1")));
    }
    Ok((theta, scaling))
}

/// transformers' Qwen3 default of `max_window_layers`.
const QWEN3_MAX_WINDOW_LAYERS: usize = 28;

/// Each layer's attention: `layer_types`; without it, as transformers' Qwen3 derives them, the
/// layers from `max_window_layers` (default 28) on slide over `sliding_window` when
/// `use_sliding_window` is true and a window is set, and every layer is full otherwise.
fn parse_layer_kinds(f: &Fields, num_layers: usize) -> Result<Vec<AttnKind>> {
    let Some(types) = f.opt_str_list("layer_types")? else {
        if f.opt_bool("use_sliding_window")? != Some(true) {
            return Ok(vec![AttnKind::Full; num_layers]);
        }
        // transformers keeps no window when `sliding_window` is null: every layer full then.
        let Some(window) = f.opt_usize("sliding_window")?.filter(|&w| w > 0) else {
            return Ok(vec![AttnKind::Full; num_layers]);
        };
        let from = f.opt_usize("max_window_layers")?.unwrap_or(QWEN3_MAX_WINDOW_LAYERS);
        return Ok((0..num_layers)
            .map(|i| if i >= from { AttnKind::Sliding { window } } else { AttnKind::Full })
            .collect());
    };
    if types.len() != num_layers {
        return Err(
            f.error("layer_types", format!("has {} entries but num_hidden_layers is {num_layers}", types.len()))
        );
    }
    types
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            "full_attention" => Ok(AttnKind::Full),
            // transformers drops the window when `use_sliding_window` is false: refused rather
            // than read two ways (files without the key, as this project wrote before, are read
            // with their window).
            "sliding_attention" if f.opt_bool("use_sliding_window")? == Some(false) => Err(f.error(
                "use_sliding_window",
                format!(
                    "false, but layer_types[{i}] is sliding_attention (transformers would run it as full attention)"
                ),
            )),
            "sliding_attention" => match f.opt_usize("sliding_window")? {
                Some(window) if window > 0 => Ok(AttnKind::Sliding { window }),
                _ => Err(f.error(
                    "sliding_window",
                    format!("layer_types[{i}] is sliding_attention but no positive sliding_window is set"),
                )),
            },
            other => Err(f.error(&format!("layer_types[{i}]"), format!("unknown layer type `{other}`"))),
        })
        .collect()
}

/// The most layers a config may have: 4096, 32 times the deepest published model's (Llama 3.1
/// 405B: 126), so that an absurd count is an error naming it, not an allocation abort.
pub const MAX_LAYERS: usize = 1 << 12;

/// `num_hidden_layers`, at least 1 and at most [`MAX_LAYERS`].
pub(crate) fn num_layers(f: &Fields) -> Result<usize> {
    let n = f.positive("num_hidden_layers")?;
    if n > MAX_LAYERS {
        return Err(f.error("num_hidden_layers", format!("{n} is above the {MAX_LAYERS} layers a config may have")));
    }
    Ok(n)
}

/// The spec's default `target_layer_ids` for `num_target_layers` layers and `n` features:
/// `n == 1 -> [L/2]`, else `round(1 + i*(L-4)/(n-1))`, halves to even as Python's `round` in the
/// upstream helper that serving engines run when a drafter's config omits the ids (34 layers:
/// [1, 8, 16, 24, 31]; away from zero would tap layer 9 where they feed layer 8).
pub fn default_target_layer_ids(num_target_layers: usize, n: usize) -> Vec<usize> {
    if n == 1 {
        return vec![num_target_layers / 2];
    }
    let span = num_target_layers as f64 - 4.0;
    (0..n).map(|i| (1.0 + i as f64 * span / (n - 1) as f64).round_ties_even().max(0.0) as usize).collect()
}

/// The feature layers a drafter may tap in a target of `num_target_layers` layers: below its last
/// layer, whose output serving engines do not see as we do (transformers' last hidden state is
/// after the final norm; the features are the layers' outputs before it).
pub fn max_feature_layer(num_target_layers: usize) -> Option<usize> {
    num_target_layers.checked_sub(2)
}

/// The target layers a new drafter of `n` features is trained on (fewer when the target has
/// fewer layers up to [`max_feature_layer`]): the spec's rule ([`default_target_layer_ids`]) where it gives `n`
/// increasing layers up to [`max_feature_layer`], as for every published target; on targets of a
/// few layers, where the rule repeats or reorders layers, `n` layers spread evenly from the first
/// to [`max_feature_layer`], each once.
pub fn training_target_layer_ids(num_target_layers: usize, n: usize) -> Vec<usize> {
    let Some(top) = max_feature_layer(num_target_layers) else { return Vec::new() };
    let n = n.min(top + 1);
    let rule = default_target_layer_ids(num_target_layers, n);
    if rule.windows(2).all(|p| p[0] < p[1]) && rule.iter().all(|&l| l <= top) {
        return rule;
    }
    (0..n).map(|i| (i as f64 * top as f64 / (n.max(2) - 1) as f64).round() as usize).collect()
}

/// Checks feature layer ids chosen for a target of `num_target_layers` layers, as serving
/// engines read them: at least one; each at most [`max_feature_layer`]; increasing (the engines
/// concatenate the features in layer order whatever the list's). The message names the bad id.
pub fn check_feature_layers(ids: &[usize], num_target_layers: usize) -> std::result::Result<(), String> {
    let Some(top) = max_feature_layer(num_target_layers) else {
        return Err(format!("a target of {num_target_layers} layer has no layer below its last to tap"));
    };
    if ids.is_empty() {
        return Err("no layer given".into());
    }
    if let Some(bad) = ids.iter().find(|&&l| l >= num_target_layers) {
        return Err(format!("layer {bad} is out of range for the target's {num_target_layers} layers"));
    }
    if let Some(bad) = ids.iter().find(|&&l| l > top) {
        return Err(format!(
            "layer {bad} is the target's last: engines serve its output after the final norm, which the drafter never saw; take layers up to {top}"
        ));
    }
    if let Some(p) = ids.windows(2).find(|p| p[0] >= p[1]) {
        return Err(match p[0] == p[1] {
            true => format!("layer {} is given twice", p[0]),
            false => format!(
                "{} before {}: give the layers in increasing order (engines concatenate the features in layer order)",
                p[0], p[1]
            ),
        });
    }
    Ok(())
}

/// The DFlash drafter's config (`DFlashDraftModel`, `model_type: qwen3`).
#[derive(Clone, Debug, PartialEq)]
pub struct DraftConfig {
    pub dims: ModelDims,
    /// Tokens per drafted block `B` (anchor included).
    pub block_size: usize,
    /// Number of decoder layers of the target the features come from.
    pub num_target_layers: usize,
    pub mask_token_id: u32,
    /// Target layers whose outputs are concatenated into the context features (length `F`).
    pub target_layer_ids: Vec<usize>,
}

/// The architecture of a supported target model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetArch {
    /// `Qwen3ForCausalLM`: per-head q/k RMSNorm.
    Qwen3,
    /// `LlamaForCausalLM`: no q/k norm.
    Llama,
    /// `Qwen3MoeForCausalLM`: Qwen3's attention with sparse MoE MLPs, which this project does
    /// not run: its sizes derive the drafter, its tables are the drafter's, and its features
    /// come from a cache written by transformers (`xtask/scripts/features_transformers.py`).
    Qwen3Moe,
}

impl TargetArch {
    /// The HF `architectures[0]` name.
    pub fn hf_name(self) -> &'static str {
        match self {
            TargetArch::Qwen3 => "Qwen3ForCausalLM",
            TargetArch::Llama => "LlamaForCausalLM",
            TargetArch::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }

    fn model_type(self) -> &'static str {
        match self {
            TargetArch::Qwen3 => "qwen3",
            TargetArch::Llama => "llama",
            TargetArch::Qwen3Moe => "qwen3_moe",
        }
    }

    /// Whether its attention norms q and k per head (Qwen3's, dense or MoE).
    pub fn has_qk_norm(self) -> bool {
        matches!(self, TargetArch::Qwen3 | TargetArch::Qwen3Moe)
    }

    /// Whether this project runs the architecture's forward (an MoE target's features come
    /// from a feature cache only).
    pub fn runs_here(self) -> bool {
        self != TargetArch::Qwen3Moe
    }
}

impl TargetConfig {
    /// Refuses `what` (work that runs the target's forward) on a target whose forward this
    /// project does not run, saying how to train from it instead.
    pub fn check_runs_here(&self, what: &str) -> Result<()> {
        match self.arch.runs_here() {
            true => Ok(()),
            false => Err(Error::invalid(
                "target",
                format!(
                    "{what} needs the forward of {} (a sparse MoE), which this project does not run: its drafters train from features written by transformers (`features --export-documents`, then `xtask/scripts/features_transformers.py`; README), with `train --features CACHE --tau-prompts 0`",
                    self.arch.hf_name()
                ),
            )),
        }
    }
}

/// A Qwen3 or Llama target model's config (dense; or a Qwen3 MoE, known by its sizes only).
#[derive(Clone, Debug, PartialEq)]
pub struct TargetConfig {
    pub arch: TargetArch,
    pub dims: ModelDims,
    pub tie_word_embeddings: bool,
    /// The target's RoPE variant (its theta is `dims.rope_theta`).
    pub rope_scaling: RopeScaling,
}

impl DraftConfig {
    /// A drafter for `target`: the target's dims with `num_layers` full-attention layers,
    /// features from [`training_target_layer_ids`] for `num_features` features (a one-layer
    /// target, which only tests build, has none below its last: its only layer).
    pub fn for_target(
        target: &TargetConfig,
        num_layers: usize,
        block_size: usize,
        mask_token_id: u32,
        num_features: usize,
    ) -> Self {
        let mut dims = target.dims.clone();
        dims.layer_kinds = vec![AttnKind::Full; num_layers];
        let num_target_layers = target.dims.num_layers();
        DraftConfig {
            dims,
            block_size,
            num_target_layers,
            mask_token_id,
            target_layer_ids: match training_target_layer_ids(num_target_layers, num_features) {
                ids if ids.is_empty() => vec![0],
                ids => ids,
            },
        }
    }

    /// Checks that this drafter fits `target`: the same hidden size, attention heads, head size
    /// and vocabulary (the drafter copies the target's dims and shares its embedding and LM head),
    /// features from a target of `num_target_layers` layers, and the mask token inside the vocab.
    /// Each mismatch names both sides.
    pub fn check_target(&self, target: &TargetConfig) -> Result<()> {
        let (d, t) = (&self.dims, &target.dims);
        self.check_sizes(
            &[
                ("hidden_size", d.hidden_size, t.hidden_size),
                ("num_attention_heads", d.num_heads, t.num_heads),
                ("num_key_value_heads", d.num_kv_heads, t.num_kv_heads),
                ("head_dim", d.head_dim, t.head_dim),
                ("vocab_size", d.vocab_size, t.vocab_size),
                ("num_target_layers", self.num_target_layers, t.num_layers()),
            ],
            t.vocab_size,
        )
    }

    /// Refuses the first of `pairs` (name, this drafter's size, the target's) that differ, and a
    /// mask token not below the target's `vocab`; each mismatch names both sides.
    pub fn check_sizes(&self, pairs: &[(&str, usize, usize)], vocab: usize) -> Result<()> {
        if let Some((name, ours, theirs)) = pairs.iter().find(|(_, a, b)| a != b) {
            return Err(Error::invalid(
                "drafter config",
                format!("{name} {ours} but the target's is {theirs} (the drafter must match its target)"),
            ));
        }
        if self.mask_token_id as usize >= vocab {
            return Err(Error::invalid(
                "drafter config",
                format!("mask_token_id {} is not below the target's vocab_size {vocab}", self.mask_token_id),
            ));
        }
        Ok(())
    }

    /// Number of target features `F` concatenated per token.
    pub fn num_features(&self) -> usize {
        self.target_layer_ids.len()
    }

    /// Reads and validates a drafter `config.json`.
    pub fn from_file(file: &Path) -> Result<Self> {
        let value = read_json(file)?;
        Self::from_value(file, &value)
    }

    /// Validates a parsed drafter config; `file` names the source in errors.
    pub fn from_value(file: &Path, value: &Value) -> Result<Self> {
        let f = Fields::top(file, value)?;
        if let Some(archs) = f.opt_str_list("architectures")? {
            if !archs.iter().any(|a| a == "DFlashDraftModel") {
                return Err(
                    f.error("architectures", format!("{archs:?} is not a DFlash drafter (expected DFlashDraftModel)"))
                );
            }
        }
        let dims = ModelDims::parse(&f)?;
        if parse_rope(&f, dims.max_position_embeddings)?.1 != RopeScaling::Default {
            let key = if f.has("rope_parameters") { "rope_parameters" } else { "rope_scaling" };
            return Err(f.error(key, "a drafter's RoPE must be the default (no scaling)"));
        }
        let block_size = f.opt_usize("block_size")?.unwrap_or(16);
        if block_size < 2 {
            return Err(
                f.error("block_size", format!("{block_size} must be at least 2 (anchor plus one drafted token)"))
            );
        }
        let num_target_layers = f.positive("num_target_layers")?;
        let dflash = f.object("dflash_config")?.ok_or_else(|| f.error("dflash_config", "missing"))?;
        let mask_token_id = dflash.usize("mask_token_id")?;
        if mask_token_id >= dims.vocab_size {
            return Err(
                dflash.error("mask_token_id", format!("{mask_token_id} is not below vocab_size {}", dims.vocab_size))
            );
        }
        let target_layer_ids = match dflash.opt_usize_list("target_layer_ids")? {
            Some(ids) => ids,
            None => default_target_layer_ids(num_target_layers, dims.num_layers()),
        };
        if target_layer_ids.is_empty() {
            return Err(dflash.error("target_layer_ids", "is empty"));
        }
        if let Some((i, id)) = target_layer_ids.iter().enumerate().find(|(_, &id)| id >= num_target_layers) {
            return Err(dflash.error(
                &format!("target_layer_ids[{i}]"),
                format!("{id} is out of range for num_target_layers {num_target_layers}"),
            ));
        }
        Ok(DraftConfig { dims, block_size, num_target_layers, mask_token_id: mask_token_id as u32, target_layer_ids })
    }

    /// The HF `config.json` value.
    pub fn to_value(&self) -> Value {
        let mut out = Map::new();
        out.insert("architectures".into(), json!(["DFlashDraftModel"]));
        out.insert("model_type".into(), json!("qwen3"));
        self.dims.write(&mut out);
        out.insert("block_size".into(), json!(self.block_size));
        out.insert("num_target_layers".into(), json!(self.num_target_layers));
        out.insert("tie_word_embeddings".into(), json!(false));
        out.insert(
            "dflash_config".into(),
            json!({"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids}),
        );
        Value::Object(out)
    }

    /// Writes `config.json` atomically (temporary name, then rename), naming the dtype of the
    /// weights saved beside it (`dtype`, and `torch_dtype` for transformers 4 readers: engines
    /// run the drafter in it).
    pub fn save(&self, file: &Path, weights: candle_core::DType) -> Result<()> {
        let name = match weights {
            candle_core::DType::BF16 => "bfloat16",
            candle_core::DType::F16 => "float16",
            candle_core::DType::F32 => "float32",
            other => {
                return Err(Error::invalid("dtype", format!("{other:?}: not a dtype drafter weights are saved in")))
            }
        };
        let mut value = self.to_value();
        if let Value::Object(map) = &mut value {
            map.insert("dtype".into(), json!(name));
            map.insert("torch_dtype".into(), json!(name));
        }
        write_json(file, &value)
    }
}

impl TargetConfig {
    /// Reads and validates a target `config.json`.
    pub fn from_file(file: &Path) -> Result<Self> {
        let value = read_json(file)?;
        Self::from_value(file, &value)
    }

    /// Validates a parsed target config; `file` names the source in errors.
    pub fn from_value(file: &Path, value: &Value) -> Result<Self> {
        let f = Fields::top(file, value)?;
        let supported = [TargetArch::Qwen3, TargetArch::Llama, TargetArch::Qwen3Moe];
        let archs = f.opt_str_list("architectures")?.ok_or_else(|| f.error("architectures", "missing"))?;
        let arch = supported.into_iter().find(|a| archs.first().map(String::as_str) == Some(a.hf_name())).ok_or_else(
            || {
                f.error(
                    "architectures",
                    format!(
                        "unsupported architecture {archs:?} (supported: Qwen3ForCausalLM, LlamaForCausalLM; Qwen3MoeForCausalLM from a feature cache)"
                    ),
                )
            },
        )?;
        if let Some(model_type) = f.opt_str("model_type")? {
            if model_type != arch.model_type() {
                return Err(
                    f.error("model_type", format!("`{model_type}` does not match architecture {}", arch.hf_name()))
                );
            }
        }
        for key in ["attention_bias", "mlp_bias"] {
            if f.opt_bool(key)? == Some(true) {
                return Err(f.error(key, "biases are not supported"));
            }
        }
        let dims = ModelDims::parse(&f)?;
        Ok(TargetConfig {
            arch,
            rope_scaling: parse_rope(&f, dims.max_position_embeddings)?.1,
            dims,
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        })
    }

    /// The HF `config.json` value.
    pub fn to_value(&self) -> Value {
        let mut out = Map::new();
        out.insert("architectures".into(), json!([self.arch.hf_name()]));
        out.insert("model_type".into(), json!(self.arch.model_type()));
        self.dims.write(&mut out);
        out.insert("tie_word_embeddings".into(), json!(self.tie_word_embeddings));
        out.insert("attention_bias".into(), json!(false));
        if let Some(scaling) = self.rope_scaling.to_value() {
            out.insert("rope_scaling".into(), scaling);
        }
        Value::Object(out)
    }

    /// Writes `config.json` atomically.
    pub fn save(&self, file: &Path) -> Result<()> {
        write_json(file, &self.to_value())
    }
}

fn write_json(file: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::invalid("config", e.to_string()))?;
    write_atomically(file, |w| w.write_all(text.as_bytes()))
}
