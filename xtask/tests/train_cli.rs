//! `cargo xtask train` end to end through the binary: a short run trains and saves a drafter;
//! bad options fail with a clear message instead of a panic.

use std::process::Command;

fn xtask(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_xtask")).args(args).output().expect("run xtask")
}

/// A few steps on a small data set print the loss table and the evaluation, and save an HF
/// drafter that loads back.
#[test]
fn short_training_run_saves_a_loadable_drafter() {
    let out = tempfile::tempdir().expect("temp dir");
    let dir = out.path().join("drafter");
    let result = xtask(&["train", "--steps", "6", "--rows", "2", "--anchors", "4", "--out", dir.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&result.stdout);
    assert!(result.status.success(), "stdout:\n{stdout}\nstderr:\n{}", String::from_utf8_lossy(&result.stderr));
    for expected in [
        "training (reference step) 6 steps",
        "loss:",
        "held-out loss",
        "tau (greedy speculative decoding",
        "saved the drafter",
    ] {
        assert!(stdout.contains(expected), "`{expected}` missing from:\n{stdout}");
    }
    let drafter = dflash_reference::drafter::Drafter::load(&dir, candle_core::DType::F32).expect("load saved drafter");
    assert_eq!(drafter.config.block_size, 8);
}

/// Unknown options, missing values and unparsable numbers are reported by name.
#[test]
fn bad_options_are_named() {
    for (args, expected) in [
        (vec!["train", "--stpes", "3"], "unknown option `--stpes`"),
        (vec!["train", "--steps"], "option `--steps` needs a value"),
        (vec!["train", "--lr", "fast"], "option `--lr`: cannot parse `fast`"),
        (vec!["train", "--steps", "0"], "must be at least 1"),
        (vec!["frobnicate"], "unknown command `frobnicate`"),
        (vec!["train", "--step", "fast"], "unknown step `fast`"),
    ] {
        let result = xtask(&args);
        let stderr = String::from_utf8_lossy(&result.stderr);
        assert!(!result.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(expected), "{args:?}: `{expected}` missing from stderr:\n{stderr}");
        assert!(!stderr.contains("panicked"), "{args:?} panicked:\n{stderr}");
    }
}
