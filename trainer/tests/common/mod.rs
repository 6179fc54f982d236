//! Shared by the trainer's tests: a tiny run config and its built-in setup.
#![allow(dead_code)]

use std::path::Path;

use dflash_trainer::builtin::{self, BuiltinSetup};
use dflash_trainer::config::{RunConfig, StepKind};
use dflash_trainer::engine::CpuEngine;
use dflash_trainer::metrics;
use dflash_trainer::run::{RunInputs, Trainer};
use rand::Rng;

/// A fresh random seed (printed by the tests that use it, to reproduce a failure).
pub fn fresh_seed() -> u64 {
    rand::rng().random_range(0..1u64 << 40)
}

/// A run small enough to take well under a second per step: 4 rows of 4 + 12 tokens.
pub fn tiny_config(out: &Path, seed: u64, steps: usize) -> RunConfig {
    let c = RunConfig {
        steps: Some(steps),
        epochs: None,
        rows_per_step: 2,
        anchors: 3,
        seed,
        out: out.to_path_buf(),
        checkpoint_every: 0,
        keep_checkpoints: 3,
        log_every: 1,
        eval_every: 0,
        eval_rows: 1,
        tau_prompts: 1,
        tau_tokens: 4,
        rows: 4,
        prompt_len: 4,
        continuation_len: 12,
        ..RunConfig::builtin()
    };
    c.validate().expect("the tiny config is valid");
    c.resolved(builtin::draft_config(&c).block_size, c.rows)
}

pub fn setup(c: &RunConfig) -> BuiltinSetup {
    builtin::setup(c).expect("built-in setup")
}

pub fn engine(c: &RunConfig, s: &BuiltinSetup, kind: StepKind) -> CpuEngine {
    let drafter = builtin::init_drafter(c, &s.draft_config).expect("drafter");
    CpuEngine::new(drafter, s.target.frozen_head(), builtin::adamw_config(c), kind).expect("engine")
}

pub fn inputs<'a>(c: &'a RunConfig, s: &'a BuiltinSetup) -> RunInputs<'a> {
    RunInputs {
        config: c,
        draft_config: &s.draft_config,
        data: &s.data,
        held_out: &s.held_out,
        tau: None,
        quiet: true,
        devices: 0,
        read_ahead: false,
        processes: c.world_size.unwrap_or(1),
    }
}

/// A whole run of `c` from scratch; returns the trainer's losses by step from metrics.jsonl.
pub fn run_to_end(c: &RunConfig, s: &BuiltinSetup, kind: StepKind) -> Vec<(u64, u64)> {
    std::fs::create_dir_all(&c.out).unwrap();
    let mut e = engine(c, s, kind);
    let mut t = Trainer::new(inputs(c, s)).expect("trainer");
    t.run(&mut e).expect("run");
    losses(&c.out)
}

/// `(step, loss bits)` of the train lines of `out/metrics.jsonl`, exactly as written.
pub fn losses(out: &Path) -> Vec<(u64, u64)> {
    metrics::train_losses(&metrics::metrics_file(out)).unwrap().into_iter().map(|(s, l)| (s, l.to_bits())).collect()
}
