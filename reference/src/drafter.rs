//! The DFlash drafter (spec section 1): fc + hidden_norm, Qwen3-style layers whose keys/values
//! are the context features plus the block, final norm, the target's frozen embeddings and LM head.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use crate::anchors::Anchors;
use crate::attention::dense_attention;
use crate::config::{AttnKind, DraftConfig};
use crate::data::TrainRow;
use crate::error::{Error, Result};
use crate::io::{save_safetensors, WeightSet};
use crate::mask::BlockLayout;
use crate::ops::{head_rms_norm, linear, rms_norm, rope, rope_tables, swiglu};

/// The target's frozen tables the drafter borrows: `embed` and `lm_head`, both `[V, H]`.
#[derive(Clone, Debug)]
pub struct FrozenHead {
    pub embed: Tensor,
    pub lm_head: Tensor,
}

/// What the drafter sees for one row: context features and the blocks to fill.
#[derive(Clone, Debug)]
pub struct DraftInput {
    pub layout: BlockLayout,
    /// Concatenated target features `[S, F*H]`.
    pub features: Tensor,
    /// RoPE position of each context key `[S]`.
    pub context_positions: Vec<usize>,
    /// `x[a_j]`, the known token opening each block `[N]`.
    pub anchor_tokens: Vec<u32>,
    /// RoPE position of each block's offset 0 `[N]`; offset `o` sits at `+o`.
    pub anchor_positions: Vec<usize>,
}

impl DraftInput {
    /// The training input of `row` with `anchors` (blocks of `block_size`).
    pub fn training(row: &TrainRow, anchors: &Anchors, block_size: usize) -> Result<Self> {
        let layout = BlockLayout::new(
            row.len(),
            block_size,
            anchors.positions.clone(),
            anchors.keep.clone(),
            row.doc_ids.clone(),
        )?;
        Ok(DraftInput {
            layout,
            features: row.features.clone(),
            context_positions: row.positions.clone(),
            anchor_tokens: anchors.positions.iter().map(|&a| row.tokens[a]).collect(),
            anchor_positions: anchors.positions.iter().map(|&a| row.positions[a]).collect(),
        })
    }

    /// The inference input: features of the `n` committed positions `[n, F*H]` and the bonus
    /// token at position `n`, drafting one block after the context.
    pub fn inference(features: Tensor, bonus_token: u32, block_size: usize) -> Result<Self> {
        let n = features.dim(0)?;
        Ok(DraftInput {
            layout: BlockLayout::new(n, block_size, vec![n], vec![true], None)?,
            features,
            context_positions: (0..n).collect(),
            anchor_tokens: vec![bonus_token],
            anchor_positions: vec![n],
        })
    }

    /// RoPE position of every query `[N*B]`: `anchor_positions[j] + o`.
    pub fn query_positions(&self) -> Vec<usize> {
        let b = self.layout.block_size;
        self.anchor_positions.iter().flat_map(|&p| (0..b).map(move |o| p + o)).collect()
    }

    /// RoPE position of every key `[S + N*B]`: the context positions, then the queries'.
    pub fn key_positions(&self) -> Vec<usize> {
        self.context_positions.iter().copied().chain(self.query_positions()).collect()
    }

    /// The block tokens `[N*B]`: per block the anchor token, then `B-1` mask tokens.
    pub fn block_tokens(&self, mask_token_id: u32) -> Vec<u32> {
        let b = self.layout.block_size;
        self.anchor_tokens
            .iter()
            .flat_map(|&t| std::iter::once(t).chain(std::iter::repeat_n(mask_token_id, b - 1)))
            .collect()
    }

    /// The block inputs `[N*B, H]`: the embeddings of [`DraftInput::block_tokens`] (frozen
    /// table, as `dtype`).
    pub fn block_embeddings(&self, head: &FrozenHead, mask_token_id: u32, dtype: DType) -> Result<Tensor> {
        let ids = Tensor::from_vec(self.block_tokens(mask_token_id), self.layout.num_queries(), &Device::Cpu)?;
        Ok(head.embed.to_dtype(dtype)?.index_select(&ids, 0)?)
    }
}

/// A drafter: its config and trainable parameters, in checkpoint-key order.
pub struct Drafter {
    pub config: DraftConfig,
    params: Vec<(String, Var)>,
    index: HashMap<String, usize>,
}

/// Checkpoint key and shape of every trainable parameter, in a fixed order.
pub fn param_shapes(config: &DraftConfig) -> Vec<(String, Vec<usize>)> {
    let c = &config.dims;
    let (h, d, i) = (c.hidden_size, c.head_dim, c.intermediate_size);
    let mut shapes = vec![
        ("fc.weight".to_string(), vec![h, config.num_features() * h]),
        ("hidden_norm.weight".to_string(), vec![h]),
    ];
    for l in 0..c.num_layers() {
        let p = |name: &str, shape: Vec<usize>| (format!("layers.{l}.{name}"), shape);
        shapes.extend([
            p("input_layernorm.weight", vec![h]),
            p("self_attn.q_proj.weight", vec![c.num_heads * d, h]),
            p("self_attn.k_proj.weight", vec![c.num_kv_heads * d, h]),
            p("self_attn.v_proj.weight", vec![c.num_kv_heads * d, h]),
            p("self_attn.o_proj.weight", vec![h, c.num_heads * d]),
            p("self_attn.q_norm.weight", vec![d]),
            p("self_attn.k_norm.weight", vec![d]),
            p("post_attention_layernorm.weight", vec![h]),
            p("mlp.gate_proj.weight", vec![i, h]),
            p("mlp.up_proj.weight", vec![i, h]),
            p("mlp.down_proj.weight", vec![h, i]),
        ]);
    }
    shapes.push(("norm.weight".to_string(), vec![h]));
    shapes
}

/// Whether a parameter is a norm weight (initialised to ones) rather than a linear.
pub fn is_norm(name: &str) -> bool {
    name.ends_with("norm.weight")
}

impl Drafter {
    /// Builds every parameter from `make(name, shape)`.
    pub fn from_fn(config: DraftConfig, mut make: impl FnMut(&str, &[usize]) -> Result<Tensor>) -> Result<Self> {
        let mut params = Vec::new();
        for (name, shape) in param_shapes(&config) {
            let t = make(&name, &shape)?;
            params.push((name, Var::from_tensor(&t)?));
        }
        let index = params.iter().enumerate().map(|(i, (n, _))| (n.clone(), i)).collect();
        Ok(Drafter { config, params, index })
    }

    /// The spec's init: normal(0, 0.02) for linears, ones for norms; seeded.
    pub fn init(config: DraftConfig, seed: u64, dtype: DType) -> Result<Self> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        Self::from_fn(config, |name, shape| {
            if is_norm(name) {
                return Ok(Tensor::ones(shape, dtype, &Device::Cpu)?);
            }
            random_normal(shape, 0.02, &mut rng, dtype)
        })
    }

    /// Loads `config.json` and `model.safetensors` from `dir` (HF format), as `dtype`.
    pub fn load(dir: &Path, dtype: DType) -> Result<Self> {
        let config = DraftConfig::from_file(&dir.join("config.json"))?;
        let weights = WeightSet::load_files(&dir.join("model.safetensors"), &[dir.join("model.safetensors")])?;
        Self::from_fn(config, |name, shape| weights.get(name, shape, dtype))
    }

    /// Saves `config.json` and `model.safetensors` (f32) into `dir`, each atomically.
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let tensors = self
            .params
            .iter()
            .map(|(n, v)| Ok((n.clone(), v.as_tensor().to_dtype(DType::F32)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        save_safetensors(&dir.join("model.safetensors"), &tensors)?;
        self.config.save(&dir.join("config.json"), DType::F32)
    }

    /// Every trainable parameter with its checkpoint key, in a fixed order.
    pub fn named_params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// The parameter called `name` (a checkpoint key).
    pub fn param(&self, name: &str) -> &Tensor {
        self.params[self.index[name]].1.as_tensor()
    }

    /// Number of trainable scalars.
    pub fn num_params(&self) -> usize {
        self.params.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// Logits `[N*B, V]` for every block row of `input`: row `j*B+o` predicts the token at
    /// position `a_j + o`.
    pub fn forward(&self, head: &FrozenHead, input: &DraftInput) -> Result<Tensor> {
        let c = &self.config.dims;
        let (eps, b, s) = (c.rms_norm_eps, input.layout.block_size, input.layout.context_len);
        if b != self.config.block_size {
            return Err(Error::invalid(
                "block_size",
                format!("input blocks of {b}, drafter trained for {}", self.config.block_size),
            ));
        }
        let expected = [s, self.config.num_features() * c.hidden_size];
        if input.features.dims() != expected {
            return Err(Error::invalid(
                "features",
                format!("shape {:?}, expected {expected:?}", input.features.dims()),
            ));
        }
        let dtype = self.param("fc.weight").dtype();
        // ctx [S, H]: projected, normalised target features.
        let ctx = rms_norm(
            &linear(&input.features.to_dtype(dtype)?, self.param("fc.weight"))?,
            self.param("hidden_norm.weight"),
            eps,
        )?;
        // X [N*B, H]: anchor embedding then B-1 mask embeddings per block.
        let mut x = input.block_embeddings(head, self.config.mask_token_id, dtype)?;
        let (cos_q, sin_q) = rope_tables(&input.query_positions(), c.head_dim, c.rope_theta, dtype)?;
        let (cos_k, sin_k) = rope_tables(&input.key_positions(), c.head_dim, c.rope_theta, dtype)?;
        let mut masks: HashMap<AttnKind, Vec<bool>> = HashMap::new();
        let nq = input.layout.num_queries();

        for (l, &kind) in c.layer_kinds.iter().enumerate() {
            let w = |name: &str| self.param(&format!("layers.{l}.{name}"));
            let mask = masks.entry(kind).or_insert_with(|| input.layout.dense(kind));
            let xn = rms_norm(&x, w("input_layernorm.weight"), eps)?;
            let q = head_rms_norm(
                &linear(&xn, w("self_attn.q_proj.weight"))?,
                c.num_heads,
                w("self_attn.q_norm.weight"),
                eps,
            )?;
            let q = rope(&q, &cos_q, &sin_q)?; // [N*B, nh, d]
            let kv_in = Tensor::cat(&[&ctx, &xn], 0)?; // [S+N*B, H]
            let k = head_rms_norm(
                &linear(&kv_in, w("self_attn.k_proj.weight"))?,
                c.num_kv_heads,
                w("self_attn.k_norm.weight"),
                eps,
            )?;
            let k = rope(&k, &cos_k, &sin_k)?; // [S+N*B, nkv, d]
            let v = linear(&kv_in, w("self_attn.v_proj.weight"))?.reshape((s + nq, c.num_kv_heads, c.head_dim))?;
            let attn = dense_attention(&q, &k, &v, mask)?.reshape((nq, c.num_heads * c.head_dim))?;
            x = (x + linear(&attn, w("self_attn.o_proj.weight"))?)?;
            let xn = rms_norm(&x, w("post_attention_layernorm.weight"), eps)?;
            x = (&x + swiglu(&xn, w("mlp.gate_proj.weight"), w("mlp.up_proj.weight"), w("mlp.down_proj.weight"))?)?;
        }
        linear(&rms_norm(&x, self.param("norm.weight"), eps)?, &head.lm_head.to_dtype(dtype)?)
    }
}

/// A `[shape]` tensor of normal(0, std) draws from `rng`, as `dtype`.
pub fn random_normal(shape: &[usize], std: f64, rng: &mut ChaCha8Rng, dtype: DType) -> Result<Tensor> {
    let normal = Normal::new(0.0, std).map_err(|e| Error::invalid("std", e.to_string()))?;
    let n: usize = shape.iter().product();
    let values: Vec<f64> = (0..n).map(|_| normal.sample(rng)).collect();
    Ok(Tensor::from_vec(values, shape, &Device::Cpu)?.to_dtype(dtype)?)
}
