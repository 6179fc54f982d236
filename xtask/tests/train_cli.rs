//! `cargo xtask train` end to end through the binary: a short run trains and saves a drafter
//! and its run folder; bad options and configs fail with a clear message naming the option
//! before any work; a run killed at random moments (also while writing a checkpoint) and
//! resumed gives bitwise the losses of an uninterrupted run.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dflash_conformance::cli_args;
use dflash_conformance::hybrid_cases::write_hybrid_target_folder;
use dflash_conformance::target_cases::{copy_target_folder, write_target_folder};
use dflash_conformance::tolerance::{GPU_STEP_BF16, STEP_F32};
use rand::Rng;

fn xtask(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_xtask")).args(args).output().expect("run xtask")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Options of a run of a few seconds: 4 rows of 4 + 12 tokens, 2 rows x 3 anchors per step.
const TINY: &[&str] = &[
    "--rows",
    "4",
    "--prompt-len",
    "4",
    "--continuation-len",
    "12",
    "--rows-per-step",
    "2",
    "--anchors",
    "3",
    "--eval-rows",
    "1",
    "--tau-prompts",
    "1",
    "--tau-tokens",
    "4",
    "--log-every",
    "1",
    "--eval-every",
    "0",
];

/// A few steps print the loss table and the evaluation, and leave the run folder: checkpoints,
/// latest, metrics.jsonl, training.svg and a servable drafter that loads back. A fresh run
/// replaces a finished run or a dead one's remains, never an unfinished run nor a folder a live
/// run holds.
#[test]
fn short_training_run_saves_a_loadable_drafter() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path().join("run");
    let mut args = vec!["train", "--steps", "6", "--checkpoint-every", "4", "--out", dir.to_str().unwrap()];
    args.extend(TINY);
    let result = xtask(&args);
    let stdout = text(&result.stdout);
    assert!(result.status.success(), "stdout:\n{stdout}\nstderr:\n{}", text(&result.stderr));
    for expected in [
        "training (reference step) 6 steps",
        "loss:",
        "held-out loss",
        "held-out tau_hat",
        "tau (greedy speculative decoding",
        "saved the drafter",
    ] {
        assert!(stdout.contains(expected), "`{expected}` missing from:\n{stdout}");
    }
    for drafter_dir in [dir.join("drafter"), dir.join("checkpoint-6"), dir.join("checkpoint-4")] {
        let drafter = dflash_reference::drafter::Drafter::load(&drafter_dir, candle_core::DType::F32)
            .unwrap_or_else(|e| panic!("{}: {e}", drafter_dir.display()));
        assert_eq!(drafter.config.block_size, 8);
    }
    assert_eq!(std::fs::read_to_string(dir.join("latest")).unwrap().trim(), "checkpoint-6");
    let svg = std::fs::read_to_string(dir.join("training.svg")).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("tau_hat") && svg.contains("<polyline"),
        "{}",
        &svg[..200.min(svg.len())]
    );
    let lines = metrics(&dir);
    let train: Vec<_> = lines.iter().filter(|v| v["kind"] == "train").collect();
    assert_eq!(train.len(), 6);
    for v in &train {
        assert_eq!(v["acc"].as_array().unwrap().len(), 7, "acc_1..acc_7");
        let tau = v["tau_hat"].as_f64().unwrap();
        assert!((1.0..=8.0).contains(&tau), "{tau}");
        for key in ["lr", "grad_norm", "tokens_per_s", "samples_per_s", "epoch"] {
            assert!(v[key].as_f64().is_some_and(f64::is_finite), "{key} in {v}");
        }
    }
    assert!(lines.iter().any(|v| v["kind"] == "eval" && v["tau_hat"].as_f64().is_some()));
    // A fresh run replaces a finished run in its folder (the same losses again) ...
    let first = losses(&dir);
    let again = xtask(&args);
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert!(text(&again.stdout).contains("held a finished run of 6 steps: replaced"), "{}", text(&again.stdout));
    assert_eq!(losses(&dir), first);
    // ... and refuses an unfinished one (the newest complete checkpoint before the last step).
    std::fs::remove_dir_all(dir.join("checkpoint-6")).unwrap();
    let refused = xtask(&args);
    assert!(!refused.status.success());
    let stderr = text(&refused.stderr);
    assert!(stderr.contains("unfinished run") && stderr.contains("--resume"), "{stderr}");
    assert!(dir.join("checkpoint-4/state.json").exists(), "nothing of the unfinished run is deleted");
    // A folder in `latest`'s place does not make the unfinished run replaceable.
    std::fs::remove_file(dir.join("latest")).unwrap();
    std::fs::create_dir(dir.join("latest")).unwrap();
    let refused = xtask(&args);
    let stderr = text(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("`latest` is a folder"), "{stderr}");
    assert!(dir.join("checkpoint-4/state.json").exists(), "nothing of the unfinished run is deleted");
    std::fs::remove_dir(dir.join("latest")).unwrap();
    std::fs::write(dir.join("latest"), "checkpoint-6\n").unwrap();
    // With no complete checkpoint left (`latest` naming a lost one), nothing can be resumed: the
    // resume says so and how to go on, and a fresh run replaces the remains.
    for (_, checkpoint) in dflash_trainer::checkpoint::list_checkpoints(&dir).unwrap() {
        std::fs::remove_dir_all(checkpoint).unwrap();
    }
    let resumed = xtask(&["train", "--resume", dir.to_str().unwrap()]);
    let stderr = text(&resumed.stderr);
    assert!(
        !resumed.status.success() && stderr.contains("no complete checkpoint") && stderr.contains("fresh run"),
        "{stderr}"
    );
    // A folder that does not exist (a typo, or a rank on a machine without rank 0's folder).
    let missing = tmp.path().join("no-such-run");
    let resumed = xtask(&["train", "--resume", missing.to_str().unwrap()]);
    let stderr = text(&resumed.stderr);
    assert!(!resumed.status.success() && stderr.contains("no such folder") && stderr.contains("share"), "{stderr}");
    let fresh = xtask(&args);
    assert!(fresh.status.success(), "{}", text(&fresh.stderr));
    assert!(
        text(&fresh.stdout).contains("held the remains of a run with no complete checkpoint"),
        "{}",
        text(&fresh.stdout)
    );
    assert_eq!(losses(&dir), first);
    // A folder another live run holds (its lock taken here) is refused, naming the holder, and
    // nothing of it is touched.
    let lock = std::fs::OpenOptions::new().write(true).open(dir.join(".lock")).unwrap();
    lock.try_lock().unwrap();
    std::fs::write(dir.join(".lock"), "process 4242 on elsewhere").unwrap();
    let busy = xtask(&args);
    let stderr = text(&busy.stderr);
    assert!(!busy.status.success() && stderr.contains("in use by another run (process 4242 on elsewhere)"), "{stderr}");
    assert_eq!(losses(&dir), first);
    drop(lock);
    // A run killed while writing its first checkpoint left only that temporary: a fresh run
    // removes it.
    let leftover = tmp.path().join("leftover");
    std::fs::create_dir_all(leftover.join(".checkpoint-9.tmp")).unwrap();
    std::fs::write(leftover.join(".checkpoint-9.tmp/training.safetensors"), "half").unwrap();
    let mut fresh_args = vec!["train"];
    fresh_args.extend(TINY);
    fresh_args.extend(["--steps", "2", "--out", leftover.to_str().unwrap()]);
    let result = xtask(&fresh_args);
    assert!(result.status.success(), "{}", text(&result.stderr));
    assert!(!leftover.join(".checkpoint-9.tmp").exists(), "the dead run's temporary is removed");
    // `--tau-prompts 0` (the help's "0: none"): trained without the real tau, reported as none.
    let no_tau = tmp.path().join("no-tau");
    let args = cli_args(
        &[&["train"], TINY].concat(),
        &["--steps", "2", "--tau-prompts", "0", "--out", no_tau.to_str().unwrap()],
    );
    let result = xtask(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(result.status.success(), "{}", text(&result.stderr));
    assert!(!text(&result.stdout).contains("greedy speculative decoding"), "{}", text(&result.stdout));
    assert!(metrics(&no_tau).iter().filter(|v| v["kind"] == "eval").all(|v| v["tau"].is_null()));
    // The host step takes --checkpointing (read, not ignored), with the same losses each way.
    let policy_losses = |policy: &str| {
        let out = tmp.path().join(format!("host-{policy}"));
        let mut args = vec!["train"];
        args.extend(TINY);
        args.extend(["--steps", "3", "--step", "host", "--checkpointing", policy, "--out", out.to_str().unwrap()]);
        let result = xtask(&args);
        assert!(result.status.success(), "{}", text(&result.stderr));
        assert!(text(&result.stdout).contains(&format!("checkpointing: {policy}")), "{}", text(&result.stdout));
        losses(&out)
    };
    assert_eq!(policy_losses("none"), policy_losses("per-layer"));
}

fn metrics(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

/// Unknown options, missing values, unparsable numbers and every out-of-range value are
/// reported by name, before any work: nothing is written in the run folder.
#[test]
fn bad_options_are_named_before_any_work() {
    let tmp = tempfile::tempdir().unwrap();
    let a_file = tmp.path().join("a-file");
    std::fs::write(&a_file, "x").unwrap();
    let under_file = a_file.join("run");
    let bad_toml = tmp.path().join("bad.toml");
    let line = rand::rng().random_range(2..5);
    std::fs::write(&bad_toml, format!("steps = 3\n{}warmup = 0.1\n", "\n".repeat(line - 2))).unwrap();
    let out = tmp.path().join("run");
    let out_s = out.to_str().unwrap();
    let bad_toml_s = bad_toml.to_str().unwrap();
    let cases: Vec<(Vec<&str>, String)> = vec![
        (vec!["--stpes", "3"], "unknown option `--stpes`".into()),
        (vec!["--lr", "6e-4", "--lr", "6e-3"], "option `--lr` given twice".into()),
        (vec!["--max-len", "64", "--max_len", "96"], "option `--max_len` given twice".into()),
        (vec!["--config", bad_toml_s, "--config", bad_toml_s], "option `--config` given twice".into()),
        (vec!["--steps"], "option `--steps` needs a value".into()),
        (vec!["--lr", "fast"], "option `--lr`: cannot parse `fast`".into()),
        (vec!["--steps", "0"], "option `steps`: 0: must be at least 1".into()),
        (vec!["--tau-tokens", "100000"], "option `tau_tokens`: 100000: prompts of 16 tokens".into()),
        (vec!["--tau-tokens", "1"], "option `tau_tokens`: 1: must be at least 2".into()),
        (vec!["--step", "fast"], "unknown step `fast`".into()),
        (vec!["--step", "gpu"], "`gpu` needs `builtin_target = gpu`".into()),
        (vec!["--builtin-target", "huge"], "unknown target `huge`".into()),
        (vec!["--checkpointing", "some"], "unknown policy `some` (auto, none, selective or per-layer)".into()),
        (vec!["--checkpointing", "none", "--step", "reference"], "option `checkpointing`: the `reference` step".into()),
        (vec!["--tau-prompts", "9223372036854775807"], "option `tau_prompts`: 9223372036854775807: at most".into()),
        (
            vec!["--step", "host", "--drafter-workers", "5"],
            "4 rows per update for 5 drafter workers: each needs a row of every update".into(),
        ),
        (vec!["--epochs", "1000000", "--rows", "5000000"], "option `epochs`: 1000000 over 5000000 rows".into()),
        (vec!["--lr", "NaN"], "option `lr`: NaN: must be a finite number".into()),
        (vec!["--lr", "inf"], "option `lr`: inf: must be a finite number".into()),
        (vec!["--lr", "0"], "option `lr`: 0: must be above 0".into()),
        (vec!["--temperature", "-1"], "option `temperature`: -1: must be at least 0".into()),
        (vec!["--warmup-frac", "1"], "option `warmup_frac`: 1: must be in [0, 1)".into()),
        (vec!["--clip-norm", "0"], "option `clip_norm`".into()),
        (vec!["--anchors", "1000"], "option `anchors`: 1000: a row of 96 tokens holds at most 95 anchors".into()),
        (vec!["--rows", "0"], "option `rows`".into()),
        (vec!["--config", bad_toml_s], format!("line {line}")),
        (vec!["--config", bad_toml_s], "unknown field `warmup`".into()),
        (vec!["--target", "somewhere", "--data", "a.jsonl"], "somewhere: not a folder".into()),
        // A real run's option on the built-in default: refused, not ignored.
        (vec!["--max-len", "100"], "option `max_len`: applies to real runs (`--target`) only".into()),
        (vec!["--block-size", "4"], "option `block_size`: applies to real runs".into()),
        // ... also at its default value (the recipe's 16; the built-in drafter's blocks are 8).
        (vec!["--block-size", "16"], "option `block_size`: applies to real runs".into()),
    ];
    let mut all = cases;
    all.push((vec!["--out", a_file.to_str().unwrap()], "option `out`".into()));
    all.push((vec!["--out", under_file.to_str().unwrap()], "option `out`".into()));
    for (extra, expected) in &all {
        let mut args = vec!["train"];
        args.extend(extra.iter());
        if !extra.contains(&"--out") {
            args.extend(["--out", out_s]);
        }
        let started = Instant::now();
        let result = xtask(&args);
        let stderr = text(&result.stderr);
        assert!(!result.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(expected.as_str()), "{args:?}: `{expected}` missing from stderr:\n{stderr}");
        assert!(!stderr.contains("panicked"), "{args:?} panicked:\n{stderr}");
        assert!(!text(&result.stdout).contains("data: sampling"), "{args:?} started work");
        assert!(
            !out.join("metrics.jsonl").exists() && !out.join("latest").exists(),
            "{args:?} wrote into the run folder"
        );
        assert!(started.elapsed() < Duration::from_secs(10), "{args:?} took {:?}", started.elapsed());
    }
    let result = xtask(&["frobnicate"]);
    assert!(text(&result.stderr).contains("unknown command `frobnicate`"));
}

/// `--plan` prints the resolved config (a command-line value over the file's, the file's over
/// the preset's), steps, epochs, tokens and a time estimate, and trains nothing.
#[test]
fn plan_prints_the_resolved_config_without_training() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("run.toml");
    let mut rng = rand::rng();
    let (file_anchors, cli_anchors) = (rng.random_range(1..40), rng.random_range(1..40));
    // `block_size` at the recipe's value, as a built-in run's saved `run.toml` holds it: a config
    // file's real-run option at its default is accepted (on the command line it is refused).
    std::fs::write(&file, format!("anchors = {file_anchors}\nlr = 0.001\nepochs = 2\nblock_size = 16\n")).unwrap();
    let out = tmp.path().join("run");
    let plan = |extra: &[&str]| {
        let mut args = vec!["train", "--plan", "--config", file.to_str().unwrap(), "--out", out.to_str().unwrap()];
        args.extend(extra);
        let result = xtask(&args);
        assert!(result.status.success(), "{}", text(&result.stderr));
        text(&result.stdout)
    };
    let stdout = plan(&[]);
    assert!(stdout.contains(&format!("anchors = {file_anchors}\n")), "{stdout}");
    assert!(stdout.contains("lr = 0.001\n") && stdout.contains("gamma = 4.0\n"), "{stdout}");
    // 2 epochs of 64 rows at 4 rows per step.
    assert!(stdout.contains("steps = 32\n") && stdout.contains("steps: 32\nepochs: 2.00\n"), "{stdout}");
    assert!(stdout.contains(&format!("tokens: {}", 32 * 4 * 96)) && stdout.contains("estimated time"), "{stdout}");
    let stdout = plan(&["--anchors", &cli_anchors.to_string()]);
    assert!(stdout.contains(&format!("anchors = {cli_anchors}\n")), "{stdout}");
    assert!(!out.exists(), "--plan created the run folder");
    // The most steps of the most rows: counts past u64 are printed whole, not wrapped.
    let (steps, rows) = (1u128 << 40, 1u128 << 16);
    let result = xtask(&[
        "train",
        "--plan",
        "--steps",
        &steps.to_string(),
        "--rows-per-step",
        "256",
        "--grad-accum",
        "256",
        "--anchors",
        "64",
    ]);
    let stdout = text(&result.stdout);
    assert!(result.status.success(), "{}", text(&result.stderr));
    let anchors: u128 = stdout.lines().find_map(|l| l.strip_prefix("anchors = ")).and_then(|v| v.parse().ok()).unwrap();
    let tokens = format!("tokens: {} (", steps * rows * 96);
    let block_rows: u128 = stdout
        .split_once(&tokens)
        .and_then(|(_, rest)| rest.split_once(" block rows"))
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or_else(|| panic!("no `{tokens}N block rows`: {stdout}"));
    assert!(block_rows > u64::MAX as u128 && block_rows.is_multiple_of(steps * rows * anchors), "{block_rows}");
}

/// Kills the run (SIGKILL) at random moments after its first checkpoint, once while a
/// checkpoint is half-written, resumes each time, and compares every step's loss with an
/// uninterrupted run: bitwise equal, each step once in metrics.jsonl.
#[test]
fn killed_and_resumed_run_has_the_uninterrupted_losses() {
    let tmp = tempfile::tempdir().unwrap();
    let seed = rand::rng().random_range(0..1u64 << 40).to_string();
    let steps = "24";
    let run_args = |out: &Path| {
        let mut args: Vec<String> =
            ["train", "--steps", steps, "--checkpoint-every", "5", "--keep-checkpoints", "2", "--seed", &seed]
                .iter()
                .map(|s| s.to_string())
                .collect();
        args.extend(TINY.iter().map(|s| s.to_string()));
        args.extend(["--out".to_string(), out.to_str().unwrap().to_string()]);
        args
    };
    let (expected, out) = killed_and_resumed_equals_uninterrupted(tmp.path(), run_args, 24, &seed);

    // Resuming the finished run with a changed option that alters it is refused, naming it.
    let result = xtask(&["train", "--resume", out.to_str().unwrap(), "--lr", "0.01"]);
    assert!(!result.status.success());
    assert!(text(&result.stderr).contains("option `lr`"), "{}", text(&result.stderr));
    // The newest checkpoint without its marker: resumption falls back to the previous one and
    // says so, and (extended by 2 steps) recomputes the same losses up to the old end.
    std::fs::remove_file(out.join("checkpoint-24/state.json")).unwrap();
    let result = xtask(&["train", "--resume", out.to_str().unwrap(), "--steps", "26"]);
    let stdout = text(&result.stdout);
    assert!(result.status.success(), "{stdout}\n{}", text(&result.stderr));
    assert!(stdout.contains("falling back to") && stdout.contains("checkpoint-20"), "{stdout}");
    assert!(stdout.contains("`steps` changed from 24 to 26"), "{stdout}");
    // The schedule's change is said with step 20's lr under each length.
    assert!(stdout.contains("the schedule is now that of 26 steps (was 24): step 20's lr"), "{stdout}");
    let extended = losses(&out);
    assert_eq!(extended.len(), 26);
    // Step 20's loss is taken before its update, with the weights of the old schedule.
    assert_eq!(&extended[..21], &expected[..21], "the steps before the checkpoint are kept as they were");
}

/// Runs `run_args(out)` uninterrupted, then again killed (SIGKILL) at random moments after its
/// first checkpoint, once while a checkpoint is half-written, resuming each time; asserts that
/// every one of the `steps` losses is bitwise the uninterrupted run's, each step once in
/// metrics.jsonl. Returns the uninterrupted losses and the killed run's folder.
fn killed_and_resumed_equals_uninterrupted(
    tmp: &Path,
    run_args: impl Fn(&Path) -> Vec<String>,
    steps: usize,
    seed: &str,
) -> (Vec<(u64, u64)>, std::path::PathBuf) {
    let whole = tmp.join("whole");
    let result = Command::new(env!("CARGO_BIN_EXE_xtask")).args(run_args(&whole)).output().unwrap();
    assert!(result.status.success(), "{}", text(&result.stderr));
    let expected = losses(&whole);
    assert_eq!(expected.len(), steps);

    let out = tmp.join("killed");
    let mut kills = 0;
    let mut mid_checkpoint_kill = false;
    let (mut attempt, mut spawns) = (0, 0);
    loop {
        attempt += 1;
        spawns += 1;
        assert!(spawns < 60, "the run was never killed and resumed as planned");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_xtask"));
        if attempt == 1 {
            cmd.args(run_args(&out));
        } else {
            cmd.args(["train", "--resume", out.to_str().unwrap()]);
        }
        let mut child = cmd
            .env("DFLASH_TEST_PAUSE_IN_CHECKPOINT", "25")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Wait for a complete checkpoint (and, the first time, for the next one to be under way).
        let started = Instant::now();
        let deadline = Duration::from_secs(60);
        let want_kill = kills < 3 || !mid_checkpoint_kill;
        let wait_for_tmp = !mid_checkpoint_kill && kills >= 1;
        let delay = Duration::from_millis(rand::rng().random_range(0..400));
        let mut seen_at: Option<Instant> = None;
        let finished = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            assert!(started.elapsed() < deadline, "attempt {attempt} hangs");
            let ready = out.join("latest").exists() && (!wait_for_tmp || has_tmp(&out));
            if ready && seen_at.is_none() {
                seen_at = Some(Instant::now());
            }
            if want_kill && seen_at.is_some_and(|t| wait_for_tmp || t.elapsed() >= delay) {
                break None;
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        match finished {
            Some(status) => {
                let output = child.wait_with_output().unwrap();
                assert!(status.success(), "attempt {attempt}:\n{}\n{}", text(&output.stdout), text(&output.stderr));
                if !want_kill {
                    break;
                }
                // Finished before it could be killed enough: start over with a fresh run.
                std::fs::remove_dir_all(&out).unwrap();
                (kills, mid_checkpoint_kill, attempt) = (0, false, 0);
            }
            None => {
                let _ = child.kill();
                child.wait().unwrap();
                // Killed while a checkpoint was being written (unless its rename won the race).
                mid_checkpoint_kill |= wait_for_tmp && has_tmp(&out);
                kills += 1;
            }
        }
    }
    eprintln!("killed {kills} times (one while a checkpoint was being written); {spawns} processes in all");
    let got = losses(&out);
    assert_eq!(got.len(), steps, "each step once in metrics.jsonl: {:?}", got.iter().map(|g| g.0).collect::<Vec<_>>());
    for ((s1, l1), (s2, l2)) in expected.iter().zip(&got) {
        assert_eq!(s1, s2);
        assert_eq!(l1, l2, "step {s1}: {} vs {} (seed {seed})", f64::from_bits(*l1), f64::from_bits(*l2));
    }
    assert!(!has_tmp(&out), "a leftover temporary checkpoint");

    (expected, out)
}

fn has_tmp(out: &Path) -> bool {
    std::fs::read_dir(out)
        .map(|d| {
            d.filter_map(|e| e.ok()).any(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.starts_with(".checkpoint-") && name.ends_with(".tmp")
            })
        })
        .unwrap_or(false)
}

/// `(step, loss bits)` of the train lines of `out/metrics.jsonl`, exactly as written (the
/// number's text parsed by Rust's correctly rounded parser).
fn losses(out: &Path) -> Vec<(u64, u64)> {
    dflash_trainer::metrics::train_losses(&out.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .map(|(s, l)| (s, l.to_bits()))
        .collect()
}

/// A real run's options on the CPU twins: the fixture conversations through a small random
/// Qwen3 target folder ([`write_target_folder`]), rows of 256 tokens, 8 anchors.
fn real_args(target: &Path, cache: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let args: Vec<String> = ["train", "--target", target.to_str().unwrap()]
        .into_iter()
        .chain(["--data", repo("fixtures/data/conversations.jsonl").to_str().unwrap()])
        .chain(["--data-cache", cache.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .chain(["--max-len", "256", "--anchors", "8", "--target-layer-ids", "0,1", "--held-out", "0.2"])
        .chain(["--lr", "3e-3", "--log-every", "1", "--eval-rows", "2", "--eval-every", "4"])
        .map(String::from)
        .collect();
    cli_args(&args, extra)
}

/// A real run of `extra` (over [`real_args`]) that succeeds: its stdout.
fn run_real(target: &Path, cache: &Path, out: &Path, extra: &[&str]) -> String {
    let result = Command::new(env!("CARGO_BIN_EXE_xtask")).args(real_args(target, cache, out, extra)).output().unwrap();
    let stdout = text(&result.stdout);
    assert!(result.status.success(), "{extra:?}:\n{stdout}\n{}", text(&result.stderr));
    stdout
}

/// `xtask features` on the CPU twins: the cache of `real_args`' data and layers into `features`.
fn write_features(target: &Path, cache: &Path, features: &Path) {
    let result = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["features", "--device", "cpu", "--target", target.to_str().unwrap()])
        .args(["--data", repo("fixtures/data/conversations.jsonl").to_str().unwrap()])
        .args(["--out", features.to_str().unwrap(), "--cache", cache.to_str().unwrap()])
        .args(["--max-len", "256", "--layer-ids", "0,1", "--held-out", "0.2"])
        .output()
        .unwrap();
    assert!(result.status.success(), "{}", text(&result.stderr));
}

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

/// `(step, loss)` of the train lines.
fn loss_values(out: &Path) -> Vec<f64> {
    losses(out).into_iter().map(|(_, l)| f64::from_bits(l)).collect()
}

/// A real run end to end on the CPU: online on the twins (the target's forward feeding the
/// step in the same process), with the reference engine, and offline from a feature cache.
/// Each trains (finite losses, per-offset accuracy on logged steps, held-out lines), saves a
/// drafter that loads in the reference with the target's dims, vocab and the layers asked for;
/// the first step's loss of the online twins equals the reference's within the f32 step bound,
/// the cache's within the bf16 bound of its features.
#[test]
fn a_real_run_trains_online_offline_and_with_the_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    let seed: u64 = rand::rng().random_range(0..1 << 30);
    write_target_folder(&target, seed).unwrap();
    let cache = tmp.path().join("data-cache");
    let steps = ["--steps", "8", "--checkpoint-every", "4"];
    // --plan: the resolved config, the target and step memory on one GPU, the run's size; no training.
    let planned = tmp.path().join("planned");
    let run = |out: &Path, extra: &[&str]| run_real(&target, &cache, out, extra);
    let stdout = run(&planned, &["--plan", "--epochs", "2"]);
    for expected in ["# resolved config", "target + drafter step", "fits", "steps:", "epochs: 2.00", "estimated time"] {
        assert!(stdout.contains(expected), "--plan: no `{expected}` in\n{stdout}");
    }
    // `checkpointing = auto`: every policy planned, the fastest that fits taken.
    for expected in ["none policy", "per-layer policy", "checkpointing: none (the fastest policy whose step fits"] {
        assert!(stdout.contains(expected), "--plan: no `{expected}` in\n{stdout}");
    }
    assert!(!planned.join("metrics.jsonl").exists(), "--plan trained");
    // One row per update: AdamW reads the step's own gradients (no fp32 accumulator in the
    // plan); two processes (torchrun's variables alone) for one row per update are refused, one
    // of them having no row to step.
    let plan_with = |env: &[(&str, &str)]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_xtask"));
        c.args(real_args(&target, &cache, &planned, &["--plan", "--step", "gpu", "--rows-per-step", "1"]));
        c.envs(env.iter().copied()).output().unwrap()
    };
    let single = plan_with(&[]);
    assert!(single.status.success() && !text(&single.stdout).contains("accumulated gradients (fp32)"));
    let torchrun = [("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29999")];
    let stderr = text(&plan_with(&torchrun).stderr);
    assert!(stderr.contains("rows per update for 2 drafter workers over 2 processes"), "{stderr}");
    // With the AdamW state sharded over 2 drafter GPUs: per worker the whole accumulated
    // gradients (4 bytes per parameter) and half the masters and moments (12 / 2), against 16.
    let extra = ["--plan", "--step", "gpu", "--gpus", "0,1", "--drafter-workers", "2", "--shard-optimizer", "yes"];
    let extra = [&extra[..], &["--rows-per-step", "2"]].concat();
    let stdout = run(&planned, &extra);
    let line = stdout.lines().find(|l| l.contains("sharded over 2 drafter workers")).expect("the sharded state's line");
    let gb: Vec<f64> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    // The whole state's bytes against the largest shard's, in the same unit below 1 GB.
    assert!(gb.len() == 3 && line.matches("MB").count() == 2 && (gb[1] / gb[2] - 10.0 / 16.0).abs() < 0.01, "{line}");
    // Target workers with the `gpu` step: each GPU's target workers (a forward and 2 feature
    // slots each: one per drafter worker and one being filled), and the drafter's step with its
    // own LM head beside the target workers on its GPU (none, then one).
    for (gpus, targets, beside) in
        [("1,0", "1", "0 target worker(s) beside it"), ("1,0,0", "2", "1 target worker(s) beside it")]
    {
        let extra = ["--plan", "--step", "gpu", "--gpus", gpus, "--target-workers", targets, "--rows-per-step", "2"];
        let stdout = run(&planned, &extra);
        for expected in
            ["a target worker: ", "and 2 feature slots of", "GPU 1: 1 target worker(s)", "its own LM head", beside]
        {
            assert!(stdout.contains(expected), "--plan --gpus {gpus}: no `{expected}` in\n{stdout}");
        }
        assert!(!stdout.contains("target + drafter step"), "--plan --gpus {gpus}: no shared LM head:\n{stdout}");
    }
    let (mut first, mut stats) = (Vec::new(), Vec::new());
    for (name, step) in [("host", "host"), ("reference", "reference")] {
        let out = tmp.path().join(name);
        let mut extra = vec!["--step", step, "--tau-prompts", "2", "--tau-tokens", "6"];
        extra.extend(steps);
        let stdout = run(&out, &extra);
        for expected in ["training (", "held-out loss", "held-out tau_hat", "saved the drafter"] {
            assert!(stdout.contains(expected), "{name}: no `{expected}` in\n{stdout}");
        }
        let lines = dflash_trainer::metrics::read_lines(&out.join("metrics.jsonl")).unwrap();
        let train: Vec<_> = lines.iter().filter(|v| v["kind"] == "train").collect();
        assert_eq!(train.len(), 8, "{name}");
        assert!(train.iter().all(|v| v["loss"].as_f64().is_some_and(f64::is_finite)), "{name}");
        assert!(train.iter().all(|v| v["acc"].as_array().is_some_and(|a| a.len() == 15)), "{name}: {:?}", train[0]);
        let evals: Vec<_> = lines.iter().filter(|v| v["kind"] == "eval").collect();
        assert!(evals.len() >= 2, "{name}");
        // The real tau by speculative decoding (identical to greedy, checked) next to tau_hat.
        assert!(
            evals.iter().all(|v| v["tau"].as_f64().is_some_and(|t| (1.0..=16.0).contains(&t))),
            "{name}: {evals:?}"
        );
        assert!(stdout.contains("tau (greedy speculative decoding, 2 held-out prompts"), "{name}: {stdout}");
        let drafter = dflash_reference::drafter::Drafter::load(&out.join("drafter"), candle_core::DType::F32).unwrap();
        assert_eq!(drafter.config.target_layer_ids, vec![0, 1]);
        assert_eq!((drafter.config.dims.hidden_size, drafter.config.dims.vocab_size), (32, 768));
        assert_eq!((drafter.config.block_size, drafter.config.dims.num_layers()), (16, 5));
        first.push(loss_values(&out)[0]);
        stats.push((train[0]["acc"].clone(), train[0]["tau_hat"].clone()));
    }
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
    assert!(rel(first[0], first[1]) <= STEP_F32.rel, "online twins {} vs reference {}", first[0], first[1]);
    // The first step's predictions (the step's recorded argmax vs the reference's logits): the
    // same weights and anchors, so the same accuracy per offset and tau_hat.
    assert_eq!(stats[0], stats[1], "step 0's accuracy and tau_hat: online twins vs reference");

    // Offline: the features of every document cached, then trained from.
    let features = tmp.path().join("features");
    write_features(&target, &cache, &features);
    let out = tmp.path().join("offline");
    // --plan from the cache: the step with its own LM head, no target on the device.
    let stdout = run(&out, &["--plan", "--step", "host", "--features", features.to_str().unwrap()]);
    for expected in ["no target on the device", "its own LM head", "checkpointing: none (the fastest policy"] {
        assert!(stdout.contains(expected), "offline --plan: no `{expected}` in\n{stdout}");
    }
    assert!(!stdout.contains("target + drafter step"), "offline --plan plans no target:\n{stdout}");
    let mut extra = vec!["--step", "host", "--features", features.to_str().unwrap()];
    extra.extend(steps);
    let stdout = run(&out, &extra);
    assert!(stdout.contains("features from the cache"), "{stdout}");
    let offline = loss_values(&out)[0];
    assert!(rel(offline, first[0]) <= GPU_STEP_BF16.rel, "from the cache {offline} vs online {}", first[0]);

    // The cache against another target's config, or unfinished: refused before the data is read.
    let refused = |target: &Path, features: &Path, want: &str| {
        let mut args = real_args(target, &cache, &tmp.path().join("refused"), &["--step", "host"]);
        args.extend(["--features".to_string(), features.to_str().unwrap().to_string()]);
        let result = Command::new(env!("CARGO_BIN_EXE_xtask")).args(&args).output().unwrap();
        let stderr = text(&result.stderr);
        assert!(!result.status.success() && stderr.contains(want), "no `{want}` in {stderr}");
        assert!(!text(&result.stdout).contains("data:"), "the data was read first:\n{}", text(&result.stdout));
    };
    let edited = tmp.path().join("edited-target");
    std::fs::create_dir(&edited).unwrap();
    for entry in std::fs::read_dir(&target).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, edited.join(path.file_name().unwrap())).unwrap();
    }
    let mut config = std::fs::read_to_string(edited.join("config.json")).unwrap();
    config.push('\n');
    std::fs::write(edited.join("config.json"), config).unwrap();
    refused(&edited, &features, "provenance.target_config");
    let unfinished = tmp.path().join("unfinished");
    std::fs::create_dir(&unfinished).unwrap();
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(features.join("index.json")).unwrap()).unwrap();
    index["shards"].as_array_mut().unwrap().pop();
    std::fs::write(unfinished.join("index.json"), index.to_string()).unwrap();
    refused(&target, &unfinished, "documents written (an unfinished `cargo xtask features` run");
}

/// A real run on the CPU twins, killed at random moments and resumed, has bitwise the losses of
/// an uninterrupted one.
/// A real run with a Qwen3.5 hybrid target folder on the CPU (spec section 10): `--plan` itemises
/// the hybrid target next to its drafter's step; online on the twins (the hybrid forward feeding
/// the step in the same process), with the reference engine (the reference hybrid's features),
/// and offline from `xtask features` of the hybrid. Each trains and saves the hybrid's drafter
/// (heads of 128, sliding layers then a full one, the layers asked for); the online twins' first
/// loss equals the reference's within the f32 step bound, the cache's within the bf16 bound.
#[test]
fn a_real_run_with_a_hybrid_target_trains_online_offline_and_with_the_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("hybrid");
    write_hybrid_target_folder(&target, rand::rng().random_range(0..1 << 30)).unwrap();
    // A multi-token-prediction head in the checkpoint: left out, and said so.
    let weights = target.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &candle_core::Device::Cpu).unwrap();
    tensors.insert(
        "mtp.fc.weight".into(),
        candle_core::Tensor::ones((2, 3), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, &weights).unwrap();
    let cache = tmp.path().join("data-cache");
    let run = |out: &Path, extra: &[&str]| run_real(&target, &cache, out, extra);
    let stdout = run(&tmp.path().join("planned"), &["--plan", "--step", "host", "--tau-prompts", "1"]);
    for expected in [
        "== hybrid target",
        "2 GatedDeltaNet + 1 gated attention",
        "target + drafter step",
        "fits",
        "1 checkpoint tensors the text model does not use are left out (mtp.fc.weight)",
        "real tau decoders (1 prompts",
        "drafter step (per-layer policy: step",
        "+ real tau decoders",
    ] {
        assert!(stdout.contains(expected), "--plan: no `{expected}` in\n{stdout}");
    }
    let mut first = Vec::new();
    for step in ["host", "reference"] {
        let out = tmp.path().join(step);
        let stdout = run(&out, &["--step", step, "--steps", "4", "--tau-prompts", "1", "--tau-tokens", "4"]);
        // The real tau: the twins' cached decoders with the host step, the reference's otherwise.
        let decoders = if step == "host" { "the cached decoders on" } else { "the reference decoders" };
        for expected in ["Qwen3.5 hybrid (3 layers", "held-out tau_hat", "tau (greedy speculative decoding", decoders] {
            assert!(stdout.contains(expected), "{step}: no `{expected}` in\n{stdout}");
        }
        assert!(stdout.contains("output identical to plain greedy decoding"), "{step}:\n{stdout}");
        assert!(stdout.contains("saved the drafter"), "{step}:\n{stdout}");
        let drafter = dflash_reference::drafter::Drafter::load(&out.join("drafter"), candle_core::DType::F32).unwrap();
        let dims = &drafter.config.dims;
        assert_eq!(drafter.config.target_layer_ids, vec![0, 1]);
        assert_eq!((dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.head_dim), (128, 1, 1, 128));
        assert_eq!(dims.vocab_size, 768);
        let full = dims.layer_kinds.iter().filter(|k| **k == dflash_reference::config::AttnKind::Full).count();
        assert_eq!((dims.num_layers(), full, dims.layer_kinds[4]), (5, 1, dflash_reference::config::AttnKind::Full));
        let losses = loss_values(&out);
        assert!(losses.len() == 4 && losses.iter().all(|l| l.is_finite()), "{step}: {losses:?}");
        first.push(losses[0]);
    }
    // A target worker feeding the host step (the hybrid's forward in its own thread, features
    // through its slots): the online host run's losses bitwise.
    let fed = tmp.path().join("fed");
    run(&fed, &["--step", "host", "--steps", "4", "--target-workers", "1"]);
    assert_eq!(loss_values(&fed), loss_values(&tmp.path().join("host")), "1 target worker + 1 drafter worker");
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
    assert!(rel(first[0], first[1]) <= STEP_F32.rel, "online twins {} vs reference {}", first[0], first[1]);
    // `xtask eval` with the hybrid: the reference decoders are lossless (the GPU's run in
    // `gpu-conformance` and `gpu_train_check.sh`).
    let eval = |extra: &[&str]| {
        let drafter = tmp.path().join("host/drafter");
        Command::new(env!("CARGO_BIN_EXE_xtask"))
            .args(["eval", "--target", target.to_str().unwrap(), "--drafter", drafter.to_str().unwrap()])
            .args(["--prompts", repo("fixtures/data/conversations.jsonl").to_str().unwrap()])
            .args(["--max-new-tokens", "6", "--max-prompts", "2"])
            .args(extra)
            .output()
            .unwrap()
    };
    let report = tmp.path().join("eval.json");
    let result = eval(&["--device", "cpu", "--out", report.to_str().unwrap()]);
    assert!(result.status.success(), "{}", text(&result.stderr));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!((v["prompts"].as_u64(), v["all_identical_to_plain"].as_bool()), (Some(2), Some(true)));

    let features = tmp.path().join("features");
    write_features(&target, &cache, &features);
    let out = tmp.path().join("offline");
    let stdout = run(&out, &["--step", "host", "--steps", "4", "--features", features.to_str().unwrap()]);
    assert!(stdout.contains("features from the cache"), "{stdout}");
    let offline = loss_values(&out)[0];
    assert!(rel(offline, first[0]) <= GPU_STEP_BF16.rel, "from the cache {offline} vs online {}", first[0]);
}

#[test]
fn a_killed_real_run_resumes_with_the_uninterrupted_losses() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    let seed = rand::rng().random_range(0..1u64 << 30).to_string();
    write_target_folder(&target, 7).unwrap();
    let cache = tmp.path().join("data-cache");
    let run_args = |out: &Path| {
        let extra = ["--step", "host", "--steps", "12", "--checkpoint-every", "3", "--keep-checkpoints", "2"];
        let mut args = real_args(&target, &cache, out, &extra);
        args.extend(["--seed".to_string(), seed.clone()]);
        args
    };
    killed_and_resumed_equals_uninterrupted(tmp.path(), run_args, 12, &seed);
}

/// The run folder and the inputs of real runs: `--data A --data B` reads both files as `--data
/// A B` does; paths are saved absolute, so a run started with relative paths resumes from
/// another folder; a finished real run is replaced only with `--overwrite` (not by the built-in
/// default); an `--out` that
/// cannot be a run folder is refused before the data is read; a run whose weights go non-finite
/// reports a NaN held-out loss and still writes its checkpoint and drafter.
#[test]
fn real_run_folders_paths_and_inputs() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    write_target_folder(&target, rand::rng().random_range(0..1u64 << 30)).unwrap();
    let conversations = std::fs::read_to_string(repo("fixtures/data/conversations.jsonl")).unwrap();
    let lines: Vec<&str> = conversations.lines().collect();
    let half = rand::rng().random_range(10..lines.len() - 10);
    std::fs::write(tmp.path().join("a.jsonl"), lines[..half].join("\n")).unwrap();
    std::fs::write(tmp.path().join("b.jsonl"), lines[half..].join("\n")).unwrap();
    let run = |args: &[&str]| {
        let mut base = vec!["train", "--target", target.to_str().unwrap(), "--step", "host"];
        base.extend(["--max-len", "256", "--anchors", "4", "--target-layer-ids", "0,1", "--held-out", "0.2"]);
        Command::new(env!("CARGO_BIN_EXE_xtask")).args(cli_args(&base, args)).current_dir(tmp.path()).output().unwrap()
    };
    let data_line = |out: &std::process::Output| {
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
        stdout.lines().find(|l| l.starts_with("data: ")).map(String::from).expect("a data line")
    };
    let both = data_line(&run(&["--data", "a.jsonl", "b.jsonl", "--plan"]));
    let repeated = data_line(&run(&["--data", "a.jsonl", "--data", "b.jsonl", "--plan"]));
    let first = data_line(&run(&["--data", "a.jsonl", "--plan"]));
    assert_eq!(repeated, both, "--data A --data B reads both files");
    assert_ne!(first, both, "the second file adds conversations");

    // Relative paths in, absolute paths saved; resumed from another folder.
    let trained = run(&["--data", "a.jsonl", "--steps", "2", "--out", "run"]);
    assert!(trained.status.success(), "{}", text(&trained.stderr));
    let saved = std::fs::read_to_string(tmp.path().join("run/checkpoint-2/run.toml")).unwrap();
    let abs = std::path::absolute(tmp.path().join("a.jsonl")).unwrap();
    assert!(saved.contains(&format!("data = [\"{}\"]", abs.display())), "{saved}");
    let elsewhere = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["train", "--resume", tmp.path().join("run").to_str().unwrap(), "--steps", "3"])
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap();
    assert!(elsewhere.status.success(), "resumed from another folder:\n{}", text(&elsewhere.stderr));
    assert!(tmp.path().join("run/checkpoint-3/state.json").exists(), "the resumed run's checkpoint");
    // Resumed with fewer steps than its checkpoint's: refused once the rows are known, before the
    // target is loaded or anything evaluated.
    let shorter = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["train", "--resume", tmp.path().join("run").to_str().unwrap(), "--steps", "2"])
        .output()
        .unwrap();
    let stderr = text(&shorter.stderr);
    assert!(!shorter.status.success() && stderr.contains("at step 3, past this run's 2 steps"), "{stderr}");
    assert!(!text(&shorter.stdout).contains("rows: "), "{}", text(&shorter.stdout));

    // A finished real run: refused without --overwrite, before the data is read; replaced with it.
    let again = run(&["--data", "a.jsonl", "--steps", "2", "--out", "run"]);
    let stderr = text(&again.stderr);
    assert!(
        !again.status.success() && stderr.contains("finished run of 3 steps") && stderr.contains("--overwrite"),
        "{stderr}"
    );
    assert!(!text(&again.stdout).contains("data:"), "the data was read first");
    assert!(tmp.path().join("run/checkpoint-3").exists(), "the finished run was kept");
    // The built-in default (a forgotten --target) does not replace it either, saying why.
    let builtin = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["train", "--out", "run", "--steps", "2"])
        .current_dir(tmp.path())
        .output()
        .unwrap();
    let stderr = text(&builtin.stderr);
    assert!(!builtin.status.success() && stderr.contains("replaces only its own runs"), "{stderr}");
    assert!(tmp.path().join("run/checkpoint-3").exists(), "the finished run was kept");
    // A real run's drafter whose checkpoints were deleted (to free the disk): kept by the
    // built-in default too; replaced with --overwrite.
    let kept = tmp.path().join("kept");
    std::fs::create_dir_all(kept.join("drafter")).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(tmp.path().join("run/checkpoint-3").join(f), kept.join("drafter").join(f)).unwrap();
    }
    let small = ["--rows", "4", "--eval-rows", "1", "--continuation-len", "8", "--tau-prompts", "0", "--steps", "1"];
    let builtin = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_xtask"))
            .args(["train", "--out", kept.to_str().unwrap()])
            .args(small)
            .args(extra)
            .output()
            .unwrap()
    };
    let refused = builtin(&[]);
    let stderr = text(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("no complete checkpoint") && stderr.contains("own runs"),
        "{stderr}"
    );
    let replaced = builtin(&["--overwrite"]);
    assert!(replaced.status.success(), "{}", text(&replaced.stderr));
    assert!(text(&replaced.stdout).contains("replaced by this one"), "{}", text(&replaced.stdout));
    let replaced = run(&["--data", "a.jsonl", "--steps", "2", "--out", "run", "--overwrite"]);
    assert!(
        replaced.status.success() && text(&replaced.stdout).contains("replaced by this one"),
        "{}",
        text(&replaced.stderr)
    );
    assert!(!tmp.path().join("run/checkpoint-3").exists() && tmp.path().join("run/checkpoint-2").exists());

    // Throughput counts document tokens, not padding: one document per row, padded to 512 (no
    // fixture conversation reaches 512 tokens, so no row is all document).
    let args = ["--data", "a.jsonl", "--steps", "3", "--log-every", "1", "--packing", "no", "--max-len", "512"];
    let unpacked = run(&[&args[..], &["--out", "unpacked"]].concat());
    assert!(unpacked.status.success(), "{}", text(&unpacked.stderr));
    for line in metrics(&tmp.path().join("unpacked")).iter().filter(|v| v["kind"] == "train") {
        let per_row = line["tokens_per_s"].as_f64().unwrap() / line["samples_per_s"].as_f64().unwrap();
        assert!((2.0..511.0).contains(&per_row), "{per_row} tokens per row of 512 counted: {line}");
        // The host step's FLOPs on the CPU are no fraction of an H200's peak.
        assert!(line["mfu"].is_null(), "an MFU on the CPU: {line}");
    }

    // An --out that is a file: refused before the data is read.
    std::fs::write(tmp.path().join("a-file"), "x").unwrap();
    let refused = run(&["--data", "a.jsonl", "--steps", "2", "--out", "a-file"]);
    assert!(!refused.status.success() && text(&refused.stderr).contains("option `out`"), "{}", text(&refused.stderr));
    assert!(!text(&refused.stdout).contains("data:"), "the data was read first");

    // Weights blown up by a huge learning rate: the held-out loss is NaN, the run still ends
    // with its checkpoint and drafter.
    let blown = run(&["--data", "a.jsonl", "--steps", "2", "--lr", "1e30", "--eval-every", "1", "--out", "nan"]);
    assert!(blown.status.success(), "{}", text(&blown.stderr));
    let evals: Vec<serde_json::Value> =
        metrics(&tmp.path().join("nan")).into_iter().filter(|v| v["kind"] == "eval").collect();
    assert!(evals.iter().any(|v| v["loss"].is_null()), "a NaN held-out loss is written as null: {evals:?}");
    assert!(
        tmp.path().join("nan/checkpoint-2/state.json").exists() && tmp.path().join("nan/drafter/config.json").exists()
    );
}

/// `demo-target` writes a target folder the real-run commands take as it is (a short run on
/// the CPU twins trains and saves a drafter); it refuses a folder that is not new or empty.
#[test]
fn demo_target_writes_a_folder_a_real_run_takes() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("demo");
    let seed = rand::rng().random_range(0..1u64 << 30).to_string();
    let made = xtask(&["demo-target", "--out", target.to_str().unwrap(), "--seed", &seed]);
    assert!(made.status.success(), "{}", text(&made.stderr));
    let (cache, out) = (tmp.path().join("data-cache"), tmp.path().join("run"));
    run_real(&target, &cache, &out, &["--step", "host", "--steps", "2"]);
    assert!(out.join("drafter/model.safetensors").exists());
    let again = xtask(&["demo-target", "--out", target.to_str().unwrap()]);
    assert!(!again.status.success() && text(&again.stderr).contains("not an empty folder"), "{}", text(&again.stderr));
}

/// Bad real-run input is refused before any training, naming the option, file or token.
#[test]
fn bad_real_runs_are_refused_before_any_work() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    write_target_folder(&target, 3).unwrap();
    let cache = tmp.path().join("data-cache");
    let out = tmp.path().join("out");
    let refuses = |target: &Path, extra: &[&str], want: &[&str]| {
        let args = cli_args(&real_args(target, &cache, &out, &["--step", "host", "--steps", "2"]), extra);
        let result = Command::new(env!("CARGO_BIN_EXE_xtask")).args(&args).output().unwrap();
        let stderr = text(&result.stderr);
        assert!(!result.status.success(), "{extra:?} was accepted");
        for w in want {
            assert!(stderr.contains(w), "{extra:?}: no `{w}` in {stderr}");
        }
        assert!(!out.join("metrics.jsonl").exists(), "{extra:?}: training started");
    };
    let fails = |extra: &[&str], want: &[&str]| refuses(&target, extra, want);
    fails(&["--target-layer-ids", "1,3"], &["target_layer_ids", "layer 3", "3 layers"]);
    fails(&["--anchors", "1000"], &["anchors", "1000"]);
    fails(&["--max-len", "1"], &["max_len"]);
    fails(&["--mask-token-id", "9999"], &["mask_token_id", "9999", "768"]);
    fails(&["--held-out", "1.5"], &["held_out"]);
    fails(&["--held-out", "5%"], &["option `held_out`", "5%`: neither a fraction in [0, 1) nor a jsonl file"]);
    fails(&["--draft-layers", "100000000000"], &["draft_layers", "at most 4096"]);
    fails(&["--rows-per-step", "1000000000000"], &["rows_per_step", "at most 65536 rows per update"]);
    fails(&["--grad-accum", "1000", "--rows-per-step", "1000"], &["rows_per_step", "grad_accum 1000"]);
    fails(&["--steps", "9000000000000000000"], &["steps", "at most 1099511627776"]);
    fails(&["--tau-prompts", "4", "--held-out", "0"], &["tau_prompts", "`held_out` is 0"]);
    fails(&["--tau-prompts", "1", "--tau-tokens", "5000"], &["tau_tokens", "beyond the target's 4096 positions"]);
    // An argument that is not UTF-8 text (a path in another encoding) is named, not a panic.
    use std::os::unix::ffi::OsStrExt;
    let latin1 = std::ffi::OsStr::from_bytes(b"caf\xe9.jsonl");
    let result = Command::new(env!("CARGO_BIN_EXE_xtask")).args(["train", "--data"]).arg(latin1).output().unwrap();
    let stderr = text(&result.stderr);
    assert!(!result.status.success() && stderr.contains("argument 3") && stderr.contains("not UTF-8"), "{stderr}");
    // The training data as its own held-out file (by another spelling of its path); no lines.
    let data_again = repo("fixtures/data/../data/conversations.jsonl");
    fails(&["--held-out", data_again.to_str().unwrap()], &["held_out", "also a --data file"]);
    let empty = tmp.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let empty_cache = tmp.path().join("empty-cache");
    let mut args = real_args(&target, &empty_cache, &out, &["--step", "host", "--steps", "2"]);
    let at = args.iter().position(|a| a == "--data").unwrap() + 1;
    args[at] = empty.to_str().unwrap().to_string();
    let result = Command::new(env!("CARGO_BIN_EXE_xtask")).args(&args).output().unwrap();
    let stderr = text(&result.stderr);
    assert!(!result.status.success() && stderr.contains("hold no lines") && stderr.contains("empty.jsonl"), "{stderr}");
    fails(&["--features", tmp.path().join("nothing").to_str().unwrap()], &["features", "index.json"]);
    fails(&["--block-size", "1"], &["block_size", "at least 2"]);
    fails(&["--draft-layers", "0"], &["draft_layers", "at least 1"]);
    fails(&["--target-layer-ids", "1,x"], &["--target-layer-ids", "comma-separated whole numbers"]);
    fails(&["--packing", "maybe"], &["--packing", "yes or no"]);
    fails(&["--drafter-workers", "0"], &["drafter_workers", "at least 1"]);
    fails(&["--target-layer-ids", "0,0"], &["target_layer_ids", "layer 0 is given twice"]);
    fails(&["--target-layer-ids", "1,0"], &["target_layer_ids", "1 before 0", "increasing order"]);
    fails(&["--target-layer-ids", "0,2"], &["target_layer_ids", "layer 2 is the target's last", "up to 1"]);
    fails(&["--block-size", "300"], &["block_size", "300", "max_len 256"]);
    fails(&["--max-len", "5000"], &["max_len", "5000", "4096 positions", "config.json"]);
    fails(&["--tau-prompts", "1", "--tau-tokens", "4090"], &["tau_tokens", "4090", "4096 positions"]);
    // The built-in default's options: refused, not ignored.
    fails(&["--temperature", "0.7"], &["temperature", "built-in default only"]);
    fails(&["--rows", "10"], &["rows", "built-in default only"]);
    fails(&["--drafter-workers", "2", "--step", "reference"], &["drafter_workers", "host", "gpu"]);
    fails(&["--target-workers", "1", "--step", "reference"], &["target_workers", "host"]);
    fails(&["--shard-optimizer", "yes"], &["shard_optimizer", "2 or more drafter workers"]);
    // The GPUs: one per worker, drafter workers on GPUs of their own.
    fails(&["--gpus", "0", "--step", "host"], &["gpus", "`host` step"]);
    let gpu = |extra: &[&'static str]| [&["--step", "gpu"], extra].concat();
    fails(&gpu(&["--gpus", "0", "--target-workers", "1"]), &["gpus", "1 GPUs for 1 target + 1 drafter workers"]);
    fails(&gpu(&["--drafter-workers", "2"]), &["gpus", "two drafter workers on GPU 0"]);
    fails(&gpu(&["--gpus", "1,1", "--drafter-workers", "2"]), &["gpus", "two drafter workers on GPU 1"]);
    // GPUs the machine lacks, before the data is read: none in CI, GPU 63 on a GPU machine.
    let mut args = real_args(&target, &cache, &out, &["--steps", "2"]);
    args.extend(
        gpu(&["--gpus", "0,63", "--drafter-workers", "2", "--rows-per-step", "2"]).iter().map(|s| s.to_string()),
    );
    let result = Command::new(env!("CARGO_BIN_EXE_xtask")).args(&args).output().unwrap();
    let (stdout, stderr) = (text(&result.stdout), text(&result.stderr));
    assert!(!result.status.success(), "GPU 63 accepted");
    assert!(stderr.contains("no CUDA GPU here") || stderr.contains("GPU 63 requested"), "{stderr}");
    assert!(!stdout.contains("data:"), "the data was read first:\n{stdout}");
    let cached = tmp.path().join("nothing").to_str().unwrap().to_string();
    fails(&["--target-workers", "1", "--features", &cached], &["target_workers", "no `--features`"]);
    // A mask token the data holds (a token of the first conversation).
    let tokenizer = dflash_data::target::TargetTokenizer::load(&target).unwrap();
    let common = tokenizer.encode("the").unwrap()[0].to_string();
    fails(&["--mask-token-id", &common], &["mask_token_id", "occurs in the data"]);
    // A checkpoint without a weight of its last layer, and one with a weight of the wrong shape.
    let damaged = tmp.path().join("damaged");
    write_target_folder(&damaged, 3).unwrap();
    let weights = damaged.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &candle_core::Device::Cpu).unwrap();
    let refused = |tensors: &std::collections::HashMap<String, candle_core::Tensor>, want: &[&str]| {
        candle_core::safetensors::save(tensors, &weights).unwrap();
        refuses(&damaged, &[], want);
    };
    let up = "model.layers.2.mlp.up_proj.weight";
    let weight = tensors.remove(up).unwrap();
    refused(&tensors, &[up, "missing from the checkpoint"]);
    tensors.insert(up.into(), weight.t().unwrap().contiguous().unwrap());
    refused(&tensors, &[up, "[32, 48]", "[48, 32]"]);
    let missing = tmp.path().join("absent");
    let args = real_args(&missing, &cache, &out, &["--steps", "2"]);
    let result = Command::new(env!("CARGO_BIN_EXE_xtask")).args(&args).output().unwrap();
    assert!(!result.status.success() && text(&result.stderr).contains("target"), "{}", text(&result.stderr));
    // Data without a target.
    let result = xtask(&["train", "--data", "a.jsonl", "--steps", "2"]);
    assert!(!result.status.success() && text(&result.stderr).contains("needs `target`"), "{}", text(&result.stderr));
}

/// `cargo xtask eval` on a drafter a real run saved: every prompt decodes to exactly the target's
/// greedy tokens, tau is reported both ways and within [1, B], the JSON says the same; a drafter
/// of another target, an empty prompt file (alone or after a good one), a prompt past the
/// context, the GPU (not built) and a bad prompt line are refused before decoding, each named.
#[test]
fn eval_decodes_losslessly_and_refuses_bad_input() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    write_target_folder(&target, 11).unwrap();
    let (cache, out) = (tmp.path().join("data-cache"), tmp.path().join("run"));
    let result = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(real_args(&target, &cache, &out, &["--step", "host", "--steps", "4", "--block-size", "4"]))
        .output()
        .unwrap();
    assert!(result.status.success(), "{}", text(&result.stderr));
    let drafter = out.join("drafter");
    let prompts = repo("fixtures/data/conversations.jsonl");
    let eval = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_xtask"))
            .args(["eval", "--target", target.to_str().unwrap(), "--drafter", drafter.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap()
    };
    let report = tmp.path().join("eval.json");
    let p = prompts.to_str().unwrap();
    let result =
        eval(&["--prompts", p, "--max-new-tokens", "12", "--max-prompts", "3", "--out", report.to_str().unwrap()]);
    let stdout = text(&result.stdout);
    assert!(result.status.success(), "{stdout}\n{}", text(&result.stderr));
    assert!(stdout.contains("mean of A+1 over all") && stdout.contains("mean of the prompts' taus"), "{stdout}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(v["prompts"], 3);
    assert_eq!(v["all_identical_to_plain"], true);
    for key in ["tau_over_steps", "tau_over_prompts"] {
        let tau = v[key].as_f64().unwrap();
        assert!((1.0..=4.0).contains(&tau), "{key} {tau}");
    }
    assert_eq!(v["acceptance_per_position"].as_array().unwrap().len(), 3);
    for prompt in v["per_prompt"].as_array().unwrap() {
        // 12 tokens, or fewer ending at an end-of-sequence id (`eval_cli.rs` tests the stop).
        let generated = prompt["tokens"].as_array().unwrap().len();
        assert!(prompt["generated_tokens"] == generated && (1..=12).contains(&generated), "{prompt}");
        for rate in ["spec_tokens_per_s", "plain_tokens_per_s"] {
            assert!(prompt[rate].as_f64().is_some_and(|r| r > 0.0), "{rate}: {prompt}");
        }
    }
    assert_eq!(v["sampling"], serde_json::json!({"temperature": 0.0}));
    // Seeded sampling: speculative equals plain sampling, and the tokens are not the greedy ones.
    let sampled = tmp.path().join("sampled.json");
    let args = ["--prompts", p, "--max-new-tokens", "12", "--max-prompts", "3", "--temperature", "1.5", "--seed", "4"];
    let result = eval(&[&args[..], &["--out", sampled.to_str().unwrap()]].concat());
    assert!(result.status.success(), "{}", text(&result.stderr));
    let s: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&sampled).unwrap()).unwrap();
    assert_eq!(s["all_identical_to_plain"], true);
    assert_eq!(s["sampling"], serde_json::json!({"temperature": 1.5, "seed": 4}));
    assert!(text(&result.stdout).contains("sampled at temperature 1.5 (seed 4)"), "{}", text(&result.stdout));
    let tokens = |v: &serde_json::Value| {
        v["per_prompt"].as_array().unwrap().iter().map(|p| p["tokens"].clone()).collect::<Vec<_>>()
    };
    assert_ne!(tokens(&s), tokens(&v), "sampling at temperature 1.5 gave the greedy tokens");

    let refused = |extra: &[&str], want: &[&str]| {
        let result = eval(extra);
        let stderr = text(&result.stderr);
        assert!(!result.status.success(), "{extra:?} was accepted");
        for w in want {
            assert!(stderr.contains(w), "{extra:?}: no `{w}` in {stderr}");
        }
        assert!(!text(&result.stdout).contains("identical"), "{extra:?}: decoding started");
    };
    let empty = tmp.path().join("empty.jsonl");
    std::fs::write(&empty, "\n").unwrap();
    refused(&["--prompts", empty.to_str().unwrap()], &["no prompt"]);
    // Also after a file that gives prompts: the empty one is named.
    refused(&["--prompts", p, empty.to_str().unwrap()], &["no prompt in", "empty.jsonl"]);
    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"hello\"}\n{not json\n").unwrap();
    refused(&["--prompts", bad.to_str().unwrap()], &["bad.jsonl", "line 2"]);
    refused(&["--prompts", p, "--max-new-tokens", "5000"], &["line 1", "4096 positions"]);
    // Without a GPU (CI) `--device gpu` says so; on one, this target's heads of 8 are refused.
    let gpu = eval(&["--prompts", p, "--device", "gpu"]);
    let why = text(&gpu.stderr);
    assert!(!gpu.status.success() && (why.contains("no CUDA GPU") || why.contains("head_dim")), "{why}");
    refused(&["--prompts", p, "--device", "tpu"], &["--device", "`tpu`"]);
    refused(&["--prompts", p, "--temperature", "-1"], &["--temperature"]);
    refused(&["--prompts", p, "--temperature", "nan"], &["--temperature"]);
    refused(&["--prompts", p, "--seed", "-3"], &["--seed"]);
    refused(&["--prompts", p, "--max-new-tokens", "0"], &["--max-new-tokens"]);
    refused(&["--prompts", p, "--max-new-tokens", "1"], &["--max-new-tokens 1: at least 2"]);
    refused(&["--prompts", p, "--max-prompts", "0"], &["--max-prompts"]);
    refused(&["--prompts", p, "--thinking", "maybe"], &["--thinking"]);
    // A report that cannot be written: refused before decoding.
    let unwritable = tmp.path().join("eval.json").join("report.json");
    refused(&["--prompts", p, "--out", unwritable.to_str().unwrap()], &["--out", "report.json"]);
    refused(&[], &["--prompts FILE... is required"]);
    let result = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["eval", "--target", target.to_str().unwrap(), "--prompts", p])
        .output()
        .unwrap();
    assert!(
        !result.status.success() && text(&result.stderr).contains("--drafter DIR is required"),
        "{}",
        text(&result.stderr)
    );
    // The run folder instead of its drafter: the error points at the drafter.
    let result = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["eval", "--target", target.to_str().unwrap(), "--drafter", out.to_str().unwrap(), "--prompts", p])
        .output()
        .unwrap();
    let stderr = text(&result.stderr);
    assert!(!result.status.success() && stderr.contains(&drafter.display().to_string()), "{stderr}");
    let other = repo("fixtures/drafter");
    let result = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["eval", "--target", target.to_str().unwrap(), "--drafter", other.to_str().unwrap(), "--prompts", p])
        .output()
        .unwrap();
    assert!(
        !result.status.success() && text(&result.stderr).contains("does not fit the target"),
        "{}",
        text(&result.stderr)
    );
    // Feature layers that training refuses (out of order: engines concatenate them in layer
    // order) are refused here too, not decoded in list order.
    let swapped = tmp.path().join("swapped");
    std::fs::create_dir(&swapped).unwrap();
    for f in ["model.safetensors", "config.json"] {
        std::fs::copy(drafter.join(f), swapped.join(f)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(swapped.join("config.json")).unwrap()).unwrap();
    let ids = config["dflash_config"]["target_layer_ids"].as_array().unwrap().clone();
    assert!(ids.len() >= 2, "{ids:?}");
    config["dflash_config"]["target_layer_ids"] = serde_json::json!(ids.iter().rev().collect::<Vec<_>>());
    std::fs::write(swapped.join("config.json"), config.to_string()).unwrap();
    let result = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["eval", "--target", target.to_str().unwrap(), "--drafter", swapped.to_str().unwrap(), "--prompts", p])
        .output()
        .unwrap();
    let stderr = text(&result.stderr);
    assert!(
        !result.status.success() && stderr.contains("target_layer_ids") && stderr.contains("increasing"),
        "{stderr}"
    );
    // A drafter folder without one of its weights: named before the target is loaded.
    let damaged = tmp.path().join("damaged");
    std::fs::create_dir(&damaged).unwrap();
    std::fs::copy(drafter.join("config.json"), damaged.join("config.json")).unwrap();
    let weights = damaged.join("model.safetensors");
    let mut tensors =
        candle_core::safetensors::load(drafter.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let name = tensors.keys().find(|k| k.contains("layers.0.")).unwrap().clone();
    tensors.remove(&name).unwrap();
    candle_core::safetensors::save(&tensors, &weights).unwrap();
    let result = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["eval", "--target", target.to_str().unwrap(), "--drafter", damaged.to_str().unwrap(), "--prompts", p])
        .output()
        .unwrap();
    let stderr = text(&result.stderr);
    assert!(!result.status.success() && stderr.contains(&name) && stderr.contains("damaged"), "{stderr}");
}

/// Data-parallel drafter workers through the binary (the host step, one thread each): 2 workers
/// train like 1 with the same rows per step (losses within 1e-6: the same f32 sums in another
/// grouping), and a 2-worker run's checkpoint resumes on 3 workers with the same next losses
/// (and on 4, more than its rows per update, saying that some idle),
/// a 2-worker run sharding the optimizer's on 1 worker without sharding.
#[test]
fn drafter_workers_train_like_one_and_resume_on_another_count() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    write_target_folder(&target, 5).unwrap();
    let cache = tmp.path().join("data-cache");
    let run = |out: &Path, workers: &str| {
        let extra = ["--step", "host", "--steps", "6", "--checkpoint-every", "3", "--rows-per-step", "3"];
        let mut args = real_args(&target, &cache, out, &extra);
        args.extend(["--drafter-workers".to_string(), workers.to_string()]);
        let result = Command::new(env!("CARGO_BIN_EXE_xtask")).args(&args).output().unwrap();
        assert!(result.status.success(), "{workers} workers: {}", text(&result.stderr));
        text(&result.stdout)
    };
    let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
    run(&one, "1");
    let stdout = run(&two, "2");
    assert!(stdout.contains("2 data-parallel workers"), "{stdout}");
    let close = |a: &[f64], b: &[f64], what: &str| {
        assert_eq!(a.len(), b.len(), "{what}");
        for (s, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() / y.abs() <= 1e-6, "{what}: step {s}: {x} vs {y}");
        }
    };
    let want = loss_values(&one);
    close(&loss_values(&two), &want, "2 workers vs 1");
    // The AdamW state sharded over the 2 workers: the same losses as the whole state.
    let split = tmp.path().join("split");
    let extra = ["--step", "host", "--steps", "6", "--checkpoint-every", "3", "--rows-per-step", "3"];
    let mut args = real_args(&target, &cache, &split, &extra);
    args.extend(["--drafter-workers", "2", "--shard-optimizer", "yes"].map(String::from));
    let result = Command::new(env!("CARGO_BIN_EXE_xtask")).args(&args).output().unwrap();
    assert!(result.status.success(), "{}", text(&result.stderr));
    close(&loss_values(&split), &want, "2 workers sharding the optimizer vs 1");
    // 1 target worker feeding 2 drafter workers through its queue: the same losses; the train
    // lines say how long each side waited.
    let fed = tmp.path().join("fed");
    let mut args = real_args(&target, &cache, &fed, &["--step", "host", "--steps", "6", "--checkpoint-every", "3"]);
    args.extend(["--rows-per-step", "3", "--drafter-workers", "2", "--target-workers", "1"].map(String::from));
    let result = Command::new(env!("CARGO_BIN_EXE_xtask")).args(&args).output().unwrap();
    assert!(result.status.success(), "{}", text(&result.stderr));
    assert!(text(&result.stdout).contains("fed by 1 target workers"), "{}", text(&result.stdout));
    assert!(text(&result.stdout).contains("pipeline: the drafter workers waited"), "{}", text(&result.stdout));
    close(&loss_values(&fed), &want, "1 target + 2 drafter workers vs 1");
    // 1 target worker feeding 1 drafter worker: the single engine's losses bitwise (the same
    // features, read from the target worker's slot instead of the engine's own forward).
    let pair = tmp.path().join("pair");
    let mut args = real_args(&target, &cache, &pair, &["--step", "host", "--steps", "6", "--rows-per-step", "3"]);
    args.extend(["--target-workers", "1"].map(String::from));
    let result = Command::new(env!("CARGO_BIN_EXE_xtask")).args(&args).output().unwrap();
    assert!(result.status.success(), "{}", text(&result.stderr));
    assert_eq!(loss_values(&pair), want, "1 target + 1 drafter worker vs 1");
    let lines = dflash_trainer::metrics::read_lines(&fed.join("metrics.jsonl")).unwrap();
    let train: Vec<_> = lines.iter().filter(|v| v["kind"] == "train").collect();
    assert!(train
        .iter()
        .all(|v| v["drafters_waited_s"].as_f64().is_some() && v["targets_waited_s"].as_f64().is_some()));
    // `train --resume DIR EXTRA...` that succeeds: its stdout.
    let resume = |dir: &Path, extra: &[&str]| {
        let result = Command::new(env!("CARGO_BIN_EXE_xtask"))
            .args(["train", "--resume", dir.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        let stdout = text(&result.stdout);
        assert!(result.status.success(), "{stdout}\n{}", text(&result.stderr));
        stdout
    };
    // A run's folder back at its checkpoint of step 3.
    let back_to_step_3 = |dir: &Path| {
        std::fs::remove_dir_all(dir.join("checkpoint-6")).unwrap();
        std::fs::remove_file(dir.join("latest")).unwrap();
    };
    // The 2-worker run back at its checkpoint of step 3, resumed on 3 workers.
    back_to_step_3(&two);
    let stdout = resume(&two, &["--drafter-workers", "3"]);
    assert!(
        stdout.contains("3 data-parallel workers") && stdout.contains("`drafter_workers` changed from 2 to 3"),
        "{stdout}"
    );
    close(&loss_values(&two), &want, "resumed on 3 workers vs 1");
    // Resumed (extended by a step) on more workers than its rows per update: it runs, saying
    // that some sit idle (a checkpoint's rows per update cannot change).
    let stdout = resume(&two, &["--drafter-workers", "4", "--steps", "7"]);
    assert!(stdout.contains("3 rows per update for 4 drafter workers: some sit idle at every step"), "{stdout}");
    // The sharded run back at step 3, resumed on 1 worker (the checkpoint holds the whole state).
    back_to_step_3(&split);
    let stdout = resume(&split, &["--drafter-workers", "1", "--shard-optimizer", "no"]);
    assert!(stdout.contains("`shard_optimizer` changed from true to false"), "{stdout}");
    close(&loss_values(&split), &want, "sharded on 2 workers, resumed unsharded on 1, vs 1");
    // Several workers need the host step.
    let mut args = real_args(&target, &cache, &tmp.path().join("gpu"), &["--drafter-workers", "2", "--steps", "2"]);
    args.extend(["--step".to_string(), "reference".to_string()]);
    let result = Command::new(env!("CARGO_BIN_EXE_xtask")).args(&args).output().unwrap();
    assert!(!result.status.success() && text(&result.stderr).contains("drafter_workers"), "{}", text(&result.stderr));
}

/// A free TCP port on 127.0.0.1 (for rank 0 to listen on).
fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string()
}

/// How soon the other process must exit after one is killed: the killed process's sockets
/// close at once, the survivor fails in its next collective (within its current step, here a
/// fraction of a second); the bound leaves room for a loaded CI machine, far below the
/// collective timeout (30 min).
const PEER_STOPS_WITHIN: Duration = Duration::from_secs(20);

/// Several processes through the binary (the host step), joined through the TCP rendezvous:
/// rank 0 from options, rank 1 from the torchrun variables. Two processes train like one with
/// the same rows per step (losses within 1e-6: the same f32 sums in another grouping), rank 1
/// writing nothing (its --out stays absent); their checkpoint resumes on both ranks with two
/// drafter workers each (the in-process group inside each process, the process group across)
/// with the same next losses; a rank killed mid-run makes the other exit with an error naming it
/// within seconds.
#[test]
fn processes_joined_through_the_rendezvous_train_like_one() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    write_target_folder(&target, rand::rng().random_range(0..1 << 30)).unwrap();
    let cache = tmp.path().join("data-cache");
    let seed = rand::rng().random_range(0..1u64 << 40).to_string();
    let common = ["--step", "host", "--rows-per-step", "4", "--seed", &seed];
    let args = |out: &Path, extra: &[&str]| {
        let mut all: Vec<&str> = common.to_vec();
        all.extend(extra);
        real_args(&target, &cache, out, &all)
    };
    let one = tmp.path().join("one");
    let result = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(args(&one, &["--steps", "6", "--checkpoint-every", "3"]))
        .output()
        .unwrap();
    assert!(result.status.success(), "{}", text(&result.stderr));
    let want = loss_values(&one);
    // Rank 0 by options, rank 1 by the variables torchrun sets.
    let spawn = |rank: usize, port: &str, cmd: Vec<String>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_xtask"));
        c.args(cmd).stdout(Stdio::piped()).stderr(Stdio::piped());
        match rank {
            0 => c.args(["--rank", "0", "--world-size", "2", "--master-addr", "127.0.0.1", "--master-port", port]),
            _ => c
                .envs([("RANK", "1"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")])
                .envs([("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port)]),
        };
        c.spawn().unwrap()
    };
    let both = |cmd0: Vec<String>, cmd1: Vec<String>| {
        let port = free_port();
        let (zero, one) = (spawn(0, &port, cmd0), spawn(1, &port, cmd1));
        let (zero, one) = (zero.wait_with_output().unwrap(), one.wait_with_output().unwrap());
        for (rank, r) in [&zero, &one].into_iter().enumerate() {
            assert!(r.status.success(), "rank {rank}:\n{}\n{}", text(&r.stdout), text(&r.stderr));
        }
        (text(&zero.stdout), text(&one.stdout))
    };
    let close = |a: &[f64], b: &[f64], what: &str| {
        assert_eq!(a.len(), b.len(), "{what}");
        for (s, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() / y.abs() <= 1e-6, "{what}: step {s}: {x} vs {y}");
        }
        let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs()).fold(0.0, f64::max);
        eprintln!("{what}: losses within {worst:.1e} relative");
    };
    let (two, elsewhere) = (tmp.path().join("two"), tmp.path().join("rank-1"));
    let steps = ["--steps", "6", "--checkpoint-every", "3"];
    let (stdout0, stdout1) = both(args(&two, &steps), args(&elsewhere, &steps));
    assert!(stdout0.contains("1 data-parallel workers on rank 0 of 2 processes"), "{stdout0}");
    assert!(stdout1.contains("process rank 1 of 2: 6 steps trained"), "{stdout1}");
    close(&loss_values(&two), &want, "2 processes vs 1");
    assert!(two.join("drafter/model.safetensors").exists() && two.join("checkpoint-6/state.json").exists());
    assert!(!elsewhere.exists(), "rank 1 wrote under its --out");
    // One process with 2 drafter workers sums the same parts in the same order: bitwise.
    let pair = tmp.path().join("pair");
    let result = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(args(&pair, &["--steps", "6", "--drafter-workers", "2"]))
        .output()
        .unwrap();
    assert!(result.status.success(), "{}", text(&result.stderr));
    assert_eq!(losses(&two), losses(&pair), "2 processes vs 2 drafter workers in one");
    // Offline, each process reads the features of its own rows alone: the same losses as one
    // process reading them all.
    let features = tmp.path().join("features");
    write_features(&target, &cache, &features);
    let offline: Vec<&str> = steps.iter().copied().chain(["--features", features.to_str().unwrap()]).collect();
    let alone = tmp.path().join("offline-one");
    let result = Command::new(env!("CARGO_BIN_EXE_xtask")).args(args(&alone, &offline)).output().unwrap();
    assert!(result.status.success(), "{}", text(&result.stderr));
    let (offline_two, offline_elsewhere) = (tmp.path().join("offline-two"), tmp.path().join("offline-rank-1"));
    both(args(&offline_two, &offline), args(&offline_elsewhere, &offline));
    close(&loss_values(&offline_two), &loss_values(&alone), "2 processes vs 1, offline");

    // Back at the checkpoint of step 3, resumed on both ranks with 2 drafter workers each.
    std::fs::remove_dir_all(two.join("checkpoint-6")).unwrap();
    std::fs::remove_file(two.join("latest")).unwrap();
    let resume: Vec<String> =
        ["train", "--resume", two.to_str().unwrap(), "--drafter-workers", "2"].map(String::from).to_vec();
    let (stdout0, stdout1) = both(resume.clone(), resume);
    assert!(stdout0.contains("2 data-parallel workers on rank 0 of 2 processes"), "{stdout0}");
    assert!(stdout1.contains("resume: resumed from") && stdout1.contains("at step 3"), "{stdout1}");
    close(&loss_values(&two), &want, "resumed on 2 processes x 2 workers vs 1");

    // A long run; a random rank killed (SIGKILL) once rank 0 has logged a few steps.
    let (long, port) = (tmp.path().join("long"), free_port());
    let steps = ["--steps", "100000", "--checkpoint-every", "0", "--eval-every", "0"];
    let mut ranks = [spawn(0, &port, args(&long, &steps)), spawn(1, &port, args(&long, &steps))];
    let started = Instant::now();
    while losses(&long).len() < 3 {
        assert!(started.elapsed() < Duration::from_secs(120), "the two processes never trained");
        assert!(ranks.iter_mut().all(|r| r.try_wait().unwrap().is_none()), "a rank stopped early");
        std::thread::sleep(Duration::from_millis(20));
    }
    let victim = rand::rng().random_range(0..2);
    let [zero, one] = ranks;
    let (mut killed, survivor) = if victim == 0 { (zero, one) } else { (one, zero) };
    killed.kill().unwrap();
    let at = Instant::now();
    killed.wait().unwrap();
    let mut survivor = survivor;
    let status = loop {
        if let Some(status) = survivor.try_wait().unwrap() {
            break status;
        }
        assert!(at.elapsed() < PEER_STOPS_WITHIN, "still running {PEER_STOPS_WITHIN:?} after rank {victim} was killed");
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = at.elapsed();
    let stderr = text(&survivor.wait_with_output().unwrap().stderr);
    assert!(!status.success());
    assert!(stderr.contains(&format!("rank {victim} closed its connection")), "{stderr}");
    eprintln!(
        "rank {} exited {:.2} s after rank {victim} was killed: {}",
        1 - victim,
        took.as_secs_f64(),
        stderr.trim()
    );

    // Rank 0 refused before the rendezvous (its --out holds a finished run): rank 1 is told why
    // when it arrives, instead of waiting out the rendezvous timeout; both stop.
    let port = free_port();
    let started = Instant::now();
    let (zero, one) = (spawn(0, &port, args(&two, &steps)), spawn(1, &port, args(&elsewhere, &steps)));
    let (zero, one) = (zero.wait_with_output().unwrap(), one.wait_with_output().unwrap());
    assert!(!zero.status.success() && !one.status.success());
    let (stderr0, stderr1) = (text(&zero.stderr), text(&one.stderr));
    assert!(stderr0.contains("finished run") && stderr0.contains("1 of 1 ranks told"), "{stderr0}");
    assert!(stderr1.contains("rank 0 stopped before the rendezvous") && stderr1.contains("finished run"), "{stderr1}");
    assert!(started.elapsed() < Duration::from_secs(120), "{:?}", started.elapsed());

    // Rank 1 stopped before the rendezvous (the checkpoint it resumes is not there): rank 0 is
    // told why, and stops without waiting out the rendezvous timeout (600 s) or for rank 1.
    let (port, fresh, missing) = (free_port(), tmp.path().join("fresh"), tmp.path().join("no-such-run"));
    let started = Instant::now();
    let resume_missing = ["train", "--resume", missing.to_str().unwrap()].map(String::from).to_vec();
    let (zero, one) = (spawn(0, &port, args(&fresh, &steps)), spawn(1, &port, resume_missing));
    let (zero, one) = (zero.wait_with_output().unwrap(), one.wait_with_output().unwrap());
    assert!(!zero.status.success() && !one.status.success());
    let (stderr0, stderr1) = (text(&zero.stderr), text(&one.stderr));
    assert!(stderr1.contains("no-such-run") && stderr1.contains("rank 0 told"), "{stderr1}");
    assert!(stderr0.contains("rank 1 stopped before joining") && stderr0.contains("no-such-run"), "{stderr0}");
    assert!(stderr0.contains("1 of 1 ranks told"), "{stderr0}");
    assert!(started.elapsed() < Duration::from_secs(120), "{:?}", started.elapsed());
}

/// A run whose least memory (the target's forward, the step under per-layer checkpointing; each
/// worker's on its device) is above what the device has free (here 8 GB: the CPU twins, with the host's memory set by the
/// test hook) is refused naming the parts, before the drafter is initialized or the target loaded,
/// and nothing is written to its folder; a target whose forward alone is above it is told to
/// cache its features offline or give the target GPUs of its own.
#[test]
fn a_run_that_cannot_fit_is_refused_before_the_target_is_loaded() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    write_target_folder(&target, rand::rng().random()).unwrap();
    let config_file = target.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_file).unwrap()).unwrap();
    config["max_position_embeddings"] = (1u64 << 25).into();
    std::fs::write(&config_file, config.to_string()).unwrap();
    // Rows of 2^20 tokens with 10^6 anchors: a forward of about 1.4 GB, a step of about 54 GB;
    // rows of 2^23 tokens: a forward of about 11 GB.
    let cases = [
        (
            (1u64 << 20).to_string(),
            "1000000",
            &["memory: the run needs at least", "the target's forward", "(per-layer)"][..],
        ),
        ((1u64 << 23).to_string(), "8", &["memory: the target's forward alone needs", "cargo xtask features"][..]),
    ];
    // The run with the host memory set to `available`: refused, its stderr naming `free` and each
    // of `needles`; its stdout.
    let refused = |args: &[String], available: &str, free: &str, needles: &[&str]| -> String {
        let result = Command::new(env!("CARGO_BIN_EXE_xtask"))
            .args(args)
            .env(dflash_optimized::backend::host::HOST_AVAILABLE_ENV, available)
            .output()
            .unwrap();
        let (stdout, stderr) = (text(&result.stdout), text(&result.stderr));
        assert!(!result.status.success(), "{stdout}");
        for needle in needles {
            assert!(stderr.contains(needle) && stderr.contains(free), "`{needle}`: {stderr}");
        }
        stdout
    };
    for (seq, anchors, needles) in cases {
        let (cache, out) = (tmp.path().join("cache"), tmp.path().join(format!("run-{seq}")));
        let mut args = real_args(&target, &cache, &out, &["--step", "host", "--steps", "1"]);
        for (flag, value) in [("--max-len", seq.as_str()), ("--anchors", anchors)] {
            let at = args.iter().position(|a| a == flag).unwrap();
            args[at + 1] = value.to_string();
        }
        let started = Instant::now();
        let stdout = refused(&args, &(8u64 << 30).to_string(), "on the CPU, which has 8.59 GB free", needles);
        assert!(
            !stdout.contains("trainable parameters") && !stdout.contains("target forward"),
            "work began:\n{stdout}"
        );
        assert!(!out.join("metrics.jsonl").exists(), "the run folder was written");
        assert!(started.elapsed() < Duration::from_secs(20), "took {:?}", started.elapsed());
    }
    // Host workers share this machine's memory: each drafter worker's forward and step, each
    // target worker's forward and feature slots, and the tables the fed workers share, are
    // counted.
    let workers = [
        (
            &["--drafter-workers", "2"][..],
            &["drafter worker 0: the target's forward", "drafter worker 1: the step"][..],
        ),
        (
            &["--drafter-workers", "1", "--target-workers", "2"][..],
            &[
                "drafter worker 0: the embedding table",
                "target worker 1: the target's forward and its feature slots",
                "the tables read from the target (f32)",
            ][..],
        ),
    ];
    for (i, (extra, needles)) in workers.into_iter().enumerate() {
        let (cache, out) = (tmp.path().join("cache"), tmp.path().join(format!("run-workers-{i}")));
        let mut args = vec!["--step", "host", "--steps", "1", "--rows-per-step", "2"];
        args.extend(extra);
        let stdout =
            refused(&real_args(&target, &cache, &out, &args), "650000", "on the CPU, which has 0.65 MB free", needles);
        assert!(!stdout.contains("target forward") && !stdout.contains("target worker"), "work began:\n{stdout}");
    }
}

/// A Qwen3 MoE target (`Qwen3MoeForCausalLM`, a checkpoint with routers and experts), known here
/// by its sizes: from a feature cache of its provenance (what
/// `xtask/scripts/features_transformers.py` writes; here the features of its dense twin, which has
/// the same attention, sizes and tables), it trains exactly as the dense twin does from the same
/// cache; every command that would run its forward (training without
/// `--features`, the real tau, `features`, `eval`) is refused naming the way to train from it,
/// while `features --export-documents` writes its documents.
#[test]
fn an_moe_target_trains_from_a_feature_cache_and_its_forward_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (dense, moe, cache) = (tmp.path().join("dense"), tmp.path().join("moe"), tmp.path().join("data-cache"));
    write_target_folder(&dense, rand::rng().random()).unwrap();
    copy_target_folder(&dense, &moe, |config| {
        config["architectures"] = serde_json::json!(["Qwen3MoeForCausalLM"]);
        config["model_type"] = "qwen3_moe".into();
        for (key, value) in [("num_experts", 4), ("num_experts_per_tok", 2), ("moe_intermediate_size", 16)] {
            config[key] = value.into();
        }
    });
    // Its checkpoint as a Qwen3 MoE's: each layer's dense MLP replaced by a router and experts.
    let weights = moe.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &candle_core::Device::Cpu).unwrap();
    tensors.retain(|name, _| !["gate_proj", "up_proj", "down_proj"].iter().any(|p| name.contains(&format!("mlp.{p}"))));
    let random = |shape: &[usize]| candle_core::Tensor::randn(0f32, 0.1, shape, &candle_core::Device::Cpu).unwrap();
    for l in 0..3 {
        tensors.insert(format!("model.layers.{l}.mlp.gate.weight"), random(&[4, 32]));
        for e in 0..4 {
            for (p, shape) in [("gate_proj", [16, 32]), ("up_proj", [16, 32]), ("down_proj", [32, 16])] {
                tensors.insert(format!("model.layers.{l}.mlp.experts.{e}.{p}.weight"), random(&shape));
            }
        }
    }
    candle_core::safetensors::save(&tensors, &weights).unwrap();

    // The dense twin's cache, then the same features under the MoE target's provenance.
    let (features, moe_features) = (tmp.path().join("features"), tmp.path().join("moe-features"));
    write_features(&dense, &cache, &features);
    std::fs::create_dir(&moe_features).unwrap();
    for file in std::fs::read_dir(&features).unwrap().map(|e| e.unwrap().path()) {
        std::fs::copy(&file, moe_features.join(file.file_name().unwrap())).unwrap();
    }
    let index_file = moe_features.join("index.json");
    let mut index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index_file).unwrap()).unwrap();
    let moe_provenance = dflash_data::features::provenance(&moe, &[0, 1], &[0; 32]).unwrap();
    for key in ["target_config", "target_weights"] {
        assert_ne!(index["provenance"][key].as_str(), Some(moe_provenance[key].as_str()));
        index["provenance"][key] = moe_provenance[key].clone().into();
    }
    std::fs::write(&index_file, index.to_string()).unwrap();

    let steps = ["--step", "host", "--steps", "4"];
    let (dense_out, moe_out) = (tmp.path().join("dense-run"), tmp.path().join("moe-run"));
    run_real(&dense, &cache, &dense_out, &[&steps[..], &["--features", features.to_str().unwrap()]].concat());
    let stdout =
        run_real(&moe, &cache, &moe_out, &[&steps[..], &["--features", moe_features.to_str().unwrap()]].concat());
    assert!(stdout.contains("Qwen3MoeForCausalLM"), "{stdout}");
    let losses = loss_values(&moe_out);
    assert!(losses.len() == 4 && losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert_eq!(losses, loss_values(&dense_out), "the MoE target's run against its dense twin's");
    let drafter = moe_out.join("drafter");
    let config = dflash_reference::config::DraftConfig::from_file(&drafter.join("config.json")).unwrap();
    assert_eq!((config.dims.hidden_size, config.dims.intermediate_size, config.target_layer_ids), (32, 48, vec![0, 1]));

    // Whatever would run its forward is refused, naming how to train from it.
    let refused = |args: Vec<String>, needles: &[&str]| {
        let result = Command::new(env!("CARGO_BIN_EXE_xtask")).args(&args).output().unwrap();
        let stderr = text(&result.stderr);
        assert!(!result.status.success(), "{args:?} ran:\n{}", text(&result.stdout));
        for needle in ["Qwen3MoeForCausalLM", "features_transformers.py"].iter().chain(needles) {
            assert!(stderr.contains(needle), "{args:?}: `{needle}` missing from\n{stderr}");
        }
    };
    let out = tmp.path().join("refused");
    refused(real_args(&moe, &cache, &out, &steps), &["option `features`", "training without `--features`"]);
    let tau = [&steps[..], &["--features", moe_features.to_str().unwrap(), "--tau-prompts", "1"]].concat();
    refused(real_args(&moe, &cache, &out, &tau), &["option `tau_prompts`", "the real tau"]);
    assert!(!out.join("metrics.jsonl").exists(), "a refused run began");
    let data = repo("fixtures/data/conversations.jsonl");
    let (moe_dir, data) = (moe.to_str().unwrap(), data.to_str().unwrap());
    let features_args = ["features", "--device", "cpu", "--target", moe_dir, "--data", data, "--out"];
    let features_out = tmp.path().join("refused-features");
    refused(
        [&features_args[..], &[features_out.to_str().unwrap()]].concat().iter().map(|s| s.to_string()).collect(),
        &["`features` without `--export-documents` needs"],
    );
    let eval = ["eval", "--target", moe_dir, "--drafter", drafter.to_str().unwrap(), "--prompts", data];
    refused(eval.iter().map(|s| s.to_string()).collect(), &["`eval` needs"]);
    // `plan --target` shows the offline plan: no forward on the device.
    let plan = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["plan", "--target", moe_dir, "--seq", "64", "--anchors", "8"])
        .output()
        .unwrap();
    let stdout = text(&plan.stdout);
    assert!(plan.status.success(), "{}", text(&plan.stderr));
    assert!(stdout.contains("trains from a feature cache") && stdout.contains("== offline"), "{stdout}");
    let docs = tmp.path().join("moe-docs.jsonl");
    let export = ["features", "--target", moe_dir, "--data", data, "--cache", cache.to_str().unwrap()];
    let result = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(export)
        .args(["--max-len", "256", "--held-out", "0.2", "--export-documents", docs.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(result.status.success(), "{}", text(&result.stderr));
    assert!(std::fs::read_to_string(&docs).unwrap().lines().count() > 1);
}
