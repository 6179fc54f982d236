//! The run config: layering (preset, file, command line), unknown keys, and every validation
//! rule naming its option.

mod common;

use std::path::Path;

use dflash_trainer::config::{RunConfig, FIELDS};
use dflash_trainer::run::check_resume_config;
use dflash_trainer::Error;
use rand::Rng;

fn set(c: &RunConfig, pairs: &[(&str, &str)]) -> Result<RunConfig, Error> {
    c.with_overrides(&pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>())
}

/// Every range rule refuses a bad value with an error naming the option; a random valid value
/// next to it passes (so the rule is not refusing everything).
#[test]
fn each_bad_value_is_refused_naming_its_option() {
    let base = RunConfig::builtin();
    base.validate().expect("the built-in preset is valid");
    let mut rng = rand::rng();
    let cases: &[(&str, &[&str], String)] = &[
        ("lr", &["0", "-1e-3", "NaN", "inf", "-inf"], format!("{}", rng.random_range(1e-5..1e-1))),
        ("temperature", &["-1", "-0.001", "NaN", "inf"], format!("{}", rng.random_range(0.0..2.0))),
        ("warmup_frac", &["1", "1.5", "-0.1", "NaN"], format!("{}", rng.random_range(0.0..0.99))),
        ("clip_norm", &["0", "-1", "inf"], format!("{}", rng.random_range(0.1..10.0))),
        ("beta1", &["1", "-0.5", "NaN"], format!("{}", rng.random_range(0.0..0.99))),
        ("beta2", &["1", "2"], format!("{}", rng.random_range(0.5..0.9999))),
        ("eps", &["0", "-1e-8", "inf"], format!("{}", rng.random_range(1e-12..1e-6))),
        ("weight_decay", &["-0.1", "NaN"], format!("{}", rng.random_range(0.0..0.1))),
        ("gamma", &["0", "-4", "NaN", "inf"], format!("{}", rng.random_range(0.5..10.0))),
        ("epochs", &["0", "NaN", "inf"], format!("{}", rng.random_range(0.1..6.0))),
        ("steps", &["0"], format!("{}", rng.random_range(1..1000))),
        ("rows", &["0"], format!("{}", rng.random_range(1..100))),
        ("rows_per_step", &["0"], format!("{}", rng.random_range(1..8))),
        ("grad_accum", &["0"], format!("{}", rng.random_range(1..4))),
        ("anchors", &["0", "96", "1000"], format!("{}", rng.random_range(1..=95))),
        ("keep_checkpoints", &["0"], format!("{}", rng.random_range(1..5))),
        ("log_every", &["0"], format!("{}", rng.random_range(1..50))),
        ("eval_rows", &["0"], format!("{}", rng.random_range(1..9))),
        ("max_nonfinite_in_a_row", &["0"], format!("{}", rng.random_range(1..9))),
        ("continuation_len", &["1", "0", "2000"], format!("{}", rng.random_range(2..200))),
        ("prompt_len", &["0", "1020"], format!("{}", rng.random_range(1..100))),
    ];
    for (name, bad, good) in cases {
        let flag = name.replace('_', "-");
        // `anchors` must fit the row; the others keep the preset's 96-token rows.
        let good_config = set(&base, &[(&flag, good)]).expect("parses");
        good_config.validate().unwrap_or_else(|e| panic!("--{flag} {good} refused: {e}"));
        for value in *bad {
            let message = match set(&base, &[(&flag, value)]).and_then(|c| c.validate()) {
                Ok(()) => panic!("--{flag} {value} accepted"),
                Err(e) => e.to_string(),
            };
            let named = message.contains(&format!("option `{name}`"))
                || message.contains("option `prompt_len + continuation_len`") && name.ends_with("_len");
            assert!(named, "--{flag} {value}: the error does not name the option: {message}");
        }
    }
}

/// A file's keys override the preset, the command line overrides the file; `steps` and
/// `epochs` replace each other across layers.
#[test]
fn layers_override_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = rand::rng();
    let (file_lr, cli_lr) = (rng.random_range(1e-4..1e-2), rng.random_range(1e-4..1e-2));
    let anchors = rng.random_range(1..40);
    let file = dir.path().join("run.toml");
    std::fs::write(&file, format!("lr = {file_lr:e}\nanchors = {anchors}\nepochs = 2.5\n")).unwrap();
    let from_file = RunConfig::from_file(&RunConfig::builtin(), &file).unwrap();
    assert_eq!(from_file.lr, file_lr);
    assert_eq!(from_file.anchors, anchors);
    assert_eq!((from_file.steps, from_file.epochs), (None, Some(2.5)), "the file's epochs replace the preset's steps");
    assert_eq!(from_file.rows_per_step, RunConfig::builtin().rows_per_step, "unset keys keep the preset");
    let cli = set(&from_file, &[("lr", &format!("{cli_lr}")), ("steps", "7")]).unwrap();
    assert_eq!(cli.lr, cli_lr);
    assert_eq!((cli.steps, cli.epochs), (Some(7), None));
    assert_eq!(cli.anchors, anchors);
    // 2.5 epochs of 64 rows at 4 rows per step.
    assert_eq!(from_file.total_steps(64), 40);
    // The resolved config reads back from its own TOML unchanged.
    let resolved = cli.resolved(8, 64);
    assert_eq!(resolved.gamma, Some(4.0), "gamma of blocks of 8");
    let again = RunConfig::from_toml(&RunConfig::default(), &resolved.to_toml(), Path::new("x.toml")).unwrap();
    assert_eq!(again, resolved);
    assert_eq!(RunConfig::default().resolved(16, 10).gamma, Some(7.0));
    assert_eq!(RunConfig::default().resolved(10, 10).gamma, Some(5.0));
}

/// Unknown keys in a file name the key, the file and the line; on the command line, the option.
#[test]
fn unknown_keys_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("run.toml");
    let line = rand::rng().random_range(1..6);
    let mut text: String = (1..line).map(|i| format!("# comment {i}\n")).collect();
    text.push_str("lrr = 0.1\n");
    std::fs::write(&file, &text).unwrap();
    let message = RunConfig::from_file(&RunConfig::builtin(), &file).unwrap_err().to_string();
    assert!(message.contains("lrr"), "{message}");
    assert!(message.contains(&file.display().to_string()), "{message}");
    assert!(message.contains(&format!("line {line}")), "{message}");
    // A mistyped value, with its line too.
    std::fs::write(&file, "steps = 3\nlr = \"fast\"\n").unwrap();
    let message = RunConfig::from_file(&RunConfig::builtin(), &file).unwrap_err().to_string();
    assert!(message.contains("line 2") && message.contains("lr"), "{message}");
    std::fs::write(&file, "steps = 3\nepochs = 2\n").unwrap();
    let message = RunConfig::from_file(&RunConfig::builtin(), &file).unwrap_err().to_string();
    assert!(message.contains("steps") && message.contains("epochs"), "{message}");
    let message = set(&RunConfig::builtin(), &[("stpes", "3")]).unwrap_err().to_string();
    assert!(message.contains("unknown option `--stpes`"), "{message}");
    let message = set(&RunConfig::builtin(), &[("steps", "-3")]).unwrap_err().to_string();
    assert!(message.contains("option `--steps`: cannot parse `-3`"), "{message}");
    // Every option has a command-line form that parses.
    for (name, kind, _) in FIELDS {
        let value = match kind {
            dflash_trainer::config::Kind::Int => "3",
            dflash_trainer::config::Kind::Float => "0.5",
            dflash_trainer::config::Kind::Text => {
                if *name == "step" {
                    "host"
                } else if *name == "builtin_target" {
                    "gpu"
                } else if *name == "checkpointing" {
                    "per-layer"
                } else {
                    "somewhere"
                }
            }
            dflash_trainer::config::Kind::Bool => "yes",
            dflash_trainer::config::Kind::Ints => "1,2",
            dflash_trainer::config::Kind::Paths => "a.jsonl",
        };
        set(&RunConfig::builtin(), &[(&name.replace('_', "-"), value)]).unwrap_or_else(|e| panic!("--{name}: {e}"));
    }
}

/// `out`: an existing file, or a folder that cannot be created or written, is refused; a
/// fresh folder is created and left empty.
#[test]
fn out_must_be_a_writable_folder() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    for (out, expected) in [(file.clone(), "is not a folder"), (file.join("sub"), "cannot create")] {
        let c = RunConfig { out: out.clone(), ..RunConfig::builtin() };
        let message = c.check_out().unwrap_err().to_string();
        assert!(message.contains("option `out`") && message.contains(expected), "{}: {message}", out.display());
    }
    let fresh = dir.path().join(format!("run-{}", common::fresh_seed()));
    RunConfig { out: fresh.clone(), ..RunConfig::builtin() }.check_out().unwrap();
    assert!(fresh.is_dir());
    assert_eq!(std::fs::read_dir(&fresh).unwrap().count(), 0, "the probe file is removed");
}

/// Resuming with an option that changes the run is an error naming it; extending the steps or
/// changing the logging is allowed.
#[test]
fn resume_refuses_options_that_change_the_run() {
    let saved = RunConfig::builtin().resolved(8, 64);
    let mut rng = rand::rng();
    for (flag, value) in [
        ("lr", format!("{}", rng.random_range(1e-4..2e-3))),
        ("seed", format!("{}", rng.random_range(1..1000))),
        ("anchors", format!("{}", rng.random_range(1..16))),
        ("rows-per-step", "3".to_string()),
        ("temperature", "0.25".to_string()),
        ("step", "host".to_string()),
    ] {
        let now = set(&saved, &[(flag, &value)]).unwrap().resolved(8, 64);
        let message = check_resume_config(&now, &saved).unwrap_err().to_string();
        let key = flag.replace('-', "_");
        assert!(message.contains(&format!("option `{key}`")), "--{flag}: {message}");
    }
    let longer = set(&saved, &[("steps", "900"), ("log-every", "7")]).unwrap().resolved(8, 64);
    let notes = check_resume_config(&longer, &saved).unwrap();
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert!(check_resume_config(&saved, &saved).unwrap().is_empty());
}

/// `gpus` places the workers, target workers first: drafter workers on GPUs of their own (one
/// NCCL rank each), target workers anywhere: beside their drafters or on GPUs of their own.
#[test]
fn gpus_place_target_workers_anywhere_and_drafter_workers_apart() {
    let base =
        set(&RunConfig::builtin(), &[("step", "gpu"), ("target", "/models/qwen3"), ("data", "/data/chats.jsonl")])
            .expect("parses");
    let placed = |gpus: &str, targets: &str, drafters: &str| {
        set(&base, &[("gpus", gpus), ("target-workers", targets), ("drafter-workers", drafters)])
            .and_then(|c| c.validate().map(|()| c.topology()))
    };
    let apart = placed("2,3,0,1", "2", "2").expect("targets on GPUs of their own");
    assert_eq!(apart, (vec![2, 3], vec![0, 1]));
    assert_eq!(placed("0,0", "1", "1").expect("a target beside its drafter"), (vec![0], vec![0]));
    assert_eq!(placed("1,1,0", "2", "1").expect("two targets on one GPU"), (vec![1, 1], vec![0]));
    let refused = placed("0,1,1", "1", "2").expect_err("two drafter workers on GPU 1").to_string();
    assert!(refused.contains("option `gpus`") && refused.contains("two drafter workers on GPU 1"), "{refused}");
}
