//! `xtask bench train` (on the H200): training end to end on one GPU, the trainer's own engine
//! (`DeviceEngine`: the target's forward online, the drafter's step, AdamW on the device) for a
//! Qwen3-8B-shaped target (random weights in HF format, made by `bench target`'s script) and its
//! drafter, at the recipe's shape and at SpecForge's published one, online and offline, next to
//! a PyTorch pipeline in the same run; writes `results/train-h200.json`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use dflash_data::features::{Entry, FeatureCache, FeatureIndex, FeatureWriter};
use dflash_optimized::backend::cuda::Cuda;
use dflash_optimized::device::gpu::Gpu;
use dflash_optimized::memory::named::named_configs;
use dflash_optimized::memory::step::Checkpointing;
use dflash_optimized::model::target_forward::TargetForward;
use dflash_reference::config::{DraftConfig, TargetConfig};
use dflash_reference::data::{Row, TrainRow};
use dflash_reference::drafter::{Drafter, FrozenHead};
use dflash_reference::io::WeightSet;
use dflash_reference::loss::default_gamma;
use dflash_reference::optim::AdamWConfig;
use dflash_trainer::engine::{DeviceEngine, Frozen, StepBatch, StepEngine};
use dflash_trainer::rows::{cached_features, ReadAhead, RowSource};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

use crate::args::Options;
use crate::bench_attention::run_python_json;
use crate::gpu_bundle;
use crate::gpu_conformance::{open_gpu, utc_now, write_json};

const HELP: &str = "usage: xtask bench train [options]     (on the GPU machine)

One training row per optimizer step, end to end: the target's forward (layers 0..=33 of a random
Qwen3-8B-shaped checkpoint, bf16; made there by `bench target`'s script when missing) writes the
features where the drafter's step reads them, the step (5 layers, block 16, checkpointing as
`--checkpointing` says) and AdamW on the device; rows of S random tokens, every token supervised, N
anchors re-drawn every step. Median of CUDA-event timings after warm-up of whole optimizer steps.
Offline: the same steps with each row's features read from a feature cache on disk (written
first to the temporary folder, so read from the page cache, as a warm cache) by the trainer's
reader, the next row read while a step runs, as `train --features` on the GPU reads them. The PyTorch pipeline (xtask/bench/train_torch.py:
transformers' forward with hidden states, the step of step_torch.py, fused AdamW) runs in the
same command. Writes one JSON object per shape and prints a table last.

options:
  --target DIR    the checkpoint              (default /tmp/dflash-qwen3-8b-random)
  --shapes LIST   S x N pairs                 (default 3072x512,768x256)
  --warmup N      untimed steps               (default 2)
  --iters N       timed steps, median         (default 5)
  --torch yes|no  run the PyTorch pipeline    (default yes)
  --python EXE    Python with PyTorch and transformers (default python3)
  --out FILE      results file                (default results/train-h200.json)
  --seed N        seed of tokens, anchors, init (default 0)
  --profile yes|no  print each operation's GPU time in one more step per shape (default no)
  --checkpointing POLICY  both steps' policy, ours and the PyTorch pipeline's: per-layer,
                  selective or none; each object records it    (default per-layer)
  --commit SHA    the commit measured         (default: commit.txt next to the binary)";

const OPTIONS: &[&str] =
    &["target", "shapes", "warmup", "iters", "torch", "python", "out", "seed", "commit", "profile", "checkpointing"];

/// What our engine measured at one shape.
struct Measured {
    ms: f64,
    peak_bytes: u64,
    losses: Vec<f64>,
}

pub fn run(args: Vec<String>) -> Result<(), String> {
    let Some(opts) = Options::parse(args, OPTIONS)? else {
        println!("{HELP}");
        return Ok(());
    };
    let dir: PathBuf = opts.get("target", PathBuf::from("/tmp/dflash-qwen3-8b-random"))?;
    let shapes: Vec<(usize, usize)> = opts
        .get("shapes", "3072x512,768x256".to_string())?
        .split(',')
        .map(|p| {
            let bad = || format!("option `--shapes`: `{p}` is not SxN (e.g. 3072x512)");
            let (s, n) = p.trim().split_once('x').ok_or_else(bad)?;
            let (s, n): (usize, usize) = (s.parse().map_err(|_| bad())?, n.parse().map_err(|_| bad())?);
            if n == 0 || n + 1 > s {
                return Err(format!("option `--shapes`: {n} anchors do not fit rows of {s} tokens"));
            }
            Ok((s, n))
        })
        .collect::<Result<_, String>>()?;
    let (warmup, iters, seed): (usize, usize, u64) =
        (opts.get("warmup", 2)?, opts.get("iters", 5)?, opts.get("seed", 0)?);
    if iters == 0 {
        return Err("--iters must be at least 1".into());
    }
    let with_torch = opts.yes_no("torch", true)?;
    let profile = opts.yes_no("profile", false)?;
    let policy_name: String = opts.get("checkpointing", "per-layer".to_string())?;
    let policy = Checkpointing::from_name(&policy_name)
        .ok_or_else(|| format!("option `--checkpointing`: `{policy_name}` is not none, selective or per-layer"))?;
    let python: String = opts.get("python", "python3".to_string())?;
    let target_script = gpu_bundle::bundled_file("target_torch.py", "xtask/bench/target_torch.py");
    let script = gpu_bundle::bundled_file("train_torch.py", "xtask/bench/train_torch.py");
    for s in [&target_script, &script] {
        if !s.is_file() {
            return Err(format!("{}: a baseline script is missing", s.display()));
        }
    }
    let out: PathBuf = opts.get("out", PathBuf::from("results/train-h200.json"))?;
    let commit = gpu_bundle::commit(Some(opts.get("commit", String::new())?).filter(|c| !c.is_empty()))?;

    if !dir.join("config.json").is_file() {
        println!("making a random Qwen3-8B-shaped checkpoint in {} with transformers", dir.display());
        let spec =
            json!({"mode": "make", "model_dir": dir, "config": crate::bench_target::qwen3_8b_config(), "seed": seed});
        run_python_json(&python, &target_script, &spec)?;
    }
    let target = TargetConfig::from_file(&dir.join("config.json")).map_err(|e| e.to_string())?;
    let draft = named_configs().into_iter().next().expect("the Qwen3-8B drafter").config;
    draft.check_target(&target).map_err(|e| e.to_string())?;

    let gpu = Arc::new(open_gpu()?);
    let (online, offline) = measure_ours(&gpu, &dir, &target, &draft, &shapes, (warmup, iters, seed), profile, policy)?;
    let mut errors = Vec::new();
    let (date, name) = (utc_now(), gpu.name().to_string());
    drop(gpu);
    let object = |k: usize, torch: Option<&Value>| {
        let (s, n) = shapes[k];
        let per_s = |ms: f64| 1e3 / ms;
        let (on, off) = (&online[k], &offline[k]);
        let torch_ms = torch.and_then(|t| t["ms_per_step"].as_f64());
        json!({
            "shape": format!("S={s} N={n}"),
            "seq": s,
            "anchors": n,
            "checkpointing": policy.name(),
            "ours_ms_per_step": on.ms,
            "ours_samples_per_s": per_s(on.ms),
            "ours_tokens_per_s": per_s(on.ms) * s as f64,
            "ours_peak_gb": on.peak_bytes as f64 / 1e9,
            "ours_offline_samples_per_s": per_s(off.ms),
            "ours_offline_peak_gb": off.peak_bytes as f64 / 1e9,
            "ours_losses": on.losses,
            "torch_ms_per_step": torch_ms,
            "torch_samples_per_s": torch_ms.map(per_s),
            "torch_tokens_per_s": torch_ms.map(|ms| per_s(ms) * s as f64),
            "torch_peak_gb": torch.and_then(|t| t["peak_gb"].as_f64()),
            "torch_target_ms": torch.and_then(|t| t["target_ms"].as_f64()),
            "torch_step_ms": torch.and_then(|t| t["step_ms"].as_f64()),
            "torch_form": torch.map(|t| t["form"].clone()),
            "torch_checkpointing": torch.map(|t| t["policy"].clone()),
            "torch_errors": torch.map(|t| t["errors"].clone()),
            "torch_losses": torch.map(|t| t["losses"].clone()),
            "speedup": torch_ms.map(|t| t / on.ms),
            "warmup": warmup,
            "iters": iters,
            "date": date,
            "gpu": name,
            "commit": commit,
        })
    };
    // Ours first (written at once, so a run cut short keeps them), then each shape's PyTorch.
    let mut objects: Vec<Value> = (0..shapes.len()).map(|k| object(k, None)).collect();
    write_json(&out, &Value::Array(objects.clone()))?;
    for (k, &(s, n)) in shapes.iter().enumerate() {
        if !with_torch {
            break;
        }
        let spec = torch_spec(&dir, &draft, (s, n), policy.name(), (warmup, iters, seed));
        match run_python_json(&python, &script, &spec) {
            Ok(v) => objects[k] = object(k, Some(&v)),
            Err(e) => errors.push(format!("PyTorch at S={s} N={n}: {e}")),
        }
        write_json(&out, &Value::Array(objects.clone()))?;
    }
    let f = |v: &Value, digits: usize| v.as_f64().map_or("-".to_string(), |x| format!("{x:.digits$}"));
    println!(
        "{:>14} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9}",
        "shape", "ours ms", "torch ms", "ours s/s", "torch s/s", "speedup", "peak GB", "torch GB", "offl s/s"
    );
    for o in &objects {
        println!(
            "{:>14} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9}",
            o["shape"].as_str().unwrap_or("-"),
            f(&o["ours_ms_per_step"], 1),
            f(&o["torch_ms_per_step"], 1),
            f(&o["ours_samples_per_s"], 2),
            f(&o["torch_samples_per_s"], 2),
            f(&o["speedup"], 2),
            f(&o["ours_peak_gb"], 1),
            f(&o["torch_peak_gb"], 1),
            f(&o["ours_offline_samples_per_s"], 2),
        );
    }
    println!("wrote {}", out.display());
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
}

/// The PyTorch pipeline's spec at one shape (the drafter of `draft`, its target's folder), its
/// step checkpointing by `policy` (step_torch.py's names are ours).
fn torch_spec(
    dir: &Path,
    draft: &DraftConfig,
    (s, n): (usize, usize),
    policy: &str,
    (warmup, iters, seed): (usize, usize, u64),
) -> Value {
    let c = &draft.dims;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut anchors = std::collections::BTreeSet::new();
    while anchors.len() < n {
        anchors.insert(rng.random_range(0..s - 1));
    }
    json!({
        "target_dir": dir,
        "layer_ids": draft.target_layer_ids,
        "context_len": s,
        "anchors": anchors.into_iter().collect::<Vec<_>>(),
        "gamma": default_gamma(draft.block_size),
        "lm_chunk_rows": 1024,
        "warmup": warmup,
        "iters": iters,
        "seed": seed,
        "form": "compiled",
        "policy": policy,
        "config": {
            "hidden": c.hidden_size, "intermediate": c.intermediate_size, "num_heads": c.num_heads,
            "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "vocab": c.vocab_size,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "windows": vec![Value::Null; c.num_layers()], "num_features": draft.num_features(),
            "block_size": draft.block_size, "mask_token_id": draft.mask_token_id,
        },
    })
}

/// `count` rows of `s` random tokens (never the mask token), every token supervised, one document.
fn random_rows(s: usize, count: usize, draft: &DraftConfig, rng: &mut ChaCha8Rng) -> Vec<Row> {
    (0..count)
        .map(|_| Row {
            tokens: (0..s)
                .map(|_| loop {
                    let t = rng.random_range(0..draft.dims.vocab_size as u32);
                    if t != draft.mask_token_id {
                        break t;
                    }
                })
                .collect(),
            loss_mask: vec![true; s],
            doc_ids: vec![0; s],
            positions: (0..s).collect(),
        })
        .collect()
}

/// Times `engine`'s optimizer steps over `rows` (one row per step, cycling; the next step's row
/// read on another thread while a step runs, as a GPU run reads them), CUDA events after
/// warm-up; the pool's high-water mark above `before` is the peak. With `profile`, one more step
/// is profiled per operation.
fn time_engine(
    gpu: &Gpu,
    engine: &mut dyn StepEngine,
    rows: &dyn RowSource,
    n: usize,
    (warmup, iters, seed): (usize, usize, u64),
    before: u64,
    profile: Option<&str>,
) -> Result<Measured, String> {
    let err = |e: dflash_optimized::Error| e.to_string();
    let step_err = |e: dflash_trainer::Error| dflash_optimized::Error::invalid("step", e.to_string());
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut losses = Vec::new();
    let mut k = 0;
    gpu.reset_pool_high().map_err(err)?;
    let gamma = default_gamma(16);
    std::thread::scope(|scope| {
        let mut ahead = ReadAhead::default();
        let mut step = |engine: &mut dyn StepEngine| {
            let row = ahead.rows(rows, &[vec![k % rows.len()]], &(0..1)).map_err(step_err)?;
            k += 1;
            ahead.start(scope, rows, vec![vec![k % rows.len()]], 0..1);
            let batch = StepBatch {
                step: k,
                micro_batches: vec![vec![&row[0][0]]],
                anchors: n,
                gamma,
                lr: 6e-4,
                clip_norm: 1.0,
                want_stats: false,
            };
            let outcome = engine.step(&batch, &mut rng).map_err(step_err)?;
            losses.push(outcome.loss);
            Ok(())
        };
        let ms = gpu.time_ms(warmup, iters, || step(&mut *engine)).map_err(err)?;
        let peak = gpu.pool_used_high().map_err(err)?.saturating_sub(before);
        if let Some(what) = profile {
            crate::bench::profile_once(what, || step(&mut *engine))?;
            losses.pop(); // the timed steps' losses only
        }
        if losses.iter().any(|l| !l.is_finite()) {
            return Err(format!("non-finite losses {losses:?}"));
        }
        Ok(Measured { ms, peak_bytes: peak, losses })
    })
}

/// Rows whose features an offline run would read: a feature cache on disk (`xtask features`'
/// format, one document per row), read per row by the trainer's reader ([`cached_features`]);
/// its folder is removed when dropped.
struct CachedRows {
    cache: FeatureCache,
    rows: Vec<Row>,
}

impl CachedRows {
    /// Writes `rows` with their `features` (bf16 bits `[S, F*H]` each) into a cache at `dir`.
    fn write(dir: &Path, rows: Vec<Row>, features: &[Vec<u16>], draft: &DraftConfig, h: usize) -> Result<Self, String> {
        let err = |e: dflash_data::Error| e.to_string();
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let index = FeatureIndex {
            format: String::new(),
            provenance: Default::default(),
            hidden_size: h,
            layer_ids: draft.target_layer_ids.clone(),
            shard_bytes: 4 << 30,
            documents: rows.len(),
            tokens: rows.iter().map(|r| r.tokens.len() as u64).sum(),
            shards: vec![],
        };
        let mut writer = FeatureWriter::open(dir, index).map_err(err)?;
        for (row, features) in rows.iter().zip(features) {
            writer.push(Entry { tokens: &row.tokens, loss_mask: &row.loss_mask, features }).map_err(err)?;
        }
        writer.finish().map_err(err)?;
        Ok(CachedRows { cache: FeatureCache::open(dir, None).map_err(err)?, rows })
    }
}

impl Drop for CachedRows {
    fn drop(&mut self) {
        _ = std::fs::remove_dir_all(&self.cache.dir);
    }
}

impl RowSource for CachedRows {
    fn len(&self) -> usize {
        self.rows.len()
    }

    fn row(&self, i: usize) -> dflash_trainer::Result<TrainRow> {
        let row = self.rows[i].clone();
        let features = cached_features(&self.cache, &row.tokens, &[(0..row.tokens.len(), i)])?;
        Ok(TrainRow::from_row(row, features)?)
    }

    /// Nothing resumes a benchmark's steps.
    fn sha256(&self) -> dflash_trainer::Result<String> {
        Err(dflash_trainer::Error::option("rows", "a benchmark's rows are not hashed"))
    }
}

/// Online (the target's forward in the engine) and offline (features read from a cache on disk)
/// per shape, the step checkpointing by `policy`.
#[allow(clippy::too_many_arguments)]
fn measure_ours(
    gpu: &Arc<Gpu>,
    dir: &Path,
    target: &TargetConfig,
    draft: &DraftConfig,
    shapes: &[(usize, usize)],
    (warmup, iters, seed): (usize, usize, u64),
    profile: bool,
    policy: Checkpointing,
) -> Result<(Vec<Measured>, Vec<Measured>), String> {
    let err = |e: dflash_optimized::Error| e.to_string();
    let started = std::time::Instant::now();
    let weights = WeightSet::load_dir(dir).map_err(|e| e.to_string())?;
    let before = gpu.pool_used().map_err(err)?;
    let max_s = shapes.iter().map(|s| s.0).max().expect("a shape");
    let cuda = Cuda::new(gpu, target.dims.head_dim).map_err(err)?;
    let mut forward = TargetForward::new(cuda, target, &draft.target_layer_ids, max_s, true).map_err(err)?;
    forward.load_weights(|name, shape| weights.get(name, shape, DType::BF16)).map_err(err)?;
    let (v, h) = (target.dims.vocab_size, target.dims.hidden_size);
    let embed = weights.get("model.embed_tokens.weight", &[v, h], DType::F32).map_err(|e| e.to_string())?;
    let lm_head = match target.tie_word_embeddings {
        true => embed.clone(),
        false => weights.get("lm_head.weight", &[v, h], DType::F32).map_err(|e| e.to_string())?,
    };
    drop(weights);
    println!("loaded the target in {:.1}s", started.elapsed().as_secs_f64());
    let started = std::time::Instant::now();
    let init = Drafter::init(draft.clone(), seed + 1, DType::F32).map_err(|e| e.to_string())?;
    println!("drafter init ({} parameters) in {:.1}s", init.num_params(), started.elapsed().as_secs_f64());
    let copy = || {
        let mut params = init.named_params().iter();
        Drafter::from_fn(draft.clone(), |_, _| Ok(params.next().expect("same config").1.as_tensor().clone()))
            .map_err(|e| e.to_string())
    };
    let adamw = AdamWConfig { lr: 6e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
    let head_dim = draft.dims.head_dim;
    let engine_of = |frozen: Frozen<Cuda>| -> Result<DeviceEngine<Cuda>, String> {
        let g = gpu.clone();
        Ok(DeviceEngine::new(move || Cuda::new(&g, head_dim), copy()?, frozen, adamw.clone(), &[policy]))
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut frozen = Frozen::Target(Box::new(forward));
    let (mut online, mut offline_rows) = (Vec::new(), Vec::new());
    let cache_dir =
        |i: usize| std::env::temp_dir().join(format!("dflash-bench-train-cache-{}-{i}", std::process::id()));
    for (i, &(s, n)) in shapes.iter().enumerate() {
        let rows = random_rows(s, warmup + iters, draft, &mut rng);
        let train: Vec<TrainRow> = rows
            .iter()
            .map(|r| TrainRow::from_row(r.clone(), Tensor::zeros((s, 0), DType::F32, &Device::Cpu)?))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let mut engine = engine_of(frozen)?;
        let what = format!("one online step at S={s} N={n}");
        let m = time_engine(gpu, &mut engine, &train, n, (warmup, iters, seed), before, profile.then_some(&*what))?;
        println!("ours online S={s} N={n}: {:.1} ms per step, peak {:.2} GB", m.ms, m.peak_bytes as f64 / 1e9);
        online.push(m);
        frozen = engine.into_frozen();
        // The same rows' features in a cache on disk, as an offline run reads them.
        let Frozen::Target(forward) = &mut frozen else { unreachable!("the forward was given") };
        let mut features = Vec::new();
        for row in &rows {
            forward.run(&[row]).map_err(err)?;
            // bf16-exact values: the conversion back is exact.
            features.push(
                forward
                    .features_to_host()
                    .map_err(err)?
                    .into_iter()
                    .map(|v| half::bf16::from_f64(v).to_bits())
                    .collect(),
            );
        }
        let started = std::time::Instant::now();
        offline_rows.push(CachedRows::write(&cache_dir(i), rows, &features, draft, h)?);
        println!(
            "wrote the features of S={s} to {} in {:.1}s",
            cache_dir(i).display(),
            started.elapsed().as_secs_f64()
        );
    }
    drop(frozen);
    let head = FrozenHead { embed, lm_head };
    let before = gpu.pool_used().map_err(err)?;
    let mut offline = Vec::new();
    for (&(s, n), rows) in shapes.iter().zip(&offline_rows) {
        let mut engine = engine_of(Frozen::Host(head.clone()))?;
        let what = format!("one offline step at S={s} N={n}");
        let m = time_engine(gpu, &mut engine, rows, n, (warmup, iters, seed), before, profile.then_some(&*what))?;
        println!("ours offline S={s} N={n}: {:.1} ms per step, peak {:.2} GB", m.ms, m.peak_bytes as f64 / 1e9);
        offline.push(m);
    }
    Ok((online, offline))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The offline rows read back from their cache: each row's tokens, mask and features as
    /// written (a small drafter config's width), read ahead or not.
    #[test]
    fn cached_rows_read_back_as_written() {
        let mut rng = ChaCha8Rng::seed_from_u64(rand::rng().random());
        let mut draft = named_configs().into_iter().next().expect("a drafter").config;
        draft.dims.vocab_size = 500;
        draft.mask_token_id = 499;
        let (h, s) = (rng.random_range(2..6), rng.random_range(20..40));
        let fw = draft.target_layer_ids.len() * h;
        let rows = random_rows(s, 3, &draft, &mut rng);
        let features: Vec<Vec<u16>> = (0..3)
            .map(|_| (0..s * fw).map(|_| half::bf16::from_f32(rng.random_range(-3.0..3.0)).to_bits()).collect())
            .collect();
        let dir = std::env::temp_dir().join(format!("dflash-cached-rows-test-{}", rng.random::<u64>()));
        let cached = CachedRows::write(&dir, rows.clone(), &features, &draft, h).unwrap();
        std::thread::scope(|scope| {
            let mut ahead = ReadAhead::default();
            ahead.start(scope, &cached, vec![vec![2]], 0..1);
            for i in [2, 0, 1] {
                let row = &ahead.rows(&cached, &[vec![i]], &(0..1)).unwrap()[0][0];
                assert_eq!((&row.tokens, &row.loss_mask), (&rows[i].tokens, &rows[i].loss_mask), "row {i}");
                let got: Vec<u16> = row
                    .features
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<half::bf16>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                assert_eq!(row.features.dims(), [s, fw], "row {i}");
                assert_eq!(got, features[i], "row {i}");
            }
        });
        drop(cached);
        assert!(!dir.exists(), "the cache's folder goes with the rows");
    }
}
