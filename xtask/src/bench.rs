//! `cargo xtask bench <name>`: the benchmarks, each in its own file, each measured against its
//! baseline in the same run and written to `results/*.json` (the GPU ones on the H200).

const HELP: &str = "usage: xtask bench <benchmark> [options]

benchmarks:
  attention   our attention vs PyTorch flex_attention and SDPA         (results/attention-h200.json)
  gemm        the cuBLAS bf16 linear: checked against the CPU, timed; decoding's linear layers
              (cuBLAS, linear_rows) in GB/s                            (results/gemm-h200.json)
  step        the GPU training step per policy vs PyTorch, MFU, peaks  (results/step-h200.json)
  target      the target forward (features) vs transformers, 8B shape (results/target-h200.json)
  hybrid      the hybrid target forward vs transformers (fla and torch), 27B layer shapes
                                                                       (results/target-hybrid-h200.json)
  eval        batch-1 decoding, plain and speculative, vs transformers generate (results/eval-h200.json)
  train       training end to end (target + step + AdamW) vs PyTorch   (results/train-h200.json)
  data        (this machine) render + tokenize + mask + pack vs Python  (results/data-cpu.json)

run `xtask bench <benchmark> --help` for its options";

pub fn run(args: Vec<String>) -> Result<(), String> {
    let mut args = args.into_iter();
    match args.next().as_deref() {
        Some("attention") => crate::bench_attention::run(args.collect()),
        Some("gemm") => crate::bench_gemm::run(args.collect()),
        Some("step") => crate::bench_step::run(args.collect()),
        Some("target") => crate::bench_target::run(args.collect()),
        Some("hybrid") => crate::bench_hybrid::run(args.collect()),
        Some("eval") => crate::bench_eval::run(args.collect()),
        Some("train") => crate::bench_train::run(args.collect()),
        Some("data") => crate::bench_data::run(args.collect()),
        Some("-h" | "--help") | None => {
            println!("{HELP}");
            Ok(())
        }
        Some(other) => Err(format!("unknown benchmark `{other}`\n\n{HELP}")),
    }
}

/// This machine's CPU model and core count (what host-bound timings follow).
pub fn host_machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name").map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned()))
        })
        .unwrap_or_else(|| "unknown CPU".into());
    format!("{cpu}, {} cores", std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Runs `run` once with the GPU profile on and prints its operations as `what`
/// ([`print_profile`]).
pub fn profile_once<T>(what: &str, run: impl FnOnce() -> dflash_optimized::Result<T>) -> Result<(), String> {
    use dflash_optimized::device::profile;
    profile::enable(true);
    let result = run();
    profile::enable(false);
    result.map_err(|e| e.to_string())?;
    print_profile(what, &profile::report().map_err(|e| e.to_string())?);
    Ok(())
}

/// Profiled operations by total GPU time, the longest first (`device::profile::report`), with
/// totals per kind: what `what` spent; and the GPU time from the first operation's start to the
/// last one's end, whose excess over the operations' sum the GPU spent idle between them.
pub fn print_profile(what: &str, report: &dflash_optimized::device::profile::Report) {
    let ops = &report.ops;
    let total: f64 = ops.iter().map(|o| o.1).sum();
    println!(
        "profile of {what}: {total:.2} ms in {} operations; {:.2} ms from the first start to the last end",
        ops.iter().map(|o| o.2).sum::<usize>(),
        report.span_ms
    );
    // Matmuls: cuBLAS's and the decoding kernel's (`linear_rows`).
    let kind_of = |name: &str| match name {
        n if n.starts_with("gemm") || n.starts_with("linear_rows") => "matmul",
        n if n.starts_with("attention") => "attention",
        _ => "other",
    };
    for kind in ["matmul", "attention", "other"] {
        let ms: f64 = ops.iter().filter(|o| kind_of(&o.0) == kind).map(|o| o.1).sum();
        println!("  {kind:<12} {ms:>8.2} ms");
    }
    for (name, ms, count) in ops.iter().take(40) {
        println!("  {ms:>8.3} ms {count:>4}x  {name}");
    }
}
