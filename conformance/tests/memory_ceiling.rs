//! Measured heap peaks of the CPU twin of the fused attention against its planned ceilings,
//! with a counting allocator: never above the plan, and the plan within 10% of the measurement
//! (a dense `[Q, K]` buffer or expanded K/V would blow through both).

use dflash_conformance::attention_cases::AttnCase;
use dflash_conformance::heap::{measure, CountingAllocator};
use dflash_conformance::setups::randn;
use dflash_optimized::memory::attention::{twin_backward_bytes, twin_forward_bytes};
use dflash_optimized::ops::attention::twin::{attention_backward, attention_forward, AttnShape};
use dflash_reference::config::AttnKind;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// The planned ceilings relative to the measured peak: at least 1, at most 1.10.
const PLAN_SLACK: f64 = 1.10;

fn check(case: &AttnCase) {
    let plan = case.ranges().expect("plan");
    let shape = AttnShape { num_heads: case.num_heads, num_kv_heads: case.num_kv_heads, head_dim: case.head_dim };
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
    let flat = |rows: usize, heads: usize, rng: &mut ChaCha8Rng| -> Vec<f32> {
        randn(&[rows, heads, case.head_dim], rng, candle_core::DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let (q, k, v) = (
        flat(plan.num_queries, case.num_heads, &mut rng),
        flat(plan.num_keys, case.num_kv_heads, &mut rng),
        flat(plan.num_keys, case.num_kv_heads, &mut rng),
    );
    let dout = flat(plan.num_queries, case.num_heads, &mut rng);
    let scale = (case.head_dim as f64).powf(-0.5);

    let ((out, lse), fwd_peak) = measure(|| attention_forward(&plan, shape, &q, &k, &v, scale).unwrap());
    let fwd_plan = twin_forward_bytes(&plan, shape, 4);
    let (_, bwd_peak) = measure(|| attention_backward(&plan, shape, &q, &k, &v, &out, &lse, &dout, scale).unwrap());
    let bwd_plan = twin_backward_bytes(&plan, shape, 4);
    for (what, peak, planned) in [("forward", fwd_peak, fwd_plan), ("backward", bwd_peak, bwd_plan)] {
        println!("{} {what}: measured {peak} bytes, planned {planned}", case.name);
        assert!(peak <= planned, "{} {what}: measured {peak} bytes above the plan {planned}", case.name);
        assert!(
            planned as f64 <= PLAN_SLACK * peak as f64,
            "{} {what}: plan {planned} more than {PLAN_SLACK}x the measured {peak}",
            case.name
        );
    }
}

/// DFlash full and sliding layers, and causal attention: peaks within the plans.
#[test]
fn cpu_twin_peaks_stay_under_the_plan() {
    for case in [
        AttnCase::dflash("dflash-full", AttnKind::Full, 1500, 24, (8, 2), 64),
        AttnCase::dflash("dflash-sliding", AttnKind::Sliding { window: 300 }, 1500, 24, (8, 2), 64),
        AttnCase::causal("causal", AttnKind::Full, 700, (4, 2), 32),
    ] {
        check(&case);
    }
}
