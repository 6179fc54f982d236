//! `cargo xtask data` through the binary: the fixture's conversations give statistics and sample
//! rows; every bad option or file is a clear error before any work, never a panic.

use std::path::Path;
use std::process::Command;

fn fixture(path: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path).to_string_lossy().into_owned()
}

fn data(args: &[&str], cache: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
        .arg("data")
        .args(args)
        .args(["--cache", cache.to_str().unwrap()])
        .output()
        .expect("run xtask")
}

#[test]
fn the_fixture_prepares_and_bad_input_is_refused() {
    let cache = tempfile::tempdir().expect("temp dir");
    let (target, convs) = (fixture("fixtures/data/tokenizer-qwen"), fixture("fixtures/data/conversations.jsonl"));
    let out = data(&["--target", &target, "--data", &convs, "--show", "1"], cache.path());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for needle in ["conversations:      50", "supervised tokens", "packing efficiency", "── row 0"] {
        assert!(stdout.contains(needle), "`{needle}` missing from:\n{stdout}");
    }
    let bad: [(&[&str], &str); 7] = [
        (&["--target", &target], "--data FILE... is required"),
        (&["--target", &target, "--data", "no-such.jsonl"], "no-such.jsonl"),
        (&["--target", "no-such-target", "--data", &convs], "no-such-target/tokenizer.json"),
        (&["--target", &target, "--data", &convs, "--max-len", "1"], "max_len"),
        (&["--target", &target, "--data", &convs, "--held-out", "1.5"], "held_out"),
        (&["--target", &target, "--data", &convs, "--packing", "maybe"], "--packing"),
        (&["--target", &target, "--data", &convs, "--bogus", "1"], "unknown option `--bogus`"),
    ];
    for (args, needle) in bad {
        let out = data(args, cache.path());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(needle) && !stderr.contains("panicked"), "{args:?}: `{needle}` missing:\n{stderr}");
    }
}
