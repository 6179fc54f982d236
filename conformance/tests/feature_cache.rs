//! The offline feature cache's two writers agree: `xtask/scripts/features_transformers.py` (run
//! with transformers in f32 on the H200 machine, its cache checked in under
//! fixtures/features/target-qwen3-transformers) and the Rust writer (`TargetForward` on the CPU
//! twins in f32 + `FeatureWriter`) over the same documents (fixtures/features/documents.jsonl)
//! and the Qwen3 fixture: the same provenance hashes, shard layout, tokens and masks, and
//! features within bf16 rounding. The Rust reader opens the Python cache.

use dflash_conformance::fixtures_dir;
use dflash_conformance::tolerance::{rel_error, BF16_STORAGE};
use dflash_data::features::{provenance, Entry, FeatureCache, FeatureIndex, FeatureWriter};
use dflash_optimized::backend::host::Host;
use dflash_optimized::model::target_forward::TargetForward;
use dflash_reference::config::TargetConfig;
use dflash_reference::data::Row;
use dflash_reference::target::TargetModel;
use serde_json::Value;

fn bf16_tensor(bits: &[u16]) -> candle_core::Tensor {
    let v: Vec<f32> = bits.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
    candle_core::Tensor::new(v, &candle_core::Device::Cpu).expect("tensor")
}

#[test]
fn rust_and_transformers_writers_agree() {
    let dir = fixtures_dir();
    let python = FeatureCache::open(&dir.join("features/target-qwen3-transformers"), None).expect("python cache");
    let text = std::fs::read_to_string(dir.join("features/documents.jsonl")).expect("documents");
    let mut lines = text.lines();
    let header: Value = serde_json::from_str(lines.next().expect("header")).expect("header json");
    let docs: Vec<Value> = lines.map(|l| serde_json::from_str(l).expect("document json")).collect();
    let hex = header["data"].as_str().expect("data key");
    let key: [u8; 32] = (0..32)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex"))
        .collect::<Vec<_>>()
        .try_into()
        .expect("32 bytes");

    let target = dir.join("target-qwen3");
    let ids = vec![2, 0];
    let index = FeatureIndex {
        format: String::new(),
        provenance: provenance(&target, &ids, &key).expect("provenance"),
        hidden_size: 32,
        layer_ids: ids.clone(),
        shard_bytes: python.index.shard_bytes,
        documents: docs.len(),
        tokens: header["tokens"].as_u64().expect("tokens"),
        shards: vec![],
    };
    let out = tempfile::tempdir().expect("temp dir");
    let mut writer = FeatureWriter::open(out.path(), index).expect("writer");
    let config = TargetConfig::from_file(&target.join("config.json")).expect("config");
    let model = TargetModel::load(&target, candle_core::DType::F32).expect("model");
    let mut forward = TargetForward::new(Host::<f32>::default(), &config, &ids, 128, false).expect("forward");
    forward.load_weights(|name, _| model.weight(name)).expect("weights");
    for doc in &docs {
        let tokens: Vec<u32> =
            doc["input_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        let mask: Vec<bool> = doc["loss_mask"].as_array().unwrap().iter().map(|m| m.as_u64() == Some(1)).collect();
        let n = tokens.len();
        let row = Row { tokens, loss_mask: mask, doc_ids: vec![0; n], positions: (0..n).collect() };
        forward.run(&[&row]).expect("forward");
        let features = forward.features_to_host_bf16().expect("features");
        writer.push(Entry { tokens: &row.tokens, loss_mask: &row.loss_mask, features: &features }).expect("push");
    }
    writer.finish().expect("finish");
    // Opening with the Python cache's provenance checks that both writers hash the same files.
    let rust = FeatureCache::open(out.path(), Some(&python.index.provenance)).expect("rust cache");
    let layout = |c: &FeatureCache| c.index.shards.iter().map(|s| (s.first_doc, s.docs, s.tokens)).collect::<Vec<_>>();
    assert_eq!(layout(&rust), layout(&python), "shard layouts differ");
    for i in 0..docs.len() {
        let (a, b) = (rust.doc(i).expect("rust doc"), python.doc(i).expect("python doc"));
        assert_eq!((&a.tokens, &a.loss_mask), (&b.tokens, &b.loss_mask), "document {i}");
        let err = rel_error(&bf16_tensor(a.features), &bf16_tensor(b.features));
        assert!(err <= BF16_STORAGE.rel, "document {i}: features differ by {err:.2e}");
    }
}
