//! The memory planner: snapshots of the itemised plans of the named configs, and properties
//! that hold for any config (items add up to the peak, checkpointing never raises the saved
//! activations, the failure modes reproduce the spec's figure).

use dflash_optimized::planner::{check_fits, failure_modes, named_plans, plan_step, step_buffers, Policy, StepShape};

/// One H200's usable memory, 139.8 GiB (shared/GPU.md).
fn device_bytes() -> u64 {
    (139.8 * (1u64 << 30) as f64) as u64
}

/// The rendered plans of issue 4's named configs, per policy, with the failure modes.
#[test]
fn named_plans_snapshot() {
    let mut out = String::new();
    for p in named_plans() {
        out.push_str(&format!("== {}\n", p.name));
        for policy in Policy::ALL {
            out.push_str(&format!("-- {}\n", policy.name()));
            out.push_str(&plan_step(&p.config, p.shape, policy).render(device_bytes()));
        }
        let fm = failure_modes(&p.config, p.shape, 256);
        out.push_str(&format!(
            "-- failure modes: unfused attention one layer {} bytes; chunked attention all layers {} bytes\n",
            fm.unfused_attention_one_layer, fm.chunked_attention_all_layers
        ));
    }
    insta::assert_snapshot!(out);
}

/// The peak is the sum of the items; the peak without optimizer drops exactly the fp32 master
/// copy and both AdamW moments; more checkpointing never saves more activations.
#[test]
fn plan_items_add_up_and_policies_order() {
    for p in named_plans() {
        let plans: Vec<_> = Policy::ALL.iter().map(|&policy| plan_step(&p.config, p.shape, policy)).collect();
        for plan in &plans {
            let sum: u64 = plan.persistent.iter().chain(&plan.saved).chain(&plan.transient).map(|i| i.bytes).sum();
            assert_eq!(sum, plan.peak, "{}", p.name);
            let optimizer: u64 = plan
                .persistent
                .iter()
                .filter(|i| ["master", "AdamW", "accumulated"].iter().any(|p| i.name.starts_with(p)))
                .map(|i| i.bytes)
                .sum();
            assert_eq!(plan.peak - optimizer, plan.peak_without_optimizer, "{}", p.name);
        }
        let saved = |i: usize| plans[i].saved.iter().map(|x| x.bytes).sum::<u64>();
        assert!(saved(0) > saved(1) && saved(1) > saved(2), "{}: saved bytes must fall with checkpointing", p.name);
    }
}

/// Spec section 5, item 7: chunked attention whose autograd graph keeps every chunk's expanded
/// K/V needs about 128 GB at seq 8000 with 1024 anchors (Qwen3-8B drafter, 256-row chunks).
#[test]
fn chunked_attention_failure_mode_matches_the_spec_figure() {
    let qwen = named_plans().into_iter().next().expect("named plans").config;
    let shape = StepShape { context_len: 8000, num_anchors: 1024, lm_chunk_rows: 1024 };
    let gb = failure_modes(&qwen, shape, 256).chunked_attention_all_layers as f64 / 1e9;
    assert!((gb - 128.0).abs() / 128.0 < 0.05, "chunked attention peak {gb:.1} GB, the spec says about 128 GB");
}

/// A step that does not fit is refused with an error naming what it needs, the device, what is
/// available and its largest buffers; one that fits passes. The GPU step calls this before it
/// allocates anything.
#[test]
fn a_step_that_cannot_fit_is_refused_naming_its_largest_buffers() {
    let p = named_plans().into_iter().next().expect("named plans");
    let buffers = step_buffers(&p.config, p.shape, Policy::None, true);
    let peak = plan_step(&p.config, p.shape, Policy::None).peak;
    assert!(check_fits(&buffers, peak, "GPU 0").is_ok(), "exactly the plan fits");
    let err = check_fits(&buffers, peak - 1, "GPU 0").expect_err("one byte short must be refused");
    for needle in ["needs 27.", "GPU 0", "available", "adam_m", "master"] {
        assert!(err.contains(needle), "`{needle}` missing from: {err}");
    }
}

/// The scratch region's layout: every buffer of a phase inside the region, 256-byte aligned and
/// disjoint from the other buffers of its phase (the two phases never run at the same time).
#[test]
fn scratch_buffers_are_aligned_disjoint_and_inside_the_region() {
    use dflash_optimized::planner::{Lifetime, SCRATCH};
    for p in named_plans() {
        for policy in Policy::ALL {
            let buffers = step_buffers(&p.config, p.shape, policy, false);
            let region = buffers.iter().find(|b| b.key == SCRATCH).expect("a scratch region").bytes;
            for phase in [Lifetime::Layer, Lifetime::Head] {
                let mut spans: Vec<(u64, u64, &str)> = buffers
                    .iter()
                    .filter(|b| b.lifetime == phase)
                    .map(|b| {
                        let offset = b.scratch_offset.expect("scratch buffers have an offset");
                        (offset, offset + b.bytes, b.key.as_str())
                    })
                    .collect();
                assert!(!spans.is_empty(), "{} {policy:?}: no {phase:?} buffers", p.name);
                spans.sort();
                for (lo, hi, key) in &spans {
                    assert!(lo % 256 == 0 && *hi <= region, "{} {policy:?}: {key} at {lo}..{hi} of {region}", p.name);
                }
                for w in spans.windows(2) {
                    assert!(w[0].1 <= w[1].0, "{} {policy:?}: {} overlaps {}", p.name, w[0].2, w[1].2);
                }
            }
            for b in buffers.iter().filter(|b| !matches!(b.lifetime, Lifetime::Layer | Lifetime::Head)) {
                assert!(b.scratch_offset.is_none(), "{}: {} is outside the scratch region", p.name, b.key);
            }
        }
    }
}
