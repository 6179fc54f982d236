//! `cargo xtask kernels` through the binary: arguments it does not take, and a CUDA_HOME without
//! the compiler's tools, end with a clear error before any kernel is compiled.

use std::process::Command;

fn kernels(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_xtask"));
    cmd.arg("kernels").args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run xtask");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn arguments_it_does_not_take_are_errors_naming_them() {
    for (args, needle) in [
        (&["--foo", "1"][..], "unknown option `--foo` (this command takes none)"),
        (&["extra"][..], "unexpected argument `extra`"),
    ] {
        let (ok, err) = kernels(args, &[]);
        assert!(!ok, "{args:?} was accepted");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("compiles with NVRTC"), "{args:?}: work began: {err}");
    }
}

/// A CUDA_HOME without the compiler's tools: the command fails naming what is missing (NVRTC
/// where the machine has none, else ptxas) before compiling anything, so CI's check cannot pass
/// without having run.
#[test]
fn without_its_tools_it_fails_naming_the_missing_one() {
    let empty = tempfile::tempdir().expect("temp dir");
    let dir = empty.path().to_str().expect("utf-8 temp dir");
    let (ok, err) = kernels(&[], &[("CUDA_HOME", dir)]);
    assert!(!ok, "passed without the tools: {err}");
    let ptxas = format!("{dir}/bin/ptxas is missing");
    assert!(err.contains("no NVRTC library") || err.contains(&ptxas), "{err}");
    assert!(!err.contains("compiles with NVRTC"), "work began: {err}");
}
