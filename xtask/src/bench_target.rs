//! `xtask bench target` (on the H200): the target's forward that gives the drafter its features,
//! for a Qwen3-8B-shaped checkpoint with random weights (made in HF format by transformers in the
//! same run; nothing is downloaded), next to transformers' own forward with hidden states in the
//! same run; writes `results/target-h200.json`.

use dflash_optimized::flops::{target_forward_flops, PEAK_FLOPS, TARGET_FLOP_CONVENTION};
use std::path::{Path, PathBuf};

use dflash_optimized::backend::cuda::Cuda;
use dflash_optimized::memory::named::qwen3_8b_target;
use dflash_optimized::model::target_forward::TargetForward;
use dflash_reference::config::{default_target_layer_ids, TargetConfig};
use dflash_reference::data::Row;
use dflash_reference::io::WeightSet;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::args::Options;
use crate::bench_attention::run_python_json;
use crate::gpu_bundle;
use crate::gpu_conformance::{open_gpu, utc_now, write_json};

const HELP: &str = "usage: xtask bench target [options]     (on the GPU machine)

Makes (once) a random Qwen3-8B-shaped checkpoint in HF format with transformers (36 layers, hidden
4096, 32/8 heads of 128, SwiGLU 12288, vocab 151936; bf16 shards), then for each S times our
target forward (layers 0..=33 for the drafter's features from layers [1, 9, 17, 25, 33], no final
norm or logits, one row of S random tokens) and transformers' forward (bf16, sdpa,
output_hidden_states=True, all layers and the LM head): median of CUDA-event timings after
warm-up, tokens/s, MFU and peak memory (weights included). Writes one JSON object per S and prints
a table last.

options:
  --target DIR    the checkpoint (made there when it has no config.json)
                                              (default /tmp/dflash-qwen3-8b-random)
  --seqs LIST     comma-separated S values                 (default 3072,8192)
  --warmup N      untimed calls                            (default 2)
  --iters N       timed calls, median reported             (default 5)
  --torch yes|no  run transformers' forward                (default yes)
  --python EXE    Python with PyTorch and transformers     (default python3)
  --script FILE   the baseline script   (default target_torch.py next to the binary, else
                                         xtask/bench/target_torch.py)
  --out FILE      results file                             (default results/target-h200.json)
  --seed N        seed of the tokens                       (default 0)
  --profile yes|no  print each operation's GPU time in one forward per S (default no)
  --commit SHA    the commit measured                      (default: commit.txt next to the binary)";

const OPTIONS: &[&str] =
    &["target", "seqs", "warmup", "iters", "torch", "python", "script", "out", "seed", "commit", "profile"];

/// Qwen3-8B's config for transformers' `Qwen3Config` (the named target's dims; random weights).
pub fn qwen3_8b_config() -> Value {
    let t = qwen3_8b_target();
    let c = &t.dims;
    json!({
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers(), "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "tie_word_embeddings": t.tie_word_embeddings,
    })
}

pub fn run(args: Vec<String>) -> Result<(), String> {
    let Some(opts) = Options::parse(args, OPTIONS)? else {
        println!("{HELP}");
        return Ok(());
    };
    let dir: PathBuf = opts.get("target", PathBuf::from("/tmp/dflash-qwen3-8b-random"))?;
    let seqs: Vec<usize> = opts
        .get("seqs", "3072,8192".to_string())?
        .split(',')
        .map(|s| s.trim().parse().map_err(|_| format!("option `--seqs`: `{s}` is not a token count")))
        .collect::<Result<_, _>>()?;
    if seqs.is_empty() || seqs.contains(&0) {
        return Err("option `--seqs`: at least one S, each at least 1".into());
    }
    let (warmup, iters, seed): (usize, usize, u64) =
        (opts.get("warmup", 2)?, opts.get("iters", 5)?, opts.get("seed", 0)?);
    if iters == 0 {
        return Err("--iters must be at least 1".into());
    }
    let with_torch = opts.yes_no("torch", true)?;
    let profile = opts.yes_no("profile", false)?;
    let python: String = opts.get("python", "python3".to_string())?;
    let script: PathBuf =
        opts.get("script", gpu_bundle::bundled_file("target_torch.py", "xtask/bench/target_torch.py"))?;
    if !script.is_file() {
        return Err(format!("{}: the transformers script is missing (--script)", script.display()));
    }
    let out: PathBuf = opts.get("out", PathBuf::from("results/target-h200.json"))?;
    let commit = gpu_bundle::commit(Some(opts.get("commit", String::new())?).filter(|c| !c.is_empty()))?;

    if !dir.join("config.json").is_file() {
        println!("making a random Qwen3-8B-shaped checkpoint in {} with transformers", dir.display());
        let spec = json!({"mode": "make", "model_dir": dir, "config": qwen3_8b_config(), "seed": seed});
        run_python_json(&python, &script, &spec)?;
    }
    let config = TargetConfig::from_file(&dir.join("config.json")).map_err(|e| e.to_string())?;
    let layer_ids = default_target_layer_ids(config.dims.num_layers(), 5);
    let layers = layer_ids.iter().max().map_or(0, |&l| l + 1);
    let max_seq = *seqs.iter().max().expect("non-empty");
    let ours = measure_ours(&dir, &config, &layer_ids, &seqs, max_seq, (warmup, iters, seed), profile)?;
    let hf = if with_torch {
        let spec =
            json!({"mode": "time", "model_dir": dir, "seqs": seqs, "warmup": warmup, "iters": iters, "seed": seed});
        Some(run_python_json(&python, &script, &spec))
    } else {
        None
    };
    let mut errors = Vec::new();
    if let Some(Err(e)) = &hf {
        errors.push(format!("transformers: {e}"));
    }
    let hf_ok = hf.as_ref().and_then(|r| r.as_ref().ok());
    let versions = hf_ok.map(|v| format!("torch {}, transformers {}", v["torch"], v["transformers"]));
    let (gpu, date) = (ours.gpu.clone(), utc_now());
    let mut objects = Vec::new();
    for (k, &seq) in seqs.iter().enumerate() {
        let (ms, peak) = ours.per_seq[k];
        let hf_row = hf_ok.and_then(|v| v["results"].as_array()).and_then(|r| r.iter().find(|x| x["seq"] == seq));
        let hf_ms = hf_row.and_then(|r| r["ms"].as_f64());
        let hf_peak = hf_row.and_then(|r| r["peak_bytes"].as_f64());
        let tokens = |ms: f64| seq as f64 / (ms * 1e-3);
        let ours_flops = target_forward_flops(&config, layers, seq, false);
        let hf_flops = target_forward_flops(&config, config.dims.num_layers(), seq, true);
        objects.push(json!({
            "seq": seq,
            "ours_ms": ms,
            "hf_ms": hf_ms,
            "ours_tokens_per_s": tokens(ms),
            "hf_tokens_per_s": hf_ms.map(tokens),
            "speedup": hf_ms.map(|h| h / ms),
            "mfu": ours_flops / (ms * 1e-3 * PEAK_FLOPS),
            "hf_mfu": hf_ms.map(|h| hf_flops / (h * 1e-3 * PEAK_FLOPS)),
            "ours_peak_gb": peak as f64 / 1e9,
            "ours_planned_gb": ours.planned as f64 / 1e9,
            "hf_peak_gb": hf_peak.map(|b| b / 1e9),
            "layers_run": layers,
            "layer_ids": layer_ids,
            "baseline": versions,
            "flop_convention": TARGET_FLOP_CONVENTION,
            "warmup": warmup,
            "iters": iters,
            "date": date,
            "gpu": gpu,
            "commit": commit,
        }));
    }
    write_json(&out, &Value::Array(objects.clone()))?;
    let f = |v: &Value, digits: usize| v.as_f64().map_or("-".to_string(), |x| format!("{x:.digits$}"));
    println!(
        "{:>6} {:>9} {:>9} {:>10} {:>10} {:>7} {:>6} {:>6} {:>8} {:>8}",
        "S", "ours ms", "hf ms", "ours tok/s", "hf tok/s", "speedup", "MFU", "hfMFU", "peak GB", "hf GB"
    );
    for o in &objects {
        println!(
            "{:>6} {:>9} {:>9} {:>10} {:>10} {:>7} {:>6} {:>6} {:>8} {:>8}",
            o["seq"],
            f(&o["ours_ms"], 2),
            f(&o["hf_ms"], 2),
            f(&o["ours_tokens_per_s"], 0),
            f(&o["hf_tokens_per_s"], 0),
            f(&o["speedup"], 2),
            f(&o["mfu"], 3),
            f(&o["hf_mfu"], 3),
            f(&o["ours_peak_gb"], 2),
            f(&o["hf_peak_gb"], 2),
        );
    }
    println!("wrote {}", out.display());
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
}

/// What our side measured: per S the median ms and the pool peak (weights included).
struct Ours {
    gpu: String,
    per_seq: Vec<(f64, u64)>,
    planned: u64,
}

fn measure_ours(
    dir: &Path,
    config: &TargetConfig,
    layer_ids: &[usize],
    seqs: &[usize],
    max_seq: usize,
    (warmup, iters, seed): (usize, usize, u64),
    profile: bool,
) -> Result<Ours, String> {
    let err = |e: dflash_optimized::Error| e.to_string();
    let gpu = open_gpu()?;
    let started = std::time::Instant::now();
    let weights = WeightSet::load_dir(dir).map_err(|e| e.to_string())?;
    println!("read {} in {:.1}s", dir.display(), started.elapsed().as_secs_f64());
    let before = gpu.pool_used().map_err(err)?;
    gpu.reset_pool_high().map_err(err)?;
    let cuda = Cuda::new(&gpu, config.dims.head_dim).map_err(err)?;
    let mut forward = TargetForward::new(cuda, config, layer_ids, max_seq, true).map_err(err)?;
    let started = std::time::Instant::now();
    forward.load_weights(|name, shape| weights.get(name, shape, candle_core::DType::BF16)).map_err(err)?;
    println!(
        "loaded layers 0..={} (+ embedding and LM head) in {:.1}s; planned {:.2} GB",
        layer_ids.iter().max().unwrap_or(&0),
        started.elapsed().as_secs_f64(),
        forward.layout.total_bytes().map_err(err)? as f64 / 1e9
    );
    drop(weights);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut per_seq = Vec::new();
    for &seq in seqs {
        let row = Row {
            tokens: (0..seq).map(|_| rng.random_range(0..config.dims.vocab_size as u32)).collect(),
            loss_mask: vec![true; seq],
            doc_ids: vec![0; seq],
            positions: (0..seq).collect(),
        };
        gpu.reset_pool_high().map_err(err)?;
        let ms = gpu.time_ms(warmup, iters, || forward.run(&[&row])).map_err(err)?;
        let peak = gpu.pool_used_high().map_err(err)?.saturating_sub(before);
        let finite = forward.features_to_host().map_err(err)?.iter().all(|x| x.is_finite());
        println!(
            "ours S={seq}: {ms:.2} ms, peak {:.2} GB{}",
            peak as f64 / 1e9,
            if finite { "" } else { ", NON-FINITE" }
        );
        if !finite {
            return Err(format!("ours S={seq}: non-finite features"));
        }
        per_seq.push((ms, peak));
        if profile {
            crate::bench::profile_once(&format!("one forward of S={seq}"), || forward.run(&[&row]))?;
            // Whether the host holds the GPU up: run() returns before the GPU has finished
            // unless the host waits on it or launches slower than the GPU runs.
            let started = std::time::Instant::now();
            forward.run(&[&row]).map_err(err)?;
            let queued = started.elapsed().as_secs_f64() * 1e3;
            dflash_optimized::backend::Backend::synchronize(forward.backend()).map_err(err)?;
            println!(
                "one forward of S={seq}: run() returned after {queued:.2} ms, the GPU finished after {:.2} ms (host clock)",
                started.elapsed().as_secs_f64() * 1e3
            );
        }
    }
    Ok(Ours { gpu: gpu.name().to_string(), per_seq, planned: forward.layout.total_bytes().map_err(err)? })
}
