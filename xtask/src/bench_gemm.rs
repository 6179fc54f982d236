//! `xtask bench gemm` (GPU machine): the cuBLAS bf16 `linear` of the training step checked
//! against the CPU (candle f32 on the same bf16 values) and timed with CUDA events on the
//! matmul shapes of the Qwen3-8B drafter step; then decoding's linear layers (1 and 16 rows of
//! the Qwen3-8B shapes): cuBLAS against `linear_rows`, in GB/s of weight read;
//! writes `results/gemm-h200.json`.

use std::path::PathBuf;

use candle_core::{Device, Tensor};
use cudarc::driver::DevicePtr;
use dflash_optimized::backend::cuda::Cuda;
use dflash_optimized::backend::Backend;
use dflash_optimized::device::gpu::{median, Gpu};
use dflash_optimized::ops::constants::LINEAR_ROWS;
use dflash_optimized::ops::matmul::cuda::Blas;
use half::bf16;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use serde_json::{json, Value};

use crate::args::Options;
use crate::gpu_bundle;
use crate::gpu_conformance::{open_gpu, utc_now, write_json};

const HELP: &str = "usage: xtask bench gemm [options]     (on the GPU machine)

options:
  --out FILE      results file                          (default results/gemm-h200.json)
  --warmup N      warm-up iterations                    (default 10)
  --iters N       timed iterations (median)             (default 50)
  --algos N       also time cuBLASLt's first N heuristic candidates for each shape of the
                  training step and of the target's forward (S=8192), back to back, against
                  cublasGemmEx's default choice (default 0: not run; at most 64)
  --commit SHA    the commit measured                   (default: commit.txt next to the binary)";

const OPTIONS: &[&str] = &["out", "warmup", "iters", "commit", "algos"];

/// bf16 output rounding (2^-8 relative per element) over random-sign sums: the GPU result (NaN
/// gives an infinite relative error, so it fails)
/// against an f32 CPU product of the same bf16 inputs stays well below this.
const GEMM_BF16_TOLERANCE: f64 = 1e-2;

/// (name, m, n, k): `y [m, n] = x [m, k] @ w [n, k]^T`; m = 8192 block rows (N=512, B=16).
const SHAPES: &[(&str, usize, usize, usize)] = &[
    ("square 8192^3", 8192, 8192, 8192),
    ("qwen3-8b q_proj", 8192, 4096, 4096),
    ("qwen3-8b gate/up_proj", 8192, 12288, 4096),
    ("qwen3-8b down_proj", 8192, 4096, 12288),
    ("qwen3-8b lm_head chunk", 1024, 151936, 4096),
];

/// (name, m, n, k) of the target forward's stacked linears at S=8192 (Qwen3-8B), for `--algos`.
const TARGET_SHAPES: &[(&str, usize, usize, usize)] = &[
    ("target qkv_proj (stacked)", 8192, 6144, 4096),
    ("target o_proj", 8192, 4096, 4096),
    ("target gate_up_proj", 8192, 24576, 4096),
    ("target down_proj", 8192, 4096, 12288),
];

/// Most cuBLASLt candidates `--algos` asks for.
const MAX_ALGOS: usize = 64;

/// Back-to-back calls per timed sample of `--algos` (the GPU kept busy, as in a forward).
const ALGO_REPS: usize = 10;
/// Rounds over every candidate of a shape (interleaved, so that clocks and temperature drift
/// alike for all); a candidate's time is the median of its rounds.
const ALGO_ROUNDS: usize = 3;

/// (name, n, k) of decoding's linear layers on the Qwen3-8B shape, timed at 1 and 16 rows.
const DECODE_SHAPES: &[(&str, usize, usize)] = &[
    ("q/o_proj", 4096, 4096),
    ("k/v_proj", 1024, 4096),
    ("qkv_proj (stacked)", 6144, 4096),
    ("gate_up_proj", 24576, 4096),
    ("down_proj", 4096, 12288),
    ("lm_head", 151936, 4096),
];

fn err(e: dflash_optimized::Error) -> String {
    e.to_string()
}

fn gpu_err(e: cudarc::driver::DriverError) -> String {
    format!("{e:?}")
}

fn random_bf16(n: usize, rng: &mut ChaCha8Rng) -> Vec<bf16> {
    (0..n).map(|_| bf16::from_f32(StandardNormal.sample(rng))).collect()
}

pub fn run(args: Vec<String>) -> Result<(), String> {
    let Some(opts) = Options::parse(args, OPTIONS)? else {
        println!("{HELP}");
        return Ok(());
    };
    let out: PathBuf = opts.get("out", gpu_bundle::repo_root().join("results/gemm-h200.json"))?;
    let (warmup, iters): (usize, usize) = (opts.get("warmup", 10)?, opts.get("iters", 50)?);
    let commit: String = opts.get("commit", String::new())?;
    let algos: usize = opts.get("algos", 0)?;
    if iters == 0 {
        return Err("option `--iters`: 0; at least 1 timed iteration".into());
    }
    if algos > MAX_ALGOS {
        return Err(format!("option `--algos`: {algos}; at most {MAX_ALGOS} candidates (0: not run)"));
    }
    let commit = gpu_bundle::commit(Some(commit).filter(|c| !c.is_empty()))?;
    let gpu = open_gpu()?;
    let blas = Blas::new(&gpu).map_err(|e| e.to_string())?;
    let stream = gpu.stream();
    let mut rng = ChaCha8Rng::seed_from_u64(0);

    // Correctness on an odd shape: GPU bf16 against the CPU in f32 on the same bf16 values.
    let (m, n, k) = (300, 700, 500);
    let (x, w) = (random_bf16(m * k, &mut rng), random_bf16(n * k, &mut rng));
    let (dx, dw) = (stream.clone_htod(&x).map_err(gpu_err)?, stream.clone_htod(&w).map_err(gpu_err)?);
    let mut dy = stream.alloc_zeros::<bf16>(m * n).map_err(gpu_err)?;
    blas.linear(&dx, &dw, &mut dy, (m, n, k)).map_err(err)?;
    let got: Vec<f64> = stream.clone_dtoh(&dy).map_err(gpu_err)?.iter().map(|v| v.to_f64()).collect();
    let widen = |v: &[bf16], rows, cols| {
        Tensor::from_vec(v.iter().map(|e| e.to_f32()).collect::<Vec<_>>(), (rows, cols), &Device::Cpu)
    };
    let want = dflash_reference::ops::linear(
        &widen(&x, m, k).map_err(|e| e.to_string())?,
        &widen(&w, n, k).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?
    .flatten_all()
    .and_then(|t| t.to_dtype(candle_core::DType::F64))
    .and_then(|t| t.to_vec1::<f64>())
    .map_err(|e| e.to_string())?;
    let rel = dflash_conformance::attention_cases::rel_error(&got, &want);
    println!("cuBLAS linear {m}x{n}x{k} vs CPU f32: relative error {rel:.2e} (bound {GEMM_BF16_TOLERANCE:.0e})");

    let (gpu_name, date) = (gpu.name().to_string(), utc_now());
    let mut rows: Vec<Value> = Vec::new();
    println!("{:<26} {:>10} {:>10}", "shape", "ms", "TFLOP/s");
    for &(name, m, n, k) in SHAPES {
        let (x, w) = (random_bf16(m * k, &mut rng), random_bf16(n * k, &mut rng));
        let (dx, dw) = (stream.clone_htod(&x).map_err(gpu_err)?, stream.clone_htod(&w).map_err(gpu_err)?);
        let mut dy = stream.alloc_zeros::<bf16>(m * n).map_err(gpu_err)?;
        let ms = gpu.time_ms(warmup, iters, || blas.linear(&dx, &dw, &mut dy, (m, n, k))).map_err(err)?;
        let tflops = 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;
        println!("{name:<26} {ms:>10.3} {tflops:>10.1}");
        rows.push(json!({"shape": name, "m": m, "n": n, "k": k, "ms": ms, "tflops": tflops}));
    }
    for row in rows.iter_mut() {
        row["check_rel_error"] = json!(rel);
    }
    decode_rows(&gpu, (warmup, iters), &mut rng, &mut rows)?;
    // The largest relative error of a cuBLASLt candidate against the default's output.
    let algo_error = match algos {
        0 => 0.0,
        n => algo_rows(&gpu, &blas, n, (warmup, iters), &mut rng, &mut rows)?,
    };
    for row in rows.iter_mut() {
        row["date"] = json!(date);
        row["gpu"] = json!(gpu_name);
        row["commit"] = json!(commit);
    }
    write_json(&out, &Value::Array(rows))?;
    println!("wrote {}", out.display());
    if rel >= GEMM_BF16_TOLERANCE {
        return Err(format!("cuBLAS linear relative error {rel:.2e} above {GEMM_BF16_TOLERANCE:.0e}"));
    }
    if algo_error >= GEMM_BF16_TOLERANCE {
        return Err(format!(
            "a cuBLASLt candidate's output is {algo_error:.2e} from the default's, above {GEMM_BF16_TOLERANCE:.0e}"
        ));
    }
    Ok(())
}

/// Decoding's linear layers at 1 and 16 rows ([`DECODE_SHAPES`]): cuBLAS and `linear_rows`,
/// each in GB/s of weight read (the bound of batch-1 decoding); a row each.
fn decode_rows(
    gpu: &Gpu,
    (warmup, iters): (usize, usize),
    rng: &mut ChaCha8Rng,
    rows: &mut Vec<Value>,
) -> Result<(), String> {
    let (stream, blas, dev) = (gpu.stream(), Blas::new(gpu).map_err(err)?, Cuda::new(gpu, 128).map_err(err)?);
    let kernels = dev.ops();
    println!("{:<26} {:>4} {:>10} {:>12}", "decode linear", "rows", "cuBLAS", "linear_rows");
    for &(name, n, k) in DECODE_SHAPES {
        // As in decoding, the weights come from HBM, not from L2: copies of at least 256 MB in
        // all, one call on each per timed iteration.
        let copies = (256_000_000usize).div_ceil(2 * n * k).clamp(1, 64);
        let ws = (0..copies)
            .map(|_| stream.clone_htod(&random_bf16(n * k, rng)).map_err(gpu_err))
            .collect::<Result<Vec<_>, _>>()?;
        for m in [1, LINEAR_ROWS] {
            let x = stream.clone_htod(&random_bf16(m * k, rng)).map_err(gpu_err)?;
            let mut y = stream.alloc_zeros::<bf16>(m * n).map_err(gpu_err)?;
            let gb_per_s = |ms: f64| (2 * n * k * copies) as f64 / (ms * 1e-3) / 1e9;
            let cublas = gpu
                .time_ms(warmup, iters, || ws.iter().try_for_each(|w| blas.linear(&x, w, &mut y, (m, n, k))))
                .map_err(err)?;
            let (xp, yp) = (x.device_ptr(stream).0, y.device_ptr(stream).0);
            let wps: Vec<u64> = ws.iter().map(|w| w.device_ptr(stream).0).collect();
            let ours = gpu
                .time_ms(warmup, iters, || {
                    wps.iter().try_for_each(|&wp| kernels.linear_rows(xp, wp, yp, (m, n, k), 0.0))
                })
                .map_err(err)?;
            println!("{name:<26} {m:>4} {:>10.0} {:>12.0}  GB/s", gb_per_s(cublas), gb_per_s(ours));
            rows.push(json!({"shape": format!("decode {name}"), "m": m, "n": n, "k": k,
                "cublas_gb_per_s": gb_per_s(cublas), "linear_rows_gb_per_s": gb_per_s(ours)}));
        }
    }
    Ok(())
}

/// `--algos N`: for each forward linear of the training step and of the target ([`SHAPES`],
/// [`TARGET_SHAPES`]), cublasGemmEx's default choice and cuBLASLt's first `count` heuristic
/// candidates, each timed over [`ALGO_REPS`] back-to-back calls per sample in [`ALGO_ROUNDS`]
/// interleaved rounds, its output checked against the default's; a row each shape. Returns the
/// largest relative error of a candidate's output against the default's.
fn algo_rows(
    gpu: &Gpu,
    blas: &Blas,
    count: usize,
    (warmup, iters): (usize, usize),
    rng: &mut ChaCha8Rng,
    rows: &mut Vec<Value>,
) -> Result<f64, String> {
    use dflash_optimized::ops::matmul::cuda::LtLinear;
    let stream = gpu.stream();
    let mut worst = 0.0f64;
    for &(name, m, n, k) in SHAPES.iter().chain(TARGET_SHAPES) {
        let (x, w) = (random_bf16(m * k, rng), random_bf16(n * k, rng));
        let (dx, dw) = (stream.clone_htod(&x).map_err(gpu_err)?, stream.clone_htod(&w).map_err(gpu_err)?);
        let mut dy = stream.alloc_zeros::<bf16>(m * n).map_err(gpu_err)?;
        let lt = LtLinear::new(gpu, (m, n, k)).map_err(err)?;
        let candidates = lt.algos(count).map_err(err)?;
        // The default's output, the reference of every candidate's (its first 2^20 values).
        blas.linear(&dx, &dw, &mut dy, (m, n, k)).map_err(err)?;
        let check = (m * n).min(1 << 20);
        let first = |y: &cudarc::driver::CudaSlice<bf16>| -> Result<Vec<f64>, String> {
            let v = stream.clone_dtoh(&y.slice(0..check)).map_err(gpu_err)?;
            Ok(v.iter().map(|e| e.to_f64()).collect())
        };
        let want = first(&dy)?;
        let (xp, wp) = (dx.device_ptr(stream).0, dw.device_ptr(stream).0);
        let yp = dy.device_ptr(stream).0;
        let mut errors = Vec::with_capacity(candidates.len());
        for a in &candidates {
            lt.run(a, xp, wp, yp).map_err(err)?;
            errors.push(dflash_conformance::attention_cases::rel_error(&first(&dy)?, &want));
        }
        worst = errors.iter().copied().fold(worst, f64::max);
        // times[0]: the default; times[1 + i]: candidate i; per round.
        let mut times = vec![Vec::with_capacity(ALGO_ROUNDS); 1 + candidates.len()];
        for _ in 0..ALGO_ROUNDS {
            let t = gpu
                .time_ms(warmup, iters, || (0..ALGO_REPS).try_for_each(|_| blas.linear(&dx, &dw, &mut dy, (m, n, k))))
                .map_err(err)?;
            times[0].push(t / ALGO_REPS as f64);
            for (i, a) in candidates.iter().enumerate() {
                let t = gpu
                    .time_ms(warmup, iters, || (0..ALGO_REPS).try_for_each(|_| lt.run(a, xp, wp, yp)))
                    .map_err(err)?;
                times[1 + i].push(t / ALGO_REPS as f64);
            }
        }
        let ms: Vec<f64> = times.iter_mut().map(|t| median(t)).collect();
        let tflops = |ms: f64| 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;
        println!("{name} ({m}x{n}x{k}): gemmEx default {:.3} ms, {:.1} TFLOP/s", ms[0], tflops(ms[0]));
        println!(
            "  {:>3} {:>5} {:>5} {:>6} {:>6} {:>7} {:>6} {:>9} {:>8} {:>9}",
            "#", "algo", "tile", "stages", "splitk", "cluster", "waves", "ms", "vs dflt", "rel err"
        );
        let mut listed = Vec::with_capacity(candidates.len());
        for (i, a) in candidates.iter().enumerate() {
            let t = ms[1 + i];
            println!(
                "  {i:>3} {:>5} {:>5} {:>6} {:>6} {:>7} {:>6.2} {t:>9.3} {:>8.3} {:>9.1e}",
                a.id,
                a.tile,
                a.stages,
                a.splitk,
                a.cluster,
                a.waves,
                ms[0] / t,
                errors[i]
            );
            listed.push(json!({"rank": i, "algo": a.id, "tile": a.tile, "stages": a.stages, "splitk": a.splitk,
                "cluster": a.cluster, "waves": a.waves, "workspace": a.workspace, "ms": t, "tflops": tflops(t),
                "speedup_vs_default": ms[0] / t, "rel_error_vs_default": errors[i]}));
        }
        rows.push(json!({"shape": format!("algos {name}"), "m": m, "n": n, "k": k, "default_ms": ms[0],
            "default_tflops": tflops(ms[0]), "reps": ALGO_REPS, "rounds": ALGO_ROUNDS, "candidates": listed}));
    }
    Ok(worst)
}
