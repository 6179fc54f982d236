//! `xtask bench step` (on the H200): the GPU training step of the Qwen3-8B drafter (S=3072,
//! N=512, one row, random weights and features) under each checkpointing policy, next to a
//! PyTorch implementation of the same step measured in the same run in two forms (compiled
//! flex_attention with the rest eager; every layer compiled); writes `results/step-h200.json`.

use dflash_optimized::flops::{step_model_flops, PEAK_FLOPS, STEP_FLOP_CONVENTION};
use std::path::PathBuf;

use dflash_optimized::backend::cuda::Cuda;
use dflash_optimized::backend::Backend;
use dflash_optimized::device::gpu::Gpu;
use dflash_optimized::memory::named::named_configs;
use dflash_optimized::memory::step::{Checkpointing as Policy, StepShape};
use dflash_optimized::model::drafter_step::{DrafterStep, Grads};
use dflash_optimized::ops::attention::ranges::KeyRanges;
use dflash_optimized::ops::elementwise::ElementwiseOps;
use dflash_reference::config::{AttnKind, DraftConfig};
use dflash_reference::loss::default_gamma;
use dflash_reference::mask::BlockLayout;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::args::Options;
use crate::bench_attention::run_python_json;
use crate::gpu_bundle;
use crate::gpu_conformance::{open_gpu, utc_now, write_json};

const HELP: &str = "usage: xtask bench step [options]     (on the GPU machine)

Times one training step (forward + backward, no optimizer) of the Qwen3-8B drafter (hidden 4096,
5 layers, 32/8 heads of 128, SwiGLU 12288, vocab 151936) on one row of S tokens with N random
sorted anchors of 16, random weights and features, under each checkpointing policy: step time
(CUDA events, median after warm-up), tokens/s, MFU and the memory-pool peak next to the plan.
Then runs the same step in PyTorch (xtask/bench/step_torch.py) in two forms, compiled
flex_attention with the rest eager and every layer compiled, under the same policies. Writes one
JSON object per policy and prints a table last.

options:
  --out FILE      results file                          (default results/step-h200.json)
  --config NAME   a named config of `cargo xtask plan`, by its first word: qwen3-8b-drafter
                  (default) or 64-layer-target (S=8192 N=1024, 4 sliding layers of 2048 + 1 full)
  --seq S         context tokens                        (default: the named config's)
  --anchors N     blocks                                (default: the named config's)
  --lm-chunk R    LM-head rows per chunk                (default 1024)
  --warmup N      untimed steps per measurement         (default 3)
  --iters N       timed steps, median reported          (default 10)
  --torch yes|no  run the PyTorch baselines             (default yes)
  --python EXE    Python with PyTorch                   (default python3)
  --script FILE   the baseline script      (default step_torch.py next to the binary, else
                                            xtask/bench/step_torch.py)
  --seed N        seed of the anchors, weights, inputs  (default 0)
  --profile yes|no  print each operation's GPU time in one step per policy (default no)
  --commit SHA    the commit measured                   (default: commit.txt next to the binary)";

const OPTIONS: &[&str] = &[
    "out", "config", "seq", "anchors", "lm-chunk", "warmup", "iters", "torch", "python", "script", "seed", "commit",
    "profile",
];

const MEMORY_CONVENTION: &str = "peak: memory-pool high-water of one step (bf16 weights and step gradients, frozen \
    LM head, inputs, activations, scratch; no optimizer state or fp32 master weights, no embedding table); PyTorch: \
    max_memory_allocated of one step (bf16 weights and gradients, frozen LM head, inputs, activations) less its \
    embedding table (embed_bytes), which ours does not hold; GB = 1e9 bytes";

/// Sorted distinct anchors in `[1, S - B]` (every block fits in the row), `n` of them.
fn random_anchors(s: usize, block: usize, n: usize, seed: u64) -> Result<Vec<usize>, String> {
    let span = s.saturating_sub(block);
    if n > span {
        return Err(format!("{n} anchors do not fit in S={s} with blocks of {block}"));
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut picked = std::collections::BTreeSet::new();
    while picked.len() < n {
        picked.insert(rng.random_range(1..=span));
    }
    Ok(picked.into_iter().collect())
}

/// Our measurement of one policy.
struct Ours {
    step_ms: f64,
    loss: f64,
    peak_bytes: u64,
    planned_bytes: u64,
}

/// Random weights made on the device (the spec's init: normal(0, 0.02) for linears, ones for
/// norms) and a random LM head (normal(0, 0.02)).
fn randomize_weights(step: &DrafterStep<Cuda>, seed: u64) -> dflash_optimized::Result<()> {
    let (weights, ops) = (step.addr(step.layout.weights), step.backend().ops());
    for (n, slot) in step.slots().iter().enumerate() {
        let (mean, std) = if dflash_reference::drafter::is_norm(&slot.name) { (1.0, 0.0) } else { (0.0, 0.02) };
        let ptr = weights + (slot.offset * <half::bf16 as dflash_optimized::ops::Elem>::BYTES) as u64;
        ops.fill_normal(ptr, slot.len, seed.wrapping_add(n as u64), mean, std)?;
    }
    let z = step.layout.dims;
    ops.fill_normal(step.lm_head_addr(), z.v * z.h, seed ^ 0x5eed_1e4d, 0.0, 0.02)
}

/// A random input made on the device for `anchors` of one document of `S` tokens: features and
/// block embeddings normal(0, 1), random labels, every anchor kept.
fn set_random_input(
    step: &mut DrafterStep<Cuda>,
    anchors: &[usize],
    gamma: f64,
    seed: u64,
) -> dflash_optimized::Result<()> {
    use rand::{Rng, SeedableRng};
    let (z, b) = (step.layout.dims, step.config.block_size);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let tokens: Vec<u32> = (0..z.s).map(|_| rng.random_range(0..z.v as u32)).collect();
    let keep = vec![true; anchors.len()];
    let layout = dflash_reference::mask::BlockLayout::new(z.s, b, anchors.to_vec(), keep.clone(), None)?;
    let anchor_set = dflash_reference::anchors::Anchors { positions: anchors.to_vec(), keep };
    let targets = dflash_reference::loss::BlockTargets::new(&tokens, &vec![true; z.s], &anchor_set, b, gamma);
    let (features, x0) = (step.addr(step.layout.input.features), step.addr(step.layout.residual[0]));
    step.backend().ops().fill_normal(features, z.s * z.fw, seed ^ 1, 0.0, 1.0)?;
    step.backend().ops().fill_normal(x0, z.q * z.h, seed ^ 2, 0.0, 1.0)?;
    let queries: Vec<usize> = anchors.iter().flat_map(|&a| (0..b).map(move |o| a + o)).collect();
    let keys: Vec<usize> = (0..z.s).chain(queries.iter().copied()).collect();
    step.set_blocks(&layout, &queries, &keys, &targets)
}

fn measure_ours(
    gpu: &Gpu,
    config: &DraftConfig,
    shape: StepShape,
    policy: Policy,
    anchors: &[usize],
    (warmup, iters, seed): (usize, usize, u64),
    profile: bool,
) -> Result<Ours, String> {
    let err = |e: dflash_optimized::Error| e.to_string();
    let before = gpu.pool_used().map_err(err)?;
    gpu.reset_pool_high().map_err(err)?;
    let cuda = Cuda::new(gpu, config.dims.head_dim).map_err(err)?;
    let mut step = DrafterStep::new(cuda, config, shape, policy, false).map_err(err)?;
    randomize_weights(&step, seed).map_err(err)?;
    set_random_input(&mut step, anchors, default_gamma(config.block_size), seed).map_err(err)?;
    let first = step.step(1.0).map_err(err)?;
    let scale = 1.0 / first.total_weight;
    let loss = step.step(scale).map_err(err)?.loss;
    step.grad_sum_squares(Grads::Step).map_err(err)?;
    let peak_bytes = gpu.pool_used_high().map_err(err)?.saturating_sub(before);
    let step_ms = gpu.time_ms(warmup, iters, || step.step(scale).map(|_| ())).map_err(err)?;
    if profile {
        crate::bench::profile_once(&format!("one {} step", policy.name()), || step.step(scale))?;
    }
    Ok(Ours { step_ms, loss, peak_bytes, planned_bytes: step.planned_peak() })
}

pub fn run(args: Vec<String>) -> Result<(), String> {
    let Some(opts) = Options::parse(args, OPTIONS)? else {
        println!("{HELP}");
        return Ok(());
    };
    let out: PathBuf = opts.get("out", PathBuf::from("results/step-h200.json"))?;
    let wanted: String = opts.get("config", "qwen3-8b-drafter".to_string())?;
    let plans = named_configs();
    let known: Vec<&str> = plans.iter().filter_map(|p| p.name.split_whitespace().next()).collect::<Vec<_>>();
    let known = known.join(", ");
    let named = named_configs()
        .into_iter()
        .find(|p| p.name.split_whitespace().next() == Some(wanted.as_str()))
        .ok_or_else(|| format!("option `--config`: unknown `{wanted}` (known: {known})"))?;
    let shape = StepShape {
        context_len: opts.get("seq", named.shape.context_len)?,
        num_anchors: opts.get("anchors", named.shape.num_anchors)?,
        lm_chunk_rows: opts.get("lm-chunk", named.shape.lm_chunk_rows)?,
    };
    let (warmup, iters, seed): (usize, usize, u64) =
        (opts.get("warmup", 3)?, opts.get("iters", 10)?, opts.get("seed", 0)?);
    let profile = opts.yes_no("profile", false)?;
    let with_torch = opts.yes_no("torch", true)?;
    let python: String = opts.get("python", "python3".to_string())?;
    let script: PathBuf = opts.get("script", gpu_bundle::bundled_file("step_torch.py", "xtask/bench/step_torch.py"))?;
    if iters == 0 {
        return Err("--iters must be at least 1".to_string());
    }
    if with_torch && !script.is_file() {
        return Err(format!("{}: the PyTorch baseline script is missing (--script, or --torch no)", script.display()));
    }
    let commit: String = opts.get("commit", String::new())?;
    let commit = gpu_bundle::commit(Some(commit).filter(|c| !c.is_empty()))?;
    let config = named.config;
    let block = config.block_size;
    let anchors = random_anchors(shape.context_len, block, shape.num_anchors, seed)?;
    let layout = BlockLayout::new(shape.context_len, block, anchors.clone(), vec![true; anchors.len()], None)
        .map_err(|e| e.to_string())?;
    let pairs: Vec<u64> = config
        .dims
        .layer_kinds
        .iter()
        .map(|&kind| KeyRanges::dflash(&layout, kind).map(|p| p.allowed_pairs()))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    // Rows with CE weight: offsets 1..B of each block whose position is inside the row.
    let weighted_rows: usize = anchors.iter().map(|&a| (1..block).filter(|o| a + o < shape.context_len).count()).sum();
    let flops = step_model_flops(&config, shape, weighted_rows, &pairs);

    let gpu = open_gpu()?;
    let gpu_name = gpu.name().to_string();
    let date = utc_now();
    println!(
        "step benchmark on {gpu_name} (commit {commit}): {} S={} N={} ({:.1} model TFLOP), warm-up {warmup}, median of {iters}",
        named.name,
        shape.context_len,
        shape.num_anchors,
        flops / 1e12
    );
    let mut ours = Vec::new();
    for policy in Policy::ALL {
        let measured = measure_ours(&gpu, &config, shape, policy, &anchors, (warmup, iters, seed), profile);
        match &measured {
            Ok(m) => println!(
                "ours  {:<10} {:.2} ms, loss {:.4}, peak {:.3} GB (planned {:.3} GB)",
                policy.name(),
                m.step_ms,
                m.loss,
                m.peak_bytes as f64 / 1e9,
                m.planned_bytes as f64 / 1e9
            ),
            Err(e) => println!("ours  {:<10} error: {e}", policy.name()),
        }
        ours.push(measured);
    }
    // The baselines get the GPU to themselves.
    drop(gpu);
    let torch = if with_torch {
        let windows: Vec<Option<usize>> = config
            .dims
            .layer_kinds
            .iter()
            .map(|k| match k {
                AttnKind::Full => None,
                AttnKind::Sliding { window } => Some(*window),
            })
            .collect();
        let c = &config.dims;
        let input = json!({
            "warmup": warmup, "iters": iters, "seed": seed, "device": "cuda",
            "config": {
                "hidden": c.hidden_size, "intermediate": c.intermediate_size, "num_heads": c.num_heads,
                "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "vocab": c.vocab_size,
                "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "windows": windows,
                "num_features": config.num_features(), "block_size": block, "mask_token_id": config.mask_token_id,
            },
            "context_len": shape.context_len, "anchors": anchors, "gamma": default_gamma(block),
            "lm_chunk_rows": shape.lm_chunk_rows,
            "forms": ["flex", "compiled"], "policies": Policy::ALL.iter().map(|p| p.name()).collect::<Vec<_>>(),
        });
        Some(run_python_json(&python, &script, &input))
    } else {
        None
    };

    let mut errors = Vec::new();
    if let Some(Err(e)) = &torch {
        errors.push(format!("PyTorch baselines: {e}"));
    }
    let torch_results: Vec<Value> =
        torch.as_ref().and_then(|t| t.as_ref().ok()).and_then(|t| t["results"].as_array().cloned()).unwrap_or_default();
    let torch_version = torch
        .as_ref()
        .and_then(|t| t.as_ref().ok())
        .and_then(|t| t["torch"].as_str())
        .unwrap_or(if with_torch { "unknown" } else { "not run" })
        .to_string();
    let mut objects = Vec::new();
    for (policy, measured) in Policy::ALL.iter().zip(&ours) {
        let form = |name: &str| torch_results.iter().find(|r| r["form"] == name && r["policy"] == policy.name());
        for name in ["flex", "compiled"] {
            if let Some(r) = form(name) {
                for e in r["errors"].as_array().into_iter().flatten() {
                    errors.push(format!("PyTorch {name} {}: {}", policy.name(), e.as_str().unwrap_or("?")));
                }
            }
        }
        let ms = |name: &str| form(name).and_then(|r| r["step_ms"].as_f64());
        // Without the embedding table the PyTorch step holds for its block inputs: ours gathers
        // them from the target's table, held beside the step (here not at all).
        let peak = |name: &str| {
            let r = form(name)?;
            Some((r["peak_bytes"].as_f64()? - r["embed_bytes"].as_f64()?) / 1e9)
        };
        let (flex_ms, compiled_ms) = (ms("flex"), ms("compiled"));
        let torch_ms = match (flex_ms, compiled_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let mfu = |ms: Option<f64>| ms.map(|ms| flops / (ms * 1e-3 * PEAK_FLOPS));
        let (ours_ms, ours_peak, planned, loss) = match measured {
            Ok(m) => {
                (Some(m.step_ms), Some(m.peak_bytes as f64 / 1e9), Some(m.planned_bytes as f64 / 1e9), Some(m.loss))
            }
            Err(e) => {
                errors.push(format!("ours {}: {e}", policy.name()));
                (None, None, None, None)
            }
        };
        objects.push(json!({
            "policy": policy.name(),
            "ours_step_ms": ours_ms,
            "torch_step_ms": torch_ms,
            "torch_flex_step_ms": flex_ms,
            "torch_compiled_step_ms": compiled_ms,
            "speedup": ours_ms.zip(torch_ms).map(|(o, t)| t / o),
            "mfu": mfu(ours_ms),
            "torch_flex_mfu": mfu(flex_ms),
            "torch_compiled_mfu": mfu(compiled_ms),
            "tokens_per_s": ours_ms.map(|ms| shape.context_len as f64 / (ms * 1e-3)),
            "peak_gb": ours_peak,
            "planned_peak_gb": planned,
            "torch_flex_peak_gb": peak("flex"),
            "torch_compiled_peak_gb": peak("compiled"),
            "loss": loss,
            "torch_flex_loss": form("flex").and_then(|r| r["loss"].as_f64()),
            "model_tflop": flops / 1e12,
            "config": named.name,
            "context_len": shape.context_len,
            "num_anchors": shape.num_anchors,
            "lm_chunk_rows": shape.lm_chunk_rows,
            "warmup": warmup,
            "iters": iters,
            "torch": torch_version,
            "flop_convention": STEP_FLOP_CONVENTION,
            "memory_convention": MEMORY_CONVENTION,
            "date": date,
            "gpu": gpu_name,
            "commit": commit,
        }));
    }
    write_json(&out, &Value::Array(objects.clone()))?;
    print_table(&objects);
    println!("wrote {}", out.display());
    if errors.is_empty() {
        Ok(())
    } else {
        Err(format!("{} measurement(s) failed:\n  {}", errors.len(), errors.join("\n  ")))
    }
}

/// The summary table, printed last.
fn print_table(objects: &[Value]) {
    let f = |v: &Value, digits: usize| v.as_f64().map_or("-".to_string(), |x| format!("{x:.digits$}"));
    println!(
        "{:<10} {:>9} {:>9} {:>9} {:>7} {:>6} {:>6} {:>6} {:>8} {:>8} {:>8} {:>8}",
        "policy",
        "ours ms",
        "flex ms",
        "comp ms",
        "speedup",
        "MFU",
        "fMFU",
        "cMFU",
        "peak GB",
        "plan GB",
        "flex GB",
        "comp GB"
    );
    for o in objects {
        println!(
            "{:<10} {:>9} {:>9} {:>9} {:>7} {:>6} {:>6} {:>6} {:>8} {:>8} {:>8} {:>8}",
            o["policy"].as_str().unwrap_or("?"),
            f(&o["ours_step_ms"], 2),
            f(&o["torch_flex_step_ms"], 2),
            f(&o["torch_compiled_step_ms"], 2),
            f(&o["speedup"], 2),
            f(&o["mfu"], 3),
            f(&o["torch_flex_mfu"], 3),
            f(&o["torch_compiled_mfu"], 3),
            f(&o["peak_gb"], 3),
            f(&o["planned_peak_gb"], 3),
            f(&o["torch_flex_peak_gb"], 3),
            f(&o["torch_compiled_peak_gb"], 3),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchors_are_sorted_distinct_and_fit() {
        let a = random_anchors(3072, 16, 512, 0).unwrap();
        assert_eq!(a.len(), 512);
        assert!(a.windows(2).all(|w| w[0] < w[1]) && a[0] >= 1 && *a.last().unwrap() <= 3072 - 16);
        assert!(random_anchors(20, 16, 5, 0).is_err());
    }
}
