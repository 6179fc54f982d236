//! The hybrid model: packed rows equal their documents alone, the chunked form equals the
//! recurrent one through the whole stack, save / load (text and wrapper layouts), bad input.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Tensor};
use serde_json::{json, Value};

use super::*;
use crate::io::{save_safetensors, write_atomically};

/// f64, one forward against another that computes the same sums in another order (chunks, or a
/// packed row whose masked keys and reset states add exact zeros): rounding only.
const SAME_MATH_F64: f64 = 1e-10;

/// A tiny config: 4 layers (GDN, full, GDN, GDN), 2 key heads serving 4 value heads, d_k 4 and
/// d_v 6 (unequal, to catch a transpose), 4 query heads on 2 K/V heads of 16 dims, RoPE on 4.
fn tiny_config() -> Value {
    json!({
        "model_type": "qwen3_5_text",
        "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 4, "vocab_size": 50,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 4, "linear_value_head_dim": 6,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
        "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
    })
}

fn config(value: &Value) -> HybridConfig {
    HybridConfig::from_value(Path::new("tiny/config.json"), value).unwrap()
}

fn model(value: &Value, dtype: DType) -> HybridModel {
    HybridModel::random(config(value), 7, 0.2, dtype).unwrap()
}

fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let f = |t: Tensor| t.to_dtype(DType::F64).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
    (f((a - b).unwrap()) / f(b.clone())).sqrt()
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 17 + seed * 31 + i * i * 7) % 50).collect()
}

/// A packed row of documents of 5, 9 and 3 tokens, then 2 of padding; the row's outputs equal
/// each document run alone (both forms), and padding rows are zero.
#[test]
fn packed_row_equals_documents_alone() {
    let m = model(&tiny_config(), DType::F64);
    let docs = [tokens(5, 1), tokens(9, 2), tokens(3, 3)];
    let mut row = Row { tokens: vec![], loss_mask: vec![], doc_ids: vec![], positions: vec![] };
    for (d, doc) in docs.iter().enumerate() {
        row.tokens.extend(doc);
        row.doc_ids.extend(std::iter::repeat_n(d as i64, doc.len()));
        row.positions.extend(0..doc.len());
    }
    row.tokens.extend([0, 0]);
    row.doc_ids.extend([-1, -1]);
    row.positions.extend([0, 0]);
    row.loss_mask = vec![true; 17].into_iter().chain([false, false]).collect();
    let layers = [0, 1, 3];
    for form in [GdnForm::Recurrent, GdnForm::Chunked { chunk: 4 }] {
        let packed = m.row_forward(&row, &layers, form).unwrap();
        let mut begin = 0;
        for doc in &docs {
            let alone = m.forward(doc, &layers).unwrap();
            let part = |t: &Tensor| t.narrow(0, begin, doc.len()).unwrap();
            assert!(rel_err(&part(&packed.logits), &alone.logits) < SAME_MATH_F64, "{form:?} logits");
            for (p, a) in packed.hidden.iter().zip(&alone.hidden) {
                assert!(rel_err(&part(p), a) < SAME_MATH_F64, "{form:?} hidden");
            }
            begin += doc.len();
        }
        let padding = packed.logits.narrow(0, 17, 2).unwrap().abs().unwrap().sum_all().unwrap();
        assert_eq!(padding.to_scalar::<f64>().unwrap(), 0.0);
    }
    let features = m.row_features(&row, &layers).unwrap();
    assert_eq!(features.dims(), [19, 3 * 24]);
}

/// Through the whole stack (f64), the chunked form equals the recurrent one, for 150 tokens:
/// two full chunks of the default 64 and a partial one, and a chunk of 7 that divides nothing.
#[test]
fn chunked_stack_equals_recurrent() {
    let mut value = tiny_config();
    value["linear_num_key_heads"] = json!(1);
    value["linear_num_value_heads"] = json!(3);
    let m = model(&value, DType::F64);
    let toks = tokens(150, 4);
    let all: Vec<usize> = (0..4).collect();
    let recurrent = m.forward(&toks, &all).unwrap();
    for chunk in [gdn::DEFAULT_CHUNK, 7] {
        let chunked = m.forward_with(&toks, &all, GdnForm::Chunked { chunk }).unwrap();
        assert!(rel_err(&chunked.logits, &recurrent.logits) < SAME_MATH_F64, "chunk {chunk} logits");
        for (l, (c, r)) in chunked.hidden.iter().zip(&recurrent.hidden).enumerate() {
            assert!(rel_err(c, r) < SAME_MATH_F64, "chunk {chunk} layer {l}");
        }
    }
}

/// Saved (text layout, f32) and loaded back, the model gives the same outputs bit for bit.
#[test]
fn save_then_load_round_trips() {
    let m = model(&tiny_config(), DType::F32);
    let dir = tempfile::tempdir().unwrap();
    m.save(dir.path()).unwrap();
    let loaded = HybridModel::load(dir.path(), DType::F32).unwrap();
    assert_eq!(loaded.config, m.config);
    assert!(loaded.ignored_weights().is_empty());
    let toks = tokens(12, 5);
    let (a, b) = (m.forward(&toks, &[2]).unwrap(), loaded.forward(&toks, &[2]).unwrap());
    assert_eq!(rel_err(&a.logits, &b.logits), 0.0);
    assert_eq!(rel_err(&a.hidden[0], &b.hidden[0]), 0.0);
}

/// Writes `config` and the model's weights renamed by `rename`, plus `extra` tensors, into `dir`.
fn write_checkpoint(dir: &Path, m: &HybridModel, config: &Value, rename: impl Fn(&str) -> String, extra: &[&str]) {
    let mut tensors: HashMap<String, Tensor> =
        hybrid_param_shapes(&m.config).into_iter().map(|(name, _)| (rename(&name), m.weight(&name).unwrap())).collect();
    for name in extra {
        tensors.insert(name.to_string(), Tensor::ones((2, 3), DType::F32, &candle_core::Device::Cpu).unwrap());
    }
    save_safetensors(&dir.join("model.safetensors"), &tensors).unwrap();
    let text = serde_json::to_string(config).unwrap();
    write_atomically(&dir.join("config.json"), |w| std::io::Write::write_all(w, text.as_bytes())).unwrap();
}

/// The multimodal wrapper: weights under `model.language_model.*`, the vision tower and the MTP
/// head left out and listed; a tensor of neither kind is refused, naming it.
#[test]
fn wrapper_checkpoint_loads_the_language_model() {
    let m = model(&tiny_config(), DType::F32);
    let wrapper = json!({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": tiny_config(), "vision_config": {"depth": 1}});
    let dir = tempfile::tempdir().unwrap();
    let extra = ["mtp.fc.weight", "model.visual.blocks.0.attn.qkv.weight"];
    write_checkpoint(dir.path(), &m, &wrapper, |n| HybridLayout::Wrapped.checkpoint_name(n), &extra);
    let loaded = HybridModel::load(dir.path(), DType::F32).unwrap();
    assert_eq!(loaded.config.layout, HybridLayout::Wrapped);
    assert_eq!(loaded.ignored_weights(), ["model.visual.blocks.0.attn.qkv.weight", "mtp.fc.weight"]);
    let toks = tokens(9, 6);
    assert_eq!(rel_err(&loaded.forward(&toks, &[]).unwrap().logits, &m.forward(&toks, &[]).unwrap().logits), 0.0);

    // The text config alone with the wrapper's weights (`model.language_model.*`): read there,
    // as transformers does, through either loader.
    write_checkpoint(dir.path(), &m, &tiny_config(), |n| HybridLayout::Wrapped.checkpoint_name(n), &extra);
    let loaded = HybridModel::load(dir.path(), DType::F32).unwrap();
    assert_eq!(loaded.config.layout, HybridLayout::Wrapped);
    assert_eq!(rel_err(&loaded.forward(&toks, &[]).unwrap().logits, &m.forward(&toks, &[]).unwrap().logits), 0.0);
    let kind = crate::target::TargetKind::from_file(&dir.path().join("config.json")).unwrap();
    assert!(matches!(kind, crate::target::TargetKind::Hybrid(c) if c.layout == HybridLayout::Wrapped));

    // Text-layout names in a wrapper checkpoint: the first unexpected tensor is named.
    write_checkpoint(dir.path(), &m, &wrapper, |n| n.to_string(), &[]);
    let err = HybridModel::load(dir.path(), DType::F32).err().expect("text names in a wrapper").to_string();
    assert!(err.contains("tensor `model.embed_tokens.weight`: not a weight of this Wrapped-layout"), "{err}");
    // A Qwen3-Next-style fused projection is not a Qwen3.5 weight.
    write_checkpoint(
        dir.path(),
        &m,
        &tiny_config(),
        |n| n.to_string(),
        &["model.layers.0.linear_attn.in_proj_qkvz.weight"],
    );
    let err = HybridModel::load(dir.path(), DType::F32).err().expect("an unknown tensor").to_string();
    assert!(err.contains("tensor `model.layers.0.linear_attn.in_proj_qkvz.weight`"), "{err}");
}

/// A hybrid's config is read as one by any of its marks (its model type, architecture or
/// GatedDeltaNet layer types), not refused as an unsupported dense architecture; a dense model
/// type on a hybrid's layers is named.
#[test]
fn a_hybrid_is_known_without_its_model_type() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.json");
    let base = tiny_config();
    let mut no_type = base.clone();
    no_type.as_object_mut().unwrap().remove("model_type");
    let mut dense_type = base.clone();
    dense_type["model_type"] = json!("qwen3");
    let mut by_architecture = no_type.clone();
    by_architecture.as_object_mut().unwrap().remove("layer_types");
    by_architecture["full_attention_interval"] = json!(4);
    by_architecture["architectures"] = json!(["Qwen3_5ForCausalLM"]);
    for config in [no_type, by_architecture] {
        std::fs::write(&file, config.to_string()).unwrap();
        let kind = crate::target::TargetKind::from_file(&file).unwrap();
        assert!(matches!(kind, crate::target::TargetKind::Hybrid(_)), "{config}");
    }
    // A dense model type on a hybrid's layers: the model type is named.
    std::fs::write(&file, dense_type.to_string()).unwrap();
    let err = crate::target::TargetKind::from_file(&file).expect_err("qwen3 on hybrid layers").to_string();
    assert!(err.contains("model_type") && err.contains("qwen3_5_text"), "{err}");
}

/// Tied embeddings: no `lm_head.weight`, the logits use the embedding table.
#[test]
fn tied_head_uses_the_embedding() {
    let mut value = tiny_config();
    value["tie_word_embeddings"] = json!(true);
    let m = model(&value, DType::F64);
    assert!(m.weight("lm_head.weight").is_err());
    let toks = tokens(6, 7);
    let out = m.forward(&toks, &[3]).unwrap();
    let normed = zero_centred_rms_norm(&out.hidden[0], &m.weight("model.norm.weight").unwrap(), 1e-6).unwrap();
    let want = linear(&normed, &m.weight("model.embed_tokens.weight").unwrap()).unwrap();
    assert!(rel_err(&out.logits, &want) < SAME_MATH_F64);
    // A tied checkpoint that still carries a head loads, the head left out and listed.
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &m, &value, |n| n.to_string(), &["lm_head.weight"]);
    assert_eq!(HybridModel::load(dir.path(), DType::F64).unwrap().ignored_weights(), ["lm_head.weight"]);
}

#[test]
fn bad_input_is_refused() {
    let m = model(&tiny_config(), DType::F32);
    let err = |r: Result<TargetOutput>| r.err().expect("must be refused").to_string();
    assert!(err(m.forward(&[1, 50], &[])).contains("token id 50 is not below vocab_size 50"));
    assert!(err(m.forward(&[1, 2], &[4])).contains("layer 4 is out of range for 4 target layers"));
    assert!(err(m.forward(&[], &[])).contains("`tokens`: no tokens"));
    let e = HybridModel::random(config(&tiny_config()), 1, 0.1, DType::F16).err().expect("f16").to_string();
    assert!(e.contains("F16") && e.contains("f32 or f64"), "{e}");
    let bad_row = Row { tokens: vec![1, 2], loss_mask: vec![true, true], doc_ids: vec![0, 2], positions: vec![0, 0] };
    assert!(err(m.row_forward(&bad_row, &[], GdnForm::Recurrent)).contains("doc_ids"));
}
