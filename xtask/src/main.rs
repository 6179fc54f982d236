//! `cargo xtask <command>`: the project's developer workflows.
//!
//! - `train`: train a drafter; with no arguments, a tiny drafter against the tiny built-in
//!   target on the CPU (a few minutes), printing the falling loss and tau before and after.
//! - `plan`: the memory planner's itemised peak for the named configs, per policy.
//! - `data`: a user's conversations and the target's tokenizer to packed rows; statistics.
//! - `features`: the offline feature cache (every document through the target, in shards).
//! - `eval`: a drafter by speculative decoding with its target (tau, acceptance, speed).
//! - `demo-target`: a small random Qwen3 target folder with a real tokenizer (no download).
//! - `kernels`: every CUDA kernel compiled here as the GPU machine compiles it (no GPU); checked.
//! - `gpu-bundle`: the release binary and baseline scripts in `gpu-bundle/`, for the GPU machine.
//! - `gpu-conformance` (GPU machine): the CUDA kernels against the reference; the attestation.
//! - `bench attention` (GPU machine): our attention against PyTorch flex_attention and SDPA.
//! - `bench step` (GPU machine): the GPU training step against PyTorch; MFU and memory peaks.
//! - `bench data`: the data pipeline against Python transformers on the CPU; peak memory.
//! - `bench gemm`, `bench target`, `bench hybrid`, `bench eval`, `bench train` (GPU machine):
//!   the cuBLAS linear, the target forwards, decoding and training end to end, each against its
//!   baseline (`xtask bench --help`).

mod args;
mod bench;
mod bench_attention;
mod bench_data;
mod bench_eval;
mod bench_gemm;
mod bench_hybrid;
mod bench_step;
mod bench_target;
mod bench_train;
mod data;
mod demo_target;
mod eval;
mod features;
mod gpu_bundle;
mod gpu_conformance;
mod kernels;
mod plan;
mod train;

use std::process::ExitCode;

const USAGE: &str = "usage: cargo xtask <command> [options]

commands:
  train              train a drafter (no options: the tiny built-in default on the CPU)
  plan               the memory planner: itemised peak per checkpointing policy
  data               conversations + the target's tokenizer -> packed rows; stats, samples
  features           the offline feature cache: every document through the target, in shards
  eval               a drafter by speculative decoding with its target: tau, acceptance, speed
  demo-target        a small random Qwen3 target folder with a real tokenizer, to try the above
  kernels            compile every CUDA kernel here with NVRTC and ptxas (no GPU); check the SASS
  gpu-bundle         build the release binary into gpu-bundle/ for the GPU machine
  gpu-conformance    (GPU machine) CUDA kernels vs the reference; writes the attestation
  bench attention    (GPU machine) our attention vs PyTorch flex_attention and SDPA
  bench gemm         (GPU machine) the cuBLAS bf16 linear: checked against the CPU, timed
  bench step         (GPU machine) the GPU training step per policy vs PyTorch, MFU, peaks
  bench target       (GPU machine) the target forward (features) vs transformers, 8B shape
  bench hybrid       (GPU machine) the hybrid target forward vs transformers (fla and torch)
  bench eval         (GPU machine) batch-1 decoding, plain and speculative, vs transformers
  bench train        (GPU machine) training steps end to end vs a PyTorch pipeline, 8B target
  bench data         the data pipeline vs Python transformers on the CPU; peak memory

run `cargo xtask <command> --help` for a command's options";

fn main() -> ExitCode {
    // Arguments are text: one that is not UTF-8 (a path in another encoding) is named, not a panic.
    let argv: Result<Vec<String>, String> = std::env::args_os()
        .skip(1)
        .enumerate()
        .map(|(i, a)| {
            a.into_string().map_err(|a| format!("argument {} ({}) is not UTF-8 text", i + 1, a.to_string_lossy()))
        })
        .collect();
    let mut argv = match argv {
        Ok(argv) => argv.into_iter(),
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::FAILURE;
        }
    };
    let result = match argv.next().as_deref() {
        Some("train") => train::run(argv.collect()),
        Some("plan") => plan::run(argv.collect()),
        Some("data") => data::run(argv.collect()),
        Some("features") => features::run(argv.collect()),
        Some("eval") => eval::run(argv.collect()),
        Some("demo-target") => demo_target::run(argv.collect()),
        Some("kernels") => kernels::run(argv.collect()),
        Some("gpu-bundle") => gpu_bundle::run(argv.collect()),
        Some("gpu-conformance") => gpu_conformance::run(argv.collect()),
        Some("bench") => bench::run(argv.collect()),
        Some("-h" | "--help") | None => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some(other) => Err(format!("unknown command `{other}`\n\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}
