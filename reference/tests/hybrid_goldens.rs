//! The hybrid reference (spec section 10) against transformers' Qwen3.5 (`Qwen3_5ForCausalLM`,
//! torch path, float32): logits and every decoder layer's output, for the fixtures that
//! fixtures/scripts/make_hybrid_goldens.py wrote on the H200 machine (transformers 5.17; its
//! README says what each holds).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use dflash_reference::hybrid::gdn::DEFAULT_CHUNK;
use dflash_reference::hybrid::{GdnForm, HybridLayout, HybridModel};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// f32 against transformers' f32, by `||ours - theirs|| / ||theirs||`: the same math in other
/// summation orders (transformers runs the chunked prefill, the reference both forms).
const ORACLE_F32: f64 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(name)
}

fn rel_error(got: &Tensor, want: &Tensor) -> candle_core::Result<f64> {
    let sq = |t: &Tensor| t.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>();
    Ok((sq(&(got - want)?)? / sq(want)?).sqrt())
}

/// Prints the relative error (shown with `--no-capture`), then checks it is within [`ORACLE_F32`]
/// (NaN never passes).
fn check(what: &str, got: &Tensor, want: &Tensor) -> TestResult {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let err = rel_error(got, want)?;
    println!("{what}: rel err {err:.3e}");
    assert!(err < ORACLE_F32, "{what}: rel err {err:.3e} is not below {ORACLE_F32:e}");
    Ok(())
}

/// Loads `name` and compares both forms of the delta rule with its goldens.
fn matches_transformers(name: &str) -> TestResult {
    let dir = fixture(name);
    if !dir.is_dir() {
        return Err(format!("{} is missing: run fixtures/scripts/make_hybrid_goldens.py", dir.display()).into());
    }
    let golden: HashMap<String, Tensor> = candle_core::safetensors::load(dir.join("golden.safetensors"), &Device::Cpu)?;
    let get = |key: &str| golden.get(key).ok_or_else(|| format!("{name}/golden.safetensors has no `{key}`"));
    let tokens = get("input_ids")?
        .to_dtype(DType::I64)?
        .to_vec1::<i64>()?
        .into_iter()
        .map(u32::try_from)
        .collect::<Result<Vec<u32>, _>>()?;
    let model = HybridModel::load(&dir, DType::F32)?;
    let all: Vec<usize> = (0..model.config.num_layers()).collect();
    let layer_outputs = get("layer_outputs")?;
    assert_eq!(layer_outputs.dim(0)?, all.len(), "{name}: golden layer count");
    for form in [GdnForm::Recurrent, GdnForm::Chunked { chunk: DEFAULT_CHUNK }] {
        let out = model.forward_with(&tokens, &all, form)?;
        check(&format!("{name} {form:?} logits"), &out.logits, get("logits")?)?;
        for (l, ours) in out.hidden.iter().enumerate() {
            check(
                &format!("{name} {form:?} layer {l} ({:?})", model.config.layer_kinds[l]),
                ours,
                &layer_outputs.get(l)?,
            )?;
        }
    }
    Ok(())
}

/// Explicit `layer_types`, untied head, float32, one file.
#[test]
fn layer_types_fixture_matches_transformers() -> TestResult {
    matches_transformers("target-qwen3_5")
}

/// `full_attention_interval` instead of `layer_types`, tied embeddings, bf16 shards.
#[test]
fn interval_fixture_matches_transformers() -> TestResult {
    matches_transformers("target-qwen3_5-interval")
}

/// The multimodal wrapper layout: weights under `model.language_model.*`, the MTP head and the
/// vision tower left out.
#[test]
fn wrapped_fixture_matches_transformers() -> TestResult {
    matches_transformers("target-qwen3_5-wrapped")?;
    let model = HybridModel::load(&fixture("target-qwen3_5-wrapped"), DType::F32)?;
    assert_eq!(model.config.layout, HybridLayout::Wrapped);
    assert_eq!(model.ignored_weights(), ["model.visual.patch_embed.proj.weight", "mtp.fc.weight"]);
    Ok(())
}
