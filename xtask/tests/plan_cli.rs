//! `cargo xtask plan` through the binary: absurd configs and shapes end with a clear error naming
//! the field, never a panic or a wrapped size (this binary is built with overflow checks; the
//! release build runs the same checked arithmetic).

use std::process::Command;

use dflash_optimized::memory::named::named_configs;

fn plan(config: &std::path::Path, seq: &str, anchors: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["plan", "--config", config.to_str().unwrap(), "--seq", seq, "--anchors", anchors])
        .output()
        .expect("run xtask")
}

#[test]
fn absurd_configs_are_clear_errors() {
    let dir = tempfile::tempdir().expect("temp dir");
    let base = named_configs().into_iter().next().expect("named configs").config;
    let cases: [(&str, usize, usize, &str, &str, &str); 8] = [
        ("hidden 2^62", 1 << 62, 0, "3072", "512", "does not fit"),
        ("hidden 1e9", 1_000_000_000, 0, "3072", "512", "does not fit"),
        ("vocab 2^40", 0, 1 << 40, "3072", "512", "vocab_size"),
        ("seq 2^64-1", 0, 0, "18446744073709551615", "512", "does not fit"),
        ("anchors above seq", 0, 0, "80", "1000", "anchors"),
        ("seq 0", 0, 0, "0", "512", "seq"),
        ("seq 1", 0, 0, "1", "1", "a row needs at least 2"),
        ("anchors equal to seq", 0, 0, "512", "512", "a row of 512 tokens holds at most 511 anchors"),
    ];
    for (name, hidden, vocab, seq, anchors, needle) in cases {
        let mut config = base.clone();
        if hidden > 0 {
            config.dims.hidden_size = hidden;
        }
        if vocab > 0 {
            config.dims.vocab_size = vocab;
        }
        let file = dir.path().join(format!("{}.json", name.replace(' ', "_")));
        config.save(&file, candle_core::DType::BF16).expect("save config");
        let out = plan(&file, seq, anchors);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: plan succeeded:\n{}", String::from_utf8_lossy(&out.stdout));
        assert!(
            stderr.contains(needle) && !stderr.contains("panicked"),
            "{name}: `{needle}` missing or a panic:\n{stderr}"
        );
    }
    // A sane config still plans.
    let file = dir.path().join("sane.json");
    base.save(&file, candle_core::DType::BF16).expect("save config");
    let out = plan(&file, "3072", "512");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("predicted peak"));
}

/// `plan --target` plans a target folder next to its drafter; a missing folder, and `bench
/// target`'s, `bench train`'s, `bench eval`'s, `bench hybrid`'s and `gpu-conformance`'s bad values, are clear errors
/// before any work (no GPU needed to see them).
#[test]
fn plan_target_and_bench_target_options() {
    let xtask = env!("CARGO_BIN_EXE_xtask");
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/target-qwen3");
    let out = std::process::Command::new(xtask)
        .args(["plan", "--target", fixture.to_str().unwrap(), "--seq", "64", "--anchors", "8"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("target LM head") && stdout.contains("target + drafter step"), "{stdout}");
    assert!(stdout.contains("topology: one GPU holds both"), "{stdout}");
    // --config's drafter is planned against the target (read, not ignored: this one does not
    // fit it), and rows beyond the target's positions are refused as `train` refuses them.
    let drafter = fixture.join("../drafter/config.json");
    let refused: [(&[&str], &str); 2] = [
        (
            &["--config", drafter.to_str().unwrap(), "--seq", "64"],
            "option `--config`: the drafter does not fit the target",
        ),
        (&["--seq", "100000"], "option `--seq`: rows of 100000 tokens exceed the target's 128 positions"),
    ];
    for (extra, needle) in refused {
        let out = std::process::Command::new(xtask)
            .args(["plan", "--target", fixture.to_str().unwrap(), "--anchors", "8"])
            .args(extra)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(needle), "{extra:?}: `{needle}` missing from: {stderr}");
    }
    // Options the chosen plan would not read are refused, not ignored.
    let ignored: [(&[&str], &str); 3] = [
        (&["--seq", "8192"], "option `--seq` needs --config or --target"),
        (&["--anchors", "1024"], "option `--anchors` needs --config or --target"),
        (
            &["--target", fixture.to_str().unwrap(), "--chunk-rows", "64"],
            "option `--chunk-rows` is not used with --target",
        ),
    ];
    for (extra, needle) in ignored {
        let out = std::process::Command::new(xtask).arg("plan").args(extra).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(needle), "{extra:?}: `{needle}` missing from: {stderr}");
    }
    // A small Qwen3.5 hybrid (heads of 128 for its drafter): its layers itemised next to its drafter.
    let tmp = tempfile::tempdir().unwrap();
    let hybrid = tmp.path().join("hybrid");
    std::fs::create_dir_all(&hybrid).unwrap();
    let config = serde_json::json!({
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 8, "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "head_dim": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        "attn_output_gate": true, "vocab_size": 1024, "tie_word_embeddings": false,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    });
    std::fs::write(hybrid.join("config.json"), config.to_string()).unwrap();
    // `plan --target DIR --seq S --anchors N`: its stdout, after it succeeded.
    let plan_target = |dir: &std::path::Path, seq: &str, anchors: &str| {
        let out = std::process::Command::new(xtask)
            .args(["plan", "--target", dir.to_str().unwrap(), "--seq", seq, "--anchors", anchors])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let stdout = plan_target(&hybrid, "256", "16");
    for needle in ["hybrid target", "GatedDeltaNet scratch", "gated attention weights", "fits", "topology: one GPU"] {
        assert!(stdout.contains(needle), "no `{needle}` in {stdout}");
    }
    // The 27B hybrid at S=262144, N=32768: its drafter's step alone does not fit one GPU, so no
    // topology is offered but shorter rows.
    let big = tmp.path().join("27b");
    std::fs::create_dir_all(&big).unwrap();
    let config = dflash_optimized::memory::named::qwen3_5_27b_target().to_value();
    std::fs::write(big.join("config.json"), config.to_string()).unwrap();
    let stdout = plan_target(&big, "262144", "32768");
    assert!(
        stdout.contains("topology: the drafter's step alone") && stdout.contains("shorter rows or fewer anchors"),
        "{stdout}"
    );
    let cases: [(&[&str], &str); 31] = [
        (&["plan", "--target", "no-such-target"], "no-such-target/config.json"),
        (&["bench", "target", "--seqs", "3072,0"], "option `--seqs`"),
        (&["bench", "target", "--seqs", "many"], "`many` is not a token count"),
        (&["bench", "target", "--iters", "0"], "--iters must be at least 1"),
        (&["bench", "target", "--torch", "maybe"], "option `--torch`"),
        (&["bench", "train", "--shapes", "3072"], "`3072` is not SxN"),
        (&["bench", "train", "--shapes", "768x768"], "768 anchors do not fit rows of 768 tokens"),
        (&["bench", "train", "--shapes", "768x0"], "0 anchors do not fit"),
        (&["bench", "train", "--iters", "0"], "--iters must be at least 1"),
        (&["bench", "train", "--torch", "maybe"], "option `--torch`"),
        (&["bench", "train", "--profile", "maybe"], "option `--profile`"),
        (&["bench", "train", "--checkpointing", "some"], "`some` is not none, selective or per-layer"),
        (&["bench", "eval", "--new-tokens", "0"], "--new-tokens"),
        (&["bench", "eval", "--prompt-tokens", "0"], "--prompt-tokens"),
        (&["bench", "eval", "--iters", "0"], "--iters"),
        (&["bench", "eval", "--torch", "maybe"], "option `--torch`"),
        (&["bench", "eval", "--random-drafter", "maybe"], "option `--random-drafter`"),
        (&["bench", "eval", "--profile", "maybe"], "option `--profile`"),
        (&["bench", "eval", "--seed", "x"], "--seed"),
        (&["bench", "hybrid", "--layers", "0"], "--layers 0: between 1 and 64"),
        (&["bench", "hybrid", "--layers", "65"], "--layers 65: between 1 and 64"),
        (&["bench", "hybrid", "--seq", "0"], "--seq and --iters must be at least 1"),
        (&["bench", "hybrid", "--layer-ids", "1,x"], "`x` is not a layer"),
        (&["bench", "hybrid", "--fla", "/no/such/site"], "no `fla` package there"),
        (&["bench", "hybrid", "--iters", "0"], "--seq and --iters must be at least 1"),
        (&["bench", "hybrid", "--warmup", "x"], "--warmup"),
        (&["bench", "hybrid", "--torch", "maybe"], "option `--torch`"),
        (&["bench", "hybrid", "--accuracy", "maybe"], "option `--accuracy`"),
        (&["bench", "hybrid", "--profile", "maybe"], "option `--profile`"),
        (&["bench", "hybrid", "--hf-lm-head", "maybe"], "option `--hf-lm-head`: `maybe`; yes or no expected"),
        (&["gpu-conformance", "--only", "decoding,bogus"], "option `--only`: `bogus` is not a group"),
    ];
    for (args, needle) in cases {
        let out = std::process::Command::new(xtask).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(needle), "{args:?}: `{needle}` missing from: {stderr}");
    }
}
