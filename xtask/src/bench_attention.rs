//! `xtask bench attention` (on the H200): our CUDA attention next to PyTorch's flex_attention
//! (under torch.compile) and SDPA with a dense mask, measured in the same run on the four cases of
//! the anchor table in GPU.md (the project's H200 notes); writes `results/attention-h200.json` and prints a table.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use dflash_conformance::attention_cases::{bench_cases, AttnCase};
use dflash_conformance::gpu_attention::{case_shape, DeviceRun, HostInputs};
use dflash_optimized::device::gpu::Gpu;
use dflash_optimized::memory::attention::cuda_extra_bytes;
use dflash_optimized::ops::attention::cuda::{AttentionKernels, DeviceKeyRanges};
use dflash_reference::config::AttnKind;
use serde_json::{json, Value};

use crate::args::Options;
use crate::gpu_bundle;
use crate::gpu_conformance::{open_gpu, utc_now, write_json};

const HELP: &str = "usage: xtask bench attention [options]     (on the GPU machine)

For the four cases of the anchor table in GPU.md (the project's H200 notes) (bf16, 32 query heads, 8 KV heads, d 128,
B 16, random sorted anchors: S=8192 N=128; S=3072 N=512; S=8000 N=512; sliding W=2048 S=8192
N=128), times our CUDA attention forward and forward+backward, then runs the PyTorch baselines
(flex_attention under torch.compile, SDPA with a dense boolean mask) through python3 in the same
run. Writes one JSON object per case (times, useful TFLOP/s, extra memory, the planner's bound,
speed-up over flex) and prints a table last. Exits with an error when a measurement failed, after
writing what it has.

options:
  --out FILE      results file                          (default results/attention-h200.json)
  --warmup N      untimed iterations per measurement    (default 20)
  --iters N       timed iterations, median reported     (default 100)
  --python EXE    Python with PyTorch                   (default python3)
  --script FILE   the baseline script     (default attention_torch.py next to the binary, else
                                           xtask/bench/attention_torch.py)
  --commit SHA    the commit measured                   (default: commit.txt next to the binary)
  --torch yes|no  run the PyTorch baselines             (default yes; no: ours only, no file)
  --profile yes|no  print each kernel's GPU time per call, per case   (default no)";

const OPTIONS: &[&str] = &["out", "warmup", "iters", "python", "script", "commit", "torch", "profile"];

/// Useful FLOPs of the forward per allowed (query, key) pair and query head, over `head_dim`:
/// `QK^T` and `PV`, 2 multiply-adds each.
const FWD_FLOPS_PER_PAIR_DIM: f64 = 4.0;
/// Forward+backward FLOPs over forward FLOPs: the backward counts 2.5x the forward (5 matmuls
/// against 2), the FlashAttention convention the TFLOP/s of GPU.md (the project's H200 notes) follow.
const FWDBWD_FLOPS_FACTOR: f64 = 3.5;
const FLOP_CONVENTION: &str = "useful FLOPs: forward 4*head_dim*num_heads*allowed_pairs; forward+backward 3.5x \
                               the forward (backward = 2.5x forward, FlashAttention convention)";
const MEMORY_CONVENTION: &str = "extra memory: peak allocated during one forward+backward minus what was \
                                 allocated before it (inputs q, k, v, dO and the mask or plan), so O, \
                                 logsumexp, dQ, dK, dV and temporaries count; GB = 1e9 bytes";

/// One benchmark case with what is known about it before the PyTorch run.
struct Measured {
    case: AttnCase,
    anchors: Vec<usize>,
    s: usize,
    block: usize,
    window: Option<usize>,
    q_len: usize,
    kv_len: usize,
    pairs: u64,
    ours: Result<BenchTimes, String>,
}

pub fn run(args: Vec<String>) -> Result<(), String> {
    let Some(opts) = Options::parse(args, OPTIONS)? else {
        println!("{HELP}");
        return Ok(());
    };
    let out: PathBuf = opts.get("out", PathBuf::from("results/attention-h200.json"))?;
    let warmup: usize = opts.get("warmup", 20)?;
    let iters: usize = opts.get("iters", 100)?;
    let python: String = opts.get("python", "python3".to_string())?;
    let script: PathBuf =
        opts.get("script", gpu_bundle::bundled_file("attention_torch.py", "xtask/bench/attention_torch.py"))?;
    if iters == 0 {
        return Err("--iters must be at least 1".to_string());
    }
    if !script.is_file() {
        return Err(format!("{}: the PyTorch baseline script is missing (--script)", script.display()));
    }
    let commit: String = opts.get("commit", String::new())?;
    let commit = gpu_bundle::commit(Some(commit).filter(|c| !c.is_empty()))?;
    let with_torch = opts.yes_no("torch", true)?;
    let profile = opts.yes_no("profile", false)?;
    let gpu = open_gpu()?;
    let gpu_name = gpu.name().to_string();
    let date = utc_now();
    println!("attention benchmark on {gpu_name} (commit {commit}), warm-up {warmup}, median of {iters}");

    let mut rows = Vec::new();
    for case in bench_cases() {
        let name = case.name.clone();
        let plan = case.ranges().map_err(|e| e.to_string())?;
        let layout = case.block_layout().map_err(|e| e.to_string())?;
        let Some(layout) = layout.filter(|l| l.doc_ids.is_none() && !l.keep.contains(&false)) else {
            return Err(format!("bench case `{name}`: the PyTorch baseline needs one document and no padding block"));
        };
        let ours = bench_case(&gpu, &case, warmup, iters).map_err(|e| e.to_string());
        match &ours {
            Ok(t) => println!("ours  {name:<28} fwd {:.3} ms, fwd+bwd {:.3} ms", t.fwd_ms, t.fwdbwd_ms),
            Err(e) => println!("ours  {name:<28} error: {e}"),
        }
        if profile {
            print_kernel_times(&gpu, &case)?;
        }
        rows.push(Measured {
            window: match case.kind {
                AttnKind::Full => None,
                AttnKind::Sliding { window } => Some(window),
            },
            case,
            anchors: layout.anchors.clone(),
            s: layout.context_len,
            block: layout.block_size,
            q_len: plan.num_queries,
            kv_len: plan.num_keys,
            pairs: plan.allowed_pairs(),
            ours,
        });
    }
    // The baselines get the GPU to themselves.
    drop(gpu);
    if !with_torch {
        println!("--torch no: PyTorch baselines skipped, no results file written");
        return Ok(());
    }
    let torch = run_torch(&python, &script, &rows, warmup, iters);

    let mut errors = Vec::new();
    if let Err(e) = &torch {
        errors.push(format!("PyTorch baselines: {e}"));
    }
    let torch_version = torch.as_ref().ok().and_then(|t| t["torch"].as_str()).unwrap_or("unknown").to_string();
    let common = json!({
        "torch": torch_version,
        "warmup": warmup,
        "iters": iters,
        "flop_convention": FLOP_CONVENTION,
        "memory_convention": MEMORY_CONVENTION,
        "date": date,
        "gpu": gpu_name,
        "commit": commit,
    });
    let mut objects = Vec::new();
    for row in &rows {
        let base = torch
            .as_ref()
            .ok()
            .and_then(|t| t["cases"].as_array()?.iter().find(|c| c["name"] == row.case.name.as_str()))
            .cloned()
            .unwrap_or(Value::Null);
        let mut object = case_object(row, &base, &mut errors);
        if let (Value::Object(object), Value::Object(common)) = (&mut object, &common) {
            object.extend(common.clone());
        }
        objects.push(object);
    }
    let results = Value::Array(objects);
    write_json(&out, &results)?;
    print_table(results.as_array().map_or(&[][..], Vec::as_slice));
    println!("wrote {}", out.display());
    if errors.is_empty() {
        Ok(())
    } else {
        Err(format!("{} measurement(s) failed:\n  {}", errors.len(), errors.join("\n  ")))
    }
}

/// The result object of one case (without the fields common to all); failed measurements are null and their errors are appended
/// to `errors`.
fn case_object(row: &Measured, base: &Value, errors: &mut Vec<String>) -> Value {
    let name = &row.case.name;
    let gb = |bytes: u64| bytes as f64 / 1e9;
    let fwd_flops = FWD_FLOPS_PER_PAIR_DIM * (row.case.head_dim * row.case.num_heads) as f64 * row.pairs as f64;
    let tflops = |flops: f64, ms: f64| flops / (ms * 1e-3) / 1e12;
    let num = |key: &str| base[key].as_f64();
    if let Err(e) = &row.ours {
        errors.push(format!("{name}: ours: {e}"));
    }
    if let Some(base_errors) = base["errors"].as_array() {
        errors.extend(base_errors.iter().map(|e| format!("{name}: {}", e.as_str().unwrap_or("?"))));
    }
    if base.is_null() {
        errors.push(format!("{name}: no PyTorch result"));
    }
    let torch_pairs = base["allowed_pairs"].as_u64();
    if let Some(pairs) = torch_pairs.filter(|&p| p != row.pairs) {
        errors.push(format!(
            "{name}: the PyTorch mask allows {pairs} pairs but the attention plan {}: the baselines compute something else",
            row.pairs
        ));
    }
    let ours = row.ours.as_ref().ok();
    let (flex_fwd, flex_fwdbwd) = (num("flex_fwd_ms"), num("flex_fwdbwd_ms"));
    let ratio = |flex: Option<f64>, ours: Option<f64>| Some(flex? / ours?);
    json!({
        "case": name,
        "q_len": row.q_len,
        "kv_len": row.kv_len,
        "density": row.pairs as f64 / (row.q_len as f64 * row.kv_len as f64),
        "allowed_pairs": row.pairs,
        "torch_allowed_pairs": torch_pairs,
        "num_heads": row.case.num_heads,
        "num_kv_heads": row.case.num_kv_heads,
        "head_dim": row.case.head_dim,
        "window": row.window,
        "ours_fwd_ms": ours.map(|t| t.fwd_ms),
        "ours_fwdbwd_ms": ours.map(|t| t.fwdbwd_ms),
        "flex_fwd_ms": flex_fwd,
        "flex_fwdbwd_ms": flex_fwdbwd,
        "sdpa_fwdbwd_ms": num("sdpa_fwdbwd_ms"),
        "ours_extra_gb": ours.map(|t| gb(t.extra_bytes)),
        "flex_extra_gb": base["flex_extra_bytes"].as_u64().map(gb),
        "sdpa_extra_gb": base["sdpa_extra_bytes"].as_u64().map(gb),
        "planned_extra_gb": ours.map(|t| gb(t.planned_extra_bytes)),
        "speedup_fwd": ratio(flex_fwd, ours.map(|t| t.fwd_ms)),
        "speedup_fwdbwd": ratio(flex_fwdbwd, ours.map(|t| t.fwdbwd_ms)),
        "ours_tflops_fwd": ours.map(|t| tflops(fwd_flops, t.fwd_ms)),
        "ours_tflops_fwdbwd": ours.map(|t| tflops(FWDBWD_FLOPS_FACTOR * fwd_flops, t.fwdbwd_ms)),
        "flex_tflops_fwd": flex_fwd.map(|ms| tflops(fwd_flops, ms)),
        "flex_tflops_fwdbwd": flex_fwdbwd.map(|ms| tflops(FWDBWD_FLOPS_FACTOR * fwd_flops, ms)),
    })
}

/// Runs the baseline script on the cases; its parsed JSON stdout.
fn run_torch(python: &str, script: &Path, rows: &[Measured], warmup: usize, iters: usize) -> Result<Value, String> {
    let cases: Vec<Value> = rows
        .iter()
        .map(|r| {
            json!({
                "name": r.case.name,
                "s": r.s,
                "block": r.block,
                "anchors": r.anchors,
                "window": r.window,
                "num_heads": r.case.num_heads,
                "num_kv_heads": r.case.num_kv_heads,
                "head_dim": r.case.head_dim,
                "seed": r.case.seed,
            })
        })
        .collect();
    run_python_json(python, script, &json!({ "warmup": warmup, "iters": iters, "cases": cases }))
}

/// Runs `python script INPUT.json` with `input` written to a temporary file, its stderr shown as
/// it comes; its stdout parsed as one JSON value.
pub fn run_python_json(python: &str, script: &Path, input: &Value) -> Result<Value, String> {
    let file = std::env::temp_dir().join(format!("dflash-bench-input-{}.json", std::process::id()));
    write_json(&file, input)?;
    let shown = format!("{python} {} {}", script.display(), file.display());
    println!("running {shown} (torch.compile takes a while; its log goes to stderr)");
    let output = Command::new(python).arg(script).arg(&file).stdout(Stdio::piped()).stderr(Stdio::inherit()).output();
    // Best effort: a leftover file in the temporary folder is harmless.
    let _ = std::fs::remove_file(&file);
    let output = output.map_err(|e| format!("`{shown}`: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!("`{shown}` failed ({})", output.status));
    }
    serde_json::from_str(stdout.trim()).map_err(|e| {
        let head: String = stdout.chars().take(400).collect();
        format!("`{shown}`: stdout is not the expected JSON ({e}): {head}")
    })
}

/// Each kernel's GPU time per call over a few forward+backward runs of `case` (CUDA events).
fn print_kernel_times(gpu: &Gpu, case: &AttnCase) -> Result<(), String> {
    use dflash_optimized::device::profile;
    profile::enable(true);
    let run = bench_case(gpu, case, 2, 3);
    profile::enable(false);
    let report = profile::report().map_err(|e| e.to_string())?;
    run.map_err(|e| e.to_string())?;
    for (name, ms, count) in report.ops {
        println!("      {:>8.3} ms/call  {name}", ms / count as f64);
    }
    Ok(())
}

/// The summary table, printed last.
fn print_table(objects: &[Value]) {
    let cell = |v: &Value, key: &str, digits: usize| match v[key].as_f64() {
        Some(x) => format!("{x:.digits$}"),
        None => "-".to_string(),
    };
    println!();
    println!(
        "{:<28} {:>8} {:>8} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>19}",
        "case",
        "ours fwd",
        "flex fwd",
        "ours f+b",
        "flex f+b",
        "sdpa f+b",
        "speedup",
        "TF/s fwd",
        "TF/s f+b",
        "extra GB ours/flex/plan"
    );
    for v in objects {
        println!(
            "{:<28} {:>8} {:>8} {:>9} {:>9} {:>9} {:>7}x {:>8} {:>8} {:>19}",
            v["case"].as_str().unwrap_or("?"),
            cell(v, "ours_fwd_ms", 3),
            cell(v, "flex_fwd_ms", 3),
            cell(v, "ours_fwdbwd_ms", 3),
            cell(v, "flex_fwdbwd_ms", 3),
            cell(v, "sdpa_fwdbwd_ms", 2),
            cell(v, "speedup_fwdbwd", 2),
            cell(v, "ours_tflops_fwd", 0),
            cell(v, "ours_tflops_fwdbwd", 0),
            format!(
                "{}/{}/{}",
                cell(v, "ours_extra_gb", 3),
                cell(v, "flex_extra_gb", 3),
                cell(v, "planned_extra_gb", 3)
            ),
        );
    }
    println!("(times in ms, median; speedup = flex fwd+bwd / ours fwd+bwd; TF/s: ours, useful FLOPs)");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(ours: Result<BenchTimes, String>) -> Measured {
        let case = bench_cases().remove(0);
        Measured {
            case,
            anchors: vec![5, 9],
            s: 10,
            block: 16,
            window: None,
            q_len: 1000,
            kv_len: 2000,
            pairs: 1_000_000,
            ours,
        }
    }

    #[test]
    fn case_object_computes_ratios_tflops_and_memory() {
        let times =
            BenchTimes { fwd_ms: 1.0, fwdbwd_ms: 2.0, extra_bytes: 2_000_000_000, planned_extra_bytes: 1_000_000_000 };
        let base = json!({ "allowed_pairs": 1_000_000, "flex_fwd_ms": 2.0, "flex_fwdbwd_ms": 3.0,
                           "flex_extra_bytes": 500_000_000u64, "errors": [] });
        let mut errors = Vec::new();
        let v = case_object(&measured(Ok(times)), &base, &mut errors);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(v["speedup_fwdbwd"].as_f64(), Some(1.5));
        assert_eq!(v["speedup_fwd"].as_f64(), Some(2.0));
        // 4 * d 128 * 32 heads * 1e6 pairs = 16.384 GFLOP in 1 ms.
        assert!((v["ours_tflops_fwd"].as_f64().unwrap() - 16.384).abs() < 1e-9);
        assert!((v["ours_tflops_fwdbwd"].as_f64().unwrap() - 16.384 * 3.5 / 2.0).abs() < 1e-9);
        assert_eq!(v["ours_extra_gb"].as_f64(), Some(2.0));
        assert_eq!(v["flex_extra_gb"].as_f64(), Some(0.5));
        assert_eq!(v["planned_extra_gb"].as_f64(), Some(1.0));
        assert_eq!(v["density"].as_f64(), Some(0.5));
        assert!(v["sdpa_fwdbwd_ms"].is_null());
    }

    #[test]
    fn case_object_reports_failures_and_a_different_mask() {
        let base = json!({ "allowed_pairs": 999, "errors": ["flex fwd ms: OutOfMemoryError"] });
        let mut errors = Vec::new();
        let v = case_object(&measured(Err("launch failed".into())), &base, &mut errors);
        assert!(v["ours_fwd_ms"].is_null() && v["speedup_fwdbwd"].is_null());
        let all = errors.join("\n");
        assert!(all.contains("ours: launch failed") && all.contains("OutOfMemoryError"), "{all}");
        assert!(all.contains("allows 999 pairs but the attention plan 1000000"), "{all}");
    }

    #[test]
    fn run_torch_parses_stdout_and_rejects_other_output() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.sh");
        std::fs::write(&good, "echo progress >&2\necho '{\"torch\": \"2.11\", \"cases\": []}'\n").unwrap();
        let rows = [measured(Err("not run".into()))];
        let out = run_torch("sh", &good, &rows, 1, 1).unwrap();
        assert_eq!(out["torch"], "2.11");
        let bad = dir.path().join("bad.sh");
        std::fs::write(&bad, "echo not json\n").unwrap();
        let err = run_torch("sh", &bad, &rows, 1, 1).unwrap_err();
        assert!(err.contains("not the expected JSON") && err.contains("not json"), "{err}");
        let failing = dir.path().join("failing.sh");
        std::fs::write(&failing, "exit 2\n").unwrap();
        assert!(run_torch("sh", &failing, &rows, 1, 1).unwrap_err().contains("failed"));
    }
}

/// Times and memory of the CUDA attention on one case (CUDA events after warm-up, median).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BenchTimes {
    /// Forward (O and logsumexp), ms.
    pub fwd_ms: f64,
    /// Forward then backward (dQ, dK, dV), ms.
    pub fwdbwd_ms: f64,
    /// Memory-pool high-water mark of one forward+backward minus the memory in use before it
    /// (the inputs q, k, v, dO and the plan on the device): O, logsumexp, dQ, dK, dV and every
    /// temporary, in bytes; the same convention as the PyTorch baselines of the benchmark.
    pub extra_bytes: u64,
    /// The planner's bound for the same quantity, bytes.
    pub planned_extra_bytes: u64,
}

/// Times the forward and forward+backward of `case` (CUDA events, median after `warmup`), and
/// measures the memory-pool growth of one forward+backward against the planned bytes.
fn bench_case(gpu: &Gpu, case: &AttnCase, warmup: usize, iters: usize) -> dflash_optimized::Result<BenchTimes> {
    let ranges = case.ranges()?;
    let shape = case_shape(case);
    let host = HostInputs::draw(case, &ranges);
    let stream = gpu.stream();
    let kernels = &AttentionKernels::load(gpu, case.head_dim)?;
    let dr = DeviceKeyRanges::upload(stream, &ranges)?;
    let inputs = DeviceRun::upload_inputs(stream, &host)?;
    let before = gpu.pool_used()?;
    gpu.reset_pool_high()?;
    let mut run = DeviceRun::new(stream, inputs, &ranges, shape)?;
    run.forward(kernels, stream, &dr, shape)?;
    run.backward(kernels, stream, &dr, shape)?;
    let extra_bytes = gpu.pool_used_high()?.saturating_sub(before);
    let fwd_ms = gpu.time_ms(warmup, iters, || run.forward(kernels, stream, &dr, shape))?;
    let fwdbwd_ms = gpu.time_ms(warmup, iters, || {
        run.forward(kernels, stream, &dr, shape)?;
        run.backward(kernels, stream, &dr, shape)
    })?;
    Ok(BenchTimes { fwd_ms, fwdbwd_ms, extra_bytes, planned_extra_bytes: cuda_extra_bytes(&ranges, shape) })
}
