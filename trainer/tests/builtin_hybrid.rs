//! The built-in hybrid target (`--builtin-target hybrid`, spec section 10): the reference
//! Qwen3.5-style target samples the rows and gives their features, and the drafter trains on them
//! through the optimized step on the CPU twins.

mod common;

use common::{fresh_seed, run_to_end, setup, tiny_config};
use dflash_trainer::config::{BuiltinTarget, RunConfig, StepKind};

/// A short run on 4 rows of 4 + 12 tokens: the rows carry the features of the hybrid's tapped
/// layers `[S, 3 x 128]`, and the loss of the last 5 steps is below a third of the first steps'
/// (the target's next tokens are peaked: a drafter that learns nothing stays near ln(128) = 4.9
/// per offset).
#[test]
fn the_hybrid_builtin_trains_on_the_host_step() {
    let seed = fresh_seed();
    println!("seed {seed}");
    let dir = tempfile::tempdir().unwrap();
    let c = RunConfig { builtin_target: BuiltinTarget::Hybrid, ..tiny_config(dir.path(), seed, 40) };
    c.validate().expect("valid");
    let s = setup(&c);
    assert_eq!(s.data[0].features.dims(), &[16, 3 * 128]);
    let losses: Vec<f64> = run_to_end(&c, &s, StepKind::Host).into_iter().map(|(_, l)| f64::from_bits(l)).collect();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (first, last) = (mean(&losses[..3]), mean(&losses[losses.len() - 5..]));
    println!("loss {first:.3} (first 3 steps) -> {last:.3} (last 5)");
    assert!(last < first / 3.0, "loss {first:.3} -> {last:.3}: the drafter did not learn");
}
