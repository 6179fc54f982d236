//! `xtask bench hybrid` (on the H200): the hybrid target's forward (spec section 10: GatedDeltaNet
//! and gated attention layers) that gives the drafter its features, for a checkpoint of the 27B
//! Qwen3.5's layer shapes with random weights (made in HF format by transformers in the same run;
//! nothing is downloaded), next to transformers' own forward twice in the same run: with the
//! flash-linear-attention package's Triton kernels and with the PyTorch fallback. Writes
//! `results/target-hybrid-h200.json` for the whole 27B, `results/target-hybrid-N-layers-h200.json`
//! for a cut of N layers.

use std::path::{Path, PathBuf};

use candle_core::{DType, Tensor};
use dflash_conformance::hybrid_cases::{case_features, hybrid_check, random_hybrid_cases, GPU_HYBRID_SEED};
use dflash_conformance::tolerance::HYBRID_BF16;
use dflash_optimized::backend::cuda::Cuda;
use dflash_optimized::backend::host::Host;
use dflash_optimized::memory::named::qwen3_5_27b_target;
use dflash_optimized::model::hybrid_forward::HybridForward;
use dflash_reference::config::training_target_layer_ids;
use dflash_reference::data::{document_runs, Row};
use dflash_reference::hybrid::HybridConfig;
use dflash_reference::io::WeightSet;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::args::Options;
use crate::bench_attention::run_python_json;
use crate::gpu_bundle;
use crate::gpu_conformance::{open_gpu, utc_now, write_json};

const HELP: &str = "usage: xtask bench hybrid [options]     (on the GPU machine)

Makes (once) a random checkpoint of the 27B Qwen3.5 hybrid's shape in HF format with transformers
(hidden 5120, SwiGLU 17408, every 4th layer gated attention with 24/4 heads of 256, the others
GatedDeltaNet with 16/48 heads of 128, vocab 248320; bf16 shards, 54 GB for all 64 layers), or
its first --layers layers when the whole does not fit the disk or the time. Then times, for one
row of S random tokens (median of CUDA-event timings after warm-up):
  - ours: the forward up to the last of --layer-ids (the drafter's features), no final norm or
    logits;
  - transformers (bf16, sdpa, output_hidden_states=True, every layer; the whole model with its
    LM head, or with --hf-lm-head no its decoder stack model.model), once with the
    flash-linear-attention package (`fla`) importable from --fla and once without it (its PyTorch
    fallback).
The defaults give the drafter's comparison: for the whole 27B, ours stops after layer 61 (the
5-feature rule's ids) and transformers runs its LM head; for a cut, both sides run every layer
and no LM head (the per-layer ratio). Prints tokens/s, the speed-ups and the peaks, and how far
our features are from transformers' (fla run; hooks on the same layers, same tokens). Writes one
JSON object.

options:
  --target DIR    the checkpoint (made there when it has no config.json)
                                       (default /tmp/dflash-qwen3_5-27b-LAYERS)
  --layers N      layers of the 27B's shape to keep                  (default 64: the whole)
  --layer-ids L   comma-separated tapped layers (default: the 5-feature rule's ids, for a cut
                                                with the last one its last layer)
  --hf-lm-head yes|no  transformers runs its LM head      (default: yes for the whole, no for a cut)
  --seq S         tokens of the row                                 (default 4096)
  --warmup N      untimed calls                                     (default 2)
  --iters N       timed calls, median reported                      (default 5)
  --torch yes|no  run transformers                                  (default yes)
  --fla DIR       a PYTHONPATH entry holding flash-linear-attention (its Triton kernels); without
                  it only the PyTorch fallback runs                 (default: none)
  --python EXE    Python with PyTorch and transformers              (default python3)
  --script FILE   the baseline script (default target_hybrid_torch.py next to the binary, else
                                       xtask/bench/target_hybrid_torch.py)
  --out FILE      results file   (default results/target-hybrid-h200.json for all 64 layers,
                                  results/target-hybrid-N-layers-h200.json for a cut of N)
  --seed N        seed of the weights and tokens                    (default 0)
  --profile yes|no  print each operation's GPU time in one forward  (default no)
  --accuracy yes|no  also the error bf16 storage costs, on gpu-conformance's random hybrids:
                  transformers' bf16 forward (fla and torch runs), ours on the GPU and the bf16
                  CPU twins, each against the reference in f32   (default: yes when --torch yes)
  --commit SHA    the commit measured          (default: commit.txt next to the binary)";

const OPTIONS: &[&str] = &[
    "target",
    "layers",
    "layer-ids",
    "hf-lm-head",
    "seq",
    "warmup",
    "iters",
    "torch",
    "fla",
    "python",
    "script",
    "out",
    "seed",
    "profile",
    "accuracy",
    "commit",
];

/// The 27B hybrid's config cut to its first `layers` layers.
fn cut_config(layers: usize) -> Result<HybridConfig, String> {
    let mut config = qwen3_5_27b_target();
    if layers == 0 || layers > config.num_layers() {
        return Err(format!("--layers {layers}: between 1 and {}", config.num_layers()));
    }
    config.layer_kinds.truncate(layers);
    Ok(config)
}

/// The 5-feature rule's ids for `layers` of the 27B's layers: as the rule gives them for the
/// whole model, with the last moved to the last layer for a cut (every layer of it runs).
fn default_layer_ids(layers: usize) -> Vec<usize> {
    let mut ids = training_target_layer_ids(layers, 5);
    if let Some(last) = ids.last_mut().filter(|_| layers < qwen3_5_27b_target().num_layers()) {
        *last = layers - 1;
    }
    ids
}

pub fn run(args: Vec<String>) -> Result<(), String> {
    let Some(opts) = Options::parse(args, OPTIONS)? else {
        println!("{HELP}");
        return Ok(());
    };
    let whole = qwen3_5_27b_target().num_layers();
    let layers: usize = opts.get("layers", whole)?;
    let shape = cut_config(layers)?;
    let dir: PathBuf = opts.get("target", PathBuf::from(format!("/tmp/dflash-qwen3_5-27b-{layers}")))?;
    let ids: Vec<usize> = match opts.get("layer-ids", String::new())? {
        s if s.is_empty() => default_layer_ids(layers),
        s => s
            .split(',')
            .map(|x| x.trim().parse().map_err(|_| format!("option `--layer-ids`: `{x}` is not a layer")))
            .collect::<Result<_, _>>()?,
    };
    let (seq, warmup, iters, seed): (usize, usize, usize, u64) =
        (opts.get("seq", 4096)?, opts.get("warmup", 2)?, opts.get("iters", 5)?, opts.get("seed", 0)?);
    if seq == 0 || iters == 0 {
        return Err("--seq and --iters must be at least 1".into());
    }
    let with_torch = opts.yes_no("torch", true)?;
    let hf_lm_head = opts.yes_no("hf-lm-head", layers == whole)?;
    let fla: Option<PathBuf> = Some(opts.get("fla", PathBuf::new())?).filter(|p| !p.as_os_str().is_empty());
    if let Some(fla) = fla.as_ref().filter(|p| !p.join("fla").is_dir()) {
        return Err(format!("--fla {}: no `fla` package there", fla.display()));
    }
    let profile = opts.yes_no("profile", false)?;
    let with_accuracy = opts.yes_no("accuracy", with_torch)?;
    let python: String = opts.get("python", "python3".to_string())?;
    let script: PathBuf =
        opts.get("script", gpu_bundle::bundled_file("target_hybrid_torch.py", "xtask/bench/target_hybrid_torch.py"))?;
    if !script.is_file() {
        return Err(format!("{}: the transformers script is missing (--script)", script.display()));
    }
    let default_out = match layers == whole {
        true => "results/target-hybrid-h200.json".to_string(),
        false => format!("results/target-hybrid-{layers}-layers-h200.json"),
    };
    let out: PathBuf = opts.get("out", PathBuf::from(default_out))?;
    let commit = gpu_bundle::commit(Some(opts.get("commit", String::new())?).filter(|c| !c.is_empty()))?;

    if !dir.join("config.json").is_file() {
        println!("making a random {layers}-layer checkpoint of the 27B Qwen3.5's shape in {}", dir.display());
        let spec = json!({"mode": "make", "model_dir": dir, "config": shape.to_value(), "seed": seed});
        run_python_json(&python, &script, &spec)?;
    }
    let config = HybridConfig::from_file(&dir.join("config.json")).map_err(|e| e.to_string())?;
    if let Some(bad) = ids.iter().find(|&&l| l >= config.num_layers()) {
        return Err(format!("--layer-ids: layer {bad} is out of range for {} layers", config.num_layers()));
    }
    let features_file = std::env::temp_dir().join(format!("dflash-hybrid-features-{}.bin", std::process::id()));
    let mut runs: Vec<(&str, Result<Value, String>)> = Vec::new();
    if with_torch {
        let time = |features: bool| {
            json!({"mode": "time", "model_dir": dir, "seq": seq, "warmup": warmup, "iters": iters, "seed": seed,
                   "layer_ids": ids, "lm_head": hf_lm_head,
                   "features_out": if features { features_file.display().to_string() } else { String::new() }})
        };
        runs = both_paths(&python, &script, fla.as_deref(), |path| time(path == "fla" || fla.is_none()));
    }
    let tokens = read_tokens(&features_file, seq, config.vocab_size, seed)?;
    let ours = measure_ours(&dir, &config, &ids, &tokens, (warmup, iters), profile)?;
    let agreement = match std::fs::read(&features_file) {
        Ok(bytes) => Some(feature_error(&bytes, &ours.features)?),
        Err(_) => None,
    };
    let _ = std::fs::remove_file(&features_file);
    let _ = std::fs::remove_file(features_file.with_extension("bin.tokens"));
    let accuracy = match with_accuracy {
        true => Some(bf16_accuracy(&python, &script, fla.as_deref())?),
        false => None,
    };

    let tokens_per_s = |ms: f64| seq as f64 / (ms * 1e-3);
    let hf = |name: &str| runs.iter().find(|r| r.0 == name).and_then(|r| r.1.as_ref().ok());
    let hf_ms = |name: &str| hf(name).and_then(|v| v["ms"].as_f64());
    let shape_text = format!(
        "the 27B Qwen3.5's layers, first {} of 64 ({} GatedDeltaNet + {} gated attention), hidden 5120, vocab 248320",
        config.num_layers(),
        config.layer_kinds.iter().filter(|k| **k == dflash_reference::hybrid::HybridLayerKind::Linear).count(),
        config.layer_kinds.iter().filter(|k| **k == dflash_reference::hybrid::HybridLayerKind::Full).count(),
    );
    let result = json!({
        "shape": shape_text,
        "seq": seq,
        "layer_ids": ids,
        "ours_layers_run": ids.iter().max().map(|l| l + 1),
        "hf_layers_run": config.num_layers(),
        "hf_lm_head": hf_lm_head,
        "ours_ms": ours.ms,
        "hf_fla_ms": hf_ms("fla"),
        "hf_torch_ms": hf_ms("torch"),
        "ours_tokens_per_s": tokens_per_s(ours.ms),
        "hf_fla_tokens_per_s": hf_ms("fla").map(tokens_per_s),
        "hf_torch_tokens_per_s": hf_ms("torch").map(tokens_per_s),
        "speedup_vs_fla": hf_ms("fla").map(|h| h / ours.ms),
        "speedup_vs_torch": hf_ms("torch").map(|h| h / ours.ms),
        "ours_peak_gb": ours.peak as f64 / 1e9,
        "ours_planned_gb": ours.planned as f64 / 1e9,
        "hf_fla_peak_gb": hf("fla").and_then(|v| v["peak_bytes"].as_f64()).map(|b| b / 1e9),
        "hf_torch_peak_gb": hf("torch").and_then(|v| v["peak_bytes"].as_f64()).map(|b| b / 1e9),
        "hf_fla_kernels": hf("fla").map(|v| v["gdn_kernels"].clone()),
        "hf_torch_kernels": hf("torch").map(|v| v["gdn_kernels"].clone()),
        "features_rel_error_vs_hf": agreement,
        "bf16_accuracy": accuracy.as_ref().map(|rows| rows.iter().map(AccuracyRow::to_json).collect::<Vec<_>>()),
        "baseline": hf("torch").or(hf("fla")).map(|v| format!("torch {}, transformers {}", v["torch"], v["transformers"])),
        "warmup": warmup,
        "iters": iters,
        "date": utc_now(),
        "gpu": ours.gpu,
        "commit": commit,
    });
    write_json(&out, &result)?;
    let f = |v: &Value, digits: usize| v.as_f64().map_or("-".to_string(), |x| format!("{x:.digits$}"));
    println!("{shape_text}, S={seq}:");
    println!("{:<28} {:>9} {:>10} {:>9} {:>8}", "", "ms", "tokens/s", "ours x", "peak GB");
    for (name, ms, peak, speedup) in [
        ("ours", &result["ours_ms"], &result["ours_peak_gb"], &Value::Null),
        ("transformers + fla", &result["hf_fla_ms"], &result["hf_fla_peak_gb"], &result["speedup_vs_fla"]),
        ("transformers, torch path", &result["hf_torch_ms"], &result["hf_torch_peak_gb"], &result["speedup_vs_torch"]),
    ] {
        let tps = ms.as_f64().map_or("-".to_string(), |ms| format!("{:.0}", tokens_per_s(ms)));
        println!("{name:<28} {:>9} {tps:>10} {:>9} {:>8}", f(ms, 2), f(speedup, 2), f(peak, 2));
    }
    if let Some(e) = agreement {
        println!("our features vs transformers' (fla run, layers {ids:?}): relative error {e:.2e}");
    }
    if let Some(rows) = &accuracy {
        AccuracyRow::print(rows);
    }
    println!("wrote {}", out.display());
    let errors: Vec<String> =
        runs.into_iter().filter_map(|(n, r)| r.err().map(|e| format!("transformers {n}: {e}"))).collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
}

/// The script on `input(path)` once with `fla` on `PYTHONPATH` (path "fla", when given) and
/// once as the environment has it (path "torch": transformers' PyTorch fallback unless the
/// environment already holds fla).
fn both_paths(
    python: &str,
    script: &Path,
    fla: Option<&Path>,
    input: impl Fn(&str) -> Value,
) -> Vec<(&'static str, Result<Value, String>)> {
    let mut runs = Vec::new();
    if let Some(fla) = fla {
        let joined = match std::env::var("PYTHONPATH") {
            Ok(rest) if !rest.is_empty() => format!("{}:{rest}", fla.display()),
            _ => fla.display().to_string(),
        };
        runs.push(("fla", with_pythonpath(&joined, || run_python_json(python, script, &input("fla")))));
    }
    runs.push(("torch", run_python_json(python, script, &input("torch"))));
    runs
}

/// The error bf16 storage costs on one of gpu-conformance's random hybrids: each forward's
/// features against the reference's in f32 (relative, Frobenius), on the same bf16-exact weights
/// and documents.
struct AccuracyRow {
    case: String,
    tokens: usize,
    ours_gpu: f64,
    ours_bf16_twins: f64,
    /// Ours on the GPU against the bf16 twins (the same storage, f32 arithmetic on the CPU).
    gpu_vs_twins: f64,
    hf_fla: Option<f64>,
    hf_torch: Option<f64>,
}

impl AccuracyRow {
    fn to_json(&self) -> Value {
        json!({"case": self.case, "tokens": self.tokens, "ours_gpu": self.ours_gpu,
               "ours_bf16_twins": self.ours_bf16_twins, "ours_gpu_vs_bf16_twins": self.gpu_vs_twins, "hf_fla_bf16": self.hf_fla, "hf_torch_bf16": self.hf_torch})
    }

    fn print(rows: &[AccuracyRow]) {
        let f = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2e}"));
        println!("features vs the reference in f32 (bf16 storage's error), gpu-conformance's random hybrids:");
        println!(
            "{:<58} {:>9} {:>10} {:>10} {:>11}   GPU vs twins",
            "", "ours GPU", "bf16 twins", "hf + fla", "hf, torch"
        );
        for r in rows {
            let name = format!("{} ({} tokens)", r.case, r.tokens);
            println!(
                "{name:<58} {:>9} {:>10} {:>10} {:>11}   {}",
                f(Some(r.ours_gpu)),
                f(Some(r.ours_bf16_twins)),
                f(r.hf_fla),
                f(r.hf_torch),
                f(Some(r.gpu_vs_twins))
            );
        }
    }
}

/// [`AccuracyRow`]s of `random_hybrid_cases(GPU_HYBRID_SEED)`: transformers runs each document
/// alone (its forward has no packed rows), ours the packed rows (padding zero on both sides of the
/// comparison), the reference in f32.
fn bf16_accuracy(python: &str, script: &Path, fla: Option<&Path>) -> Result<Vec<AccuracyRow>, String> {
    let err = |e: dflash_optimized::Error| e.to_string();
    let cases = random_hybrid_cases(GPU_HYBRID_SEED, DType::F32).map_err(err)?;
    let work = std::env::temp_dir().join(format!("dflash-hybrid-accuracy-{}", std::process::id()));
    let mut specs = Vec::new();
    let mut want = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let dir = work.join(format!("case-{i}"));
        case.model.save(&dir).map_err(|e| e.to_string())?;
        let docs: Vec<Vec<u32>> = case
            .rows
            .iter()
            .flat_map(|row| document_runs(&row.doc_ids).into_iter().map(|run| row.tokens[run].to_vec()))
            .collect();
        let mut reference = Vec::new();
        for doc in &docs {
            let out = case.model.forward(doc, &case.layer_ids).map_err(|e| e.to_string())?;
            let cat = Tensor::cat(&out.hidden, 1).and_then(|t| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>());
            reference.extend(cat.map_err(|e| e.to_string())?);
        }
        want.push(reference);
        specs.push(json!({"model_dir": dir, "documents": docs, "layer_ids": case.layer_ids}));
    }
    let features = |path: &str, i: usize| work.join(format!("{path}-{i}.bin"));
    let input = |path: &str| {
        let cases: Vec<Value> = specs
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                let mut spec = spec.clone();
                spec["features_out"] = json!(features(path, i));
                spec
            })
            .collect();
        json!({"mode": "documents", "cases": cases})
    };
    let runs = both_paths(python, script, fla, input);
    let gpu = open_gpu()?;
    let mut rows = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let d = case.model.config.head_dim;
        let gpu_check = hybrid_check(case, || Cuda::new(&gpu, d), HYBRID_BF16, None).map_err(err)?;
        let twin_check = hybrid_check(case, || Ok(Host::<half::bf16>::default()), HYBRID_BF16, None).map_err(err)?;
        let hf = |path: &str| -> Result<Option<f64>, String> {
            match runs.iter().find(|r| r.0 == path) {
                Some((_, Ok(_))) => {
                    let file = features(path, i);
                    let bytes = std::fs::read(&file).map_err(|e| format!("{}: {e}", file.display()))?;
                    Ok(Some(feature_error(&bytes, &want[i])?))
                }
                _ => Ok(None),
            }
        };
        rows.push(AccuracyRow {
            case: case.name.clone(),
            tokens: case.rows.iter().map(|r| r.tokens.len()).sum(),
            ours_gpu: gpu_check.errors[0].1,
            ours_bf16_twins: twin_check.errors[0].1,
            gpu_vs_twins: rel(
                &case_features(case, Cuda::new(&gpu, d).map_err(err)?).map_err(err)?,
                &case_features(case, Host::<half::bf16>::default()).map_err(err)?,
            ),
            hf_fla: hf("fla")?,
            hf_torch: hf("torch")?,
        });
    }
    let _ = std::fs::remove_dir_all(&work);
    for (path, run) in &runs {
        if let Err(e) = run {
            return Err(format!("transformers {path} (accuracy): {e}"));
        }
    }
    Ok(rows)
}

/// Runs `f` with `PYTHONPATH` set to `value`, restoring it after.
fn with_pythonpath<T>(value: &str, f: impl FnOnce() -> T) -> T {
    let before = std::env::var_os("PYTHONPATH");
    // SAFETY: xtask is single-threaded here; no other thread reads the environment meanwhile.
    unsafe { std::env::set_var("PYTHONPATH", value) };
    let out = f();
    match before {
        // SAFETY: as above.
        Some(v) => unsafe { std::env::set_var("PYTHONPATH", v) },
        // SAFETY: as above.
        None => unsafe { std::env::remove_var("PYTHONPATH") },
    }
    out
}

/// The row's tokens: those transformers ran (`FILE.tokens` beside its features), or `seq` random
/// ones when it did not run.
fn read_tokens(features_file: &Path, seq: usize, vocab: usize, seed: u64) -> Result<Vec<u32>, String> {
    let file = features_file.with_extension("bin.tokens");
    match std::fs::read(&file) {
        Ok(bytes) if bytes.len() == 4 * seq => {
            Ok(bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
        }
        Ok(bytes) => Err(format!("{}: {} bytes, expected {} tokens", file.display(), bytes.len(), seq)),
        Err(_) => {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            Ok((0..seq).map(|_| rng.random_range(0..vocab as u32)).collect())
        }
    }
}

/// Relative error (Frobenius) of our features against transformers' (`bytes`: f32 `[S, F*H]`).
fn feature_error(bytes: &[u8], ours: &[f64]) -> Result<f64, String> {
    if bytes.len() != 4 * ours.len() {
        return Err(format!("transformers' features: {} values, ours {}", bytes.len() / 4, ours.len()));
    }
    let theirs: Vec<f64> =
        bytes.chunks_exact(4).map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))).collect();
    Ok(rel(ours, &theirs))
}

/// `||got - want|| / ||want||` (Frobenius) of equally long slices.
fn rel(got: &[f64], want: &[f64]) -> f64 {
    let diff: f64 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let norm: f64 = want.iter().map(|b| b * b).sum();
    (diff / norm).sqrt()
}

/// What our side measured: the median ms, the pool peak (weights included), the layout's bytes
/// and the features of the last run.
struct Ours {
    gpu: String,
    ms: f64,
    peak: u64,
    planned: u64,
    features: Vec<f64>,
}

fn measure_ours(
    dir: &Path,
    config: &HybridConfig,
    ids: &[usize],
    tokens: &[u32],
    (warmup, iters): (usize, usize),
    profile: bool,
) -> Result<Ours, String> {
    let err = |e: dflash_optimized::Error| e.to_string();
    let gpu = open_gpu()?;
    let started = std::time::Instant::now();
    let weights = WeightSet::load_dir(dir).map_err(|e| e.to_string())?;
    println!("read {} in {:.1}s", dir.display(), started.elapsed().as_secs_f64());
    let before = gpu.pool_used().map_err(err)?;
    gpu.reset_pool_high().map_err(err)?;
    let cuda = Cuda::new(&gpu, config.head_dim).map_err(err)?;
    let mut forward = HybridForward::new(cuda, config, ids, tokens.len()).map_err(err)?;
    let started = std::time::Instant::now();
    forward.load_weights(|name, shape| weights.get(name, shape, candle_core::DType::BF16)).map_err(err)?;
    let planned = forward.layout.total_bytes().map_err(err)?;
    println!(
        "loaded layers 0..={} (+ embedding and LM head) in {:.1}s; planned {:.2} GB",
        ids.iter().max().unwrap_or(&0),
        started.elapsed().as_secs_f64(),
        planned as f64 / 1e9
    );
    drop(weights);
    let seq = tokens.len();
    let row = Row {
        tokens: tokens.to_vec(),
        loss_mask: vec![true; seq],
        doc_ids: vec![0; seq],
        positions: (0..seq).collect(),
    };
    gpu.reset_pool_high().map_err(err)?;
    let ms = gpu.time_ms(warmup, iters, || forward.run(&[&row])).map_err(err)?;
    let peak = gpu.pool_used_high().map_err(err)?.saturating_sub(before);
    let features = forward.features_to_host().map_err(err)?;
    if !features.iter().all(|x| x.is_finite()) {
        return Err(format!("ours S={seq}: non-finite features"));
    }
    println!("ours S={seq}: {ms:.2} ms, peak {:.2} GB", peak as f64 / 1e9);
    if profile {
        crate::bench::profile_once(&format!("one forward of S={seq}"), || forward.run(&[&row]))?;
    }
    Ok(Ours { gpu: gpu.name().to_string(), ms, peak, planned, features })
}
