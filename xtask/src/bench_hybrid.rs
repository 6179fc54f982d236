//! `xtask bench hybrid` (on the H200): the hybrid target's forward (spec section 10: GatedDeltaNet
//! and gated attention layers) that gives the drafter its features, for a checkpoint of the 27B
//! Qwen3.5's layer shapes with random weights (made in HF format by transformers in the same run;
//! nothing is downloaded), next to transformers' own forward twice in the same run: with the
//! flash-linear-attention package's Triton kernels and with the PyTorch fallback. Writes
//! `results/target-hybrid-h200.json`.

use std::path::{Path, PathBuf};

use dflash_optimized::backend::cuda::Cuda;
use dflash_optimized::memory::named::qwen3_5_27b_target;
use dflash_optimized::model::hybrid_forward::HybridForward;
use dflash_reference::config::default_target_layer_ids;
use dflash_reference::data::Row;
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
GatedDeltaNet with 16/48 heads of 128, vocab 248320; bf16 shards), cut to its first --layers
layers when the whole does not fit the disk or the time. Then times, for one row of S random
tokens (median of CUDA-event timings after warm-up):
  - ours: the forward over every layer of the checkpoint (features from layers --layer-ids, the
    last of them the last layer), no final norm or logits;
  - transformers' decoder stack (model.model, bf16, sdpa, output_hidden_states=True, every layer,
    no LM head; with --hf-lm-head yes the whole model, logits included), once with the
    flash-linear-attention package (`fla`) importable from --fla and once without it (its PyTorch
    fallback).
Prints tokens/s, the speed-ups and the peaks, and how far our features are from transformers'
(fla run; hooks on the same layers, same tokens). Writes one JSON object.

options:
  --target DIR    the checkpoint (made there when it has no config.json)
                                       (default /tmp/dflash-qwen3_5-27b-LAYERS)
  --layers N      layers of the 27B's shape to keep                (default 16; the whole: 64)
  --layer-ids L   comma-separated tapped layers      (default: the 5-feature rule's ids with the
                                                      last one the last layer: every layer runs)
  --hf-lm-head yes|no  transformers runs the LM head too  (default no: both sides the same layers)
  --seq S         tokens of the row                                 (default 4096)
  --warmup N      untimed calls                                     (default 2)
  --iters N       timed calls, median reported                      (default 5)
  --torch yes|no  run transformers                                  (default yes)
  --fla DIR       a PYTHONPATH entry holding flash-linear-attention (its Triton kernels); without
                  it only the PyTorch fallback runs                 (default: none)
  --python EXE    Python with PyTorch and transformers              (default python3)
  --script FILE   the baseline script (default target_hybrid_torch.py next to the binary, else
                                       xtask/bench/target_hybrid_torch.py)
  --out FILE      results file                          (default results/target-hybrid-h200.json)
  --seed N        seed of the weights and tokens                    (default 0)
  --profile yes|no  print each operation's GPU time in one forward  (default no)
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

/// The 5-feature rule's ids for `layers` layers with the last moved to the last layer.
fn every_layer_ids(layers: usize) -> Vec<usize> {
    let mut ids = default_target_layer_ids(layers, 5);
    if let Some(last) = ids.last_mut() {
        *last = layers - 1;
    }
    ids
}

pub fn run(args: Vec<String>) -> Result<(), String> {
    let Some(opts) = Options::parse(args, OPTIONS)? else {
        println!("{HELP}");
        return Ok(());
    };
    let layers: usize = opts.get("layers", 16)?;
    let shape = cut_config(layers)?;
    let dir: PathBuf = opts.get("target", PathBuf::from(format!("/tmp/dflash-qwen3_5-27b-{layers}")))?;
    let ids: Vec<usize> = match opts.get("layer-ids", String::new())? {
        s if s.is_empty() => every_layer_ids(layers),
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
    let hf_lm_head = opts.yes_no("hf-lm-head", false)?;
    let fla: Option<PathBuf> = Some(opts.get("fla", PathBuf::new())?).filter(|p| !p.as_os_str().is_empty());
    if let Some(fla) = fla.as_ref().filter(|p| !p.join("fla").is_dir()) {
        return Err(format!("--fla {}: no `fla` package there", fla.display()));
    }
    let profile = opts.yes_no("profile", false)?;
    let python: String = opts.get("python", "python3".to_string())?;
    let script: PathBuf =
        opts.get("script", gpu_bundle::bundled_file("target_hybrid_torch.py", "xtask/bench/target_hybrid_torch.py"))?;
    if !script.is_file() {
        return Err(format!("{}: the transformers script is missing (--script)", script.display()));
    }
    let out: PathBuf = opts.get("out", PathBuf::from("results/target-hybrid-h200.json"))?;
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
        if let Some(fla) = &fla {
            let joined = match std::env::var("PYTHONPATH") {
                Ok(rest) if !rest.is_empty() => format!("{}:{rest}", fla.display()),
                _ => fla.display().to_string(),
            };
            runs.push(("fla", with_pythonpath(&joined, || run_python_json(&python, &script, &time(true)))));
        }
        runs.push(("torch", run_python_json(&python, &script, &time(fla.is_none()))));
    }
    let tokens = read_tokens(&features_file, seq, config.vocab_size, seed)?;
    let ours = measure_ours(&dir, &config, &ids, &tokens, (warmup, iters), profile)?;
    let agreement = match std::fs::read(&features_file) {
        Ok(bytes) => Some(feature_error(&bytes, &ours.features)?),
        Err(_) => None,
    };
    let _ = std::fs::remove_file(&features_file);
    let _ = std::fs::remove_file(features_file.with_extension("bin.tokens"));

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
    println!("wrote {}", out.display());
    let errors: Vec<String> =
        runs.into_iter().filter_map(|(n, r)| r.err().map(|e| format!("transformers {n}: {e}"))).collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
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
    let theirs = bytes.chunks_exact(4).map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
    let (mut diff, mut norm) = (0.0, 0.0);
    for (a, b) in ours.iter().zip(theirs) {
        diff += (a - b) * (a - b);
        norm += b * b;
    }
    Ok((diff / norm).sqrt())
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
