//! `xtask gpu-conformance` (on the H200): the CUDA attention kernels against their CPU twin and
//! the reference on the conformance cases, every elementwise kernel and the matmul against the one
//! set of CPU twins, and the GPU step against the reference, written as the attestation `fixtures/gpu/attestation.json` that the CI test
//! `conformance/tests/attestation.rs` checks against the current kernel sources.

use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use dflash_conformance::attention_cases::{conformance_cases, BF16_TOLERANCE};
use dflash_conformance::decode_cases::{
    builtin_pair, decode_check, gpu_hybrid_pairs, gpu_pairs, random_prompt, DecodeMatch, BF16_NEAR_TIE,
};
use dflash_conformance::gpu_attention::conformance_case;
use dflash_conformance::gpu_step::{self, kernel_checks, GpuCheck, PoolMeter};
use dflash_conformance::hybrid_cases::{hybrid_check, random_hybrid_cases, GPU_HYBRID_SEED};
use dflash_conformance::target_cases::{random_target_cases, target_check};
use dflash_conformance::tolerance::{GPU_KERNEL_BF16, HYBRID_BF16};
use dflash_optimized::backend::cuda::Cuda;
use dflash_optimized::device::gpu::Gpu;
use dflash_optimized::ops::sources::{kernel_hash, KERNEL_SOURCES};
use dflash_reference::speculative::Sampling;
use serde_json::{json, Value};

use crate::args::Options;
use crate::gpu_bundle;

const HELP: &str = "usage: xtask gpu-conformance [options]     (on the GPU machine)

Runs the CUDA attention kernels on the conformance cases (odd sizes, N=1, a padding block, S not a
multiple of 64, a window larger than S, several documents, GQA 32/8 d=128, causal full and
sliding) against their CPU twin and the reference (relative errors below 1e-2); every
elementwise.cu and gdn.cu kernel and the cuBLAS matmul against the same CPU twins CI runs, in f64
(below 1e-2; the chunked delta rule's tensor-core products below 2e-2); the target's forward (Qwen3 and Llama, d 64/128, GQA, yarn/llama3 RoPE, packed documents)
against the reference in f32 (features below 1e-2, each document alone as packed, memory-pool peak
at most its layout); the hybrid target's forward (GatedDeltaNet d_k 128 and 32, gated attention
d 256 and 64, packed documents) against the reference in f32 likewise (below 3e-2: bf16 storage
alone gives 1.9e-2 there); greedy and speculative decoding with K/V caches (random GPU-sized targets and
drafters, and the built-in target with its trained drafter): lossless, accept lengths the longest
agreeing prefixes, every token and draft the f32 reference's argmax up to a bf16 near-tie; the same for
random hybrids (GatedDeltaNet states kept across launches, verify blocks keeping their accepted
prefix); and the GPU training step of random drafters (sliding + full layer, packed
documents, keep=false blocks) under every checkpointing policy against the reference in f64 (loss
and every parameter gradient below 2e-2, policies equal, measured memory-pool peak at most the plan
and within 15% of it). Writes the attestation: the SHA-256 of the kernel sources with the constants prelude, the GPU, the
date, the commit, each case's errors and the verdict. Exits with an error when a case fails, after
writing the file.

options:
  --out FILE      where the attestation goes       (default fixtures/gpu/attestation.json)
  --commit SHA    the commit under test            (default: commit.txt next to the binary)
  --step yes|no   also the elementwise kernels and the GPU step         (default yes)
  --only GROUPS   run only these groups, comma-separated, of: attention, kernels, target, hybrid,
                  decoding, hybrid-decoding, step (a partial attestation, which says so)
                                                                          (default: all)";

const OPTIONS: &[&str] = &["out", "commit", "step", "only"];

/// The groups of cases `--only` may name, in the order they run.
const GROUPS: [&str; 7] = ["attention", "kernels", "target", "hybrid", "decoding", "hybrid-decoding", "step"];

/// Opens GPU 0, or says why there is none and how to run on the GPU machine.
pub fn open_gpu() -> Result<Gpu, String> {
    open_gpu_at(0)
}

/// GPU `ordinal`, or an error saying there is none here.
pub fn open_gpu_at(ordinal: usize) -> Result<Gpu, String> {
    match Gpu::open(ordinal).map_err(|e| e.to_string())? {
        Some(gpu) => Ok(gpu),
        None => Err(NO_GPU.to_string()),
    }
}

/// What a GPU command says on a machine without one.
const NO_GPU: &str = "no CUDA GPU here (no driver library libcuda.so, or no device); run on the GPU machine: \
                      `cargo xtask gpu-bundle` prints the command";

/// Checks that this machine has the GPUs `ordinals` (a command's workers), before any work;
/// without any GPU the error names `option` (the one that asked for the GPU).
pub fn check_gpus(option: &str, ordinals: &[usize]) -> dflash_trainer::Result<()> {
    let count = Gpu::count()?;
    if count == 0 {
        return Err(dflash_trainer::Error::option(option, format!("`gpu`: {NO_GPU}")));
    }
    match ordinals.iter().find(|&&g| g >= count) {
        Some(g) => Err(dflash_trainer::Error::option(
            "gpus",
            format!("GPU {g} requested, but this machine has {count} CUDA device(s)"),
        )),
        None => Ok(()),
    }
}

/// Now in UTC, ISO 8601 to the second: `2026-11-29T14:03:59Z`.
pub fn utc_now() -> String {
    iso_utc(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()))
}

/// `secs` since the Unix epoch as ISO 8601 UTC.
fn iso_utc(secs: u64) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Checks before the work that [`write_json`] can write `file`: it is not a folder, and its
/// folder can be created and written (a probe file is created there and removed).
pub fn check_json_out(file: &Path) -> Result<(), String> {
    if file.is_dir() {
        return Err(format!("option `--out`: {} is a folder, not a file", file.display()));
    }
    let dir = file.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let probe = dir.join(format!(".write-probe-{}", std::process::id()));
    let written = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&probe, b"probe"));
    let _ = std::fs::remove_file(&probe);
    written.map_err(|e| format!("option `--out`: {}: cannot write there: {e}", file.display()))
}

/// Writes `value` as pretty JSON to `file` atomically, creating its folder.
pub fn write_json(file: &Path, value: &Value) -> Result<(), String> {
    if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    dflash_reference::io::write_atomically(file, |f| {
        serde_json::to_writer_pretty(&mut *f, value).map_err(std::io::Error::other)?;
        std::io::Write::write_all(f, b"\n")
    })
    .map_err(|e| e.to_string())
}

pub fn run(args: Vec<String>) -> Result<(), String> {
    let Some(opts) = Options::parse(args, OPTIONS)? else {
        println!("{HELP}");
        return Ok(());
    };
    let out: PathBuf = opts.get("out", PathBuf::from("fixtures/gpu/attestation.json"))?;
    let commit: String = opts.get("commit", String::new())?;
    let commit = gpu_bundle::commit(Some(commit).filter(|c| !c.is_empty()))?;
    let with_step = opts.yes_no("step", true)?;
    let only: String = opts.get("only", GROUPS.join(","))?;
    let only: Vec<&str> = only.split(',').map(str::trim).collect();
    if let Some(bad) = only.iter().find(|g| !GROUPS.contains(g)) {
        return Err(format!("option `--only`: `{bad}` is not a group ({})", GROUPS.join(", ")));
    }
    let runs = |group: &str| only.contains(&group) && (with_step || group == "attention");
    let gpu = open_gpu()?;
    if KERNEL_SOURCES.is_empty() {
        return Err("no kernel sources are embedded (optimized/src/ops/*/*.cu): nothing to attest".to_string());
    }
    let hash = kernel_hash();
    let files: Vec<&str> = KERNEL_SOURCES.iter().map(|&(name, _)| name).collect();
    println!("GPU conformance on {} (commit {commit}); kernels {} sha256 {hash}", gpu.name(), files.join(", "));
    println!("{:<34} {:>10} {:>10} {:>10} {:>10}  {:<6} {:>7}", "case", "out", "dq", "dk", "dv", "result", "time");

    let mut cases = Vec::new();
    for case in conformance_cases().into_iter().filter(|_| only.contains(&"attention")) {
        let started = Instant::now();
        let outcome = conformance_case(&gpu, &case);
        let name = &case.name;
        let secs = started.elapsed().as_secs_f64();
        let entry = match outcome {
            Ok(errors) => {
                let pass = errors.pass();
                println!(
                    "{:<34} {:>10.2e} {:>10.2e} {:>10.2e} {:>10.2e}  {:<6} {secs:>6.1}s",
                    name,
                    errors.out,
                    errors.dq,
                    errors.dk,
                    errors.dv,
                    if pass { "pass" } else { "FAIL" }
                );
                json!({
                    "name": name,
                    "errors": { "out": errors.out, "dq": errors.dq, "dk": errors.dk, "dv": errors.dv },
                    "pass": pass,
                })
            }
            Err(e) => {
                println!("{name:<34} error after {secs:.1}s: {e}");
                json!({ "name": name, "errors": Value::Null, "pass": false, "error": e.to_string() })
            }
        };
        cases.push(entry);
    }
    cases.extend(step_checks(&gpu, &runs)?);
    let failed: Vec<&str> =
        cases.iter().filter(|c| c["pass"] != Value::Bool(true)).filter_map(|c| c["name"].as_str()).collect();
    let verdict = if failed.is_empty() { "pass" } else { "fail" };
    let attestation = json!({
        "kernel_hash": hash,
        "kernel_files": files,
        "gpu": gpu.name(),
        "date": utc_now(),
        "commit": commit,
        "tolerance": BF16_TOLERANCE,
        "cases": cases,
        "groups": GROUPS.iter().filter(|g| runs(g)).collect::<Vec<_>>(),
        "partial": GROUPS.iter().any(|g| !runs(g)),
        "verdict": verdict,
    });
    write_json(&out, &attestation)?;
    println!(
        "verdict: {verdict} ({} of {} cases pass); wrote {}",
        cases.len() - failed.len(),
        cases.len(),
        out.display()
    );
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("GPU conformance failed on: {}", failed.join(", ")))
    }
}

/// Seeds of the random GPU-step cases (each run under every checkpointing policy).
const STEP_SEEDS: [u64; 3] = [1, 2, 3];
/// Seed of the kernel-twin checks' inputs.
const KERNEL_SEED: u64 = 7;
/// Seed of the random targets.
const TARGET_SEED: u64 = 5;
/// Seed of the decoding pairs and prompts.
const DECODE_SEED: u64 = 9;

/// The target's forward on the GPU (bf16) for the random targets against the reference in f32,
/// with its memory-pool peak against its layout.
fn target_checks(gpu: &Gpu) -> dflash_optimized::Result<Vec<GpuCheck>> {
    let cases = random_target_cases(TARGET_SEED, candle_core::DType::F32)?;
    let mut meter = PoolMeter::new(gpu);
    cases
        .iter()
        .map(|case| {
            let d = case.model.config.dims.head_dim;
            target_check(case, || Cuda::new(gpu, d), GPU_KERNEL_BF16, Some(&mut meter))
        })
        .collect()
}

/// The hybrid target's forward on the GPU (bf16, `gdn.cu`) for the random hybrids against the
/// reference in f32, with its memory-pool peak against its layout.
fn hybrid_checks(gpu: &Gpu) -> dflash_optimized::Result<Vec<GpuCheck>> {
    let cases = random_hybrid_cases(GPU_HYBRID_SEED, candle_core::DType::F32)?;
    let mut meter = PoolMeter::new(gpu);
    cases
        .iter()
        .map(|case| {
            let d = case.model.config.head_dim;
            hybrid_check(case, || Cuda::new(gpu, d), HYBRID_BF16, Some(&mut meter))
        })
        .collect()
}

/// Greedy and speculative decoding on the GPU (bf16, K/V caches): lossless against its own greedy
/// decode, accept lengths the longest agreeing prefixes, and every token and draft the reference's
/// argmax (f32, teacher-forced on our output) up to a bf16 near-tie; for the random GPU-sized pairs
/// (prompts shorter than a window, longer, and longer than one prefill chunk) and the built-in
/// target with its trained drafter.
fn decode_checks(gpu: &Gpu) -> dflash_optimized::Result<Vec<GpuCheck>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(DECODE_SEED);
    let mut checks = Vec::new();
    let mut pairs = gpu_pairs(DECODE_SEED, candle_core::DType::F32);
    pairs.push(builtin_pair(candle_core::DType::F32));
    for pair in &pairs {
        let vocab = pair.target.config.dims.vocab_size;
        let lens = [rng.random_range(5..30), rng.random_range(60..200), rng.random_range(520..600)];
        let prompts: Vec<Vec<u32>> = lens.iter().map(|&n| random_prompt(n, vocab, &mut rng)).collect();
        checks.push(
            decode_check(
                pair,
                |d| Cuda::new(gpu, d),
                &prompts,
                (48, &Sampling::Greedy),
                DecodeMatch::NearTie { rel: BF16_NEAR_TIE },
            )?
            .0,
        );
    }
    Ok(checks)
}

/// [`decode_checks`] for random hybrids (GatedDeltaNet states kept across launches, verify
/// blocks keeping their accepted prefix): prompts within one GatedDeltaNet chunk, across chunks,
/// and across prefill launches.
fn hybrid_decode_checks(gpu: &Gpu) -> dflash_optimized::Result<Vec<GpuCheck>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(DECODE_SEED);
    let mut checks = Vec::new();
    for pair in &gpu_hybrid_pairs(DECODE_SEED, candle_core::DType::F32) {
        let vocab = pair.target.config.vocab_size;
        let lens = [rng.random_range(5..30), rng.random_range(60..200), rng.random_range(520..600)];
        let prompts: Vec<Vec<u32>> = lens.iter().map(|&n| random_prompt(n, vocab, &mut rng)).collect();
        let matching = DecodeMatch::NearTie { rel: BF16_NEAR_TIE };
        checks.push(decode_check(pair, |d| Cuda::new(gpu, d), &prompts, (48, &Sampling::Greedy), matching)?.0);
    }
    Ok(checks)
}

/// The elementwise kernels and the matmul against the CPU twins and the GPU step against the
/// reference, as attestation cases (printed as they finish).
fn step_checks(gpu: &Gpu, runs: &dyn Fn(&str) -> bool) -> Result<Vec<Value>, String> {
    println!("{:<72} {:>10} {:>9}  {:<6}", "step check", "worst", "bound", "result");
    let mut entries = Vec::new();
    let mut record = |name: String, outcome: dflash_optimized::Result<Vec<GpuCheck>>, secs: f64| match outcome {
        Ok(checks) => {
            for c in checks {
                let pass = c.pass();
                let memory = c.memory.map(|(measured, planned)| {
                    format!("  peak {:.4} GB, planned {:.4} GB", measured as f64 / 1e9, planned as f64 / 1e9)
                });
                println!(
                    "{:<72} {:>10.2e} {:>9.0e}  {:<6}{}",
                    c.name,
                    c.worst(),
                    c.tolerance,
                    if pass { "pass" } else { "FAIL" },
                    memory.unwrap_or_default()
                );
                let errors: serde_json::Map<String, Value> =
                    c.errors.iter().map(|(n, e)| (n.clone(), json!(e))).collect();
                entries.push(json!({
                    "name": c.name,
                    "errors": errors,
                    "tolerance": c.tolerance,
                    "peak_bytes": c.memory.map(|m| m.0),
                    "planned_bytes": c.memory.map(|m| m.1),
                    "pass": pass,
                }));
            }
            println!("  ({name}: {secs:.1}s)");
        }
        Err(e) => {
            println!("{name}: error after {secs:.1}s: {e}");
            entries.push(json!({ "name": name, "errors": Value::Null, "pass": false, "error": e.to_string() }));
        }
    };
    type Group<'a> = (&'a str, String, Box<dyn Fn() -> dflash_optimized::Result<Vec<GpuCheck>> + 'a>);
    let mut groups: Vec<Group> = vec![
        ("kernels", "kernel twins".to_string(), Box::new(|| kernel_checks(gpu, KERNEL_SEED))),
        ("target", "target forward".to_string(), Box::new(|| target_checks(gpu))),
        ("hybrid", "hybrid forward".to_string(), Box::new(|| hybrid_checks(gpu))),
        ("decoding", "decoding".to_string(), Box::new(|| decode_checks(gpu))),
        ("hybrid-decoding", "hybrid decoding".to_string(), Box::new(|| hybrid_decode_checks(gpu))),
    ];
    for seed in STEP_SEEDS {
        groups.push(("step", format!("step seed {seed}"), Box::new(move || gpu_step::step_checks(gpu, seed))));
    }
    for (_, name, checks) in groups.into_iter().filter(|(group, _, _)| runs(group)) {
        let started = Instant::now();
        record(name, checks(), started.elapsed().as_secs_f64());
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::{iso_utc, utc_now};

    #[test]
    fn iso_utc_dates() {
        assert_eq!(iso_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso_utc(951_827_696), "2000-02-29T12:34:56Z");
        assert_eq!(iso_utc(1_798_761_599), "2026-12-31T23:59:59Z");
        assert_eq!(utc_now().len(), 20);
    }
}
