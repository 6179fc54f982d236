//! The target's forward (`dflash_optimized::model::target_forward`) against the reference target
//! (`TargetModel::row_features`, each packed document run alone) on any backend: the checked-in
//! Qwen3 and Llama fixtures (head dims 16 and 8: the CPU twins only, below the kernels' granule
//! of 64) and random targets of both architectures with real head dims (64, 128), GQA, the RoPE
//! variants, sliding layers, several documents packed per row, padding, and lengths that are no
//! multiple of a tile. Written once over the backend: CI runs it on `Host`, the H200 on `Cuda`.

use candle_core::{DType, Tensor};
use dflash_optimized::backend::Backend;
use dflash_optimized::model::target_forward::TargetForward;
use dflash_optimized::model::TargetFeatures;
use dflash_optimized::Result;
use dflash_reference::config::{AttnKind, ModelDims, RopeScaling, TargetArch, TargetConfig};
use dflash_reference::data::{document_runs, Row};
use dflash_reference::target::{Target, TargetModel};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::fixtures_dir;
use crate::gpu_step::{GpuCheck, PeakMeter};
use crate::tolerance::{rel_error, Tolerance};

/// One target forward to check: a model, the layers it taps and the rows of one launch.
pub struct TargetCase {
    pub name: String,
    pub model: TargetModel,
    pub layer_ids: Vec<usize>,
    pub rows: Vec<Row>,
}

/// Copies the fixture Qwen tokenizer (with its chat template) into the folder `dir`.
pub fn copy_fixture_tokenizer(dir: &std::path::Path) -> dflash_reference::Result<()> {
    let source = fixtures_dir().join("data/tokenizer-qwen");
    let io = |file: &std::path::Path, e| dflash_reference::Error::io(file, e);
    for entry in std::fs::read_dir(&source).map_err(|e| io(&source, e))? {
        let path = entry.map_err(|e| io(&source, e))?.path();
        let to = dir.join(path.file_name().unwrap_or_default());
        std::fs::copy(&path, &to).map_err(|e| io(&to, e))?;
    }
    Ok(())
}

/// Writes a target folder for end-to-end runs into `dir`: the fixture Qwen tokenizer (with its
/// chat template) and a random Qwen3 of 3 layers (hidden 32, heads of 8, GQA 4/2) whose vocab of
/// 768 covers the tokenizer, saved in HF format; returns the model. (`cargo xtask demo-target`
/// writes one for trying the real-run commands without a download.)
pub fn write_target_folder(dir: &std::path::Path, seed: u64) -> dflash_reference::Result<TargetModel> {
    std::fs::create_dir_all(dir).map_err(|e| dflash_reference::Error::io(dir, e))?;
    copy_fixture_tokenizer(dir)?;
    let config = TargetConfig {
        arch: TargetArch::Qwen3,
        dims: ModelDims {
            hidden_size: 32,
            intermediate_size: 48,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            vocab_size: 768,
            rms_norm_eps: 1e-6,
            rope_theta: 1e4,
            max_position_embeddings: 4096,
            layer_kinds: vec![AttnKind::Full; 3],
        },
        tie_word_embeddings: false,
        rope_scaling: RopeScaling::Default,
    };
    let model = TargetModel::random(config, seed, 0.1, DType::F32)?;
    model.save(dir)?;
    Ok(model)
}

/// A copy of the target folder `from` at `to` whose `config.json` is `edit`ed (another
/// architecture's target with the same files).
pub fn copy_target_folder(from: &std::path::Path, to: &std::path::Path, edit: impl FnOnce(&mut serde_json::Value)) {
    std::fs::create_dir_all(to).unwrap();
    for file in std::fs::read_dir(from).unwrap().map(|e| e.unwrap().path()) {
        std::fs::copy(&file, to.join(file.file_name().unwrap())).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(from.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(to.join("config.json"), config.to_string()).unwrap();
}

/// A row of documents of `lengths` tokens (positions restarting at 0), then `pad` padding tokens.
pub fn packed_row(lengths: &[usize], pad: usize, vocab: usize, rng: &mut ChaCha8Rng) -> Row {
    let mut row = Row { tokens: vec![], loss_mask: vec![], doc_ids: vec![], positions: vec![] };
    for (doc, &len) in lengths.iter().enumerate() {
        for p in 0..len {
            row.tokens.push(rng.random_range(0..vocab as u32));
            row.loss_mask.push(rng.random_bool(0.7));
            row.doc_ids.push(doc as i64);
            row.positions.push(p);
        }
    }
    for _ in 0..pad {
        row.tokens.push(rng.random_range(0..vocab as u32));
        row.loss_mask.push(false);
        row.doc_ids.push(-1);
        row.positions.push(0);
    }
    row
}

/// The fixture targets (loaded in f64 from their f32 and bf16 checkpoints) with one packed row
/// and one single-document row per launch.
pub fn fixture_target_cases(seed: u64) -> Result<Vec<TargetCase>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut cases = Vec::new();
    for fixture in ["target-qwen3", "target-llama"] {
        let model = TargetModel::load(&fixtures_dir().join(fixture), DType::F64)?;
        let v = model.config.dims.vocab_size;
        let rows = vec![packed_row(&[13, 1, 29], 7, v, &mut rng), packed_row(&[37], 0, v, &mut rng)];
        cases.push(TargetCase { name: fixture.to_string(), model, layer_ids: vec![0, 2, 1], rows });
    }
    Ok(cases)
}

/// Random targets the GPU kernels can run: Qwen3 (q/k norms) and Llama, head dims 64 and 128,
/// GQA groups 1 to 4, tied and untied, a sliding layer, the llama3 and yarn RoPE scalings, rows
/// of several documents whose lengths are no multiple of the kernels' 64-key tiles, and padding.
/// The reference computes in `dtype` (f32 against the GPU's bf16, f64 against the CPU twins);
/// linears N(0, 0.02) (transformers' init), norms 1 + N(0, 0.1), rounded to bf16 (as a checkpoint
/// stores them).
pub fn random_target_cases(seed: u64, dtype: DType) -> Result<Vec<TargetCase>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let specs = [
        ("qwen3 d128 gqa4 yarn", TargetArch::Qwen3, 128, (8, 2), true),
        ("llama d128 gqa4 llama3 tied", TargetArch::Llama, 128, (8, 2), false),
        ("qwen3 d64 mha sliding", TargetArch::Qwen3, 64, (2, 2), false),
    ];
    let mut cases = Vec::new();
    for (i, (name, arch, d, (nh, nkv), untied)) in specs.into_iter().enumerate() {
        let layers = 3;
        let mut layer_kinds = vec![AttnKind::Full; layers];
        if name.contains("sliding") {
            layer_kinds[1] = AttnKind::Sliding { window: 50 };
        }
        let rope_scaling = match arch {
            TargetArch::Qwen3 if name.contains("yarn") => RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 64.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: 0.1 * 4f64.ln() + 1.0,
                truncate: true,
            },
            TargetArch::Llama => RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 128.0,
            },
            _ => RopeScaling::Default,
        };
        let config = TargetConfig {
            arch,
            dims: ModelDims {
                hidden_size: 256,
                intermediate_size: 344,
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: d,
                vocab_size: 300,
                rms_norm_eps: 1e-6,
                rope_theta: 1e6,
                max_position_embeddings: 4096,
                layer_kinds,
            },
            tie_word_embeddings: !untied,
            rope_scaling,
        };
        // bf16-exact weights, as a checkpoint's: the GPU stores exactly what the reference reads.
        let random = TargetModel::random(config.clone(), seed * 10 + i as u64, 0.02, DType::F32)?;
        let model =
            TargetModel::from_fn(config, |name, _| Ok(random.weight(name)?.to_dtype(DType::BF16)?.to_dtype(dtype)?))?;
        let v = model.config.dims.vocab_size;
        let rows = vec![
            packed_row(&[rng.random_range(60..140), 1, rng.random_range(2..70)], rng.random_range(1..30), v, &mut rng),
            packed_row(&[rng.random_range(130..300)], 0, v, &mut rng),
        ];
        cases.push(TargetCase { name: name.to_string(), model, layer_ids: vec![2, 0], rows });
    }
    Ok(cases)
}

/// The case's rows through the forward on `backend()` against the reference's features of each
/// document alone (f64), within `tol`, as [`features_check`] runs them.
pub fn target_check<B: Backend>(
    case: &TargetCase,
    backend: impl Fn() -> Result<B>,
    tol: Tolerance,
    meter: Option<&mut dyn PeakMeter>,
) -> Result<GpuCheck> {
    let (ids, config) = (&case.layer_ids, &case.model.config);
    let total = case.rows.iter().map(|r| r.tokens.len()).sum();
    let make = || {
        let mut forward = TargetForward::new(backend()?, config, ids, total, false)?;
        forward.load_weights(|name, _| case.model.weight(name))?;
        Ok(forward)
    };
    features_check(&format!("target {}", case.name), &case.model, ids, &case.rows, make, tol, meter)
}

/// The rows of one launch through the forward `make` builds against the reference `target`'s
/// features of each document alone (f64), within `tol`; and the first row's documents each run
/// alone through the same forward against their slice of the packed run (the same computation on
/// a shorter launch). With a `meter` (started before the forward is made), the forward's measured
/// peak against its plan. The check is named `name (T tokens)`.
pub fn features_check<F: TargetFeatures>(
    name: &str,
    target: &dyn Target,
    ids: &[usize],
    rows: &[Row],
    make: impl FnOnce() -> Result<F>,
    tol: Tolerance,
    meter: Option<&mut dyn PeakMeter>,
) -> Result<GpuCheck> {
    let rows: Vec<&Row> = rows.iter().collect();
    let total: usize = rows.iter().map(|r| r.tokens.len()).sum();
    let mut meter = meter;
    if let Some(m) = meter.as_deref_mut() {
        m.start()?;
    }
    let mut forward = make()?;
    forward.run(&rows)?;
    let memory = match meter {
        Some(m) => Some((m.peak()?, forward.planned_bytes()?)),
        None => None,
    };
    let got = forward.features_to_host()?;
    let mut want = Vec::with_capacity(got.len());
    for row in &rows {
        want.extend(flat(&target.row_features(row, ids)?)?);
    }
    let mut errors = vec![("features".to_string(), rel_error(&vec_tensor(&got)?, &vec_tensor(&want)?))];
    let fw = ids.len() * target.hidden_size();
    let mut worst_alone = 0.0f64;
    for run in document_runs(&rows[0].doc_ids) {
        let alone = Row {
            tokens: rows[0].tokens[run.clone()].to_vec(),
            loss_mask: rows[0].loss_mask[run.clone()].to_vec(),
            doc_ids: vec![0; run.len()],
            positions: (0..run.len()).collect(),
        };
        forward.run(&[&alone])?;
        let one = forward.features_to_host()?;
        worst_alone = worst_alone.max(rel_error(&vec_tensor(&one)?, &vec_tensor(&got[run.start * fw..run.end * fw])?));
    }
    errors.push(("each document alone vs packed".to_string(), worst_alone));
    Ok(GpuCheck { name: format!("{name} ({total} tokens)"), errors, tolerance: tol.rel, memory })
}

fn flat(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

fn vec_tensor(v: &[f64]) -> Result<Tensor> {
    Ok(Tensor::new(v, &candle_core::Device::Cpu)?)
}
