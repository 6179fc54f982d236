//! `cargo xtask bench gemm` through the binary: a bad `--algos` or `--iters` is refused naming
//! the option before the GPU is opened.

use std::process::Command;

fn bench_gemm(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["bench", "gemm", "--commit", "test"])
        .args(args)
        .output()
        .expect("run xtask");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn bad_values_are_refused_before_the_gpu_is_opened() {
    for (args, needle) in [
        (&["--algos", "many"][..], "option `--algos`: cannot parse `many`"),
        (&["--algos", "-1"][..], "option `--algos`: cannot parse `-1`"),
        (&["--algos", "65"][..], "option `--algos`: 65; at most 64"),
        (&["--iters", "0"][..], "option `--iters`: 0; at least 1"),
    ] {
        let (ok, err) = bench_gemm(args);
        assert!(!ok, "{args:?} was accepted");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("no CUDA GPU"), "{args:?}: the GPU was asked for first: {err}");
    }
}
