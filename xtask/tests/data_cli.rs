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
    // One document per row: the efficiency counts each row padded to --max-len, as training
    // pads it (documents + padding = rows x S), not the documents alone.
    let efficiency = |stdout: &str| -> (f64, usize, usize) {
        let line = stdout.lines().find(|l| l.starts_with("packing efficiency")).expect("efficiency line");
        let pct: f64 = line.split_whitespace().nth(2).unwrap().trim_end_matches('%').parse().unwrap();
        let rows = stdout.lines().find(|l| l.starts_with("rows (")).expect("rows line");
        let number = |after: &str| -> usize {
            let rest = &rows[rows.find(after).unwrap() + after.len()..];
            rest.trim_start().split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
        };
        (pct, number("):"), number("documents,"))
    };
    let unpacked = data(
        &["--target", &target, "--data", &convs, "--packing", "no", "--max-len", "512", "--show", "0"],
        cache.path(),
    );
    let stdout = String::from_utf8_lossy(&unpacked.stdout).into_owned();
    assert!(unpacked.status.success(), "{}", String::from_utf8_lossy(&unpacked.stderr));
    let (pct, rows, tokens) = efficiency(&stdout);
    let want = 100.0 * tokens as f64 / (rows * 512) as f64;
    assert!((pct - want).abs() < 0.06 && pct < 100.0, "{pct}% printed, {want:.2}% of {rows} rows x 512:\n{stdout}");
    let bad: [(&[&str], &str); 8] = [
        (&["--target", &target], "--data FILE... is required"),
        (&["--target", &target, "--data", &convs, "--held-out", &convs], "is also a --data file"),
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
    // Rows longer than a target's positions (its config.json), as `train` refuses them.
    let folder = cache.path().join("target");
    dflash_conformance::target_cases::write_target_folder(&folder, 2).unwrap();
    let out = data(&["--target", folder.to_str().unwrap(), "--data", &convs, "--max-len", "100000"], cache.path());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("rows of 100000 tokens exceed the target's 4096 positions"),
        "{stderr}"
    );
}
