//! The target's forward on the CPU twins (`TargetForward<Host<_>>`, the GPU path's driver,
//! layout and ops) against the reference target, document by document: the Qwen3 and Llama
//! fixtures and the random targets the H200 runs (`xtask gpu-conformance`), in f64 and f32.

use dflash_conformance::target_cases::{fixture_target_cases, random_target_cases, target_check, TargetCase};
use dflash_conformance::tolerance::{Tolerance, EXACT, STEP_F32, STEP_F64};
use dflash_optimized::backend::host::Host;

/// Each case on `Host<f64>` (and `Host<f32>` when `with_f32`) against the reference.
fn check_all(cases: &[TargetCase], with_f32: bool) {
    for case in cases {
        let mut runs: Vec<(&str, Tolerance, Box<dyn Fn() -> _>)> =
            vec![("f64", STEP_F64, Box::new(|| target_check(case, || Ok(Host::<f64>::default()), STEP_F64, None)))];
        if with_f32 {
            runs.push((
                "f32",
                STEP_F32,
                Box::new(|| target_check(case, || Ok(Host::<f32>::default()), STEP_F32, None)),
            ));
        }
        for (dtype, tol, run) in runs {
            let check = run().unwrap_or_else(|e| panic!("{} {dtype}: {e}", case.name));
            println!("{} {dtype}: {:?}", check.name, check.errors);
            assert!(
                check.errors[0].1 <= tol.rel,
                "{} {dtype}: features {:?} above {:.0e}",
                check.name,
                check.errors,
                tol.rel
            );
            // On the CPU a document alone is the same arithmetic as in the packed launch.
            assert!(check.errors[1].1 <= EXACT.rel, "{} {dtype}: packed vs alone {:?}", check.name, check.errors);
        }
    }
}

/// The fixtures (f32 and bf16 checkpoints, tied and untied, q/k norms or none), one packed row of
/// three documents and padding and one single-document row in one launch.
#[test]
fn fixture_targets_match_the_reference() {
    check_all(&fixture_target_cases(11).expect("fixture cases"), true);
}

/// The random targets of the GPU conformance run (f64 only: the CI's time; f32 is the fixtures'): head dims 64 and 128, GQA, yarn and llama3
/// RoPE, a sliding layer, documents of lengths no multiple of a tile.
#[test]
fn random_targets_match_the_reference() {
    check_all(&random_target_cases(3, candle_core::DType::F64).expect("random cases"), false);
}
